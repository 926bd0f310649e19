#!/usr/bin/env bash
# Stable Diffusion 1.5 at its published component sizes (seeded random weights: trained ones
# cannot be fetched here), as scripts/demo.sh runs it (and alone). Exported once into the cache
# (scripts/reference/sd_export.py: about 8 min and 7.7 GB the first time), then eager, staged and
# staged with prefetch, one run each in its own process under the guard (`stageload ab`;
# 256x256, 4 DDIM steps, guidance 7.5, CPU); the plan of the runs' pipeline file with the working
# memory the eager run measured, checked against the staged run (weights exact, peak within 5 %
# of the need); then a staged run checked against diffusers' StableDiffusionPipeline on the same
# weights, embeddings and initial latents (within 1e-5 of each value range, or it fails).
# Results in $1 (default target/demo/stable-diffusion).
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(scripts/setup-libtorch.sh)"
eval "$(scripts/setup-reference.sh)"
out="${1:-target/demo/stable-diffusion}"
components="$(dirname "$STAGELOAD_SD_SMALL")/sd-sd15"
echo "== the published-size export in $components (made once)"
"$STAGELOAD_PYTHON" scripts/reference/sd_export.py --size sd15 --out "$components"
cargo build --example stable_diffusion
cargo build -p stageload-cli --bin stageload
mkdir -p "$out"
stageload=target/debug/stageload
sd=(target/debug/examples/stable_diffusion --components "$components")
echo "== stageload ab: eager, staged, prefetch, one run each, under the guard"
set +e
"$stageload" ab --wait-free 25 --start-timeout 10m --runs 1 --names eager,staged,prefetch \
    --out "$out" --log "$out/guard.ndjson" \
    -- "${sd[@]}" --mode eager -- "${sd[@]}" --mode staged -- "${sd[@]}" --mode prefetch | tee "$out/ab.log"
status=${PIPESTATUS[0]}
set -e
description=$(sed -n 's/^pipeline description \(.*\) (stageload plan reads it)$/\1/p' "$out/ab.log" | head -1)
echo "== stageload plan $description --from-trace eager-1.jsonl --check staged-1.jsonl"
if ! "$stageload" plan "$description" --from-trace "$out/eager-1.jsonl" --check "$out/staged-1.jsonl" \
    | tee "$out/plan-check.txt" | sed -n '/^plan against/,$p'; then
    status=1
fi
echo "== a staged run against diffusers' StableDiffusionPipeline"
if ! "${sd[@]}" --mode staged --compare-python | tee "$out/compare.txt"; then
    status=1
fi
exit "$status"
