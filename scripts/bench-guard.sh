#!/usr/bin/env bash
# Benchmark of `stageload guard`: reaction time and overshoot against a child allocating as fast
# as it can, and CPU per hour of watching. Torch-free. Writes traces/guard-bench.md and .json.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -p stageload-cli --bin stageload --example bench_guard
exec target/release/examples/bench_guard "$@"
