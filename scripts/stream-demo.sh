#!/usr/bin/env bash
# Block streaming, as scripts/demo.sh runs it (and alone): the cascade's largest model
# (texture_flow) at scale 2 (1.2 GiB) loaded whole, then streamed under a 500 MiB budget inside
# `stageload guard --max-memory 1GiB` (below the model's size: the whole model under the same
# guard is stopped); the latents must match, and the plan of the streamed run's pipeline file
# (with the working memory the whole run measured) must match the streamed run: the run goes
# through StagedModels built from that file. Then the step-time benchmark at scale 1 (1024
# tokens, compute-bound): fully resident against half the blocks streamed and against the budget's
# own split, from the page cache; then the hot set under a router's access (hot-set-bench.sh).
# Results in $1 (default target/demo/stream).
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(scripts/setup-libtorch.sh)"
out="${1:-target/demo/stream}"
cargo build --example stream
cargo build -p stageload-cli --bin stageload
mkdir -p "$out"
stageload=target/debug/stageload
stream=target/debug/examples/stream
big=(--device cpu --scale 2 --tokens 256)
{
echo "== texture_flow at scale 2, loaded whole (no guard)"
"$stream" "${big[@]}" --result "$out/whole.json" --trace "$out/whole.jsonl"
echo "== the same under stageload guard --max-memory 1GiB (the guard must stop it)"
if "$stageload" guard --max-memory 1GiB -- "$stream" "${big[@]}"; then
    echo "FAILED: the whole model ran under a limit below its size"; exit 1
fi
echo "== streamed under a 500 MiB budget, under stageload guard --max-memory 1GiB"
"$stageload" guard --max-memory 1GiB --log "$out/guard.ndjson" -- "$stream" "${big[@]}" --budget 500MiB \
    --working 32MiB --result "$out/streamed.json" --trace "$out/streamed.jsonl" --pipeline "$out/pipeline.toml"
echo "== stageload plan of the streamed run's pipeline file against 1 GiB, with the working memory"
echo "   the whole run measured, checked against the streamed run (weights exact, peak within 5 %)"
"$stageload" plan "$out/pipeline.toml" --memory 1GiB --from-trace "$out/whole.jsonl" --check "$out/streamed.jsonl"
whole=$(sed -n 's/.*"fingerprint": "\(.*\)".*/\1/p' "$out/whole.json")
streamed=$(sed -n 's/.*"fingerprint": "\(.*\)".*/\1/p' "$out/streamed.json")
[ "$whole" = "$streamed" ] && echo "latents identical: $whole" || { echo "FAILED: latents differ"; exit 1; }
echo "== step time at scale 1, 1024 tokens: resident, half streamed, a 400 MiB budget (twice each)"
for run in 1 2; do
    "$stream" --device cpu --result "$out/bench-resident-$run.json"
    "$stream" --device cpu --budget 2GiB --resident-at-most 6 --result "$out/bench-half-$run.json"
    "$stream" --device cpu --budget 400MiB --working 200MiB --result "$out/bench-budget-$run.json"
done
echo "== ratios (seconds of the flow; median of two runs each)"
median() { sed -n 's/.*"seconds": \([0-9.]*\).*/\1/p' "$@" | sort -n | awk '{v[NR]=$1} END {print (v[1]+v[NR])/2}'; }
resident=$(median "$out"/bench-resident-*.json)
half=$(median "$out"/bench-half-*.json)
budget=$(median "$out"/bench-budget-*.json)
awk -v r="$resident" -v h="$half" -v b="$budget" 'BEGIN {
    printf "resident %.2f s; half streamed %.2f s (%.3fx); 400 MiB budget %.2f s (%.3fx)\n", r, h, h / r, b, b / r }'
"$stageload" summary "$out/whole.jsonl" "$out/streamed.jsonl"
} 2>&1 | tee "$out/stream.log"
echo "== the hot set, a forward that runs some blocks per call (scripts/hot-set-bench.sh)"
scripts/hot-set-bench.sh "$out/hot-set"
