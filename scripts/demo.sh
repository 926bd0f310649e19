#!/usr/bin/env bash
# The README's main job: the cascade demo pipeline run eager, staged, and staged with prefetch of
# the next stage, each in its own process under `stageload guard`, on CUDA when the machine has
# it (else the CPU); the traces, the side-by-side summary, the chart, and whether the latents
# matched bit for bit, in one folder (default target/demo; DEMO_OUT to change it). Extra
# arguments go to the cascade example (for example --scale 0.1 for a quick run, --device cpu).
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(scripts/setup-libtorch.sh)"
out="${DEMO_OUT:-target/demo}"
cargo build --example cascade
cargo build -p stageload-cli --bin stageload
mkdir -p "$out"
stageload=target/debug/stageload
for mode in eager staged prefetch; do
    echo "== cascade, $mode, under stageload guard"
    case $mode in
        prefetch) flags=(--mode staged --prefetch) ;;
        *) flags=(--mode "$mode") ;;
    esac
    "$stageload" guard --wait-free 25 --start-timeout 10m --log "$out/guard-$mode.jsonl" -- \
        target/debug/examples/cascade "${flags[@]}" --trace "$out/$mode.jsonl" \
        --fingerprints "$out/latents-$mode.txt" "$@" | tee "$out/$mode.log"
    if [ "$mode" = eager ]; then
        # The staged run builds its registry from this description: check it against the machine first.
        description=$(sed -n 's/^pipeline description \(.*\) (stageload plan reads it)$/\1/p' "$out/eager.log")
        echo "== stageload plan $description"
        "$stageload" plan "$description" | tee "$out/plan.txt" || echo "(the plan says it does not fit; running anyway under the guard)"
    fi
done
# Each staged run against the eager one (two traces: with the per-stage check).
"$stageload" summary "$out/eager.jsonl" "$out/staged.jsonl" | tee "$out/summary.txt"
"$stageload" summary "$out/eager.jsonl" "$out/prefetch.jsonl" | tee "$out/summary-prefetch.txt"
"$stageload" plot "$out/eager.jsonl" "$out/staged.jsonl" -o "$out/memory.svg"
"$stageload" plot "$out/eager.jsonl" "$out/staged.jsonl" -o "$out/memory.png"
for mode in staged prefetch; do
    if cmp -s "$out/latents-eager.txt" "$out/latents-$mode.txt"; then
        echo "latents: eager and $mode match bit for bit ($(wc -l < "$out/latents-$mode.txt") fingerprints)"
    else
        echo "latents: eager and $mode DIFFER:"
        diff "$out/latents-eager.txt" "$out/latents-$mode.txt" || true
        exit 1
    fi
done
echo "everything is in $out/"
