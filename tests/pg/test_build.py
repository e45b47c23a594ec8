"""The extension's load-time checks and what the shared-memory transport leaves behind."""

import os
import subprocess
import sys

import pytest

from tests import REPO_ROOT, rankpool

REPO = REPO_ROOT


def test_refuses_other_torch_version():
    """``_C`` built for one torch refuses to load under another, naming both versions."""
    code = (
        "import torch\n"
        "built = torch.__version__\n"
        "torch.__version__ = '9.9.9'\n"
        "try:\n"
        "    import mooncake_pg\n"
        "except ImportError as e:\n"
        "    msg = str(e)\n"
        "    assert '9.9.9' in msg and built in msg, msg\n"
        "    print('refused:', msg)\n"
        "else:\n"
        "    raise SystemExit('mooncake_pg loaded under a different torch version')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "refused:" in out.stdout


def _shm_names(rank, world_size):
    import mooncake_pg

    return mooncake_pg.backend_of().transport, sorted(
        n for n in os.listdir("/dev/shm") if n.startswith("mooncake-")
    )


def test_shm_segments_unlinked_once_mapped():
    """After set-up every rank has the segment mapped and its name is gone from /dev/shm,
    so a SIGKILL of any rank cannot leak it."""
    if rankpool.default_backend()[0] != "mooncake":
        pytest.skip("mooncake-specific")
    res = rankpool.get_pool(3, "mooncake", "shm").run(_shm_names, timeout=60)
    for transport, names in res:
        assert transport == "shm"
        assert names == [], names


def _transport(rank, world_size):
    import mooncake_pg

    return mooncake_pg.backend_of().transport


def test_forced_tcp_transport_is_used():
    if rankpool.default_backend()[0] != "mooncake":
        pytest.skip("mooncake-specific")
    assert rankpool.get_pool(2, "mooncake", "tcp").run(_transport, timeout=60) == ["tcp", "tcp"]
