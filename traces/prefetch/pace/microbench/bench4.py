import os, sys, time, subprocess, statistics, torch
torch.set_num_threads(2)
path = sys.argv[1]
a = torch.randn(768, 3072); b = torch.randn(3072, 768); x = torch.randn(77*2, 768)
def compute(n=20):
    t = time.perf_counter()
    for _ in range(n):
        y = x
        for _ in range(6):
            y = torch.nn.functional.gelu(y @ a) @ b
    return time.perf_counter() - t
compute(10)
keys = ["none", "4:1", "4:0.25", "1:0.25"]
res = {k: [] for k in keys}
for r in range(int(sys.argv[2])):
    for k in keys:
        p = None
        if k != "none":
            p = subprocess.Popen([sys.executable, "copier4.py", path] + k.split(":")); time.sleep(0.3)
        res[k].append(compute())
        if p: p.kill(); p.wait()
base = statistics.median(res["none"])
import math
for k in keys:
    v = res[k]
    print(k, "median %.3f s" % statistics.median(v), "ratio %.3f" % (statistics.median(v) / base), " ".join("%.3f" % (x / base) for x in v))
print("paired (each round against its own none, median):")
for k in keys[1:]:
    print(k, "%.3f" % statistics.median([v / n for v, n in zip(res[k], res["none"])]))
