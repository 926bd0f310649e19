#!/usr/bin/env bash
# Every check of the workspace: formatting, then the torch-free crates (the workspace's default
# members: a plain `cargo test` runs them, no libtorch needed; a minute or two), then clippy,
# the tests and the documentation of everything that links libtorch (installed on first use,
# see scripts/setup-libtorch.sh). This is the README's test command; .ci/run calls it. Extra
# arguments go to both `cargo test` runs.
#
#   scripts/test.sh --torch-free     only formatting and the torch-free lane
set -euo pipefail
cd "$(dirname "$0")/.."
# The crates that link libtorch: every workspace member that is not a default member.
torch=(-p stageload -p stageload-torch-sys -p stageload-build -p stageload-demo-kit -p stageload-bench -p stageload-test-support)
only_torch_free=false
if [[ "${1:-}" == "--torch-free" ]]; then
    only_torch_free=true
    shift
fi

cargo fmt --all --check
cargo clippy --all-targets -- -D warnings
# The macOS readings (crates/probe/src/macos.rs) compile-checked for Apple silicon, where the
# target's standard library can be installed.
if rustup target add aarch64-apple-darwin >/dev/null 2>&1; then
    cargo check --target aarch64-apple-darwin -p stageload-probe -p stageload-guard -p stageload-cli
else
    echo "test.sh: rustup could not install aarch64-apple-darwin here: the macOS compile check did not run" >&2
fi
cargo test --no-fail-fast "$@"
$only_torch_free && exit 0

eval "$(scripts/setup-libtorch.sh)"
# The published checkpoint the MiniLM test runs, and its reference implementation.
eval "$(scripts/setup-reference.sh)"
# Ray, the scheduler the many-jobs test submits cascade jobs to.
eval "$(scripts/setup-ray.sh)"
cargo clippy --workspace --all-targets -- -D warnings
cargo test --no-fail-fast "${torch[@]}" "$@"
# The docs lane: every crate's documentation builds, its broken links and bad markup refused.
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --quiet
