"""Integration of the backend under test with the rest of torch.distributed:
world size 1, ``new_group`` subgroups, object collectives, DDP (built-in allreduce,
the default allreduce hook, the PowerSGD hook), DeviceMesh, FSDP2 (``fully_shard``) and
``torch.distributed.checkpoint``. References: a single-process computation where one
exists, else the same run on gloo (same seeds, same rank-dependent data).

The default group of the pool is the backend under test (``mooncake`` by default), so
DeviceMesh/FSDP2/DCP, which use the default group's backend for "cpu", run on it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tests import rankpool
from tests.faults import kill_group
from tests.pg import outcomes as O
from tests.rankpool import default_backend, get_pool

pytestmark = pytest.mark.timeout(240)

BACKEND, TRANSPORT = default_backend()


def pool(ws):
    return get_pool(ws, BACKEND, TRANSPORT)


def gloo_pool(ws):
    return get_pool(ws, "gloo")


# ----------------------------------------------------------------- world size 1


def rank_world_size_1(rank, ws):
    torch.set_num_threads(1)
    assert ws == 1 and rank == 0
    out = {"backend": dist.get_backend()}
    t = torch.arange(5.0) + 3
    for op in ("SUM", "MAX", "AVG", "PRODUCT"):
        x = t.clone()
        dist.all_reduce(x, op=getattr(dist.ReduceOp, op))
        out[("all_reduce", op)] = x
    x = t.clone()
    dist.broadcast(x, src=0)
    out["broadcast"] = x
    x = t.clone()
    dist.reduce(x, dst=0)
    out["reduce"] = x
    lst = [torch.zeros(5)]
    dist.all_gather(lst, t)
    out["all_gather"] = lst[0]
    o = torch.zeros(5)
    dist.all_gather_single(o, t)
    out["all_gather_single"] = o
    o = torch.zeros(5)
    dist.reduce_scatter_single(o, t)
    out["reduce_scatter_single"] = o
    o = torch.zeros(5)
    dist.all_to_all_single(o, t)
    out["all_to_all_single"] = o
    g = [torch.zeros(5)]
    dist.gather(t, g, dst=0)
    out["gather"] = g[0]
    o = torch.zeros(5)
    dist.scatter(o, [t.clone()], src=0)
    out["scatter"] = o
    dist.barrier()
    objs = [None]
    dist.all_gather_object(objs, {"r": rank})
    out["all_gather_object"] = objs
    w = dist.all_reduce(t.clone(), async_op=True)
    w.wait()
    out["async"] = w.is_completed()
    return out


def test_world_size_1():
    """Every collective at world size 1 is the identity (and nothing blocks)."""
    o = pool(1).run(rank_world_size_1, timeout=60)[0]
    t = torch.arange(5.0) + 3
    assert o["backend"] == BACKEND
    for key, v in o.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, t), (key, v)
    assert o["all_gather_object"] == [{"r": 0}]
    assert o["async"] is True


# ------------------------------------------------------------------- subgroups


def rank_subgroups(rank, ws):
    torch.set_num_threads(1)
    g01 = dist.new_group([0, 1])
    g123 = dist.new_group([1, 2, 3])  # does not contain rank 0
    g23 = dist.new_group([2, 3])
    g31 = dist.new_group([3, 1])
    out = {}
    try:
        # g01 and g23 at the same time, on disjoint ranks
        if rank in (0, 1):
            out["g01_backend"] = dist.get_backend(g01)
            t = torch.tensor([rank + 1.0, 10.0 * rank])
            dist.all_reduce(t, group=g01)
            out["g01_all_reduce"] = t
        else:
            t = torch.tensor([rank + 1.0])
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g23)
            out["g23_max"] = t
        if rank in (1, 2, 3):
            out["g123_rank"] = dist.get_rank(g123)
            out["g123_backend"] = dist.get_backend(g123)
            t = torch.tensor([rank + 1.0])
            dist.all_reduce(t, group=g123)
            out["g123_all_reduce"] = t
            b = torch.arange(3.0) + 100 * rank
            dist.broadcast(b, src=2, group=g123)  # global rank 2
            out["g123_broadcast"] = b
            o = torch.zeros(6)
            dist.all_gather_single(o, torch.tensor([rank * 1.0, rank + 0.5]), group=g123)
            out["g123_all_gather_single"] = o
            a = torch.zeros(3)
            dist.all_to_all_single(a, torch.arange(3.0) + 10 * rank, group=g123)
            out["g123_all_to_all_single"] = a
            rs = torch.zeros(2)
            dist.reduce_scatter_single(rs, torch.arange(6.0) * rank, group=g123)
            out["g123_reduce_scatter_single"] = rs
            # p2p inside the subgroup by group rank: group rank 0 (global 1) <-> 2 (global 3)
            if rank in (1, 3):
                y = torch.zeros(4)
                peer = 2 if rank == 1 else 0
                if rank == 1:
                    dist.send(torch.arange(4.0) + rank, group=g123, group_dst=peer)
                    dist.recv(y, group=g123, group_src=peer)
                else:
                    dist.recv(y, group=g123, group_src=peer)
                    dist.send(torch.arange(4.0) + rank, group=g123, group_dst=peer)
                out["g123_p2p"] = y
            dist.barrier(group=g123)
        else:
            # not a member: torch makes the op a no-op (with a warning)
            t = torch.tensor([rank + 1.0])
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dist.all_reduce(t, group=g123)
            out["nonmember_unchanged"] = t
        if rank in (1, 3):
            t = torch.tensor([rank * 1.0])
            dist.all_reduce(t, group=g31)
            out["g31_all_reduce"] = t
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t)
        out["world_all_reduce"] = t
    finally:
        for g in (g01, g123, g23, g31):
            dist.destroy_process_group(g)
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    out["after_destroy"] = t
    return out


def test_new_group_subgroups():
    """new_group subgroups (one without rank 0, disjoint ones used concurrently): inherit
    the backend, every op uses group ranks correctly, non-members are left alone, the
    default group still works after the subgroups are destroyed."""
    res = pool(4).run(rank_subgroups, timeout=90)
    for r in (0, 1):
        assert res[r]["g01_backend"] == BACKEND
        assert res[r]["g01_all_reduce"].tolist() == [3.0, 10.0]
    for r in (2, 3):
        assert res[r]["g23_max"].tolist() == [4.0]
    for r in (1, 2, 3):
        o = res[r]
        assert o["g123_rank"] == r - 1 and o["g123_backend"] == BACKEND
        assert o["g123_all_reduce"].tolist() == [9.0]
        assert o["g123_broadcast"].tolist() == [200.0, 201.0, 202.0]
        assert o["g123_all_gather_single"].tolist() == [1.0, 1.5, 2.0, 2.5, 3.0, 3.5]
        gr = r - 1
        assert o["g123_all_to_all_single"].tolist() == [gr + 10.0 * s for s in (1, 2, 3)]
        assert o["g123_reduce_scatter_single"].tolist() == [6.0 * (2 * gr), 6.0 * (2 * gr + 1)]
    assert res[1]["g123_p2p"].tolist() == (torch.arange(4.0) + 3).tolist()
    assert res[3]["g123_p2p"].tolist() == (torch.arange(4.0) + 1).tolist()
    assert res[0]["nonmember_unchanged"].tolist() == [1.0]
    assert res[1]["g31_all_reduce"].tolist() == [4.0] and res[3]["g31_all_reduce"].tolist() == [4.0]
    for r in range(4):
        assert res[r]["world_all_reduce"].tolist() == [10.0]
        assert res[r]["after_destroy"].tolist() == [10.0]


# ------------------------------------------------------------ object collectives


def rank_objects(rank, ws):
    torch.set_num_threads(1)
    out = {}
    objs = [None] * ws
    dist.all_gather_object(
        objs, {"rank": rank, "payload": list(range(rank)), "s": "x" * (rank * 1000)}
    )
    out["all_gather_object"] = objs
    lst = [{"from": 1, "n": 42}, "hello", 3.5, None] if rank == 1 else [None] * 4
    dist.broadcast_object_list(lst, src=1)
    out["broadcast_object_list"] = lst
    g = [None] * ws if rank == 2 else None
    dist.gather_object(("g", rank), g, dst=2)
    out["gather_object"] = g
    recv = [None]
    dist.scatter_object_list(
        recv, [("s", k, [k] * k) for k in range(ws)] if rank == 0 else None, src=0
    )
    out["scatter_object_list"] = recv[0]
    return out


def test_object_collectives():
    """all_gather_object, broadcast_object_list, gather_object, scatter_object_list
    (torch pickles the objects by design; our own code never does)."""
    ws = 3
    res = pool(ws).run(rank_objects, timeout=60)
    for r, o in enumerate(res):
        assert o["all_gather_object"] == [
            {"rank": k, "payload": list(range(k)), "s": "x" * (k * 1000)} for k in range(ws)
        ]
        assert o["broadcast_object_list"] == [{"from": 1, "n": 42}, "hello", 3.5, None]
        assert o["scatter_object_list"] == ("s", r, [r] * r)
    assert res[2]["gather_object"] == [("g", k) for k in range(ws)]


# ------------------------------------------------- collectives inside future callbacks


def rank_future_callback(rank, ws, first_numel):
    """What DDP comm hooks (PowerSGD) do: a callback on a Work's future issues another
    collective and waits for it."""
    torch.set_num_threads(1)
    first = torch.full((first_numel,), float(rank))
    w = dist.all_reduce(first, async_op=True)

    def then_all_reduce(fut):
        fut.value()
        x = torch.tensor([rank + 1.0, 10.0 * rank])
        return dist.all_reduce(x, async_op=True).get_future().wait()[0]

    second = w.get_future().then(then_all_reduce)
    out = second.wait().clone()
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return out, first[:3].clone(), t.item()


@pytest.mark.parametrize("first_numel", [4, 300_000], ids=["small", "large"])
def test_collective_issued_from_future_callback(first_numel):
    """Work.get_future().then(cb) where cb runs all_reduce(async_op=True).get_future().wait()
    -- the pattern of the PowerSGD hook: must complete (callbacks may not run where the
    next op's completion needs to run)."""
    ws = 4
    res = pool(ws).run(rank_future_callback, first_numel, timeout=60)
    for r, (out, first, after) in enumerate(res):
        assert out.tolist() == [10.0, 60.0], (r, out)
        assert first.tolist() == [6.0] * 3, (r, first)
        assert after == 10.0


def rank_future_done_after_wait(rank, ws, numel, iters):
    torch.set_num_threads(1)
    bad = []
    for i in range(iters):
        x = torch.full((numel,), float(rank))
        w = dist.all_reduce(x, async_op=True)
        w.wait()
        fut = w.get_future()
        if not (w.is_completed() and fut.done()):
            bad.append((i, w.is_completed(), fut.done()))
        elif not torch.equal(fut.value()[0], torch.full((numel,), float(ws * (ws - 1) // 2))):
            bad.append((i, "wrong value"))
    return bad


@pytest.mark.parametrize("numel", [4, 300_000], ids=["small", "large"])
def test_future_completed_when_wait_returns(numel):
    """Once Work.wait() has returned, the Work is completed and so is its future, whose
    value() is the output (gloo behaves so; code that reads work.get_future().value()
    after wait() must not hit torch's "completed()" assertion)."""
    res = pool(2).run(rank_future_done_after_wait, numel, 30, timeout=60)
    assert res == [[], []], f"(iteration, work.is_completed(), future.done()) after wait(): {res}"


# -------------------------------------------------------------------------- DDP

DDP_STEPS = 4


def make_mlp():
    return nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )


def ddp_batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def rank_ddp(rank, ws, hook):
    torch.set_num_threads(1)
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(rank)  # different on every rank: DDP must broadcast rank 0's
    model = make_mlp()
    ddp = DDP(model)
    if hook == "allreduce_hook":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    elif hook == "powerSGD":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2, random_seed=0
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(DDP_STEPS):
        x, y = ddp_batch(rank, step)
        loss = F.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def ddp_reference(ws):
    """Single process: rank 0's initial model; each step the gradient averaged over the
    ranks' batches (what DDP's allreduce computes)."""
    torch.manual_seed(0)
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(DDP_STEPS):
        loss = sum(F.mse_loss(model(x), y) for x, y in (ddp_batch(r, step) for r in range(ws))) / ws
        loss.backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _same_on_all_ranks(res, what):
    for r in range(1, len(res)):
        for k, (a, b) in enumerate(zip(res[0], res[r])):
            assert torch.equal(a, b), f"{what}: parameter {k} differs between rank 0 and rank {r}"


@pytest.mark.parametrize("hook", ["builtin", "allreduce_hook"])
def test_ddp_allreduce(hook):
    """DDP with its built-in allreduce and with default_hooks.allreduce_hook: parameters
    after a few steps equal the single-process reference (and gloo's run), identical on
    every rank; the initial broadcast took rank 0's parameters."""
    ws = 4
    res = pool(ws).run(rank_ddp, hook, timeout=120)
    _same_on_all_ranks(res, f"DDP {hook}")
    ref = ddp_reference(ws)
    glo = gloo_pool(ws).run(rank_ddp, hook, timeout=120)
    for k, (p, q, g) in enumerate(zip(res[0], ref, glo[0])):
        torch.testing.assert_close(
            p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"DDP {hook} param {k} vs reference: {m}"
        )
        torch.testing.assert_close(
            p, g, rtol=1e-5, atol=1e-6, msg=lambda m: f"DDP {hook} param {k} vs gloo: {m}"
        )


def test_ddp_powersgd_hook():
    """DDP with the PowerSGD hook (uses Work futures and their output tensors): same
    parameters as the gloo run with the same seeds, identical on every rank, and really
    compressed (differs from the uncompressed reference)."""
    ws = 4
    res = pool(ws).run(rank_ddp, "powerSGD", timeout=120)
    _same_on_all_ranks(res, "DDP PowerSGD")
    glo = gloo_pool(ws).run(rank_ddp, "powerSGD", timeout=120)
    for k, (p, g) in enumerate(zip(res[0], glo[0])):
        torch.testing.assert_close(
            p, g, rtol=1e-4, atol=1e-5, msg=lambda m: f"PowerSGD param {k} vs gloo: {m}"
        )
    ref = ddp_reference(ws)
    assert any(not torch.allclose(p, q, rtol=1e-4, atol=1e-5) for p, q in zip(res[0], ref)), (
        "PowerSGD run equals the uncompressed reference: was the hook applied?"
    )


# -------------------------------------------------------------------- DeviceMesh


def rank_device_mesh(rank, ws):
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    out = {"default_backend": dist.get_backend()}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for dim in ("dp", "tp"):
        g = mesh.get_group(dim)
        out[f"{dim}_backend"] = dist.get_backend(g)
        t = torch.tensor([rank + 1.0, 100.0 * rank])
        dist.all_reduce(t, group=g)
        out[f"{dim}_all_reduce"] = t
    full = torch.arange(32.0).reshape(8, 4)
    dt = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
    out["local_shard"] = dt.to_local().clone()
    out["full_tensor"] = dt.full_tensor()
    out["replicated"] = dt.redistribute(mesh, [Replicate(), Replicate()]).to_local()
    out["sum"] = (dt * 2).sum().full_tensor()
    return out


def test_device_mesh():
    """init_device_mesh("cpu", (2, 2)) on the default group of the backend under test:
    both mesh dimensions' groups use it; all_reduce per mesh dimension; a DTensor sharded
    on both dimensions gathers back (full_tensor, redistribute, sum)."""
    res = pool(4).run(rank_device_mesh, timeout=90)
    full = torch.arange(32.0).reshape(8, 4)
    for r, o in enumerate(res):
        assert o["default_backend"] == BACKEND
        assert o["dp_backend"] == BACKEND and o["tp_backend"] == BACKEND, o
        # mesh [[0, 1], [2, 3]]: "dp" groups {0, 2} and {1, 3}; "tp" groups {0, 1} and {2, 3}
        dp = [q for q in range(4) if q % 2 == r % 2]
        tp = [q for q in range(4) if q // 2 == r // 2]
        assert o["dp_all_reduce"].tolist() == [sum(q + 1.0 for q in dp), sum(100.0 * q for q in dp)]
        assert o["tp_all_reduce"].tolist() == [sum(q + 1.0 for q in tp), sum(100.0 * q for q in tp)]
        i, j = r // 2, r % 2
        assert torch.equal(o["local_shard"], full[4 * i : 4 * i + 4, 2 * j : 2 * j + 2])
        assert torch.equal(o["full_tensor"], full)
        assert torch.equal(o["replicated"], full)
        assert o["sum"].item() == 2 * full.sum().item()


# ------------------------------------------------------------------------- FSDP2

FSDP_STEPS = 5


def rank_fsdp2(rank, ws):
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )
    mesh = init_device_mesh("cpu", (ws,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    losses = []
    for step in range(FSDP_STEPS):
        x, y = ddp_batch(rank, step)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "params": params, "mesh_backend": dist.get_backend(mesh.get_group())}


def test_fsdp2_losses_equal_gloo():
    """A short FSDP2 (fully_shard) run: per-step losses (and final parameters) equal the
    same run on gloo with the same seed and data, on every rank."""
    ws = 4
    res = pool(ws).run(rank_fsdp2, timeout=180)
    glo = gloo_pool(ws).run(rank_fsdp2, timeout=180)
    for r in range(ws):
        assert res[r]["mesh_backend"] == BACKEND
        torch.testing.assert_close(
            torch.tensor(res[r]["losses"]),
            torch.tensor(glo[r]["losses"]),
            rtol=1e-5,
            atol=1e-6,
            msg=lambda m: f"FSDP2 losses, rank {r}: {m}",
        )
        for k in glo[r]["params"]:
            torch.testing.assert_close(
                res[r]["params"][k],
                glo[r]["params"][k],
                rtol=1e-4,
                atol=1e-5,
                msg=lambda m: f"FSDP2 param {k}, rank {r}: {m}",
            )
    # the losses moved (the run trained) and the ranks saw different data
    assert res[0]["losses"][0] != res[0]["losses"][-1]
    assert res[0]["losses"][0] != res[1]["losses"][0]


# ----------------------------------------------------------- distributed checkpoint


def rank_dcp(rank, ws, path):
    torch.set_num_threads(1)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ws,))
    full = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6) * 0.5
    sd = {
        "sharded": distribute_tensor(full, mesh, [Shard(0)]),
        "replicated": torch.arange(5.0) * 3,
        "step": torch.tensor(7),
    }
    dcp.save(sd, checkpoint_id=path)
    dist.barrier()
    target = {
        "sharded": distribute_tensor(torch.zeros(8, 6), mesh, [Shard(0)]),
        "replicated": torch.zeros(5),
        "step": torch.tensor(0),
    }
    dcp.load(target, checkpoint_id=path)
    return {
        "local": target["sharded"].to_local().clone(),
        "expected_local": sd["sharded"].to_local().clone(),
        "full": target["sharded"].full_tensor(),
        "replicated": target["replicated"],
        "step": target["step"].item(),
    }


def test_distributed_checkpoint_save_load(tmp_path):
    """torch.distributed.checkpoint: save a sharded DTensor, a replicated tensor and a
    step counter over the group into a temporary directory, load into zeroed state:
    every value restored."""
    ws = 4
    path = str(tmp_path / "ckpt")
    res = pool(ws).run(rank_dcp, path, timeout=120)
    full = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6) * 0.5
    for r, o in enumerate(res):
        assert torch.equal(o["local"], o["expected_local"]), r
        assert torch.equal(o["full"], full), r
        assert torch.equal(o["replicated"], torch.arange(5.0) * 3), r
        assert o["step"] == 7


# ========================== re-initialising the default group with the same store

REINIT_SCRIPT = textwrap.dedent("""
    import json, sys
    from datetime import timedelta
    import torch
    import torch.distributed as dist
    import mooncake_pg

    torch.set_num_threads(1)
    rank, ws, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    transports = sys.argv[4].split(",")
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    out = []
    for it, tr in enumerate(transports):
        dist.init_process_group(backend="mooncake", store=store, rank=rank, world_size=ws,
                                timeout=timedelta(seconds=30),
                                pg_options=mooncake_pg.MooncakeOptions(timeout=10.0, transport=tr))
        rec = {"it": it, "requested": tr, "transport": mooncake_pg.backend_of().transport}
        x = torch.full((1000,), float(rank + it))
        dist.all_reduce(x)
        big = torch.arange(200_000, dtype=torch.float64) * (rank + 1) + it
        dist.all_reduce(big)
        nxt, prv = (rank + 1) % ws, (rank - 1) % ws
        r = torch.full((3,), -7.0)
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((3,), float(10 * it + rank)), nxt),
                                         dist.P2POp(dist.irecv, r, prv)]):
            w.wait()
        g = dist.new_group(list(range(ws)))
        y = torch.full((2,), float(rank))
        dist.all_reduce(y, group=g)
        rec.update(x=x.tolist()[:3] + [x.unique().numel()], big_sum=float(big.sum()),
                   big_first=big[:3].tolist(), ring=r.tolist(), group=y.tolist())
        out.append(rec)
        dist.destroy_process_group()
    print("RESULT " + json.dumps(out), flush=True)
""")


@O.mooncake_only
@pytest.mark.timeout(90)
def test_reinit_default_group_same_store(tmp_path):
    ws = 2
    transports = ["shm", "tcp", "shm"]
    script = tmp_path / "reinit_rank.py"
    script.write_text(REINIT_SCRIPT)
    # the store is hosted here, on a listening socket bound to 127.0.0.1 with a port the
    # kernel picks (TCPStore's own listener would bind every interface)
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(64)
    port = lsock.getsockname()[1]
    store = dist.TCPStore(
        "127.0.0.1",
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=30),
        master_listen_fd=lsock.fileno(),
    )
    assert store.port == port
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [rankpool.REPO_ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    env.update(
        {
            "MOONCAKE_SOCKET_IFNAME": "lo",
            "GLOO_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }
    )
    env.pop("MOONCAKE_TRANSPORT", None)
    procs = []
    try:
        for r in range(ws):
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(script), str(r), str(ws), str(port), ",".join(transports)],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=str(tmp_path),
                    start_new_session=True,
                    preexec_fn=rankpool._set_pdeathsig,
                )
            )
        outs = []
        deadline = time.monotonic() + 75
        for p in procs:
            try:
                text, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                kill_group(p, wait_s=10)
                text, _ = p.communicate()
                pytest.fail(
                    f"a rank did not finish re-initialising in time:\n{text.decode(errors='replace')[-4000:]}"
                )
            outs.append((p.returncode, text.decode(errors="replace")))
    finally:
        for p in procs:
            kill_group(p, wait_s=10)
        del store
        try:
            lsock.close()
        except OSError:
            pass
    results = []
    for r, (rc, text) in enumerate(outs):
        assert rc == 0, f"rank {r} exited with {rc}:\n{text[-4000:]}"
        line = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
        assert line, f"rank {r} printed no result:\n{text[-4000:]}"
        results.append(json.loads(line[-1][len("RESULT ") :]))
    ref_big = torch.arange(200_000, dtype=torch.float64)
    for r in range(ws):
        assert len(results[r]) == len(transports), f"rank {r}: {results[r]}"
        for it, tr in enumerate(transports):
            rec = results[r][it]
            ctx = f"rank {r} iteration {it} ({tr})"
            assert rec["transport"] == tr, f"{ctx}: group uses transport {rec['transport']!r}"
            s = float(sum(q + it for q in range(ws)))
            assert rec["x"] == [s, s, s, 1], f"{ctx}: all_reduce gave {rec['x']}, expected all {s}"
            big = ref_big * (ws * (ws + 1) / 2) + it * ws
            assert rec["big_sum"] == float(big.sum()) and rec["big_first"] == big[:3].tolist(), (
                f"{ctx}: pipelined all_reduce gave first {rec['big_first']} sum {rec['big_sum']}"
            )
            prv = (r - 1) % ws
            assert rec["ring"] == [float(10 * it + prv)] * 3, f"{ctx}: p2p ring gave {rec['ring']}"
            assert rec["group"] == [float(ws * (ws - 1) / 2)] * 2, (
                f"{ctx}: new_group all_reduce gave {rec['group']}"
            )
