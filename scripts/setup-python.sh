#!/usr/bin/env bash
# Builds the Python package stageload_rs (crates/python: the Rust core under the original
# stageload's API) with maturin and installs it into the cached torch environment
# (scripts/setup-libtorch.sh made it), with pytest for its tests. maturin and ruff live in an
# environment of their own beside it. The build is incremental (about 6 minutes cold on 2 cores,
# seconds after); the wheel is installed again only when it changed. Runs scripts/setup-libtorch.sh
# first unless STAGELOAD_PYTHON is set (cargo xtask runs both and reads what they print).
#
#   scripts/setup-python.sh
#
#   STAGELOAD_RUFF   (printed) ruff, for the Python lint of `cargo xtask test`
set -euo pipefail
log() { echo "setup-python: $*" >&2; }
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ -z "${STAGELOAD_PYTHON:-}" ]]; then
    # Run alone (the one set-up command of a Python user): torch first.
    setup=$("$here/scripts/setup-libtorch.sh") || exit 1
    eval "$setup"
fi
python=$STAGELOAD_PYTHON
MATURIN_VERSION=1.16.0
RUFF_VERSION=0.17.6
PYTEST_VERSION=9.2.0

cache=$(cd "$("$python" -c 'import sys; print(sys.prefix)')/.." && pwd)
tools="$cache/maturin-venv"
if ! "$tools/bin/python" -c "import sys, importlib.metadata as m; sys.exit(m.version('maturin') != '$MATURIN_VERSION' or m.version('ruff') != '$RUFF_VERSION')" 2>/dev/null; then
    log "installing maturin==$MATURIN_VERSION and ruff==$RUFF_VERSION into $tools (once per machine)"
    [[ -x "$tools/bin/python" ]] || python3 -m venv "$tools" >&2
    if ! "$tools/bin/python" -m pip install --disable-pip-version-check --no-cache-dir -q "maturin==$MATURIN_VERSION" "ruff==$RUFF_VERSION" >&2; then
        log "could not install maturin and ruff from the Python package registry; the Python package cannot be built without maturin."
        exit 1
    fi
fi
if ! "$python" -c "import sys, importlib.metadata as m; sys.exit(m.version('pytest') != '$PYTEST_VERSION')" 2>/dev/null; then
    log "installing pytest==$PYTEST_VERSION into $("$python" -c 'import sys; print(sys.prefix)') (once per machine)"
    if ! "$python" -m pip install --disable-pip-version-check --no-cache-dir -q "pytest==$PYTEST_VERSION" >&2; then
        log "could not install pytest==$PYTEST_VERSION from the Python package registry; the Python package's tests need it."
        exit 1
    fi
fi

# A workspace of its own (crates/python/Cargo.toml says why), built into the main target folder.
out="${CARGO_TARGET_DIR:-$here/target}/python"
rm -rf "$out/wheels"
log "building stageload_rs (crates/python) with maturin"
if ! (cd "$here/crates/python" && CARGO_TARGET_DIR="$out" "$tools/bin/maturin" build --release --quiet \
        -i "$python" --auditwheel skip -o "$out/wheels" >&2); then
    log "building stageload_rs failed (see above)."
    exit 1
fi
wheel=$(ls "$out"/wheels/stageload_rs-*.whl)
# Reinstalled only when the wheel changed: pip takes seconds even for an identical one.
sum=$(sha256sum "$wheel" | cut -c1-64)
stamp="$out/installed.sha256"
if [[ "$(cat "$stamp" 2>/dev/null)" != "$sum" ]] || ! "$python" -c "import importlib.metadata as m; m.version('stageload-rs')" 2>/dev/null; then
    if ! "$python" -m pip install --disable-pip-version-check --no-cache-dir -q --no-deps --force-reinstall "$wheel" >&2; then
        log "installing $wheel into the torch environment failed (see above)."
        exit 1
    fi
    echo "$sum" >"$stamp"
fi
log "stageload_rs is installed for $python"
echo "export STAGELOAD_RUFF='$tools/bin/ruff'"
