#!/usr/bin/env bash
# The README's main job: the cascade demo pipeline run eager, staged, and staged with prefetch of
# the next stage, twice each and alternating, each run in its own process under the guard
# (`stageload ab`), on CUDA when the machine has it (else the CPU). One folder (default
# target/demo; DEMO_OUT to change it) gets every trace and latents file, the aggregated
# per-stage peaks (median and spread), the latents compared against eager's own variation, the
# plan checked against the machine, the side-by-side summary of the first runs, and the charts.
# Extra arguments go to every cascade run (for example --scale 0.1 for a quick run, --device cpu).
# Then block streaming (scripts/stream-demo.sh) and Stable Diffusion 1.5 at its published
# component sizes against diffusers (scripts/sd-demo.sh; its export, 7.7 GB, is made once).
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(scripts/setup-libtorch.sh)"
out="${DEMO_OUT:-target/demo}"
cargo build --example cascade
cargo build -p stageload-cli --bin stageload
mkdir -p "$out"
stageload=target/debug/stageload
cascade=target/debug/examples/cascade
echo "== stageload ab: eager, staged, prefetch, twice each, alternating, under the guard"
set +e
"$stageload" ab --wait-free 25 --start-timeout 10m --runs 2 --names eager,staged,prefetch \
    --out "$out" --log "$out/guard.jsonl" \
    -- "$cascade" --mode eager "$@" \
    -- "$cascade" --mode staged "$@" \
    -- "$cascade" --mode staged --prefetch "$@" | tee "$out/ab.log"
status=${PIPESTATUS[0]}
set -e
# Each run wrote the pipeline description the staged runs build their registry from: check it.
description=$(sed -n 's/^pipeline description \(.*\) (stageload plan reads it)$/\1/p' "$out/ab.log" | head -1)
echo "== stageload plan $description"
"$stageload" plan "$description" > "$out/plan.txt" || echo "(the plan says it does not fit; the runs went ahead under the guard)"
# The plan with the working memory the eager run measured, checked against the staged run stage
# by stage: resident weights exactly, peak within 5 % of the need.
echo "== stageload plan --from-trace eager-1.jsonl --check staged-1.jsonl"
if ! "$stageload" plan "$description" --from-trace "$out/eager-1.jsonl" --check "$out/staged-1.jsonl" \
    | tee "$out/plan-check.txt" | sed -n '/^plan against/,$p'; then
    status=1
fi
# The first staged and prefetch runs against the first eager one, with the per-stage check.
"$stageload" summary "$out/eager-1.jsonl" "$out/staged-1.jsonl" | tee "$out/summary-first-runs.txt"
"$stageload" summary "$out/eager-1.jsonl" "$out/prefetch-1.jsonl" > "$out/summary-first-runs-prefetch.txt"
# Block streaming: the cascade's largest model under a budget below its size.
echo "== block streaming (scripts/stream-demo.sh)"
scripts/stream-demo.sh "$out/stream" || status=1
# A pipeline written by others: Stable Diffusion 1.5's components (diffusers, transformers) at
# their published sizes, staged, and checked against diffusers itself.
echo "== Stable Diffusion 1.5 against diffusers (scripts/sd-demo.sh)"
scripts/sd-demo.sh "$out/stable-diffusion" || status=1
echo "everything is in $out/ (summary.txt: the aggregated comparison)"
exit "$status"
