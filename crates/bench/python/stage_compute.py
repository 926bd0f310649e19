"""Per-stage compute time from stageload traces: each stage's window (its stage event to the
next stage event or the close mark) less the foreground loads in it (load/reload events not
marked prefetched: their seconds), less the releases in it (their seconds, which since
2026-12-06 include their share of giving the memory back to the OS) and less the wait for a model of its own whose prefetch ends
inside it (from the window's start to that load's end: the stage's `get` waits for it; an upper
bound if the stage computed something first). A prefetched load is the stage's whose `prefetch`
event, the last before it for that model, names the stage. Medians over each arm's runs; ratios to the first arm's.

    python3 crates/bench/python/stage_compute.py FOLDER eager,staged,prefetch"""

import glob
import json
import os
import statistics
import sys

folder, arms = sys.argv[1], sys.argv[2].split(",")


def compute(path):
    with open(path) as lines:
        events = [json.loads(line) for line in lines if '"type":"event"' in line]
    marks = [(e["t"], e.get("stage")) for e in events if e["kind"] == "stage"]
    ends = [e["t"] for e in events if e["kind"] == "mark"]
    out = {}
    for i, (t, stage) in enumerate(marks):
        end = (
            marks[i + 1][0]
            if i + 1 < len(marks)
            else (min([x for x in ends if x > t], default=events[-1]["t"]))
        )
        inside = [e for e in events if e["kind"] in ("load", "reload") and t <= e["t"] <= end]
        loads = sum(e.get("seconds", 0) for e in inside if not e.get("prefetched"))
        releases = sum(
            e.get("seconds", 0) for e in events if e["kind"] == "release" and t <= e["t"] <= end
        )

        def target(load):
            asked = [
                e
                for e in events
                if e["kind"] == "prefetch"
                and e.get("model") == load.get("model")
                and e["t"] <= load["t"]
            ]
            return asked[-1].get("stage") if asked else None

        waited = max(
            [e["t"] - t for e in inside if e.get("prefetched") and target(e) == stage], default=0.0
        )
        out[stage] = out.get(stage, 0) + (end - t - loads - releases - waited)
    return out


per = {}
for arm in arms:
    runs = [compute(p) for p in sorted(glob.glob(os.path.join(folder, f"{arm}-[0-9].jsonl")))]
    per[arm] = {s: statistics.median([r[s] for r in runs if s in r]) for s in runs[0]}
stages = [s for s in per[arms[0]] if s != "setup"]
print("| stage | " + " | ".join([f"{arms[0]} (s)"] + [f"{a} / {arms[0]}" for a in arms[1:]]) + " |")
print("|---" * len(arms) + "|---|")
for s in stages:
    base = per[arms[0]][s]
    print(f"| {s} | {base:.2f} | " + " | ".join(f"{per[a][s] / base:.3f}" for a in arms[1:]) + " |")
