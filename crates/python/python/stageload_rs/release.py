"""Free a module's weights in place, and make a released module say so when it is called."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import _native
from .errors import ReleasedModuleError

if TYPE_CHECKING:
    from torch import nn

# the hooks a released module carries, kept on the module object itself
_GUARD = "_stageload_rs_released"


@dataclass(frozen=True)
class ReleaseStats:
    """What a release did: bytes of storage freed, and bytes left alone because a module in
    ``keep`` (or another resident model) shares them."""

    nbytes: int
    kept: int


def weights(module: nn.Module) -> list[tuple[str, Any]]:
    """What the registry releases and refills of ``module``: its parameters and persistent
    buffers under their state-dict names, each tensor once (a tied weight under its first name).
    Non-persistent buffers are computed by the module, not weights: no checkpoint has them, so
    they stay as the module made them."""
    buffers = []
    for name, buffer in module.named_buffers():
        owner, _, attr = name.rpartition(".")
        if attr not in module.get_submodule(owner)._non_persistent_buffers_set:
            buffers.append((name, buffer))
    return [*module.named_parameters(), *buffers]


def _holds_freed(module: nn.Module) -> bool:
    """Whether a tensor of ``module``'s own (not its submodules') has lost its storage."""
    own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    return any(t.numel() > 0 and t.untyped_storage().nbytes() == 0 for t in own)


def is_freed(module: nn.Module) -> bool:
    """Whether any weight of ``module`` (or of its submodules) has lost its storage."""
    return any(_holds_freed(sub) for sub in module.modules())


def guard(module: nn.Module, name: str | None, stage: str | None) -> None:
    """Makes calling ``module``, or a submodule of it whose own weights were freed, raise
    :class:`ReleasedModuleError` naming ``name`` and ``stage`` before torch would touch a freed
    storage. A submodule whose weights were kept (shared with a model still resident) keeps
    working; a module of which nothing was freed is left as it is."""
    if getattr(module, _GUARD, None) is not None:
        return
    freed = [sub for sub in module.modules() if _holds_freed(sub)]
    if not freed:
        return
    if not any(sub is module for sub in freed):
        freed.insert(0, module)

    # the hooks go when the weights come back; a call already running its hooks when that
    # happens (a stage hook before this one brought them back) finds the guard down
    guard = _Guard([])

    def refuse(_module: Any, _args: Any) -> None:
        if guard.up:
            raise ReleasedModuleError(name, stage)

    guard.handles.extend(sub.register_forward_pre_hook(refuse) for sub in freed)
    object.__setattr__(module, _GUARD, guard)


class _Guard:
    def __init__(self, handles: list[Any]) -> None:
        self.handles = handles
        self.up = True


def unguard(module: nn.Module) -> None:
    """Takes :func:`guard`'s hooks off again (the module's weights are back)."""
    guard = getattr(module, _GUARD, None)
    if guard is None:
        return
    guard.up = False
    for handle in guard.handles:
        handle.remove()
    object.__delattr__(module, _GUARD)


def release(
    module: nn.Module,
    *,
    name: str | None = None,
    stage: str | None = None,
    keep: Iterable[nn.Module] = (),
    empty_cache: bool = True,
) -> ReleaseStats:
    """Frees every parameter and buffer storage of ``module`` in place, for good: the memory
    goes back to the OS even while other references to the module or its tensors live. Storage
    shared with a module in ``keep`` is left alone. Afterwards calling ``module``, or a submodule
    whose weights were freed, raises :class:`ReleasedModuleError`. With ``empty_cache``, CUDA's and MPS's
    caching allocators give freed device memory back too."""
    freed, kept = _native.release_module(
        module, name=name or "module", stage=stage, keep=list(keep)
    )
    guard(module, name, stage)
    if empty_cache:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if torch.backends.mps.is_available():
            torch.mps.empty_cache()
    return ReleaseStats(nbytes=freed, kept=kept)
