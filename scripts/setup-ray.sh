#!/usr/bin/env bash
# Installs Ray (ray==2.60.0 from the Python package registry), the scheduler the many-jobs run
# and its test submit cascade jobs to, into a Python environment of its own in the per-user cache
# (about 20 s and 290 MB, once per machine), and prints where its python is.
#
#   STAGELOAD_CACHE   cache root (default: ${XDG_CACHE_HOME:-$HOME/.cache}/stageload)
#
# Usage:  eval "$(scripts/setup-ray.sh)"   # exports STAGELOAD_RAY_PYTHON
set -euo pipefail

RAY_VERSION=2.60.0
cache_root=${STAGELOAD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/stageload}
venv="$cache_root/ray-$RAY_VERSION"

log() { echo "setup-ray: $*" >&2; }

if ! "$venv/bin/python" -c "import sys, importlib.metadata as m; sys.exit(m.version('ray') != '$RAY_VERSION')" 2>/dev/null; then
    python=${PYTHON:-python3}
    if ! command -v "$python" >/dev/null; then
        log "python3 not found: install Python 3 with pip and venv"
        exit 1
    fi
    mkdir -p "$cache_root"
    exec 9>"$cache_root/.install-ray.lock"
    flock 9
    log "installing ray==$RAY_VERSION into $venv (once per machine; about 20 s and 290 MB)"
    if ! { [[ -x "$venv/bin/python" ]] || "$python" -m venv "$venv"; } >&2; then
        log "could not make a Python environment at $venv: install Python's venv module (Debian: python3-venv)"
        exit 1
    fi
    if ! "$venv/bin/python" -m pip install --disable-pip-version-check --no-cache-dir -q "ray==$RAY_VERSION" >&2; then
        log "could not install ray==$RAY_VERSION from the Python package registry; the many-jobs run and its test need it."
        log "Without network access, install it by hand into $venv from a local wheel."
        exit 1
    fi
fi
echo "export STAGELOAD_RAY_PYTHON='$venv/bin/python'"
