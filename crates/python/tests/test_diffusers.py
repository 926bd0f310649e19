"""diffusers pipelines staged as they are (``stageload_rs.diffusers.staged_pipeline``), against
the same pipeline unwrapped: Stable Diffusion, Shap-E image to 3D and Wan2.1 text to video, from
the diffusers folders of the small exports (``scripts/reference/diffusers_folder.py``, seeded
random weights at small configurations), eager, staged and with prefetch, two runs each in one
process, every output equal bit for bit."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import diffusers
import numpy as np
import pytest
import stageload_rs as sl
import torch
from conftest import mapped_from
from PIL import Image
from safetensors import safe_open
from stageload_rs.diffusers import BETWEEN_CALLS, MODES, staged_pipeline
from stageload_rs.release import weights


def folder(variable: str) -> Path:
    root = os.environ.get(variable)
    assert root, f"{variable} names the small export (scripts/setup-reference.sh prints it)"
    path = Path(root) / "diffusers"
    assert (path / "model_index.json").is_file(), f"{path}: run scripts/setup-reference.sh"
    return path


def stable_diffusion() -> tuple[type, Path, Callable[[Any], torch.Tensor]]:
    path = folder("STAGELOAD_SD_SMALL")
    prompt = (path / "prompt.txt").read_text()

    def run(pipe: Any) -> torch.Tensor:
        generator = torch.Generator().manual_seed(7)
        out = pipe(
            prompt,
            num_inference_steps=3,
            guidance_scale=7.5,
            generator=generator,
            output_type="pt",
            height=16,
            width=16,
        )
        return out.images

    return diffusers.StableDiffusionPipeline, path, run


def shap_e() -> tuple[type, Path, Callable[[Any], torch.Tensor]]:
    path = folder("STAGELOAD_SHAP_E_SMALL")
    pixels = (np.random.default_rng(3).random((64, 64, 3)) * 255).astype(np.uint8)
    image = Image.fromarray(pixels)

    def run(pipe: Any) -> torch.Tensor:
        generator = torch.Generator().manual_seed(7)
        out = pipe(
            image,
            num_inference_steps=2,
            guidance_scale=3.0,
            frame_size=32,
            generator=generator,
            output_type="np",
        )
        return torch.from_numpy(np.stack(out.images))

    return diffusers.ShapEImg2ImgPipeline, path, run


def wan() -> tuple[type, Path, Callable[[Any], torch.Tensor]]:
    path = folder("STAGELOAD_WAN_SMALL")
    prompt = (path / "prompt.txt").read_text()

    def run(pipe: Any) -> torch.Tensor:
        generator = torch.Generator().manual_seed(7)
        out = pipe(
            prompt=prompt,
            negative_prompt="",
            height=32,
            width=32,
            num_frames=9,
            num_inference_steps=2,
            guidance_scale=5.0,
            generator=generator,
            output_type="np",
            max_sequence_length=16,
        )
        return torch.from_numpy(out.frames)

    return diffusers.WanPipeline, path, run


PIPELINES = {"stable_diffusion": stable_diffusion, "shap_e": shap_e, "wan": wan}
# the components each pipeline stages, in the order its stages run
COMPONENTS = {
    "stable_diffusion": ["text_encoder", "unet", "vae"],
    "shap_e": ["image_encoder", "prior", "shap_e_renderer"],
    "wan": ["text_encoder", "transformer", "vae"],
}


@pytest.fixture(scope="module")
def unwrapped() -> dict[str, torch.Tensor]:
    """Each pipeline's output, unwrapped (``from_pretrained``), once per test module."""
    outputs = {}
    for name, make in PIPELINES.items():
        cls, path, run = make()
        outputs[name] = run(cls.from_pretrained(str(path)))
    return outputs


@pytest.mark.parametrize(
    ("mode", "reload"),
    [("eager", "map"), ("staged", "map"), ("prefetch", "map"), ("staged", "copy")],
)
@pytest.mark.parametrize("pipeline", list(PIPELINES))
def test_a_staged_pipeline_gives_the_unwrapped_pipelines_output_bit_for_bit(
    pipeline, mode, reload, unwrapped
):
    cls, path, run = PIPELINES[pipeline]()
    events = sl.ListSink()
    pipe, models = staged_pipeline(cls, path, mode=mode, reload=reload, events=events)
    components = [getattr(pipe, c) for c in COMPONENTS[pipeline]]
    for attempt in range(2):  # the second image comes back from reloads in place
        assert torch.equal(run(pipe), unwrapped[pipeline]), (
            f"{pipeline} {mode}, image {attempt + 1}"
        )
    assert [getattr(pipe, c) for c in COMPONENTS[pipeline]] == components, "the same objects"

    def loads() -> list[tuple]:
        return [
            (e.name, e.kind, e.fields.get("from"))
            for e in events.events
            if e.kind in ("load", "reload")
        ]

    if mode == "eager":
        assert loads() == [(c, "load", None) for c in COMPONENTS[pipeline]]
    else:
        expected = sorted(
            [(c, "load", None) for c in COMPONENTS[pipeline]]
            + [
                (c, "reload", "mapped" if reload == "map" else "in_place")
                for c in COMPONENTS[pipeline]
            ]
        )
        # a prefetch tells of its load from its own thread, which can take the GIL after the
        # call returned: up to 10 s
        deadline = time.monotonic() + 10
        while sorted(loads()) != expected and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(loads()) == expected
    models.close()
    if mode == "prefetch":
        assert any(
            e.fields.get("prefetched") for e in events.events if e.kind in ("load", "reload")
        )


@pytest.mark.parametrize("pipeline", list(PIPELINES))
def test_a_component_is_on_its_files_pages_at_its_first_load_and_after_a_mapped_reload(
    pipeline: str,
):
    cls, path, _ = PIPELINES[pipeline]()
    events = sl.ListSink()
    _, models = staged_pipeline(cls, path, events=events)
    for kind in ("load", "reload"):  # from_pretrained's mapping, then the registry's
        for component, stage in zip(
            COMPONENTS[pipeline], ["encode", "denoise", "decode"], strict=True
        ):
            models.enter(stage)
            module = models[component]
            (file,) = (path / component).glob("*.safetensors")
            with safe_open(str(file), framework="pt") as entries:
                stored = {name: entries.get_tensor(name).dtype for name in entries.keys()}  # noqa: SIM118
            # a weight from_pretrained converts (WanTransformer's bf16 entries to float32) is copied
            on_pages = {n: mapped_from(p, file) for n, p in module.named_parameters()}
            expected = {n: p.dtype == stored[n] for n, p in module.named_parameters()}
            assert on_pages == expected, f"{pipeline} {component} {kind}: on {file.name}'s pages"
            assert any(on_pages.values())
            (event,) = [e for e in events.events if e.kind == kind and e.name == component]
            assert event.fields["report"]["used"] == len(weights(module)), event.fields
    models.close()


def test_stages_follow_the_pipelines_own_calls_and_nothing_loads_before_its_stage():
    cls, path, run = stable_diffusion()
    events = sl.ListSink()
    pipe, models = staged_pipeline(cls, path, events=events)
    assert set(models.states().values()) == {"unloaded"}
    run(pipe)
    stages = [e.stage for e in events.of_kind("stage")]
    assert stages == ["encode", "denoise", "decode", BETWEEN_CALLS]
    releases = [(e.name, e.stage) for e in events.of_kind("release")]
    assert releases == [("text_encoder", "denoise"), ("unet", "decode"), ("vae", BETWEEN_CALLS)]
    # a part of a released component, called past the component (whose call enters its stage)
    with pytest.raises(sl.ReleasedModuleError) as raised:
        pipe.unet.conv_in(torch.zeros(1, 4, 8, 8))
    assert (raised.value.name, raised.value.stage) == ("unet", "decode")
    # the component itself, called, enters its stage and comes back
    run(pipe)
    assert [e.stage for e in events.of_kind("stage")][4:] == [
        "encode",
        "denoise",
        "decode",
        BETWEEN_CALLS,
    ]


@pytest.mark.parametrize("pipeline", list(PIPELINES))
def test_between_its_calls_a_staged_pipeline_holds_no_model_and_an_eager_one_holds_them_all(
    pipeline: str,
):
    cls, path, run = PIPELINES[pipeline]()
    for mode in MODES:
        pipe, models = staged_pipeline(cls, path, mode=mode)
        run(pipe)  # the pipeline's own end of call (maybe_free_model_hooks) ends its last stage
        held = sorted(COMPONENTS[pipeline]) if mode == "eager" else []
        assert sorted(models.loaded()) == held, f"{pipeline} {mode}"
        if mode != "eager":
            assert models.resident_bytes() == 0
            assert models.current_stage == BETWEEN_CALLS
        models.close()


def test_a_released_component_leaves_no_mapping_of_its_file_without_a_collection(
    collections,
):
    """Python's collector (0.22 s in a process running SD 1.5) runs after a release only while a
    file of what the loader made is still mapped: from_pretrained's leave none (the test of the
    collection itself is in test_core.py)."""
    gc.collect()  # pipelines of earlier tests, in cycles, may still map these files
    cls, path, run = stable_diffusion()
    pipe, models = staged_pipeline(cls, path)
    files = [
        str(f.resolve())
        for c in COMPONENTS["stable_diffusion"]
        for f in (path / c).glob("*.safetensors")
    ]
    for image in range(2):  # releases of from_pretrained's weights, then of refills'
        run(pipe)
        maps = Path("/proc/self/maps").read_text()
        assert [f for f in files if f in maps] == [], f"image {image + 1}: every file unmapped"
        assert collections == [], f"image {image + 1}"
    models.close()


def test_a_call_that_raises_leaves_the_pipeline_between_calls_and_the_next_one_equal(unwrapped):
    cls, path, run = stable_diffusion()
    pipe, models = staged_pipeline(cls, path)

    def interrupt(*_args: Any) -> None:
        raise KeyboardInterrupt

    handle = pipe.unet.register_forward_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        run(pipe)
    assert (models.loaded(), models.current_stage) == ([], BETWEEN_CALLS)
    handle.remove()
    assert torch.equal(run(pipe), unwrapped["stable_diffusion"])
    models.close()


@pytest.mark.parametrize("pipeline", list(PIPELINES))
def test_a_staged_pipeline_is_assembled_as_from_pretrained_assembles_it(pipeline: str):
    cls, path, _ = PIPELINES[pipeline]()
    pipe, models = staged_pipeline(cls, path)
    plain = cls.from_pretrained(str(path))
    # its class: the pipeline's, whose call ends by releasing (see the test on between calls)
    assert isinstance(pipe, cls)
    assert (type(pipe).__name__, type(pipe).__module__) == (cls.__name__, cls.__module__)
    assert dict(pipe.config) == dict(plain.config)
    kinds = {name: type(c) for name, c in pipe.components.items()}
    assert kinds == {name: type(c) for name, c in plain.components.items()}
    models.close()


def answers(module: torch.nn.Module) -> tuple:
    config = module.config  # transformers: a PretrainedConfig; diffusers: a FrozenDict
    as_dict = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    return type(module), module.dtype, module.device, as_dict


@pytest.mark.parametrize("pipeline", list(PIPELINES))
def test_before_its_stage_a_component_holds_no_storage_and_answers_as_the_loaded_model(
    pipeline: str,
):
    cls, path, _ = PIPELINES[pipeline]()
    pipe, models = staged_pipeline(cls, path)
    stages = dict(zip(COMPONENTS[pipeline], ["encode", "denoise", "decode"], strict=True))
    for component, stage in stages.items():
        shell = getattr(pipe, component)
        tensors = [*shell.parameters(), *shell.buffers()]
        assert sum(t.untyped_storage().nbytes() for t in tensors) == 0
        # what a pipeline asks before the first call (WanPipeline asks the transformer's dtype)
        before = answers(shell)
        models.enter(stage)
        loaded = models[component]
        assert loaded is shell
        assert answers(loaded) == before
        assert sum(t.untyped_storage().nbytes() for t in loaded.parameters()) > 0
    models.close()


def test_a_pipeline_without_a_plan_or_a_component_without_safetensors_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no stage plan for StableDiffusionImg2ImgPipeline"):
        staged_pipeline(diffusers.StableDiffusionImg2ImgPipeline, folder("STAGELOAD_SD_SMALL"))
    with pytest.raises(ValueError, match="mode 'lazy'"):
        staged_pipeline(
            diffusers.StableDiffusionPipeline, folder("STAGELOAD_SD_SMALL"), mode="lazy"
        )
    copy = tmp_path / "sd"
    for file in folder("STAGELOAD_SD_SMALL").rglob("*"):
        if file.is_file() and not (file.parent.name == "unet" and file.suffix == ".safetensors"):
            target = copy / file.relative_to(folder("STAGELOAD_SD_SMALL"))
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(file.read_bytes())
    with pytest.raises(FileNotFoundError, match="component 'unet'"):
        staged_pipeline(diffusers.StableDiffusionPipeline, copy)
    # a header that is not one: its length field says more than the file holds
    broken = copy / "unet" / "diffusion_pytorch_model.safetensors"
    broken.write_bytes((1 << 40).to_bytes(8, "little") + b"{}")
    with pytest.raises(sl.StageError, match="diffusion_pytorch_model.safetensors"):
        staged_pipeline(diffusers.StableDiffusionPipeline, copy)


# Run in a process of its own, where MKL_CBWR is unset (conftest sets it for this one): the
# unwrapped pipeline's video, then two of the staged pipeline's, and whether each equals it.
_WITHOUT_CBWR = """
import json, sys, warnings
sys.path.insert(0, sys.argv[1])
import torch
import test_diffusers as t
warnings.simplefilter("ignore")
cls, path, run = t.wan()
unwrapped = run(cls.from_pretrained(str(path)))
pipe, _ = t.staged_pipeline(cls, path, mode="staged", reload=sys.argv[2])
print(json.dumps([bool(torch.equal(run(pipe), unwrapped)) for _ in range(2)]))
"""


def _equal_without_cbwr(reload: str) -> list[bool]:
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_CBWR, str(Path(__file__).parent), reload],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def _page_offsets(module: torch.nn.Module) -> dict[str, int]:
    return {name: p.data_ptr() % 4096 for name, p in module.named_parameters()}


def test_mapped_reloads_give_wan_the_unwrapped_video_without_mkl_cbwr():
    # Mapped, the weights are at the offsets from_pretrained's mapping gives them, so MKL's
    # products round as the unwrapped pipeline's do: both videos equal it with MKL_CBWR unset.
    assert _equal_without_cbwr("map") == [True, True]
    # The mechanism, which holds on any CPU (whether MKL rounds otherwise at other offsets
    # depends on the CPU and the offsets): a reload that maps puts every weight at the page
    # offset from_pretrained's mapping puts it; one that copies puts it at the allocator's.
    cls, path, run = wan()
    plain = _page_offsets(cls.from_pretrained(str(path)).text_encoder)
    for reload in ("map", "copy"):
        pipe, models = staged_pipeline(cls, path, reload=reload)
        run(pipe)
        models.enter("encode")  # the text encoder comes back
        offsets = _page_offsets(models["text_encoder"])
        if reload == "map":
            assert offsets == plain
        else:
            assert all(offset % 64 == 0 for offset in offsets.values())
            assert offsets != plain
        models.close()
