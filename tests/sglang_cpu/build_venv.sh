#!/bin/sh
# Builds, once, what the real-SGLang tests run on (test support only; nothing here is what a GPU
# user runs): a venv with SGLang 0.5.23 and mooncake's non-CUDA transfer engine, and the stand-in
# libcuda.so.1 of tests/sglang_cpu/libcuda_stub.c that lets `import sgl_kernel` load without a GPU.
# SGLang pins a CUDA build of torch: about 11 GB and 3-5 minutes the first time. Kept in
# $PD_ROUTER_CACHE/sglang-0.5.23 (default ~/.cache/pd-router), outside the clone; a later call
# returns at once. Prints the venv's path; exits non-zero when it cannot be built.
set -eu

SGLANG_VERSION=0.5.23
CACHE="${PD_ROUTER_CACHE:-$HOME/.cache/pd-router}"
VENV="$CACHE/sglang-$SGLANG_VERSION"
HERE="$(cd "$(dirname "$0")" && pwd)"
if [ -f "$VENV/.complete" ]; then echo "$VENV"; exit 0; fi

PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
command -v cc >/dev/null 2>&1 || { echo "sglang venv: needs a C compiler (cc) for the libcuda stub" >&2; exit 1; }
mkdir -p "$CACHE"
# Built in place (a venv cannot be moved) and marked complete last: a cut build is redone.
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip >&2
"$VENV/bin/python" -m pip install --quiet "sglang==$SGLANG_VERSION" mooncake-transfer-engine-non-cuda >&2
mkdir -p "$VENV/cpu-shim"
cc -shared -fPIC -O2 -Wl,-soname,libcuda.so.1 -o "$VENV/cpu-shim/libcuda.so.1" "$HERE/libcuda_stub.c"
touch "$VENV/.complete"
echo "$VENV"
