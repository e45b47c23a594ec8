"""Expert parallelism with a rank that dies between dispatch and combine (issue 4, DESIGN.md
"Expert parallel" / "Membership and fault tolerance").

W=4 on a fresh rank pool (never the cached ones: a process dies), rank 2 SIGKILLs itself
after a normal dispatch and a low-latency dispatch. Survivors then combine with the
handles they hold: with ``on_failure="mask"`` the combines complete over the survivors;
with ``"raise"`` they raise ``RankFailureError`` (failed [2], epoch 1) on every survivor and
a retry with the same handle completes. Either way every survivor's output equals the
float64 reference without rank 2's experts, later dispatches route nothing to rank 2, an
``ExpertParallelMoE`` forward/backward equals the reference MoE without rank 2's experts,
and every survivor reports the same mask ([1, 1, 0, 1]) and epoch (1).
"""
from __future__ import annotations

import os
import signal
import sys
import time

import pytest
import torch

import eputil
import rankpool
from rankpool import RankPool, RemoteError

pytestmark = pytest.mark.timeout(120)

if not any(b == "mooncake" for b, _ in rankpool.parse_backends()):
    pytest.skip("dead-rank tests need the mooncake backend", allow_module_level=True)

W, VICTIM = 4, 2
T, H, E, K = 10, 32, 8, 3
OP_TIMEOUT = 30.0


def plus_one(e):
    return float(e + 1)


def _try(fn, log, name):
    """Runs fn(); on RankFailureError records it and runs fn() once more (raise policy)."""
    import mooncake_pg

    t0 = time.monotonic()
    try:
        res = fn()
        log.append({"op": name, "raised": None, "dt": time.monotonic() - t0})
        return res
    except mooncake_pg.RankFailureError as e:
        log.append({"op": name, "raised": {"failed": sorted(e.failed_ranks), "epoch": e.epoch},
                    "dt": time.monotonic() - t0})
        return fn()


def rank_kill_between(rank, ws, seed):
    import mooncake_pg
    import mooncake_ep

    buf = mooncake_ep.Buffer()
    L = E // ws
    x, idx, w = eputil.make_inputs(rank, T + rank, H, E, K, torch.float32, seed, 0.2)
    r = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    ll = buf.low_latency_dispatch(x, idx, T + ws, E)
    y = eputil.scaled_experts_normal(r.recv_x, r.recv_topk_idx, r.recv_topk_weights, rank, L, plus_one)
    y_ll = eputil.scaled_experts_ll(ll.recv_x, rank, L, plus_one)
    if rank == VICTIM:
        sys.stderr.write(f"[test_ep_ft] rank {rank}: SIGKILL between dispatch and combine\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    log = []
    out = _try(lambda: buf.combine(y, r.handle).combined_x, log, "combine")
    out_ll = _try(lambda: buf.low_latency_combine(y_ll, idx, w, ll.handle), log, "low_latency_combine")
    # later rounds run over the survivors
    r2 = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    y2 = eputil.scaled_experts_normal(r2.recv_x, r2.recv_topk_idx, r2.recv_topk_weights, rank, L, plus_one)
    out2 = buf.combine(y2, r2.handle).combined_x
    ll2 = buf.low_latency_dispatch(x, idx, T + ws, E)
    out2_ll = buf.low_latency_combine(eputil.scaled_experts_ll(ll2.recv_x, rank, L, plus_one), idx, w, ll2.handle)
    # the MoE layer after the failure (forward and input gradient)
    gate, experts = eputil.build_model(H, E, 2, 16, "topk", seed=4)
    moe = mooncake_ep.ExpertParallelMoE(gate, experts)
    xm = eputil.make_inputs(rank, T, H, E, K, torch.float32, seed + 1)[0].requires_grad_()
    ym = moe(xm)
    ym.sum().backward()
    return {"out": out, "out_ll": out_ll, "out2": out2, "out2_ll": out2_ll, "log": log,
            "recv_from_victim": r2.recv_x.shape[0], "moe_y": ym.detach(), "moe_gx": xm.grad,
            "active": mooncake_pg.get_active_ranks().tolist(), "epoch": mooncake_pg.get_epoch(),
            "buf_active": buf.get_active_ranks().tolist(), "buf_epoch": buf.get_epoch(),
            "failed": sorted(mooncake_pg.backend_of().failed_ranks())}


@pytest.mark.parametrize("policy", ["mask", "raise"])
def test_kill_between_dispatch_and_combine(policy):
    """W=4, rank 2 SIGKILLed after dispatch (normal and low-latency), before combine."""
    seed = 22  # every survivor routes tokens to the victim's experts with this seed
    pool = RankPool(W, "mooncake", None, op_timeout=OP_TIMEOUT, options={"on_failure": policy})
    try:
        res = pool.run(rank_kill_between, seed, timeout=60, return_exceptions=True)
    finally:
        pool.close(graceful=False)
    assert isinstance(res[VICTIM], RemoteError) and res[VICTIM].type_name == "RankDied", res[VICTIM]
    survivors = [r for r in range(W) if r != VICTIM]
    bad = {r: res[r] for r in survivors if isinstance(res[r], RemoteError)}
    assert not bad, "\n".join(f"rank {r}: {e.type_name}: {e.message}\n{e.traceback}" for r, e in bad.items())
    L = E // W
    dead = set(range(VICTIM * L, (VICTIM + 1) * L))
    gate, experts = eputil.build_model(H, E, 2, 16, "topk", seed=4)
    for r in survivors:
        o = res[r]
        x, idx, w = eputil.make_inputs(r, T + r, H, E, K, torch.float32, seed, 0.2)
        exp = eputil.ref_scaled_moe(x, idx, w, plus_one, excluded=dead).float()
        full = eputil.ref_scaled_moe(x, idx, w, plus_one).float()
        assert not torch.allclose(exp, full), "the test routes nothing to the victim: it proves nothing"
        for key in ("out", "out_ll", "out2", "out2_ll"):
            torch.testing.assert_close(o[key], exp, rtol=1e-6, atol=1e-5, msg=lambda m: f"rank {r} {key}: {m}")
        assert o["active"] == [1, 1, 0, 1] and o["buf_active"] == [1, 1, 0, 1], (r, o["active"], o["buf_active"])
        assert o["epoch"] == 1 and o["buf_epoch"] == 1 and o["failed"] == [VICTIM], (r, o["epoch"], o["failed"])
        raised = [e for e in o["log"] if e["raised"]]
        if policy == "mask":
            assert not raised, f"rank {r}: on_failure='mask' raised: {o['log']}"
        else:
            assert [e["op"] for e in raised] == ["combine"], f"rank {r}: {o['log']}"
            assert raised[0]["raised"] == {"failed": [VICTIM], "epoch": 1}, raised
        assert max(e["dt"] for e in o["log"]) < 5.0, f"rank {r}: slow detection {o['log']}"
        xm = eputil.make_inputs(r, T, H, E, K, torch.float32, seed + 1)[0].requires_grad_()
        ym = eputil.ref_moe(gate, experts, xm, excluded=dead)
        ym.sum().backward()
        torch.testing.assert_close(o["moe_y"], ym.detach(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(o["moe_gx"], xm.grad, rtol=1e-4, atol=1e-5)
