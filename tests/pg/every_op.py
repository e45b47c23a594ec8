"""Every collective and p2p op of torch.distributed once, on small rank-dependent inputs,
with the expected outputs computed here independently (plain Python arithmetic), for
tests that change a group's members or its hosts and then check that everything works.

Imported both by the test process and by the rank processes (keep it light).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def run_collectives(group=None) -> dict:
    """Every collective once on ``group`` (default: the default group) with inputs that
    depend on the rank in that group; returns the outputs by op name."""
    r, n = dist.get_rank(group), dist.get_world_size(group)
    out = {"rank": r, "size": n}
    t = torch.tensor([r + 1.0, 10.0 * (r + 1)])
    dist.all_reduce(t, group=group)
    out["all_reduce"] = t
    t = torch.full((3,), float(r))
    dist.broadcast(t, group_src=n - 1, group=group)
    out["broadcast"] = t
    ag = torch.empty(2 * n)
    dist.all_gather_into_tensor(ag, torch.tensor([r, r + 0.5]), group=group)
    out["all_gather_into_tensor"] = ag
    lst = [torch.empty(1) for _ in range(n)]
    dist.all_gather(lst, torch.tensor([r * 3.0]), group=group)
    out["all_gather"] = torch.cat(lst)
    rs = torch.empty(2)
    dist.reduce_scatter_tensor(rs, torch.arange(2.0 * n) + 100 * r, group=group)
    out["reduce_scatter_tensor"] = rs
    a2a = torch.empty(n)
    dist.all_to_all_single(a2a, torch.arange(float(n)) * 10 + r, group=group)
    out["all_to_all_single"] = a2a
    g = [torch.empty(1) for _ in range(n)] if r == 0 else None
    dist.gather(torch.tensor([r + 7.0]), g, group_dst=0, group=group)
    out["gather"] = torch.cat(g) if g else None
    sc = torch.empty(1)
    src = 1 % n
    dist.scatter(
        sc,
        [torch.tensor([i * 2.0]) for i in range(n)] if r == src else None,
        group_src=src,
        group=group,
    )
    out["scatter"] = sc
    red = torch.tensor([r + 1.0])
    dist.reduce(red, group_dst=n - 1, group=group)
    out["reduce"] = red if r == n - 1 else None
    recv = torch.empty(1)
    ops = [
        dist.P2POp(dist.isend, torch.tensor([r * 1.0]), group_peer=(r + 1) % n, group=group),
        dist.P2POp(dist.irecv, recv, group_peer=(r - 1) % n, group=group),
    ]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    out["send_recv"] = recv
    dist.barrier(group=group)
    return out


def expected_collectives(n: int) -> list:
    """The outputs of :func:`run_collectives` for each rank of an ``n``-rank group."""
    res = []
    for r in range(n):
        e = {"rank": r, "size": n}
        e["all_reduce"] = torch.tensor(
            [sum(k + 1.0 for k in range(n)), sum(10.0 * (k + 1) for k in range(n))]
        )
        e["broadcast"] = torch.full((3,), float(n - 1))
        e["all_gather_into_tensor"] = torch.tensor([v for k in range(n) for v in (k, k + 0.5)])
        e["all_gather"] = torch.tensor([k * 3.0 for k in range(n)])
        e["reduce_scatter_tensor"] = torch.tensor(
            [sum(2.0 * r + i + 100 * k for k in range(n)) for i in range(2)]
        )
        e["all_to_all_single"] = torch.tensor([r * 10.0 + k for k in range(n)])
        e["gather"] = torch.tensor([k + 7.0 for k in range(n)]) if r == 0 else None
        e["scatter"] = torch.tensor([r * 2.0])
        e["reduce"] = torch.tensor([sum(k + 1.0 for k in range(n))]) if r == n - 1 else None
        e["send_recv"] = torch.tensor([float((r - 1) % n)])
        res.append(e)
    return res


def assert_collectives(got: dict, exp: dict, where: str):
    for k, v in exp.items():
        g = got[k]
        if isinstance(v, torch.Tensor):
            assert isinstance(g, torch.Tensor) and g.dtype == v.dtype and torch.equal(g, v), (
                f"{where}: {k} = {g}, expected {v}"
            )
        else:
            assert g == v, f"{where}: {k} = {g!r}, expected {v!r}"


# ------------------------------------------------------------------ dtypes and shapes

# one dtype of each class (exact in every one of them: the inputs are small integers)
SWEEP_DTYPES = ["float32", "float64", "bfloat16", "float16", "int64", "int32", "uint8", "bool"]


def _sweep_input(r: int, count: int, dtype: str) -> torch.Tensor:
    """Rank r's input: small integers (0/1 for bool) that every dtype holds exactly."""
    base = torch.arange(count) % 5 + r
    return (base % 2 if dtype == "bool" else base).to(getattr(torch, dtype))


def run_sweep(group=None, count: int = 7) -> dict:
    """all_reduce, all_gather_into_tensor, reduce_scatter_tensor, broadcast and
    all_to_all_single (uneven splits) for each dtype of SWEEP_DTYPES; all_reduce of a
    non-contiguous view and of zero elements."""
    r, n = dist.get_rank(group), dist.get_world_size(group)
    out = {}
    for d in SWEEP_DTYPES:
        dt = getattr(torch, d)
        op = dist.ReduceOp.MAX if d == "bool" else dist.ReduceOp.SUM
        t = _sweep_input(r, count, d)
        dist.all_reduce(t, op=op, group=group)
        out[f"all_reduce/{d}"] = t
        ag = torch.empty(n * count, dtype=dt)
        dist.all_gather_into_tensor(ag, _sweep_input(r, count, d), group=group)
        out[f"all_gather_into_tensor/{d}"] = ag
        rs = torch.empty(count, dtype=dt)
        dist.reduce_scatter_tensor(rs, _sweep_input(r, n * count, d), op=op, group=group)
        out[f"reduce_scatter_tensor/{d}"] = rs
        b = _sweep_input(r, count, d)
        dist.broadcast(b, group_src=0, group=group)
        out[f"broadcast/{d}"] = b
        # rank r sends j + 1 elements to rank j and receives r + 1 from each
        send = [j + 1 for j in range(n)]
        recv = [r + 1] * n
        a_in = torch.cat([_sweep_input(r * 10 + j, j + 1, d) for j in range(n)])
        a_out = torch.empty(sum(recv), dtype=dt)
        dist.all_to_all_single(a_out, a_in, recv, send, group=group)
        out[f"all_to_all_single/{d}"] = a_out
    m = (torch.arange(12.0).reshape(3, 4) + r).t()  # a transposed view: not contiguous
    dist.all_reduce(m, group=group)
    out["all_reduce/non_contiguous"] = m
    z = torch.empty(0)
    dist.all_reduce(z, group=group)
    out["all_reduce/zero_elements"] = z
    return out


def expected_sweep(n: int, count: int = 7) -> list:
    """The outputs of :func:`run_sweep` for each rank of an ``n``-rank group."""
    res = []
    for r in range(n):
        e = {}
        for d in SWEEP_DTYPES:
            ins = [_sweep_input(k, count, d).double() for k in range(n)]
            red = torch.stack(ins).amax(0) if d == "bool" else torch.stack(ins).sum(0)
            dt = getattr(torch, d)
            e[f"all_reduce/{d}"] = red.to(dt)
            e[f"all_gather_into_tensor/{d}"] = torch.cat(
                [_sweep_input(k, count, d) for k in range(n)]
            )
            full = [_sweep_input(k, n * count, d).double() for k in range(n)]
            fred = torch.stack(full).amax(0) if d == "bool" else torch.stack(full).sum(0)
            e[f"reduce_scatter_tensor/{d}"] = fred[r * count : (r + 1) * count].to(dt)
            e[f"broadcast/{d}"] = _sweep_input(0, count, d)
            e[f"all_to_all_single/{d}"] = torch.cat(
                [_sweep_input(k * 10 + r, r + 1, d) for k in range(n)]
            )
        e["all_reduce/non_contiguous"] = sum(
            (torch.arange(12.0).reshape(3, 4) + k).t() for k in range(n)
        )
        e["all_reduce/zero_elements"] = torch.empty(0)
        res.append(e)
    return res


# ------------------------------------------------------------------ large messages


def _large_input(r: int, count: int, dtype: str, salt: int = 0) -> torch.Tensor:
    """Rank r's input: small integers, so that every sum, AVG over 2^k ranks and PREMUL_SUM
    by 0.5 is exact in every dtype used."""
    v = (torch.arange(count, dtype=torch.int64) * 7 + r * 13 + salt) % 11
    return (v % 2 if dtype == "bool" else v).to(getattr(torch, dtype))


def _reduced(stack: torch.Tensor, op: str, dtype: str) -> torch.Tensor:
    """The reference reduction over dim 0 of every rank's input, computed by torch."""
    dt = getattr(torch, dtype)
    if op == "sum":
        return (
            stack.to(torch.float64).sum(0).to(dt) if dt.is_floating_point else stack.sum(0).to(dt)
        )
    if op == "max":
        return stack.max(0).values
    if op == "avg":
        if dt.is_floating_point:
            return (stack.to(torch.float64).sum(0) / stack.shape[0]).to(dt)
        return torch.div(stack.sum(0), stack.shape[0], rounding_mode="trunc").to(dt)
    if op == "premul_half":
        return (stack.to(torch.float64).sum(0) * 0.5).to(dt)
    raise ValueError(op)


_OPS = {
    "sum": lambda: dist.ReduceOp.SUM,
    "max": lambda: dist.ReduceOp.MAX,
    "avg": lambda: dist.ReduceOp.AVG,
    "premul_half": lambda: dist._make_nccl_premul_sum(0.5),
}

# (dtype, op) pairs for the reducing ops
LARGE_REDUCTIONS = [
    ("float32", "sum"),
    ("float64", "avg"),
    ("int64", "avg"),
    ("int32", "max"),
    ("bfloat16", "sum"),
    ("float16", "premul_half"),
    ("uint8", "sum"),
    ("bool", "max"),
]


def run_large(counts, group=None) -> dict:
    """Large all_reduce, reduce, reduce_scatter_tensor, all_gather (list and into_tensor),
    broadcast and all_to_all_single (skewed splits) at each of ``counts`` elements per rank, checked on the rank against torch's
    reduction of every rank's input. Returns {"checked": [case], "bad": {case: why}}."""
    r, n = dist.get_rank(group), dist.get_world_size(group)
    checked, bad = [], {}

    def check(case, got, want):
        checked.append(case)
        if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
            diff = (got != want).nonzero()
            first = diff[0].tolist() if diff.numel() else None
            bad[case] = (
                f"dtype {got.dtype}/{want.dtype} shape {tuple(got.shape)}/{tuple(want.shape)} "
                f"{int((got != want).sum()) if got.shape == want.shape else '?'} elements differ, "
                f"first at {first}"
            )

    for count in counts:
        for d, op in LARGE_REDUCTIONS:
            stack = torch.stack([_large_input(j, count, d) for j in range(n)])
            t = _large_input(r, count, d)
            dist.all_reduce(t, op=_OPS[op](), group=group)
            check(f"all_reduce/{d}/{op}/{count}", t, _reduced(stack, op, d))
            for root in sorted({n - 1, min(1, n - 1)}):
                t = _large_input(r, count, d, salt=root)
                want = (
                    _reduced(
                        torch.stack([_large_input(j, count, d, root) for j in range(n)]), op, d
                    )
                    if r == root
                    else _large_input(r, count, d, salt=root)  # untouched on other ranks
                )
                if group is None:
                    dist.reduce(t, dst=root, op=_OPS[op]())
                else:
                    dist.reduce(t, group_dst=root, op=_OPS[op](), group=group)
                check(f"reduce/{d}/{op}/root{root}/{count}", t, want)
            full = torch.stack([_large_input(j, count * n, d, salt=5) for j in range(n)])
            rs = torch.empty(count, dtype=getattr(torch, d))
            dist.reduce_scatter_tensor(rs, full[r].clone(), op=_OPS[op](), group=group)
            check(
                f"reduce_scatter_tensor/{d}/{op}/{count}",
                rs,
                _reduced(full[:, r * count : (r + 1) * count], op, d),
            )
        for d in ("float32", "uint8", "int64"):
            dt = getattr(torch, d)
            ag = torch.empty(n * count, dtype=dt)
            dist.all_gather_into_tensor(ag, _large_input(r, count, d, salt=3), group=group)
            check(
                f"all_gather_into_tensor/{d}/{count}",
                ag,
                torch.cat([_large_input(j, count, d, salt=3) for j in range(n)]),
            )
            lst = [torch.empty(count, dtype=dt) for _ in range(n)]
            dist.all_gather(lst, _large_input(r, count, d, salt=4), group=group)
            check(
                f"all_gather/{d}/{count}",
                torch.cat(lst),
                torch.cat([_large_input(j, count, d, salt=4) for j in range(n)]),
            )
            for root in sorted({0, n - 1, min(1, n - 1)}):
                b = _large_input(r, count, d, salt=7 + root)
                src = _large_input(root, count, d, salt=7 + root)
                if group is None:
                    dist.broadcast(b, src=root)
                else:
                    dist.broadcast(b, group_src=root, group=group)
                check(f"broadcast/{d}/root{root}/{count}", b, src)
        # all_to_all_single with skewed splits: per sender, one peer gets 3 x count rows,
        # one count, one a single row, one none (each sender's slot is cut in proportion)
        pattern = (0, 1, 3 * count, count)

        def splits(s):
            return [pattern[(d - s) % 4] if d != s else 2 for d in range(n)]

        for d in ("float64", "int32"):
            # every element distinct: a row delivered to the wrong place shows
            send = [
                (torch.arange(sum(splits(s)), dtype=torch.int64) + s * 10**7).to(getattr(torch, d))
                for s in range(n)
            ]
            out = torch.empty(sum(splits(s)[r] for s in range(n)), dtype=getattr(torch, d))
            dist.all_to_all_single(
                out,
                send[r],
                [splits(s)[r] for s in range(n)],
                splits(r),
                group=group,
            )
            want = []
            for s in range(n):
                start = sum(splits(s)[:r])
                want.append(send[s][start : start + splits(s)[r]])
            check(f"all_to_all_single/skewed/{d}/{count}", out, torch.cat(want))
    return {"checked": checked, "bad": bad}
