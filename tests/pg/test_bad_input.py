"""Bad input (docs/design.md "Work, errors, bad input").

(a) A rank's own bad arguments raise before the op is enqueued: only the faulty caller
    makes the call (the other ranks do not take part), so the error must come at once
    from local checks; its buffers stay untouched; then every rank runs normal
    collectives and point-to-point ops, which must still be right (nothing was enqueued,
    no sequence counter moved).
(b) Cross-rank mismatch (size, dtype, ReduceOp, split sizes): every rank raises
    ``ValueError`` naming the offending rank, before any user buffer is modified
    (buffers are filled with a sentinel first), nobody waits for the op timeout, and the
    next all_reduce gives the right answer. Only on mooncake: gloo hangs or aborts.

With ``MOONCAKE_TEST_BACKENDS=gloo`` (developing the tests) several (a) cases fail:
gloo enqueues or advances its collective counter before some of its checks, so the
follow-up ops time out. That is gloo's behaviour, not the tests'.
"""

from __future__ import annotations

import re
import time

import pytest
import torch
import torch.distributed as dist

from tests import rankpool
from tests.pg import outcomes as O
from tests.rankpool import PoolStartError, RankPool, default_backend, get_pool

pytestmark = pytest.mark.timeout(120)

BACKEND, TRANSPORT = default_backend()
OP_TIMEOUT = 10.0  # short op timeout for these pools
LOCAL_ERROR_LIMIT_S = 1.0  # a local check answers at once
SENTINEL = -7.0
LARGE_ROW = 1 << 16  # float32 elements: 256 KiB


def pool(ws):
    return get_pool(ws, BACKEND, TRANSPORT, timeout=OP_TIMEOUT)


def _follow_up(rank, ws):
    """Normal ops after the bad call; returns what the test compares."""
    out = {}
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    out["all_reduce"] = t.item()
    o = torch.zeros(2 * ws)
    dist.all_gather_single(o, torch.tensor([100.0 * rank, 100.0 * rank + 1]))
    out["all_gather_single"] = o.tolist()
    a = torch.zeros(ws)
    dist.all_to_all_single(a, torch.arange(ws, dtype=torch.float32) + 10 * rank)
    out["all_to_all_single"] = a.tolist()
    if ws > 1:
        y = torch.zeros(3)
        rw = dist.irecv(y, src=(rank - 1) % ws)
        dist.isend(torch.arange(3.0) + rank, dst=(rank + 1) % ws).wait()
        rw.wait()
        out["ring"] = y.tolist()
    return out


def _follow_up_expected(rank, ws):
    out = {
        "all_reduce": ws * (ws + 1) / 2,
        "all_gather_single": [v for r in range(ws) for v in (100.0 * r, 100.0 * r + 1)],
        "all_to_all_single": [float(rank + 10 * s) for s in range(ws)],
    }
    if ws > 1:
        out["ring"] = (torch.arange(3.0) + (rank - 1) % ws).tolist()
    return out


# ---------------------------------------------------------------- (a) local errors
# Each bad_* runs on the faulty caller only and returns the buffers that must stay
# untouched; it raises (that is the point) before the op is enqueued.


def _opts(cls, **kw):
    o = getattr(dist, cls)()
    for k, v in kw.items():
        setattr(o, k, v)
    return o


def bad_a2a_input_split_sum(rank, ws, bufs):
    x, out = (
        torch.arange(4.0 * ws).reshape(2 * ws, 2),
        bufs.setdefault("out", torch.full((2 * ws, 2), SENTINEL)),
    )
    ins = [2] * ws
    ins[-1] -= 1  # sums to 2*ws - 1, input has 2*ws rows
    dist.all_to_all_single(out, x, output_split_sizes=[2] * ws, input_split_sizes=ins)


def bad_a2a_output_split_sum(rank, ws, bufs):
    x, out = (
        torch.arange(4.0 * ws).reshape(2 * ws, 2),
        bufs.setdefault("out", torch.full((2 * ws, 2), SENTINEL)),
    )
    outs = [2] * ws
    outs[0] += 1
    dist.all_to_all_single(out, x, output_split_sizes=outs, input_split_sizes=[2] * ws)


def bad_a2a_split_count(rank, ws, bufs):
    x, out = (
        torch.arange(4.0 * ws).reshape(2 * ws, 2),
        bufs.setdefault("out", torch.full((2 * ws, 2), SENTINEL)),
    )
    dist.all_to_all_single(
        out, x, output_split_sizes=[2] * ws + [0], input_split_sizes=[2] * ws + [0]
    )


def bad_a2a_negative_split(rank, ws, bufs):
    x, out = (
        torch.arange(4.0 * ws).reshape(2 * ws, 2),
        bufs.setdefault("out", torch.full((2 * ws, 2), SENTINEL)),
    )
    ins = [2] * ws
    ins[0], ins[1] = -1, 5
    dist.all_to_all_single(out, x, output_split_sizes=[2] * ws, input_split_sizes=ins)


def bad_a2a_even_not_divisible(rank, ws, bufs):
    x, out = torch.arange(float(ws + 1)), bufs.setdefault("out", torch.full((ws + 1,), SENTINEL))
    dist.all_to_all_single(out, x)


def bad_agt_output_size(rank, ws, bufs):
    out = bufs.setdefault("out", torch.full((ws * 4 + 1,), SENTINEL))
    dist.all_gather_single(out, torch.arange(4.0))


def bad_agt_output_dtype(rank, ws, bufs):
    out = bufs.setdefault("out", torch.full((ws * 4,), SENTINEL, dtype=torch.float64))
    dist.all_gather_single(out, torch.arange(4.0))


def bad_rst_input_size(rank, ws, bufs):
    out = bufs.setdefault("out", torch.full((4,), SENTINEL))
    dist.reduce_scatter_single(out, torch.arange(4.0 * ws - 1))


def bad_rst_output_dtype(rank, ws, bufs):
    out = bufs.setdefault("out", torch.full((4,), SENTINEL, dtype=torch.float64))
    dist.reduce_scatter_single(out, torch.arange(4.0 * ws))


def bad_all_gather_list_len(rank, ws, bufs):
    outs = bufs.setdefault("out", [torch.full((4,), SENTINEL) for _ in range(ws + 1)])
    dist.all_gather(outs, torch.arange(4.0))


def bad_all_gather_list_size(rank, ws, bufs):
    outs = bufs.setdefault(
        "out", [torch.full((4,), SENTINEL) for _ in range(ws - 1)] + [torch.full((5,), SENTINEL)]
    )
    dist.all_gather(outs, torch.arange(4.0))


def bad_reduce_scatter_list_len(rank, ws, bufs):
    out = bufs.setdefault("out", torch.full((4,), SENTINEL))
    dist.reduce_scatter(out, [torch.arange(4.0) for _ in range(ws + 1)])


def bad_all_to_all_list_len(rank, ws, bufs):
    outs = bufs.setdefault("out", [torch.full((2,), SENTINEL) for _ in range(ws + 1)])
    dist.all_to_all(outs, [torch.arange(2.0) for _ in range(ws + 1)])


def bad_broadcast_root_direct(rank, ws, bufs):
    t = bufs.setdefault("out", torch.full((4,), SENTINEL))
    dist.group.WORLD.broadcast([t], _opts("BroadcastOptions", rootRank=ws, rootTensor=0)).wait()


def bad_broadcast_root_negative_direct(rank, ws, bufs):
    t = bufs.setdefault("out", torch.full((4,), SENTINEL))
    dist.group.WORLD.broadcast([t], _opts("BroadcastOptions", rootRank=-1, rootTensor=0)).wait()


def bad_broadcast_root_public(rank, ws, bufs):
    t = bufs.setdefault("out", torch.full((4,), SENTINEL))
    dist.broadcast(t, src=ws)


def bad_reduce_root_direct(rank, ws, bufs):
    t = bufs.setdefault("out", torch.full((4,), SENTINEL))
    dist.group.WORLD.reduce([t], _opts("ReduceOptions", rootRank=ws + 3)).wait()


def bad_gather_list_len_on_root(rank, ws, bufs):
    outs = bufs.setdefault("out", [torch.full((4,), SENTINEL) for _ in range(ws + 1)])
    dist.group.WORLD.gather(
        [outs], [torch.arange(4.0)], _opts("GatherOptions", rootRank=rank)
    ).wait()


def bad_scatter_list_len_on_root(rank, ws, bufs):
    out = bufs.setdefault("out", torch.full((4,), SENTINEL))
    dist.group.WORLD.scatter(
        [out], [[torch.arange(4.0) for _ in range(ws + 1)]], _opts("ScatterOptions", rootRank=rank)
    ).wait()


def bad_scatter_piece_size_on_root(rank, ws, bufs):
    out = bufs.setdefault("out", torch.full((4,), SENTINEL))
    dist.scatter(out, [torch.arange(4.0) for _ in range(ws - 1)] + [torch.arange(5.0)], src=rank)


def bad_send_to_self_direct(rank, ws, bufs):
    dist.group.WORLD.send([torch.arange(4.0)], rank, 0).wait()


def bad_send_out_of_range_direct(rank, ws, bufs):
    dist.group.WORLD.send([torch.arange(4.0)], ws, 0).wait()


def bad_recv_out_of_range_direct(rank, ws, bufs):
    t = bufs.setdefault("out", torch.full((4,), SENTINEL))
    dist.group.WORLD.recv([t], ws + 1, 0).wait()


def bad_all_reduce_band_float(rank, ws, bufs):
    t = bufs.setdefault("out", torch.full((4,), SENTINEL))
    dist.all_reduce(t, op=dist.ReduceOp.BAND)


def bad_all_reduce_premul_int(rank, ws, bufs):
    t = bufs.setdefault("out", torch.full((4,), 7, dtype=torch.int32))
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(2.0))


LOCAL_CASES = sorted(k for k in globals() if k.startswith("bad_"))


def rank_local_error(rank, ws, case, caller):
    torch.set_num_threads(1)
    res = None
    if rank == caller:
        bufs = {}
        fn = globals()[case]
        # the value each buffer holds before the call (set up by the case on first touch)
        t0 = time.monotonic()
        try:
            fn(rank, ws, bufs)
            res = {"raised": None}
        except Exception as e:
            res = {
                "raised": type(e).__name__,
                "mro": [c.__name__ for c in type(e).__mro__],
                "message": str(e),
            }
        res["seconds"] = time.monotonic() - t0
        res["bufs"] = bufs.get("out")
    dist.barrier()
    return res, _follow_up(rank, ws)


def _untouched(buf):
    if buf is None:
        return True
    if isinstance(buf, list):
        return all(_untouched(b) for b in buf)
    if buf.dtype == torch.int32:
        return bool((buf == 7).all())
    return bool(((buf == SENTINEL) | (buf == 7.0)).all())


@pytest.mark.parametrize("case", LOCAL_CASES)
def test_own_bad_arguments_raise_before_enqueue(case):
    """(a) the caller alone makes the bad call: it raises at once (local check, no peer
    involved), leaves its buffers alone, and the group's next ops are all right."""
    ws = 3
    caller = 0 if case.endswith("_on_root") else 1
    res = pool(ws).run(rank_local_error, case, caller, timeout=90)
    mine = res[caller][0]
    assert mine["raised"] is not None, (
        f"{case}: the bad call did not raise (took {mine['seconds']:.2f} s)"
    )
    assert (
        mine["raised"] in ("ValueError", "RuntimeError", "TypeError", "IndexError")
        or "ValueError" in mine["mro"]
        or "RuntimeError" in mine["mro"]
    ), mine
    assert mine["seconds"] < LOCAL_ERROR_LIMIT_S, (
        f"{case}: the error took {mine['seconds']:.2f} s (waited on peers: enqueued?): {mine['message']}"
    )
    assert _untouched(mine["bufs"]), f"{case}: a buffer was modified: {mine['bufs']}"
    for r in range(ws):
        assert res[r][1] == _follow_up_expected(r, ws), (
            f"{case}: follow-up ops on rank {r}: {res[r][1]}"
        )


def rank_all_same_bad_args(rank, ws):
    """Every rank passes the same bad split sizes: all raise, nobody hangs."""
    torch.set_num_threads(1)
    x, out = torch.arange(4.0 * ws).reshape(2 * ws, 2), torch.full((2 * ws, 2), SENTINEL)
    t0 = time.monotonic()
    try:
        dist.all_to_all_single(out, x, output_split_sizes=[2] * ws, input_split_sizes=[1] * ws)
        r = None
    except Exception as e:
        r = type(e).__name__
    return r, time.monotonic() - t0, bool((out == SENTINEL).all()), _follow_up(rank, ws)


def test_same_bad_arguments_on_every_rank():
    """(a) every rank passes the same bad split sizes: every rank raises at once and the
    group goes on."""
    ws = 4
    res = pool(ws).run(rank_all_same_bad_args, timeout=60)
    for r, (err, secs, untouched, follow) in enumerate(res):
        assert err is not None and secs < LOCAL_ERROR_LIMIT_S and untouched, (
            r,
            err,
            secs,
            untouched,
        )
        assert follow == _follow_up_expected(r, ws), (r, follow)


# ----------------------------------------------------------- (b) cross-rank mismatch

N = 8


def _mismatch_call(rank, ws, case, off):
    """Sets up this rank's arguments (the offender's differ) and returns (call, buffers):
    ``buffers`` is a list of (tensor, expected-unchanged copy)."""
    me = rank == off
    if case == "all_reduce_size":
        x = torch.arange(float(N + (1 if me else 0))) + 100 * rank
        return (lambda: dist.all_reduce(x)), [(x, x.clone())]
    if case == "all_reduce_dtype":
        x = (torch.arange(float(N)) + 100 * rank).to(torch.float64 if me else torch.float32)
        return (lambda: dist.all_reduce(x)), [(x, x.clone())]
    if case == "all_reduce_op":
        x = torch.arange(float(N)) + 100 * rank
        op = dist.ReduceOp.MAX if me else dist.ReduceOp.SUM
        return (lambda: dist.all_reduce(x, op=op)), [(x, x.clone())]
    if case == "all_gather_single_size":
        n = N + (1 if me else 0)
        x = torch.arange(float(n)) + 100 * rank
        out = torch.full((ws * n,), SENTINEL)
        return (lambda: dist.all_gather_single(out, x)), [(out, out.clone()), (x, x.clone())]
    if case == "all_gather_single_dtype":
        d = torch.int32 if me else torch.float32
        x = (torch.arange(N) + 100 * rank).to(d)
        out = torch.full((ws * N,), -7, dtype=d)
        return (lambda: dist.all_gather_single(out, x)), [(out, out.clone()), (x, x.clone())]
    if case == "all_to_all_single_output_splits":
        x = torch.arange(float(ws)) + 100 * rank
        out = torch.full((ws,), SENTINEL)
        outs = [1] * ws
        if me:
            outs = [2] + [1] * (ws - 2) + [0]  # still sums to ws: locally valid
        return (
            lambda: dist.all_to_all_single(
                out, x, output_split_sizes=outs, input_split_sizes=[1] * ws
            )
        ), [(out, out.clone()), (x, x.clone())]
    if case == "all_to_all_single_output_splits_large_rows":
        # rows of 256 KiB, the last rank 0.2 s late: over TCP the others hold every other
        # sender's bytes, ready to copy out, while the last frames are still coming; the
        # splits must be checked first
        x = torch.arange(float(ws * LARGE_ROW)).view(ws, LARGE_ROW) + 100 * rank
        out = torch.full((ws, LARGE_ROW), SENTINEL)
        outs = [2] + [1] * (ws - 2) + [0] if me else [1] * ws

        def late_a2a():
            if rank == ws - 1:
                time.sleep(0.2)
            dist.all_to_all_single(out, x, output_split_sizes=outs, input_split_sizes=[1] * ws)

        return late_a2a, [(out, out.clone()), (x, x.clone())]
    if case == "all_to_all_single_input_splits":
        k = 2 if me else 1
        x = torch.arange(float(k * ws)) + 100 * rank
        out = torch.full((ws,), SENTINEL)
        return (
            lambda: dist.all_to_all_single(
                out, x, output_split_sizes=[1] * ws, input_split_sizes=[k] * ws
            )
        ), [(out, out.clone()), (x, x.clone())]
    if case == "reduce_scatter_single_size":
        n = N + (1 if me else 0)
        x = torch.arange(float(ws * n)) + 100 * rank
        out = torch.full((n,), SENTINEL)
        return (lambda: dist.reduce_scatter_single(out, x)), [(out, out.clone()), (x, x.clone())]
    if case == "reduce_scatter_single_op":
        x = torch.arange(float(ws * N)) + 100 * rank
        out = torch.full((N,), SENTINEL)
        op = dist.ReduceOp.AVG if me else dist.ReduceOp.SUM
        return (lambda: dist.reduce_scatter_single(out, x, op=op)), [
            (out, out.clone()),
            (x, x.clone()),
        ]
    if case in ("all_reduce_sparse_negative_index", "all_reduce_sparse_index_too_large"):
        # torch does not check sparse indices unless asked; coalescing a bad one corrupts memory
        bad = -1 if case.endswith("negative_index") else N
        x = torch.sparse_coo_tensor(
            torch.tensor([[bad if me else rank % N]]), torch.tensor([1.0]), (N,)
        )
        return (lambda: dist.all_reduce(x)), ([] if me else [(x, x.clone())])
    if case == "all_reduce_coalesced_count":  # the offender passes one tensor more
        xs = [torch.arange(float(N)) + 100 * rank for _ in range(3 if me else 2)]
        return (lambda: dist.all_reduce_coalesced(xs)), [(x, x.clone()) for x in xs]
    if case == "coalescing_block_count":  # one all_gather more in the offender's block
        ins = [torch.arange(float(N)) + 100 * rank for _ in range(3 if me else 2)]
        outs = [torch.full((ws * N,), SENTINEL) for _ in ins]

        def block():
            with dist._coalescing_manager(async_ops=True) as cm:
                for o, i in zip(outs, ins):
                    dist.all_gather_into_tensor(o, i)
            cm.wait()

        return block, [(o, o.clone()) for o in outs]
    raise ValueError(case)


MISMATCH_CASES = [
    "all_reduce_size",
    "all_reduce_dtype",
    "all_reduce_op",
    "all_gather_single_size",
    "all_gather_single_dtype",
    "all_to_all_single_output_splits",
    "all_to_all_single_input_splits",
    "reduce_scatter_single_size",
    "reduce_scatter_single_op",
    # calls that run one collective per tensor: the tensor counts must agree, else the
    # later tensors would pair with the next calls of the other ranks
    "all_reduce_coalesced_count",
    "coalescing_block_count",
    # a sparse tensor's indices are checked by its rank and the verdict exchanged first
    "all_reduce_sparse_negative_index",
    "all_reduce_sparse_index_too_large",
]


def rank_mismatch(rank, ws, case, off):
    torch.set_num_threads(1)
    call, bufs = _mismatch_call(rank, ws, case, off)
    t0 = time.monotonic()
    try:
        call()
        res = {"raised": None}
    except Exception as e:
        res = {
            "raised": type(e).__name__,
            "mro": [c.__name__ for c in type(e).__mro__],
            "message": str(e),
        }
    res["seconds"] = time.monotonic() - t0
    res["unchanged"] = [
        bool(torch.equal(b.to_dense(), c.to_dense()) if b.is_sparse else torch.equal(b, c))
        for b, c in bufs
    ]
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    res["next_all_reduce"] = t.item()
    res["follow_up"] = _follow_up(rank, ws)
    return res


needs_mooncake = pytest.mark.skipif(
    BACKEND != "mooncake",
    reason="cross-rank mismatch detection is a mooncake feature (gloo hangs or aborts)",
)


@needs_mooncake
@pytest.mark.parametrize("case", MISMATCH_CASES)
def test_cross_rank_mismatch_every_rank_raises(case):
    """(b) W=4, rank 2 alone passes different arguments: every rank raises ValueError
    naming rank 2, no user buffer changed, no op timeout waited for, next ops right."""
    _check_mismatch(4, 2, case)


@needs_mooncake
@pytest.mark.parametrize("ws,off", [(2, 1), (3, 1), (4, 3)])
def test_cross_rank_mismatch_other_offenders(ws, off):
    """(b) the same with other world sizes and offenders (all_reduce size and split sizes)."""
    _check_mismatch(ws, off, "all_reduce_size")
    _check_mismatch(ws, off, "all_to_all_single_input_splits")


@needs_mooncake
@pytest.mark.parametrize("case", ["all_to_all_single_output_splits_large_rows"])
def test_cross_rank_mismatch_over_tcp_leaves_outputs_untouched(case):
    """(b) over TCP an all_to_all copies each sender's bytes out as they arrive, while
    other frames are still coming: only after every rank's splits are in and agree, so a
    mismatch still leaves every output untouched and raises ValueError on every rank."""
    _check_mismatch(4, 2, case, transport="tcp")


def _check_mismatch(ws, off, case, transport=TRANSPORT):
    res = get_pool(ws, BACKEND, transport, timeout=OP_TIMEOUT).run(
        rank_mismatch, case, off, timeout=90
    )
    problems = []
    for r, o in enumerate(res):
        if o["raised"] is None:
            problems.append(f"rank {r}: no error")
        else:
            if "ValueError" not in o["mro"]:
                problems.append(
                    f"rank {r}: raised {o['raised']} (not a ValueError): {o['message']}"
                )
            if f"rank {off}" not in o["message"]:
                problems.append(f"rank {r}: message does not name 'rank {off}': {o['message']!r}")
        if o["seconds"] >= OP_TIMEOUT * 0.5:
            problems.append(f"rank {r}: took {o['seconds']:.1f} s (waited for the op timeout?)")
        if not all(o["unchanged"]):
            problems.append(f"rank {r}: buffers modified: {o['unchanged']}")
        if o["next_all_reduce"] != ws * (ws + 1) / 2:
            problems.append(f"rank {r}: next all_reduce gave {o['next_all_reduce']}")
        if o["follow_up"] != _follow_up_expected(r, ws):
            problems.append(f"rank {r}: follow-up ops gave {o['follow_up']}")
    assert not problems, f"{case} (ws={ws}, offender rank {off}):\n" + "\n".join(problems)


# ================================== a bad op in batch_isend_irecv poisons nothing later

BATCH_OP_TIMEOUT = 10.0


def _ring(rank, ws, n=6):
    nxt, prv = (rank + 1) % ws, (rank - 1) % ws
    r = torch.full((n,), O.SENTINEL)
    works = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, torch.full((n,), float(rank + 1)), nxt),
            dist.P2POp(dist.irecv, r, prv),
        ]
    )
    for w in works:
        w.wait()
    return r


def rank_batch_bad_op(rank, ws, bad, with_good):
    bad_peer = rank if bad == "self" else ws + 5
    ops = []
    recv_buf = torch.full((4,), O.SENTINEL)
    if with_good:
        ops.append(dist.P2POp(dist.isend, torch.full((4,), float(100 + rank)), (rank + 1) % ws))
    ops.append(dist.P2POp(dist.isend, torch.ones(2), bad_peer))
    if with_good:
        ops.append(dist.P2POp(dist.irecv, recv_buf, (rank - 1) % ws))

    def call():
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    rec = O.outcome(call)
    out = {"batch": rec, "after": O.follow_up(rank, ws)}
    out["ring1"] = _ring(rank, ws)
    out["ring2"] = _ring(rank, ws, n=300_000)
    out["recv_buf"] = recv_buf
    return out


@O.mooncake_only
@pytest.mark.timeout(60)
@pytest.mark.parametrize("with_good", [False, True], ids=["alone", "with_good_ops"])
@pytest.mark.parametrize("bad", ["self", "out_of_range"])
@pytest.mark.parametrize("transport", O.TRANSPORTS)
def test_batch_isend_irecv_bad_op_does_not_poison_group(transport, bad, with_good):
    ws = 2
    pool = rankpool.get_pool(ws, "mooncake", transport, timeout=BATCH_OP_TIMEOUT)
    res = pool.run(rank_batch_bad_op, bad, with_good, timeout=O.RUN_TIMEOUT)
    ctx = f"[{transport}/{bad}/{'with good ops' if with_good else 'alone'}]"
    for r in range(ws):
        rec = res[r]["batch"]
        assert not rec["ok"], (
            f"{ctx} rank {r}: batch_isend_irecv with a send to a bad peer {O.fmt(rec)}"
        )
        assert "ValueError" in rec["mro"], (
            f"{ctx} rank {r}: a bad peer is a bad argument (ValueError): {O.fmt(rec)}"
        )
        if bad == "out_of_range":
            assert re.search(rf"\b{ws + 5}\b", rec["msg"]), (
                f"{ctx} rank {r}: the bad peer is not named: {O.fmt(rec)}"
            )
        assert rec["dt"] < O.LOCAL_ERROR_LIMIT_S * 5, f"{ctx} rank {r}: {O.fmt(rec)}"
        # the good irecv of the batch either took the good isend's message or nothing
        prv = (r - 1) % ws
        got = res[r]["recv_buf"]
        assert torch.equal(got, torch.full((4,), O.SENTINEL)) or torch.equal(
            got, torch.full((4,), float(100 + prv))
        ), f"{ctx} rank {r}: the batch's good irecv buffer holds {got.tolist()}"
    O.check_follow_up(res, ws, ctx)
    for r in range(ws):
        prv = (r - 1) % ws
        assert torch.equal(res[r]["ring1"], torch.full((6,), float(prv + 1))), (
            f"{ctx} rank {r}: later batch ring gave {res[r]['ring1'].tolist()}, expected {prv + 1}"
        )
        assert torch.equal(res[r]["ring2"], torch.full((300_000,), float(prv + 1))), (
            f"{ctx} rank {r}: later large batch ring gave {res[r]['ring2'][:8].tolist()}"
        )


# ================================================= expanded (stride-0) output tensors

EXPAND_OP_TIMEOUT = 10.0
EXPAND_OPS = ["all_reduce", "broadcast", "all_gather_into_tensor", "all_gather"]


def rank_expanded_output(rank, ws, opname):
    base = torch.full((1,), O.SENTINEL)
    if opname == "all_reduce":
        x = base.expand(4)
        call = lambda: dist.all_reduce(x)  # noqa: E731
    elif opname == "broadcast":
        x = base.expand(4)
        call = lambda: dist.broadcast(x, src=0)  # noqa: E731
    elif opname == "all_gather_into_tensor":
        x = base.expand(ws * 4)
        call = lambda: dist.all_gather_into_tensor(x, torch.full((4,), float(rank + 1)))  # noqa: E731
    else:
        bases = [torch.full((1,), O.SENTINEL) for _ in range(ws)]
        outs = [b.expand(4) for b in bases]
        call = lambda: dist.all_gather(outs, torch.full((4,), float(rank + 1)))  # noqa: E731
    rec = O.outcome(call)
    untouched = (
        bool((base == O.SENTINEL).all())
        if opname != "all_gather"
        else all(bool((b == O.SENTINEL).all()) for b in bases)
    )
    return {"rec": rec, "untouched": untouched, "after": O.follow_up(rank, ws)}


@O.mooncake_only
@pytest.mark.timeout(60)
@pytest.mark.parametrize("opname", EXPAND_OPS)
@pytest.mark.parametrize("transport", O.TRANSPORTS)
def test_expanded_output_raises_value_error(transport, opname):
    ws = 2
    pool = rankpool.get_pool(ws, "mooncake", transport, timeout=EXPAND_OP_TIMEOUT)
    res = pool.run(rank_expanded_output, opname, timeout=O.RUN_TIMEOUT)
    ctx = f"[{transport}/{opname}]"
    for r in range(ws):
        rec = res[r]["rec"]
        assert not rec["ok"], f"{ctx} rank {r}: {opname} into an expanded output {O.fmt(rec)}"
        assert "ValueError" in rec["mro"], f"{ctx} rank {r}: expected ValueError: {O.fmt(rec)}"
        assert rec["dt"] < O.LOCAL_ERROR_LIMIT_S, (
            f"{ctx} rank {r}: not raised at once: {O.fmt(rec)}"
        )
        assert res[r]["untouched"], f"{ctx} rank {r}: the expanded output's storage was written"
    O.check_follow_up(res, ws, ctx)


# =============================================== cross-rank op-kind mismatch message

MISMATCH_OP_TIMEOUT = 10.0


def rank_kind_mismatch(rank, ws, kinds):
    kind = kinds[rank]
    t = torch.full((4,), O.SENTINEL)
    if kind == "all_reduce":
        rec = O.outcome(lambda: dist.all_reduce(t))
    else:
        rec = O.outcome(dist.barrier)
    return {"rec": rec, "buf": t, "after": O.follow_up(rank, ws)}


@O.mooncake_only
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "kinds",
    [
        ("all_reduce", "barrier"),
        ("barrier", "all_reduce"),
        ("all_reduce", "all_reduce", "barrier"),
        ("barrier", "all_reduce", "barrier"),
    ],
    ids=lambda k: "-".join(k),
)
@O.mooncake_only
@pytest.mark.parametrize("transport", O.TRANSPORTS)
def test_op_kind_mismatch_names_own_op_and_offender(transport, kinds):
    ws = len(kinds)
    pool = rankpool.get_pool(ws, "mooncake", transport, timeout=MISMATCH_OP_TIMEOUT)
    res = pool.run(rank_kind_mismatch, kinds, timeout=O.RUN_TIMEOUT)
    ctx = f"[{transport}/{'-'.join(kinds)}]"
    offenders = [j for j in range(ws) if kinds[j] != kinds[0]]
    for r in range(ws):
        rec = res[r]["rec"]
        assert not rec["ok"], f"{ctx} rank {r}: {kinds[r]} against {kinds} {O.fmt(rec)}"
        assert "ValueError" in rec["mro"], f"{ctx} rank {r}: expected ValueError: {O.fmt(rec)}"
        assert rec["msg"].startswith(f"mooncake {kinds[r]} "), (
            f"{ctx} rank {r} called {kinds[r]}; the message must start with its own op: {rec['msg'][:300]!r}"
        )
        who = ", ".join(str(j) for j in offenders)
        assert re.search(rf"offending rank\(s\): {re.escape(who)}(?![\d,])", rec["msg"]), (
            f"{ctx} rank {r}: message does not name offending rank(s) {offenders}: {rec['msg'][:300]!r}"
        )
        assert rec["dt"] < 5.0, f"{ctx} rank {r}: {O.fmt(rec)}"
        if kinds[r] == "all_reduce":
            assert torch.equal(res[r]["buf"], torch.full((4,), O.SENTINEL)), (
                f"{ctx} rank {r}: the all_reduce buffer was modified: {res[r]['buf'].tolist()}"
            )
    O.check_follow_up(res, ws, ctx)


# ========================================== MOONCAKE_SHM_SLOT_BYTES that is not a number


@O.mooncake_only
def test_shm_slot_bytes_env_not_a_number(monkeypatch):
    import mooncake_pg

    monkeypatch.setenv("MOONCAKE_SHM_SLOT_BYTES", "abc")
    with pytest.raises(ValueError, match="MOONCAKE_SHM_SLOT_BYTES") as ei:
        mooncake_pg.config.env_defaults()
    assert "abc" in str(ei.value)
    with pytest.raises(ValueError, match="MOONCAKE_SHM_SLOT_BYTES"):
        mooncake_pg.config.resolve(mooncake_pg.MooncakeOptions())
    # an explicit argument wins, also over a malformed variable (which is then not read)
    opts = mooncake_pg.MooncakeOptions(shm_slot_bytes=65536)
    assert mooncake_pg.config.resolve(opts)["shm_slot_bytes"] == 65536
    monkeypatch.setenv("MOONCAKE_HIERARCHICAL", "maybe")
    with pytest.raises(ValueError, match="MOONCAKE_HIERARCHICAL"):
        mooncake_pg.config.resolve(opts)
    opts = mooncake_pg.MooncakeOptions(shm_slot_bytes=65536, hierarchical=False)
    assert mooncake_pg.config.resolve(opts)["hierarchical"] is False
    monkeypatch.delenv("MOONCAKE_HIERARCHICAL")
    monkeypatch.setenv("MOONCAKE_SHM_SLOT_BYTES", "")
    assert mooncake_pg.config.env_defaults()["shm_slot_bytes"] == 1 << 20
    monkeypatch.setenv("MOONCAKE_SHM_SLOT_BYTES", "65536")
    assert mooncake_pg.config.env_defaults()["shm_slot_bytes"] == 65536
    monkeypatch.delenv("MOONCAKE_SHM_SLOT_BYTES")
    assert mooncake_pg.config.env_defaults()["shm_slot_bytes"] == 1 << 20


@O.mooncake_only
@pytest.mark.timeout(60)
def test_shm_slot_bytes_env_not_a_number_at_init():
    """The same through init_process_group in real rank processes: every rank's init
    raises ValueError naming the variable (no hang, no other error)."""
    with pytest.raises(PoolStartError) as ei:
        pool = RankPool(
            2, "mooncake", "shm", op_timeout=10.0, env={"MOONCAKE_SHM_SLOT_BYTES": "abc"}
        )
        pool.close(graceful=False)
    errs = ei.value.errors
    assert sorted(errs) == [0, 1], f"every rank's init should fail: {ei.value}"
    for r, e in errs.items():
        assert e.isinstance_of("ValueError"), f"rank {r}: {e!r}"
        assert "MOONCAKE_SHM_SLOT_BYTES" in e.message, f"rank {r}: {e!r}"


@O.mooncake_only
@pytest.mark.parametrize("raw", ["0", "-5", "100", "4095"])
def test_shm_slot_bytes_below_the_minimum(monkeypatch, raw):
    """A slot size below 4096 bytes (what the shared-memory engine needs) raises
    ValueError naming MOONCAKE_SHM_SLOT_BYTES, or the field, before any group is made;
    4096 itself is taken."""
    import mooncake_pg

    monkeypatch.setenv("MOONCAKE_SHM_SLOT_BYTES", raw)
    with pytest.raises(
        ValueError, match=rf"MOONCAKE_SHM_SLOT_BYTES must be at least 4096.*'{raw}'"
    ):
        mooncake_pg.config.env_defaults()
    monkeypatch.setenv("MOONCAKE_SHM_SLOT_BYTES", "4096")
    assert mooncake_pg.config.env_defaults()["shm_slot_bytes"] == 4096
    with pytest.raises(ValueError, match=rf"shm_slot_bytes must be >= 4096, got {raw}"):
        mooncake_pg.MooncakeOptions(shm_slot_bytes=int(raw))
    assert mooncake_pg.MooncakeOptions(shm_slot_bytes=4096).shm_slot_bytes == 4096


# ========================================== MooncakeOptions values checked at construction


@O.mooncake_only
@pytest.mark.parametrize(
    "kw, want",
    [
        (dict(host_ip=5), "host_ip must be an address string (e.g. '10.0.0.5') or None, got 5"),
        (dict(host_ip=b"127.0.0.1"), "host_ip must be an address string"),
        (dict(timeout=1e-9), "timeout must be at least 0.1 s (and at most 1e+09 s), got 1e-09"),
        (dict(timeout=0.099), "timeout must be at least 0.1 s"),
        (dict(timeout=0), "timeout must be at least 0.1 s"),
        (dict(timeout=-1.0), "timeout must be at least 0.1 s"),
        (dict(timeout=float("nan")), "timeout must be at least 0.1 s"),
        (dict(timeout=float("inf")), "at most 1e+09 s), got inf"),
        (dict(timeout=1e10), "at most 1e+09 s), got 10000000000.0"),
    ],
)
def test_option_values_raise_at_construction(kw, want):
    """A host_ip that is not a string and an op timeout outside [0.1 s, 1e9 s] raise
    ValueError naming the field when MooncakeOptions is made, not at init or as a live
    rank declared failed."""
    import mooncake_pg

    with pytest.raises(ValueError, match="MooncakeOptions: .*" + re.escape(want)):
        mooncake_pg.MooncakeOptions(**kw)


@O.mooncake_only
def test_option_values_at_the_bounds_are_taken():
    from datetime import timedelta

    import mooncake_pg

    assert mooncake_pg.MooncakeOptions(timeout=0.1).timeout == 0.1
    assert mooncake_pg.MooncakeOptions(timeout=1e9).timeout == 1e9
    assert mooncake_pg.MooncakeOptions(timeout=timedelta(milliseconds=100)).timeout == 0.1
    assert mooncake_pg.MooncakeOptions(host_ip="127.0.0.1").host_ip == "127.0.0.1"


def rank_slow_peer(rank, ws, delay_s):
    if rank == 1:
        time.sleep(delay_s)
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    return t


@O.mooncake_only
@pytest.mark.timeout(90)
def test_largest_timeout_waits_for_a_slow_peer():
    """MooncakeOptions(timeout=1e9), the largest taken, is within the backend's deadline
    range: it waits for a peer that comes 2 s late and the all_reduce sums right."""
    pool = RankPool(2, "mooncake", "shm", op_timeout=10.0, options={"timeout": 1e9})
    try:
        res = pool.run(rank_slow_peer, 2.0, timeout=60)
    finally:
        pool.close(graceful=False)
    for r in range(2):
        assert torch.equal(res[r], torch.full((4,), 3.0)), (r, res[r])


# ========================================== seats and timeouts of the membership calls


@O.mooncake_only
@pytest.mark.parametrize("op", ["recover_ranks", "deactivate_ranks"])
@pytest.mark.parametrize("ranks", [[1.0], [True], "1", 1, [0, None]])
def test_membership_calls_take_int_seats(op, ranks):
    """recover_ranks / deactivate_ranks take a sequence of int seats; a float (which int()
    would truncate to a seat), a bool, a string or a non-sequence raises ValueError naming
    the call and its argument before any group is looked at (none exists here)."""
    import mooncake_pg

    with pytest.raises(
        ValueError, match=rf"^{op}: ranks must be a sequence of int seat numbers, got "
    ):
        getattr(mooncake_pg, op)(None, ranks)


@O.mooncake_only
@pytest.mark.parametrize("timeout", [0, -1.0, float("inf"), float("nan"), 1e10, "60", True])
def test_join_group_timeout_must_be_seconds(timeout):
    """join_group(timeout=) must be a number of seconds in (0, 1e9]: an infinite or huge
    one would overflow the backend's int64-nanosecond deadline."""
    import mooncake_pg

    with pytest.raises(ValueError, match=r"^join_group: timeout must be seconds in \(0, 1e\+09\]"):
        mooncake_pg.join_group(None, timeout=timeout)


# ========================================== boolean MOONCAKE_* variables, one parser


@O.mooncake_only
@pytest.mark.parametrize(
    "var, key, default",
    [
        ("MOONCAKE_DEBUG", "debug", False),
        ("MOONCAKE_IS_RECOVERY", "is_recovery", False),
        ("MOONCAKE_CUDA_IPC", "cuda_ipc", True),
        ("MOONCAKE_EP_FP32_ACCUMULATE", "fp32_accumulate", True),
    ],
)
def test_boolean_env_variables_parse_alike(monkeypatch, var, key, default):
    """Every boolean variable of the process group and of mooncake_ep takes the same
    words in any case (1/true/yes/on, 0/false/no/off); junk raises naming the variable
    instead of counting as "on"."""
    import mooncake_ep.config
    import mooncake_pg

    read = (
        mooncake_ep.config.env_defaults
        if var.startswith("MOONCAKE_EP_")
        else mooncake_pg.config.env_defaults
    )
    monkeypatch.delenv(var, raising=False)
    assert read()[key] is default
    for raw, want in [("", default), ("1", True), ("TRUE", True), ("Yes", True), ("on", True)] + [
        ("0", False),
        ("FALSE", False),
        ("no", False),
        ("Off", False),
    ]:
        monkeypatch.setenv(var, raw)
        assert read()[key] is want, (var, raw)
    monkeypatch.setenv(var, "sometimes")
    with pytest.raises(ValueError, match=f"{var} must be 0 or 1, got 'sometimes'"):
        read()
