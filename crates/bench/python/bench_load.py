"""Python peers of crates/bench/src/bin/bench_load.rs: each loads the checkpoint into an existing
model's parameters, on the CPU, in its documented fastest CPU configuration.

    python bench_load.py PEER CHECKPOINT.safetensors RUNS warm|cold

PEER is one of PEERS below; warm or cold is the page cache the caller leaves (fastsafetensors reads
with O_DIRECT, its default on a local disk, when cold, and through the page cache when warm). The
model's parameters (one zeroed f32 tensor per checkpoint tensor) are made from the checkpoint's
header; each run loads into them (startup is not timed) and prints one JSON line: seconds, bytes,
the transient peak of anonymous memory over the model (VmHWM reset before the load; mapped file
pages subtracted), the same with them, a checksum of the loaded parameters, and the peer's version
and configuration. A peer that cannot be imported or cannot load to the CPU prints one line
{"unavailable": why} and exits 0, so that the benchmark reports it and runs the rest. The `.pt`
peers read CHECKPOINT with the suffix `.pt` (the same weights, written by torch.save with
`--write-pt`).
"""

import importlib.metadata
import json
import os
import sys
import time

import torch
from safetensors import safe_open


class Unavailable(Exception):
    """The peer cannot run here; the message says why."""


def version(package):
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        raise Unavailable(
            f"{package} is not installed (scripts/setup-load-peers.sh installs it)"
        ) from None


def copy_into(params, name, tensor):
    params[name].copy_(tensor)


def load_safetensors(path, params):
    from safetensors.torch import load_file

    state = load_file(path)
    for name, tensor in state.items():
        copy_into(params, name, tensor)
    return state


def load_runai(path, params):
    from runai_model_streamer import SafetensorsStreamer

    # owned=False: views into the streamer's reused buffers, copied into the model as they come
    # (the documented way to consume tensors inline).
    with SafetensorsStreamer() as streamer:
        streamer.stream_file(path, device="cpu", owned=False)
        for name, tensor in streamer.get_tensors():
            copy_into(params, name, tensor)


def load_fastsafetensors(path, params):
    from fastsafetensors import SafeTensorsFileLoader, SingleGroup

    loader = SafeTensorsFileLoader(
        SingleGroup(), "cpu", nogds=True, bbuf_size_kb=FST_BBUF_KB, max_threads=FST_THREADS
    )
    try:
        loader.add_filenames({0: [path]})
        buffer = loader.copy_files_to_device()
        try:
            for name in params:
                copy_into(params, name, buffer.get_tensor(name))
        finally:
            buffer.close()
    finally:
        loader.close()


def load_instanttensor(path, params):
    from instanttensor import safe_open as instant_open

    try:
        opened = instant_open(path, framework="pt", device="cpu", copy=False)
    except ValueError as e:
        raise Unavailable(
            f"cannot load to the CPU: safe_open(device='cpu') raises ValueError: {e}"
        ) from None
    with opened as f:
        for name, tensor in f.tensors():
            copy_into(params, name, tensor)


def pt_path(path):
    return os.path.splitext(path)[0] + ".pt"


def load_torch(path, params, mmap):
    state = torch.load(pt_path(path), map_location="cpu", weights_only=True, mmap=mmap)
    for name, tensor in state.items():
        copy_into(params, name, tensor)
    return state


FST_THREADS = 16
FST_BBUF_KB = 16 * 1024

# name: (package for the version, load, configuration)
PEERS = {
    "safetensors": (
        "safetensors",
        load_safetensors,
        "safetensors.torch.load_file (mmap), copied into the model",
    ),
    "runai-model-streamer": (
        "runai-model-streamer",
        load_runai,
        "SafetensorsStreamer, RUNAI_STREAMER_CONCURRENCY={}, RUNAI_STREAMER_CHUNK_BYTESIZE={}, memory limit {}, owned=False, each tensor copied into the model",
    ),
    "fastsafetensors": (
        "fastsafetensors",
        load_fastsafetensors,
        (
            f"SafeTensorsFileLoader(nogds=True, max_threads={FST_THREADS}, "
            f"bbuf_size_kb={FST_BBUF_KB}), FASTSAFETENSORS_ODIRECT={{}}, copied into the model"
        ),
    ),
    "instanttensor": (
        "instanttensor",
        load_instanttensor,
        "safe_open(copy=False), each tensor copied into the model",
    ),
    "torch.load": (
        "torch",
        lambda p, params: load_torch(p, params, False),
        "torch.load(weights_only=True) of the .pt, copied into the model",
    ),
    "torch.load-mmap": (
        "torch",
        lambda p, params: load_torch(p, params, True),
        "torch.load(weights_only=True, mmap=True) of the .pt, copied into the model",
    ),
}


def configuration(peer, template):
    if peer == "runai-model-streamer":
        env = os.environ
        return template.format(
            env.get("RUNAI_STREAMER_CONCURRENCY", "16 (default)"),
            env.get("RUNAI_STREAMER_CHUNK_BYTESIZE", "2 MiB (default)"),
            env.get("RUNAI_STREAMER_MEMORY_LIMIT", "40 GB (default)"),
        )
    if peer == "fastsafetensors":
        return template.format(
            os.environ.get("FASTSAFETENSORS_ODIRECT", "1 (its default on a local disk)")
        )
    return template


def status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def parameters_for(path):
    """The model's parameters, one zeroed tensor per checkpoint tensor, by name (written, so resident
    before the first load, as the Rust side's model is)."""
    with safe_open(path, framework="pt") as f:
        return {name: torch.empty(f.get_slice(name).get_shape()).fill_(0.0) for name in f.keys()}  # noqa: SIM118 (safe_open is no dict)


def write_pt(path):
    """The same weights as PATH, as a torch.save file beside it (once)."""
    from safetensors.torch import load_file

    target = pt_path(path)
    if not os.path.exists(target):
        torch.save(load_file(path), target + ".tmp")
        os.replace(target + ".tmp", target)


def main(peer, path, runs, cache):
    if peer not in PEERS:
        sys.exit(f"unknown peer {peer!r}: one of {', '.join(PEERS)}")
    if cache not in ("warm", "cold"):
        sys.exit(f"unknown cache {cache!r}: warm or cold")
    if cache == "warm":
        os.environ.setdefault("FASTSAFETENSORS_ODIRECT", "0")
    package, load, template = PEERS[peer]
    params = parameters_for(path)
    model_bytes = sum(p.numel() * p.element_size() for p in params.values())
    try:
        peer_version = version(package)
        for _ in range(runs):
            before, file_before = status("VmRSS"), status("RssFile")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            start = time.perf_counter()
            # What a peer returns may still map the file: its pages are counted before it goes.
            still_mapped = load(path, params)
            seconds = time.perf_counter() - start
            file_pages = status("RssFile") - file_before
            with_file = status("VmHWM") - before
            del still_mapped
            checksum = sum(p.double().sum().item() for p in params.values())
            print(
                json.dumps(
                    {
                        "seconds": seconds,
                        "bytes": model_bytes,
                        "peak_over": with_file - file_pages,
                        "peak_with_file": with_file,
                        "checksum": checksum,
                        "version": peer_version,
                        "configuration": configuration(peer, template),
                    }
                ),
                flush=True,
            )
    except (Unavailable, ImportError) as e:
        print(json.dumps({"unavailable": f"{peer}: {e}"}), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--write-pt"]:
        write_pt(sys.argv[2])
    else:
        main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
