#!/usr/bin/env bash
# Installs the checkpoint load benchmark's loader peers (cargo xtask bench-load), pinned, from the
# Python package registry into a Python environment of their own in the per-user cache that sees
# the torch environment's packages (scripts/setup-libtorch.sh made it; torch is not installed
# twice), once per machine (about 10 s and 30 MB), and prints where its python is. Only the
# benchmark runs this: the tests never need these peers. A peer that cannot be installed is
# logged and left out; the benchmark then reports it as not installed and measures the rest.
#
#   STAGELOAD_PYTHON   the torch environment's python (set by scripts/setup-libtorch.sh)
#   STAGELOAD_CACHE    cache root (default: ${XDG_CACHE_HOME:-$HOME/.cache}/stageload)
#
# Usage:  eval "$(scripts/setup-load-peers.sh)"   # exports STAGELOAD_LOAD_PEERS_PYTHON
set -euo pipefail

PEERS=(runai-model-streamer==0.17.0 fastsafetensors==0.5.0 instanttensor==0.2.2)
python=${STAGELOAD_PYTHON:?run scripts/setup-libtorch.sh first (eval its output): it sets STAGELOAD_PYTHON}
cache_root=${STAGELOAD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/stageload}
torch_env=$("$python" -c 'import sys; print(sys.prefix)')
venv="$cache_root/load-peers-$(basename "$torch_env")"

log() { echo "setup-load-peers: $*" >&2; }

# The pins as importlib.metadata checks: true when every peer is installed at its version.
installed() {
    local checks=() peer
    for peer in "$@"; do checks+=("m.version('${peer%%==*}') == '${peer##*==}'"); done
    "$venv/bin/python" -c "import importlib.metadata as m, sys; sys.exit(not all([$(IFS=,; echo "${checks[*]}")]))" 2>/dev/null
}

if ! installed "${PEERS[@]}"; then
    mkdir -p "$cache_root"
    exec 9>"$cache_root/.install-load-peers.lock"
    flock 9
    if ! installed "${PEERS[@]}"; then
        if [[ ! -x "$venv/bin/python" ]]; then
            if ! "$python" -m venv "$venv" >&2; then
                log "could not make a Python environment at $venv; the benchmark runs its peers with $python (those not installed there are reported)"
                echo "export STAGELOAD_LOAD_PEERS_PYTHON='$python'"
                exit 0
            fi
            # torch, numpy and safetensors come from the torch environment, after this one's own.
            "$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
                >"$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/stageload-torch-env.pth"
        fi
        for peer in "${PEERS[@]}"; do
            installed "$peer" && continue
            log "installing $peer into $venv (once per machine)"
            if ! "$venv/bin/python" -m pip install --disable-pip-version-check --no-cache-dir -q "$peer" >&2; then
                log "could not install $peer from the Python package registry; the benchmark reports it as not installed."
            fi
        done
    fi
fi
echo "export STAGELOAD_LOAD_PEERS_PYTHON='$venv/bin/python'"
