"""StagedModels: a pipeline's models, only the current stage's in memory, kept by the Rust
registry.

The registry holds the Python modules themselves. A release frees their parameter and buffer
storages in place (the memory goes back to the OS while the pipeline still holds the modules);
a model with a checkpoint comes back into the same module objects, refilled from safetensors,
with no rebuild and no random draw. Everything else (building, rebuilding, prefetching, the host
tier, snapshots, the memory meter) is the core's, as in the Rust API.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any

from . import _native
from .events import Event, EventSink
from .meter import MemoryMeter
from .release import guard, is_freed, unguard
from .rng import PythonGenerators

if TYPE_CHECKING:
    from torch import nn

Loader = Callable[[], "nn.Module"]
_NO_DEFAULT = object()


def _collect_file_maps() -> None:
    """Runs Python's collector (see :meth:`StagedModels._collect_if_due`)."""
    gc.collect()


def _still_mapped(paths: Iterable[str]) -> bool:
    """Whether one of ``paths`` is mapped into this process (``/proc/self/maps``; where it cannot
    be read, assumed so)."""
    try:
        with open("/proc/self/maps") as maps_file:
            maps = maps_file.read()
    except OSError:
        return True
    return any(path in maps for path in paths)


# One Python loader runs at a time in the process. The core lets a prefetch's build run its loader
# beside a foreground build, which suits loaders that touch nothing process-wide; from_pretrained
# does (accelerate's init_empty_weights patches nn.Module.register_parameter for the whole process
# while diffusers builds on meta), and a text encoder built beside a UNet's prefetch came back with
# all 196 weights on meta. Reentrant: a loader may ask the registry for another model.
_LOADERS = threading.RLock()


def _one_at_a_time(loader: Loader) -> Loader:
    def run() -> nn.Module:
        with _LOADERS:  # waits with the GIL released
            return loader()

    return run


# The live registries, for the exit: Python's interpreter, finalizing, stops a thread that wants
# the GIL back where it stands, and one of a prefetch's inside a torch call aborts the process
# ("terminate called without an active exception"). Their prefetches end before it finalizes.
# (By id: a mapping is not hashable.)
_LIVE: weakref.WeakValueDictionary[int, StagedModels] = weakref.WeakValueDictionary()


@atexit.register
def _stop_prefetches_at_exit() -> None:
    for models in list(_LIVE.values()):
        models._registry.stop_prefetches()


def _names_known(what: str, names: Iterable[str], known: Mapping[str, Any]) -> None:
    unknown = sorted(set(names) - known.keys())
    if unknown:
        raise KeyError(f"{what} name models that have no loader: {unknown}")


class StagedModels(MutableMapping[str, "nn.Module"]):
    """Holds a pipeline's models; only the models the current stage needs stay in memory.

    ``models[name]`` loads a model the first time it is asked for. ``enter(stage)`` releases
    every loaded model that the stage does not list and that is not pinned. Membership tests,
    ``len`` and iteration over names never load anything, and ``values()``/``items()`` only
    yield models that are loaded right now. With ``preserve_rng`` (the default) a build leaves
    torch's CPU, CUDA and MPS generators, Python's ``random`` and NumPy's global generator where
    they were, so a model built in the middle of a seeded run does not change its noise.

    ``models[name] = module`` stores a module that has no loader: once released, it stays gone.
    ``del models[name]`` and ``clear()`` release without loading anything. ``pop`` and
    ``popitem`` hand a model over: loaded first if it was not, and forgotten without a release.

    What the Rust core adds, as keywords:

    - ``checkpoints={name: [files]}``: the model's safetensors files (its state-dict names). They
      fill the model after its build, and a released model comes back from them in place: the
      same module and ``Parameter`` objects, no loader call, nothing drawn. A file changed since
      the model's first load is refused (:class:`~stageload_rs.SourceChangedError`).
    - ``loader_reads_checkpoint=[names]``: those loaders read their checkpoint themselves (as
      ``from_pretrained`` does): it is checked against the model, not copied again.
    - ``skip_init=[names]``: those models are built without initial values (torch's random
      fills are skipped while their loader runs); every weight comes from the checkpoint.
    - ``reload_mapped=[names]``: those models come back from a release on their checkpoint files'
      pages (a private mapping, as ``from_pretrained`` holds weights), and with ``skip_init`` are
      on them from their first load (what the build allocated is freed): nothing is allocated or
      copied, and a CPU weight that is one entry of the file in its dtype is the page cache's
      pages (the others are copied). While such a model is resident its files are checked each
      time it is handed out: one written in place releases it and raises
      :class:`~stageload_rs.ChangedUnderModelError` (a truncated file under a running model ends
      the process with SIGBUS, as under ``from_pretrained``).
    - ``prefetch=True``: entering a stage starts loading the next stage's models in the
      background (only loads that draw no random number: refills, and builds of the two above).
    - ``host_tier=bytes``: released models keep a copy in host memory within that budget and come
      back from it (for models on a GPU).
    - ``snapshots=folder``: a model with no checkpoint is written there at its first release and
      comes back from that file, not from its loader.
    - ``strict=True``: asking for a model outside a stage that lists it is an error.
    - ``map_large_host_blocks=True`` and ``cache_host_blocks=True``: the Rust core's process-wide
      allocator settings (glibc's mmap threshold fixed at 1 MiB, so freed blocks go back to the OS
      at once; and a cache of freed blocks of 1 MiB or more for the next request of their size
      within a stage). Both off by default here, where Python's allocator is as torch leaves it:
      on Stable Diffusion 1.5 the threshold alone made every step fault its activations in again
      (denoise 1.18x the original stageload's time) and the cache held a stage's freed
      activations to its end (stage peaks 0.2-0.3 GiB above the original's).
    - ``events=MemoryMeter(path)``: the trace in the project's schema (``stageload summary``,
      ``plot`` and ``plan --from-trace`` read it); any other sink gets :class:`Event` objects.
    """

    def __init__(
        self,
        loaders: Mapping[str, Loader],
        *,
        stages: Mapping[str, Iterable[str]],
        pinned: Iterable[str] = (),
        events: EventSink | None = None,
        preserve_rng: bool = True,
        checkpoints: Mapping[str, Sequence[str | os.PathLike[str]]] | None = None,
        loader_reads_checkpoint: Iterable[str] = (),
        skip_init: Iterable[str] = (),
        reload_mapped: Iterable[str] = (),
        prefetch: bool = False,
        host_tier: int | None = None,
        snapshots: str | os.PathLike[str] | None = None,
        strict: bool = False,
        cache_host_blocks: bool = False,
        map_large_host_blocks: bool = False,
    ) -> None:
        stages = {stage: list(names) for stage, names in stages.items()}
        pinned = list(pinned)
        checkpoints = {
            name: [os.fspath(f) for f in files] for name, files in (checkpoints or {}).items()
        }
        reads, skips, mapped = set(loader_reads_checkpoint), set(skip_init), set(reload_mapped)
        _names_known("stages", (n for names in stages.values() for n in names), loaders)
        _names_known("pinned models", pinned, loaders)
        _names_known("checkpoints", checkpoints, loaders)
        _names_known("loader_reads_checkpoint", reads, loaders)
        _names_known("skip_init", skips, loaders)
        _names_known("reload_mapped", mapped, loaders)
        for name in sorted(mapped - checkpoints.keys()):
            raise ValueError(f"model {name!r} maps its checkpoint on reload: give it checkpoints=")
        for name in sorted((reads | skips) - checkpoints.keys()):
            raise ValueError(f"model {name!r} is built without its weights: give it checkpoints=")
        for name in sorted(reads & skips):
            raise ValueError(f"model {name!r} is in both loader_reads_checkpoint and skip_init")
        for name, files in checkpoints.items():
            for file in files:
                if not os.path.isfile(file):
                    raise FileNotFoundError(f"checkpoint of model {name!r}: no file {file}")
        for name, loader in loaders.items():
            if not callable(loader):
                raise TypeError(
                    f"the loader of model {name!r} is a {type(loader).__name__}, not a callable"
                )

        def init(name: str) -> str:
            return "reads" if name in reads else "skip" if name in skips else "loader"

        self._events = events
        # every module object handed out or given, by model: the one a release guards
        self._modules: dict[str, nn.Module] = {}
        # the stage each model was last released at, for its guard's message
        self._released_at: dict[str, str | None] = {}
        # the resident models whose weights their loader made (not refilled by the registry), and
        # those released since the last look (see _collect_if_due)
        self._from_loader: set[str] = set()
        self._released_from_loader: set[str] = set()
        self._files = {
            name: [os.path.realpath(f) for f in files] for name, files in checkpoints.items()
        }
        meter = events.native() if isinstance(events, MemoryMeter) else None
        # the registry calls back through a weak reference: a strong one would be a cycle through
        # the Rust object, which Python's collector cannot see, and the models would never go
        me = weakref.ref(self)

        def on_event(line: str) -> None:
            staged = me()
            if staged is not None:
                staged._on_event(line)

        self._registry = _native.Registry(
            [
                (
                    name,
                    _one_at_a_time(loader),
                    checkpoints.get(name, []),
                    init(name),
                    "map" if name in mapped else "copy",
                )
                for name, loader in loaders.items()
            ],
            list(stages.items()),
            pinned=pinned,
            preserve_rng=preserve_rng,
            generators=PythonGenerators() if preserve_rng else None,
            events=on_event,
            meter=meter,
            prefetch=prefetch,
            host_tier=host_tier,
            snapshots=os.fspath(snapshots) if snapshots is not None else None,
            strict=strict,
            cache_host_blocks=cache_host_blocks,
            map_large_host_blocks=map_large_host_blocks,
        )
        _LIVE[id(self)] = self

    def _on_event(self, line: str) -> None:
        """The registry's events (called from the thread that did the work): a module released
        or brought back is guarded or unguarded; then the user's sink hears of it."""
        event = Event.from_line(line)
        if event.kind == "load" and event.name is not None:
            self._from_loader.add(event.name)
        elif event.kind == "reload" and event.name is not None:
            self._from_loader.discard(event.name)
        elif event.kind == "release" and event.name is not None:
            self._released_at[event.name] = event.stage
            if event.name in self._from_loader:
                self._from_loader.discard(event.name)
                self._released_from_loader.add(event.name)
        if event.kind in ("release", "load", "reload") and event.name is not None:
            self._settle(event.name)
        if self._events is not None and not isinstance(self._events, MemoryMeter):
            self._events.emit(event)

    def _settle(self, name: str) -> None:
        """Guards the module handed out as ``name`` while its weights are freed, and only then:
        read from its storages when an event or a get comes, so an event told late (a
        prefetch's, from its thread) cannot leave it wrong."""
        module = self._modules.get(name)
        if module is None:
            return
        if is_freed(module):
            guard(module, name, self._released_at.get(name))
        else:
            unguard(module)

    def __getitem__(self, name: str) -> nn.Module:
        module = self._registry.get(name)
        old = self._modules.get(name)
        self._modules[name] = module
        if old is not None and old is not module:
            guard(old, name, self._released_at.get(name))  # rebuilt: the old object stays released
        self._settle(name)
        return module

    def __setitem__(self, name: str, module: nn.Module) -> None:
        if self._modules.get(name) is module and self._registry.state(name) == "resident":
            return
        self._registry.insert(name, module)
        self._modules[name] = module

    def __delitem__(self, name: str) -> None:
        self._registry.remove(name)
        self._modules.pop(name, None)

    def pop(self, name: str, default: Any = _NO_DEFAULT) -> Any:
        if name not in self._registry:
            if default is _NO_DEFAULT:
                raise KeyError(name)
            return default
        module = self._registry.take(name)
        self._modules.pop(name, None)
        return module

    def popitem(self) -> tuple[str, nn.Module]:
        names = self._registry.names()
        if not names:
            raise KeyError("popitem(): no models")
        return names[-1], self.pop(names[-1])

    def clear(self) -> None:
        self.close()
        for name in self._registry.names():
            del self[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._registry.names())

    def __len__(self) -> int:
        return len(self._registry)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._registry

    def loaded(self) -> list[str]:
        """The models holding their weights now (never loads)."""
        return self._registry.resident()

    def values(self) -> list[nn.Module]:  # type: ignore[override]
        return [self[name] for name in self.loaded()]

    def items(self) -> list[tuple[str, nn.Module]]:  # type: ignore[override]
        return [(name, self[name]) for name in self.loaded()]

    @property
    def current_stage(self) -> str | None:
        return self._registry.current_stage()

    def enter(self, stage: str) -> None:
        """Enters ``stage``: releases every loaded model it does not list and that is not pinned
        (and, with ``prefetch``, starts loading the next stage's)."""
        self._registry.enter(stage)
        self._collect_if_due()

    def pin(self, name: str) -> None:
        self._registry.pin(name)

    def unpin(self, name: str) -> None:
        self._registry.unpin(name)

    def close(self) -> None:
        """Releases every loaded model, pinned ones too; the registry loads nothing after."""
        self._registry.close()
        self._collect_if_due()

    def _collect_if_due(self) -> None:
        """Runs Python's collector after a release of weights a loader made while their files
        are still mapped (or, for a model without files, always, as the original stageload does
        after every release). A module ``from_pretrained`` loaded has tensors on its safetensors
        files' mappings, which objects in reference cycles can hold after the storages are
        freed (0.27 GiB of Stable Diffusion 1.5's text encoder once stayed mapped so; with
        transformers 5 and diffusers 0.42 none does). Weights the registry refilled are on its
        own memory or mappings, which no Python object holds. A collection takes 0.22 s in a
        process running Stable Diffusion from diffusers; reading the maps, about a millisecond."""
        released, self._released_from_loader = self._released_from_loader, set()
        if not released:
            return
        if any(not self._files.get(name) for name in released) or _still_mapped(
            f for name in released for f in self._files[name]
        ):
            _collect_file_maps()

    def load(self, name: str) -> None:
        """Loads (or brings back) ``name`` now, without handing it out."""
        self._registry.load(name)

    def prefetch(self, stage: str) -> list[str]:
        """Starts loading ``stage``'s models in the background; returns those started."""
        return self._registry.prefetch(stage)

    def wait_prefetch(self, stage: str) -> None:
        """Waits until every prefetch started for ``stage`` has ended (loaded or failed)."""
        self._registry.wait_prefetch(stage)

    def prefetching(self) -> list[str]:
        """The models being loaded in the background now."""
        return self._registry.prefetching()

    def stage_models(self, stage: str) -> list[str]:
        """The models ``stage`` lists."""
        return self._registry.stage_models(stage)

    def states(self) -> dict[str, str]:
        """Each model's state: unloaded, loading, resident, release_pending, released, failed."""
        return dict(self._registry.states())

    def mark(self, label: str) -> None:
        """A ``mark`` event with ``label`` (a line in the trace)."""
        self._registry.mark(label)

    def accept_changed_files(self, name: str) -> None:
        """Takes ``name``'s changed checkpoint files as they are now, at its next load."""
        self._registry.accept_changed_files(name)

    def resident_bytes(self) -> int:
        """Bytes of the distinct storages of every model holding weights."""
        return self._registry.resident_bytes()

    def host_tier(self) -> tuple[int, int] | None:
        """The host tier's budget and the bytes its copies hold (``None``: no tier)."""
        return self._registry.host_tier()

    def set_host_tier_budget(self, nbytes: int) -> None:
        """Sets the host tier's budget now (shrinking evicts the least recently used copies)."""
        self._registry.set_host_tier_budget(nbytes)

    def load_report(self, name: str) -> dict[str, Any] | None:
        """How the last load of ``name`` met its checkpoint (used, converted, unused, ignored and
        missing names); ``None`` before a load from one."""
        report = self._registry.load_report(name)
        return json.loads(report) if report is not None else None
