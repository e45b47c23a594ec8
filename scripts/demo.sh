#!/usr/bin/env bash
# The main job of the README: sets everything up (scripts/setup.sh), then runs
# `mooncake-demo` (examples/moe_rl_demo.py): 4 training ranks of a small MoE language model
# with expert parallelism over "mooncake" under the in-process mooncake-run launcher; rank
# 1 is killed mid-run, respawned and rejoined. Extra arguments go to the demo
# (`bash scripts/demo.sh --help`).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
export OMP_NUM_THREADS=1
echo "[demo] .venv/bin/mooncake-demo $*"
exec .venv/bin/mooncake-demo "$@"
