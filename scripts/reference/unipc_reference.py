"""Reference schedules and runs of diffusers' UniPCMultistepScheduler as the Wan2.1 text-to-video
pipeline configures it (CPU), for tests/unipc.rs and the Rust port in crates/pipelines/src/schedulers/unipc.rs.

    python unipc_reference.py SPEC.json OUT_DIR

SPEC.json (written by the test) holds:

- `seed`: the generator seed of the runs; `shape`: the shape of the runs' samples;
- `configs`: name -> overrides of the published configuration (PUBLISHED below), e.g.
  `{"flow_shift": 5.0}` for 720p;
- `tables`: name -> step counts whose schedules are written;
- `runs`: a list of `{"config": name, "dtype": "float32" | "bfloat16" | "float16", "steps": [n]}`.

For each configuration, OUT_DIR/NAME/scheduler_config.json is what diffusers' `save_config` writes
(the format of a published `scheduler/scheduler_config.json`, which the Rust side parses).
OUT_DIR/reference.safetensors holds, for each table name and n, `NAME.n{n}.timesteps` (int64, n)
and `NAME.n{n}.sigmas` (float32, n + 1) after `set_timesteps(n)`; for each run, under the prefix
`NAME.DTYPE.n{n}`, a whole run as pipeline_wan.py makes it (`set_timesteps(n)`,
`set_begin_index(0)`, one `step(model_output, t, latents)` per timestep), its inputs drawn from a
torch.Generator seeded with `seed + n`: `.sample` (the float32 starting latents), and for each step
i: `.model_output.{i}` (standard normal in float32, then cast to DTYPE, as the bf16 transformer's
output would be), `.prev.{i}` (the step's result, the next step's sample), `.x0.{i}` (the converted
output the step appended, `model_outputs[-1]`), `.last_sample.{i}` (the sample after the
corrector, which the predictor stepped from) and `.state.{i}` (int64: `this_order`,
`lower_order_nums`, `step_index` after the step). `.sample` and the model outputs are the inputs the
Rust side replays."""
import json
import os
import sys

import torch
from safetensors.torch import save_file

try:
    import diffusers
    from diffusers import UniPCMultistepScheduler
except ImportError as error:
    sys.exit(
        f"unipc_reference: diffusers is not installed in {sys.prefix} ({error}); "
        'run eval "$(scripts/setup-reference.sh)", which installs it, '
        f"or install it by hand: {sys.executable} -m pip install diffusers==0.42.1"
    )

# Wan-AI/Wan2.1-T2V-1.3B-Diffusers scheduler/scheduler_config.json (its keys; diffusers' defaults
# fill the rest). flow_shift 3.0 is the 480p value; diffusers' Wan docs use 5.0 for 720p.
PUBLISHED = dict(
    num_train_timesteps=1000,
    beta_start=0.0001,
    beta_end=0.02,
    beta_schedule="linear",
    trained_betas=None,
    solver_order=2,
    prediction_type="flow_prediction",
    thresholding=False,
    dynamic_thresholding_ratio=0.995,
    sample_max_value=1.0,
    predict_x0=True,
    solver_type="bh2",
    lower_order_final=True,
    disable_corrector=[],
    solver_p=None,
    use_karras_sigmas=False,
    use_exponential_sigmas=False,
    use_beta_sigmas=False,
    use_flow_sigmas=True,
    flow_shift=3.0,
    timestep_spacing="linspace",
    steps_offset=0,
    final_sigmas_type="zero",
    rescale_betas_zero_snr=False,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

spec_path, out = sys.argv[1], sys.argv[2]
with open(spec_path) as file:
    spec = json.load(file)
seed, shape = spec["seed"], tuple(spec["shape"])


def scheduler(name):
    return UniPCMultistepScheduler(**{**PUBLISHED, **spec["configs"][name]})


def public(config):
    return {key: value for key, value in config.items() if not key.startswith("_")}


for name in spec["configs"]:
    folder = os.path.join(out, name)
    scheduler(name).save_config(folder)
    # What the pipeline does with the file: from_pretrained reads it back into the same scheduler.
    with open(os.path.join(folder, "scheduler_config.json")) as file:
        again = UniPCMultistepScheduler.from_config(json.load(file))
    assert public(again.config) == public(scheduler(name).config), name

result = {}
for name, steps in spec["tables"].items():
    sched = scheduler(name)
    for n in steps:
        sched.set_timesteps(n)
        assert sched.timesteps.dtype == torch.int64 and sched.sigmas.dtype == torch.float32
        result[f"{name}.n{n}.timesteps"] = sched.timesteps.contiguous()
        result[f"{name}.n{n}.sigmas"] = sched.sigmas.contiguous()

steps_run = 0
for run in spec["runs"]:
    name, dtype = run["config"], run["dtype"]
    for n in run["steps"]:
        prefix = f"{name}.{dtype}.n{n}"
        sched = scheduler(name)
        # As WanPipeline.__call__: set_timesteps, then set_begin_index(0) before the loop.
        sched.set_timesteps(n)
        sched.set_begin_index(0)
        generator = torch.Generator().manual_seed(seed + n)
        latents = torch.randn(shape, generator=generator, dtype=torch.float32)
        result[f"{prefix}.sample"] = latents
        for i, t in enumerate(sched.timesteps):
            model_output = torch.randn(shape, generator=generator, dtype=torch.float32).to(DTYPES[dtype])
            result[f"{prefix}.model_output.{i}"] = model_output
            latents = sched.step(model_output, t, latents, return_dict=False)[0]
            assert latents.dtype == torch.float32, (prefix, i, latents.dtype)
            result[f"{prefix}.prev.{i}"] = latents.contiguous()
            result[f"{prefix}.x0.{i}"] = sched.model_outputs[-1].contiguous()
            result[f"{prefix}.last_sample.{i}"] = sched.last_sample.contiguous()
            result[f"{prefix}.state.{i}"] = torch.tensor(
                [sched.this_order, sched.lower_order_nums, sched.step_index], dtype=torch.int64
            )
            steps_run += 1
        assert sched.step_index == n, (prefix, sched.step_index)

# Tensors that share memory (a last_sample that is the previous step's result) are stored once
# each: save_file refuses shared storage, so clone what is shared.
result = {key: value.clone() for key, value in result.items()}
save_file(result, os.path.join(out, "reference.safetensors"))
print(
    f"unipc_reference: diffusers {diffusers.__version__}, torch {torch.__version__}, "
    f"{len(spec['configs'])} configurations, {sum(len(s) for s in spec['tables'].values())} schedules, "
    f"{steps_run} steps, {len(result)} tensors"
)
