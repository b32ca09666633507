#!/usr/bin/env bash
# Collect the third-party wheels an offline GPU machine needs for the GPU list and the gate.
#
#   scripts/gpu_wheelhouse.sh <dir> [--python-version 3.12]
#
# The GPU list (release/gpu-test-list.txt) exercises DeepSpeed and Megatron-Core; the GPU
# machines have CUDA torch, triton, pytest and transformers but no network, so the engines
# travel as wheels. Run this on a machine with PyPI access, copy <dir> beside the checkout and
#   GEFEN_GATE_EXTRA_WHEELS=<dir> scripts/release_gpu_gate.sh dist/ ...
# (or `python3 -m pip install --no-index --find-links <dir> deepspeed megatron-core` before
# scripts/run_gpu_tests.sh). DeepSpeed is published as an sdist only: it is built here into a
# pure-Python wheel (its CUDA ops are JIT-built on first use on the GPU machine). Pins match
# noxfile.py's TEST_REQUIREMENTS.
set -euo pipefail

dir="${1:?usage: gpu_wheelhouse.sh <dir> [--python-version X.Y]}"
shift
pyver="3.12"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --python-version) pyver="$2"; shift ;;
    *) echo "gpu_wheelhouse.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
PYTHON="${PYTHON:-python3}"
mkdir -p "$dir"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

"$PYTHON" -m pip download --quiet --no-deps --no-binary :all: -d "$tmp" deepspeed==0.19.8
"$PYTHON" -m pip wheel --quiet --no-deps -w "$dir" "$tmp"/deepspeed-0.19.8.tar.gz
plat=(--only-binary=:all: --python-version "$pyver" --platform manylinux2014_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64)
# DeepSpeed's runtime dependencies (resolved together, so pydantic gets its pydantic-core), and
# megatron-core without its dependencies (numpy, packaging and CUDA torch are on the machine).
"$PYTHON" -m pip download --quiet -d "$dir" "${plat[@]}" \
  einops hjson msgpack ninja psutil py-cpuinfo pydantic
"$PYTHON" -m pip download --quiet -d "$dir" "${plat[@]}" --no-deps megatron-core==0.16.1
ls -1 "$dir"
