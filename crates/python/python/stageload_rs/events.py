"""What the registry tells: one event per load, reload, release, stage entry and mark (and the
Rust core's other kinds: prefetch, error, tier, snapshot, residency)."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class Event:
    """One event, with the original's fields (``name`` is the model, ``nbytes`` its bytes)
    and, in ``fields``, everything else the trace line says (``prefetched``, ``from``,
    ``report``, ``resident``, ...)."""

    kind: str
    name: str | None = None
    stage: str | None = None
    nbytes: int | None = None
    seconds: float | None = None
    note: str | None = None
    t: float = field(default_factory=time.monotonic)
    fields: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_line(cls, line: str) -> Event:
        """The event a trace line (the Rust core's JSON) describes."""
        record = json.loads(line)
        record.pop("t", None)
        record.pop("start", None)
        kind = record.pop("kind")
        name = record.pop("model", None)
        stage = record.pop("stage", None)
        nbytes = record.pop("bytes", None)
        seconds = record.pop("seconds", None)
        note = record.pop("note", None)
        if record.get("outside_stage"):
            note = "outside_stage"
        return cls(kind, name, stage, nbytes, seconds, note, fields=record)

    def as_dict(self) -> dict[str, Any]:
        return {key: value for key, value in asdict(self).items() if value not in (None, {})}

    def line(self) -> str:
        """The event as a trace line (the project's schema; ``t`` is the meter's to set)."""
        record: dict[str, Any] = {"t": 0.0, "kind": self.kind, **self.fields}
        for key, value in (
            ("model", self.name),
            ("stage", self.stage),
            ("bytes", self.nbytes),
            ("seconds", self.seconds),
            ("note", self.note),
        ):
            if value is not None:
                record[key] = value
        return json.dumps(record)


class EventSink(Protocol):
    def emit(self, event: Event) -> None: ...


class ListSink:
    """Keeps events in a list, for tests and quick summaries."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def emit(self, event: Event) -> None:
        self.events.append(event)

    def of_kind(self, kind: str) -> list[Event]:
        return [event for event in self.events if event.kind == kind]
