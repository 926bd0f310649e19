#!/usr/bin/env bash
# Many jobs under a real scheduler: a local Ray cluster (scripts/setup-ray.sh installs Ray once)
# with a node memory resource of two eager requests, N cascade jobs eager and then N staged, each
# task's memory from `stageload plan --request ray` and each run inside `stageload guard --plan`
# (scripts/many_jobs.py says how). Results in $1 (default traces/many-jobs): many-jobs.md (the
# table), many-jobs.json (every job), the plan, the requests in Ray, Slurm and Kubernetes words,
# and every job's trace and guard log. JOBS and SCALE override the defaults (8, 0.25).
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(scripts/setup-libtorch.sh)"
eval "$(scripts/setup-ray.sh)"
out="${1:-traces/many-jobs}"
cargo build --example cascade
cargo build -p stageload-cli --bin stageload
rm -rf "$out"
"$STAGELOAD_RAY_PYTHON" scripts/many_jobs.py --stageload target/debug/stageload --cascade target/debug/examples/cascade \
    --jobs "${JOBS:-8}" --scale "${SCALE:-0.25}" --out "$out"
for format in slurm kubernetes; do
    target/debug/stageload plan --request "$format" "$out/jobs.toml" > "$out/request.$format"
done
