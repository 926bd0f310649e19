#!/usr/bin/env bash
# Staged + prefetch wall time against eager and staged, on a warm and on a cold page cache: the
# cascade demo through `stageload ab` (alternating, each run in its own process under the
# guard), first with the checkpoints in the page cache, then with each run dropping them first
# (`--cold`, posix_fadvise DONTNEED: every load reads the disk). Results in OUT (default
# target/prefetch-bench): warm/ and cold/, each with the traces, ab.json and summary.txt (wall
# time per run and per mode, ratios to eager, peaks per stage, latents compared).
#
#   scripts/prefetch-bench.sh [OUT] [cascade args...]     e.g. scripts/prefetch-bench.sh out --scale 0.5
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(scripts/setup-libtorch.sh)"
out="${1:-target/prefetch-bench}"
shift || true
cargo build --example cascade
cargo build -p stageload-cli --bin stageload
stageload=target/debug/stageload
cascade=target/debug/examples/cascade
status=0
for cache in warm cold; do
    flags=()
    [ "$cache" = cold ] && flags=(--cold)
    mkdir -p "$out/$cache"
    echo "== $cache page cache: eager, staged, prefetch, twice each, alternating"
    "$stageload" ab --wait-free 25 --start-timeout 10m --runs 2 --names eager,staged,prefetch --out "$out/$cache" \
        -- "$cascade" --mode eager "${flags[@]}" "$@" \
        -- "$cascade" --mode staged "${flags[@]}" "$@" \
        -- "$cascade" --mode staged --prefetch "${flags[@]}" "$@" > "$out/$cache/ab.log" || status=1
    sed -n '/^wall time/,/^$/p' "$out/$cache/summary.txt"
done
exit "$status"
