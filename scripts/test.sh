#!/usr/bin/env bash
# The test command of the README: sets everything up (scripts/setup.sh), then runs the
# test suite. Extra arguments go to pytest, e.g. `bash scripts/test.sh -k conformance -x`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
echo "[test] .venv/bin/python -m pytest tests -q $*"
exec .venv/bin/python -m pytest tests -q "$@"
