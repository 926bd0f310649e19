#!/usr/bin/env bash
# The hot set of a streamed model whose forward runs only some blocks per call (a fixed router
# over texture_flow's 12 blocks at scale 1: blocks 0 and 1 every call, one of the last three
# and one of the middle seven in turn; `stream --route experts`) on the CPU, arms:
#   resident  the whole model loaded;
#   resident-mapped  the same with the allocator setting a streamed model makes on the CPU
#             (every block of 1 MiB or more its own mapping, so that freed weights leave the RSS;
#             activations then page-fault on every call): what streaming costs beyond it;
#   hot       streamed in any order under a 550 MiB budget (two slots, a hot set of ~6 blocks);
#   no-hot    the same with no hot set (`--resident-at-most 0`);
#   prefix    the same budget as a resident prefix (blocks 0-5, which the router does not favour).
# Once with refills from the page cache, once from the disk (`--cold --uncached`: the checkpoint's
# pages dropped before set-up, and each refill drops what it read, as a model bigger than memory
# streams). RUNS (default 2) runs per arm, alternating. The latents must match the resident
# run's, and the hot set must read fewer blocks than either other streamed arm.
# Results in OUT (default target/hot-set-bench): cache/ and disk/, one JSON per run, bench.log.
#
#   [RUNS=N] scripts/hot-set-bench.sh [OUT]
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(scripts/setup-libtorch.sh)"
out="${1:-target/hot-set-bench}"
cargo build --example stream
stream=target/debug/examples/stream
common=(--device cpu --route experts --steps 24 --tokens 128)
arms=(resident resident-mapped hot no-hot prefix)
flags() { # arm, source
    local budget="--budget 550MiB --working 150MiB"
    [ "$2" = disk ] && { echo -n "--cold "; [[ "$1" = resident* ]] || echo -n "--uncached "; }
    case "$1" in
        resident) ;;
        resident-mapped) echo "--map-large-blocks" ;;
        hot) echo "$budget --any-order" ;;
        no-hot) echo "$budget --any-order --resident-at-most 0" ;;
        prefix) echo "$budget" ;;
    esac
}
field() { sed -n "s/.*\"$2\": \"\{0,1\}\([^,\"]*\)\"\{0,1\},\{0,1\}$/\1/p" "$1"; }
median() {
    for f in "$1"-[0-9]*.json; do field "$f" seconds; done | sort -n |
        awk '{v[NR]=$1} END {print (v[int((NR+1)/2)]+v[int(NR/2)+1])/2}'
}
mkdir -p "$out"
{
for source in cache disk; do
    dir="$out/$source"
    mkdir -p "$dir"
    for run in $(seq "${RUNS:-2}"); do
        for arm in "${arms[@]}"; do
            echo "== $source, $arm, run $run: $stream ${common[*]} $(flags "$arm" "$source")"
            # shellcheck disable=SC2046 # the arm's flags are words
            "$stream" "${common[@]}" $(flags "$arm" "$source") --result "$dir/$arm-$run.json"
        done
    done
    want=$(field "$dir/resident-1.json" fingerprint)
    for f in "$dir"/*.json; do
        [ "$(field "$f" fingerprint)" = "$want" ] || { echo "FAILED: $f's latent differs from the resident run's"; exit 1; }
    done
    echo "== from the $source: latents identical in all $(ls "$dir"/*.json | wc -l) runs ($want)"
    echo "   medians of ${RUNS:-2} runs: seconds of the flow; blocks and bytes read in one run; peak RSS over set-up"
    resident=$(median "$dir/resident")
    for arm in "${arms[@]}"; do
        f="$dir/$arm-1.json"
        awk -v arm="$arm" -v s="$(median "$dir/$arm")" -v r="$resident" -v refills="$(field "$f" refills)" \
            -v hits="$(field "$f" hot_hits)" -v bytes="$(field "$f" bytes_refilled)" \
            -v runs="$(field "$f" blocks_run)" -v peak="$(field "$f" peak_rss)" -v base="$(field "$f" base_rss)" \
            'BEGIN { printf "   %-15s %.2f s (%.3fx resident); %d of %d block runs read (%.2f GiB), %d found hot; peak %.0f MiB\n",
                     arm, s, s / r, refills, runs, bytes / 2^30, hits, (peak - base) / 2^20 }'
    done
    hot=$(field "$dir/hot-1.json" refills)
    for other in no-hot prefix; do
        [ "$hot" -lt "$(field "$dir/$other-1.json" refills)" ] || { echo "FAILED: the hot set read no fewer blocks than $other"; exit 1; }
    done
done
} 2>&1 | tee "$out/bench.log"
