"""Records of error paths in rank processes, and the follow-up ops that show a group still
works after an error (shared by the p2p, bad-input, lifecycle and seat tests of pg/).

Every rank function returns plain records (:func:`outcome`); the assertions are made in
the test process against values computed there (:func:`expected_follow_up`).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests.rankpool import RankPool, parse_backends

TRANSPORTS = ["shm", "tcp"]
SENTINEL = -7.0
LOCAL_ERROR_LIMIT_S = 1.0  # an error found by local or header checks comes at once
RUN_TIMEOUT = 60.0  # one pool.run

mooncake_only = pytest.mark.skipif(
    not any(b == "mooncake" for b, _ in parse_backends()),
    reason="a check of the mooncake backend",
)


def default_store():
    """The default group's store (file store of the pool, behind torch's prefix)."""
    return dist.distributed_c10d._get_default_store()


def outcome(fn):
    """Runs ``fn()``; a picklable record of what happened and how long it took."""
    t0 = time.monotonic()
    try:
        val = fn()
        return {"ok": True, "dt": time.monotonic() - t0, "val": val}
    except Exception as e:
        return {
            "ok": False,
            "dt": time.monotonic() - t0,
            "type": type(e).__name__,
            "mro": [c.__name__ for c in type(e).__mro__],
            "msg": str(e),
            "failed": list(getattr(e, "failed_ranks", []) or []),
        }


def follow_up(rank, ws):
    """Normal collectives after an error: all_reduce (small and pipelined) and all_gather."""
    small = torch.full((5,), float(rank + 1))
    dist.all_reduce(small)
    big = torch.arange(100_000, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(big)
    out = torch.full((ws * 3,), SENTINEL)
    dist.all_gather_into_tensor(out, torch.full((3,), float(rank * 10)))
    return {"small": small, "big": big, "agit": out}


def expected_follow_up(ws):
    s = ws * (ws + 1) / 2
    return {
        "small": torch.full((5,), s),
        "big": torch.arange(100_000, dtype=torch.float32) * s,
        "agit": (torch.arange(ws, dtype=torch.float32) * 10).repeat_interleave(3),
    }


def check_follow_up(res, ws, ctx):
    exp = expected_follow_up(ws)
    for r in range(ws):
        for k, v in exp.items():
            assert torch.equal(res[r]["after"][k], v), (
                f"{ctx} rank {r}: follow-up {k} gave {res[r]['after'][k][:8].tolist()}, "
                f"expected {v[:8].tolist()}"
            )


def fmt(rec):
    if rec.get("ok"):
        return f"returned after {rec['dt']:.2f} s"
    return f"raised {rec['type']} after {rec['dt']:.2f} s: {rec['msg'][:300]}"


def fresh_pool(ws, transport, op_timeout, **kw):
    """A new mooncake pool (never a cached one: these tests kill ranks or break links)."""
    return RankPool(ws, "mooncake", transport, op_timeout=op_timeout, **kw)
