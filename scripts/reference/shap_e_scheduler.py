"""The scheduler of diffusers' ShapEImg2ImgPipeline (openai/shap-e-img2img) and its export for
stageload's Rust port (crates/pipelines/src/schedulers/heun.rs).

    python shap_e_scheduler.py OUT.json

writes the scheduler's configuration and its `log_sigmas` table as the Rust side reads them
(`HeunConfig::from_json_file`). The table is DATA, not something Rust recomputes: diffusers builds
it with `np.log` on a float32 array, and numpy's own SIMD float32 log differs from glibc's `logf`
(and from `torch.log`) in the last bit at tens of the 1,024 entries; the fractional timesteps the
prior sees are interpolated in it. The table written here is the one `HeunDiscreteScheduler`
computes in `set_timesteps`, taken from numpy as diffusers takes it; `heun_reference.py` uses this
function, and the Shap-E export is meant to call it too."""
import json
import sys
import warnings

import numpy as np
import torch

# The published scheduler/scheduler_config.json of openai/shap-e-img2img. timestep_spacing is
# absent there, so diffusers' default "linspace" applies; steps_offset (0) is unused by linspace.
CONFIG = dict(
    beta_schedule="exp",
    num_train_timesteps=1024,
    prediction_type="sample",
    use_karras_sigmas=True,
    clip_sample=True,
    clip_sample_range=1.0,
)

FORMAT = "stageload heun scheduler 1"


def scheduler(config=None):
    """diffusers' HeunDiscreteScheduler with `config` (the pipeline's when None)."""
    from diffusers import HeunDiscreteScheduler

    return HeunDiscreteScheduler(**(CONFIG if config is None else config))


def log_sigmas(sched):
    """The float32 table `set_timesteps` interpolates timesteps in, computed by diffusers' own
    expression (scheduling_heun_discrete.py, set_timesteps)."""
    with warnings.catch_warnings():
        # numpy 2's note that a torch tensor's __array__ takes no copy keyword (diffusers' own line).
        warnings.simplefilter("ignore", DeprecationWarning)
        sigmas = np.array(((1 - sched.alphas_cumprod) / sched.alphas_cumprod) ** 0.5)
    table = np.log(sigmas)
    assert table.dtype == np.float32, table.dtype
    return table


def config_json(sched=None):
    """The JSON document the Rust port reads: the scheduler's full diffusers configuration and
    its `log_sigmas` table (float32 values written as the shortest decimals that read back to the
    same doubles, so the same float32 values)."""
    import diffusers

    sched = scheduler() if sched is None else sched
    table = log_sigmas(sched)
    # diffusers' own scheduler_config.json document (with _class_name and _diffusers_version).
    config = json.loads(sched.to_json_string())
    return {
        "format": FORMAT,
        "scheduler_config": config,
        "log_sigmas": [float(value) for value in table],
        "log_sigmas_source": f"np.log over float32 (numpy {np.__version__}, diffusers {diffusers.__version__}, "
        f"torch {torch.__version__})",
    }


def write_config(path, sched=None):
    """Writes `config_json(sched)` to `path` and returns the table written."""
    document = config_json(sched)
    with open(path, "w") as file:
        json.dump(document, file, indent=1)
        file.write("\n")
    return np.array(document["log_sigmas"], dtype=np.float32)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} OUT.json")
    write_config(sys.argv[1])
    print(f"shap_e_scheduler: wrote {sys.argv[1]}")
