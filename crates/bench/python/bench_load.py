"""Python peer of crates/bench/src/bin/bench_load.rs: safetensors.torch.load_file + load_state_dict.

Builds the same model (layers.N as nn.Linear), then loads the checkpoint once per run with the
warm page cache and prints one JSON line per run: seconds, bytes, and the transient peak of
anonymous memory over the model (VmHWM reset before the load; mapped file pages subtracted).
"""
import json, sys, time
import torch
from safetensors import safe_open
from safetensors.torch import load_file


def status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def main(path, runs):
    shapes = {}
    with safe_open(path, framework="pt") as f:
        for key in f.keys():
            shapes[key] = f.get_slice(key).get_shape()
    layers = sorted({int(k.split(".")[1]) for k in shapes})
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(
        torch.nn.Linear(shapes[f"layers.{i}.weight"][1], shapes[f"layers.{i}.weight"][0]) for i in layers
    )
    model_bytes = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    for _ in range(runs):
        before, file_before = status("VmRSS"), status("RssFile")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        start = time.perf_counter()
        state = load_file(path)
        model.load_state_dict(state)
        seconds = time.perf_counter() - start
        file_pages = status("RssFile") - file_before
        with_file = status("VmHWM") - before
        del state
        print(json.dumps({"seconds": seconds, "bytes": model_bytes, "peak_over": with_file - file_pages, "peak_with_file": with_file}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
