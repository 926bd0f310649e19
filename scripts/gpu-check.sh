#!/usr/bin/env bash
# The project's GPU checks, in one call of a few minutes on the GPU machine. That machine has no
# cargo: build here first, against its libtorch, with the device kit (../shared/device-kit):
#
#   ../shared/device-kit/build.sh build -p stageload-bench --bin gpu_check --example cascade --example stream --example stable_diffusion
#   ../shared/device-kit/build.sh build -p stageload-cli --bin stageload
#   cp -r ~/.cache/stageload/sd-small target/device-kit/sd-small     # the small Stable Diffusion export (11 MB)
#
# then, on the GPU machine, from the repository root with target/device-kit carried along:
#
#   scripts/gpu-check.sh            # results in $OUT (or target/gpu-check)
#
# It runs: gpu_check (crates/bench) (the CUDA paths checked, checkpoint -> CUDA against Python's
# safetensors and the pinned/pageable copy limits on one 4 GiB file), then the cascade demo on
# cuda:0 eager, staged, staged with prefetch, staged with a 4 GiB host tier (the released models
# come back from pinned host memory), and staged without RNG preservation (the control),
# compares their latents, and writes the summary and chart of the eager, staged and prefetch
# traces; then block streaming on cuda:0 (the stream demo: texture_flow at scale 2 whole, under a
# 500 MiB budget, and with half its blocks streamed; same latent, step times; and a router's
# access with a hot set against the same route whole; and a compute-bound model, 4096 tokens, with
# 2 of its 12 blocks resident: 83 % streamed, against whole); then the checkpoint -> CUDA load
# under other ring shapes (STAGELOAD_RING: buffers, window, readers) against the same run's pinned
# limit; then the small Stable Diffusion (TorchScript, traced on the CPU) on cuda:0 eager, staged
# and prefetch, latents compared. Files:
# gpu-check.json, log.txt, latents.txt, summary.txt, summary-tier.txt, memory.svg,
# cascade-{eager,staged,prefetch,tier}.jsonl, stream-*.json, stream-ratios.json (step time
# streamed / whole, refill GB/s / the pinned limit of this run), ring-*.json, sd-latents.txt.
set -uo pipefail
root=$(pwd)
kit=$root/target/device-kit
out=${OUT:-$root/target/gpu-check}
scratch=${TMPDIR:-/tmp}/stageload-gpu-check
mkdir -p "$out" "$scratch"
log=$out/log.txt
: > "$log"
step() { echo "+ $*" | tee -a "$log"; }
run() { DEVICE_KIT_QUIET=1 "$kit/run.sh" "$@" 2>&1 | tee -a "$log"; return "${PIPESTATUS[0]}"; }
status=0

"$kit/run.sh" true 2>&1 | tee -a "$log"   # the GPU and the torch version
step gpu_check
run bin/gpu_check --out "$out" --scratch "$scratch" --gib 4 --rounds 5 --peer "$root/crates/bench/python/bench_device.py" || status=1

for mode in eager staged prefetch tier control; do
    case $mode in
        eager) flags=(--mode eager) ;;
        staged) flags=(--mode staged) ;;
        prefetch) flags=(--mode staged --prefetch) ;;
        tier) flags=(--mode staged --host-tier 4GiB) ;;
        control) flags=(--mode staged --no-preserve-rng) ;;
    esac
    step "cascade $mode"
    start=$(date +%s%N)
    run bin/cascade "${flags[@]}" --device cuda --cache "$scratch/weights" --trace "$scratch/cascade-$mode.jsonl" \
        --latents "$scratch/latents-$mode.safetensors" > /dev/null || status=1
    cp "$scratch/latents-$mode.safetensors.sha256" "$scratch/latents-$mode.txt" 2>/dev/null || true
    echo "cascade $mode wall $(( ($(date +%s%N) - start) / 1000000 )) ms" | tee -a "$log"
done
cp "$scratch/cascade-eager.jsonl" "$scratch/cascade-staged.jsonl" "$scratch/cascade-prefetch.jsonl" "$scratch/cascade-tier.jsonl" "$out/"
{
    for mode in eager staged prefetch tier control; do echo "== $mode"; cat "$scratch/latents-$mode.txt"; done
    for mode in staged prefetch tier control; do
        if cmp -s "$scratch/latents-eager.txt" "$scratch/latents-$mode.txt"; then echo "$mode: latents identical to eager"
        else echo "$mode: $(diff <(cat "$scratch/latents-eager.txt") "$scratch/latents-$mode.txt" | grep -c '^>') latents differ from eager"; fi
    done
} > "$out/latents.txt"
tail -4 "$out/latents.txt" | tee -a "$log"
run bin/stageload summary "$scratch/cascade-eager.jsonl" "$scratch/cascade-staged.jsonl" "$scratch/cascade-prefetch.jsonl" > "$out/summary.txt" || status=1
run bin/stageload summary "$scratch/cascade-tier.jsonl" > "$out/summary-tier.txt" || status=1
run bin/stageload plot "$scratch/cascade-eager.jsonl" "$scratch/cascade-staged.jsonl" "$scratch/cascade-prefetch.jsonl" -o "$out/memory.svg" || status=1
for mode in whole budget half; do
    case $mode in
        whole) flags=() ;;
        budget) flags=(--budget 500MiB --working 256MiB) ;;
        half) flags=(--budget 8GiB --resident-at-most 6) ;;
    esac
    step "stream $mode"
    run bin/stream --device cuda --scale 2 --tokens 1024 --cache "$scratch/weights" "${flags[@]}" \
        --result "$out/stream-$mode.json" || status=1
done
# The hot set on the GPU: a router's access (4 of 12 blocks per call), any order, against the
# same route with the model whole.
for mode in experts-whole experts-hot; do
    flags=(--route experts --steps 12)
    [ "$mode" = experts-hot ] && flags+=(--budget 900MiB --working 256MiB --any-order)
    step "stream $mode"
    run bin/stream --device cuda --scale 2 --tokens 1024 --cache "$scratch/weights" "${flags[@]}" \
        --result "$out/stream-$mode.json" || status=1
done
# #30 part 4: compute-bound (4096 tokens), whole against 2 of 12 blocks resident.
for mode in compute-whole compute-streamed; do
    flags=(--tokens 4096)
    [ "$mode" = compute-streamed ] && flags+=(--budget 8GiB --resident-at-most 2)
    step "stream $mode"
    run bin/stream --device cuda --scale 2 --cache "$scratch/weights" "${flags[@]}" \
        --result "$out/stream-$mode.json" || status=1
done
# #30 part 3: the load under other ring shapes, each its own process (the ring is the process's).
for ring in slots=16 slots=64 window=32M window=64M,slots=16 readers=4 readers=8 readers=32,slots=64; do
    step "gpu_check --load-only, STAGELOAD_RING=$ring"
    STAGELOAD_RING=$ring run bin/gpu_check --load-only --out "$scratch/ring" --scratch "$scratch" --gib 4 --rounds 3 \
        || status=1
    cp "$scratch/ring/gpu-check.json" "$out/ring-${ring//[=,]/-}.json" 2>/dev/null
done
# The TorchScript pipeline on cuda:0 (the export is the CPU's trace: a module that baked a CPU
# tensor into its graph fails here, and says so).
for mode in eager staged prefetch; do
    step "stable_diffusion small $mode on cuda"
    run bin/stable_diffusion --components "$kit/sd-small" --device cuda --mode $mode \
        --latents "$scratch/sd-$mode.safetensors" > /dev/null || status=1
done
{
    for mode in eager staged prefetch; do echo "== $mode"; cat "$scratch/sd-$mode.safetensors.sha256" 2>/dev/null; done
    for mode in staged prefetch; do
        if cmp -s "$scratch/sd-eager.safetensors.sha256" "$scratch/sd-$mode.safetensors.sha256"; then
            echo "sd $mode: latents identical to eager"
        else echo "sd $mode: latents DIFFER from eager (or missing)"; fi
    done
} > "$out/sd-latents.txt"
tail -2 "$out/sd-latents.txt" | tee -a "$log"
for pair in whole:budget whole:half experts-whole:experts-hot compute-whole:compute-streamed; do
    reference=${pair%%:*} mode=${pair#*:}
    if [ "$(grep '"fingerprint"' "$out/stream-$reference.json")" = "$(grep '"fingerprint"' "$out/stream-$mode.json")" ]; then
        echo "stream $mode: latent identical to $reference" | tee -a "$log"
    else
        echo "stream $mode: latent DIFFERS from $reference" | tee -a "$log"; status=1
    fi
done
# #14's ratios in this run: step time streamed against whole, refills against the pinned limit.
python3 - "$out" <<'PY' | tee -a "$log" || status=1
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
pinned = json.loads((out / "gpu-check.json").read_text())["pinned_h2d_gb_per_s"]
whole = json.loads((out / "stream-whole.json").read_text())
ratios = {"pinned_h2d_gb_per_s": pinned}
for mode, against in (("budget", whole), ("half", whole), ("compute-streamed", json.loads((out / "stream-compute-whole.json").read_text()))):
    run = json.loads((out / f"stream-{mode}.json").read_text())
    refill = run["bytes_refilled"] / run["refill_seconds"] / 1e9 if run["refill_seconds"] > 0 else None
    ratios[mode] = {
        "step_over_whole": run["seconds_per_step"] / against["seconds_per_step"],
        "refill_gb_per_s": refill,
        "refill_over_pinned": refill / pinned if refill else None,
        "residency": run["residency"],
    }
for ring in sorted(out.glob("ring-*.json")):
    r = json.loads(ring.read_text())
    ratios[ring.stem] = {"ring": r["ring"], "to_cuda_gb_per_s": r["stageload_to_cuda_gb_per_s"],
                         "over_pinned": r["stageload_over_pinned_limit"]}
(out / "stream-ratios.json").write_text(json.dumps(ratios, indent=2))
print(json.dumps(ratios, indent=2))
PY
exit $status
