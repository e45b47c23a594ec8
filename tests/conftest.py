"""Fixtures common to every area (see rankpool.py for the rank-process pool); each area's
own fixtures are in its conftest.py (pg/, ep/, store/, integration/).

Environment:
  MOONCAKE_TEST_BACKENDS   backend(s) under test, ``name[:transport]`` comma-separated
                           (default ``mooncake,mooncake:tcp``; ``gloo`` to develop without the extension)
  MOONCAKE_TEST_POOL_MODE  ``fork`` (default: ranks forked from a zygote that imported
                           torch) or ``spawn`` (fresh interpreters)
  MOONCAKE_TEST_MAX_POOLS  pools alive at once (default 6)
  MOONCAKE_TEST_KEEP_LOGS  1: keep the rank logs' temporary directory
  MOONCAKE_TORCH_SUITE_SPAWN  1: torch_suite/ spawns each rank as PyTorch's CI does (default:
                           forked from a server that imported torch and the suite once)
"""

import pytest

from tests import rankpool


@pytest.fixture(scope="session", autouse=True)
def _rank_pools():
    """Tears every pool down (killing each rank's process group) at the end of the session."""
    yield
    rankpool.shutdown_all()


@pytest.fixture(scope="session")
def backend_under_test():
    """``(backend, transport)``: the first entry of MOONCAKE_TEST_BACKENDS."""
    return rankpool.default_backend()
