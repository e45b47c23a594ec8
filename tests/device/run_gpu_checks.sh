#!/usr/bin/env bash
# GPU checks of the CUDA paths: builds the CUDA extension against the installed torch,
# runs the conformance suite on CUDA tensors (2-4 ranks sharing the GPU), checks EP on the
# GPU and measures all_reduce bus bandwidth (vs the device-to-device copy ceiling and vs
# gloo on CUDA tensors) and EP latency; writes JSON (bench_out/gpu_checks.json).
#
#   bash tests/device/run_gpu_checks.sh [--dry-run] [--json OUT] [--steps a,b] [--skip-build]
#
# Needs nothing downloaded: the machine's python (PYTHON, default python3) with torch
# (CUDA build), triton, pytest, setuptools; nvcc from the CUDA toolkit. At most 6 minutes
# including the build. --dry-run runs nothing: it plans the steps, checks tools and
# imports, writes the JSON with "dry_run": true, and passes on a machine without a GPU.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PYTHON="${PYTHON:-python3}"
if [[ -z "${CUDA_HOME:-}" ]]; then
    for d in /usr/local/cuda /usr/local/cuda-*; do
        if [[ -x "$d/bin/nvcc" ]]; then export CUDA_HOME="$d"; break; fi
    done
fi
[[ -n "${CUDA_HOME:-}" ]] && export PATH="$CUDA_HOME/bin:$PATH"
exec timeout --kill-after=10 360 "$PYTHON" tests/device/gpu_checks.py "$@"
