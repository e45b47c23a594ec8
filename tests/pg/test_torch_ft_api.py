"""Changing a group's members on "mooncake": torch's ``dist.shrink_group`` (drop failed or
leaving ranks, renumber the rest) and ``ProcessGroup.split_group`` (what ``dist.split_group``
calls; torch 2.13 reaches it only on accelerator machines), our ``leave_group`` (a rank
leaves between two ops; its seat can be refilled); also c10d sequence numbers and DDP with
a sparse embedding (sparse ``all_reduce``) against gloo.

References are computed in the test process from the ranks' inputs
(``expected_collectives``), never by the backend under test.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from tests.faults import kill_self
from tests.pg.every_op import assert_collectives, expected_collectives, run_collectives
from tests.rankpool import RankPool, RemoteError, get_pool

pytestmark = pytest.mark.timeout(180)

OP_TIMEOUT = 30.0  # MooncakeOptions.timeout of the pools here
TRANSPORTS = ["shm", "tcp"]


@pytest.fixture
def fresh_pool():
    """``fresh_pool(world_size, transport, policy)`` -> a RankPool of its own (its groups are
    shrunk, so it is never reused), killed at teardown."""
    pools = []

    def make(world_size, transport, policy="raise"):
        p = RankPool(
            world_size, "mooncake", transport, op_timeout=OP_TIMEOUT, options={"on_failure": policy}
        )
        pools.append(p)
        return p

    yield make
    for p in pools:
        p.close(graceful=False)


# ------------------------------------------------------------------ rank side


def rank_shrink_after_death(rank, ws, victim):
    x = torch.ones(1)
    dist.all_reduce(x)
    if rank == victim:
        kill_self(rank, "before the second all_reduce")
    try:
        dist.all_reduce(x)
        first = "completed"
    except Exception as e:  # the agreed failure, on every survivor
        first = type(e).__name__, list(getattr(e, "failed_ranks", []))
    t0 = time.monotonic()
    new = dist.shrink_group([victim])
    shrink_s = time.monotonic() - t0
    return {
        "first": first,
        "shrink_s": shrink_s,
        "is_default": new is c10d._get_default_group(),
        "backend": dist.get_backend(new),
        "world": dist.get_world_size(),
        **run_collectives(new),
    }


def rank_planned_shrink(rank, ws, leaving):
    if rank == leaving:
        return "left"
    new = dist.shrink_group([leaving])
    out = run_collectives(new)
    # DDP on the shrunk group (torch registers it as a gloo group; DDP's logger used to
    # take our backend for gloo's and crash): the gradient is the mean over the survivors
    lin = torch.nn.Linear(2, 1)
    with torch.no_grad():
        lin.weight.fill_(1.0)
        lin.bias.zero_()
    ddp = torch.nn.parallel.DistributedDataParallel(lin)
    ddp(torch.full((1, 2), dist.get_rank() + 1.0)).sum().backward()
    out["ddp_grad"] = lin.weight.grad.clone()
    return out


def rank_shrink_subgroup(rank, ws):
    """Global rank 1 (rank 0 of the subgroup [1, 2, 3]) is dropped from the subgroup."""
    sub = dist.new_group([1, 2, 3])
    if rank not in (2, 3):
        return None
    new = dist.shrink_group([0], group=sub)  # group ranks, as torch documents
    out = run_collectives(new)
    out["global_ranks"] = dist.get_process_group_ranks(new)
    t = torch.full((1,), float(rank))
    dist.broadcast(t, src=3, group=new)  # a global rank, mapped by torch
    out["broadcast_from_global_3"] = t
    return out


def rank_shrink_abort_in_flight(rank, ws, absent):
    if rank == absent:
        time.sleep(0.5)  # alive, but never joins the all_reduce below
        return "absent"
    w = dist.all_reduce(torch.ones(4), async_op=True)
    time.sleep(0.5)  # the op is waiting for the absent rank
    t0 = time.monotonic()
    new = dist.shrink_group([absent], shrink_flags=c10d.SHRINK_ABORT)
    try:
        w.wait()
        in_flight = "completed"
    except Exception as e:
        in_flight = type(e).__name__
    return {"in_flight": in_flight, "seconds": time.monotonic() - t0, **run_collectives(new)}


def rank_shrink_bad_arguments(rank, ws):
    """torch's documented errors, raised before the backend is asked (nothing collective)."""
    out = {}
    for name, args, kw in [
        ("empty", ([],), {}),
        ("out_of_range", ([ws],), {}),
        ("duplicate", ([0, 0],), {}),
        ("self", ([rank],), {}),
        ("all", (list(range(ws)),), {}),
        ("flags", ([0],), {"shrink_flags": 7}),
        ("not_a_list", ((0,),), {}),
    ]:
        try:
            dist.shrink_group(*args, **kw)
            out[name] = "no error"
        except Exception as e:
            out[name] = type(e).__name__
    # the group still works afterwards
    t = torch.ones(1)
    dist.all_reduce(t)
    out["after"] = float(t)
    return out


def rank_split(rank, ws, split_ranks):
    pg = c10d._get_default_group()
    mine = next((s for s in split_ranks if rank in s), None)
    # as dist.split_group does: a rank in no split passes the first split (and gets None)
    ranks = sorted(mine if mine is not None else split_ranks[0])
    sub = pg.split_group(ranks, timeout=timedelta(seconds=OP_TIMEOUT))
    if sub is None:
        return None
    # torch's dist.split_group registers the new group for the dist.* API; called directly,
    # the group is used through its own methods
    r, n = sub.rank(), sub.size()
    t = torch.tensor([r + 1.0, 10.0 * (r + 1)])
    sub.allreduce([t]).wait()
    b = torch.full((3,), float(r))
    opts = dist.BroadcastOptions()
    opts.rootRank = n - 1
    sub.broadcast([b], opts).wait()
    out = [torch.empty(1) for _ in range(n)]
    sub.allgather([out], [torch.tensor([r * 3.0])]).wait()
    return {
        "rank": r,
        "size": n,
        "all_reduce": t,
        "broadcast": b,
        "all_gather": torch.cat(out),
        "backend": type(sub._get_backend(torch.device("cpu"))).__name__,
    }


def rank_sequence_numbers(rank, ws, n_ops):
    be = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    before = be._get_sequence_number_for_group()
    be._set_sequence_number_for_group()  # nothing to agree on: numbers start at 0 everywhere
    sub = dist.new_group([0, 1])
    sub_be = sub._get_backend(torch.device("cpu")) if rank in (0, 1) else None
    after_new = sub_be._get_sequence_number_for_group() if sub_be is not None else None
    t = torch.ones(2)
    for i in range(n_ops):
        if i % 3 == 0:
            dist.all_reduce(t)
        elif i % 3 == 1:
            dist.broadcast(t, 0)
        else:
            dist.barrier()
    w = dist.all_reduce(t, async_op=True)  # counted when issued
    issued = be._get_sequence_number_for_group()
    w.wait()
    if sub_be is not None:
        dist.all_reduce(t, group=sub)
    return {
        "before": before,
        "issued": issued,
        "sub_new": after_new,
        "sub": sub_be._get_sequence_number_for_group() if sub_be is not None else None,
    }


def rank_ddp_sparse_embedding(rank, ws, steps):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 8, sparse=True), torch.nn.Linear(8, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        idx = torch.randint(0, 50, (6,), generator=g)
        loss = ddp(idx).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ------------------------------------------------------------------ tests


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_shrink_group_after_a_death(fresh_pool, transport):
    """Rank 1 of 4 dies (on_failure="raise"); the survivors see RankFailureError naming it,
    shrink the default group to the 3 survivors (renumbered 0..2; the new group is the
    default group, backend "mooncake") and every collective is correct there."""
    pool = fresh_pool(4, transport)
    res = pool.run(rank_shrink_after_death, 1, timeout=120, return_exceptions=True)
    assert isinstance(res[1], RemoteError) and res[1].type_name == "RankDied", res[1]
    survivors = [res[r] for r in (0, 2, 3)]
    bad = [s for s in survivors if isinstance(s, RemoteError)]
    assert not bad, "\n".join(f"{e.type_name}: {e.message}\n{e.traceback}" for e in bad)
    exp = expected_collectives(3)
    for old, got in zip((0, 2, 3), survivors):
        assert got["first"] == ("RankFailureError", [1]), got["first"]
        assert got["is_default"] and got["backend"] == "mooncake" and got["world"] == 3, got
        assert got["shrink_s"] < OP_TIMEOUT / 3, got["shrink_s"]
        assert_collectives(got, exp[got["rank"]], f"old rank {old}")
    assert [s["rank"] for s in survivors] == [0, 1, 2]


def test_planned_shrink_without_a_failure(fresh_pool):
    """A rank that leaves on purpose (still alive) is shrunk away by the others; every
    collective and DDP work on the shrunk group."""
    pool = fresh_pool(4, "shm")
    res = pool.run(rank_planned_shrink, 3, timeout=120)
    assert res[3] == "left"
    exp = expected_collectives(3)
    for r in range(3):
        exp[r]["ddp_grad"] = torch.full((1, 2), (1.0 + 2.0 + 3.0) / 3)
        assert_collectives(res[r], exp[r], f"rank {r}")


def test_shrink_group_of_a_subgroup_renumbers_its_members(fresh_pool):
    """shrink_group([0], group=new_group([1, 2, 3])) on ranks 2 and 3: the new group is
    global ranks [2, 3] renumbered 0 and 1 (torch 2.13 alone records [1, 2, 3] for it), and
    every collective is right there."""
    pool = fresh_pool(4, "shm")
    res = pool.run(rank_shrink_subgroup, timeout=120)
    assert res[0] is None and res[1] is None, res
    exp = expected_collectives(2)
    for g, r in ((2, 0), (3, 1)):
        exp[r]["global_ranks"] = [2, 3]
        exp[r]["broadcast_from_global_3"] = torch.tensor([3.0])
        assert_collectives(res[g], exp[r], f"global rank {g}")


def test_shrink_abort_fails_the_op_in_flight(fresh_pool):
    """SHRINK_ABORT with an all_reduce in flight that waits for an absent rank: the op fails
    at once (not after the 30 s op timeout) and the shrunk group works."""
    pool = fresh_pool(4, "shm")
    res = pool.run(rank_shrink_abort_in_flight, 2, timeout=120)
    exp = expected_collectives(3)
    for old, got in zip((0, 1, 3), (res[0], res[1], res[3])):
        assert got["in_flight"] != "completed", got
        assert got["seconds"] < OP_TIMEOUT / 3, got
        assert_collectives(got, exp[got["rank"]], f"old rank {old}")


def test_shrink_group_bad_arguments_raise_as_torch_documents():
    res = get_pool(3, "mooncake", "shm").run(rank_shrink_bad_arguments, timeout=60)
    for r in res:
        assert r == {
            "empty": "ValueError",
            "out_of_range": "ValueError",
            "duplicate": "ValueError",
            "self": "RuntimeError",
            "all": "ValueError",
            "flags": "ValueError",
            "not_a_list": "TypeError",
            "after": 3.0,
        }, r


@pytest.mark.parametrize(
    "split_ranks",
    [[[0, 1], [2, 3]], [[0, 2, 3]], [[3, 1]]],
    ids=["two", "one-of-three", "no-colour"],
)
def test_split_group(fresh_pool, split_ranks):
    """ProcessGroup.split_group (behind dist.split_group): each rank gets the group of its
    split, renumbered in parent order; a rank in no split gets None."""
    pool = fresh_pool(4, "shm")
    res = pool.run(rank_split, split_ranks, timeout=120)
    for r in range(4):
        mine = next((sorted(s) for s in split_ranks if r in s), None)
        if mine is None:
            assert res[r] is None, res[r]
            continue
        full = expected_collectives(len(mine))[mine.index(r)]
        exp = {k: full[k] for k in ("rank", "size", "all_reduce", "broadcast", "all_gather")}
        exp["backend"] = "MooncakeBackend"
        assert_collectives(res[r], exp, f"rank {r} in split {mine}")


def test_supports_shrinking_and_splitting():
    res = get_pool(2, "mooncake", "shm").run(_rank_supports, timeout=60)
    assert res == [(True, True)] * 2


def _rank_supports(rank, ws):
    be = c10d._get_default_group()._get_backend(torch.device("cpu"))
    return be.supports_shrinking, be.supports_splitting


def test_sequence_numbers_count_collectives_and_agree():
    """c10d sequence numbers (the backend's _get_sequence_number_for_group): 0 on a new group,
    one more per collective when it is issued, equal on every rank; a new group counts its own."""
    n_ops = 7
    res = get_pool(3, "mooncake", "shm").run(rank_sequence_numbers, n_ops, timeout=60)
    befores = {r["before"] for r in res}
    assert len(befores) == 1, res  # the pool's earlier calls ran the same collectives everywhere
    b = befores.pop()
    for r, got in enumerate(res):
        # new_group's own set-up runs no collective of the default group
        assert got["issued"] == b + n_ops + 1, (r, got)
        if r in (0, 1):
            assert got["sub_new"] == 0 and got["sub"] == 1, (r, got)


def test_ddp_sparse_embedding_trains_like_gloo():
    """DDP over nn.Embedding(sparse=True) all-reduces sparse gradients: after 5 steps every
    parameter equals the one gloo's DDP trains from the same seeds."""
    got = get_pool(2, "mooncake", "shm").run(rank_ddp_sparse_embedding, 5, timeout=120)
    ref = get_pool(2, "gloo").run(rank_ddp_sparse_embedding, 5, timeout=120)
    for r in range(2):
        for k in ref[r]:
            assert torch.allclose(got[r][k], ref[r][k], rtol=1e-5, atol=1e-6), (r, k)
    for k in got[0]:
        assert torch.equal(got[0][k], got[1][k]), k  # replicas stay equal


# ------------------------------------------------------------------ graceful leave


def rank_leave(rank, ws, leaver):
    import mooncake_pg

    x = torch.ones(1)
    dist.all_reduce(x)
    if rank == leaver:
        mooncake_pg.leave_group()
        after = {}
        for name, call in (
            ("all_reduce", lambda: dist.all_reduce(x)),
            ("send", lambda: dist.send(torch.ones(1), dst=0)),
            ("leave_group", mooncake_pg.leave_group),
        ):
            try:
                call()
                after[name] = "completed"
            except Exception as e:
                after[name] = type(e).__name__
        return {
            "left": True,
            "after": after,
            "active": mooncake_pg.get_active_ranks().tolist(),
            "epoch": mooncake_pg.get_epoch(),
        }
    t = torch.tensor([rank + 1.0])
    t0 = time.monotonic()
    dist.all_reduce(t)
    return {
        "value": float(t),
        "seconds": time.monotonic() - t0,
        "failed": list(mooncake_pg.backend_of(None).failed_ranks()),
        "active": mooncake_pg.get_active_ranks().tolist(),
    }


HOLD_MS = 1000  # MOONCAKE_FAULT_DELAY of rank_leave_in_flight: well over the 0.1 s record look-up


def rank_leave_in_flight(rank, ws, leaver, late, then_exit):
    """Every rank all_reduces ones on a new group; ``late`` takes the leaver's part of that op
    ``HOLD_MS`` late (``MOONCAKE_FAULT_DELAY``), so the leaver completes it, leaves (and exits
    with ``then_exit``) while its part is still on its way to ``late``. Then the others
    all_reduce ``rank + 1``."""
    import os

    import mooncake_pg

    if rank == late:
        os.environ["MOONCAKE_FAULT_DELAY"] = f"0:{leaver}:{HOLD_MS}"
    try:
        g = dist.new_group(list(range(ws)))
    finally:
        os.environ.pop("MOONCAKE_FAULT_DELAY", None)
    x = torch.ones(1)
    dist.all_reduce(x, group=g)
    if rank == leaver:
        mooncake_pg.leave_group(g)
        if then_exit:
            os._exit(0)
        return {"first": float(x)}
    t = torch.tensor([rank + 1.0])
    t0 = time.monotonic()
    dist.all_reduce(t, group=g)
    return {
        "first": float(x),
        "value": float(t),
        "seconds": time.monotonic() - t0,
        "failed": list(mooncake_pg.backend_of(g).failed_ranks()),
        "active": mooncake_pg.get_active_ranks(g).tolist(),
    }


def rank_exit(rank, ws, who):
    if rank == who:
        import os

        os._exit(0)
    return None


def rank_refill(rank, ws):
    import mooncake_pg

    if mooncake_pg.is_joining():
        mooncake_pg.join_group(timeout=20.0)
        joined = None
    else:
        deadline = time.monotonic() + 20.0
        while not mooncake_pg.get_pending_ranks() and time.monotonic() < deadline:
            time.sleep(0.05)
        joined = mooncake_pg.recover_ranks(None, mooncake_pg.get_pending_ranks())
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return {"joined": joined, "value": float(t)}


@pytest.mark.parametrize(
    "transport, policy, world_size",
    [("shm", "raise", 4), ("tcp", "mask", 3), ("shm", "manual", 3)],
)
def test_leave_group_is_agreed_at_once_and_the_seat_refilled(transport, policy, world_size):
    """Rank 1 of 3 or 4 leaves (leave_group) between two ops: the others' next all_reduce runs
    over the others (the sum of rank + 1 without rank 1's 2) well under the 30 s op timeout,
    under every policy; the leaver's
    later ops (collectives, p2p, another leave) raise DistBackendError and it sees the
    membership the others see; the seat is listed failed, and a replacement takes it through
    recover_ranks / join_group, after which all_reduce runs over every rank again."""
    from tests.pg.test_rejoin import RejoinPool, expect_ok

    rp = RejoinPool(transport, policy=policy, op_timeout=OP_TIMEOUT, world_size=world_size)
    n = world_size
    others = [r for r in range(n) if r != 1]
    mask = [0 if r == 1 else 1 for r in range(n)]
    try:
        res = rp.run(rank_leave, 1)
        expect_ok(rp, res, range(n), "leave")
        assert res[1] == {
            "left": True,
            "after": dict.fromkeys(("all_reduce", "send", "leave_group"), "DistBackendError"),
            "active": mask,
            "epoch": 1,
        }, res[1]
        for r in others:
            got = res[r]
            assert got["value"] == sum(k + 1.0 for k in others), (r, res, rp.mooncake_lines())
            assert got["seconds"] < 3.0, (
                r,
                res,
                rp.mooncake_lines(),
            )  # no op timeout (30 s), no death
            assert got["failed"] == [1] and got["active"] == mask, (r, res, rp.mooncake_lines())
        rp.run(rank_exit, 1)  # the leaver's process goes away; a new one takes the seat
        rp.respawn(1)
        res = rp.run(rank_refill)
        expect_ok(rp, res, range(n), "refill")
        for r in range(n):
            assert res[r]["value"] == n * (n + 1) / 2, res[r]
        for r in others:
            assert res[r]["joined"] == [1], res
    finally:
        rp.close()


@pytest.mark.parametrize(
    "transport, policy, then_exit",
    [
        ("tcp", "mask", False),
        ("shm", "raise", False),
        ("tcp", "raise", True),
        ("shm", "mask", True),
    ],
)
def test_leave_right_after_an_op_whose_data_is_still_in_flight(transport, policy, then_exit):
    """Rank 1 of 3 leaves (and, with then_exit, exits) right after an all_reduce that rank 2
    has not yet received its part of (held back 1 s as if in flight): rank 2 sees the leave
    record while it waits for that part. The leaver completed that op, so its part is on its
    way: every rank's result includes it (3), and the next all_reduce runs over ranks 0 and 2
    (1 + 3) on both, without an op timeout. Taking the leaver for gone there would rerun the
    op on rank 2 alone without it, in the next epoch, where that rerun pairs with rank 0's
    next all_reduce (2 on both, and rank 2's own next all_reduce finds no partner); so would
    rank 0 moving to the next epoch before rank 2 has arrived at the next all_reduce (shm:
    rank 2 then finds a peer in a later epoch while still in the held op)."""
    from tests.pg.test_rejoin import RejoinPool, expect_died, expect_ok

    rp = RejoinPool(transport, policy=policy, op_timeout=10.0, world_size=3)
    try:
        res = rp.run(rank_leave_in_flight, 1, 2, then_exit)
        expect_ok(rp, res, (0, 2), "leave")
        if then_exit:
            expect_died(rp, res, 1, "leave")
        else:
            assert res[1] == {"first": 3.0}, (res, rp.mooncake_lines())
        for r in (0, 2):
            got = res[r]
            assert got["first"] == 3.0, (r, res, rp.mooncake_lines())
            assert got["value"] == 4.0, (r, res, rp.mooncake_lines())
            assert got["seconds"] < HOLD_MS / 1000 + 3.0, (r, res, rp.mooncake_lines())
            assert got["failed"] == [1] and got["active"] == [1, 0, 1], (
                r,
                res,
                rp.mooncake_lines(),
            )
    finally:
        rp.close()
