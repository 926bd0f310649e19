#!/usr/bin/env bash
# Checkpoint load benchmark (not a test): stageload vs tch VarStore::load vs Python, results in traces/.
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(scripts/setup-libtorch.sh)"
cargo run --release -p stageload-bench --bin bench_load -- "$@"
