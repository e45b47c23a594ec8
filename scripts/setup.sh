#!/usr/bin/env bash
# Sets up everything this project needs, on a fresh machine or an existing checkout:
#   1. a virtual environment in .venv (made with python3, or $PYTHON),
#   2. torch==2.13.0 (the CPU build where pip's local wheel cache has it),
#   3. the test and benchmark dependencies,
#   4. the project itself: `pip install --no-build-isolation -e .` (builds mooncake_pg._C).
# Idempotent: each step is skipped when already satisfied, so a second run takes seconds.
# Set MOONCAKE_FORCE_BUILD=1 to rebuild the extension anyway; `--deps-only` stops before
# building the project (CI times install and build as separate stages).
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

PYTHON="${PYTHON:-python3}"
VENV="$ROOT/.venv"
VPY="$VENV/bin/python"
TORCH_VERSION="2.13.0"
# Everything the tests, benchmarks and examples import besides torch and the project,
# plus what a --no-build-isolation build needs (setuptools, wheel, ninja). triton: the
# expert-parallel kernels are checked under TRITON_INTERPRET=1 and compiled for sm_90;
# tqdm and matplotlib: the main job's progress bars and plot; the store's runtime
# dependencies: msgpack, xxhash (WeightSync checksums), etcd3gw, prometheus_client (the
# master's and the KV cache's metrics), transformers (the KV cache takes and returns its
# caches) and uvloop (optional); redis: the store benchmark's peer client; expecttest and
# hypothesis: PyTorch's own distributed test suite (tests/torch_suite) imports them.
DEPS=("numpy" "pytest>=8" "pytest-timeout>=2.3" "ninja" "setuptools>=77" "wheel" "triton>=3.6" "tqdm" "matplotlib" "msgpack>=1.0" "xxhash>=3.0" "etcd3gw>=2.4" "prometheus_client>=0.17" "transformers>=5.25" "uvloop>=0.19" "redis>=5" "expecttest" "hypothesis")
export MAX_JOBS="${MAX_JOBS:-2}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

say() { echo "[setup] $*"; }

# 1. virtual environment
if [[ ! -x "$VPY" ]] || ! "$VPY" -c 'import sys' >/dev/null 2>&1; then
    say "creating virtual environment $VENV with $($PYTHON --version 2>&1)"
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
else
    say "virtual environment $VENV exists ($("$VPY" --version 2>&1))"
fi

# 2. torch, exact version (a different torch would break the extension's ABI)
have_torch="$("$VPY" - <<'PY' 2>/dev/null || true
import importlib.metadata as m
try:
    print(m.version("torch"))
except m.PackageNotFoundError:
    pass
PY
)"
if [[ "${have_torch%%+*}" == "$TORCH_VERSION" ]]; then
    say "torch $have_torch already installed"
else
    say "installing torch==$TORCH_VERSION (found: ${have_torch:-none})"
    "$VPY" -m pip install -q "torch==$TORCH_VERSION"
fi

# 3. test/benchmark/build dependencies
missing="$("$VPY" - "${DEPS[@]}" <<'PY'
import importlib.metadata as m, re, sys

def key(v):
    return tuple(int(x) for x in re.findall(r"\d+", v.split("+")[0])[:3])

for req in sys.argv[1:]:
    name, _, minimum = req.partition(">=")
    try:
        have = m.version(name)
    except m.PackageNotFoundError:
        print(req)
        continue
    if minimum and key(have) < key(minimum):
        print(req)
PY
)"
if [[ -z "$missing" ]]; then
    say "dependencies already installed: ${DEPS[*]}"
else
    # shellcheck disable=SC2086
    say "installing: $(echo $missing | tr '\n' ' ')"
    # torch is pinned so that nothing here can replace it
    mapfile -t missing_arr <<<"$missing"
    "$VPY" -m pip install -q "${missing_arr[@]}" "torch==$TORCH_VERSION"
fi

if [[ "$DEPS_ONLY" == 1 ]]; then
    say "dependencies ready (--deps-only: project not built)"
    exit 0
fi

# 4. the project (editable, compiled against the torch installed above).
# A full build is `pip install --no-build-isolation -e .`; pip builds editables in a fresh
# temporary folder, so when only csrc/ changed since the last install we recompile in place
# with `setup.py build_ext --inplace`, whose ninja build in build/ is incremental.
sha_of() { find "$@" -type f 2>/dev/null | LC_ALL=C sort | xargs -r sha1sum | sha1sum | cut -d' ' -f1; }
torch_now="$("$VPY" -c 'import importlib.metadata as m; print(m.version("torch"))')"
# (whether infiniband/verbs.h exists decides if the RDMA transport is compiled in)
meta_stamp="$(echo "$torch_now $(sha_of setup.py pyproject.toml) verbs=$([[ -e /usr/include/infiniband/verbs.h ]] && echo 1 || echo 0)")"
src_stamp="$(sha_of csrc)"
stamp_file="$VENV/.mooncake_build_stamp"
old_meta=""; old_src=""
if [[ -f "$stamp_file" ]]; then
    old_meta="$(sed -n 1p "$stamp_file")"; old_src="$(sed -n 2p "$stamp_file")"
fi
built_so="$(ls mooncake_pg/_C*.so 2>/dev/null | head -n1 || true)"
installed="$("$VPY" -c 'import importlib.metadata as m; print(m.version("mooncake-torch"))' 2>/dev/null || true)"
t0=$SECONDS
if [[ "${MOONCAKE_FORCE_BUILD:-0}" == "1" || -z "$installed" || -z "$built_so" || "$old_meta" != "$meta_stamp" ]]; then
    say "building and installing the project: pip install --no-build-isolation -e . (MAX_JOBS=$MAX_JOBS)"
    "$VPY" -m pip install -q --no-build-isolation -e .
    printf '%s\n%s\n' "$meta_stamp" "$src_stamp" >"$stamp_file"
    say "build done in $((SECONDS - t0)) s"
elif [[ "$old_src" != "$src_stamp" ]]; then
    say "csrc/ changed: incremental rebuild with setup.py build_ext --inplace (MAX_JOBS=$MAX_JOBS)"
    "$VPY" setup.py -q build_ext --inplace
    printf '%s\n%s\n' "$meta_stamp" "$src_stamp" >"$stamp_file"
    say "rebuild done in $((SECONDS - t0)) s"
else
    say "project mooncake-torch $installed already built and installed ($built_so up to date)"
fi
say "ready: $VPY"
