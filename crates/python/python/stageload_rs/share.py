"""Make identical loads return one shared instance for the duration of a block."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import Any

_UNKEYED = object()


def _call_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
    key = (args, tuple(sorted(kwargs.items())))
    try:
        hash(key)
    except TypeError:
        # an argument that cannot be hashed (a dict, a list) is not compared by its repr: two
        # different objects can print the same, so such a call is not shared
        return _UNKEYED
    return key


@contextmanager
def share(
    owner: Any, attr: str, *, key: Callable[..., Hashable] | None = None
) -> Iterator[dict[Hashable, Any]]:
    """Within the block, calls to ``owner.attr`` with the same key return the first result.

    The key is the call's arguments unless ``key`` is given; a call with an argument that
    cannot be hashed is passed through, not shared. ``owner`` may be a class (for a classmethod
    such as ``from_pretrained``) or a module. On exit the attribute is as it was: an inherited
    one is removed from ``owner`` again rather than copied onto it.
    """
    own = vars(owner).get(attr, _UNKEYED)
    target = getattr(owner, attr)
    cache: dict[Hashable, Any] = {}

    def shared(*args: Any, **kwargs: Any) -> Any:
        call_key = key(*args, **kwargs) if key is not None else _call_key(args, kwargs)
        if call_key is _UNKEYED:
            return target(*args, **kwargs)
        if call_key not in cache:
            cache[call_key] = target(*args, **kwargs)
        return cache[call_key]

    setattr(owner, attr, staticmethod(shared) if isinstance(owner, type) else shared)
    try:
        yield cache
    finally:
        if own is _UNKEYED:
            delattr(owner, attr)
        else:
            setattr(owner, attr, own)
