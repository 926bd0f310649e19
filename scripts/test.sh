#!/usr/bin/env bash
# Runs every test of the workspace against real libtorch (installed on first use, see
# scripts/setup-libtorch.sh). This is the README's test command; .ci/run calls it.
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(scripts/setup-libtorch.sh)"
# The published checkpoint the MiniLM test runs, and its reference implementation.
eval "$(scripts/setup-reference.sh)"
cargo test --workspace "$@"
