"""Peers of crates/bench/src/bin/gpu_check.rs on the same checkpoint, in the same run: Python's safetensors
straight to CUDA, safetensors to the CPU then .to("cuda"), and the host→device copy limits (1 GiB
from pinned and from pageable memory). Prints one JSON object of medians in GB/s.

    python bench_device.py FILE ROUNDS
"""

import json
import os
import statistics
import sys
import time

import torch

path, rounds = sys.argv[1], int(sys.argv[2])
size = os.path.getsize(path)
result = {}


def rate(run, nbytes):
    rates = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        kept = run()
        torch.cuda.synchronize()
        rates.append(nbytes / (time.perf_counter() - start) / 1e9)
        del kept
        torch.cuda.empty_cache()
    return statistics.median(rates)


try:
    from safetensors.torch import load_file

    result["load_file_cuda"] = rate(lambda: load_file(path, device="cuda"), size)
    result["load_file_then_to_cuda"] = rate(
        lambda: {k: v.to("cuda") for k, v in load_file(path).items()}, size
    )
except ImportError as e:
    result["safetensors"] = f"not installed: {e}"
gib = 1 << 30
pinned = torch.empty(gib, dtype=torch.uint8, pin_memory=True)
pageable = torch.ones(gib, dtype=torch.uint8)
target = torch.empty(gib, dtype=torch.uint8, device="cuda")
result["pinned_h2d"] = rate(lambda: target.copy_(pinned, non_blocking=True), gib)
result["pageable_h2d"] = rate(lambda: target.copy_(pageable), gib)
result["torch"] = torch.__version__
print(json.dumps(result))
