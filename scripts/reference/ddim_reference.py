"""Reference DDIM steps by diffusers' DDIMScheduler with Stable Diffusion 1.5's scheduler
configuration (CPU, float32, eta = 0), for tests/ddim.rs.

    python ddim_reference.py IN.safetensors OUT.safetensors

IN holds `steps` (int64: the inference step counts) and, for each count n and step i in 0..n,
`n{n}.noise.{i}` and `n{n}.sample.{i}` (f32). OUT holds `alphas_cumprod` (f32) and, for each n,
`n{n}.timesteps` (int64, descending), `n{n}.prev.{i}` = step(noise_i, t_i, sample_i).prev_sample
and `n{n}.chained.{i}`: the chain started from sample_0, each step's output the next one's sample."""
import os
import sys

import torch
from safetensors.torch import load_file, save_file

try:
    import diffusers
    from diffusers import DDIMScheduler
except ImportError as error:
    sys.exit(
        f"ddim_reference: diffusers is not installed in {sys.prefix} ({error}); "
        'run eval "$(scripts/setup-reference.sh)", which installs it, '
        f"or install it by hand: {sys.executable} -m pip install diffusers==0.42.1"
    )

# Stable Diffusion 1.5's scheduler/scheduler_config.json, read as DDIM (the export's own).
sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sd_export import SCHEDULER as CONFIG  # noqa: E402

source, out = sys.argv[1], sys.argv[2]
inputs = load_file(source)
result = {}
for n in inputs["steps"].tolist():
    scheduler = DDIMScheduler(**CONFIG)
    scheduler.set_timesteps(n)
    result["alphas_cumprod"] = scheduler.alphas_cumprod.contiguous()
    result[f"n{n}.timesteps"] = scheduler.timesteps.to(torch.int64).contiguous()
    chained = inputs[f"n{n}.sample.0"]
    # As a pipeline does: the timesteps are 0-d int64 tensors from scheduler.timesteps.
    for i, t in enumerate(scheduler.timesteps):
        noise = inputs[f"n{n}.noise.{i}"]
        prev = scheduler.step(noise, t, inputs[f"n{n}.sample.{i}"], eta=0.0).prev_sample
        chained = scheduler.step(noise, t, chained, eta=0.0).prev_sample
        result[f"n{n}.prev.{i}"] = prev.contiguous()
        result[f"n{n}.chained.{i}"] = chained.contiguous()
save_file(result, out)
print(f"ddim_reference: diffusers {diffusers.__version__}, torch {torch.__version__}, {len(result)} tensors")
