"""Fixtures of the store tests: the real master and agent processes of store_agents."""

import pytest

from tests.store import store_agents as sa
from tests.store.etcd_util import EtcdServer


@pytest.fixture
def procs():
    """The :mod:`store_agents` module; every master and agent it started is killed (its
    process group) at teardown."""
    yield sa
    sa.cleanup()


@pytest.fixture(scope="module")
def etcd():
    """The endpoint of a private etcd server (skips where there is no etcd binary)."""
    try:
        server = EtcdServer()
    except (FileNotFoundError, RuntimeError) as e:
        pytest.skip(f"no etcd: {e}")
    yield server.endpoint
    server.stop()
