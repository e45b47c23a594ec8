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
            assert isinstance(g, torch.Tensor) and torch.equal(g, v), (
                f"{where}: {k} = {g}, expected {v}"
            )
        else:
            assert g == v, f"{where}: {k} = {g!r}, expected {v!r}"
