"""A batch of jobs with known sizes, run four ways (issue 71, item 4): one at a time through the
queue (`stageload run`, nothing declared), packed by the plan (`stageload run --memory`), packed
under a margin that leaves room for three, and started by plain guards at once, without the
queue. Each job fills JOB_GIB of memory, holds it HOLD_S seconds and exits 0.

For each way: jobs at once (the most whose start..end intervals overlap, from the times the jobs
write), total wall time, peak memory (the most MemAvailable fell below its level before the
batch, sampled every 50 ms: other users of this shared machine move it too), exit codes (none
stopped: all 0).

Usage: python3 crates/bench/python/queue_bench.py target/debug/stageload > traces/queue/bench.json
"""

import json
import os
import subprocess
import sys
import tempfile
import threading
import time

JOBS = 6
JOB_GIB = 1
HOLD_S = 3.0
GIB = 1 << 30
JOB = (
    "import sys, time; t0 = time.time(); b = b'\\x01' * ({size}); "
    "time.sleep({hold}); open(sys.argv[1], 'a').write(f'{{t0}} {{time.time()}}\\n')"
)


def available():
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable")


def total():
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal")


def overlap(intervals):
    edges = sorted(
        [(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda x: (x[0], x[1])
    )
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


def batch(stageload, way, home, flags):
    times = os.path.join(home, f"{way}.times")
    job = JOB.format(size=JOB_GIB * GIB, hold=HOLD_S)
    env = dict(os.environ, STAGELOAD_HOME=home)
    baseline = available()
    lowest = [baseline]
    done = threading.Event()

    def sample():
        while not done.is_set():
            lowest[0] = min(lowest[0], available())
            time.sleep(0.05)

    sampler = threading.Thread(target=sample)
    sampler.start()
    began = time.time()
    runs = []
    for index in range(JOBS):
        command = [stageload] + flags(index) + ["--", sys.executable, "-c", job, times]
        runs.append(
            subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        )
        if way != "guards at once":
            time.sleep(0.05)  # join in order
    codes = [run.wait(timeout=600) for run in runs]
    wall = time.time() - began
    done.set()
    sampler.join()
    with open(times) as lines:
        intervals = [tuple(map(float, line.split())) for line in lines]
    return {
        "way": way,
        "jobs_at_once": overlap(intervals),
        "wall_s": round(wall, 2),
        "peak_memory_gib": round((baseline - lowest[0]) / GIB, 2),
        "exit_codes": codes,
        "jobs_finished": len(intervals),
    }


def packed(lane: str, margin: str):
    """The `stageload run` arguments of job i in `lane`, declaring 1.5G and keeping `margin`."""
    return lambda i: [
        "run", "--lane", lane, "--no-meter", "--who", f"job-{i}",
        "--memory", "1.5G", "--margin", margin,
    ]  # fmt: skip


def main():
    stageload = os.path.abspath(sys.argv[1])
    machine = total()
    three = 3 * 1.5 * GIB
    margin = int(machine - three - 0.1 * GIB)
    ways = [
        (
            "one at a time (run, nothing declared)",
            lambda i: ["run", "--lane", "seq", "--no-meter", "--who", f"job-{i}"],
        ),
        ("packed by the plan (run --memory 1.5G --margin 2G)", packed("pack", "2G")),
        (
            f"packed, margin leaving room for three (--margin {margin})",
            packed("three", str(margin)),
        ),
        ("guards at once", lambda i: ["guard"]),
    ]
    results = []
    with tempfile.TemporaryDirectory(prefix="stageload-queue-bench-") as home:
        for way, flags in ways:
            results.append(batch(stageload, way, home, flags))
            print(json.dumps(results[-1]), file=sys.stderr)
    print(
        json.dumps(
            {
                "jobs": JOBS,
                "job_gib": JOB_GIB,
                "hold_s": HOLD_S,
                "total_gib": round(machine / GIB, 2),
                "cpus": os.cpu_count(),
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
