"""Python's own generators, which the registry saves and puts back around every build beside
torch's CPU, CUDA and MPS generators (those the Rust core saves itself)."""

from __future__ import annotations

import random
import sys
from typing import Any


class PythonGenerators:
    """Python's ``random`` and NumPy's global generator (when NumPy is imported). Generators a
    library makes for itself (a ``torch.Generator``, a ``numpy.random.Generator``) are its own:
    nothing outside it draws from them."""

    def save(self) -> tuple[Any, Any]:
        numpy = sys.modules.get("numpy")
        return random.getstate(), (numpy.random.get_state() if numpy is not None else None)

    def restore(self, state: tuple[Any, Any]) -> None:
        python, numpy_state = state
        random.setstate(python)
        numpy = sys.modules.get("numpy")
        if numpy is not None and numpy_state is not None:
            numpy.random.set_state(numpy_state)
