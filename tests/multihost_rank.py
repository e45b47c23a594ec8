"""The rank side of :mod:`tests.multihost`: ``python -m tests.multihost_rank`` with MH_* set.

Joins the group (``init_process_group(MH_BACKEND, init_method=MH_INIT, ...)``), runs the
scenario named by MH_SCENARIO with the JSON arguments of MH_ARGS, writes its JSON result
to MH_RESULT_FILE (or prints ``RESULT <json>`` without it).
``MooncakeOptions`` come from MH_ARGS' "options" and, per rank, MH_OPTIONS (JSON).
An exception becomes ``{"error": type name, "message": ...}`` (still a RESULT line).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist


def _jsonable(x):
    if isinstance(x, torch.Tensor):
        return {"tensor": x.tolist(), "dtype": str(x.dtype).replace("torch.", "")}
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


# ------------------------------------------------------------------ scenarios


def every_op(rank, world_size):
    """Every collective and p2p op once (tests.pg.every_op), on the default group."""
    from tests.pg.every_op import run_collectives

    return run_collectives()


def conformance(rank, world_size):
    """every_op and the dtype/shape sweep on the default group, then on a subgroup that
    spans hosts (the first and the last rank) and on one inside host 0 (its ranks)."""
    from tests.pg.every_op import run_collectives, run_sweep

    per_host = [int(g) for g in os.environ["MH_RANKS_PER_HOST"].split(",")]
    out = {"world": {**run_collectives(), **run_sweep()}}
    spanning = dist.new_group([0, world_size - 1])
    inside = dist.new_group(list(range(per_host[0])))
    if rank in (0, world_size - 1):
        out["spanning"] = {**run_collectives(spanning), **run_sweep(spanning)}
    if rank < per_host[0]:
        out["inside"] = {**run_collectives(inside), **run_sweep(inside)}
    return out


def until_host_lost(rank, world_size, survivors_sum, progress_dir):
    """all_reduce of [rank + 1] in a loop (on_failure="mask"), writing the number of ops done
    to progress_dir/<rank>, until 10 results in a row equal survivors_sum (the other host
    was cut off and agreed failed). Returns the longest op and the membership."""
    import mooncake_pg

    done, longest, tail = 0, 0.0, 0
    path = os.path.join(progress_dir, str(rank))
    while tail < 10:
        t = torch.tensor([rank + 1.0])
        t0 = time.monotonic()
        dist.all_reduce(t)
        longest = max(longest, time.monotonic() - t0) if done else 0.0
        done += 1
        tail = tail + 1 if t.item() == survivors_sum else 0
        with open(path, "w") as f:
            f.write(str(done))
        time.sleep(0.01)
    return {
        "longest_op_s": longest,
        "active": mooncake_pg.get_active_ranks().tolist(),
        "epoch": mooncake_pg.get_epoch(),
    }


def busy_between_ops(rank, world_size, busy_rank, busy_s):
    """Rank busy_rank computes (sleeps) busy_s between two all_reduces while the others wait
    inside the second: nobody may be blamed (the op timeout is longer than busy_s)."""
    import mooncake_pg

    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    if rank == busy_rank:
        time.sleep(busy_s)
    t0 = time.monotonic()
    u = torch.tensor([rank + 1.0])
    dist.all_reduce(u)
    return {
        "first": t.item(),
        "second": u.item(),
        "waited_s": time.monotonic() - t0,
        "active": mooncake_pg.get_active_ranks().tolist(),
        "epoch": mooncake_pg.get_epoch(),
    }


def late_host(rank, world_size, late_ranks, late_s):
    """An all_reduce of [rank + 1] on every rank, then a second one that late_ranks (a whole
    host) enter late_s after the others (longer than the op timeout): returns both sums and
    the membership; a late rank whose second op raises returns the error's type and that of
    a third op. The others stay alive until the late ones are done (a process that exits
    would be a reason of its own to fail the op)."""
    import mooncake_pg

    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    if rank in late_ranks:
        time.sleep(late_s)
    u = torch.tensor([rank + 1.0])
    try:
        dist.all_reduce(u)
    except Exception as e:
        if rank not in late_ranks:
            raise
        errors = [type(e).__name__]
        try:
            dist.all_reduce(u)
            errors.append(None)
        except Exception as e3:
            errors.append(type(e3).__name__)
        return {"errors": errors}
    finally:
        if rank not in late_ranks:
            time.sleep(late_s + 2.0)
    return {
        "first": t.item(),
        "second": u.item(),
        "active": mooncake_pg.get_active_ranks().tolist(),
        "epoch": mooncake_pg.get_epoch(),
    }


def large_ops(rank, world_size, counts):
    """The ops that run in two levels across hosts (all_reduce, reduce, reduce_scatter,
    all_gather, broadcast) at the element counts given (above the one-round size; several
    pieces with a small shm_slot_bytes), in several dtypes and ReduceOps, rooted ops with
    roots on every host and at a local index other than 0; each checked here against the
    value torch computes from every rank's input (tests.pg.every_op.large_cases)."""
    from tests.pg.every_op import run_large

    return run_large(counts)


def bytes_out(rank, world_size, nbytes, ops=None, broadcast_src=None):
    """Bytes that left this rank's host (its eth0) during one all_reduce, reduce_scatter,
    all_gather_into_tensor and broadcast (from broadcast_src, default the last rank) of
    about nbytes (float32), between barriers: the traffic of the whole host, which the test
    compares with the link bound. ops: the names to run (default all)."""

    def tx():
        with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
            return int(f.read())

    n = nbytes // 4
    table = {
        "all_reduce": lambda: dist.all_reduce(torch.ones(n)),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(
            torch.empty(n // world_size), torch.ones(n // world_size * world_size)
        ),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(
            torch.empty(n * world_size), torch.ones(n)
        ),
        "broadcast": lambda: dist.broadcast(
            torch.ones(n), src=world_size - 1 if broadcast_src is None else broadcast_src
        ),
    }
    if ops is not None:
        table = {k: table[k] for k in ops}
    out = {}
    for name, fn in table.items():
        fn()  # warm: connections and pages
        dist.barrier()
        time.sleep(0.2)
        dist.barrier()
        before = tx()
        fn()
        dist.barrier()
        time.sleep(0.2)  # the host's other ranks finish sending too
        out[name] = tx() - before
    return out


def ep_layout(rank, world_size, topk_idx, num_experts):
    """mooncake_pg.get_rank_hosts and mooncake_ep's get_dispatch_layout of topk_idx (rows of
    expert ids, -1 = none) on the default group."""
    import mooncake_ep
    import mooncake_pg

    layout = mooncake_ep.Buffer().get_dispatch_layout(torch.tensor(topk_idx), num_experts)
    return {
        "rank_hosts": mooncake_pg.get_rank_hosts().tolist(),
        "layout": {k: None if v is None else v.tolist() for k, v in layout._asdict().items()},
    }


def ep_routing(rank, world_size, ranks_per_host, mode, T, H, E, K, dtype="float32", seed=0):
    """One rank's EP inputs (tests.ep.eputil.make_inputs) with its routing made ``mode``:
    random, masked (-1 slots), dup (slot 1 repeats slot 0), skew (every token to experts
    0..K-1), last_host (every token to experts of the last host's ranks)."""
    from tests.ep.eputil import make_inputs

    x, idx, w = make_inputs(
        rank, T, H, E, K, getattr(torch, dtype), seed=seed, masked=0.3 if mode == "masked" else 0.0
    )
    if mode == "dup" and K > 1:
        idx[:, 1] = idx[:, 0]
    elif mode == "skew":
        idx[:] = torch.arange(K)
    elif mode == "last_host":
        L = E // world_size
        first = (world_size - ranks_per_host[-1]) * L
        g = torch.Generator().manual_seed(seed * 7 + rank)
        n = min(K, E - first)  # slots beyond the host's experts stay -1
        idx = torch.full((T, K), -1, dtype=torch.int64)
        for t in range(T):
            idx[t, :n] = first + torch.randperm(E - first, generator=g)[:n]
    return x, idx, w


def ep_round_trip(
    rank,
    world_size,
    ranks_per_host,
    modes,
    T,
    H,
    E,
    K,
    dtype="float32",
    values=True,
    hierarchical=True,
    pieces=None,
):
    """For each routing mode (ep_routing): a normal-mode dispatch, the scaled experts of
    tests.ep.eputil (expert e scales by 1 + e / 8, weighted by recv_topk_weights), combine,
    and the backward of sum(combined * g) (g: tokens of seed 1); a cached dispatch of the
    seed-2 tokens through the same experts; a low-latency round trip with the backward of
    the same sum, and one with fp8 rows (dequantized before the experts). Returns the results
    and gradients for the test's reference, and the bytes that left this rank's host
    during the plain round trip and a low-latency one (between barriers); values=False: only
    the bytes. ``pieces``: the dispatches and combines move in that many pieces (a power of two
    up to 8: mooncake_ep._hosts.MAX_PIECES, with pieces of test-sized rows)."""
    import mooncake_ep
    from tests.ep.eputil import make_inputs, scaled_experts_ll, scaled_experts_normal

    if pieces is not None:  # every rank the same: the header's ranges follow MAX_PIECES
        from mooncake_ep import _hosts

        _hosts.PIECE_BYTES, _hosts.MAX_PIECES = 64, pieces
    buf = mooncake_ep.Buffer(config=mooncake_ep.EPConfig(hierarchical=hierarchical))
    L = E // world_size

    def scale(e):
        return 1.0 + e / 8

    def tx():
        with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
            return int(f.read())

    out = {}
    for mode in modes:
        x, idx, w = ep_routing(rank, world_size, ranks_per_host, mode, T, H, E, K, dtype)
        g = make_inputs(rank, T, H, E, K, x.dtype, seed=1)[0]
        x2 = make_inputs(rank, T, H, E, K, x.dtype, seed=2)[0]
        # the bytes of a plain round trip, without autograd
        dist.barrier()
        time.sleep(0.2)
        dist.barrier()
        before = tx()
        r = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
        y = scaled_experts_normal(r.recv_x, r.recv_topk_idx, r.recv_topk_weights, rank, L, scale)
        buf.combine(y, r.handle)
        dist.barrier()
        time.sleep(0.2)
        dist.barrier()
        host_tx = tx() - before
        before = tx()
        ll = buf.low_latency_dispatch(x, idx, T, E)
        buf.low_latency_combine(scaled_experts_ll(ll.recv_x, rank, L, scale), idx, w, ll.handle)
        dist.barrier()
        time.sleep(0.2)
        dist.barrier()
        ll_host_tx = tx() - before
        out[mode] = {
            "host_tx": host_tx,
            "ll_host_tx": ll_host_tx,
            "per_host": buf.get_dispatch_layout(idx, E).num_tokens_per_rdma_rank.tolist(),
            "two_level": r.handle.route is not None,
            "pieces": r.handle.route.chunks if r.handle.route is not None else 0,
        }
        if not values:
            continue
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        r = buf.dispatch(xg, topk_idx=idx, topk_weights=wg, num_experts=E)
        y = scaled_experts_normal(r.recv_x, r.recv_topk_idx, r.recv_topk_weights, rank, L, scale)
        combined = buf.combine(y, r.handle).combined_x
        (combined.float() * g.float()).sum().backward()
        r2 = buf.dispatch(x2, handle=r.handle)
        y2 = scaled_experts_normal(r2.recv_x, r.recv_topk_idx, r.recv_topk_weights, rank, L, scale)
        cached = buf.combine(y2, r.handle).combined_x
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        ll = buf.low_latency_dispatch(xl, idx, T, E)
        ll_out = buf.low_latency_combine(
            scaled_experts_ll(ll.recv_x, rank, L, scale), idx, wl, ll.handle
        ).combined_x
        (ll_out.float() * g.float()).sum().backward()
        q = buf.low_latency_dispatch(x, idx, T, E, use_fp8=True)
        deq = mooncake_ep.fp8_dequantize(*q.recv_x).to(x.dtype)
        fp8_out = buf.low_latency_combine(
            scaled_experts_ll(deq, rank, L, scale), idx, w, q.handle
        ).combined_x
        out[mode].update(
            low_latency_fp8=fp8_out.double().tolist(),
            combined=combined.detach().double().tolist(),
            grad_x=xg.grad.double().tolist(),
            grad_w=wg.grad.double().tolist(),
            cached=cached.double().tolist(),
            low_latency=ll_out.detach().double().tolist(),
            low_latency_grad_x=xl.grad.double().tolist(),
            low_latency_grad_w=wl.grad.double().tolist(),
            low_latency_two_level=ll.handle.rows is not None and q.handle.rows is not None,
        )
    return out


def ep_kill_relay(rank, world_size, ranks_per_host, victim, T, H, E, K):
    """A normal-mode and a low-latency dispatch across hosts (two levels), then the victim
    SIGKILLs itself before the combines (it relays the tokens of the ranks of its local
    index elsewhere); the survivors combine both, then run a second normal round trip over
    the survivors. Expert e scales by 1 + e / 8 (tests.ep.eputil). Returns the results,
    the membership after, and whether the round trips went in two levels."""
    import signal

    import mooncake_ep
    import mooncake_pg
    from tests.ep.eputil import scaled_experts_ll, scaled_experts_normal

    buf = mooncake_ep.Buffer()
    L = E // world_size

    def scale(e):
        return 1.0 + e / 8

    x, idx, w = ep_routing(rank, world_size, ranks_per_host, "random", T, H, E, K)
    r = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    y = scaled_experts_normal(r.recv_x, r.recv_topk_idx, r.recv_topk_weights, rank, L, scale)
    ll = buf.low_latency_dispatch(x, idx, T, E)
    ll_y = scaled_experts_ll(ll.recv_x, rank, L, scale)
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    first = buf.combine(y, r.handle).combined_x
    ll_first = buf.low_latency_combine(ll_y, idx, w, ll.handle).combined_x
    r2 = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    y2 = scaled_experts_normal(r2.recv_x, r2.recv_topk_idx, r2.recv_topk_weights, rank, L, scale)
    second = buf.combine(y2, r2.handle).combined_x
    return {
        "first": first.double().tolist(),
        "low_latency_first": ll_first.double().tolist(),
        "second": second.double().tolist(),
        "two_level_after": r2.handle.route is not None,
        "low_latency_two_level": ll.handle.rows is not None,
        "active": mooncake_pg.get_active_ranks().tolist(),
        "epoch": mooncake_pg.get_epoch(),
        "first_epoch": r.handle.epoch,
    }


def ws_group_kill(rank, world_size, victim, tensors, tensor_mib):
    """GroupWeightSync from rank 0 (alone on its host) in buckets of one tensor: version 1
    reaches every rank; during version 2 the victim (a rank that passes the buckets on to
    its host) SIGKILLs itself after its second bucket arrived. Returns the version each
    survivor holds, whether version 2 raised, and SHA-256 digests of its tensors."""
    import hashlib
    import signal

    from mooncake_store import GroupWeightSync, WeightSyncAbortedError

    def state(version):
        g = torch.Generator().manual_seed(version)
        n = tensor_mib << 18  # float32 elements
        return {f"w{i}": torch.randn(n, generator=g) for i in range(tensors)}

    gs = GroupWeightSync(src=0, bucket_bytes=tensor_mib << 20)
    model = state(1) if rank == 0 else state(0)
    gs.sync(model, 1 if rank == 0 else None)

    def hook(i):
        if rank == victim and i == 1:
            os.kill(os.getpid(), signal.SIGKILL)

    if rank == 0:
        model = state(2)
    error = None
    try:
        gs.sync(model, 2 if rank == 0 else None, stage_hook=hook)
    except WeightSyncAbortedError as e:
        error = str(e)[:300]
    return {
        "version": gs.version,
        "error": error,
        "digests": {k: hashlib.sha256(v.numpy().tobytes()).hexdigest() for k, v in model.items()},
    }


def ws_store_relay(rank, world_size, tensors, tensor_mib):
    """``WeightSync`` publish on rank 0 (alone on its host, which also runs the store
    master) and a pull of that version on every other rank at once, relays on. Returns
    the bytes that left rank 0's host during the pulls, each reader's relay position and
    the SHA-256 digests of the tensors it installed."""
    import hashlib

    from mooncake_store import MooncakeStore, WeightSync, WeightSyncConfig
    from mooncake_store.master import Master, MasterConfig

    def tx():
        with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
            return int(f.read())

    def state(version):
        g = torch.Generator().manual_seed(version)
        return {f"w{i}": torch.randn(tensor_mib << 18, generator=g) for i in range(tensors)}

    from tests.multihost import store_master_address

    host0, mport = store_master_address()
    master_addr = f"{host0}:{mport}"
    master = None
    if rank == 0:
        master = Master(MasterConfig(host=host0, port=mport)).start()
    dist.barrier()
    nbytes = tensors * tensor_mib << 20
    store = MooncakeStore(
        master=master_addr, segment_size=(4 if rank == 0 else 2) * nbytes + (16 << 20)
    )
    # relays pass each bucket on in four parts (the publisher's value holds for all)
    cfg = WeightSyncConfig(bucket_bytes=tensor_mib << 20, relay_part_bytes=tensor_mib << 18)
    ws = WeightSync(store, "mh", config=cfg)
    model = state(1) if rank == 0 else {k: torch.zeros_like(t) for k, t in state(0).items()}
    if rank == 0:
        ws.publish(model, 1)
    # counted before the barrier: the readers may start pulling from rank 0's segment (its
    # background threads serve them) before rank 0's own thread returns from it
    before = tx()
    dist.barrier()
    position = ws.pull(model).relay_position if rank else None
    dist.barrier()
    out = {
        "tx": tx() - before,
        "position": position,
        "digests": {k: hashlib.sha256(v.numpy().tobytes()).hexdigest() for k, v in model.items()},
    }
    store.close()
    dist.barrier()  # every client closed before the master goes
    if master is not None:
        master.stop()
    return out


def _loop(ops, one, linger_s):
    """Runs ``one()`` (an op, returning its checked result) ops times; the first error ends
    the loop with its type name. Returns the results and the membership afterwards. After
    an error the rank stays linger_s before it returns: rank 0 hosts the store, which the
    others still need to read the agreed outcome."""
    import mooncake_pg

    results = []
    for _ in range(ops):
        try:
            results.append(one())
        except Exception as e:  # the outcome is what is compared
            results.append(type(e).__name__)
            time.sleep(linger_s)
            break
    return {
        "results": results,
        "active": mooncake_pg.get_active_ranks().tolist(),
        "epoch": mooncake_pg.get_epoch(),
    }


def loop_all_reduce(rank, world_size, ops, count, linger_s=3.0):
    """ops all_reduces of count float32 elements equal to rank + 1 (see _loop); each op's
    value (every element equal, else "uneven"). A rank may SIGKILL itself through
    MOONCAKE_FAULT_INJECT."""

    def one():
        t = torch.full((count,), rank + 1.0)
        dist.all_reduce(t)
        return t[0].item() if bool((t == t[0]).all()) else "uneven"

    return _loop(ops, one, linger_s)


def loop_broadcast(rank, world_size, ops, count, src=0, linger_s=3.0):
    """ops broadcasts from src of count float32 elements, op i's equal to 10 + i on src and
    -1 elsewhere (see _loop); each op's value (every element equal, else "uneven"). A rank
    may SIGKILL itself through MOONCAKE_FAULT_INJECT."""
    done = [0]

    def one():
        t = torch.full((count,), 10.0 + done[0] if rank == src else -1.0)
        done[0] += 1
        dist.broadcast(t, src=src)
        return t[0].item() if bool((t == t[0]).all()) else "uneven"

    return _loop(ops, one, linger_s)


def loop_all_to_all(
    rank, world_size, ops, count, local_count, kill_at=None, kill_after_s=0.0, linger_s=3.0
):
    """ops all_to_all_singles (float32) of count elements to every rank of another host
    and local_count to those of this host, the block for rank j equal to 100 x rank + j,
    into an output of -1 (see _loop); per op each source's block value (-1: untouched,
    "uneven": mixed). kill_at=(rank, op): that rank SIGKILLs itself kill_after_s into
    that op (a timer thread: while frames are in flight, not at a round's edge)."""
    import signal
    import threading

    g = int(os.environ["MH_RANKS_PER_HOST"].split(",")[0])  # hosts of g ranks each
    done = [0]

    def n(s, d):
        return local_count if s // g == d // g else count

    def one():
        if kill_at is not None and tuple(kill_at) == (rank, done[0]):
            threading.Timer(kill_after_s, os.kill, (os.getpid(), signal.SIGKILL)).start()
        done[0] += 1
        x = torch.cat([torch.full((n(rank, j),), 100.0 * rank + j) for j in range(world_size)])
        y = torch.full((sum(n(s, rank) for s in range(world_size)),), -1.0)
        dist.all_to_all_single(
            y, x, [n(s, rank) for s in range(world_size)], [n(rank, j) for j in range(world_size)]
        )
        blocks = torch.split(y, [n(s, rank) for s in range(world_size)])
        return [b[0].item() if bool((b == b[0]).all()) else "uneven" for b in blocks]

    return _loop(ops, one, linger_s)


SCENARIOS = {
    "loop_all_reduce": loop_all_reduce,
    "loop_all_to_all": loop_all_to_all,
    "loop_broadcast": loop_broadcast,
    "large_ops": large_ops,
    "bytes_out": bytes_out,
    "every_op": every_op,
    "conformance": conformance,
    "until_host_lost": until_host_lost,
    "busy_between_ops": busy_between_ops,
    "late_host": late_host,
    "ep_layout": ep_layout,
    "ep_round_trip": ep_round_trip,
    "ep_kill_relay": ep_kill_relay,
    "ws_group_kill": ws_group_kill,
    "ws_store_relay": ws_store_relay,
}


def main() -> None:
    rank, world_size = int(os.environ["MH_RANK"]), int(os.environ["MH_WORLD_SIZE"])
    args = json.loads(os.environ.get("MH_ARGS") or "{}")
    backend = os.environ.get("MH_BACKEND", "mooncake")
    try:
        torch.set_num_threads(1)
        kw = {}
        if backend == "mooncake":
            import mooncake_pg

            opts = {**args.pop("options", {}), **json.loads(os.environ.get("MH_OPTIONS") or "{}")}
            kw["pg_options"] = mooncake_pg.MooncakeOptions(**opts)
        dist.init_process_group(
            backend,
            init_method=os.environ["MH_INIT"],
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=60),
            **kw,
        )
        res = SCENARIOS[os.environ["MH_SCENARIO"]](rank, world_size, **args)
        dist.destroy_process_group()
    except BaseException as e:  # reported, not raised: the test compares outcomes
        res = {
            "error": type(e).__name__,
            "message": str(e)[:2000],
            "tb": traceback.format_exc()[-3000:],
            "unix_s": time.time(),
        }
    text = json.dumps(_jsonable(res))
    path = os.environ.get("MH_RESULT_FILE")
    try:
        if not path:
            raise OSError("no MH_RESULT_FILE")
        with open(path + ".tmp", "w") as f:  # whole, or not at all: written aside, renamed
            f.write(text)
        os.replace(path + ".tmp", path)
    except OSError:
        print("RESULT " + text, flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
