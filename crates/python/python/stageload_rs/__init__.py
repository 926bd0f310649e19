"""Run a multi-model PyTorch pipeline with only the current stage's weights in memory: the API
of the Python ``stageload`` (``import stageload_rs as stageload``) over stageload's Rust core,
which frees and refills the modules' storages in place."""

# torch first, and the version it must be: the native module uses the libtorch torch has loaded
# (by soname: it carries no path to it) and shares its tensors in place, so it runs only with the
# torch it was built against (the wheel's own requirement says which).
import importlib.metadata as _metadata

import torch as _torch


def _built_for() -> str:
    requires = _metadata.requires("stageload-rs") or []
    pins = [
        r.split("==", 1)[1].strip() for r in requires if r.replace(" ", "").startswith("torch==")
    ]
    if not pins:
        raise ImportError(
            "stageload_rs: its package metadata names no torch==VERSION; reinstall it"
        )
    return pins[0]


_BUILT_FOR = _built_for()
if _torch.__version__.split("+", 1)[0] != _BUILT_FOR:
    raise ImportError(
        f"stageload_rs was built for torch {_BUILT_FOR}, and this is torch {_torch.__version__}: "
        f"install torch=={_BUILT_FOR}, or rebuild stageload_rs against this torch"
    )

from .errors import (
    ChangedUnderModelError,
    LoaderError,
    ReleasedModuleError,
    SourceChangedError,
    StageError,
)
from .events import Event, EventSink, ListSink
from .hooks import on_call
from .meter import MemoryMeter
from .registry import StagedModels
from .release import ReleaseStats, release
from .share import share

__version__ = _metadata.version("stageload-rs")

__all__ = [
    "ChangedUnderModelError",
    "Event",
    "EventSink",
    "ListSink",
    "LoaderError",
    "MemoryMeter",
    "ReleaseStats",
    "ReleasedModuleError",
    "SourceChangedError",
    "StageError",
    "StagedModels",
    "on_call",
    "release",
    "share",
]
