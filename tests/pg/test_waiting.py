"""A rank that waits in a collective for a late peer does not burn its core.

The shared-memory engine spins briefly before it sleeps on a futex; the spin adapts to
the waits the rank sees, so a rank whose peer is always late (still computing, or queued
behind other processes on the cores) sleeps almost at once after a few such waits. The
reference is the peer's own sleep: rank 1 sleeps ``LATE_S`` before each call, so rank 0
waits about that long in each, and its CPU time over the calls (all its threads,
``time.process_time``) must stay a small part of the spin a fixed 2 ms spin would burn.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests.rankpool import default_backend, get_pool

pytestmark = pytest.mark.timeout(120)

BACKEND, TRANSPORT = default_backend()
LATE_S = 0.02
CALLS = 30


def rank_late_peer(rank, ws, late_s, calls):
    torch.set_num_threads(1)
    t = torch.ones(4)
    dist.all_reduce(t)  # set-up and first contact outside the measurement
    c0, w0 = time.process_time(), time.perf_counter()
    sums = []
    for i in range(calls):
        if rank == 1:
            time.sleep(late_s)
        x = torch.full((4,), float(rank + i))
        dist.all_reduce(x)
        sums.append(x[0].item())
    return {
        "cpu_s": time.process_time() - c0,
        "wall_s": time.perf_counter() - w0,
        "sums": sums,
    }


@pytest.mark.skipif(BACKEND != "mooncake", reason="the waiting scheme of mooncake's engine")
def test_a_rank_waiting_for_a_late_peer_sleeps():
    out = get_pool(2, BACKEND, TRANSPORT).run(rank_late_peer, LATE_S, CALLS, timeout=90)
    # results first: each call summed both ranks' values
    assert out[0]["sums"] == [float(2 * i + 1) for i in range(CALLS)]
    assert out[1]["sums"] == out[0]["sums"]
    waited = out[0]["wall_s"]
    assert waited >= CALLS * LATE_S * 0.9, out[0]
    # A fixed 2 ms spin per wait would burn CALLS * 2 ms = 60 ms on rank 0; the adaptive
    # spin burns about 4 ms in all (2 + 1 + 0.5 + ... ms) before it settles at a few us.
    assert out[0]["cpu_s"] < CALLS * 0.002 / 3, out[0]
