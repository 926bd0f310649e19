"""Stable Diffusion from one diffusers folder, side by side in one run: the pipeline unwrapped
(`from_pretrained`, everything loaded), the original Python stageload 0.1.1 wrapping it, and
stageload_rs (`staged_pipeline`, staged and with prefetch, reloads mapping the checkpoint's
pages; `copy`: staged, reloads copying into memory of its own). Each run is a process of its own
under `stageload guard`, the arms alternating, two images per process.

    python python_side_by_side.py --folder SD/diffusers --out DIR --guard target/debug/stageload
        [--rounds 2] [--steps 4] [--size 256] [--arms unwrapped,original,staged,prefetch[,copy]]
        [--without-cbwr]

Per stage of each image (setup: building the pipeline; encode: from the call to the scheduler's
set_timesteps; denoise: to the end of the last step; decode: to the call's return) a run records
its wall time (load, first forward and compute together: `from_pretrained` maps files and pays on
first use, so a load time alone compares nothing) and its peak resident set, the kernel's exact
counter (VmHWM, reset through /proc/self/clear_refs at every boundary); after both images, what
the process still holds beyond its start (`kept`, with every model released). The unwrapped arm
gives the C heap's free pages back at each boundary (malloc_trim), so its second image's rise per
stage is the stage's working memory, the measure of the peak-against-need table. DIR gets one JSON
per run, the images (`.npy`), and summary.md: medians per arm and stage, the ratios to the
original's, and whether every image equals the unwrapped pipeline's bit for bit.

The original arm wraps diffusers as its users must: stand-in modules carrying each component's
config (read by hand) and a device, the models set in past the pipeline's `__setattr__` at its
methods (`encode_prompt`, `prepare_latents`) and, since no method runs between the loop and
`vae.decode`, at the last step's `callback_on_step_end`; a released model's place goes back to its
stand-in (an event sink), or the pipeline would take its device from a module on `meta`. diffusers' own offloading is not an
arm: on the CPU it has no device to offload from.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

STAGES = ("setup", "encode", "denoise", "decode")
# the model each stage runs, and the one still resident when it begins (released at its load)
STAGE_MODELS = {
    "encode": ("text_encoder", "vae"),
    "denoise": ("unet", "text_encoder"),
    "decode": ("vae", "unet"),
}


def status_bytes(field: str) -> int:
    """A size field of /proc/self/status (VmHWM, VmRSS, RssFile, RssAnon), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def vm_hwm() -> int:
    return status_bytes("VmHWM")


def vm_rss() -> int:
    return status_bytes("VmRSS")


def malloc_trim() -> None:
    """Gives the C heap's free pages back to the OS (glibc's malloc_trim, every arena)."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)


class Stages:
    """Times and peaks between boundaries; each boundary resets the kernel's peak counter. With
    `trim`, the C heap's free pages go back to the OS at each boundary first, so that a stage's
    rise counts every page its working memory touches (none left free by the stage before)."""

    def __init__(self, trim: bool = False) -> None:
        self.rows: list[dict] = []
        self.trim = trim
        self.reset("setup")

    def reset(self, stage: str) -> None:
        if self.trim:
            malloc_trim()
        Path("/proc/self/clear_refs").write_text("5")
        self.stage, self.start, self.start_rss = stage, time.perf_counter(), vm_rss()
        # of which file pages (the libraries' code a stage ran among them) and anonymous memory
        self.start_file, self.start_anon = status_bytes("RssFile"), status_bytes("RssAnon")
        self.released_rss = None

    def released(self) -> None:
        """A model was released in this stage (the arm's release event): the RSS after the
        stage's first release (entering it) is where its own weights and working memory start
        from; a later one (the pipeline's end of call) comes after them."""
        if self.released_rss is None:
            self.released_rss = vm_rss()

    def boundary(self, next_stage: str | None) -> None:
        peak, now = vm_hwm(), time.perf_counter()
        self.rows.append(
            {
                "stage": self.stage,
                "seconds": now - self.start,
                "peak": peak,
                "start_rss": self.start_rss,
                "start_file": self.start_file,
                "start_anon": self.start_anon,
                "released_rss": self.released_rss,
                "end_rss": vm_rss(),
            }
        )
        if next_stage is not None:
            self.reset(next_stage)


def original_pipeline(folder: Path, released):
    """The original stageload around StableDiffusionPipeline, as its users write it;
    `released()` is called after each release (the measurement's, not the user's)."""
    import stageload as original
    import torch
    from diffusers import (
        AutoencoderKL,
        DDIMScheduler,
        StableDiffusionPipeline,
        UNet2DConditionModel,
    )
    from transformers import AutoTokenizer, CLIPTextModel

    classes = {"text_encoder": CLIPTextModel, "unet": UNet2DConditionModel, "vae": AutoencoderKL}

    class StandIn(torch.nn.Module):
        """Holds a component's place (and config) until its stage: the pipeline reads configs,
        its device and dtype before it calls the models."""

        def __init__(self, config) -> None:
            super().__init__()
            self.config = config
            self.anchor = torch.nn.Parameter(torch.zeros(1), requires_grad=False)

        @property
        def device(self):
            return self.anchor.device

        @property
        def dtype(self):
            return self.anchor.dtype

    def config_of(component: str):
        cls = classes[component]
        if hasattr(cls, "config_class"):
            return cls.config_class.from_pretrained(str(folder / component))
        from diffusers.configuration_utils import FrozenDict

        return FrozenDict(cls.load_config(str(folder / component)))

    standins = {c: StandIn(config_of(c)) for c in classes}
    pipe = None

    class PutBack:
        """A released model's place goes back to its stand-in: the pipeline reads its device from
        its first module, and a released one is on `meta`."""

        def emit(self, event) -> None:
            if event.kind == "release" and pipe is not None:
                object.__setattr__(pipe, event.name, standins[event.name])
                released()

    models = original.StagedModels(
        {
            c: (lambda c=c: classes[c].from_pretrained(str(folder), subfolder=c).eval())
            for c in classes
        },
        stages={"encode": ["text_encoder"], "denoise": ["unet"], "decode": ["vae"]},
        events=PutBack(),
    )
    pipe = StableDiffusionPipeline(
        vae=standins["vae"],
        text_encoder=standins["text_encoder"],
        tokenizer=AutoTokenizer.from_pretrained(str(folder / "tokenizer")),
        unet=standins["unet"],
        scheduler=DDIMScheduler.from_pretrained(str(folder), subfolder="scheduler"),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )

    def bring(stage: str, component: str):
        def before(*_args, **_kwargs) -> None:
            models.enter(stage)
            object.__setattr__(pipe, component, models[component])

        return before

    original.on_call(pipe, "encode_prompt", before=bring("encode", "text_encoder"))
    original.on_call(pipe, "prepare_latents", before=bring("denoise", "unet"))
    decode = bring("decode", "vae")

    def last_step(pipeline, i, t, kwargs):
        if i == pipeline.num_timesteps - 1:
            decode()
        return {}

    return pipe, models, last_step


def run_arm(args) -> None:
    import diffusers  # noqa: F401  (the baseline holds what every arm imports)
    import numpy as np
    import torch

    if args.run != "original":
        import stageload_rs  # noqa: F401
    else:
        import stageload  # noqa: F401
    start_rss = vm_rss()
    # the unwrapped pipeline's second image measures each stage's working memory (its rise with
    # every model resident and faulted in): trimmed, none of it is heap the first image left free
    stages = Stages(trim=args.run == "unwrapped")
    folder = Path(args.folder)
    callback = None
    models = None
    if args.run == "unwrapped":
        from diffusers import StableDiffusionPipeline

        pipe = StableDiffusionPipeline.from_pretrained(str(folder))
    elif args.run == "original":
        pipe, models, callback = original_pipeline(folder, stages.released)
    else:
        from diffusers import StableDiffusionPipeline
        from stageload_rs.diffusers import staged_pipeline

        mode, reload = ("staged", "copy") if args.run == "copy" else (args.run, "map")

        class Released:
            def emit(self, event) -> None:
                if event.kind == "release":
                    stages.released()

        pipe, models = staged_pipeline(
            StableDiffusionPipeline, folder, mode=mode, reload=reload, events=Released()
        )
    pipe.set_progress_bar_config(disable=True)
    prompt = (folder / "prompt.txt").read_text()
    set_timesteps = pipe.scheduler.set_timesteps

    def timesteps(*a, **k):
        stages.boundary("denoise")
        return set_timesteps(*a, **k)

    pipe.scheduler.set_timesteps = timesteps

    def on_step_end(pipeline, i, t, kwargs):
        if i == pipeline.num_timesteps - 1:
            stages.boundary("decode")  # before the arm's own callback: its load is decode's
        return callback(pipeline, i, t, kwargs) if callback is not None else {}

    images = []
    runs = []
    for image in range(2):
        stages.boundary("encode")
        out = pipe(
            prompt,
            num_inference_steps=args.steps,
            guidance_scale=7.5,
            height=args.size,
            width=args.size,
            generator=torch.Generator().manual_seed(7),
            output_type="np",
            callback_on_step_end=on_step_end,
        )
        stages.boundary(None)
        runs.append(stages.rows)
        stages.rows = []
        stages.reset("between")
        images.append(out.images)
    if models is not None:
        models.close()
    import gc

    gc.collect()
    kept = vm_rss() - start_rss
    out_dir = Path(args.out)
    np.save(out_dir / f"{args.tag}.npy", np.stack(images))
    record = {"arm": args.run, "images": runs, "kept": kept, "baseline": start_rss}
    (out_dir / f"{args.tag}.json").write_text(json.dumps(record))


def drive(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    if not args.without_cbwr:
        env["MKL_CBWR"] = "COMPATIBLE"
    original = env.get("STAGELOAD_ORIGINAL")
    if not original:
        raise SystemExit(
            "python_side_by_side: STAGELOAD_ORIGINAL is not set (scripts/setup-reference.sh prints it)"
        )
    env["PYTHONPATH"] = os.pathsep.join(p for p in (original, env.get("PYTHONPATH")) if p)
    arms = args.arms.split(",")
    for round_ in range(args.rounds):
        for arm in arms:
            tag = f"{arm}-{round_ + 1}"
            command = [
                args.guard,
                "guard",
                "--",
                sys.executable,
                __file__,
                "--run",
                arm,
                "--tag",
                tag,
                "--folder",
                args.folder,
                "--out",
                args.out,
                "--steps",
                str(args.steps),
                "--size",
                str(args.size),
            ]
            began = time.time()
            done = subprocess.run(command, env=env, check=False, timeout=3600)
            print(
                f"{tag}: exit {done.returncode} in {time.time() - began:.0f} s",
                file=sys.stderr,
                flush=True,
            )
            if done.returncode != 0:
                raise SystemExit(f"python_side_by_side: {tag} failed (exit {done.returncode})")
    if not summarize(out, arms, args):
        raise SystemExit(
            "python_side_by_side: an arm's images differ from the unwrapped pipeline's"
        )


def weights(folder: Path, component: str) -> int:
    """The bytes of a component's tensors: its safetensors files less their headers."""
    total = 0
    for file in (folder / component).glob("*.safetensors"):
        with file.open("rb") as f:
            total += file.stat().st_size - 8 - int.from_bytes(f.read(8), "little")
    return total


def within_bound(runs: dict, arms: list[str], folder: Path) -> list[str]:
    """An arm's peak per stage against what the stage needs: the larger of its RSS at the
    stage's start (the model the stage before left resident is still there) and its RSS once the
    stage has released that model (its start, where it released none) plus the stage's model and
    its working memory (the rise of the unwrapped pipeline's second image in that stage, every
    model resident and faulted in before it, the C heap trimmed at its start)."""
    gib = 1 << 30
    size = {c: weights(folder, c) for c, _ in STAGE_MODELS.values()}

    def median(arm: str, image: int, stage: str, key) -> float:
        return statistics.median(
            key(row) for run in runs[arm] for row in run["images"][image] if row["stage"] == stage
        )

    lines = [
        "## Peak against the stage's own weights and working memory",
        "",
        "| arm | image | " + " | ".join(f"{s} peak / need" for s in STAGE_MODELS) + " |",
        "|---|---|" + "---|" * len(STAGE_MODELS),
    ]
    # the original beside them, for scale; prefetch holds the next stage's model too
    for arm in (a for a in arms if a in ("original", "staged", "copy")):
        for image in range(2):
            cells = []
            for stage, (model, _) in STAGE_MODELS.items():
                working = median("unwrapped", 1, stage, lambda r: r["peak"] - r["start_rss"])
                base = median(arm, image, stage, lambda r: r.get("released_rss") or r["start_rss"])
                start = median(arm, image, stage, lambda r: r["start_rss"])
                need = max(start, base + size[model] + working)
                peak = median(arm, image, stage, lambda r: r["peak"])
                cells.append(f"{peak / gib:.3f} / {need / gib:.3f} = {peak / need:.3f}")
            lines.append(f"| {arm} | {image + 1} | " + " | ".join(cells) + " |")
    return lines + [""]


def second_against_first(runs: dict, arms: list[str]) -> list[str]:
    """Each arm's second image against its first, per stage: the peak's ratio, and what the
    process held more at the stage's start, split into file pages (the code of the kernels the
    first image ran, libtorch's among them, paged in once) and anonymous memory."""
    mib = 1 << 20

    def median(arm: str, image: int, stage: str, key: str) -> float:
        return statistics.median(
            row[key] for run in runs[arm] for row in run["images"][image] if row["stage"] == stage
        )

    lines = [
        "## The second image against the first",
        "",
        (
            "Per stage: peak 2 / peak 1, and what the stage's start held more in image 2 "
            "(MiB of file pages + MiB of anonymous memory)."
        ),
        "",
        "| arm | " + " | ".join(STAGE_MODELS) + " |",
        "|---|" + "---|" * len(STAGE_MODELS),
    ]
    for arm in arms:
        if any("start_file" not in row for run in runs[arm] for row in run["images"][0]):
            continue  # runs recorded before the split
        cells = []
        for stage in STAGE_MODELS:
            ratio = median(arm, 1, stage, "peak") / median(arm, 0, stage, "peak")
            file = (median(arm, 1, stage, "start_file") - median(arm, 0, stage, "start_file")) / mib
            anon = (median(arm, 1, stage, "start_anon") - median(arm, 0, stage, "start_anon")) / mib
            cells.append(f"{ratio:.3f} ({file:+.0f} + {anon:+.0f})")
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return lines + [""]


def paired(rounds: dict[str, dict[int, dict]], arms: list[str]) -> list[str]:
    """Each arm's run against the original's of the same round (run just before or after it, so
    that both see the machine in the same state), per stage: the median of those ratios and
    their smallest and largest, which show what the machine's noise does to one comparison."""

    def value(run: dict, image: int, stage: str, key: str) -> float | None:
        rows = [row[key] for row in run["images"][image] if row["stage"] == stage]
        return rows[0] if rows else None

    original = rounds["original"]
    lines = [
        "## Per round, against the original's run of the same round",
        "",
        "Median of the ratios [smallest-largest].",
        "",
        "| arm | image | " + " | ".join(f"{s} peak | {s} s" for s in STAGES) + " |",
        "|---|---|" + "---|---|" * len(STAGES),
    ]
    for arm in arms:
        if arm == "original":
            continue
        for image in range(2):
            cells = []
            for stage in STAGES:
                for key in ("peak", "seconds"):
                    ratios = []
                    for round_, run in rounds[arm].items():
                        mine = value(run, image, stage, key)
                        theirs = (
                            value(original[round_], image, stage, key)
                            if round_ in original
                            else None
                        )
                        if mine is not None and theirs:
                            ratios.append(mine / theirs)
                    cells.append(
                        f"{statistics.median(ratios):.3f} [{min(ratios):.2f}-{max(ratios):.2f}]"
                        if ratios
                        else ""
                    )
            lines.append(f"| {arm} | {image + 1} | " + " | ".join(cells) + " |")
    return lines + [""]


def summarize(out: Path, arms: list[str], args) -> bool:
    """Writes summary.md; whether every arm's images equal the unwrapped pipeline's."""
    import numpy as np

    # each arm's runs by round (the number in the file's name)
    rounds = {
        arm: {
            int(p.stem.rsplit("-", 1)[1]): json.loads(p.read_text())
            for p in out.glob(f"{arm}-*.json")
        }
        for arm in arms
    }
    runs = {arm: [rounds[arm][n] for n in sorted(rounds[arm])] for arm in arms}
    reference = np.load(out / "unwrapped-1.npy") if "unwrapped" in arms else None
    gib = 1 << 30

    def median(arm: str, image: int, stage: str, key: str) -> float:
        return statistics.median(
            row[key] for run in runs[arm] for row in run["images"][image] if row["stage"] == stage
        )

    lines = [
        f"# Stable Diffusion, {args.size}x{args.size}, {args.steps} DDIM steps, side by side",
        "",
        (
            f"Median of {args.rounds} runs per arm, each its own process under `stageload guard`, alternating. "
            "Peak: VmHWM reset at each boundary (GiB); time in seconds; ratios to the original's."
        ),
        "",
    ]
    for image in range(2):
        lines += [
            f"## Image {image + 1}",
            "",
            "| arm | " + " | ".join(f"{s} peak | {s} s" for s in STAGES) + " |",
            "|---|" + "---|---|" * len(STAGES),
        ]
        for arm in arms:
            cells = []
            for stage in STAGES:
                try:
                    cells += [
                        f"{median(arm, image, stage, 'peak') / gib:.3f}",
                        f"{median(arm, image, stage, 'seconds'):.2f}",
                    ]
                except statistics.StatisticsError:
                    cells += ["", ""]
            lines.append(f"| {arm} | " + " | ".join(cells) + " |")
        lines.append("")
        if "original" in arms:
            lines += [
                "| arm / original | " + " | ".join(f"{s} peak | {s} s" for s in STAGES) + " |",
                "|---|" + "---|---|" * len(STAGES),
            ]
            for arm in arms:
                cells = []
                for stage in STAGES:
                    try:
                        cells += [
                            f"{median(arm, image, stage, k) / median('original', image, stage, k):.3f}"
                            for k in ("peak", "seconds")
                        ]
                    except (statistics.StatisticsError, ZeroDivisionError):
                        cells += ["", ""]
                lines.append(f"| {arm} | " + " | ".join(cells) + " |")
            lines.append("")
    if "original" in arms:
        lines += paired(rounds, arms)
    lines += second_against_first(runs, arms)
    if "unwrapped" in arms:
        lines += within_bound(runs, arms, Path(args.folder))
    lines += ["## Kept after both images, every model released (GiB), and outputs", ""]
    all_equal = True
    for arm in arms:
        kept = statistics.median(run["kept"] for run in runs[arm]) / gib
        same = ""
        if reference is not None:
            equal = all(
                np.array_equal(np.load(p), reference) for p in sorted(out.glob(f"{arm}-*.npy"))
            )
            same = (
                "both images equal to the unwrapped pipeline's bit for bit"
                if equal
                else "IMAGES DIFFER"
            )
            all_equal = all_equal and equal
        lines.append(f"- {arm}: kept {kept:.3f} GiB; {same}")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return all_equal


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--folder", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--guard", help="the stageload binary (driver)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--arms", default="unwrapped,original,staged,prefetch")
    ap.add_argument(
        "--run",
        choices=["unwrapped", "original", "staged", "prefetch", "copy"],
        help="one arm, in this process",
    )
    ap.add_argument(
        "--without-cbwr",
        action="store_true",
        help="run the arms without MKL_CBWR=COMPATIBLE, as a user would (the copy arm's images "
        "may then differ: copied weights sit at other offsets than from_pretrained's mapping)",
    )
    ap.add_argument("--tag")
    ap.add_argument("--summarize-only", action="store_true")
    args = ap.parse_args()
    if args.run:
        run_arm(args)
    elif args.summarize_only:
        summarize(Path(args.out), args.arms.split(","), args)
    else:
        if not args.guard:
            raise SystemExit("python_side_by_side: --guard names the stageload binary")
        drive(args)


if __name__ == "__main__":
    main()
