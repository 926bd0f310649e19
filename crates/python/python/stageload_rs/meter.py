"""The process's memory sampled into a trace in the project's schema (the one ``stageload
summary``, ``stageload plot`` and ``stageload plan --from-trace`` read), with the events."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from . import _native
from .errors import StageError
from .events import Event


class MemoryMeter:
    """Writes this process's memory (RSS, its peak, swap, the machine's available memory; CUDA's
    allocator on ``device="cuda:N"``) to a JSONL trace every ``interval`` seconds, with every
    event given it. Use it as a context manager; pass it as ``StagedModels(events=meter)`` and the
    registry writes its events there directly. Lines are flushed as written: the trace survives a
    kill."""

    def __init__(
        self,
        path: str | Path,
        *,
        interval: float = 0.5,
        meta: dict[str, Any] | None = None,
        device: str = "cpu",
    ) -> None:
        self.path = Path(path)
        self.interval = interval
        self.meta = meta or {}
        self.device = device
        self._native: _native.Meter | None = None

    def __enter__(self) -> MemoryMeter:  # noqa: PYI034 (Self is Python 3.11+)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._native = _native.Meter(
            str(self.path), interval=self.interval, device=self.device, meta=json.dumps(self.meta)
        )
        return self

    def __exit__(self, *exc: object) -> None:
        self.native().finish()

    def native(self) -> _native.Meter:
        if self._native is None:
            raise StageError(
                f"MemoryMeter({str(self.path)!r}) is not running: use it in a with block"
            )
        return self._native

    def emit(self, event: Event) -> None:
        self.native().emit_line(event.line())

    def mark(self, label: str) -> None:
        self.native().mark(label)

    def sample(self) -> None:
        self.native().sample()

    def summary(self) -> dict[str, Any]:
        """What ``stageload summary`` says of the trace so far: per stage peak and time, loads,
        releases."""
        return json.loads(_native.summarize_trace(str(self.path)))
