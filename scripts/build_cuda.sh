#!/usr/bin/env bash
# Build check of the CUDA extension (no GPU needed): compiles mooncake_pg._C with CUDA
# against the CUDA build of torch, for sm_90, into a build folder outside the source tree,
# so the CPU extension in mooncake_pg/ (the one the tests import) is left alone.
#
#   1. a virtual environment outside the clone, made once per machine and reused:
#      $MOONCAKE_CUDA_VENV (default ~/.cache/mooncake/cuda-venv-torch$TORCH_VERSION);
#   2. torch==$MOONCAKE_CUDA_TORCH (default 2.14.1, the CUDA 13 build) + ninja/setuptools;
#   3. `setup.py build_ext` with MOONCAKE_WITH_CUDA=1, CUDA_HOME at the toolkit that holds
#      nvcc, TORCH_CUDA_ARCH_LIST=9.0, build folders under $MOONCAKE_CUDA_BUILD (default
#      ~/.cache/mooncake/cuda-build-torch$TORCH_VERSION: ninja reuses its objects);
#   4. checks that the .so exists and that its symbols include the CUDA kernels.
# `--deps-only` stops after step 2. Exit status 0 only when every step passed.
set -euo pipefail

DEPS_ONLY=0
for arg in "$@"; do
    case "$arg" in
        --deps-only) DEPS_ONLY=1 ;;
        *) echo "usage: $0 [--deps-only]" >&2; exit 2 ;;
    esac
done

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
TORCH_VERSION="${MOONCAKE_CUDA_TORCH:-2.14.1}"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/mooncake"
VENV="${MOONCAKE_CUDA_VENV:-$CACHE/cuda-venv-torch$TORCH_VERSION}"
BUILD="${MOONCAKE_CUDA_BUILD:-$CACHE/cuda-build-torch$TORCH_VERSION}"
VPY="$VENV/bin/python"
PYTHON="${PYTHON:-python3}"
export MAX_JOBS="${MAX_JOBS:-2}" PIP_DISABLE_PIP_VERSION_CHECK=1
say() { echo "[build_cuda] $*"; }
t0=$SECONDS

# the toolkit that holds nvcc
if [[ -z "${CUDA_HOME:-}" ]]; then
    nvcc_path="$(command -v nvcc || true)"
    [[ -n "$nvcc_path" ]] || { for d in /usr/local/cuda /usr/local/cuda-*; do [[ -x "$d/bin/nvcc" ]] && nvcc_path="$d/bin/nvcc" && break; done; }
    [[ -n "$nvcc_path" ]] || { say "ERROR: no nvcc on PATH or under /usr/local/cuda*: install the CUDA toolkit"; exit 1; }
    # nvcc may be a wrapper script: ask it where its toolkit is (its TOP)
    top="$("$nvcc_path" --dryrun -c x.cu -o x.o 2>&1 | sed -n 's/^#\$ TOP=//p' | head -n1)"
    [[ -n "$top" ]] || top="$(dirname "$(readlink -f "$nvcc_path")")/.."
    CUDA_HOME="$(cd "$top" && pwd)"
fi
export CUDA_HOME PATH="$CUDA_HOME/bin:$PATH"
say "CUDA_HOME=$CUDA_HOME ($("$CUDA_HOME/bin/nvcc" --version | tail -n2 | head -n1))"

# 1. venv outside the clone
if [[ ! -x "$VPY" ]] || ! "$VPY" -c 'import sys' >/dev/null 2>&1; then
    say "creating $VENV"
    mkdir -p "$(dirname "$VENV")"
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
fi
# 2. torch (CUDA build) + build deps
have="$("$VPY" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true)"
if [[ "${have%%+*}" != "$TORCH_VERSION" ]]; then
    say "installing torch==$TORCH_VERSION into $VENV (found: ${have:-none}; once per machine)"
    "$VPY" -m pip install -q "torch==$TORCH_VERSION" ninja "setuptools>=77" wheel numpy
else
    say "torch $have already in $VENV"
fi
"$VPY" -c 'import ninja, setuptools' 2>/dev/null || "$VPY" -m pip install -q ninja "setuptools>=77" wheel "torch==$TORCH_VERSION"
cuda_ver="$("$VPY" -c 'import torch; print(torch.version.cuda or "")')"
[[ -n "$cuda_ver" ]] || { say "ERROR: torch $TORCH_VERSION in $VENV is a CPU build (torch.version.cuda is None)"; exit 1; }
say "torch $("$VPY" -c 'import torch; print(torch.__version__)') built for CUDA $cuda_ver; deps ready after $((SECONDS - t0)) s"
[[ "$DEPS_ONLY" == 1 ]] && exit 0

# 3. build outside the source tree (its _build_info.py goes next to the .so, so the
# in-tree CPU extension's version record is not touched)
mkdir -p "$BUILD/lib/mooncake_pg" "$BUILD/temp"
export MOONCAKE_BUILD_INFO_DIR="$BUILD/lib/mooncake_pg"
t1=$SECONDS
# A fresh clone gives every source a new mtime, so ninja alone would rebuild everything:
# a stamp of the sources' contents (and torch, nvcc, verbs.h) skips a build whose inputs
# are byte-identical to the cached one. MOONCAKE_FORCE_BUILD=1 rebuilds anyway.
stamp="$( { find csrc -type f | LC_ALL=C sort | xargs sha1sum; sha1sum setup.py; "$VPY" -c 'import torch; print(torch.__version__)';
            "$CUDA_HOME/bin/nvcc" --version | tail -n1; ls /usr/include/infiniband/verbs.h 2>/dev/null || true; } | sha1sum | cut -d' ' -f1)"
so="$(ls "$BUILD"/lib/mooncake_pg/_C*.so 2>/dev/null | head -n1 || true)"
if [[ "${MOONCAKE_FORCE_BUILD:-0}" != 1 && -n "$so" && -f "$BUILD/stamp" && "$(cat "$BUILD/stamp")" == "$stamp" ]]; then
    say "sources unchanged since the cached build ($so): not rebuilt"
else
    say "building the CUDA extension (TORCH_CUDA_ARCH_LIST=9.0, MAX_JOBS=$MAX_JOBS) into $BUILD"
    rm -f "$BUILD/stamp"
    MOONCAKE_WITH_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0 "$VPY" setup.py -q build_ext \
        --build-lib "$BUILD/lib" --build-temp "$BUILD/temp"
    echo "$stamp" >"$BUILD/stamp"
    say "build done in $((SECONDS - t1)) s"
fi

# 4. checks
so="$(ls "$BUILD"/lib/mooncake_pg/_C*.so 2>/dev/null | head -n1 || true)"
[[ -n "$so" ]] || { say "ERROR: no mooncake_pg/_C*.so under $BUILD/lib"; exit 1; }
syms="$(nm -C -D --defined-only "$so" 2>/dev/null; nm -C "$so" 2>/dev/null)"
missing=0
for want in "mooncake::cuda::launch_reduce" "mooncake::cuda::ipc_export" "mooncake_reduce_kernel" \
            "mooncake::CudaIpc::reduce"; do
    if grep -q "$want" <<<"$syms"; then say "symbol ok: $want"; else say "ERROR: symbol missing: $want"; missing=1; fi
done
# device code: sm_90 cubins (cuobjdump lists them; a toolkit without it: the build's
# -gencode flags and the .nv_fatbin section holding their output)
if [[ -x "$CUDA_HOME/bin/cuobjdump" ]]; then
    arches="$("$CUDA_HOME/bin/cuobjdump" --list-elf "$so" 2>/dev/null | grep -o 'sm_[0-9a-z]*' | sort -u | tr '\n' ' ')"
    say "device code for: ${arches:-none}"
    grep -q sm_90 <<<"$arches" || { say "ERROR: no sm_90 code in $so"; missing=1; }
else
    gencode="$(grep -o 'gencode=arch=[^ ]*' "$BUILD/temp/build.ninja" 2>/dev/null | sort -u | tr '\n' ' ')"
    fatbin="$(readelf -S "$so" 2>/dev/null | grep -c '\.nv_fatbin' || true)"
    say "device code: ${gencode:-no -gencode flags}; .nv_fatbin sections: $fatbin (no cuobjdump in $CUDA_HOME)"
    [[ "$gencode" == *"code=sm_90"* && "$fatbin" -ge 1 ]] || { say "ERROR: no sm_90 device code in $so"; missing=1; }
fi
[[ "$missing" == 0 ]] || exit 1
say "ok: $so ($(du -h "$so" | cut -f1)), total $((SECONDS - t0)) s"
