"""A diffusers pipeline, staged as it is: one call, from its folder, its code untouched.

``staged_pipeline(StableDiffusionPipeline, folder)`` gives the pipeline object diffusers would
give, and the registry behind it. Each model component (the UNet, the VAE, the text encoder) is
in the pipeline from the start as a placeholder of its class (its config, no submodule, no
storage: see :func:`empty_component`); the first call into it enters its stage and loads it with
the class's own ``from_pretrained``, whose module it then becomes (the module's state moves into
the object the pipeline holds). A release frees its storages in place; the next call refills them
from the folder's safetensors files, into the same objects. The non-model components (tokenizers,
schedulers, processors) load as diffusers loads them.

Stages are entered on the components' own methods: the model's ``forward``, and for a VAE or a
renderer the method the pipeline calls (``decode``, ``decode_to_image``). The three pipelines
the project checks have their plan here (``PLANS``); any other takes ``stages=``. When a call of
the pipeline returns (or raises), the pipeline enters the stage :data:`BETWEEN_CALLS`, which lists
no model: between calls it holds none, and the next call starts from what its first stage loads,
as the first call did.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import _native
from .hooks import on_call
from .registry import StagedModels

# (stage, component, the component's methods whose call enters the stage), in call order
Stage = tuple[str, str, Sequence[str]]

PLANS: dict[str, list[Stage]] = {
    "StableDiffusionPipeline": [
        ("encode", "text_encoder", ["forward"]),
        ("denoise", "unet", ["forward"]),
        ("decode", "vae", ["decode"]),
    ],
    "ShapEImg2ImgPipeline": [
        ("encode", "image_encoder", ["forward"]),
        ("denoise", "prior", ["forward"]),
        ("decode", "shap_e_renderer", ["decode_to_image", "decode_to_mesh"]),
    ],
    "WanPipeline": [
        ("encode", "text_encoder", ["forward"]),
        ("denoise", "transformer", ["forward"]),
        ("decode", "vae", ["decode"]),
    ],
}

MODES = ("eager", "staged", "prefetch")

# the stage a staged pipeline is in between its calls: no model
BETWEEN_CALLS = "between_calls"


def _component_class(library: str, name: str) -> type:
    """The class a `model_index.json` entry names: a library's (`diffusers`, `transformers`) or,
    as diffusers writes its pipelines' own components (`shap_e`), a diffusers pipeline module's."""
    try:
        module = importlib.import_module(library)
    except ImportError:
        module = importlib.import_module(f"diffusers.pipelines.{library}")
    return getattr(module, name)


def _checkpoint(folder: Path, component: str) -> list[Path]:
    files = sorted((folder / component).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"component {component!r} of {folder} has no .safetensors file: save the pipeline with "
            "save_pretrained(..., safe_serialization=True)"
        )
    return files


def _loaded_dtypes(
    cls: type, files: list[Path], torch_dtype: torch.dtype | None
) -> dict[str, torch.dtype]:
    """The dtype each tensor has once ``cls.from_pretrained`` loaded it: ``torch_dtype`` for
    floating tensors when given; else the checkpoint's for a transformers model (its default is
    "auto") and float32 for a diffusers model (its default)."""
    stored = {
        name: getattr(torch, dtype) for name, dtype in _native.checkpoint_dtypes(files).items()
    }
    if torch_dtype is None and hasattr(cls, "config_class"):
        return stored
    floating = torch_dtype or torch.float32
    return {name: floating if dtype.is_floating_point else dtype for name, dtype in stored.items()}


def empty_component(
    cls: type, folder: Path, component: str, dtypes: dict[str, torch.dtype]
) -> nn.Module:
    """An instance of ``cls`` that holds the component's place until its first load: its config
    as the class registers it from the folder's config, no submodule, and one empty parameter (no
    storage) in the dtype ``from_pretrained`` will give the model, so that what the pipeline asks
    before the first call (``device``, ``dtype``, ``config``) has the loaded model's answer. Where
    the weights have one floating dtype (the model's dtype then, whatever its rule) the class's
    constructor is not run; else the model is built on ``meta`` for its dtype rule and its
    attributes kept. Its first load moves the loaded model's state in (:func:`adopt`)."""
    path = str(folder / component)
    transformers = hasattr(cls, "config_class") and hasattr(cls, "_from_config")
    floating = {dtype for dtype in dtypes.values() if dtype.is_floating_point}
    if transformers:
        config = cls.config_class.from_pretrained(path)
        config.name_or_path = str(folder)  # as from_pretrained(folder, subfolder=...) says
        if len(floating) == 1:
            # one floating dtype: the model's dtype whatever its rule, so no build is needed
            # (building one runs the model's code, 4.4 MB for CLIP's text encoder, which the
            # first load pays anyway); the base class sets the config and its own attributes
            from transformers import PreTrainedModel

            shell = cls.__new__(cls)
            PreTrainedModel.__init__(shell, config)
            return _with_placeholder(shell, floating.pop())
    elif len(floating) == 1 and hasattr(cls.__init__, "__wrapped__"):
        # the same for a diffusers model whose constructor registers its config (the decorator
        # wraps it): the config registered as from_config registers it, the constructor not run
        return _with_placeholder(_configured(cls, folder, component), floating.pop())
    with torch.device("meta"):
        if transformers:
            built = cls._from_config(config)
        else:  # diffusers
            built = cls.from_config(cls.load_config(path))
            built.register_to_config(_name_or_path=str(folder))  # as from_pretrained does
    with torch.no_grad():
        for name, tensor in [*built.named_parameters(), *built.named_buffers()]:
            if name in dtypes and tensor.dtype != dtypes[name]:
                tensor.data = tensor.data.to(dtypes[name])
    dtype = built.dtype  # the class's own rule (first floating tensor, fp32-kept modules skipped)
    shell = cls.__new__(cls)
    nn.Module.__init__(shell)
    emptied = {"_parameters", "_buffers", "_non_persistent_buffers_set", "_modules"}
    shell.__dict__.update((k, v) for k, v in built.__dict__.items() if k not in emptied)
    return _with_placeholder(shell, dtype)


def _configured(cls: type, folder: Path, component: str) -> nn.Module:
    """An instance of the diffusers model ``cls`` holding only the config ``from_pretrained``
    registers for it: the folder's config through the class's ``register_to_config`` decorator
    (its defaults, its ``ignore_for_config``) and the hidden entries, as ``from_config`` does,
    with ``_name_or_path``; the constructor itself is not run."""
    from diffusers.configuration_utils import register_to_config

    init_dict, _, hidden = cls.extract_init_dict(cls.load_config(str(folder / component)))

    def init(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        """Registers nothing more (the decorator registered the config)."""

    init.__signature__ = inspect.signature(inspect.unwrap(cls.__init__))  # type: ignore[attr-defined]
    shell = cls.__new__(cls)
    nn.Module.__init__(shell)
    register_to_config(init)(shell, **init_dict)
    if "_class_name" in hidden:
        hidden["_class_name"] = cls.__name__
    shell.register_to_config(**hidden, _name_or_path=str(folder))
    return shell


def _with_placeholder(shell: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``shell`` with one empty parameter (no storage) in ``dtype``, in evaluation mode."""
    shell.register_parameter(
        "stageload_placeholder", nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
    )
    return shell.eval()


# nn.Module's hook tables (a hook's handle holds its table, so the shell's tables stay)
_HOOKS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


def adopt(shell: nn.Module, loaded: nn.Module) -> nn.Module:
    """Makes ``shell`` the module ``loaded`` is: its whole state (submodules, tensors, config,
    flags, hooks) moves in, and what was set on ``shell`` (the stage hooks) stays."""
    if shell.dtype != loaded.dtype:
        warnings.warn(
            f"{type(loaded).__name__}: before its load its dtype was {shell.dtype}, and "
            f"from_pretrained gave it {loaded.dtype}; pass torch_dtype= to staged_pipeline",
            stacklevel=3,
        )
    state = dict(loaded.__dict__)
    for key, value in shell.__dict__.items():
        if key in _HOOKS and key in state:
            # the shell's own dicts, its hooks first: their handles remove from these objects
            value.update(state[key])
            state[key] = value
        state.setdefault(key, value)
    shell.__dict__.clear()
    shell.__dict__.update(state)
    return shell


def staged_pipeline(
    pipeline_class: type,
    folder: str | os.PathLike[str],
    *,
    mode: str = "staged",
    stages: Sequence[Stage] | None = None,
    torch_dtype: torch.dtype | None = None,
    reload: str = "map",
    **options: Any,
) -> tuple[Any, StagedModels]:
    """The pipeline ``pipeline_class.from_pretrained(folder)`` gives, with its model components
    staged (``mode="staged"``), staged with the next stage prefetched (``"prefetch"``), or all
    loaded before it runs and never released (``"eager"``). A released component comes back on
    its safetensors files' pages as ``from_pretrained`` holds them (``reload="map"``, see
    ``reload_mapped`` of :class:`StagedModels`), or copied into memory of its own
    (``reload="copy"``). Staged, it holds no model between its calls (:data:`BETWEEN_CALLS`).
    ``options`` go to :class:`StagedModels` (``events=``, ``host_tier=``, ...). Returns the
    pipeline and its registry."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: one of {', '.join(MODES)}")
    if reload not in ("map", "copy"):
        raise ValueError(f"reload {reload!r}: 'map' or 'copy'")
    copied = mode != "eager" and reload == "copy"
    if copied and torch.backends.mkl.is_available() and not os.environ.get("MKL_CBWR"):
        warnings.warn(
            "MKL_CBWR is not set: MKL's CPU matrix products can round differently for the same "
            "weights at other addresses, and reload='copy' puts them elsewhere than "
            "from_pretrained did; start the process with MKL_CBWR=COMPATIBLE (or reload='map') "
            "for the same results bit for bit",
            stacklevel=2,
        )
    folder = Path(folder)
    plan = list(stages) if stages is not None else PLANS.get(pipeline_class.__name__)
    if plan is None:
        raise ValueError(
            f"no stage plan for {pipeline_class.__name__}: give stages=[(stage, component, "
            f"[methods]), ...] (the plans there are: {', '.join(PLANS)})"
        )
    index = pipeline_class.load_config(str(folder))
    shells: dict[str, nn.Module] = {}
    loaders = {}
    checkpoints = {}
    for _, component, _ in plan:
        entry = index.get(component)
        if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and entry[0]):
            raise KeyError(f"{folder / 'model_index.json'} has no component {component!r}")
        cls = _component_class(*entry)
        files = _checkpoint(folder, component)
        shell = empty_component(cls, folder, component, _loaded_dtypes(cls, files, torch_dtype))

        def load(
            cls: type = cls, component: str = component, shell: nn.Module = shell
        ) -> nn.Module:
            kwargs = {"torch_dtype": torch_dtype} if torch_dtype is not None else {}
            return adopt(shell, cls.from_pretrained(str(folder), subfolder=component, **kwargs))

        shells[component], loaders[component], checkpoints[component] = shell, load, files
    stage_models = {stage: [component] for stage, component, _ in plan}
    if BETWEEN_CALLS in stage_models:
        raise ValueError(f"stage name {BETWEEN_CALLS!r} is the pipeline's own: name it otherwise")
    if mode == "eager":
        stage_models = {stage: list(shells) for stage in stage_models}
    else:
        stage_models[BETWEEN_CALLS] = []
    models = StagedModels(
        loaders,
        stages=stage_models,
        checkpoints=checkpoints,
        loader_reads_checkpoint=list(shells),
        reload_mapped=list(shells) if reload == "map" else [],
        prefetch=mode == "prefetch",
        **options,
    )
    pipe = pipeline_class.from_pretrained(str(folder), **shells)
    for stage, component, methods in plan:

        def enter(
            *_args: Any, stage: str = stage, component: str = component, **_kwargs: Any
        ) -> None:
            # once per stage: every later call of the stage finds its model resident
            if models.current_stage != stage:
                models.enter(stage)
                models[component]  # loaded, or refilled in place, before the call runs

        for method in methods:
            if method == "forward":
                # before every other forward pre-hook (a released module's guard among them)
                shells[component].register_forward_pre_hook(enter, prepend=True)
            elif hasattr(shells[component], method):
                on_call(shells[component], method, before=enter)
    if mode == "eager":
        models.enter(plan[0][0])
        for component in shells:
            models[component]
    else:
        pipe.__class__ = _ending_calls_between_them(type(pipe), models)
    return pipe, models


def _ending_calls_between_them(cls: type, models: StagedModels) -> type:
    """A subclass of the pipeline class ``cls``, of the same name, whose call enters
    :data:`BETWEEN_CALLS` when it returns or raises. ``__call__`` is looked up on the class, so an
    instance's own attribute (as :func:`on_call` sets) would not run; and diffusers' end-of-call
    method (``maybe_free_model_hooks``) is not the end everywhere (Shap-E calls it before its
    renderer)."""

    @functools.wraps(cls.__call__)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return cls.__call__(self, *args, **kwargs)
        finally:
            models.enter(BETWEEN_CALLS)

    names = {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__}
    return type(cls.__name__, (cls,), {**names, "__call__": __call__})
