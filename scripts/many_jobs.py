"""Many jobs under a real scheduler: N cascade jobs submitted to a local Ray cluster, eager and then
staged, each task's resources taken from `stageload plan --request ray` and each run inside
`stageload guard --plan`, so Ray packs jobs by what their plan says they need and the guard stops
the one that goes over it.

The cluster is started here (`ray start --head --block`, bound to 127.0.0.1, in a process group
of its own whose id is its pid) with a node `memory` resource smaller than the machine: by
default what two eager jobs request, so the eager mode runs two at once and the staged mode as
many as its smaller requests fit. Logical CPUs are not the limit (one per job, as many as jobs):
the node's memory is. The cluster is stopped at the end by that pid, also on failure.

Steps: a reference run (eager, outside Ray) gives the latents every job must reproduce and the
working memory each stage needs (written into the jobs' pipeline file with `stageload summary
--write-working`, with `reserve`); then the requests; then the jobs. Writes OUT/many-jobs.json
(every job: mode, start, end, exit, peak, request, latents equal) and OUT/many-jobs.md, and exits 1
when a job failed, was stopped, went above its request, or changed a latent.

    python scripts/many_jobs.py --stageload target/debug/stageload --cascade target/debug/examples/cascade \
        --jobs 6 --scale 0.25 --out traces/many-jobs
"""

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

# Ray reads this once, at import: "0" keeps every address of the driver and the cluster on the
# loopback (otherwise it resolves 127.0.0.1 to this machine's first interface).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
import ray  # noqa: E402

RESERVE = "10%"


def run(command, **kwargs):
    """Runs `command`, failing with its output when it fails."""
    done = subprocess.run([str(c) for c in command], capture_output=True, text=True, **kwargs)
    if done.returncode != 0:
        sys.exit(f"many_jobs: {' '.join(map(str, command))} failed (exit {done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done.stdout


def peak(stageload, trace):
    """The run's peak RSS as `stageload summary` reads it from its trace."""
    return json.loads(run([stageload, "summary", "--json", trace]))[0]["peak"]


def machine_memory():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


def most_at_once(jobs):
    """The largest number of jobs whose [start, end] intervals overlap."""
    edges = sorted([(j["start"], 1) for j in jobs] + [(j["end"], -1) for j in jobs], key=lambda e: (e[0], e[1]))
    running = best = 0
    for _, step in edges:
        running += step
        best = max(best, running)
    return best


class Cluster:
    """A local Ray head bound to 127.0.0.1, in a process group of its own, stopped by its pid."""

    def __init__(self, ray_bin, folder, cpus, memory):
        folder.mkdir(parents=True, exist_ok=True)
        self.log = folder / "ray-start.log"
        env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
        # A short temporary folder: Ray's sockets live there and a socket path has 107 bytes.
        self.temp = Path(f"/tmp/stageload-ray-{os.getpid()}")
        # A free port for the head's GCS, named so the driver knows the address (`--port=0`
        # picks one but Ray 2.60 prints no address then).
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.address = f"127.0.0.1:{port}"
        command = [
            ray_bin, "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}",
            f"--num-cpus={cpus}", f"--memory={memory}", f"--object-store-memory={80 << 20}",
            "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={self.temp}",
        ]
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        (folder / "ray.pid").write_text(str(self.process.pid))
        deadline = time.monotonic() + 120
        try:
            while "Ray runtime started" not in self.log.read_text():
                if self.process.poll() is not None or time.monotonic() > deadline:
                    sys.exit(f"many_jobs: the Ray head did not start within 120 s:\n{self.log.read_text()}")
                time.sleep(0.2)
        except BaseException:
            # Not started, or a signal while waiting: the caller has no cluster to stop.
            self.stop()
            raise

    def stop(self):
        """SIGTERM to the head (it drains and stops its processes), then SIGKILL to its group."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=40)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        subprocess.run(["rm", "-rf", str(self.temp)])


@ray.remote
def job(command, trace, latents):
    """One cascade run inside the guard; its start and end on this machine's clock."""
    start = time.time()
    done = subprocess.run(command, capture_output=True, text=True)
    return {
        "start": start,
        "end": time.time(),
        "exit": done.returncode,
        "trace": trace,
        "latents": latents,
        "stderr_tail": done.stderr[-2000:],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stageload", type=Path, required=True)
    parser.add_argument("--cascade", type=Path, required=True)
    parser.add_argument("--ray", type=Path, default=Path(sys.executable).with_name("ray"), help="the ray command")
    parser.add_argument("--jobs", type=int, default=6)
    parser.add_argument("--scale", default="0.25")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cache", type=Path, help="the cascade's checkpoint cache (default: its own)")
    parser.add_argument("--node-memory", type=int, help="the node's memory resource, bytes (default: two eager requests)")
    parser.add_argument("--deadline", type=float, default=1800, help="seconds for each mode's jobs")
    args = parser.parse_args()
    # SIGTERM (a deadline, a CI runner) ends the driver through `finally`: the cluster is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    stageload, cascade = args.stageload.resolve(), args.cascade.resolve()
    common = ["--device", "cpu", "--scale", args.scale] + (["--cache", args.cache.resolve()] if args.cache else [])

    # The reference: latents every job must give, and the working memory of each stage.
    reference = run([cascade, "--mode", "eager", *common, "--trace", out / "reference.jsonl",
                     "--latents", out / "reference.safetensors"])
    description = Path(re.search(r"^pipeline description (.*) \(stageload plan reads it\)$", reference, re.M).group(1))
    pipeline = out / "jobs.toml"
    # One CPU a job: the node's CPUs (as many as jobs) never limit it, its memory does.
    pipeline.write_text(f'reserve = "{RESERVE}"\ncpus = 1\n' + description.read_text())
    run([stageload, "summary", out / "reference.jsonl", "--write-working", pipeline])
    expected = (out / "reference.safetensors.sha256").read_text()
    requests = {
        mode: json.loads(run([stageload, "plan", "--request", "ray", *flags, pipeline]))
        for mode, flags in (("eager", ["--eager"]), ("staged", []))
    }
    (out / "plan.txt").write_text(run([stageload, "plan", pipeline]))
    node_memory = args.node_memory or 2 * requests["eager"]["memory"]
    if node_memory >= machine_memory():
        sys.exit(f"many_jobs: a node memory of {node_memory} bytes is not smaller than this machine's {machine_memory()}")

    results = {"command": " ".join(sys.argv), "jobs": args.jobs, "scale": args.scale, "node_memory": node_memory,
               "requests": requests, "modes": {}}
    failures = []
    cluster = None
    try:
        # Inside `try`: a SIGTERM while the head starts still stops it.
        cluster = Cluster(args.ray, out / "ray", args.jobs, node_memory)
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        for mode, flags in (("eager", ["--eager"]), ("staged", [])):
            began = time.time()
            pending = []
            for i in range(args.jobs):
                trace, latents = out / f"{mode}-{i}.jsonl", out / f"{mode}-{i}.safetensors"
                command = [str(c) for c in [
                    stageload, "guard", "--plan", pipeline, *flags, "--trace", trace, "--log", out / f"{mode}-{i}.guard.ndjson",
                    "--", cascade, "--mode", mode, *common, "--trace", trace, "--latents", latents,
                ]]
                pending.append(job.options(**requests[mode]).remote(command, str(trace), str(latents)))
            done, left = ray.wait(pending, num_returns=len(pending), timeout=args.deadline)
            if left:
                failures.append(f"{mode}: {len(left)} of {args.jobs} jobs did not end within {args.deadline} s")
                for ref in left:
                    ray.cancel(ref, force=True)
            jobs = ray.get(done)
            for i, j in enumerate(jobs):
                j["peak"] = peak(stageload, j["trace"]) if Path(j["trace"]).exists() else None
                j["request"] = requests[mode]["memory"]
                digest = Path(j["latents"] + ".sha256")
                j["latents_equal"] = digest.exists() and digest.read_text() == expected
                # The digest stays; the latents themselves are the reference's.
                Path(j["latents"]).unlink(missing_ok=True)
                if j["exit"] != 0:
                    failures.append(f"{mode} job {i}: exit {j['exit']}: {j['stderr_tail']}")
                if j["peak"] is None or j["peak"] > j["request"]:
                    failures.append(f"{mode} job {i}: peak {j['peak']} above its request {j['request']}")
                if not j["latents_equal"]:
                    failures.append(f"{mode} job {i}: latents differ from the reference run's")
            results["modes"][mode] = {
                "wall_s": time.time() - began,
                "most_at_once": most_at_once(jobs),
                "jobs": jobs,
            }
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if cluster is not None:
            cluster.stop()
    results["failures"] = failures
    (out / "many-jobs.json").write_text(json.dumps(results, indent=1, default=str))
    write_table(out / "many-jobs.md", results)
    print((out / "many-jobs.md").read_text())
    if failures:
        print("\n".join(failures), file=sys.stderr)
        sys.exit(1)


def write_table(path, results):
    mib = lambda b: f"{b / 2**20:.1f}"
    lines = [
        f"# {results['jobs']} cascade jobs (scale {results['scale']}) on a local Ray node with {mib(results['node_memory'])} MiB of `memory`",
        "",
        f"Made by: `{results['command']}`",
        "",
        "| mode | request (MiB) | jobs at once | wall (s) | peak per job (MiB), largest | peak/request, largest | latents equal | stopped or failed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode, m in results["modes"].items():
        peaks = [j["peak"] or 0 for j in m["jobs"]]
        request = results["requests"][mode]["memory"]
        lines.append(
            f"| {mode} | {mib(request)} | {m['most_at_once']} | {m['wall_s']:.1f} | {mib(max(peaks))} | "
            f"{max(peaks) / request:.3f} | {sum(j['latents_equal'] for j in m['jobs'])}/{len(m['jobs'])} | "
            f"{sum(j['exit'] != 0 for j in m['jobs'])} |"
        )
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
