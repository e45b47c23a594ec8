"""Fixtures of the expert-parallel tests."""

import pytest

from tests import rankpool


@pytest.fixture
def pool_factory():
    """``pool_factory(world_size, **kw)`` -> cached pool of the backend under test."""
    backend, transport = rankpool.default_backend()

    def make(world_size, backend=backend, transport=transport, **kw):
        return rankpool.get_pool(world_size, backend, transport, **kw)

    return make
