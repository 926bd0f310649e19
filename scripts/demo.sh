#!/usr/bin/env bash
# The README's main job: builds and runs the demo pipeline staged, on real libtorch.
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(scripts/setup-libtorch.sh)"
cargo run --example two_models -- "$@"
