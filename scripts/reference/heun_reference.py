"""Reference tables and runs of diffusers' HeunDiscreteScheduler as ShapEImg2ImgPipeline configures
it (CPU, float32), for tests/heun.rs.

    python heun_reference.py CONFIG.json OUT.safetensors TABLE_STEPS RUN_STEPS SEED

CONFIG.json is written by shap_e_scheduler.write_config (the configuration and the numpy
`log_sigmas` table the Rust port reads). TABLE_STEPS and RUN_STEPS are comma-separated step counts.
OUT holds `log_sigmas` (f32, the table as diffusers computes it), `train_sigmas` (f32, the
sigmas it is the log of) and, for each n of TABLE_STEPS,
`n{n}.sigmas` (2n f32), `n{n}.timesteps` (2n-1 f32) and `n{n}.init_noise_sigma` (f32, shape [1]).
For each n of RUN_STEPS, a whole run as the pipeline makes it, with inputs drawn here from a
torch.Generator seeded with SEED + n: `n{n}.latents` (standard normal), `n{n}.initial` = latents *
init_noise_sigma, and for each model call i in 0..2n-1: `n{n}.model_output.{i}` (standard normal
times 1.5, so that clipping to 1.0 bites), `n{n}.scaled.{i}` = scale_model_input(sample_i, t_i),
`n{n}.prev.{i}` = step(model_output_i, t_i, sample_i).prev_sample (the next call's sample), and
the state step leaves: `n{n}.first_order.{i}` (int64 [1]: 1 when the next step is first order)
and, after a first-order step, `n{n}.derivative.{i}`, `n{n}.dt.{i}` (f32 [1]) and
`n{n}.stored.{i}` (the sample the second-order step starts from)."""
import os
import sys

import torch
from safetensors.torch import save_file

try:
    import diffusers
except ImportError as error:
    sys.exit(
        f"heun_reference: diffusers is not installed in {sys.prefix} ({error}); "
        'run eval "$(scripts/setup-reference.sh)", which installs it, '
        f"or install it by hand: {sys.executable} -m pip install diffusers==0.42.1"
    )

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shap_e_scheduler  # noqa: E402

SHAPE = (2, 16, 8)

config_path, out = sys.argv[1], sys.argv[2]
table_steps = [int(n) for n in sys.argv[3].split(",") if n]
run_steps = [int(n) for n in sys.argv[4].split(",") if n]
seed = int(sys.argv[5])

sched = shap_e_scheduler.scheduler()
written = shap_e_scheduler.write_config(config_path, sched)
table = shap_e_scheduler.log_sigmas(sched)
assert (written.view("int32") == table.view("int32")).all(), "the JSON does not hold the table bit for bit"
train_sigmas = ((1 - sched.alphas_cumprod) / sched.alphas_cumprod) ** 0.5
result = {"log_sigmas": torch.from_numpy(table).contiguous(), "train_sigmas": train_sigmas.contiguous()}


def as_1d(value):
    return value.reshape(1).contiguous()


# One scheduler for the tables (set_timesteps recomputes them; building one costs a set_timesteps
# of 1024 steps), a fresh one for each run.
for n in table_steps:
    sched.set_timesteps(n)
    result[f"n{n}.sigmas"] = sched.sigmas.contiguous()
    result[f"n{n}.timesteps"] = sched.timesteps.contiguous()
    result[f"n{n}.init_noise_sigma"] = as_1d(sched.init_noise_sigma)

for n in run_steps:
    sched = shap_e_scheduler.scheduler()
    sched.set_timesteps(n)
    generator = torch.Generator().manual_seed(seed + n)
    latents = torch.randn(SHAPE, generator=generator, dtype=torch.float32)
    result[f"n{n}.latents"] = latents
    # As ShapEImg2ImgPipeline.prepare_latents and its denoising loop do.
    sample = latents * sched.init_noise_sigma
    result[f"n{n}.initial"] = sample.clone()
    for i, t in enumerate(sched.timesteps):
        model_output = torch.randn(SHAPE, generator=generator, dtype=torch.float32) * 1.5
        result[f"n{n}.model_output.{i}"] = model_output
        result[f"n{n}.scaled.{i}"] = sched.scale_model_input(sample, t).contiguous()
        sample = sched.step(model_output, timestep=t, sample=sample).prev_sample.contiguous()
        result[f"n{n}.prev.{i}"] = sample
        first_order = sched.state_in_first_order
        result[f"n{n}.first_order.{i}"] = torch.tensor([int(first_order)], dtype=torch.int64)
        if not first_order:
            result[f"n{n}.derivative.{i}"] = sched.prev_derivative.contiguous()
            result[f"n{n}.dt.{i}"] = as_1d(sched.dt)
            result[f"n{n}.stored.{i}"] = sched.sample.clone()
    assert sched.step_index == 2 * n - 1, (n, sched.step_index)

save_file(result, out)
print(
    f"heun_reference: diffusers {diffusers.__version__}, torch {torch.__version__}, "
    f"{len(table_steps)} tables, {len(run_steps)} runs, {len(result)} tensors"
)
