#!/usr/bin/env bash
# Installs libtorch (carried by the PyTorch wheel torch==2.13.0 from the Python package registry)
# into a per-user cache shared by every clone, and prints the environment cargo needs. It is the
# one installer: `cargo xtask` runs it, and a build without libtorch (crates/build-support) and
# `stageload libtorch` name it. A crate of your own uses it too, from its stageload checkout.
#
#   STAGELOAD_CACHE   cache root (default: ${XDG_CACHE_HOME:-$HOME/.cache}/stageload)
#   LIBTORCH          a libtorch 2.13 of your own: the install is skipped and it is used as is
#
# Usage:  eval "$(scripts/setup-libtorch.sh)"   # exports LIBTORCH_USE_PYTORCH / PATH or LIBTORCH
set -euo pipefail

TORCH_VERSION=2.13.0
# The peer the checkpoint load benchmark measures against: its newest release when pinned.
SAFETENSORS_VERSION=0.8.0
cache_root=${STAGELOAD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/stageload}
venv="$cache_root/torch-$TORCH_VERSION"

log() { echo "setup-libtorch: $*" >&2; }

if [[ -n "${LIBTORCH:-}" ]]; then
    if [[ ! -d "$LIBTORCH/lib" || ! -d "$LIBTORCH/include" ]]; then
        log "LIBTORCH=$LIBTORCH has no lib/ and include/ folders; point it at a libtorch $TORCH_VERSION folder, or unset it to let this script install one into $venv"
        exit 1
    fi
    log "using LIBTORCH=$LIBTORCH (install skipped)"
    echo "export LIBTORCH='$LIBTORCH'"
    exit 0
fi

if [[ ! -x "$venv/bin/python" ]] || ! "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
    python=${PYTHON:-python3}
    if ! command -v "$python" >/dev/null; then
        log "python3 not found: install Python 3 with pip and venv, or set LIBTORCH to a libtorch $TORCH_VERSION"
        exit 1
    fi
    log "installing torch==$TORCH_VERSION into $venv (once per machine; about 80 s and 5 GB)"
    mkdir -p "$cache_root"
    lock="$cache_root/.install.lock"
    exec 9>"$lock"
    flock 9
    if [[ ! -x "$venv/bin/python" ]]; then
        "$python" -m venv "$venv" >&2
    fi
    if ! "$venv/bin/python" -m pip install --disable-pip-version-check --no-cache-dir -q "torch==$TORCH_VERSION" "safetensors==$SAFETENSORS_VERSION" numpy >&2; then
        log "could not install torch==$TORCH_VERSION from the Python package registry."
        log "Without network access, install it by hand: '$venv/bin/python -m pip install torch==$TORCH_VERSION' from a local wheel,"
        log "or download libtorch $TORCH_VERSION and set LIBTORCH to its folder."
        exit 1
    fi
    flock -u 9
fi

# (importlib.metadata answers without importing it)
if ! "$venv/bin/python" -c "import sys, importlib.metadata as m; sys.exit(m.version('safetensors') != '$SAFETENSORS_VERSION')" 2>/dev/null; then
    log "installing safetensors==$SAFETENSORS_VERSION into $venv (the load benchmark's peer)"
    if ! "$venv/bin/python" -m pip install --disable-pip-version-check --no-cache-dir -q "safetensors==$SAFETENSORS_VERSION" >&2; then
        log "could not install safetensors==$SAFETENSORS_VERSION from the Python package registry; the load benchmark and some tests need it."
        exit 1
    fi
fi

echo "export LIBTORCH_USE_PYTORCH=1"
echo "export PATH='$venv/bin':\"\$PATH\""
echo "export STAGELOAD_PYTHON='$venv/bin/python'"
