"""PyTorch's own distributed test suite against the ``mooncake`` backend.

``torch.testing._internal.distributed.distributed_test`` (``DistributedTest._DistTestBase``)
is the suite PyTorch holds its own backends to (``test/distributed/test_distributed_spawn.py``
drives it in PyTorch's CI). It reads ``BACKEND``, ``WORLD_SIZE`` and ``TEMP_DIR`` when it is
imported, so this module sets them first; run it through ``run_suite.py`` (one process
per world size), not by importing it next to other tests.
"""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("BACKEND", "mooncake")
os.environ.setdefault("WORLD_SIZE", "2")
if "TEMP_DIR" not in os.environ:  # imported on its own: a directory of its own, removed at exit
    os.environ["TEMP_DIR"] = tempfile.mkdtemp(prefix="mooncake-torch-suite-")
    atexit.register(shutil.rmtree, os.environ["TEMP_DIR"], ignore_errors=True)

import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import DistTestCases

import mooncake_pg  # noqa: F401  (registers the backend in every rank process)

# the suite runs its plugin, DDP and subgroup tests only for backends named here
for _feature in ("plugin", "ddp", "subgroup"):
    DistTestCases.backend_feature[_feature].add("mooncake")

from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)

assert dist.is_available() and torch.distributed.is_backend_available("mooncake")


# Rank processes come from a fork server that imported this module (torch, the suite and
# the extension) once: a spawned interpreter spends about 8 s of CPU importing them, per
# rank and per test. MOONCAKE_TORCH_SUITE_SPAWN=1 spawns them as PyTorch's CI does.
_SPAWN = os.environ.get("MOONCAKE_TORCH_SUITE_SPAWN", "0") == "1"
_CTX = torch.multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload([__name__])


def _with_env(env: dict, target, *args, **kwargs):
    os.environ.update(env)
    target(*args, **kwargs)


def _forked_rank(*, target, args, **kwargs):
    """A rank process from the fork server, with the test's environment: the server's own
    is the one it started with, but every test sets a new ``TEMP_DIR`` and ``INIT_METHOD``."""
    return _CTX.Process(target=_with_env, args=(dict(os.environ), target, *args), **kwargs)


class TestMooncakeSuite(TestDistBackend, DistributedTest._DistTestBase):
    """Every test of ``_DistTestBase``, each in fresh rank processes."""

    def setUp(self):
        super().setUp()
        if _SPAWN:
            self._spawn_processes()
        else:
            self._start_processes(_forked_rank)
