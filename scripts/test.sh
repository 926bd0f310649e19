#!/usr/bin/env bash
# Every check of the workspace: formatting, then the torch-free crates' tests (no libtorch
# needed; they finish in a minute or two), then clippy and the tests of everything that links
# libtorch (installed on first use, see scripts/setup-libtorch.sh). This is the README's test
# command; .ci/run calls it. Extra arguments go to both `cargo test` runs.
#
#   scripts/test.sh --torch-free     only formatting and the torch-free lane
set -euo pipefail
cd "$(dirname "$0")/.."
torch_free=(-p stageload-units -p stageload-probe -p stageload-input -p stageload-guard -p stageload-plan -p stageload-trace -p stageload-ab -p stageload-cli)
only_torch_free=false
if [[ "${1:-}" == "--torch-free" ]]; then
    only_torch_free=true
    shift
fi

cargo fmt --all --check
cargo clippy "${torch_free[@]}" --all-targets -- -D warnings
# The macOS readings (crates/probe/src/macos.rs) compile-checked for Apple silicon, where the
# target's standard library can be installed.
if rustup target add aarch64-apple-darwin >/dev/null 2>&1; then
    cargo check --target aarch64-apple-darwin -p stageload-probe -p stageload-guard -p stageload-cli
else
    echo "test.sh: rustup could not install aarch64-apple-darwin here: the macOS compile check did not run" >&2
fi
cargo test --no-fail-fast "${torch_free[@]}" "$@"
$only_torch_free && exit 0

eval "$(scripts/setup-libtorch.sh)"
# The published checkpoint the MiniLM test runs, and its reference implementation.
eval "$(scripts/setup-reference.sh)"
# Ray, the scheduler the many-jobs test submits cascade jobs to.
eval "$(scripts/setup-ray.sh)"
cargo clippy --workspace --all-targets -- -D warnings
excluded=()
for flag in "${torch_free[@]}"; do [[ $flag == -p ]] || excluded+=(--exclude "$flag"); done
cargo test --no-fail-fast --workspace "${excluded[@]}" "$@"
