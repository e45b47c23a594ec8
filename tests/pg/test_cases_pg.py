"""Cases PG-1, PG-2, PG-4, PG-5 and PG-7 of shared/cases/CASES.md ("Process group").

Each test names its case id; every rank holds rank-dependent data. Runs on the backend
under test (first entry of ``MOONCAKE_TEST_BACKENDS``, default ``mooncake``).
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests.rankpool import default_backend, get_pool

pytestmark = pytest.mark.timeout(180)

BACKEND, TRANSPORT = default_backend()
OP_TIMEOUT = 30.0  # the pools' op timeout (MooncakeOptions.timeout / gloo's timeout)


def pool(ws, **kw):
    return get_pool(ws, BACKEND, TRANSPORT, **kw)


# ------------------------------------------------------------------------- PG-1

PG1_DTYPES = ["int32", "float32", "bfloat16"]


def rank_pg1(rank, ws):
    torch.set_num_threads(1)
    out = {}
    i = torch.arange(1000)
    for name in PG1_DTYPES:
        d = getattr(torch, name)
        for op in ("SUM", "MIN", "MAX"):
            t = torch.tensor([10 + rank], dtype=d)
            dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
            out[(name, op, "scalar")] = t
            v = ((7 * i + 13 * rank) % 101).to(d)
            dist.all_reduce(v, op=getattr(dist.ReduceOp, op))
            out[(name, op, "vector")] = v
        t = torch.tensor([(rank % 3) + 1], dtype=d)
        dist.all_reduce(t, op=dist.ReduceOp.PRODUCT)
        out[(name, "PRODUCT", "scalar")] = t
        v = torch.full((1000,), (rank % 3) + 1, dtype=d)
        dist.all_reduce(v, op=dist.ReduceOp.PRODUCT)
        out[(name, "PRODUCT", "vector")] = v
        v = (((i + rank) % 3) + 1).to(d)  # element-dependent variant
        dist.all_reduce(v, op=dist.ReduceOp.PRODUCT)
        out[(name, "PRODUCT", "vector-shifted")] = v
    return out


def pg1_expected(ws, name, op, shape):
    d = getattr(torch, name)
    i = torch.arange(1000)
    if shape == "scalar":
        vals = [
            torch.tensor([10 + r], dtype=torch.float64)
            if op != "PRODUCT"
            else torch.tensor([(r % 3) + 1], dtype=torch.float64)
            for r in range(ws)
        ]
    elif op == "PRODUCT" and shape == "vector":
        vals = [torch.full((1000,), (r % 3) + 1, dtype=torch.float64) for r in range(ws)]
    elif op == "PRODUCT":
        vals = [(((i + r) % 3) + 1).to(torch.float64) for r in range(ws)]
    else:
        vals = [((7 * i + 13 * r) % 101).to(torch.float64) for r in range(ws)]
    a = torch.stack(vals)
    r = {"SUM": a.sum(0), "MIN": a.min(0).values, "MAX": a.max(0).values, "PRODUCT": a.prod(0)}[op]
    return r.to(d)  # exact integer result, rounded once to the dtype


def _bf16_ulp(t):
    e = torch.floor(torch.log2(t.double().abs().clamp(min=1.0)))
    return torch.pow(2.0, e - 7)


@pytest.mark.parametrize("ws", [4, 8])
def test_pg1_reduce_ops_pick_the_right_rank(ws):
    """PG-1: each rank holds 10+rank (int32, float32, bfloat16; 1 element), then 1000
    elements (7*i + 13*rank) % 101; all_reduce SUM/MIN/MAX equal the Python reference
    element by element (MAX = 10+W-1, MIN = 10, SUM = 10W + W(W-1)/2); PRODUCT of
    (rank % 3) + 1 is exact in every dtype.

    bfloat16 SUM of the 1000-element tensor: sums up to 800 are not all representable in
    bfloat16 (8 significant bits), so a backend that accumulates in bfloat16 (gloo does)
    rounds at every step: allowed two bfloat16 ulps there (taking another rank's value
    shifts a sum by >= 10, more than two ulps). Everything else must be exact."""
    res = pool(ws).run(rank_pg1, timeout=120)
    assert res[0][("int32", "MAX", "scalar")].item() == 10 + ws - 1
    assert res[0][("int32", "MIN", "scalar")].item() == 10
    assert res[0][("int32", "SUM", "scalar")].item() == 10 * ws + ws * (ws - 1) // 2
    failures = []
    for r in range(ws):
        for key, got in res[r].items():
            name, op, shape = key
            exp = pg1_expected(ws, name, op, shape)
            if name == "bfloat16" and op == "SUM" and shape == "vector":
                ok = got.dtype == exp.dtype and bool(
                    ((got.double() - exp.double()).abs() <= 2 * _bf16_ulp(exp)).all()
                )
            else:
                ok = got.dtype == exp.dtype and torch.equal(got, exp)
            if not ok:
                bad = (got.double() != exp.double()).nonzero().reshape(-1)[:5].tolist()
                failures.append(
                    f"PG-1 W={ws} rank {r} {name} {op} {shape}: at {bad} got "
                    f"{[got.reshape(-1)[k].item() for k in bad]} expected "
                    f"{[exp.reshape(-1)[k].item() for k in bad]}"
                )
    assert not failures, "\n".join(failures)


# ------------------------------------------------------------------------- PG-2


def rank_pg2(rank, ws):
    """Times are CLOCK_MONOTONIC, which all processes of the host share: ranks 0 and 1
    are compared with the moment rank 2 entered its barrier, so a rank that was slow to
    leave the previous barrier does not make the check flaky."""
    torch.set_num_threads(1)
    out = {}
    # Part 1: rank 2 sleeps 2 s before barrier(); ranks 0 and 1 must block meanwhile.
    dist.barrier()
    out["start"] = time.monotonic()
    if rank == 2:
        time.sleep(2.0)
        out["enter"] = time.monotonic()
    dist.barrier()
    out["exit"] = time.monotonic()

    # Part 2: barrier(async_op=True) on rank 0, waited with a 0.5 s timeout while rank 2
    # sleeps: must not report success.
    dist.barrier()
    if rank == 2:
        out["start2"] = time.monotonic()
        time.sleep(2.0)
        out["enter2"] = time.monotonic()
        dist.barrier()
    elif rank == 1:
        dist.barrier()
    else:
        w = dist.barrier(async_op=True)
        t1 = time.monotonic()
        try:
            r = w.wait(timeout=timedelta(seconds=0.5))
            out["timed_wait"] = ("returned", bool(r))
        except Exception as e:
            out["timed_wait"] = ("raised", f"{type(e).__name__}: {e}")
        out["timed_wait_end"] = time.monotonic()
        out["timed_wait_s"] = out["timed_wait_end"] - t1
        out["completed_after_timed_wait"] = w.is_completed()
        # the op goes on: it completes once rank 2 arrives
        try:
            out["final_wait"] = ("returned", bool(w.wait()))
        except Exception as e:
            out["final_wait"] = ("raised", f"{type(e).__name__}: {e}")
        out["final_exit"] = time.monotonic()
    # the group still works
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    out["after"] = t.item()
    return out


def test_pg2_barrier_waits():
    """PG-2: W=3; rank 2 sleeps 2 s before barrier(): ranks 0 and 1 block >= 1.8 s
    (counted from when rank 2 began to sleep; none leaves before rank 2 entered) and less
    than the op timeout. barrier(async_op=True) on rank 0 waited with a 0.5 s timeout
    while rank 2 sleeps does not report success (it raises a timeout error or returns
    False, and the work is not completed); the barrier then completes when rank 2
    arrives, and the group goes on (no "zero bytes, done locally" shortcut)."""
    res = pool(3).run(rank_pg2, timeout=60)
    r2 = res[2]
    for r in (0, 1):
        blocked = res[r]["exit"] - r2["start"]
        assert blocked >= 1.8, (
            f"PG-2: rank {r} left the barrier {blocked:.2f} s after rank 2 began to sleep"
        )
        assert res[r]["exit"] >= r2["enter"], (
            f"PG-2: rank {r} left the barrier before rank 2 entered it"
        )
        assert res[r]["exit"] - res[r]["start"] < OP_TIMEOUT, res[r]
    r0 = res[0]
    assert r0["timed_wait"] != ("returned", True), f"PG-2: timed wait reported success: {r0}"
    assert r0["timed_wait_end"] < r2["enter2"], (
        f"PG-2: wait(timeout=0.5 s) only ended after rank 2 arrived ({r0['timed_wait_s']:.2f} s)"
    )
    assert r0["timed_wait_s"] < 1.8, f"PG-2: wait(timeout=0.5 s) took {r0['timed_wait_s']:.2f} s"
    assert r0["completed_after_timed_wait"] is False, r0
    assert r0["final_wait"] == ("returned", True), r0
    assert r0["final_exit"] >= r2["enter2"], (
        "PG-2: the async barrier completed before rank 2 arrived"
    )
    assert [x["after"] for x in res] == [6.0, 6.0, 6.0]


# ------------------------------------------------------------------------- PG-4


def _pg4_rows(src, nrows, width=4):
    # row j of rank src: arange(width) + 100*src + 10*j
    return (
        torch.arange(width).repeat(nrows, 1) + 100 * src + 10 * torch.arange(nrows).unsqueeze(1)
    ).to(torch.float32)


def rank_pg4_uneven(rank, ws, S):
    torch.set_num_threads(1)
    x = _pg4_rows(rank, sum(S[rank]))
    out = torch.full((sum(S[s][rank] for s in range(ws)), 4), -7.0)
    dist.all_to_all_single(
        out, x, output_split_sizes=[S[s][rank] for s in range(ws)], input_split_sizes=list(S[rank])
    )
    return out


def pg4_expected(ws, S, rank):
    parts = []
    for s in range(ws):
        off = sum(S[s][:rank])
        parts.append(_pg4_rows(s, sum(S[s]))[off : off + S[s][rank]])
    return torch.cat(parts)


@pytest.mark.parametrize(
    "ws,S",
    [
        (3, [[3, 2, 1], [2, 2, 2], [1, 2, 3]]),
        (2, [[1, 2], [0, 0]]),  # rank 1 has 0 input rows; receive splits of 0
    ],
    ids=["W3", "W2-empty-rank"],
)
def test_pg4_uneven_all_to_all_single(ws, S):
    """PG-4: W=3, rows of width 4, input splits [3,2,1], [2,2,2], [1,2,3] (output splits
    are the transpose); W=2 where rank 1 has 0 input rows and some receive splits are 0.
    Rows arrive in source-rank order."""
    res = pool(ws).run(rank_pg4_uneven, S, timeout=60)
    for r in range(ws):
        exp = pg4_expected(ws, S, r)
        assert res[r].shape == exp.shape and torch.equal(res[r], exp), (
            f"PG-4 W={ws} rank {r}: got {res[r].tolist()} expected {exp.tolist()}"
        )


def rank_pg4_bad_splits(rank, ws, which):
    torch.set_num_threads(1)
    S = [[3, 2, 1], [2, 2, 2], [1, 2, 3]]
    res = None
    if rank == 1:  # only the caller with bad splits calls: it must fail on its own
        x = _pg4_rows(rank, 6)
        out = torch.full((6, 4), -7.0)
        ins, outs = [2, 2, 2], [S[s][rank] for s in range(ws)]
        if which == "input":
            ins = [2, 2, 1]  # sums to 5, input has 6 rows
        else:
            outs = [2, 2, 3]  # sums to 7, output has 6 rows
        t0 = time.monotonic()
        try:
            dist.all_to_all_single(out, x, output_split_sizes=outs, input_split_sizes=ins)
            res = ("no error", None, time.monotonic() - t0)
        except Exception as e:
            res = (type(e).__name__, str(e), time.monotonic() - t0)
        res = res + (bool((out == -7.0).all()),)
    # then a correct uneven all_to_all_single on everyone (no counter drifted)
    good = rank_pg4_uneven(rank, ws, S)
    return res, good


@pytest.mark.parametrize("which", ["input", "output"])
def test_pg4_split_sum_mismatch_raises_on_caller(which):
    """PG-4: splits whose sum differs from input.size(0) (or output.size(0)) raise a clear
    error on the caller before any traffic: rank 1 alone calls with bad splits and gets
    the error at once (no peer takes part), its output stays untouched, and the next
    all_to_all_single on all ranks is right."""
    if BACKEND == "gloo":
        pytest.skip("gloo's collective counter drifts after a rejected call (the next op hangs)")
    S = [[3, 2, 1], [2, 2, 2], [1, 2, 3]]
    res = pool(3).run(rank_pg4_bad_splits, which, timeout=60)
    err = res[1][0]
    assert err[0] in ("ValueError", "RuntimeError"), f"PG-4: expected an error, got {err}"
    msg = err[1].lower()
    assert "split" in msg or "size" in msg, f"PG-4: unclear message: {err[1]!r}"
    assert err[2] < 1.0, f"PG-4: the error took {err[2]:.2f} s (waited for peers?)"
    assert err[3], "PG-4: the output buffer was modified"
    for r in range(3):
        assert torch.equal(res[r][1], pg4_expected(3, S, r)), f"PG-4 follow-up, rank {r}"


# ------------------------------------------------------------------------- PG-5


def rank_pg5(rank, ws):
    torch.set_num_threads(1)
    out = {}
    peer = rank ^ 1
    for name, shape in (("float32", (1, 0, 2)), ("bfloat16", (0,))):
        d = getattr(torch, name)
        x = torch.empty(shape, dtype=d)
        dist.all_reduce(x)
        out[(name, "all_reduce")] = tuple(x.shape)
        lst = [torch.empty(shape, dtype=d) for _ in range(ws)]
        dist.all_gather(lst, x)
        out[(name, "all_gather")] = [tuple(t.shape) for t in lst]
        o = torch.empty((ws * shape[0],) + tuple(shape[1:]), dtype=d)
        dist.all_gather_single(o, x)
        out[(name, "all_gather_into_tensor")] = tuple(o.shape)
        i = torch.empty((ws * shape[0],) + tuple(shape[1:]), dtype=d)
        o2 = torch.empty(shape, dtype=d)
        dist.reduce_scatter_single(o2, i)
        out[(name, "reduce_scatter_tensor")] = tuple(o2.shape)
        b = torch.empty(shape, dtype=d)
        dist.broadcast(b, src=ws - 1)
        out[(name, "broadcast")] = tuple(b.shape)
        # all splits 0 needs dim 0 of size 0: (1,0,2) becomes (0,0,2) here
        a_shape = (0,) + tuple(shape[1:])
        a_in, a_out = torch.empty(a_shape, dtype=d), torch.empty(a_shape, dtype=d)
        dist.all_to_all_single(a_out, a_in, output_split_sizes=[0] * ws, input_split_sizes=[0] * ws)
        out[(name, "all_to_all_single")] = tuple(a_out.shape)
        s, rcv = torch.empty(shape, dtype=d), torch.empty(shape, dtype=d)
        if rank % 2 == 0:
            dist.send(s, dst=peer)
            dist.recv(rcv, src=peer)
        else:
            dist.recv(rcv, src=peer)
            dist.send(s, dst=peer)
        out[(name, "send/recv")] = tuple(rcv.shape)
    # normal collectives right after: no counter drifted
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    out["after_all_reduce"] = t.item()
    lst = [torch.zeros(3) for _ in range(ws)]
    dist.all_gather(lst, torch.arange(3.0) + 100 * rank)
    out["after_all_gather"] = torch.stack(lst)
    b = torch.arange(4.0) + 10 * rank
    dist.broadcast(b, src=1)
    out["after_broadcast"] = b
    y = torch.zeros(5)
    if rank % 2 == 0:
        dist.send(torch.arange(5.0) + rank, dst=peer)
        dist.recv(y, src=peer)
    else:
        dist.recv(y, src=peer)
        dist.send(torch.arange(5.0) + rank, dst=peer)
    out["after_send_recv"] = y
    return out


def test_pg5_zero_element_tensors():
    """PG-5: W=4, shapes (1,0,2) float32 and (0,) bfloat16 through all_reduce, all_gather,
    all_gather_into_tensor, reduce_scatter_tensor, broadcast, all_to_all_single with all
    splits 0 (dim 0 must then be 0: the float32 tensor is (0,0,2) there) and send/recv: all
    return with shapes kept; then normal collectives (and
    send/recv) still give the right answers."""
    ws = 4
    res = pool(ws).run(rank_pg5, timeout=60)
    for r in range(ws):
        o = res[r]
        for name, shape in (("float32", (1, 0, 2)), ("bfloat16", (0,))):
            big = (ws * shape[0],) + tuple(shape[1:])
            assert o[(name, "all_reduce")] == shape
            assert o[(name, "all_gather")] == [shape] * ws
            assert o[(name, "all_gather_into_tensor")] == big
            assert o[(name, "reduce_scatter_tensor")] == shape
            assert o[(name, "broadcast")] == shape
            assert o[(name, "all_to_all_single")] == (0,) + tuple(shape[1:])
            assert o[(name, "send/recv")] == shape
        assert o["after_all_reduce"] == 10.0, (r, o["after_all_reduce"])
        assert torch.equal(
            o["after_all_gather"], torch.stack([torch.arange(3.0) + 100 * k for k in range(ws)])
        )
        assert torch.equal(o["after_broadcast"], torch.arange(4.0) + 10)
        assert torch.equal(o["after_send_recv"], torch.arange(5.0) + (r ^ 1))


# ------------------------------------------------------------------------- PG-7


def rank_pg7(rank, ws):
    torch.set_num_threads(1)
    out = {}
    t = torch.full((1024,), rank + 0.5, dtype=torch.bfloat16)
    dist.all_reduce(t)
    out["bf16_sum"] = t
    for op in ("SUM", "MAX", "MIN"):
        b = torch.tensor([rank == 2] * 3)
        dist.all_reduce(b, op=getattr(dist.ReduceOp, op))
        out[("bool", op)] = b
    f = torch.tensor([rank + 1.0] * 5)
    dist.all_reduce(f, op=dist.ReduceOp.AVG)
    out["f32_avg"] = f
    iv = torch.tensor(
        [rank + 1, -(rank + 1), 10 * rank - 7, -7 if rank == 0 else 0, 3], dtype=torch.int32
    )
    try:
        dist.all_reduce(iv, op=dist.ReduceOp.AVG)
        out["i32_avg"] = ("ok", iv)
    except Exception as e:
        out["i32_avg"] = ("raised", f"{type(e).__name__}: {e}")
    c = torch.tensor([complex(rank + 1, -rank), complex(0.5 * rank, 2)] * 4, dtype=torch.complex64)
    dist.all_reduce(c)
    out["c64_sum"] = c
    cm = torch.tensor([complex(rank, 1)], dtype=torch.complex64)
    try:
        dist.all_reduce(cm, op=dist.ReduceOp.MAX)
        out["c64_max"] = ("ok", cm)
    except Exception as e:
        out["c64_max"] = ("raised", type(e).__name__, str(e))
    # straight to the backend (torch's own check skipped): must raise too, not reduce
    cm2 = torch.tensor([complex(rank, 1)], dtype=torch.complex64)
    try:
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        dist.group.WORLD.allreduce([cm2], opts).wait()
        out["c64_max_direct"] = ("ok", cm2)
    except Exception as e:
        out["c64_max_direct"] = ("raised", type(e).__name__, str(e))
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    out["after"] = t.item()
    return out


def test_pg7_dtype_and_op_matrix():
    """PG-7: W=4. bf16 SUM of rank+0.5 (1024 elements) = 8.0; bool SUM, MAX, MIN where
    only rank 2 holds True = True, True, False; float32 AVG of rank+1 = 2.5; complex64 SUM
    right; complex MAX a clear error (torch's ValueError naming complex, and a direct
    backend call raises as well instead of reducing).

    int32 AVG: the choice is the truncated mean (C integer division, toward zero):
    sums 10, -10, 32, -7, 12 over 4 ranks give 2, -2, 8, -1, 3 (floor would give -3 and
    -2 for the negative ones)."""
    res = pool(4).run(rank_pg7, timeout=60)
    for r, o in enumerate(res):
        assert torch.equal(o["bf16_sum"], torch.full((1024,), 8.0, dtype=torch.bfloat16)), (
            r,
            o["bf16_sum"][:4],
        )
        assert o[("bool", "SUM")].tolist() == [True] * 3, (r, o[("bool", "SUM")])
        assert o[("bool", "MAX")].tolist() == [True] * 3, (r, o[("bool", "MAX")])
        assert o[("bool", "MIN")].tolist() == [False] * 3, (r, o[("bool", "MIN")])
        assert o[("bool", "SUM")].dtype == torch.bool
        assert torch.equal(o["f32_avg"], torch.full((5,), 2.5)), (r, o["f32_avg"])
        status, val = o["i32_avg"][0], o["i32_avg"][1]
        assert status == "ok", f"PG-7 rank {r}: int32 AVG must be the truncated mean, raised {val}"
        assert val.dtype == torch.int32 and val.tolist() == [2, -2, 8, -1, 3], (r, val)
        exp_c = torch.tensor([complex(10, -6), complex(3, 8)] * 4, dtype=torch.complex64)
        assert torch.equal(o["c64_sum"], exp_c), (r, o["c64_sum"])
        assert o["c64_max"][0] == "raised" and o["c64_max"][1] == "ValueError", (r, o["c64_max"])
        assert "complex" in o["c64_max"][2].lower(), o["c64_max"]
        assert o["c64_max_direct"][0] == "raised", (
            f"PG-7 rank {r}: the backend reduced complex MAX instead of raising: {o['c64_max_direct']}"
        )
        assert o["after"] == 10.0


def rank_nan_min_max(rank, ws):
    torch.set_num_threads(1)
    out = {}
    for name in ("float32", "float64", "bfloat16", "float16"):
        d = getattr(torch, name)
        for op in ("MIN", "MAX"):
            for n in (8, 40000):  # the one-round path and the pipelined one
                t = ((torch.arange(n) * 7 + rank * 13) % 101).to(d)
                t[rank] = float("nan")  # each rank's NaN at its own position
                dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
                out[(name, op, n)] = t
    return out


def test_min_max_propagate_nan():
    """MIN and MAX with a NaN in one rank's element give NaN there, as torch.minimum /
    torch.maximum over the ranks' tensors do (each rank has its NaN at another position);
    every other element is the exact minimum / maximum."""
    ws = 4
    res = pool(ws).run(rank_nan_min_max, timeout=60)
    for (name, op, n), got in res[0].items():
        d = getattr(torch, name)
        ins = []
        for r in range(ws):
            t = ((torch.arange(n) * 7 + r * 13) % 101).to(d)
            t[r] = float("nan")
            ins.append(t)
        want = ins[0]
        for t in ins[1:]:
            want = torch.minimum(want, t) if op == "MIN" else torch.maximum(want, t)
        assert torch.equal(got.isnan(), want.isnan()), (name, op, n)
        assert torch.equal(got[~want.isnan()], want[~want.isnan()]), (name, op, n)
        for r in range(1, ws):
            assert torch.equal(res[r][(name, op, n)].isnan(), want.isnan()), (r, name, op, n)
