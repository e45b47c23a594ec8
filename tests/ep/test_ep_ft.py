"""Expert parallelism with a rank that dies between dispatch and combine (docs/design.md
"Expert parallel" / "Membership and fault tolerance").

W=4 on a fresh rank pool (never the cached ones: a process dies), rank 2 SIGKILLs itself
after a normal dispatch and a low-latency dispatch. Survivors then combine with the
handles they hold: with ``on_failure="mask"`` the combines complete over the survivors;
with ``"raise"`` they raise ``RankFailureError`` (failed [2], epoch 1) on every survivor and
a retry with the same handle completes. Either way every survivor's output equals the
float64 reference without rank 2's experts, later dispatches route nothing to rank 2, an
``ExpertParallelMoE`` forward/backward equals the reference MoE without rank 2's experts,
and every survivor reports the same mask ([1, 1, 0, 1]) and epoch (1).

Also: a live peer that stays silent between dispatch and combine is declared failed by
the group's agreement (op timeout), never masked privately; and a rank that dies and is
replaced gets its experts' weights back (``ExpertParallelMoE.restore_experts``) before
any token is routed to it.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests import rankpool
from tests.ep import eputil
from tests.faults import kill_self
from tests.rankpool import RankPool, RemoteError

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
        log.append(
            {
                "op": name,
                "raised": {"failed": sorted(e.failed_ranks), "epoch": e.epoch},
                "dt": time.monotonic() - t0,
            }
        )
        return fn()


def rank_kill_between(rank, ws, seed):
    import mooncake_ep
    import mooncake_pg

    buf = mooncake_ep.Buffer()
    L = E // ws
    x, idx, w = eputil.make_inputs(rank, T + rank, H, E, K, torch.float32, seed, 0.2)
    r = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    ll = buf.low_latency_dispatch(x, idx, T + ws, E)
    y = eputil.scaled_experts_normal(
        r.recv_x, r.recv_topk_idx, r.recv_topk_weights, rank, L, plus_one
    )
    y_ll = eputil.scaled_experts_ll(ll.recv_x, rank, L, plus_one)
    if rank == VICTIM:
        kill_self(rank, "between dispatch and combine")
    log = []
    out = _try(lambda: buf.combine(y, r.handle).combined_x, log, "combine")
    out_ll = _try(
        lambda: buf.low_latency_combine(y_ll, idx, w, ll.handle).combined_x,
        log,
        "low_latency_combine",
    )
    # later rounds run over the survivors
    r2 = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    y2 = eputil.scaled_experts_normal(
        r2.recv_x, r2.recv_topk_idx, r2.recv_topk_weights, rank, L, plus_one
    )
    out2 = buf.combine(y2, r2.handle).combined_x
    ll2 = buf.low_latency_dispatch(x, idx, T + ws, E)
    out2_ll = buf.low_latency_combine(
        eputil.scaled_experts_ll(ll2.recv_x, rank, L, plus_one), idx, w, ll2.handle
    ).combined_x
    # the MoE layer after the failure (forward and input gradient)
    gate, experts = eputil.build_model(H, E, 2, 16, "topk", seed=4)
    moe = mooncake_ep.ExpertParallelMoE(gate, experts)
    xm = eputil.make_inputs(rank, T, H, E, K, torch.float32, seed + 1)[0].requires_grad_()
    ym = moe(xm)
    ym.sum().backward()
    return {
        "out": out,
        "out_ll": out_ll,
        "out2": out2,
        "out2_ll": out2_ll,
        "log": log,
        "recv_from_victim": r2.recv_x.shape[0],
        "moe_y": ym.detach(),
        "moe_gx": xm.grad,
        "active": mooncake_pg.get_active_ranks().tolist(),
        "epoch": mooncake_pg.get_epoch(),
        "buf_active": buf.get_active_ranks().tolist(),
        "buf_epoch": buf.get_epoch(),
        "failed": sorted(mooncake_pg.backend_of().failed_ranks()),
    }


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
    assert not bad, "\n".join(
        f"rank {r}: {e.type_name}: {e.message}\n{e.traceback}" for r, e in bad.items()
    )
    L = E // W
    dead = set(range(VICTIM * L, (VICTIM + 1) * L))
    gate, experts = eputil.build_model(H, E, 2, 16, "topk", seed=4)
    for r in survivors:
        o = res[r]
        x, idx, w = eputil.make_inputs(r, T + r, H, E, K, torch.float32, seed, 0.2)
        exp = eputil.ref_scaled_moe(x, idx, w, plus_one, excluded=dead).float()
        full = eputil.ref_scaled_moe(x, idx, w, plus_one).float()
        assert not torch.allclose(exp, full), (
            "the test routes nothing to the victim: it proves nothing"
        )
        for key in ("out", "out_ll", "out2", "out2_ll"):
            torch.testing.assert_close(
                o[key], exp, rtol=1e-6, atol=1e-5, msg=lambda m: f"rank {r} {key}: {m}"
            )
        assert o["active"] == [1, 1, 0, 1] and o["buf_active"] == [1, 1, 0, 1], (
            r,
            o["active"],
            o["buf_active"],
        )
        assert o["epoch"] == 1 and o["buf_epoch"] == 1 and o["failed"] == [VICTIM], (
            r,
            o["epoch"],
            o["failed"],
        )
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


# ============================================ a silent (live) peer goes to the agreement

SILENT_TIMEOUT = 3.0


def rank_silent_between(rank, ws, seed):
    import mooncake_ep
    import mooncake_pg

    buf = mooncake_ep.Buffer()
    L = E // ws
    x, idx, w = eputil.make_inputs(rank, T + rank, H, E, K, torch.float32, seed, 0.2)
    r = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    y = eputil.scaled_experts_normal(
        r.recv_x, r.recv_topk_idx, r.recv_topk_weights, rank, L, plus_one
    )
    if rank == VICTIM:
        time.sleep(SILENT_TIMEOUT + 2.0)  # alive but silent: no process death to see
        return {"slept": True}
    t0 = time.monotonic()
    out = buf.combine(y, r.handle).combined_x
    dt = time.monotonic() - t0
    return {
        "out": out,
        "dt": dt,
        "active": buf.get_active_ranks().tolist(),
        "epoch": buf.get_epoch(),
        "failed": sorted(mooncake_pg.backend_of().failed_ranks()),
    }


def test_silent_peer_is_reported_to_the_agreement():
    """mask policy, op timeout 3 s: rank 2 stays alive but does not call combine. The
    survivors' combine waits for the op timeout, the group agrees rank 2 failed (reason
    "op timeout"), and the combine completes over the survivors with the reference that
    excludes rank 2's experts; nothing is masked privately by mooncake_ep."""
    seed = 22
    pool = RankPool(W, "mooncake", None, op_timeout=SILENT_TIMEOUT, options={"on_failure": "mask"})
    try:
        res = pool.run(rank_silent_between, seed, timeout=60, return_exceptions=True)
        logs = "\n".join(rankpool._log_tail(pool.logs[r], 20000) for r in range(W))
    finally:
        pool.close(graceful=False)
    survivors = [r for r in range(W) if r != VICTIM]
    bad = {r: res[r] for r in survivors if isinstance(res[r], RemoteError)}
    assert not bad, "\n".join(
        f"rank {r}: {e.type_name}: {e.message}\n{e.traceback}" for r, e in bad.items()
    )
    L = E // W
    dead = set(range(VICTIM * L, (VICTIM + 1) * L))
    for r in survivors:
        o = res[r]
        x, idx, w = eputil.make_inputs(r, T + r, H, E, K, torch.float32, seed, 0.2)
        exp = eputil.ref_scaled_moe(x, idx, w, plus_one, excluded=dead).float()
        torch.testing.assert_close(o["out"], exp, rtol=1e-6, atol=1e-5)
        assert o["active"] == [1, 1, 0, 1] and o["epoch"] == 1 and o["failed"] == [VICTIM], o
        assert SILENT_TIMEOUT * 0.9 <= o["dt"] < SILENT_TIMEOUT + 5.0, o["dt"]
    assert "reason=op timeout" in logs, logs[-3000:]


# ====================================================== a rejoined rank gets its experts

RJ_H, RJ_E, RJ_K, RJ_F, RJ_T = 16, 6, 2, 12, 8
_RJ = {}


def _rj_model(rank, ws):
    """Every rank builds the same MoE, then 'trains' its own experts (a rank-dependent
    change), as a real run would have."""
    import mooncake_ep

    gate, experts = eputil.build_model(RJ_H, RJ_E, RJ_K, RJ_F, "topk", seed=8)
    moe = mooncake_ep.ExpertParallelMoE(gate, experts)
    return moe


def _perturbed_experts():
    """The reference: the full expert list after every owner's rank-dependent change."""
    gate, experts = eputil.build_model(RJ_H, RJ_E, RJ_K, RJ_F, "topk", seed=8)
    with torch.no_grad():
        for e, ex in enumerate(experts):
            for p in ex.parameters():
                p.add_(0.01 * (e + 1))
    return gate, experts


def _state_digest(moe):
    import hashlib

    h = hashlib.sha256()
    for ex in moe.experts:
        for p in ex.parameters():
            h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def rank_rj_setup(rank, ws):
    moe = _rj_model(rank, ws)
    with torch.no_grad():
        for l, ex in enumerate(moe.experts):
            for p in ex.parameters():
                p.add_(0.01 * (moe.first_expert + l + 1))
    moe.snapshot_experts()
    _RJ.clear()
    _RJ["moe"] = moe
    return _state_digest(moe)


def rank_rj_kill(rank, ws, victim):
    moe = _RJ["moe"]
    if rank == victim:
        kill_self(rank, "before the forward pass")
    x = eputil.make_inputs(rank, RJ_T, RJ_H, RJ_E, RJ_K, torch.float32, 30)[0]
    with torch.no_grad():
        y = moe(x)  # over the survivors
    moe.snapshot_experts()  # a snapshot while the victim is dead keeps its copy
    return y


def _guard(moe):
    """forward's refusal (the RuntimeError's text), or None if it ran."""
    try:
        moe(torch.zeros(1, RJ_H))
        return None
    except RuntimeError as e:
        return str(e)


def rank_rj_rejoin(rank, ws, victim):
    import mooncake_pg

    out = {}
    if rank == victim:
        # fresh weights: the old ones died with the process. A training script builds its
        # model before join_group (examples/moe_rl_demo.py), another one after it.
        early = _rj_model(rank, ws)
        out["guard_joining"] = _guard(early)  # not even joined yet
        mooncake_pg.join_group(None, timeout=20)
        late = _rj_model(rank, ws)
        out["fresh_digest"] = _state_digest(early)
        # both refuse locally, before any collective (a dispatch here would meet the
        # survivors' restore_experts instead of a dispatch)
        out["guard"] = _guard(early)
        out["guard_late"] = _guard(late)
        out["guard_again"] = _guard(early)
        moe = early
        _RJ.clear()
        _RJ["moe"] = moe
    else:
        moe = _RJ["moe"]
        for _ in range(2000):
            mooncake_pg.recover_ranks(None, mooncake_pg.get_pending_ranks())
            if all(mooncake_pg.get_active_ranks().tolist()):
                break
            time.sleep(0.005)
        try:
            with torch.no_grad():
                moe(torch.zeros(1, RJ_H))
            out["guard"] = None
        except RuntimeError as e:
            out["guard"] = str(e)
    moe.restore_experts()
    out["digest"] = _state_digest(moe)
    x = eputil.make_inputs(rank, RJ_T, RJ_H, RJ_E, RJ_K, torch.float32, 31)[0]
    with torch.no_grad():
        out["y"] = moe(x)
    out["active"] = mooncake_pg.get_active_ranks().tolist()
    out["epoch"] = mooncake_pg.get_epoch()
    return out


def test_rejoined_rank_gets_its_experts_back():
    """W=3, mask policy: experts 'trained' per rank and snapshotted; rank 1 is SIGKILLed
    (survivors' MoE then excludes its experts; they snapshot again), a replacement joins with fresh weights;
    until restore_experts() ran, forward refuses to route to it on every rank, the
    replacement included (RuntimeError raised locally before any collective, whether its
    MoE was built before or after join_group; before join_group it says to join); after it,
    the replacement's experts are bit-identical to the dead rank's and the MoE output
    equals the reference MoE with every rank's trained experts."""
    from tests.pg.test_rejoin import RejoinPool

    victim = 1
    rp = RejoinPool(None, policy="mask")
    try:
        res = rp.run(rank_rj_setup)
        assert not any(isinstance(v, RemoteError) for v in res), res
        digests = res
        res = rp.run(rank_rj_kill, victim)
        assert isinstance(res[victim], RemoteError) and res[victim].type_name == "RankDied", res[
            victim
        ]
        gate, experts = _perturbed_experts()
        L = RJ_E // 3
        dead = set(range(victim * L, (victim + 1) * L))
        for r in (0, 2):
            assert not isinstance(res[r], RemoteError), res[r]
            x = eputil.make_inputs(r, RJ_T, RJ_H, RJ_E, RJ_K, torch.float32, 30)[0]
            with torch.no_grad():
                exp = eputil.ref_moe(gate, experts, x, excluded=dead)
            torch.testing.assert_close(res[r], exp, rtol=1e-4, atol=1e-5)
        rp.respawn(victim)
        res = rp.run(rank_rj_rejoin, victim, timeout=60)
        bad = {r: v for r, v in enumerate(res) if isinstance(v, RemoteError)}
        assert not bad, "\n".join(
            f"rank {r}: {e.type_name}: {e.message}\n{e.traceback}" for r, e in bad.items()
        )
    finally:
        rp.close()
    assert res[victim]["fresh_digest"] != digests[victim], (
        "the replacement started with the old weights"
    )
    o = res[victim]
    assert o["guard_joining"] is not None and "join_group" in o["guard_joining"], o["guard_joining"]
    for key in ("guard_late", "guard_again"):
        assert o[key] is not None and "restore_experts" in o[key] and "[1]" in o[key], (key, o[key])
    for r in range(3):
        o = res[r]
        assert o["guard"] is not None and "restore_experts" in o["guard"] and "[1]" in o["guard"], (
            r,
            o["guard"],
        )
        assert f"(rank {r})" in o["guard"], (r, o["guard"])
        assert o["digest"] == digests[r], (
            f"rank {r}: experts after restore differ from before the failure"
        )
        assert o["active"] == [1, 1, 1] and o["epoch"] == 2, (r, o["active"], o["epoch"])
        x = eputil.make_inputs(r, RJ_T, RJ_H, RJ_E, RJ_K, torch.float32, 31)[0]
        with torch.no_grad():
            exp = eputil.ref_moe(gate, experts, x)
        torch.testing.assert_close(o["y"], exp, rtol=1e-4, atol=1e-5)
