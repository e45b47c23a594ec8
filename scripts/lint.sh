#!/usr/bin/env bash
# Lint and format checks, the same here, in CI and in pre-commit:
#   ruff check + ruff format --check on the Python tree (config: pyproject.toml [tool.ruff]),
#   clang-format --dry-run --Werror on csrc/ (config: .clang-format),
#   scripts/check_includes.py: the torch-free folders (csrc/core, csrc/transport, csrc/ep)
#   include no torch, ATen, c10 or pybind11 header, also through project headers, and at most
#   10 translation units of the CPU build include torch headers (--fix changes nothing here).
# Installs the pinned ruff and clang-format from PyPI when the ones on PATH are missing or of
# another version. `--fix` rewrites files instead of checking them.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

RUFF_VERSION="0.17.6"
CLANG_FORMAT_VERSION="23.1.5"
FIX=0
for arg in "$@"; do
    case "$arg" in
        --fix) FIX=1 ;;
        *) echo "usage: $0 [--fix]" >&2; exit 2 ;;
    esac
done

# the tools live in a venv of their own so that their versions never depend on the project's
TOOLS="${MOONCAKE_LINT_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/mooncake/lint-venv}"
have() { [[ -x "$TOOLS/bin/$1" ]] && "$TOOLS/bin/$1" --version 2>/dev/null | grep -q "$2"; }
if ! have ruff "$RUFF_VERSION" || ! have clang-format "$CLANG_FORMAT_VERSION"; then
    echo "[lint] installing ruff==$RUFF_VERSION clang-format==$CLANG_FORMAT_VERSION into $TOOLS"
    mkdir -p "$(dirname "$TOOLS")"
    [[ -x "$TOOLS/bin/python" ]] || python3 -m venv "$TOOLS"
    PIP_DISABLE_PIP_VERSION_CHECK=1 "$TOOLS/bin/python" -m pip install -q \
        "ruff==$RUFF_VERSION" "clang-format==$CLANG_FORMAT_VERSION"
fi
RUFF="$TOOLS/bin/ruff"
CLANG_FORMAT="$TOOLS/bin/clang-format"

mapfile -t CSRC < <(git ls-files -co --exclude-standard 'csrc/*.cpp' 'csrc/*.hpp' 'csrc/*.h' 'csrc/*.cu' 'csrc/*.cuh')
rc=0
if ((FIX)); then
    "$RUFF" check --fix . || rc=1
    "$RUFF" format . || rc=1
    "$CLANG_FORMAT" -i "${CSRC[@]}" || rc=1
else
    echo "[lint] ruff check"
    "$RUFF" check . || rc=1
    echo "[lint] ruff format --check"
    "$RUFF" format --check . || rc=1
    echo "[lint] clang-format --dry-run --Werror (${#CSRC[@]} files under csrc/)"
    "$CLANG_FORMAT" --dry-run --Werror "${CSRC[@]}" || rc=1
fi
echo "[lint] include checks (scripts/check_includes.py)"
python3 scripts/check_includes.py || rc=1
((rc == 0)) && echo "[lint] clean" || echo "[lint] FAILED: run 'bash scripts/lint.sh --fix' and review the diff"
exit "$rc"
