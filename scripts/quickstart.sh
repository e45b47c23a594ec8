#!/usr/bin/env bash
# The main job of the README (for now): sets everything up (scripts/setup.sh), then runs
# examples/quickstart.py on 4 ranks of one host with torchrun. Extra arguments go to
# quickstart.py, e.g. `bash scripts/quickstart.sh --backend gloo`.
# NPROC overrides the number of ranks (default 4).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
NPROC="${NPROC:-4}"
# --standalone: a private c10d rendezvous on a free port of localhost (never a fixed port).
# One torch thread per rank: the ranks share this host's cores.
echo "[quickstart] torchrun --standalone --nproc-per-node $NPROC examples/quickstart.py $*"
export OMP_NUM_THREADS=1
exec .venv/bin/torchrun --standalone --nproc-per-node "$NPROC" examples/quickstart.py "$@"
