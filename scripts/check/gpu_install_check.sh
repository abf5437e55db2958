#!/usr/bin/env bash
# The GPU install as a user makes it (README: one command), checked on the GPU
# machine, where nothing can be fetched:
#   1. `pip install '.[cuda13]'` (non-editable) resolved offline against what the
#      machine has installed (its CUDA 13 library wheels, cupy) plus the small
#      wheels carried in .whl/install: every cuda-toolkit 13.* meta-package (pip
#      takes the one whose pins the installed libraries meet), cuda-pathfinder, and
#      setuptools, wheel, packaging for the build;
#   2. `minfer generate` with no backend flag: its first stderr line must be
#      `minfer: backend cuda (...)`;
#   3. scripts/check/cuda_libs.py: the CUDA library files that process loads, and from where.
# Steps 2 and 3 run outside the checkout, so they use the installed package (cuda_libs.py
# is run by its path, not as a module of the checkout).
#
#   bash scripts/check/gpu_install_check.sh --fetch   # first, where the package index is reachable:
#                                               # the small wheels into .whl/install (~1 MB)
#   bash scripts/check/gpu_install_check.sh     # on the GPU machine, from the repository root; carry .whl
#
# Logs under $OUT (installed-before.txt, install.log, generate.txt, libs.txt).
# Exit status: non-zero if a step failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
LOG=${OUT:-/tmp/minfer-install-check}
CACHE=${MINFER_CACHE:-/tmp/minfer-cache}

if [ "${1:-}" = --fetch ]; then
    mkdir -p .whl/install
    for v in $(python3 -m pip index versions cuda-toolkit 2>/dev/null | sed -n 's/^Available versions: //p' \
               | tr ',' '\n' | tr -d ' ' | grep '^13\.'); do
        python3 -m pip download -q --no-deps --only-binary=:all: -d .whl/install "cuda-toolkit==$v" || exit 1
    done
    python3 -m pip download -q --no-deps --only-binary=:all: -d .whl/install \
        cuda-pathfinder setuptools wheel packaging || exit 1
    ls .whl/install
    exit 0
fi

mkdir -p "$LOG" "$CACHE"
unset PYTHONPATH                       # the installed minfer, not this checkout
FAILED=0
step() { echo "=== $1: $2 ${3:-}"; [ "$2" = FAIL ] && FAILED=1; }

python3 -m pip list 2>/dev/null | grep -iE "^(cupy|nvidia-|cuda-|minfer|numpy|gguf)" >"$LOG/installed-before.txt"
cat "$LOG/installed-before.txt"

# 1. the install, offline
if python3 -m pip install --no-index --no-cache-dir --find-links .whl/install --find-links .whl \
        '.[cuda13]' >"$LOG/install.log" 2>&1; then
    step install ok "$(grep -E '^Successfully installed' "$LOG/install.log")"
else
    step install FAIL "$(tail -3 "$LOG/install.log" | tr '\n' ' ')"
fi
grep -iE "satisfied: (cupy|nvidia|cuda)" "$LOG/install.log" | sed 's/ in .*//' | sort -u

# 2. minfer generate, no backend flag
cd /tmp
SYNTH=$(python3 -c "from minfer.tools.synth import synth_model; print(synth_model('$CACHE'))")
python3 -m minfer --version
python3 -m minfer generate -m "$SYNTH" -p 'def fibonacci(n):' -n 16 --ignore-eos \
    >"$LOG/generate.txt" 2>&1
rc=$?
first=$(head -1 "$LOG/generate.txt")
if [ $rc = 0 ] && [[ $first == "minfer: backend cuda ("* ]]; then
    step generate ok "$first"
else
    step generate FAIL "rc=$rc: $first"
fi
cat "$LOG/generate.txt"; echo

# 3. the library files it loads
if python3 "$REPO/scripts/check/cuda_libs.py" "$CACHE" >"$LOG/libs.txt" 2>&1; then
    step libs ok
else
    step libs FAIL
fi
cat "$LOG/libs.txt"
exit $FAILED
