"""A two-thread torch compute timed with and without a reader process beside it, alternating.

    python bench.py FILE ROUNDS COPIER ARM...

Each ARM is the COPIER's arguments after FILE, joined by ':' (`copier.py`: duty:piece_bytes;
`copier4.py`: readers:share). Prints each arm's median and its paired ratio: each round against
that round's run without a reader."""

import statistics
import subprocess
import sys
import time

import torch

torch.set_num_threads(2)
path, rounds, copier, arms = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
a = torch.randn(768, 3072)
b = torch.randn(3072, 768)
x = torch.randn(77 * 2, 768)


def compute(n=20):
    t = time.perf_counter()
    for _ in range(n):
        y = x
        for _ in range(6):
            y = torch.nn.functional.gelu(y @ a) @ b
    return time.perf_counter() - t


compute(10)
keys = ["none"] + arms
res = {k: [] for k in keys}
for r in range(rounds):
    for k in keys:
        p = None
        if k != "none":
            p = subprocess.Popen([sys.executable, copier, path] + k.split(":"))
            time.sleep(0.3)
        res[k].append(compute())
        if p:
            p.kill()
            p.wait()
base = statistics.median(res["none"])
for k in keys:
    v = res[k]
    print(
        k,
        f"median {statistics.median(v):.3f} s",
        f"ratio {statistics.median(v) / base:.3f}",
        " ".join(f"{x / base:.3f}" for x in v),
    )
print("paired (each round against its own none, median):")
for k in arms:
    print(k, f"{statistics.median([v / n for v, n in zip(res[k], res['none'])]):.3f}")
