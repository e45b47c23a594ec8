"""Fault tolerance of the ``mooncake`` process group: cases FT-1 and FT-4 of
shared/cases/CASES.md, inactive-seat semantics after a failure, p2p with a peer that dies,
a deterministic kill-mid-op matrix (op x policy x transport) and a small random kill soak.

Contract: docs/design.md "Membership and fault tolerance". Every test kills a rank for real
(SIGKILL, ``os._exit(0)`` or the ``MOONCAKE_FAULT_INJECT`` hook), so each one builds a
fresh :class:`rankpool.RankPool` (never the cached pools) and tears it down with
``close(graceful=False)``, which kills every rank's process group.

Fault injection (:class:`tests.faults.Fault`, the ``ft_pool`` fixture):

* ``how="inject"``: the victim sets ``MOONCAKE_FAULT_INJECT="OP:ROUND"`` before creating
  the test group, so it SIGKILLs itself on collective number ``op`` of that group just
  before arriving at round ``round`` of it (0 = before it arrives at all);
* ``how="sigkill"`` / ``how="exit0"``: the victim calls ``os.kill(getpid(), SIGKILL)`` /
  ``os._exit(0)`` between collectives ``op - 1`` and ``op`` of the test group.

Every test runs its ops on a group made by :func:`make_group` (``dist.new_group`` over all
ranks; it inherits the pool's ``MooncakeOptions``). The rank pool answers a dead rank
with a ``RemoteError`` of type ``RankDied`` (checked by :func:`run_killed`).

Environment: ``MOONCAKE_FT_SEED`` (soak seed, default 20261129), ``MOONCAKE_FT_SOAK_TRIALS``
(default 10).
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import signal
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests import rankpool
from tests.faults import (
    Fault,
    kill_group,
    kill_self,
    make_group,
    maybe_die,
    victim_survived,
    wait_dead,
)
from tests.pg import outcomes as O
from tests.rankpool import RankPool, RemoteError

OP_TIMEOUT = 30.0  # MooncakeOptions.timeout of every pool here
DETECT_BOUND = 5.0  # detection + agreement must take well under OP_TIMEOUT
FAST_BOUND = 1.0  # fail-fast ops once a failure is known (FT-4)
RUN_TIMEOUT = 45.0  # one pool.run: bounded even if a survivor hangs to its op timeout
TRANSPORTS = ["shm", "tcp"]

pytestmark = pytest.mark.timeout(150)

if not any(b == "mooncake" for b, _ in rankpool.parse_backends()):
    pytest.skip("fault tolerance tests need the mooncake backend", allow_module_level=True)


# ============================================================== fault injection


@pytest.fixture
def ft_pool():
    """``ft_pool(world_size, transport, policy, **kw)`` -> a fresh RankPool (op timeout
    OP_TIMEOUT) whose ranks are all killed at teardown."""
    pools = []

    def make(world_size, transport, policy, **kw):
        opts = {"on_failure": policy}
        opts.update(kw.pop("options", {}))
        p = RankPool(world_size, "mooncake", transport, op_timeout=OP_TIMEOUT, options=opts, **kw)
        pools.append(p)
        return p

    yield make
    for p in pools:
        p.close(graceful=False)


_AGREED = re.compile(
    r"\[mooncake\] rank (\d+) group '([^']*)': epoch (\d+) agreed: ([^;\n]*);(\S*)"
)


def agreed_records(pool, ranks):
    """``{rank: [(group, epoch, failed_list, rest)]}`` from the ranks' logs."""
    out = {}
    for r in ranks:
        text = rankpool._log_tail(pool.logs[r], 200_000)
        recs = []
        for m in _AGREED.finditer(text):
            failed = [int(x) for x in m.group(4).split(",") if x.strip()]
            recs.append((m.group(2), int(m.group(3)), failed, m.group(5)))
        out[r] = recs
    return out


def mooncake_lines(pool, ranks):
    return "\n".join(
        f"rank {r}: {line}"
        for r in ranks
        for line in rankpool._log_tail(pool.logs[r], 200_000).splitlines()
        if "[mooncake]" in line or "[fault]" in line
    )


def run_killed(pool, fn, *args, victims, timeout=RUN_TIMEOUT):
    """Runs ``fn`` on every rank; asserts the victims died (RankDied, not a hang) and every
    survivor returned normally. Returns ``(survivor results {rank: value}, wall seconds)``."""
    t0 = time.monotonic()
    res = pool.run(fn, *args, timeout=timeout, return_exceptions=True)
    wall = time.monotonic() - t0
    survivors = [r for r in range(pool.world_size) if r not in victims]
    logs = mooncake_lines(pool, range(pool.world_size))
    for v in victims:
        assert isinstance(res[v], RemoteError) and res[v].type_name == "RankDied", (
            f"victim rank {v} should have died, got {res[v]!r}\n{logs}"
        )
    bad = {r: res[r] for r in survivors if isinstance(res[r], RemoteError)}
    assert not bad, (
        "survivors raised:\n"
        + "\n".join(f"rank {r}: {e.type_name}: {e.message}\n{e.traceback}" for r, e in bad.items())
        + "\n"
        + logs
    )
    return {r: res[r] for r in survivors}, wall


def check_log_blame(pool, survivors, victims):
    """No survivor's log agrees on anything but the victims, and every survivor logged the
    same record for each (group, epoch)."""
    recs = agreed_records(pool, survivors)
    logs = mooncake_lines(pool, range(pool.world_size))
    by_key = {}
    for r, lst in recs.items():
        for group, epoch, failed, rest in lst:
            assert set(failed) <= set(victims), (
                f"rank {r} logged an agreement blaming {failed} (only {sorted(victims)} died)\n{logs}"
            )
            by_key.setdefault((group, epoch), {})[r] = (tuple(failed), rest)
    for key, per_rank in by_key.items():
        assert len(set(per_rank.values())) == 1, (
            f"survivors logged different records for {key}: {per_rank}\n{logs}"
        )
    return recs


def digest(t):
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _outcome(fn):
    """Runs ``fn()``; returns a picklable record of what happened and how long it took."""
    import mooncake_pg

    t0 = time.monotonic()
    try:
        val = fn()
        return {"ok": True, "dt": time.monotonic() - t0, "val": val}
    except mooncake_pg.RankFailureError as e:
        return {
            "ok": False,
            "dt": time.monotonic() - t0,
            "type": type(e).__name__,
            "failed": sorted(e.failed_ranks),
            "epoch": e.epoch,
            "msg": str(e)[:500],
        }
    except Exception as e:
        return {
            "ok": False,
            "dt": time.monotonic() - t0,
            "type": type(e).__name__,
            "failed": None,
            "epoch": None,
            "msg": str(e)[:500],
        }


def _membership(g):
    import mooncake_pg

    return {
        "active": mooncake_pg.get_active_ranks(g).tolist(),
        "epoch": mooncake_pg.get_epoch(g),
        "failed": sorted(mooncake_pg.backend_of(g).failed_ranks()),
    }


# ============================================================================= FT-1

FT1_W = 4
FT1_ITERS = 200
FT1_VICTIM = 1
FT1_KILL_OP = 21  # the victim dies after iteration 20 (0-based collective 21 never completes)
FT1_BIG_N = 3_000_000  # the large all_reduce of the mid-op variants: 24 rounds with 1 MiB slots
FT1_FAULTS = {
    "sigkill": Fault(FT1_VICTIM, FT1_KILL_OP, "sigkill"),
    "exit0": Fault(FT1_VICTIM, FT1_KILL_OP, "exit0"),
    "inject-round0": Fault(FT1_VICTIM, FT1_KILL_OP, "inject", 0),
    "inject-mid": Fault(FT1_VICTIM, FT1_KILL_OP, "inject", 12),
    "inject-last": Fault(FT1_VICTIM, FT1_KILL_OP, "inject", 23),
}


def rank_ft1(rank, ws, fault):
    g = make_group(rank, ws, fault)
    recs = []
    big_at = fault.op if fault.how == "inject" else -1
    for i in range(FT1_ITERS):
        maybe_die(rank, fault, i)
        n = FT1_BIG_N if i == big_at else 1
        t = torch.full((n,), float(rank + 1))

        def op():
            dist.all_reduce(t, group=g)
            u = torch.unique(t)
            return {"digest": digest(t), "values": u.tolist() if u.numel() <= 4 else None}

        recs.append(_outcome(op))
    if rank == fault.victim:
        victim_survived(rank, fault)
    return {"recs": recs, **_membership(g)}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("variant", list(FT1_FAULTS))
@pytest.mark.parametrize("policy", ["raise", "mask"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_ft1_kill_mid_allreduce(ft_pool, transport, policy, variant):
    """FT-1: W=4, 200 all_reduce(SUM) of [rank+1]; rank 1 dies after iteration 20."""
    fault = FT1_FAULTS[variant]
    pool = ft_pool(FT1_W, transport, policy)
    res, wall = run_killed(pool, rank_ft1, fault, victims=[fault.victim])
    survivors = sorted(res)
    logs = mooncake_lines(pool, range(FT1_W))
    ctx = f"[{transport}/{policy}/{variant}: {fault.describe()}]"
    full, surv = float(sum(r + 1 for r in range(FT1_W))), float(sum(r + 1 for r in survivors))

    # every iteration had the same outcome on every survivor (raised with the same
    # failed set and epoch, or completed with bit-identical results)
    failing = []
    values = []
    for i in range(FT1_ITERS):
        outs = {r: res[r]["recs"][i] for r in survivors}
        oks = {r: o["ok"] for r, o in outs.items()}
        assert len(set(oks.values())) == 1, (
            f"{ctx} iteration {i}: survivors disagree on the outcome: {outs}\n{logs}"
        )
        if not oks[survivors[0]]:
            for r, o in outs.items():
                assert o["type"] == "RankFailureError", f"{ctx} iteration {i} rank {r}: {o}\n{logs}"
                assert o["failed"] == [fault.victim], (
                    f"{ctx} iteration {i} rank {r} blames {o['failed']}, expected [{fault.victim}]: {o}\n{logs}"
                )
            assert len({o["epoch"] for o in outs.values()}) == 1, (
                f"{ctx} iteration {i}: epochs differ: {outs}"
            )
            failing.append(i)
            values.append(None)
        else:
            ds = {o["val"]["digest"] for o in outs.values()}
            assert len(ds) == 1, (
                f"{ctx} iteration {i}: results differ across survivors: {outs}\n{logs}"
            )
            values.append(outs[survivors[0]]["val"]["values"])

    # the op in flight: the victim finished collective op-1 locally, so the first op
    # the survivors see fail is op-1 or op; with round >= 1 it is op exactly
    first_ok = fault.op - 1 if (fault.how != "inject" or fault.round == 0) else fault.op
    if policy == "raise":
        assert len(failing) == 1, (
            f"{ctx} expected exactly one op to raise, got iterations {failing}\n{logs}"
        )
        k = failing[0]
        assert first_ok <= k <= fault.op, (
            f"{ctx} the op that raised was iteration {k}, expected {fault.op}\n{logs}"
        )
        for r in survivors:
            assert res[r]["recs"][k]["epoch"] == 1, f"{ctx} rank {r}: {res[r]['recs'][k]}"
    else:
        assert not failing, (
            f"{ctx} on_failure='mask' must not raise, iterations {failing} raised\n{logs}"
        )
        # the op in flight completes over the survivors (8) unless it had completed with
        # everyone; from the first op the victim never reached on, every result is 8
        k = next(i for i, v in enumerate(values) if v != [full])
        assert first_ok <= k <= fault.op, (
            f"{ctx} first result without rank 1 at iteration {k}: {values[k]}\n{logs}"
        )
    for i in range(FT1_ITERS):
        if i < k:
            assert values[i] == [full], (
                f"{ctx} iteration {i} before the failure gave {values[i]}, expected [{full}]"
            )
        elif i > k or policy == "mask":
            assert values[i] == [surv], (
                f"{ctx} iteration {i} after the failure gave {values[i]}, expected [{surv}] (1+3+4)\n{logs}"
            )

    # bounded: the failing (or masked) op took well under the op timeout, and no op hung
    for r in survivors:
        dt = res[r]["recs"][k]["dt"]
        assert dt < DETECT_BOUND, (
            f"{ctx} rank {r}: the op in flight took {dt:.2f} s (op timeout {OP_TIMEOUT} s)"
        )
        worst = max(o["dt"] for o in res[r]["recs"])
        assert worst < DETECT_BOUND, f"{ctx} rank {r}: slowest op took {worst:.2f} s"

    # membership: every survivor agrees on {1}, epoch 1, active = all but 1; logs blame 1 only
    for r in survivors:
        m = res[r]
        assert m["failed"] == [fault.victim], f"{ctx} rank {r}: failed ranks {m['failed']}\n{logs}"
        assert m["epoch"] == 1, f"{ctx} rank {r}: epoch {m['epoch']}\n{logs}"
        assert m["active"] == [0 if j == fault.victim else 1 for j in range(FT1_W)], (
            f"{ctx} rank {r}: {m['active']}"
        )
    recs = check_log_blame(pool, survivors, [fault.victim])
    for r in survivors:
        assert any(ep == 1 and failed == [fault.victim] for _, ep, failed, _ in recs[r]), (
            f"{ctx} rank {r} logged no 'epoch 1 agreed: {fault.victim}' line\n{logs}"
        )
    dts = [res[r]["recs"][k]["dt"] for r in survivors]
    print(
        f"{ctx} op in flight = iteration {k}; its duration per survivor: "
        + ", ".join(f"{d * 1000:.1f} ms" for d in dts)
        + f"; run {wall:.2f} s"
    )


# ============================================================================= FT-4

FT4_W = 3
FT4_VICTIM = 2
FT4_WARMUP = 3  # collectives before the victim dies
FT4_N = 6  # numel of the input; out has FT4_W * FT4_N elements


def rank_ft4(rank, ws, fault):
    import mooncake_pg

    g = make_group(rank, ws, fault)
    for i in range(FT4_WARMUP):
        maybe_die(rank, fault, i)
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=g)
        assert t.item() == 6.0, t
    maybe_die(rank, fault, FT4_WARMUP)
    if rank == fault.victim:
        victim_survived(rank, fault)

    out = torch.full((ws * FT4_N,), -7.0)
    inp = torch.full((FT4_N,), float(rank + 1))
    recs = {"all_reduce": [], "untouched": []}

    def untouched():
        recs["untouched"].append(bool((out == -7.0).all()))

    for _ in range(10):
        recs["all_reduce"].append(_outcome(lambda: dist.all_reduce(out, group=g)))
        untouched()
    recs["all_gather_into_tensor"] = _outcome(
        lambda: dist.all_gather_into_tensor(out, inp, group=g)
    )
    untouched()
    recs["all_gather"] = _outcome(lambda: dist.all_gather(list(out.chunk(ws)), inp, group=g))
    untouched()

    # async all_reduce + wait(): wait never reports success
    w = {}

    def issue():
        w["work"] = dist.all_reduce(out, group=g, async_op=True)

    t0 = time.monotonic()
    recs["async_issue"] = _outcome(issue)
    if "work" in w:
        recs["async_wait"] = _outcome(lambda: w["work"].wait())
        recs["async_is_success"] = bool(w["work"].is_success())
        recs["async_failed_ranks"] = mooncake_pg.get_failed_ranks(w["work"])
    recs["async_total_dt"] = time.monotonic() - t0
    untouched()
    recs["before_deactivate"] = _membership(g)

    # manual recovery: every survivor deactivates the failed rank, then ops run over {0, 1}
    recs["deactivate"] = _outcome(lambda: mooncake_pg.deactivate_ranks(g, [fault.victim]))
    recs["after_deactivate"] = _membership(g)
    t = torch.tensor([float(rank + 1)])
    recs["all_reduce_after"] = _outcome(lambda: (dist.all_reduce(t, group=g), t.item())[1])
    ag = torch.full((ws * FT4_N,), -7.0)
    recs["all_gather_after"] = _outcome(
        lambda: (dist.all_gather_into_tensor(ag, inp, group=g), ag.view(ws, FT4_N)[:, 0].tolist())[
            1
        ]
    )
    recs["final"] = _membership(g)
    return recs


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_ft4_manual_fails_fast_and_leaves_buffers(ft_pool, transport):
    """FT-4: W=3, on_failure='manual', rank 2 killed; ops on the survivors fail fast
    without touching `out` until every survivor calls deactivate_ranks."""
    fault = Fault(FT4_VICTIM, FT4_WARMUP, "sigkill")
    pool = ft_pool(FT4_W, transport, "manual")
    res, wall = run_killed(pool, rank_ft4, fault, victims=[fault.victim])
    logs = mooncake_lines(pool, range(FT4_W))
    ctx = f"[{transport}/manual: {fault.describe()}]"
    for r, rec in sorted(res.items()):
        ars = rec["all_reduce"]
        for i, o in enumerate(ars):
            assert not o["ok"], (
                f"{ctx} rank {r}: all_reduce #{i} after the failure succeeded\n{logs}"
            )
            assert o["type"] == "RankFailureError" and o["failed"] == [fault.victim], (
                f"{ctx} rank {r}: all_reduce #{i}: {o}\n{logs}"
            )
            assert o["epoch"] == 1, f"{ctx} rank {r}: all_reduce #{i}: {o}"
            bound = DETECT_BOUND if i == 0 else FAST_BOUND
            assert o["dt"] < bound, (
                f"{ctx} rank {r}: all_reduce #{i} took {o['dt']:.3f} s (bound {bound} s)"
            )
        for name in ("all_gather_into_tensor", "all_gather"):
            o = rec[name]
            assert (
                not o["ok"] and o["type"] == "RankFailureError" and o["failed"] == [fault.victim]
            ), f"{ctx} rank {r}: {name}: {o}\n{logs}"
            assert o["dt"] < FAST_BOUND, f"{ctx} rank {r}: {name} took {o['dt']:.3f} s"
        iss = rec["async_issue"]
        if iss["ok"]:
            wt = rec["async_wait"]
            assert not wt["ok"], f"{ctx} rank {r}: async all_reduce wait() reported success\n{logs}"
            assert wt["type"] == "RankFailureError" and wt["failed"] == [fault.victim], (
                f"{ctx} rank {r}: wait(): {wt}"
            )
            assert not rec["async_is_success"], f"{ctx} rank {r}: work.is_success() is True"
            assert rec["async_failed_ranks"] == [fault.victim], (
                f"{ctx} rank {r}: get_failed_ranks(work) = {rec['async_failed_ranks']}"
            )
        else:
            assert iss["type"] == "RankFailureError" and iss["failed"] == [fault.victim], (
                f"{ctx} rank {r}: {iss}"
            )
        assert rec["async_total_dt"] < FAST_BOUND, (
            f"{ctx} rank {r}: async all_reduce took {rec['async_total_dt']:.3f} s"
        )
        assert all(rec["untouched"]), (
            f"{ctx} rank {r}: `out` was modified (after op #{rec['untouched'].index(False)})"
        )
        # manual: membership unchanged until deactivate_ranks
        b = rec["before_deactivate"]
        assert b["active"] == [1, 1, 1] and b["epoch"] == 0, (
            f"{ctx} rank {r}: before deactivate_ranks: {b}"
        )
        assert rec["deactivate"]["ok"], (
            f"{ctx} rank {r}: deactivate_ranks: {rec['deactivate']}\n{logs}"
        )
        for key in ("after_deactivate", "final"):
            m = rec[key]
            assert m["active"] == [1, 1, 0] and m["epoch"] == 1 and m["failed"] == [fault.victim], (
                f"{ctx} rank {r}: {key}: {m}"
            )
        o = rec["all_reduce_after"]
        assert o["ok"] and o["val"] == 3.0, f"{ctx} rank {r}: all_reduce over {{0, 1}}: {o}\n{logs}"
        o = rec["all_gather_after"]
        assert o["ok"] and o["val"] == [1.0, 2.0, -7.0], (
            f"{ctx} rank {r}: all_gather over {{0, 1}}: {o}"
        )
    check_log_blame(pool, sorted(res), [fault.victim])
    print(
        f"{ctx} fail-fast durations (ms) per survivor: "
        + "; ".join(
            f"rank {r}: " + ", ".join(f"{o['dt'] * 1000:.1f}" for o in rec["all_reduce"])
            for r, rec in sorted(res.items())
        )
        + f"; run {wall:.2f} s"
    )


# ============================================================ inactive seats (raise)

IS_W = 4
IS_VICTIM = 3
SENT = -1.0


def rank_inactive_seats(rank, ws, fault):

    g = make_group(rank, ws, fault)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=g)
    assert t.item() == 10.0
    maybe_die(rank, fault, 1)
    if rank == fault.victim:
        victim_survived(rank, fault)
    out = {}
    t = torch.tensor([float(rank + 1)])
    out["detect"] = _outcome(lambda: dist.all_reduce(t, group=g))
    out["membership"] = _membership(g)
    m = 5

    # all_gather (list and tensor forms): slot 3 keeps its sentinel
    inp = torch.arange(m, dtype=torch.float32) + 100 * rank
    outs = [torch.full((m,), SENT) for _ in range(ws)]
    out["all_gather"] = _outcome(
        lambda: (dist.all_gather(outs, inp, group=g), torch.stack(outs))[1]
    )
    flat = torch.full((ws * m,), SENT)
    out["all_gather_into_tensor"] = _outcome(
        lambda: (dist.all_gather_into_tensor(flat, inp, group=g), flat.clone())[1]
    )

    # AVG divides by the number of contributors (small: one round; large: pipelined)
    def avg(n):
        x = torch.full((n,), float(rank + 1))
        dist.all_reduce(x, op=dist.ReduceOp.AVG, group=g)
        return torch.unique(x).tolist()

    out["avg_small"] = _outcome(lambda: avg(1))
    out["avg_large"] = _outcome(lambda: avg(1 << 20))

    # all_to_all_single: nothing to/from rank 3; its output rows keep their sentinel
    a_in = torch.cat(
        [torch.arange(m, dtype=torch.float32) + 100 * rank + 10 * j for j in range(ws)]
    )
    a_out = torch.full((ws * m,), SENT)
    out["all_to_all_single"] = _outcome(
        lambda: (dist.all_to_all_single(a_out, a_in, group=g), a_out.clone())[1]
    )

    # reduce_scatter over the survivors (tensor and list forms)
    rs_in = torch.arange(ws * m, dtype=torch.float32) + 1000 * rank
    rs_out = torch.full((m,), SENT)
    out["reduce_scatter_tensor"] = _outcome(
        lambda: (dist.reduce_scatter_tensor(rs_out, rs_in, group=g), rs_out.clone())[1]
    )
    rs_out2 = torch.full((m,), SENT)
    out["reduce_scatter"] = _outcome(
        lambda: (dist.reduce_scatter(rs_out2, list(rs_in.chunk(ws)), group=g), rs_out2.clone())[1]
    )

    # rooted ops whose root died raise, and leave the buffers alone
    root = fault.victim
    b = torch.full((m,), SENT)
    out["broadcast_root3"] = _outcome(lambda: dist.broadcast(b, src=root, group=g))
    out["broadcast_root3_untouched"] = bool((b == SENT).all())
    rd = torch.full((m,), float(rank + 1))
    out["reduce_root3"] = _outcome(lambda: dist.reduce(rd, dst=root, group=g))
    out["reduce_root3_untouched"] = bool((rd == rank + 1).all())
    out["gather_root3"] = _outcome(
        lambda: dist.gather(torch.full((m,), float(rank)), dst=root, group=g)
    )
    sc = torch.full((m,), SENT)
    out["scatter_root3"] = _outcome(lambda: dist.scatter(sc, src=root, group=g))
    out["scatter_root3_untouched"] = bool((sc == SENT).all())

    # rooted ops with a live root run over the survivors; gather leaves slot 3 untouched
    gl = [torch.full((m,), SENT) for _ in range(ws)] if rank == 0 else None
    out["gather_root0"] = _outcome(
        lambda: (
            dist.gather(torch.full((m,), float(rank)), gl, dst=0, group=g),
            torch.stack(gl) if gl is not None else None,
        )[1]
    )
    sl = [torch.full((m,), float(10 + j)) for j in range(ws)] if rank == 0 else None
    so = torch.full((m,), SENT)
    out["scatter_root0"] = _outcome(lambda: (dist.scatter(so, sl, src=0, group=g), so.tolist())[1])
    rd0 = torch.full((m,), float(rank + 1))
    out["reduce_root0"] = _outcome(lambda: (dist.reduce(rd0, dst=0, group=g), rd0.tolist())[1])
    bc0 = torch.full((m,), 42.0 if rank == 0 else SENT)
    out["broadcast_root0"] = _outcome(
        lambda: (dist.broadcast(bc0, src=0, group=g), bc0.tolist())[1]
    )

    # p2p with the dead rank raises (blocking and async forms)
    p = torch.full((m,), float(rank))
    out["send_to3"] = _outcome(lambda: dist.send(p, dst=root, group=g))
    r3 = torch.full((m,), SENT)
    out["recv_from3"] = _outcome(lambda: dist.recv(r3, src=root, group=g))
    out["recv_from3_untouched"] = bool((r3 == SENT).all())
    out["isend_to3"] = _outcome(lambda: dist.isend(p, dst=root, group=g).wait())
    out["irecv_from3"] = _outcome(lambda: dist.irecv(r3, src=root, group=g).wait())

    # the group still works over the survivors, in the same epoch
    t = torch.tensor([float(rank + 1)])
    out["all_reduce_after"] = _outcome(lambda: (dist.all_reduce(t, group=g), t.item())[1])
    # p2p between survivors still works
    if rank in (0, 1):
        q = torch.full((m,), float(rank))
        if rank == 0:
            out["p2p_survivors"] = _outcome(lambda: (dist.send(q, dst=1, group=g), None)[1])
        else:
            out["p2p_survivors"] = _outcome(lambda: (dist.recv(q, src=0, group=g), q.tolist())[1])
    out["final"] = _membership(g)
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_inactive_seats_after_failure(ft_pool, transport):
    """raise policy, W=4, rank 3 SIGKILLed: inactive seats contribute nothing."""
    fault = Fault(IS_VICTIM, 1, "sigkill")
    pool = ft_pool(IS_W, transport, "raise")
    res, _ = run_killed(pool, rank_inactive_seats, fault, victims=[fault.victim])
    survivors = sorted(res)
    logs = mooncake_lines(pool, range(IS_W))
    ctx = f"[{transport}/raise: {fault.describe()}]"
    m = 5
    ar = torch.arange(m, dtype=torch.float32)

    def ok(r, name):
        o = res[r][name]
        assert o["ok"], f"{ctx} rank {r}: {name} raised {o}\n{logs}"
        return o["val"]

    def raises(r, name, bound=FAST_BOUND):
        o = res[r][name]
        assert not o["ok"], f"{ctx} rank {r}: {name} succeeded (expected RankFailureError)"
        assert o["type"] == "RankFailureError" and o["failed"] == [IS_VICTIM], (
            f"{ctx} rank {r}: {name}: {o}"
        )
        assert o["dt"] < bound, f"{ctx} rank {r}: {name} took {o['dt']:.3f} s"

    for r in survivors:
        d = res[r]["detect"]
        assert (
            not d["ok"]
            and d["type"] == "RankFailureError"
            and d["failed"] == [IS_VICTIM]
            and d["epoch"] == 1
        ), f"{ctx} rank {r}: detecting op: {d}\n{logs}"
        assert d["dt"] < DETECT_BOUND, f"{ctx} rank {r}: detection took {d['dt']:.2f} s"
        assert res[r]["membership"] == {
            "active": [1, 1, 1, 0],
            "epoch": 1,
            "failed": [IS_VICTIM],
        }, res[r]["membership"]

        exp_ag = torch.stack(
            [ar + 100 * j if j != IS_VICTIM else torch.full((m,), SENT) for j in range(IS_W)]
        )
        got = ok(r, "all_gather")
        assert torch.equal(got, exp_ag), (
            f"{ctx} rank {r}: all_gather\n got {got}\n expected {exp_ag}"
        )
        got = ok(r, "all_gather_into_tensor")
        assert torch.equal(got, exp_ag.flatten()), (
            f"{ctx} rank {r}: all_gather_into_tensor\n got {got}"
        )

        assert ok(r, "avg_small") == [2.0], (
            f"{ctx} rank {r}: AVG of 1,2,3 gave {res[r]['avg_small']}"
        )
        assert ok(r, "avg_large") == [2.0], (
            f"{ctx} rank {r}: AVG (1 Mi elements) gave {res[r]['avg_large']}"
        )

        exp_a2a = torch.cat(
            [
                ar + 100 * j + 10 * r if j != IS_VICTIM else torch.full((m,), SENT)
                for j in range(IS_W)
            ]
        )
        got = ok(r, "all_to_all_single")
        assert torch.equal(got, exp_a2a), (
            f"{ctx} rank {r}: all_to_all_single\n got {got}\n expected {exp_a2a}"
        )

        exp_rs = sum(
            torch.arange(IS_W * m, dtype=torch.float32)[r * m : (r + 1) * m] + 1000 * j
            for j in survivors
        )
        for name in ("reduce_scatter_tensor", "reduce_scatter"):
            got = ok(r, name)
            assert torch.equal(got, exp_rs), (
                f"{ctx} rank {r}: {name}\n got {got}\n expected {exp_rs}"
            )

        for name in ("broadcast_root3", "reduce_root3", "gather_root3", "scatter_root3"):
            raises(r, name)
        for name in (
            "broadcast_root3_untouched",
            "reduce_root3_untouched",
            "scatter_root3_untouched",
            "recv_from3_untouched",
        ):
            assert res[r][name], f"{ctx} rank {r}: {name} is False (the failed op wrote its buffer)"
        for name in ("send_to3", "recv_from3", "isend_to3", "irecv_from3"):
            raises(r, name, DETECT_BOUND)

        got = ok(r, "gather_root0")
        if r == 0:
            exp = torch.stack(
                [
                    torch.full((m,), float(j)) if j != IS_VICTIM else torch.full((m,), SENT)
                    for j in range(IS_W)
                ]
            )
            assert torch.equal(got, exp), (
                f"{ctx} rank 0: gather to root 0\n got {got}\n expected {exp}"
            )
        assert ok(r, "scatter_root0") == [float(10 + r)] * m, (
            f"{ctx} rank {r}: scatter from 0: {res[r]['scatter_root0']}"
        )
        exp_rd = [6.0] * m if r == 0 else [float(r + 1)] * m
        assert ok(r, "reduce_root0") == exp_rd, (
            f"{ctx} rank {r}: reduce to 0: {res[r]['reduce_root0']}"
        )
        assert ok(r, "broadcast_root0") == [42.0] * m, (
            f"{ctx} rank {r}: broadcast from 0: {res[r]['broadcast_root0']}"
        )
        assert ok(r, "all_reduce_after") == 6.0, (
            f"{ctx} rank {r}: all_reduce after: {res[r]['all_reduce_after']}"
        )
        if r == 1:
            assert ok(r, "p2p_survivors") == [0.0] * m
        elif r == 0:
            ok(r, "p2p_survivors")
        assert res[r]["final"] == {"active": [1, 1, 1, 0], "epoch": 1, "failed": [IS_VICTIM]}, (
            f"{ctx} rank {r}: membership changed by the failing rooted/p2p ops: {res[r]['final']}\n{logs}"
        )
    check_log_blame(pool, survivors, [IS_VICTIM])


# ================================================== p2p with a peer that dies (unknown yet)

P2P_W = 4
P2P_VICTIM = 1
P2P_BIG = 4 << 20  # floats (16 MiB): more than any ring or socket buffer, so the send blocks


def rank_p2p_death(rank, ws, fault):
    g = make_group(rank, ws, fault)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=g)
    assert t.item() == 10.0
    out = {}
    if rank == fault.victim:
        time.sleep(0.3)  # let rank 0's irecv and rank 2's isend be posted and waiting
        maybe_die(rank, fault, 1)
        victim_survived(rank, fault)
    if rank == 0:
        buf = torch.full((8,), SENT)
        t0 = time.monotonic()
        w = dist.irecv(buf, src=fault.victim, group=g)
        out["p2p"] = _outcome(w.wait)
        out["p2p"]["dt"] = time.monotonic() - t0
        out["p2p_untouched"] = bool((buf == SENT).all())
    elif rank == 2:
        big = torch.ones(P2P_BIG)
        t0 = time.monotonic()
        w = dist.isend(big, dst=fault.victim, group=g)
        out["p2p"] = _outcome(w.wait)
        out["p2p"]["dt"] = time.monotonic() - t0
    out["after_p2p"] = _membership(g)
    # the first collective after the failure (rank 0 and 2 know it from p2p, rank 3 not)
    t = torch.tensor([float(rank + 1)])
    out["coll1"] = _outcome(lambda: (dist.all_reduce(t, group=g), t.item())[1])
    t = torch.tensor([float(rank + 1)])
    out["coll2"] = _outcome(lambda: (dist.all_reduce(t, group=g), t.item())[1])
    out["final"] = _membership(g)
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("policy", ["raise", "mask"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_p2p_peer_dies(ft_pool, transport, policy):
    """A pending irecv from / isend to a rank that is SIGKILLed raises RankFailureError
    (p2p with a dead peer always raises) within the detection bound; then the survivors'
    collectives have one outcome everywhere and run over {0, 2, 3}."""
    fault = Fault(P2P_VICTIM, 1, "sigkill")
    pool = ft_pool(P2P_W, transport, policy)
    res, _ = run_killed(pool, rank_p2p_death, fault, victims=[fault.victim])
    survivors = sorted(res)
    logs = mooncake_lines(pool, range(P2P_W))
    ctx = f"[{transport}/{policy}: {fault.describe()} while rank 0 irecv()s from it and rank 2 isend()s to it]"
    for r in (0, 2):
        o = res[r]["p2p"]
        assert not o["ok"] and o["type"] == "RankFailureError" and o["failed"] == [P2P_VICTIM], (
            f"{ctx} rank {r}: p2p with the dead rank: {o}\n{logs}"
        )
        assert o["dt"] < DETECT_BOUND, f"{ctx} rank {r}: p2p failure took {o['dt']:.2f} s"
    assert res[0]["p2p_untouched"], f"{ctx} rank 0: the failed irecv wrote its buffer"
    c1 = {r: res[r]["coll1"] for r in survivors}
    assert len({o["ok"] for o in c1.values()}) == 1, (
        f"{ctx} survivors disagree on the first collective after the failure: {c1}\n{logs}"
    )
    if policy == "mask":
        assert all(o["ok"] for o in c1.values()), (
            f"{ctx} mask: first collective raised: {c1}\n{logs}"
        )
    for r, o in c1.items():
        if o["ok"]:
            assert o["val"] == 8.0, (
                f"{ctx} rank {r}: first collective gave {o['val']}, expected 8\n{logs}"
            )
        else:
            assert o["type"] == "RankFailureError" and o["failed"] == [P2P_VICTIM], (
                f"{ctx} rank {r}: {o}\n{logs}"
            )
        assert o["dt"] < DETECT_BOUND, (
            f"{ctx} rank {r}: first collective took {o['dt']:.2f} s\n{logs}"
        )
    for r in survivors:
        o = res[r]["coll2"]
        assert o["ok"] and o["val"] == 8.0, f"{ctx} rank {r}: second collective: {o}\n{logs}"
        assert res[r]["final"] == {"active": [1, 0, 1, 1], "epoch": 1, "failed": [P2P_VICTIM]}, (
            f"{ctx} rank {r}: {res[r]['final']}\n{logs}"
        )
    check_log_blame(pool, survivors, [P2P_VICTIM])
    print(
        f"{ctx} p2p failed after "
        + ", ".join(f"rank {r}: {res[r]['p2p']['dt'] * 1000:.1f} ms" for r in (0, 2))
        + "; first collective: "
        + ", ".join(
            f"rank {r}: {'ok' if o['ok'] else 'raised'} {o['dt'] * 1000:.1f} ms"
            for r, o in c1.items()
        )
    )


# ============================================================================= soak

SOAK_W = 4
SOAK_SEED = int(os.environ.get("MOONCAKE_FT_SEED", "20261129"))
SOAK_TRIALS = int(os.environ.get("MOONCAKE_FT_SOAK_TRIALS", "10"))
SOAK_POLICIES = ["raise", "mask", "manual"]
# op -> (size parameter, rounds with the default 1 MiB slots at W=4)
SOAK_OPS = {
    "all_reduce": (1 << 19, 5),  # 512 Ki floats: 4 pieces of 128 Ki + 1
    "all_gather_into_tensor": (3 << 18, 3),  # 768 Ki floats in (3 MiB): 3 rounds of 1 MiB
    "reduce_scatter_tensor": (1 << 18, 4),  # 256 Ki floats out: 4 rounds of 64 Ki
    # 192 Ki floats per peer (768 KiB): over shm 3 rounds of 256 KiB; over tcp 2 (the
    # second moves the rest as direct bytes), so only rounds 0 and 1 are drawn
    "all_to_all_single": (3 << 16, 2),
    "broadcast": (3 << 18, 3),  # 3 MiB: 3 rounds of 1 MiB
    # a ring of isend/irecv (3 MiB messages: more than the p2p ring and socket buffers);
    # "round" 0: the victim dies before posting its p2p ops, 1: after posting its irecv
    "send_recv": (3 << 18, 2),
}
SOAK_REPLICATED = ("all_reduce", "all_gather_into_tensor", "broadcast")  # same output on every rank
SOAK_KILL_OP = 2  # collectives 0 (small all_reduce) and 1 (the op, full group) complete first


def _soak_trials():
    rng = random.Random(SOAK_SEED)
    trials = []
    ops = []
    for i in range(SOAK_TRIALS):
        if not ops:  # every op once per len(SOAK_OPS) trials, in random order
            ops = sorted(SOAK_OPS)
            rng.shuffle(ops)
        op = ops.pop()
        victim = rng.randrange(SOAK_W)
        rnd = rng.randrange(SOAK_OPS[op][1])
        root = rng.choice([r for r in range(SOAK_W) if r != victim])
        trials.append(
            {
                "i": i,
                "policy": SOAK_POLICIES[i % 3],
                "transport": TRANSPORTS[i % 2],
                "op": op,
                "victim": victim,
                "round": rnd,
                "root": root,
            }
        )
    return trials


SOAK = _soak_trials()


def soak_input(op, rank, ws, size, root):
    """(input, output) of ``op`` on ``rank``; integer-valued floats so sums are exact."""
    n = size
    if op == "all_reduce":
        return (torch.arange(n) % 13).float() + 10 * rank, None
    if op == "all_gather_into_tensor":
        return (torch.arange(n) % 11).float() + 100 * rank, torch.full((ws * n,), SENT)
    if op == "reduce_scatter_tensor":
        return (torch.arange(ws * n) % 17).float() + 10 * rank, torch.full((n,), SENT)
    if op == "all_to_all_single":
        x = torch.cat([(torch.arange(n) % 5).float() + 100 * rank + 10 * j for j in range(ws)])
        return x, torch.full((ws * n,), SENT)
    if op == "broadcast":
        return (
            (torch.arange(n) % 19).float() + 1000 if rank == root else torch.full((n,), SENT)
        ), None
    raise ValueError(op)


def soak_reference(op, rank, ws, size, root, active):
    """The result on ``rank`` of ``op`` over the ``active`` ranks, from the inputs alone."""
    n = size
    if op == "all_reduce":
        return sum(soak_input(op, j, ws, size, root)[0] for j in active)
    if op == "all_gather_into_tensor":
        return torch.cat(
            [
                soak_input(op, j, ws, size, root)[0] if j in active else torch.full((n,), SENT)
                for j in range(ws)
            ]
        )
    if op == "reduce_scatter_tensor":
        return sum(soak_input(op, j, ws, size, root)[0][rank * n : (rank + 1) * n] for j in active)
    if op == "all_to_all_single":
        return torch.cat(
            [
                soak_input(op, j, ws, size, root)[0][rank * n : (rank + 1) * n]
                if j in active
                else torch.full((n,), SENT)
                for j in range(ws)
            ]
        )
    if op == "broadcast":
        return soak_input(op, root, ws, size, root)[0]
    raise ValueError(op)


def soak_run_op(op, rank, ws, size, root, g):
    x, y = soak_input(op, rank, ws, size, root)
    if op == "all_reduce":
        dist.all_reduce(x, group=g)
        return x
    if op == "all_gather_into_tensor":
        dist.all_gather_into_tensor(y, x, group=g)
        return y
    if op == "reduce_scatter_tensor":
        dist.reduce_scatter_tensor(y, x, group=g)
        return y
    if op == "all_to_all_single":
        dist.all_to_all_single(y, x, group=g)
        return y
    if op == "broadcast":
        dist.broadcast(x, src=root, group=g)
        return x
    raise ValueError(op)


def rank_soak_p2p(rank, ws, trial, fault):
    """The send/recv trial of the soak: rank r isends to r+1 and irecvs from r-1 (separate
    ops, each waited for on its own); the victim dies before (round 0) or after (round 1)
    posting its irecv. Then two collectives, a survivors' ring, and the membership."""
    import mooncake_pg

    size, v = SOAK_OPS["send_recv"][0], fault.victim
    g = make_group(rank, ws, None)
    nxt, prv = (rank + 1) % ws, (rank - 1) % ws

    def payload(src, dst):
        return (torch.arange(size) % 23).float() + 100 * src + dst

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=g)
    rec = {"op0": {"ok": True, "val": t.item()}}
    if rank == v:
        if trial["round"] == 1:
            dist.irecv(torch.empty(size), src=prv, group=g)
            time.sleep(0.05)
        kill_self(rank, f"in trial {trial}")
        victim_survived(rank, fault)
    buf = torch.full((size,), SENT)
    # posting to a peer already known dead may raise at once; else the Work's wait() does
    works = {
        "recv": lambda: dist.irecv(buf, src=prv, group=g),
        "send": lambda: dist.isend(payload(rank, nxt), dst=nxt, group=g),
    }
    posted = {k: _outcome(post) for k, post in works.items()}
    for k in ("send", "recv"):
        rec[k] = _outcome(posted[k]["val"].wait) if posted[k]["ok"] else posted[k]
    rec["recv_equal"] = bool(torch.equal(buf, payload(prv, rank)))
    rec["recv_untouched"] = bool((buf == SENT).all())

    def small_ar():
        x = torch.tensor([float(rank + 1)])
        dist.all_reduce(x, group=g)
        return x.item()

    rec["coll1"] = _outcome(small_ar)
    if trial["policy"] == "manual":
        rec["deactivate"] = _outcome(lambda: mooncake_pg.deactivate_ranks(g, [v]))
    rec["coll2"] = _outcome(small_ar)
    # the survivors' ring
    alive = [j for j in range(ws) if j != v]
    i = alive.index(rank)
    n2, p2 = alive[(i + 1) % len(alive)], alive[(i - 1) % len(alive)]
    buf2 = torch.full((size,), SENT)
    reqs = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, payload(rank, n2), n2, group=g),
            dist.P2POp(dist.irecv, buf2, p2, group=g),
        ]
    )
    for q in reqs:
        q.wait()
    rec["ring2"] = bool(torch.equal(buf2, payload(p2, rank)))
    rec["final"] = _membership(g)
    return rec


def check_p2p_trial(ft_pool, trial, label):
    """Checks :func:`rank_soak_p2p`: p2p with the dead rank raises RankFailureError naming
    it (a send to it may complete if the victim, or its socket buffers, took the whole
    message before it died),
    p2p between live ranks delivers the right bytes (under ``manual`` it may instead fail
    fast once the failure is agreed), the first collective has one outcome everywhere,
    and the survivors end in epoch 1 without the victim."""
    v = trial["victim"]
    fault = Fault(v, 1, "sigkill")
    pool = ft_pool(SOAK_W, trial["transport"], trial["policy"])
    res, wall = run_killed(pool, rank_soak_p2p, trial, fault, victims=[v])
    survivors = sorted(res)
    logs = mooncake_lines(pool, range(SOAK_W))
    ctx = f"[{label}]"
    policy = trial["policy"]

    def failed_on_victim(o):
        return not o["ok"] and o["type"] == "RankFailureError" and o["failed"] == [v]

    for r in survivors:
        o = res[r]
        assert o["op0"]["val"] == 10.0, f"{ctx} rank {r}: {o['op0']}"
        for key in ("send", "recv"):
            assert o[key]["dt"] < DETECT_BOUND, (
                f"{ctx} rank {r}: {key} took {o[key]['dt']:.2f} s\n{logs}"
            )
        if r == (v + 1) % SOAK_W:  # receives from the victim
            assert failed_on_victim(o["recv"]), (
                f"{ctx} rank {r}: irecv from the dead rank: {o['recv']}\n{logs}"
            )
            assert o["recv_untouched"], f"{ctx} rank {r}: the failed irecv wrote its buffer"
        else:
            assert (o["recv"]["ok"] and o["recv_equal"]) or (
                policy == "manual" and failed_on_victim(o["recv"])
            ), (
                f"{ctx} rank {r}: irecv from live rank {(r - 1) % SOAK_W}: {o['recv']} equal={o['recv_equal']}\n{logs}"
            )
        if r == (v - 1) % SOAK_W:  # sends to the victim
            # completing is fine too: over TCP the kernel may take the whole 3 MiB into the
            # victim's socket buffers just before it dies, whether or not it posted its irecv
            assert failed_on_victim(o["send"]) or o["send"]["ok"], (
                f"{ctx} rank {r}: isend to the dead rank: {o['send']}\n{logs}"
            )
        else:
            assert o["send"]["ok"] or (policy == "manual" and failed_on_victim(o["send"])), (
                f"{ctx} rank {r}: isend to a live rank: {o['send']}\n{logs}"
            )
    c1 = {r: res[r]["coll1"] for r in survivors}
    assert len({o["ok"] for o in c1.values()}) == 1, (
        f"{ctx} survivors disagree on the first collective: {c1}\n{logs}"
    )
    for r, o in c1.items():
        assert o["dt"] < DETECT_BOUND, (
            f"{ctx} rank {r}: first collective took {o['dt']:.2f} s\n{logs}"
        )
        if o["ok"]:
            assert policy != "manual" and o["val"] == float(sum(j + 1 for j in survivors)), (
                f"{ctx} rank {r}: {o}"
            )
        else:
            assert policy != "mask" and failed_on_victim(o), (
                f"{ctx} rank {r}: first collective: {o}\n{logs}"
            )
    expected_active = [0 if j == v else 1 for j in range(SOAK_W)]
    for r in survivors:
        if policy == "manual":
            assert res[r]["deactivate"]["ok"], (
                f"{ctx} rank {r}: deactivate_ranks: {res[r]['deactivate']}\n{logs}"
            )
        o = res[r]["coll2"]
        assert o["ok"] and o["val"] == float(sum(j + 1 for j in survivors)), (
            f"{ctx} rank {r}: second collective {o}"
        )
        assert res[r]["ring2"], f"{ctx} rank {r}: the survivors' ring delivered wrong data"
        assert res[r]["final"] == {"active": expected_active, "epoch": 1, "failed": [v]}, (
            f"{ctx} rank {r}: membership {res[r]['final']}\n{logs}"
        )
    check_log_blame(pool, survivors, [v])
    print(f"{ctx} ok in {wall:.2f} s")


def rank_soak(rank, ws, trial, fault):
    import mooncake_pg

    op, root, size = trial["op"], trial["root"], SOAK_OPS[trial["op"]][0]
    g = make_group(rank, ws, fault)
    everyone = list(range(ws))

    def checked(active):
        def fn():
            got = soak_run_op(op, rank, ws, size, root, g)
            exp = soak_reference(op, rank, ws, size, root, active)
            eq = torch.equal(got, exp)
            info = None
            if not eq:
                bad = (got != exp).nonzero().flatten()
                info = (
                    f"{bad.numel()} of {got.numel()} elements differ; first at {bad[0].item()}: "
                    f"got {got[bad[0]].item()} expected {exp[bad[0]].item()}; "
                    f"last at {bad[-1].item()}: got {got[bad[-1]].item()} expected {exp[bad[-1]].item()}"
                )
            return {"digest": digest(got), "equal": eq, "info": info}

        return fn

    def small_ar():
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=g)
        return t.item()

    rec = {}
    rec["op0"] = _outcome(small_ar)
    rec["op1"] = _outcome(checked(everyone))
    survivors = [r for r in everyone if r != fault.victim]
    rec["inflight"] = _outcome(checked(survivors))  # collective SOAK_KILL_OP: the victim dies in it
    if rank == fault.victim:
        victim_survived(rank, fault)
    rec["after_inflight"] = _membership(g)
    if trial["policy"] == "manual" and not rec["inflight"]["ok"] and rec["inflight"]["failed"]:
        rec["deactivate"] = _outcome(
            lambda: mooncake_pg.deactivate_ranks(g, rec["inflight"]["failed"])
        )
    rec["next"] = _outcome(checked(survivors))
    rec["next_ar"] = _outcome(small_ar)
    rec["final"] = _membership(g)
    return rec


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "trial",
    SOAK,
    ids=lambda t: (
        f"t{t['i']}-{t['policy']}-{t['transport']}-{t['op']}-v{t['victim']}-r{t['round']}"
    ),
)
def test_soak_random_kill(ft_pool, trial):
    """Soak: SIGKILL of a random rank (0 included) in a random op at a random round."""
    print(f"soak seed {SOAK_SEED} (MOONCAKE_FT_SEED), trial {trial}")
    check = check_p2p_trial if trial["op"] == "send_recv" else check_kill_trial
    check(ft_pool, trial, f"seed {SOAK_SEED} trial {trial}")


@pytest.mark.slow(unless={"transport": ["shm"]})
@pytest.mark.timeout(60)
@pytest.mark.parametrize("op", sorted(set(SOAK_OPS) - {"send_recv"}))
@pytest.mark.parametrize("policy", SOAK_POLICIES)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_kill_mid_op(ft_pool, transport, policy, op):
    """Deterministic matrix of the soak: rank 1 SIGKILLed at round 1 of each op (after it
    delivered the first piece of its data), under each policy."""
    trial = {
        "i": -1,
        "policy": policy,
        "transport": transport,
        "op": op,
        "victim": 1,
        "round": 1,
        "root": 0,
    }
    check_kill_trial(ft_pool, trial, f"trial {trial}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("policy", SOAK_POLICIES)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_kill_in_send_recv(ft_pool, transport, policy):
    """The soak's send/recv trial, deterministic: rank 2 dies in a ring of isend/irecv
    (before posting on shm, after posting its irecv on tcp), under each policy."""
    trial = {
        "i": -1,
        "policy": policy,
        "transport": transport,
        "op": "send_recv",
        "victim": 2,
        "round": 0 if transport == "shm" else 1,
        "root": 0,
    }
    check_p2p_trial(ft_pool, trial, f"trial {trial}")


def check_kill_trial(ft_pool, trial, label):
    """Runs :func:`rank_soak` for ``trial`` on a fresh pool and checks it (see the soak)."""
    fault = Fault(trial["victim"], SOAK_KILL_OP, "inject", trial["round"])
    pool = ft_pool(SOAK_W, trial["transport"], trial["policy"])
    res, wall = run_killed(pool, rank_soak, trial, fault, victims=[fault.victim])
    survivors = sorted(res)
    logs = mooncake_lines(pool, range(SOAK_W))
    ctx = f"[{label}]"
    policy = trial["policy"]

    for r in survivors:
        assert res[r]["op0"]["ok"] and res[r]["op0"]["val"] == 10.0, (
            f"{ctx} rank {r}: op0 {res[r]['op0']}"
        )
        o = res[r]["op1"]
        assert o["ok"] and o["val"]["equal"], (
            f"{ctx} rank {r}: {trial['op']} before the kill: {o}\n{logs}"
        )

    # the op in flight: the same outcome on every survivor
    inf = {r: res[r]["inflight"] for r in survivors}
    assert len({o["ok"] for o in inf.values()}) == 1, (
        f"{ctx} survivors disagree on the op in flight: {inf}\n{logs}"
    )
    for r, o in inf.items():
        assert o["dt"] < DETECT_BOUND, (
            f"{ctx} rank {r}: the op in flight took {o['dt']:.2f} s\n{logs}"
        )
    if policy == "mask":
        assert all(o["ok"] for o in inf.values()), (
            f"{ctx} mask: the op in flight raised: {inf}\n{logs}"
        )
        if trial["op"] in SOAK_REPLICATED:  # the same output on every rank
            assert len({o["val"]["digest"] for o in inf.values()}) == 1, (
                f"{ctx} mask: the op in flight gave different results on the survivors: {inf}\n{logs}"
            )
        for r, o in inf.items():
            assert o["val"]["equal"], (
                f"{ctx} mask: rank {r}: the op in flight != reference over the survivors: "
                f"{o['val']['info']}\n{logs}"
            )
    else:
        for r, o in inf.items():
            assert not o["ok"], f"{ctx} {policy}: rank {r}: the op in flight completed: {o}\n{logs}"
            assert (
                o["type"] == "RankFailureError"
                and o["failed"] == [fault.victim]
                and o["epoch"] == 1
            ), f"{ctx} {policy}: rank {r}: the op in flight: {o}\n{logs}"
        if policy == "manual":
            for r in survivors:
                m = res[r]["after_inflight"]
                assert m["active"] == [1] * SOAK_W and m["epoch"] == 0, (
                    f"{ctx} manual: rank {r} before deactivate: {m}"
                )
                assert res[r]["deactivate"]["ok"], (
                    f"{ctx} rank {r}: deactivate_ranks: {res[r]['deactivate']}\n{logs}"
                )

    # agreement, membership and the next ops over the survivors
    expected_active = [0 if j == fault.victim else 1 for j in range(SOAK_W)]
    for r in survivors:
        m = res[r]["final"]
        assert m == {"active": expected_active, "epoch": 1, "failed": [fault.victim]}, (
            f"{ctx} rank {r}: membership {m}\n{logs}"
        )
        o = res[r]["next"]
        assert o["ok"], f"{ctx} rank {r}: {trial['op']} after the failure raised: {o}\n{logs}"
        assert o["val"]["equal"], (
            f"{ctx} rank {r}: {trial['op']} after the failure: {o['val']['info']}\n{logs}"
        )
        o = res[r]["next_ar"]
        assert o["ok"] and o["val"] == float(sum(j + 1 for j in survivors)), (
            f"{ctx} rank {r}: all_reduce after: {o}"
        )
    check_log_blame(pool, survivors, [fault.victim])
    print(
        f"{ctx} ok: op in flight {'completed' if inf[survivors[0]]['ok'] else 'raised'} in "
        + ", ".join(f"{inf[r]['dt'] * 1000:.1f}" for r in survivors)
        + f" ms; run {wall:.2f} s"
    )


# ============================================================== subgroups


def rank_subgroups(rank, ws):
    import mooncake_pg

    sub = dist.new_group([0, 1, 2])  # contains the victim (2)
    other = dist.new_group([0, 1, 3])  # does not
    x = torch.ones(1)
    dist.all_reduce(x)
    if rank in (0, 1, 2):
        dist.all_reduce(x, group=sub)
    if rank != 2:
        dist.all_reduce(x, group=other)
    if rank == 2:
        kill_self(rank, "after the subgroup collectives")
    out = {}
    try:
        dist.all_reduce(torch.ones(1))
        out["default"] = "completed"
    except mooncake_pg.RankFailureError as e:
        out["default"] = ("raised", sorted(e.failed_ranks))
    if rank in (0, 1):
        t0 = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1), group=sub)
            out["sub"] = "completed"
        except mooncake_pg.RankFailureError as e:
            out["sub"] = ("raised", sorted(e.failed_ranks), round(time.monotonic() - t0, 3))
        out["sub_active"] = mooncake_pg.get_active_ranks(sub).tolist()
        y = torch.full((1,), float(rank + 1))
        dist.all_reduce(y, group=sub)
        out["sub_after"] = y.item()
    y = torch.full((1,), float(rank + 1))
    dist.all_reduce(y, group=other)
    out["other_after"] = y.item()
    out["other_epoch"] = mooncake_pg.get_epoch(other)
    if rank == 0:
        t0 = time.monotonic()
        try:
            dist.new_group([0, 2])
            out["new_group"] = "created"
        except mooncake_pg.RankFailureError as e:
            out["new_group"] = ("raised", sorted(e.failed_ranks), round(time.monotonic() - t0, 3))
    else:
        dist.new_group([0, 2])  # non-members return at once
    return out


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_failure_applies_to_every_group_containing_the_rank(ft_pool, transport):
    """An agreed failure in one group applies to every group of the process that contains
    the rank (the next op there raises at once, without waiting for detection); groups
    without it are untouched; new_group including a failed rank fails fast."""
    pool = ft_pool(4, transport, "raise")
    res, _ = run_killed(pool, rank_subgroups, victims=[2])
    for r in (0, 1, 3):
        assert res[r]["default"] == ("raised", [2]), res[r]
        assert res[r]["other_after"] == 1.0 + 2.0 + 4.0, res[r]
        assert res[r]["other_epoch"] == 0, res[r]
    for r in (0, 1):
        kind, failed, seconds = res[r]["sub"]
        assert (kind, failed) == ("raised", [2]), res[r]
        assert seconds < FAST_BOUND, res[r]
        assert res[r]["sub_active"] == [1, 1, 0], res[r]
        assert res[r]["sub_after"] == 1.0 + 2.0, res[r]
    kind, failed, seconds = res[0]["new_group"]
    assert (kind, failed) == ("raised", [2]) and seconds < FAST_BOUND, res[0]


def rank_failure_seen_first_in_a_subgroup(rank, ws):
    """Rank 2 dies while rank 0 is inside a default-group all_reduce and rank 1 inside an
    all_reduce of the subgroup [1, 2]: rank 1 learns of the failure there, so its next
    default-group op fails before it runs, while rank 0's was under way. Afterwards the
    default group must pair their ops again."""
    import mooncake_pg

    sub = dist.new_group([1, 2])
    dist.all_reduce(torch.ones(1))
    if rank == 2:
        time.sleep(0.3)
        kill_self(rank, "while 0 is in a default-group op and 1 in a subgroup op")
    sub_error = None
    if rank == 1:
        try:
            dist.all_reduce(torch.ones(1), group=sub)
        except mooncake_pg.RankFailureError as e:
            sub_error = (sorted(e.failed_ranks), str(e).splitlines()[0])
    out = [sub_error]
    for _ in range(3):
        t = torch.full((1,), float(rank + 1))
        try:
            dist.all_reduce(t)
            out.append(t.item())
        except mooncake_pg.RankFailureError as e:
            out.append(("raised", sorted(e.failed_ranks)))
    return out


@pytest.mark.parametrize("policy", ["raise", "mask"])
def test_failure_seen_first_in_a_subgroup_keeps_the_default_group_paired(ft_pool, policy):
    pool = ft_pool(3, "shm", policy)
    res, _ = run_killed(pool, rank_failure_seen_first_in_a_subgroup, victims=[2])
    if policy == "raise":
        # the subgroup's error counts in the subgroup's ranks and names the default group's
        failed, msg = res[1][0]
        assert failed == [1] and "(rank(s) 2 of the default group)" in msg, res[1][0]
    for r in (0, 1):
        res[r] = res[r][1:]
        ok = [v for v in res[r] if not isinstance(v, tuple)]
        raised = [v for v in res[r] if isinstance(v, tuple)]
        assert all(v == ("raised", [2]) for v in raised) and len(raised) <= 1, res[r]
        assert ok == [1.0 + 2.0] * len(ok) and len(ok) >= 2, res[r]
        if policy == "mask":
            assert not raised, res[r]
    assert res[0] == res[1], res


# ============================================================== control store in rank 0

_STORE_IN_RANK0 = r'''
import os, signal, sys, time
import torch, torch.distributed as dist
import mooncake_pg
rank = int(os.environ["RANK"])
torch.set_num_threads(1)
dist.init_process_group("mooncake", pg_options=mooncake_pg.MooncakeOptions(timeout=10.0, transport=sys.argv[1]))
x = torch.ones(1)
dist.all_reduce(x)
if rank == 0:
    os.kill(os.getpid(), signal.SIGKILL)
t = time.monotonic()
try:
    dist.all_reduce(x)
    print("RESULT completed", flush=True)
except Exception as e:
    msg = str(e).splitlines()[0]
    print(f"RESULT {type(e).__name__} {time.monotonic() - t:.3f} {msg}", flush=True)
'''


@pytest.mark.slow(unless={"transport": ["shm"]})
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_control_store_in_rank0_dies(tmp_path, transport):
    """With plain env:// rendezvous the TCPStore lives in rank 0; when rank 0 dies the
    survivors raise a clear fatal error within the op timeout (they cannot agree, so each
    fences itself: RankFencedError, a DistBackendError)."""
    import socket
    import subprocess

    script = tmp_path / "store_in_rank0.py"
    script.write_text(_STORE_IN_RANK0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    try:
        for r in range(3):
            env = dict(
                os.environ,
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                RANK=str(r),
                WORLD_SIZE="3",
                MOONCAKE_SOCKET_IFNAME="lo",
                PYTHONPATH=os.pathsep.join(
                    filter(None, [rankpool.REPO_ROOT, os.environ.get("PYTHONPATH")])
                ),
            )
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(script), transport],
                    env=env,
                    cwd=rankpool.REPO_ROOT,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    text=True,
                    start_new_session=True,
                )
            )
        outs = [p.communicate(timeout=60)[0] for p in procs]
    finally:
        for p in procs:
            kill_group(p)
    assert procs[0].returncode == -signal.SIGKILL
    for r in (1, 2):
        line = [l for l in outs[r].splitlines() if l.startswith("RESULT")]
        assert line, outs[r]
        _, kind, seconds, *msg = line[0].split(" ", 3)
        assert kind == "RankFencedError", line  # a DistBackendError
        assert float(seconds) < 10.0, line
        assert "control store is unreachable" in msg[0] and "fatal" in msg[0], line


# ======================================= large send to a live peer that never receives

NO_RECV_TIMEOUT = 3.0
SMALL_N = 1024  # 4 KiB of float32: buffered, completes without a matching recv
BIG_N = 10_000_000  # 40 MB of float32: cannot be buffered


def rank_send_no_recv(rank, ws):
    store = O.default_store()
    out = {}
    dist.barrier()
    if rank == 0:
        small = torch.arange(SMALL_N, dtype=torch.float32)
        out["small"] = O.outcome(lambda: dist.send(small, 1))
        store.set("reg1/small_sent", "1")
        store.wait(["reg1/small_recvd"], timedelta(seconds=30))
        big = torch.ones(BIG_N)
        out["big"] = O.outcome(lambda: dist.send(big, 1))
        out["again"] = O.outcome(lambda: dist.send(torch.ones(4), 1))
        store.set("reg1/big_done", "1")
    else:
        # the small send must complete before this rank posts its recv
        store.wait(["reg1/small_sent"], timedelta(seconds=30))
        r = torch.full((SMALL_N,), O.SENTINEL)
        dist.recv(r, 0)
        out["small_recv"] = r
        store.set("reg1/small_recvd", "1")
        # alive, but never posts a recv for the big message
        store.wait(["reg1/big_done"], timedelta(seconds=60))
    out["after"] = O.follow_up(rank, ws)
    return out


@pytest.mark.slow(unless={"transport": ["shm"]})
@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", O.TRANSPORTS)
def test_large_send_without_recv_times_out(transport):
    pool = O.fresh_pool(2, transport, NO_RECV_TIMEOUT)
    try:
        res = pool.run(rank_send_no_recv, timeout=45)
    finally:
        pool.close(graceful=False)
    ctx = f"[{transport}]"
    small = res[0]["small"]
    assert small["ok"] and small["dt"] < O.LOCAL_ERROR_LIMIT_S, (
        f"{ctx} a 4 KiB send with no recv posted should complete once buffered; {O.fmt(small)}"
    )
    assert torch.equal(res[1]["small_recv"], torch.arange(SMALL_N, dtype=torch.float32)), (
        f"{ctx} the buffered small message arrived wrong: {res[1]['small_recv'][:8].tolist()}"
    )
    big = res[0]["big"]
    assert not big["ok"], f"{ctx} a 40 MB send that nobody receives {O.fmt(big)}"
    assert "DistBackendError" in big["mro"], f"{ctx} expected DistBackendError: {O.fmt(big)}"
    assert 2.0 <= big["dt"] <= 15.0, (
        f"{ctx} the send should fail after about the op timeout ({NO_RECV_TIMEOUT} s): {O.fmt(big)}"
    )
    again = res[0]["again"]
    assert not again["ok"] and "DistBackendError" in again["mro"], (
        f"{ctx} the p2p link to rank 1 is closed after the timed-out send, so a later send "
        f"to it must raise: {O.fmt(again)}"
    )
    assert again["dt"] < O.LOCAL_ERROR_LIMIT_S, f"{ctx} send on a closed link: {O.fmt(again)}"
    O.check_follow_up(res, 2, ctx)


# ================================================== send / isend to a SIGKILLed peer

DEAD_OP_TIMEOUT = 30.0  # detection must not wait for the op timeout
DEAD_BOUND = 5.0
DEAD_KILL_DELAY = 0.5  # "during": the victim dies this long after rank 0 starts sending
# (when the victim dies, elements sent): 4 KiB and 400 KB fit the shared-memory ring
# (1 MiB) and the loopback socket buffers, 4 MB and 40 MB do not
DEAD_CASES = {
    "before-4KB": ("before", 1024),
    "before-400KB": ("before", 100_000),
    "before-4MB": ("before", 1_000_000),
    "during-40MB": ("during", BIG_N),
}


def _p2p_send(mode, t):
    if mode == "isend":
        dist.isend(t, 1).wait()
    else:
        dist.send(t, 1)


def rank_send_dead_peer(rank, ws, mode, when, n):
    store = O.default_store()
    if rank == 1:
        store.set("reg2/victim_pid", str(os.getpid()))
        if when == "during":
            store.wait(["reg2/sending"], timedelta(seconds=30))
            time.sleep(DEAD_KILL_DELAY)
        kill_self(rank, "before the send" if when == "before" else "during the send")
    pid = int(store.get("reg2/victim_pid"))
    t = torch.ones(n)
    if when == "before":
        assert wait_dead(pid), f"rank 1 (pid {pid}) did not die"
        first = O.outcome(lambda: _p2p_send(mode, t))
    else:
        store.set("reg2/sending", "1")  # nobody ever receives: the victim dies mid-message
        first = O.outcome(lambda: _p2p_send(mode, t))
        # the victim's sockets close while it exits, a moment before /proc shows it dead
        first["dead_before_return"] = wait_dead(pid, 2.0)
    other = "send" if mode == "isend" else "isend"
    second = O.outcome(lambda: _p2p_send(other, torch.ones(1_000_000)))
    small = O.outcome(lambda: _p2p_send(mode, torch.ones(4)))
    return {"first": first, "second": second, "small": small}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(DEAD_CASES))
@pytest.mark.parametrize("mode", ["send", "isend"])
@pytest.mark.parametrize("transport", O.TRANSPORTS)
def test_send_to_killed_peer_raises_rank_failure(transport, mode, case):
    """docs/design.md: "p2p with a dead peer ... always raise". "before": rank 1 is SIGKILLed
    (and gone) before rank 0 posts the send; "during": it dies while the send is in flight
    (no recv was ever posted). Then a send of the other kind and a tiny send must fail fast."""
    when, n = DEAD_CASES[case]
    pool = O.fresh_pool(2, transport, DEAD_OP_TIMEOUT)
    try:
        res = pool.run(rank_send_dead_peer, mode, when, n, timeout=45, return_exceptions=True)
    finally:
        pool.close(graceful=False)
    ctx = f"[{transport}/{mode}/{case}]"
    assert isinstance(res[1], RemoteError) and res[1].type_name == "RankDied", (
        f"{ctx} rank 1 should have killed itself: {res[1]!r}"
    )
    assert not isinstance(res[0], RemoteError), (
        f"{ctx} rank 0: {res[0]}\n{getattr(res[0], 'traceback', '')}"
    )
    bound = {
        "first": DEAD_BOUND + (DEAD_KILL_DELAY if when == "during" else 0.0),
        "second": O.LOCAL_ERROR_LIMIT_S,
        "small": O.LOCAL_ERROR_LIMIT_S,
    }
    for key, what in (
        ("first", f"{mode} of {4 * n} B"),
        ("second", "then a 4 MB send of the other kind"),
        ("small", f"then a 16 B {mode}"),
    ):
        rec = res[0][key]
        assert not rec["ok"], f"{ctx} {what} to SIGKILLed rank 1 {O.fmt(rec)}"
        assert rec["type"] == "RankFailureError", (
            f"{ctx} {what}: expected RankFailureError: {O.fmt(rec)}"
        )
        assert rec["failed"] == [1], f"{ctx} {what}: failed_ranks {rec['failed']}, expected [1]"
        assert re.search(r"\brank 1\b", rec["msg"]), (
            f"{ctx} {what}: message does not name rank 1: {O.fmt(rec)}"
        )
        assert rec["dt"] < bound[key], (
            f"{ctx} {what}: took {rec['dt']:.2f} s (op timeout {DEAD_OP_TIMEOUT} s): {O.fmt(rec)}"
        )
    if when == "during":
        assert res[0]["first"]["dead_before_return"], f"{ctx} the send ended before the victim died"


# ======================= Work.wait() after destroy_process_group returns with an error

WAIT_OP_TIMEOUT = 30.0
WAIT_BOUND = 5.0


def rank_wait_after_destroy(rank, ws, kill):
    store = O.default_store()
    dist.barrier()
    if rank == 1:
        if kill:
            store.set("reg5/victim_pid", str(os.getpid()))
            kill_self(rank, "before destroy_process_group")
        # alive, but never sends and never joins the all_reduce
        store.wait(["reg5/done"], timedelta(seconds=60))
        return None
    r = torch.full((5,), O.SENTINEL)
    w_recv = dist.irecv(r, 1)
    w_ar = dist.all_reduce(torch.ones(3), async_op=True)
    time.sleep(0.3)
    pending = {"irecv": not w_recv.is_completed(), "all_reduce": not w_ar.is_completed()}
    destroy = O.outcome(dist.destroy_process_group)
    out = {"pending": pending, "destroy": destroy}
    for name, w in (("irecv", w_recv), ("all_reduce", w_ar)):
        out[name] = O.outcome(w.wait)
    out["recv_buf"] = r
    store.set("reg5/done", "1")
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("peer", ["alive", "killed"])
@pytest.mark.parametrize("transport", O.TRANSPORTS)
def test_wait_after_destroy_returns_with_error(transport, peer):
    kill = peer == "killed"
    pool = O.fresh_pool(2, transport, WAIT_OP_TIMEOUT)
    try:
        res = pool.run(rank_wait_after_destroy, kill, timeout=45, return_exceptions=True)
    finally:
        pool.close(graceful=False)
    ctx = f"[{transport}/peer {peer}]"
    if kill:
        assert isinstance(res[1], RemoteError) and res[1].type_name == "RankDied", (
            f"{ctx} rank 1: {res[1]!r}"
        )
    else:
        assert not isinstance(res[1], RemoteError), f"{ctx} rank 1: {res[1]}"
    assert not isinstance(res[0], RemoteError), (
        f"{ctx} rank 0: {res[0]}\n{getattr(res[0], 'traceback', '')}"
    )
    out = res[0]
    if not kill:
        assert out["pending"] == {"irecv": True, "all_reduce": True}, (
            f"{ctx} with rank 1 alive and idle both works should still be pending: {out['pending']}"
        )
    assert out["destroy"]["ok"] and out["destroy"]["dt"] < WAIT_BOUND, (
        f"{ctx} destroy_process_group {O.fmt(out['destroy'])}"
    )
    for name in ("irecv", "all_reduce"):
        rec = out[name]
        assert not rec["ok"], (
            f"{ctx} {name}.wait() after destroy {O.fmt(rec)} (nothing was received/reduced)"
        )
        assert rec["dt"] < WAIT_BOUND, f"{ctx} {name}.wait() after destroy {O.fmt(rec)}"
    assert torch.equal(out["recv_buf"], torch.full((5,), O.SENTINEL)), (
        f"{ctx} the irecv buffer was written: {out['recv_buf'].tolist()}"
    )
