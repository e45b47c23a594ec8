"""PyTorch's own distributed test suite (``torch.testing._internal.distributed.distributed_test``,
the one ``test/distributed/test_distributed_spawn.py`` drives in PyTorch's CI) against
``mooncake`` at world sizes 2 and 3: every test that runs passes; the ones that skip (with
torch's own reason) or fail for a reason outside our code are listed in ``known.tsv``, and a
test whose outcome differs from that list fails here (see runner.py)."""

import pytest

from tests.torch_suite import runner


@pytest.mark.timeout(1800)
@pytest.mark.slow
@pytest.mark.parametrize("world_size", runner.WORLD_SIZES, ids=lambda w: f"ws{w}")
def test_pytorch_distributed_suite(world_size):
    got = runner.run(world_size)
    assert sum(o.outcome == "passed" for o in got.values()) > 0, "no test of torch's suite ran"
    diffs = runner.differences(world_size, got, runner.load_known())
    assert not diffs, f"{len(diffs)} differences from tests/torch_suite/known.tsv:\n" + "\n".join(
        diffs
    )
