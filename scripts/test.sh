#!/usr/bin/env bash
# The test command of the README: sets everything up (scripts/setup.sh), then runs the
# tests. By default the selection that covers every area in a few minutes (tests marked
# `slow` are left out, tests/conftest.py); `--full` runs the whole suite, as CI does.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k conformance -x`; paths among
# them run only those tests (`bash scripts/test.sh tests/store/test_store_api.py`).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
# the whole suite, or only the paths given (`bash scripts/test.sh tests/store -x`)
given_path=0
for arg in "$@"; do
    [[ "$arg" != -* && -e "${arg%%::*}" ]] && given_path=1
done
((given_path)) || set -- tests "$@"
echo "[test] .venv/bin/python -m pytest -q $*"
exec .venv/bin/python -m pytest -q "$@"
