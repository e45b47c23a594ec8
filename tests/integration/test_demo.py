"""The main job (``mooncake-demo`` = examples/moe_rl_demo.py), shortened: 4 training ranks
of a small MoE LM with expert parallelism under the in-process launcher (which also hosts
the store master), one rollout worker as a sidecar; rank 1 is SIGKILLed mid-run and
respawned. Asserts what the demo's summary reports: loss went down, the failure was
detected and recovered, all ranks at the end, dense parameters equal, the rollout served
at least 2 versions in increasing order with a K/V hit rate above 0 (logits equal with
reuse); and that the plot was written."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from tests import REPO_ROOT
from tests.faults import kill_group

ROOT = REPO_ROOT


@pytest.mark.timeout(300)
def test_demo_short_run(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", MOONCAKE_SOCKET_IFNAME="lo")
    p = subprocess.Popen(
        [
            os.path.join(os.path.dirname(os.sys.executable), "mooncake-demo"),
            "--steps",
            "40",
            "--kill-rank",
            "1",
            "--kill-at",
            "12",
            "--publish-every",
            "8",
            "--out",
            str(out),
            "--log-dir",
            str(tmp_path / "logs"),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        text, _ = p.communicate(timeout=240)
    finally:
        kill_group(p)
    assert p.returncode == 0, text[-5000:]
    for line in (
        "launcher exit 0",
        "loss went down",
        "failure recovered",
        "all ranks at the end",
        "dense parameters equal",
        "rollouts served >= 2 increasing versions",
        "rollout cache hit rate > 0",
        "logits equal with K/V reuse",
    ):
        assert any(l.startswith(line) and l.rstrip().endswith("ok") for l in text.splitlines()), (
            line,
            text[-3000:],
        )
    assert re.search(r"^killed at step\s+12$", text, re.M), text[-3000:]
    assert re.search(r"^recovered at step\s+\d+$", text, re.M), text[-3000:]
    assert (out / "loss.png").stat().st_size > 10_000
