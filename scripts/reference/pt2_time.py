"""Python's own first load of an AOTInductor package, for the .pt2 benchmark: `aoti_load_package`,
then `load_constants` with the checkpoint's tensors (`safetensors.torch.load_file`; the runner
copies them), in this fresh process, with torch._inductor already imported (its import, about
4 s and 150 MB here, is Python's cost of a first package in a process, not of the load). Prints JSON: seconds, and the resident set's growth and
peak (VmHWM) over the resident set before, in bytes.

    python pt2_time.py PACKAGE CHECKPOINT
"""
import json
import sys
import time

import torch
import torch._inductor.package  # noqa: F401  (imported before the clock starts: not the load's cost)
from safetensors.torch import load_file


def memory():
    fields = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


package, checkpoint = sys.argv[1], sys.argv[2]
before, _ = memory()
started = time.perf_counter()
loaded = torch._inductor.aoti_load_package(package)
loaded.load_constants(load_file(checkpoint), check_full_update=True)
seconds = time.perf_counter() - started
after, peak = memory()
print(json.dumps({"load_s": seconds, "rss_growth": after - before, "peak_growth": peak - before}))
