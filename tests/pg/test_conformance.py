"""Conformance of the "mooncake" backend, driven by the API map of docs/design.md.

Every op runs through the public ``torch.distributed`` API on the backend under test and
on gloo with the same rank-dependent inputs (``pgutil.make``: never equal across ranks),
world sizes 1..4, and the results are compared exactly (floats within dtype tolerance).
Where gloo cannot serve as reference (PREMUL_SUM, float8, int16, uint16/32/64, integer
AVG = truncated mean, complex gather, uneven all_to_all, stacked all_gather_single output,
non-contiguous tensors: gloo ignores strides or rejects them) the reference is
computed independently in the test process (``pgutil.reduce_ref`` and the ``ref_*``
functions below); ``test_reference_matches_gloo`` checks those independent references
against gloo wherever gloo does serve, so both references agree.

Many dtype/op combinations go through one pool round-trip: the rank function
``rank_run_cases`` runs a batch of cases and returns per-case results (or the exception
text of a case that raised, so one failing dtype does not hide the others).

Backend under test: ``MOONCAKE_TEST_BACKENDS`` (default ``mooncake``; e.g.
``mooncake:shm,mooncake:tcp`` runs both transports, ``gloo`` develops the tests without
the extension -- cases gloo cannot run are then left out).
"""

from __future__ import annotations

import os
import re
import warnings

import pytest
import torch
import torch.distributed as dist

from tests import REPO_ROOT
from tests.pg import pgutil as P
from tests.rankpool import backend_id, get_pool, parse_backends

# the default run covers every op at world sizes 1 and 3 (odd, over both transports)
pytestmark = [pytest.mark.timeout(240), pytest.mark.slow(unless={"ws": [1, 3]})]

# --------------------------------------------------------------------------- API map
# docs/design.md "torch 2.13 API -> Backend method": each Python API, the Backend method it
# reaches, and the rank-op (below) that exercises it through the public API.
API_MAP = [
    ("all_reduce", "allreduce", "all_reduce"),
    ("all_reduce_coalesced", "allreduce_coalesced", "all_reduce_coalesced"),
    ("all_reduce of a sparse COO tensor", "allreduce_sparse", "all_reduce_sparse"),
    ("_coalescing_manager + all_reduce", "allreduce_coalesced", "all_reduce_coalesced"),
    ("broadcast", "broadcast", "broadcast"),
    ("reduce", "reduce", "reduce"),
    ("gather", "gather", "gather"),
    ("scatter", "scatter", "scatter"),
    ("barrier", "barrier", "barrier"),
    ("all_gather", "allgather", "all_gather"),
    ("all_gather_coalesced", "allgather_coalesced", "all_gather_coalesced"),
    ("all_gather_single / all_gather_into_tensor", "_allgather_base", "all_gather_single"),
    (
        "_coalescing_manager + all_gather_single",
        "allgather_into_tensor_coalesced",
        "all_gather_single_coalesced",
    ),
    ("reduce_scatter", "reduce_scatter", "reduce_scatter"),
    (
        "reduce_scatter_single / reduce_scatter_tensor",
        "_reduce_scatter_base",
        "reduce_scatter_single",
    ),
    (
        "_coalescing_manager + reduce_scatter_single",
        "reduce_scatter_tensor_coalesced",
        "reduce_scatter_single_coalesced",
    ),
    ("all_to_all_single", "alltoall_base", "all_to_all_single"),
    ("all_to_all", "alltoall", "all_to_all"),
    ("send, recv", "send / recv", "send_recv"),
    ("recv without src", "recvAnysource", "recv_any_source"),
    ("isend / irecv", "send / recv", "isend_irecv"),
    (
        "batch_isend_irecv",
        "send / recv (start/endCoalescing if supportsCoalescing())",
        "batch_isend_irecv",
    ),
    ("dist.shrink_group", "supportsShrinking / shrink", "shrink_group"),
]

WORLD_SIZES = [1, 2, 3, 4]
BACKENDS = parse_backends()
RUN_TIMEOUT = 180


# ------------------------------------------------------------------- layouts


def base_shape(shape, layout):
    if layout == "transposed":
        return (shape[1], shape[0]) + tuple(shape[2:])
    if layout == "strided":
        return (2 * shape[0],) + tuple(shape[1:])
    return tuple(shape)


def view_of(base, layout):
    """The (possibly non-contiguous) view the op is given."""
    if layout == "transposed":
        return base.transpose(0, 1)
    if layout == "strided":
        return base[::2]
    return base


def build(name, rank, shape, layout="contig", kind="sum", salt=0):
    """(base, view): ``view`` holds the op's input, ``base`` is what we return/compare
    (for a strided view the gaps must stay untouched)."""
    base = P.make(name, rank, base_shape(shape, layout), kind, salt)
    return base, view_of(base, layout)


def empty_like_layout(name, shape, layout, fill=None):
    base = torch.zeros(base_shape(shape, layout), dtype=P.dt(name))
    if fill is not None:
        base.fill_(fill)
    return base, view_of(base, layout)


def _future_value(work):
    """The outputs the Work's future carries (DDP comm hooks rely on them)."""
    fut = work.get_future()
    return [t.clone() for t in fut.wait()]


# ------------------------------------------------------------------ rank side
# Each op_* runs one case on one rank and returns what the test compares.


def op_all_reduce(rank, ws, c):
    base, x = build(c["dtype"], rank, c["shape"], c.get("layout", "contig"), P.kind_for(c["op"]))
    if c.get("async"):
        w = dist.all_reduce(x, op=P.redop(c["op"], c["dtype"]), async_op=True)
        w.wait()
        return base, _future_value(w)
    dist.all_reduce(x, op=P.redop(c["op"], c["dtype"]))
    return base


def _coalesced_inputs(name, rank, kind):
    return [
        P.make(name, rank, (5,), kind, 0),
        P.make(name, rank, (3, 4), kind, 1),
        P.make(name, rank, (1,), kind, 2),
    ]


def op_all_reduce_coalesced(rank, ws, c):
    ts = _coalesced_inputs(c["dtype"], rank, P.kind_for(c["op"]))
    op = P.redop(c["op"], c["dtype"])
    api = c["api"]
    if api == "all_reduce_coalesced":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            dist.all_reduce_coalesced(ts, op=op)
    elif api == "cm":
        with dist._coalescing_manager():
            for t in ts:
                dist.all_reduce(t, op=op)
    elif api == "cm_async":
        with dist._coalescing_manager(async_ops=True) as cm:
            for t in ts:
                dist.all_reduce(t, op=op)
        cm.wait()
    else:
        raise ValueError(api)
    return ts


def op_broadcast(rank, ws, c):
    src = c["src"] % ws
    base, x = build(c["dtype"], rank, c["shape"], c.get("layout", "contig"), salt=3)
    if c.get("async"):
        w = dist.broadcast(x, src=src, async_op=True)
        w.wait()
        return base, _future_value(w)
    dist.broadcast(x, src=src)
    return base


def op_reduce(rank, ws, c):
    dst = c["dst"] % ws
    x = P.make(c["dtype"], rank, c["shape"], P.kind_for(c["op"]), 4)
    dist.reduce(x, dst=dst, op=P.redop(c["op"], c["dtype"]))
    return x if rank == dst else None


def op_gather(rank, ws, c):
    dst = c["dst"] % ws
    x = P.make(c["dtype"], rank, c["shape"], salt=5)
    out = (
        [torch.zeros(c["shape"], dtype=P.dt(c["dtype"])) for _ in range(ws)]
        if rank == dst
        else None
    )
    dist.gather(x, out, dst=dst)
    return out if rank == dst else None


def op_scatter(rank, ws, c):
    src = c["src"] % ws
    out = torch.zeros(c["shape"], dtype=P.dt(c["dtype"]))
    pieces = (
        [P.make(c["dtype"], j, c["shape"], salt=6 + src) for j in range(ws)]
        if rank == src
        else None
    )
    dist.scatter(out, pieces, src=src)
    return out


def op_barrier(rank, ws, c):
    dist.barrier()
    w = dist.barrier(async_op=True)
    w.wait()
    t = torch.tensor([rank + 1], dtype=torch.int64)
    dist.all_reduce(t)
    return t


def op_all_gather(rank, ws, c):
    _, x = build(c["dtype"], rank, c["shape"], c.get("layout", "contig"), salt=7)
    out = [torch.zeros(c["shape"], dtype=P.dt(c["dtype"])) for _ in range(ws)]
    if c.get("async"):
        w = dist.all_gather(out, x, async_op=True)
        w.wait()
        return out
    dist.all_gather(out, x)
    return out


def _gc_shapes(c):
    return [(5,), (0,), (2, 3)] if c.get("with_empty") else [(5,), (3, 4), (1,)]


def op_all_gather_coalesced(rank, ws, c):
    """torch's layout: out[r][i] receives rank r's i-th input."""
    ins = [P.make(c["dtype"], rank, s, salt=20 + i) for i, s in enumerate(_gc_shapes(c))]
    out = [[torch.zeros_like(t) for t in ins] for _ in range(ws)]
    if c.get("async"):
        fut = dist.all_gather_coalesced(out, ins, async_op=True)
        fut.wait()
    else:
        dist.all_gather_coalesced(out, ins)
    return out


def _sparse_input(rank, c):
    """A coalesced-or-not COO tensor of this rank: nnz depends on the rank (rank 0 may
    have none), indices repeat within a rank when ``dup``; hybrid: 1 sparse + 1 dense dim."""
    g = torch.Generator().manual_seed(1000 + rank)
    nnz = 0 if (c.get("empty_on_0") and rank == 0) or c.get("all_empty") else 3 + 2 * rank
    size = (6, 5)
    if c.get("hybrid"):
        idx = torch.randint(0, size[0], (1, nnz), generator=g)
        vals = P.make(c["dtype"], rank, (nnz, size[1]), salt=31)
    else:
        idx = torch.stack([torch.randint(0, n, (nnz,), generator=g) for n in size])
        vals = P.make(c["dtype"], rank, (nnz,), salt=31)
    if c.get("dup") and nnz:
        idx[:, -1] = idx[:, 0]
    return torch.sparse_coo_tensor(idx, vals, size, check_invariants=True)


def op_all_reduce_sparse(rank, ws, c):
    t = _sparse_input(rank, c)
    if c.get("async"):
        dist.all_reduce(t, async_op=True).wait()
    else:
        dist.all_reduce(t)
    return t.to_dense()


def op_all_gather_single(rank, ws, c):
    shape = tuple(c["shape"])
    _, x = build(c["dtype"], rank, shape, c.get("layout", "contig"), salt=8)
    if c.get("stacked"):
        out = torch.zeros((ws,) + shape, dtype=P.dt(c["dtype"]))
    else:
        out = torch.zeros((ws * shape[0],) + shape[1:], dtype=P.dt(c["dtype"]))
    if c.get("old_name"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            dist.all_gather_into_tensor(out, x)
    elif c.get("async"):
        w = dist.all_gather_single(out, x, async_op=True)
        w.wait()
    else:
        dist.all_gather_single(out, x)
    return out


_COALESCED_SHAPES = [(4,), (2, 3), (1,)]


def op_all_gather_single_coalesced(rank, ws, c):
    name = c["dtype"]
    ins = [P.make(name, rank, s, salt=9 + k) for k, s in enumerate(_COALESCED_SHAPES)]
    outs = [torch.zeros((ws * s[0],) + s[1:], dtype=P.dt(name)) for s in _COALESCED_SHAPES]
    with dist._coalescing_manager(async_ops=bool(c.get("async"))) as cm:
        for o, i in zip(outs, ins):
            dist.all_gather_single(o, i)
    if c.get("async"):
        cm.wait()
    return outs


def op_reduce_scatter(rank, ws, c):
    name, shape = c["dtype"], tuple(c["shape"])
    ins = [P.make(name, rank, shape, P.kind_for(c["op"]), 10 + j) for j in range(ws)]
    out = torch.zeros(shape, dtype=P.dt(name))
    dist.reduce_scatter(out, ins, op=P.redop(c["op"], c["dtype"]))
    return out


def op_reduce_scatter_single(rank, ws, c):
    name, shape, layout = c["dtype"], tuple(c["shape"]), c.get("layout", "contig")
    in_shape = (ws * shape[0],) + shape[1:]
    _, x = build(name, rank, in_shape, layout, P.kind_for(c["op"]), 11)
    out = torch.zeros(shape, dtype=P.dt(name))
    op = P.redop(c["op"], c["dtype"])
    if c.get("old_name"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            dist.reduce_scatter_tensor(out, x, op=op)
    elif c.get("async"):
        w = dist.reduce_scatter_single(out, x, op=op, async_op=True)
        w.wait()
    else:
        dist.reduce_scatter_single(out, x, op=op)
    return out


def op_reduce_scatter_single_coalesced(rank, ws, c):
    name = c["dtype"]
    kind = P.kind_for(c["op"])
    ins = [
        P.make(name, rank, (ws * s[0],) + s[1:], kind, 12 + k)
        for k, s in enumerate(_COALESCED_SHAPES)
    ]
    outs = [torch.zeros(s, dtype=P.dt(name)) for s in _COALESCED_SHAPES]
    with dist._coalescing_manager(async_ops=bool(c.get("async"))) as cm:
        for o, i in zip(outs, ins):
            dist.reduce_scatter_single(o, i, op=P.redop(c["op"], c["dtype"]))
    if c.get("async"):
        cm.wait()
    return outs


def split_matrix(ws, kind):
    """S[s][d]: rows rank s sends to rank d."""
    if kind == "even":
        return [[2] * ws for _ in range(ws)]
    if kind == "zero":
        return [[0] * ws for _ in range(ws)]
    return [[(s + 2 * d + 1) % 3 for d in range(ws)] for s in range(ws)]


def op_all_to_all_single(rank, ws, c):
    name, cols, layout = c["dtype"], c.get("cols", 3), c.get("layout", "contig")
    S = split_matrix(ws, c["splits"])
    rows_in = sum(S[rank])
    rows_out = sum(S[s][rank] for s in range(ws))
    _, x = build(name, rank, (rows_in, cols), layout, salt=13)
    out = torch.zeros((rows_out, cols), dtype=P.dt(name))
    if c["splits"] == "even" and not c.get("explicit"):
        kw = {}
    else:
        kw = dict(output_split_sizes=[S[s][rank] for s in range(ws)], input_split_sizes=S[rank])
    if c.get("async"):
        w = dist.all_to_all_single(out, x, async_op=True, **kw)
        w.wait()
    else:
        dist.all_to_all_single(out, x, **kw)
    return out


def op_all_to_all(rank, ws, c):
    name = c["dtype"]
    S = split_matrix(ws, c["splits"])
    ins = [P.make(name, rank, (S[rank][d], 2), salt=14 + d) for d in range(ws)]
    outs = [torch.zeros((S[s][rank], 2), dtype=P.dt(name)) for s in range(ws)]
    dist.all_to_all(outs, ins)
    return outs


def _partner(rank, ws):
    p = rank ^ 1
    return p if p < ws else None


def op_send_recv(rank, ws, c):
    name, shape, layout = c["dtype"], tuple(c["shape"]), c.get("layout", "contig")
    peer = _partner(rank, ws)
    if peer is None:
        return None
    _, x = build(name, rank, shape, layout, salt=15)
    _rbase, y = empty_like_layout(name, shape, layout)
    if rank % 2 == 0:
        dist.send(x, dst=peer)
        dist.recv(y, src=peer)
    else:
        dist.recv(y, src=peer)
        dist.send(x, dst=peer)
    return y.contiguous()


def op_recv_any_source(rank, ws, c):
    name, shape = c["dtype"], tuple(c["shape"])
    if rank != 0:
        dist.send(P.make(name, rank, shape, salt=16), dst=0)
        _p2p_case_end(rank, ws)
        return None
    got = []
    for _ in range(ws - 1):
        y = torch.zeros(shape, dtype=P.dt(name))
        src = dist.recv(y)
        got.append((src, y))
    _p2p_case_end(rank, ws)
    got.sort(key=lambda p: p[0])
    return got


def _p2p_case_end(rank, ws):
    # Senders must not run ahead into the next case while a receiver still waits for
    # this one (recv without src would match the next case's message).
    dist.barrier()


def op_isend_irecv(rank, ws, c):
    name, shape = c["dtype"], tuple(c["shape"])
    nxt, prv = (rank + 1) % ws, (rank - 1) % ws
    y = torch.zeros(shape, dtype=P.dt(name))
    rw = dist.irecv(y, src=prv)
    sw = dist.isend(P.make(name, rank, shape, salt=17), dst=nxt)
    sw.wait()
    rw.wait()
    return y


def op_batch_isend_irecv(rank, ws, c):
    name, shape = c["dtype"], tuple(c["shape"])
    nxt, prv = (rank + 1) % ws, (rank - 1) % ws
    from_prev = torch.zeros(shape, dtype=P.dt(name))
    from_next = torch.zeros(shape, dtype=P.dt(name))
    ops = [
        dist.P2POp(dist.isend, P.make(name, rank, shape, salt=18), nxt),
        dist.P2POp(dist.isend, P.make(name, rank, shape, salt=19), prv),
        dist.P2POp(dist.irecv, from_prev, prv),
        dist.P2POp(dist.irecv, from_next, nxt),
    ]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    return [from_prev, from_next]


def op_shrink_group(rank, ws, c):
    """If the backend says it supports shrinking, shrink a subgroup by the last rank and
    all_reduce on the result; if not, torch must refuse with TypeError."""
    g = dist.new_group(list(range(ws)))
    try:
        be = g._get_backend(torch.device("cpu"))
        supported = bool(getattr(be, "supports_shrinking", False))
        if not supported:
            if rank == 0:
                try:
                    dist.shrink_group([ws - 1], group=g)
                except TypeError:
                    return ("unsupported", "TypeError")
                return ("unsupported", "no error")
            return ("unsupported", "TypeError")
        if rank == ws - 1:
            return ("shrunk", None)
        ng = dist.shrink_group([ws - 1], group=g)
        t = torch.tensor([rank + 1], dtype=torch.int64)
        dist.all_reduce(t, group=ng)
        res = ("shrunk", int(t.item()))
        dist.destroy_process_group(ng)
        return res
    finally:
        dist.barrier()
        try:
            dist.destroy_process_group(g)
        except Exception:
            pass


OPS = {k[len("op_") :]: v for k, v in dict(globals()).items() if k.startswith("op_")}


def rank_run_cases(rank, ws, opname, cases):
    """Runs a batch of cases of one op; per case ("ok", result) or ("err", text).

    With ``MOONCAKE_TEST_DEVICE=cuda`` (tests/device/gpu_checks.py sets it) the cases of
    the ``mooncake`` backend run on CUDA tensors: tensors are made on the GPU (torch's
    default device) and results come back as CPU tensors, so the references stay as they
    are."""
    torch.set_num_threads(1)
    fn = OPS[opname]
    device = P.test_device() if dist.get_backend() == "mooncake" else "cpu"
    out = []
    for c in cases:
        try:
            if device == "cpu":
                out.append(("ok", fn(rank, ws, c)))
            else:
                with torch.device(device):
                    res = fn(rank, ws, c)
                torch.cuda.synchronize()
                out.append(("ok", P.to_cpu(res)))
        except Exception as e:
            out.append(("err", f"{type(e).__name__}: {e}"))
    return out


# ------------------------------------------------------------- independent references
# ref_*(ws, c) -> list of expected per-rank results (None: unspecified on that rank).


def _reduce_views(name, op, ws, shape, layout, salt):
    views = [build(name, r, shape, layout, P.kind_for(op), salt)[1] for r in range(ws)]
    return P.reduce_ref(name, op, [v.contiguous() for v in views], ws)


def _with_view(name, rank, shape, layout, kind, salt, value):
    base, _v = build(name, rank, shape, layout, kind, salt)
    base = base.clone()
    view_of(base, layout).copy_(value)
    return base


def ref_all_reduce(ws, c):
    name, op, layout, shape = c["dtype"], c["op"], c.get("layout", "contig"), tuple(c["shape"])
    red = _reduce_views(name, op, ws, shape, layout, 0)
    out = []
    for r in range(ws):
        base = _with_view(name, r, shape, layout, P.kind_for(op), 0, red)
        if c.get("async"):
            out.append((base, [view_of(base, layout).contiguous()]))
        else:
            out.append(base)
    return out


def ref_all_reduce_coalesced(ws, c):
    kind = P.kind_for(c["op"])
    per_rank = [_coalesced_inputs(c["dtype"], r, kind) for r in range(ws)]
    red = [
        P.reduce_ref(c["dtype"], c["op"], [per_rank[r][k] for r in range(ws)], ws)
        for k in range(len(per_rank[0]))
    ]
    return [red for _ in range(ws)]


def ref_broadcast(ws, c):
    name, layout, shape, src = (
        c["dtype"],
        c.get("layout", "contig"),
        tuple(c["shape"]),
        c["src"] % ws,
    )
    val = build(name, src, shape, layout, salt=3)[1].contiguous()
    out = []
    for r in range(ws):
        base = _with_view(name, r, shape, layout, "sum", 3, val)
        out.append((base, [view_of(base, layout).contiguous()]) if c.get("async") else base)
    return out


def ref_reduce(ws, c):
    dst = c["dst"] % ws
    red = P.reduce_ref(
        c["dtype"],
        c["op"],
        [P.make(c["dtype"], r, c["shape"], P.kind_for(c["op"]), 4) for r in range(ws)],
        ws,
    )
    return [red if r == dst else None for r in range(ws)]


def ref_gather(ws, c):
    dst = c["dst"] % ws
    allv = [P.make(c["dtype"], r, c["shape"], salt=5) for r in range(ws)]
    return [allv if r == dst else None for r in range(ws)]


def ref_scatter(ws, c):
    src = c["src"] % ws
    return [P.make(c["dtype"], r, c["shape"], salt=6 + src) for r in range(ws)]


def ref_barrier(ws, c):
    return [torch.tensor([ws * (ws + 1) // 2], dtype=torch.int64) for _ in range(ws)]


def ref_all_gather(ws, c):
    layout = c.get("layout", "contig")
    allv = [build(c["dtype"], r, c["shape"], layout, salt=7)[1].contiguous() for r in range(ws)]
    return [allv for _ in range(ws)]


def ref_all_gather_coalesced(ws, c):
    out = [
        [P.make(c["dtype"], r, s, salt=20 + i) for i, s in enumerate(_gc_shapes(c))]
        for r in range(ws)
    ]
    return [out for _ in range(ws)]


def ref_all_reduce_sparse(ws, c):
    dense = sum(_sparse_input(r, c).to_dense().double() for r in range(ws))
    return [dense.to(P.dt(c["dtype"])) for _ in range(ws)]


def ref_all_gather_single(ws, c):
    layout = c.get("layout", "contig")
    allv = [
        build(c["dtype"], r, tuple(c["shape"]), layout, salt=8)[1].contiguous() for r in range(ws)
    ]
    out = torch.stack(allv) if c.get("stacked") else torch.cat(allv)
    return [out for _ in range(ws)]


def ref_all_gather_single_coalesced(ws, c):
    outs = [
        torch.cat([P.make(c["dtype"], r, s, salt=9 + k) for r in range(ws)])
        for k, s in enumerate(_COALESCED_SHAPES)
    ]
    return [outs for _ in range(ws)]


def ref_reduce_scatter(ws, c):
    name, op, shape = c["dtype"], c["op"], tuple(c["shape"])
    return [
        P.reduce_ref(
            name, op, [P.make(name, k, shape, P.kind_for(op), 10 + r) for k in range(ws)], ws
        )
        for r in range(ws)
    ]


def ref_reduce_scatter_single(ws, c):
    name, op, shape, layout = c["dtype"], c["op"], tuple(c["shape"]), c.get("layout", "contig")
    in_shape = (ws * shape[0],) + shape[1:]
    ins = [build(name, k, in_shape, layout, P.kind_for(op), 11)[1].contiguous() for k in range(ws)]
    red = P.reduce_ref(name, op, ins, ws)
    return [red[r * shape[0] : (r + 1) * shape[0]] for r in range(ws)]


def ref_reduce_scatter_single_coalesced(ws, c):
    name, op = c["dtype"], c["op"]
    kind = P.kind_for(op)
    out = [[] for _ in range(ws)]
    for k, s in enumerate(_COALESCED_SHAPES):
        ins = [P.make(name, q, (ws * s[0],) + s[1:], kind, 12 + k) for q in range(ws)]
        red = P.reduce_ref(name, op, ins, ws)
        for r in range(ws):
            out[r].append(red[r * s[0] : (r + 1) * s[0]])
    return out


def ref_all_to_all_single(ws, c):
    name, cols, layout = c["dtype"], c.get("cols", 3), c.get("layout", "contig")
    S = split_matrix(ws, c["splits"])
    ins = [build(name, s, (sum(S[s]), cols), layout, salt=13)[1].contiguous() for s in range(ws)]
    out = []
    for r in range(ws):
        parts = []
        for s in range(ws):
            off = sum(S[s][:r])
            parts.append(ins[s][off : off + S[s][r]])
        out.append(torch.cat(parts) if parts else torch.zeros((0, cols), dtype=P.dt(name)))
    return out


def ref_all_to_all(ws, c):
    S = split_matrix(ws, c["splits"])
    return [
        [P.make(c["dtype"], s, (S[s][r], 2), salt=14 + r) for s in range(ws)] for r in range(ws)
    ]


def ref_send_recv(ws, c):
    layout = c.get("layout", "contig")
    out = []
    for r in range(ws):
        p = _partner(r, ws)
        out.append(
            None
            if p is None
            else build(c["dtype"], p, tuple(c["shape"]), layout, salt=15)[1].contiguous()
        )
    return out


def ref_recv_any_source(ws, c):
    got = [(s, P.make(c["dtype"], s, tuple(c["shape"]), salt=16)) for s in range(1, ws)]
    return [got] + [None] * (ws - 1)


def ref_isend_irecv(ws, c):
    return [P.make(c["dtype"], (r - 1) % ws, tuple(c["shape"]), salt=17) for r in range(ws)]


def ref_batch_isend_irecv(ws, c):
    shape = tuple(c["shape"])
    return [
        [
            P.make(c["dtype"], (r - 1) % ws, shape, salt=18),
            P.make(c["dtype"], (r + 1) % ws, shape, salt=19),
        ]
        for r in range(ws)
    ]


def ref_shrink_group(ws, c):
    return None  # checked by test_shrink_group itself


REFS = {k[len("ref_") :]: v for k, v in dict(globals()).items() if k.startswith("ref_")}


# ------------------------------------------------------------------------- cases

SMALL = (37,)
NONCONTIG = (5, 7)
ZERO = (1, 0, 2)


def _c(**kw):
    if "shape" in kw:
        kw["shape"] = tuple(kw["shape"])
    return kw


def cases_all_reduce(ws):
    cs = [_c(dtype=d, op=op, shape=SMALL) for d in P.ALL_DTYPES for op in P.ops_for(d)]
    cs += [
        _c(dtype=d, op=op, shape=NONCONTIG, layout="transposed")
        for d, op in [
            ("float32", "SUM"),
            ("int64", "MAX"),
            ("bfloat16", "AVG"),
            ("complex64", "SUM"),
            ("bool", "MAX"),
            ("uint32", "BXOR"),
            ("float16", "PREMUL_SUM"),
        ]
    ]
    cs += [
        _c(dtype=d, op=op, shape=(9,), layout="strided")
        for d, op in [("float64", "SUM"), ("int32", "BXOR"), ("uint8", "MIN"), ("int16", "AVG")]
    ]
    cs += [
        _c(dtype=d, op=op, shape=s)
        for d, op in [("float32", "SUM"), ("bfloat16", "AVG"), ("int64", "MAX")]
        for s in (ZERO, (0,))
    ]
    cs += [
        _c(dtype=d, op=op, shape=SMALL, **{"async": True})
        for d, op in [("float32", "SUM"), ("int32", "MAX"), ("float64", "PREMUL_SUM")]
    ]
    cs += [
        _c(dtype=d, op="PREMUL_SUM_TENSOR", shape=SMALL) for d in ("float32", "bfloat16", "float64")
    ]
    # beyond one shared-memory slot (1 MiB per rank): pipelined path
    cs += [
        _c(dtype="float32", op="SUM", shape=(300_007,)),
        _c(dtype="bfloat16", op="AVG", shape=(600_011,)),
        _c(dtype="int64", op="BXOR", shape=(140_001,)),
        _c(dtype="uint8", op="MAX", shape=(1_500_001,)),
        _c(dtype="float64", op="MIN", shape=(200_003,)),
        _c(dtype="float32", op="SUM", shape=(512, 613), layout="transposed"),
    ]
    return cs


def cases_all_reduce_coalesced(ws):
    pairs = [
        ("float32", "SUM"),
        ("int64", "SUM"),
        ("bfloat16", "MAX"),
        ("float64", "AVG"),
        ("float32", "PREMUL_SUM"),
        ("int32", "AVG"),
        ("uint16", "BOR"),
        ("bool", "MIN"),
    ]
    return [
        _c(dtype=d, op=op, api=api)
        for api in ("all_reduce_coalesced", "cm", "cm_async")
        for d, op in pairs
    ]


def cases_broadcast(ws):
    cs = [_c(dtype=d, src=src, shape=SMALL) for d in P.ALL_DTYPES for src in (0, -1)]
    cs += [
        _c(dtype=d, src=-1, shape=NONCONTIG, layout="transposed")
        for d in ("float32", "int16", "complex128")
    ]
    cs += [_c(dtype="float32", src=1, shape=(9,), layout="strided")]
    cs += [_c(dtype=d, src=0, shape=s) for d in ("float32", "bfloat16") for s in (ZERO, (0,))]
    cs += [
        _c(dtype="int32", src=-1, shape=SMALL, **{"async": True}),
        _c(dtype="float32", src=1, shape=(400_003,)),
    ]
    return cs


def cases_reduce(ws):
    cs = []
    for d in P.ALL_DTYPES:
        ops = P.ops_for(d)
        for op in ("SUM", "MAX", "AVG", "PREMUL_SUM", "BXOR"):
            if op in ops:
                cs.append(_c(dtype=d, op=op, dst=-1, shape=SMALL))
    cs += [
        _c(dtype="float32", op="SUM", dst=0, shape=SMALL),
        _c(dtype="int32", op="MIN", dst=1, shape=SMALL),
        _c(dtype="float32", op="SUM", dst=0, shape=ZERO),
        _c(dtype="float32", op="SUM", dst=0, shape=(300_007,)),
    ]
    return cs


def cases_gather(ws):
    cs = [_c(dtype=d, dst=-1, shape=SMALL) for d in P.ALL_DTYPES]
    cs += [
        _c(dtype="float32", dst=0, shape=SMALL),
        _c(dtype="float32", dst=0, shape=ZERO),
        _c(dtype="int64", dst=1, shape=(2, 3)),
        _c(dtype="float32", dst=0, shape=(300_007,)),
    ]
    return cs


def cases_scatter(ws):
    cs = [_c(dtype=d, src=0, shape=SMALL) for d in P.ALL_DTYPES]
    cs += [
        _c(dtype="float32", src=-1, shape=SMALL),
        _c(dtype="float32", src=0, shape=ZERO),
        _c(dtype="uint8", src=1, shape=(2, 3)),
        _c(dtype="float32", src=-1, shape=(300_007,)),
    ]
    return cs


def cases_barrier(ws):
    return [{}]


def cases_all_gather(ws):
    cs = [_c(dtype=d, shape=SMALL) for d in P.ALL_DTYPES]
    cs += [
        _c(dtype=d, shape=NONCONTIG, layout="transposed") for d in ("float32", "int8", "complex64")
    ]
    cs += [_c(dtype=d, shape=s) for d in ("float32", "bfloat16") for s in (ZERO, (0,))]
    cs += [
        _c(dtype="float64", shape=SMALL, **{"async": True}),
        _c(dtype="float32", shape=(300_007,)),
    ]
    return cs


def cases_all_gather_coalesced(ws):
    cs = [_c(dtype=d) for d in ("float32", "float64", "bfloat16", "int64", "uint8", "bool")]
    cs += [_c(dtype=d) for d in ("complex64", "float8_e4m3fn", "uint32")]
    cs += [_c(dtype=d, with_empty=True) for d in ("float32", "int32")]
    cs += [_c(dtype="float64", **{"async": True})]
    return cs


def cases_all_reduce_sparse(ws):
    cs = [_c(dtype=d) for d in ("float32", "float64", "int64")]
    cs += [
        _c(dtype="float32", hybrid=True),
        _c(dtype="float64", dup=True),
        _c(dtype="float32", empty_on_0=True),
        _c(dtype="float32", all_empty=True),
        _c(dtype="float64", **{"async": True}),
    ]
    return cs


def cases_all_gather_single(ws):
    cs = [_c(dtype=d, shape=SMALL) for d in P.ALL_DTYPES]
    cs += [_c(dtype=d, shape=(3, 4), stacked=True) for d in ("float32", "uint64", "bool")]
    cs += [
        _c(dtype=d, shape=NONCONTIG, layout="transposed")
        for d in ("float32", "int16", "complex128")
    ]
    cs += [_c(dtype=d, shape=s) for d in ("float32", "bfloat16") for s in (ZERO, (0,))]
    cs += [
        _c(dtype="float32", shape=SMALL, old_name=True),
        _c(dtype="int32", shape=SMALL, **{"async": True}),
        _c(dtype="float32", shape=(300_007,)),
        _c(dtype="uint8", shape=(1_100_001,)),
    ]
    return cs


def cases_all_gather_single_coalesced(ws):
    return [
        _c(dtype=d, **({"async": a} if a else {}))
        for d in ("float32", "int64", "bfloat16", "uint32", "bool")
        for a in (False, True)
    ]


def cases_reduce_scatter(ws):
    cs = [_c(dtype=d, op="SUM", shape=(6,)) for d in P.ALL_DTYPES]
    cs += [_c(dtype="float32", op=op, shape=(6,)) for op in P.FLOAT_OPS if op != "SUM"]
    cs += [_c(dtype="int32", op=op, shape=(6,)) for op in P.INT_OPS if op != "SUM"]
    cs += [
        _c(dtype="float32", op="SUM", shape=(2, 0)),
        _c(dtype="float32", op="SUM", shape=(100_003,)),
    ]
    return cs


def cases_reduce_scatter_single(ws):
    cs = [_c(dtype=d, op=op, shape=(6,)) for d in P.ALL_DTYPES for op in P.ops_for(d)]
    cs += [
        _c(dtype=d, op=op, shape=(3, 5), layout="transposed")
        for d, op in [
            ("float32", "SUM"),
            ("bfloat16", "AVG"),
            ("int64", "MAX"),
            ("float32", "PREMUL_SUM"),
        ]
    ]
    cs += [_c(dtype=d, op="SUM", shape=s) for d in ("float32", "bfloat16") for s in (ZERO, (0,))]
    cs += [_c(dtype=d, op="PREMUL_SUM_TENSOR", shape=(6,)) for d in ("float32", "bfloat16")]
    cs += [
        _c(dtype="float32", op="AVG", shape=(6,), old_name=True),
        _c(dtype="float32", op="PREMUL_SUM", shape=(6,), **{"async": True}),
        _c(dtype="float32", op="SUM", shape=(300_007,)),
        _c(dtype="bfloat16", op="AVG", shape=(200_003,)),
    ]
    return cs


def cases_reduce_scatter_single_coalesced(ws):
    return [
        _c(dtype=d, op=op, **({"async": a} if a else {}))
        for d, op in [
            ("float32", "SUM"),
            ("float32", "AVG"),
            ("bfloat16", "PREMUL_SUM"),
            ("int64", "MAX"),
        ]
        for a in (False, True)
    ]


def cases_all_to_all_single(ws):
    cs = [_c(dtype=d, splits="even") for d in P.ALL_DTYPES]
    cs += [_c(dtype=d, splits="uneven", cols=4) for d in P.ALL_DTYPES]
    cs += [
        _c(dtype="float32", splits="even", explicit=True),
        _c(dtype="float32", splits="zero", cols=4),
        _c(dtype="int64", splits="uneven", cols=4, **{"async": True}),
        _c(dtype="float32", splits="even", cols=5, layout="transposed"),
        _c(dtype="int16", splits="uneven", cols=5, layout="transposed"),
        _c(dtype="float32", splits="even", cols=100_003),
    ]
    return cs


def cases_all_to_all(ws):
    return [_c(dtype=d, splits=s) for d in P.ALL_DTYPES for s in ("uneven",)] + [
        _c(dtype="float32", splits="even"),
        _c(dtype="float32", splits="zero"),
    ]


def cases_send_recv(ws):
    if ws < 2:
        return []
    cs = [_c(dtype=d, shape=SMALL) for d in P.ALL_DTYPES]
    cs += [
        _c(dtype=d, shape=NONCONTIG, layout="transposed") for d in ("float32", "bfloat16", "int64")
    ]
    cs += [_c(dtype="float32", shape=s) for s in (ZERO, (0,))]
    cs += [_c(dtype="float32", shape=(300_007,))]
    return cs


def cases_recv_any_source(ws):
    if ws < 2:
        return []
    return [_c(dtype=d, shape=SMALL) for d in ("float32", "int64", "bfloat16", "uint16")]


def cases_isend_irecv(ws):
    if ws < 2:
        return []
    return [_c(dtype=d, shape=SMALL) for d in P.ALL_DTYPES] + [
        _c(dtype="float32", shape=(300_007,))
    ]


def cases_batch_isend_irecv(ws):
    if ws < 2:
        return []
    return [
        _c(dtype=d, shape=SMALL)
        for d in ("float32", "int8", "uint64", "bool", "complex128", "float8_e5m2", "bfloat16")
    ] + [_c(dtype="float32", shape=(300_007,))]


def cases_shrink_group(ws):
    return [{}]


CASES = {k[len("cases_") :]: v for k, v in dict(globals()).items() if k.startswith("cases_")}

P2P_OPS = {"send_recv", "recv_any_source", "isend_irecv", "batch_isend_irecv"}


def gloo_serves(opname, c) -> bool:
    """Whether gloo runs this case (and then serves as its reference)."""
    d = c.get("dtype", "float32")
    if opname == "shrink_group":
        return False
    if c.get("layout", "contig") != "contig":
        # gloo ignores strides (a [::2] view is reduced as if it were dense memory and the
        # gaps get overwritten) or rejects non-contiguous tensors: independent reference
        return False
    if opname in P2P_OPS:
        return True  # gloo moves every dtype point to point
    if d not in P.GLOO_DTYPES:
        return False
    if "op" in c and not P.gloo_reduces(d, c["op"]):
        return False
    if opname == "gather" and P.category(d) == "complex":
        return False
    if opname == "all_reduce_coalesced" and P.category(d) == "bool":
        return False
    if opname == "all_to_all" and c["splits"] == "uneven":
        return False  # gloo's alltoall takes equal sizes only
    if opname == "all_gather_single" and c.get("stacked"):
        return False  # gloo only takes the concatenated form; torch documents both
    return True


SAME_ON_ALL_RANKS = {
    "all_reduce",
    "all_reduce_coalesced",
    "all_reduce_sparse",
    "all_gather_coalesced",
    "broadcast",
    "all_gather",
    "all_gather_single",
    "all_gather_single_coalesced",
    "barrier",
}


def describe(c) -> str:
    return ",".join(f"{k}={v}" for k, v in c.items())


# --------------------------------------------------------------------- driver

_gloo_cache: dict = {}


def _run(pool, opname, cases):
    res = pool.run(rank_run_cases, opname, cases, timeout=RUN_TIMEOUT)
    return [[res[r][i] for r in range(pool.world_size)] for i in range(len(cases))]


def gloo_results(ws, opname):
    """Per gloo-served case: per-rank results from a gloo pool (cached per session)."""
    key = (ws, opname)
    if key not in _gloo_cache:
        cases = [c for c in CASES[opname](ws) if gloo_serves(opname, c)]
        res = _run(get_pool(ws, "gloo"), opname, cases) if cases else []
        _gloo_cache[key] = {repr(c): r for c, r in zip(cases, res)}
    return _gloo_cache[key]


def check_op(ws, bt, opname):
    backend, transport = bt
    cases = CASES[opname](ws)
    if backend == "gloo":  # developing the tests without the extension
        cases = [c for c in cases if gloo_serves(opname, c)]
    got = _run(get_pool(ws, backend, transport), opname, cases)
    gref = gloo_results(ws, opname)
    failures = []
    for c, per_rank in zip(cases, got):
        where = f"{opname}({describe(c)}) ws={ws} {backend_id(bt)}"
        g = gref.get(repr(c))
        if g is not None:
            bad = [f"rank {r}: {v}" for r, (s, v) in enumerate(g) if s != "ok"]
            if bad:
                failures.append(f"{where}: gloo reference raised: {bad[0]}")
                continue
            exp = [v for _, v in g]
            ref_name = "gloo"
        else:
            exp = REFS[opname](ws, c)
            ref_name = "independent reference"
        for r, (status, val) in enumerate(per_rank):
            if status != "ok":
                failures.append(f"{where} rank {r}: raised {val}")
                continue
            if exp[r] is None:
                continue
            m = P.mismatch(val, exp[r], f"{where} rank {r} vs {ref_name}")
            if m:
                failures.append(m)
        # a reduction's result is the same bits on every rank (DDP replicas stay equal)
        if (
            opname in SAME_ON_ALL_RANKS
            and c.get("layout") != "strided"
            and all(s == "ok" for s, _ in per_rank)
        ):
            for r in range(1, len(per_rank)):
                if not P.bitwise_equal(per_rank[r][1], per_rank[0][1]):
                    failures.append(f"{where}: rank {r}'s result differs from rank 0's (bitwise)")
                    break
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:60])


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"ws{w}")
def ws(request):
    return request.param


@pytest.fixture(scope="module", params=BACKENDS, ids=backend_id)
def bt(request):
    return request.param


def _needs_peer(ws):
    if ws < 2:
        pytest.skip("point-to-point needs a peer (world size >= 2)")


def test_all_reduce(ws, bt):
    """all_reduce -> allreduce: every dtype x every reduction of docs/design.md's table,
    transposed/strided views, zero-element, async + future, > 1 MiB."""
    check_op(ws, bt, "all_reduce")


def test_all_reduce_coalesced(ws, bt):
    """all_reduce_coalesced and _coalescing_manager (sync, async) -> allreduce_coalesced."""
    check_op(ws, bt, "all_reduce_coalesced")


def test_broadcast(ws, bt):
    check_op(ws, bt, "broadcast")


def test_reduce(ws, bt):
    check_op(ws, bt, "reduce")


def test_gather(ws, bt):
    check_op(ws, bt, "gather")


def test_scatter(ws, bt):
    check_op(ws, bt, "scatter")


def test_barrier(ws, bt):
    check_op(ws, bt, "barrier")


def test_all_gather(ws, bt):
    check_op(ws, bt, "all_gather")


def test_all_gather_coalesced(ws, bt):
    """all_gather_coalesced -> allgather_coalesced, torch's layout (one output list per rank),
    several dtypes (complex through torch's real view), empty tensors, async."""
    check_op(ws, bt, "all_gather_coalesced")


def test_all_reduce_sparse(ws, bt):
    """all_reduce of a sparse COO tensor (SUM) -> allreduce_sparse: the dense result equals the
    sum of every rank's tensor; hybrid (sparse + dense dims), repeated indices, ranks with
    no entries, async."""
    check_op(ws, bt, "all_reduce_sparse")


def test_all_gather_single(ws, bt):
    """all_gather_single (and the old all_gather_into_tensor) -> _allgather_base."""
    check_op(ws, bt, "all_gather_single")


def test_all_gather_single_coalesced(ws, bt):
    """_coalescing_manager + all_gather_single -> allgather_into_tensor_coalesced."""
    check_op(ws, bt, "all_gather_single_coalesced")


def test_reduce_scatter(ws, bt):
    check_op(ws, bt, "reduce_scatter")


def test_reduce_scatter_single(ws, bt):
    """reduce_scatter_single (and reduce_scatter_tensor) -> _reduce_scatter_base, every
    reduction of the table (FSDP2 uses AVG and PREMUL_SUM)."""
    check_op(ws, bt, "reduce_scatter_single")


def test_reduce_scatter_single_coalesced(ws, bt):
    """_coalescing_manager + reduce_scatter_single -> reduce_scatter_tensor_coalesced."""
    check_op(ws, bt, "reduce_scatter_single_coalesced")


def test_all_to_all_single(ws, bt):
    """even, uneven (with zero splits), all-zero, transposed input, async, large."""
    check_op(ws, bt, "all_to_all_single")


def test_all_to_all(ws, bt):
    check_op(ws, bt, "all_to_all")


def test_send_recv(ws, bt):
    _needs_peer(ws)
    check_op(ws, bt, "send_recv")


def test_recv_any_source(ws, bt):
    _needs_peer(ws)
    check_op(ws, bt, "recv_any_source")


def test_isend_irecv(ws, bt):
    _needs_peer(ws)
    check_op(ws, bt, "isend_irecv")


def test_batch_isend_irecv(ws, bt):
    """A ring in both directions through batch_isend_irecv (coalesced if the backend says
    supportsCoalescing(), else one op at a time: p2p must not block the progress thread)."""
    _needs_peer(ws)
    check_op(ws, bt, "batch_isend_irecv")


def test_shrink_group(ws, bt):
    """dist.shrink_group: works when the backend reports supports_shrinking, else torch
    refuses with TypeError (documented as unsupported)."""
    _needs_peer(ws)
    backend, transport = bt
    res = get_pool(ws, backend, transport).run(op_shrink_group, {}, timeout=RUN_TIMEOUT)
    kinds = {r[0] for r in res}
    assert len(kinds) == 1, res
    if kinds == {"unsupported"}:
        assert all(r[1] == "TypeError" for r in res), res
    else:
        exp = (ws - 1) * ws // 2
        assert [r[1] for r in res[:-1]] == [exp] * (ws - 1), res


def test_reference_matches_gloo(ws):
    """The independent references (used where gloo cannot serve) agree with gloo on
    every case gloo does serve -- so the two kinds of reference are one contract."""
    failures = []
    for opname in CASES:
        if opname == "shrink_group":
            continue
        for c in CASES[opname](ws):
            if not gloo_serves(opname, c):
                continue
            g = gloo_results(ws, opname)[repr(c)]
            exp = REFS[opname](ws, c)
            for r, (s, v) in enumerate(g):
                if s != "ok":
                    failures.append(f"{opname}({describe(c)}) ws={ws}: gloo rank {r} raised {v}")
                elif exp[r] is not None:
                    m = P.mismatch(
                        v, exp[r], f"{opname}({describe(c)}) ws={ws} rank {r} gloo vs reference"
                    )
                    if m:
                        failures.append(m)
    assert not failures, "\n".join(failures[:60])


def test_api_map_covers_design():
    """Every Backend method of docs/design.md's API map has a row here, and every row's rank op
    exists with a case list and a reference."""
    for py, _method, opname in API_MAP:
        assert opname in OPS and opname in CASES and opname in REFS, (py, opname)
    path = os.path.join(REPO_ROOT, "docs", "design.md")
    with open(path, encoding="utf-8") as f:
        design = f.read()
    m = re.search(r"### torch 2\.13 API -> Backend method[^\n]*\n\s*((?:\|[^\n]*\n)+)", design)
    assert m, "API map table not found in docs/design.md"
    ours = " ".join(method for _, method, _ in API_MAP)
    missing = []
    for line in m.group(1).splitlines()[2:]:
        cells = [x.strip() for x in line.strip().strip("|").split("|")]
        if len(cells) < 2:
            continue
        for meth in re.findall(r"[A-Za-z_][A-Za-z_]*", cells[1].split("(")[0]):
            if meth in ("same", "names", "if", "or", "documented", "as", "unsupported"):
                continue
            if meth not in ours:
                missing.append(meth)
    assert not missing, (
        f"Backend methods of docs/design.md's API map without a conformance row: {missing}"
    )
