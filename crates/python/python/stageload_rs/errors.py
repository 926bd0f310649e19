"""The exceptions stageload_rs raises. The Rust registry raises these same classes."""

from __future__ import annotations


class StageError(RuntimeError):
    """The registry refused or could not do what was asked; the message says what and why."""


class LoaderError(StageError):
    """A model's loader raised (the exception is the ``__cause__``); the registry stays usable
    and asking for the model again runs the loader again."""

    def __init__(self, message: str, model: str) -> None:
        super().__init__(message)
        self.model = model


class SourceChangedError(StageError):
    """A file the model was first loaded from was written, resized or replaced since: reloading
    it would give other weights than the first load, so nothing was loaded. Call
    ``StagedModels.accept_changed_files(model)`` to take the files as they are now."""

    def __init__(self, message: str, model: str, path: str, change: str) -> None:
        super().__init__(message)
        self.model = model
        self.path = path
        self.change = change


class ChangedUnderModelError(SourceChangedError):
    """A checkpoint file was written in place while a resident model held its pages
    (``reload_mapped``): its weights may have changed with the file, so the registry released it
    before any further use. Its next load is refused like any changed file
    (:class:`SourceChangedError`) until the first file is back or the new one accepted."""


class ReleasedModuleError(RuntimeError):
    """A module was called after stageload released its weights."""

    def __init__(self, name: str | None, stage: str | None) -> None:
        self.name = name
        self.stage = stage
        label = repr(name) if name else "This module"
        where = f" when entering stage {stage!r}" if stage else ""
        super().__init__(
            f"{label} was released{where} and its weights are gone. Get the model from the "
            "StagedModels registry again instead of keeping a reference to it."
        )
