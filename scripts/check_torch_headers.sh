#!/usr/bin/env bash
# Compile check (g++ -fsyntax-only) of every C++ source against the headers of another
# torch release, with the CUDA and RDMA parts switched on: the GPU machine runs torch 2.11,
# this machine builds against 2.13 (CPU) and 2.14.1 (CUDA). APIs newer than a release must
# be guarded with TORCH_VERSION_MAJOR/MINOR.
#
#   bash scripts/check_torch_headers.sh [VERSION]     (default 2.11.0)
#
# The headers come from that torch wheel (pip download --no-deps, once per machine; only
# torch/include is kept) under ~/.cache/mooncake/torch-headers-VERSION. Exit 0 when every
# source compiles.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VER="${1:-2.11.0}"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/mooncake/torch-headers-$VER"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[[ -x "$PY" ]] || PY=python3
export PIP_DISABLE_PIP_VERSION_CHECK=1
say() { echo "[torch-headers] $*"; }
t0=$SECONDS
if [[ ! -f "$CACHE/torch/include/ATen/ATen.h" ]]; then
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    say "fetching the torch==$VER wheel's headers (once per machine)"
    pyver="$("$PY" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')"
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" \
        --platform manylinux_2_28_x86_64 "torch==$VER" -d "$tmp"
    mkdir -p "$CACHE.part"
    unzip -q -o "$tmp"/torch-"$VER"*.whl 'torch/include/*' 'torch/version.py' -d "$CACHE.part"
    rm -rf "$CACHE"; mv "$CACHE.part" "$CACHE"
fi
T="$CACHE/torch/include"
std=c++17
grep -q "C++20 or later" "$T/ATen/ATen.h" && std=c++20
PYINC="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
CUDA_INC=""
for d in "${CUDA_HOME:-}" /usr/local/cuda /usr/local/cuda-*; do
    [[ -n "$d" && -f "$d/include/cuda_runtime.h" ]] && { CUDA_INC="$d/include"; break; }
done
defs=(-DMOONCAKE_TORCH_VERSION="\"$VER\"" -DTORCH_EXTENSION_NAME=_C -DTORCH_API_INCLUDE_EXTENSION_H -D_GLIBCXX_USE_CXX11_ABI=1)
[[ -e /usr/include/infiniband/verbs.h ]] && defs+=(-DMOONCAKE_WITH_RDMA)
[[ -n "$CUDA_INC" ]] && defs+=(-DMOONCAKE_WITH_CUDA -I"$CUDA_INC")
mapfile -t srcs < <(find csrc -name '*.cpp' | LC_ALL=C sort)
say "torch $VER headers, -std=$std, ${#srcs[@]} sources, ${defs[*]:4}"
log="$(mktemp)"
printf '%s\n' "${srcs[@]}" | xargs -P "${MAX_JOBS:-2}" -I{} sh -c \
    'g++ -fsyntax-only -std='"$std"' "$@" {} 2>&1 | grep -E "error" | sed "s|^|{}: |" | head -n 5' _ \
    "${defs[@]}" -Icsrc -I"$T" -I"$T/torch/csrc/api/include" -I"$PYINC" >"$log" || true
if [[ -s "$log" ]]; then
    cat "$log"; rm -f "$log"
    say "FAILED against torch $VER after $((SECONDS - t0)) s"
    exit 1
fi
rm -f "$log"
say "ok: every source compiles against torch $VER ($((SECONDS - t0)) s)"
