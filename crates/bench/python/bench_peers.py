"""The loaders stageload is measured against (issue 73), on the same checkpoint and GPU as
crates/bench/src/bin/gpu_check.rs, in the same run: InstantTensor, fastsafetensors, the Run:ai
model streamer and Python's safetensors, each loading every tensor of FILE onto cuda:0, warm (the
file in the page cache) and from disk (the file's pages dropped before each round with
posix_fadvise(DONTNEED) after an fsync: no root needed; the pages left resident are counted and
reported, since the kernel may keep some). A peer that is not installed or fails is reported
with its error, and the others still run. Prints one JSON object: per peer, its version and the
medians in GB/s.

    python bench_peers.py FILE ROUNDS
"""

import json
import os
import statistics
import sys
import time
import traceback

import torch

path, rounds = sys.argv[1], int(sys.argv[2])
size = os.path.getsize(path)
device = torch.device("cuda", 0)


def drop_cache():
    """Drops the file's pages from the page cache; the fraction still resident after, if known."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return resident_fraction()


def resident_fraction():
    """The fraction of the file's pages in the page cache (mmap + mincore through ctypes), or None."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        page = os.sysconf("SC_PAGE_SIZE")
        pages = (size + page - 1) // page
        fd = os.open(path, os.O_RDONLY)
        try:
            address = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
            if address in (None, ctypes.c_void_p(-1).value):
                return None
            try:
                vec = (ctypes.c_ubyte * pages)()
                if libc.mincore(address, size, vec) != 0:
                    return None
                return sum(b & 1 for b in vec) / pages
            finally:
                libc.munmap(address, size)
        finally:
            os.close(fd)
    except (OSError, AttributeError, ValueError):  # no mapping or no mincore here: unknown
        return None


def warm_cache():
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


def rates(load):
    """Medians of `rounds` loads, warm and from disk, in GB/s; the resident fraction before cold rounds."""
    out = {}
    for mode in ("warm", "cold"):
        measured, resident = [], []
        for _ in range(rounds):
            if mode == "warm":
                warm_cache()
            else:
                resident.append(drop_cache())
            torch.cuda.synchronize()
            start = time.perf_counter()
            kept = load()
            torch.cuda.synchronize()
            measured.append(size / (time.perf_counter() - start) / 1e9)
            del kept
            torch.cuda.empty_cache()
        out[f"{mode}_gb_per_s"] = statistics.median(measured)
        out[f"{mode}_rounds_gb_per_s"] = measured
        if resident and all(r is not None for r in resident):
            out["cold_resident_fraction_max"] = max(resident)
    return out


def instanttensor():
    from instanttensor import safe_open

    def load():
        with safe_open(path, framework="pt", device=0) as f:
            return {name: tensor for name, tensor in f.tensors()}

    return load


def fastsafetensors():
    from fastsafetensors import SafeTensorsFileLoader, SingleGroup

    def load():
        loader = SafeTensorsFileLoader(SingleGroup(), "cuda:0", nogds=True)
        try:
            loader.add_filenames({0: [path]})
            buffer = loader.copy_files_to_device()
            try:
                # Cloned: the buffer's device memory goes with it (a device-to-device copy, ~1 ms/GiB).
                return {name: buffer.get_tensor(name).clone() for name in loader.get_keys()}
            finally:
                buffer.close()
        finally:
            loader.close()

    return load


def runai():
    from runai_model_streamer import SafetensorsStreamer

    def load():
        with SafetensorsStreamer() as streamer:
            streamer.stream_file(path)
            return {name: tensor.to(device) for name, tensor in streamer.get_tensors()}

    return load


def safetensors():
    from safetensors.torch import load_file

    return lambda: load_file(path, device="cuda:0")


result = {"file_bytes": size, "rounds": rounds, "torch": torch.__version__}
for name, module, make in [
    ("instanttensor", "instanttensor", instanttensor),
    ("fastsafetensors", "fastsafetensors", fastsafetensors),
    ("runai_model_streamer", "runai_model_streamer", runai),
    ("safetensors", "safetensors", safetensors),
]:
    entry = {}
    try:
        from importlib.metadata import version

        entry["version"] = version(module.replace("_", "-"))
    except ImportError:  # importlib.metadata.PackageNotFoundError
        entry["version"] = None
    try:
        entry.update(rates(make()))
    except Exception as e:  # noqa: BLE001 (a peer that fails is reported, the others still run)
        entry["error"] = f"{type(e).__name__}: {e}"
        entry["trace"] = traceback.format_exc(limit=4)
    result[name] = entry
    print(
        f"{name}: {json.dumps({k: v for k, v in entry.items() if k != 'trace'})}",
        file=sys.stderr,
        flush=True,
    )
print(json.dumps(result))
