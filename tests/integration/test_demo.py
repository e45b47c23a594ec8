"""The main job (``mooncake-demo`` = examples/moe_rl_demo.py), shortened: 4 training ranks
of a small MoE LM with expert parallelism under the in-process launcher (which also hosts
the store master), one rollout worker as a sidecar; rank 1 is SIGKILLed mid-run and
respawned. Asserts what the demo's summary reports: loss went down, the failure was
detected and recovered, all ranks at the end, dense parameters equal, the rollout served
at least 2 versions in increasing order with a K/V hit rate above 0 (logits equal with
reuse); and that the plot was written. Also over two emulated hosts (``--hosts 2``:
network namespaces), where the killed rank and the rollout worker live on the second
host."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from tests import REPO_ROOT, netns
from tests.faults import kill_group

ROOT = REPO_ROOT


def _run_demo(tmp_path, *extra, env=None):
    """mooncake-demo shortened (40 steps, the kill at step 12, a version every 8 steps);
    returns its output after checking the summary."""
    out = tmp_path / "out"
    p = subprocess.Popen(
        [
            os.path.join(os.path.dirname(os.sys.executable), "mooncake-demo"),
            *extra,
            "--steps",
            "40",
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
        env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})),
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
    return text


@pytest.mark.timeout(300)
def test_demo_short_run(tmp_path):
    text = _run_demo(tmp_path, "--kill-rank", "1", env={"MOONCAKE_SOCKET_IFNAME": "lo"})
    assert "kill rank 1 at step 12" in text, text[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(not netns.available()[0], reason=f"network namespaces: {netns.available()[1]}")
def test_demo_across_two_hosts(tmp_path):
    """--hosts 2: ranks 0-1 on host 0 (the launcher's control store and the store master),
    ranks 2-3 and the rollout worker on host 1; rank 2 (the default victim: the first rank
    of the last host) is killed and respawned on its host, and rejoins."""
    text = _run_demo(tmp_path, "--hosts", "2")
    assert "2 emulated hosts" in text and "kill rank 2 at step 12" in text, text[-3000:]
