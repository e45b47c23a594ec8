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

Selection: the default run leaves out the tests marked ``slow`` (``@pytest.mark.slow``, or
``pytest.param(..., marks=pytest.mark.slow)`` for some parameters of a test) and still
covers every area: each collective at one world size over both transports, each failure
policy and fault type, EP, the store, weight sync, the KV cache and a multi-host case.
``--full`` (``bash scripts/test.sh --full``, what CI runs) selects everything; an explicit
``-m`` expression decides on its own.
"""

import pytest

from tests import rankpool


def pytest_addoption(parser):
    parser.addoption(
        "--full",
        action="store_true",
        default=False,
        help="run the tests marked slow too (the whole suite, as CI does)",
    )


def _is_slow(item) -> bool:
    """Whether a ``slow`` mark applies to ``item``.

    ``@pytest.mark.slow(unless={"transport": ["shm"]})`` marks only the parameter values
    outside ``unless``: the item stays in the default run when each parameter named there
    that the test takes has one of the listed values (parameters it does not take do not
    count).
    """
    params = getattr(getattr(item, "callspec", None), "params", {})
    for mark in item.iter_markers("slow"):
        unless = mark.kwargs.get("unless")
        if not unless:
            return True
        if any(name in params and params[name] not in values for name, values in unless.items()):
            return True
    return False


def pytest_collection_modifyitems(config, items):
    """Deselects the ``slow`` tests unless ``--full`` or an explicit ``-m`` was given."""
    if config.getoption("--full") or config.getoption("markexpr"):
        return
    keep, slow = [], []
    for item in items:
        (slow if _is_slow(item) else keep).append(item)
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = keep


def pytest_report_header(config):
    if config.getoption("--full") or config.getoption("markexpr"):
        return None
    return "default selection: tests marked slow are left out (--full runs them)"


@pytest.fixture(scope="session", autouse=True)
def _rank_pools():
    """Tears every pool down (killing each rank's process group) at the end of the session."""
    yield
    rankpool.shutdown_all()


@pytest.fixture(scope="session")
def backend_under_test():
    """``(backend, transport)``: the first entry of MOONCAKE_TEST_BACKENDS."""
    return rankpool.default_backend()
