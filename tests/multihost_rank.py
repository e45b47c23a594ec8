"""The rank side of :mod:`tests.multihost`: ``python -m tests.multihost_rank`` with MH_* set.

Joins the group (``init_process_group(MH_BACKEND, init_method=MH_INIT, ...)``), runs the
scenario named by MH_SCENARIO with the JSON arguments of MH_ARGS, prints ``RESULT <json>``.
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


def loop_all_reduce(rank, world_size, ops, count, linger_s=3.0):
    """ops all_reduces of count float32 elements equal to rank + 1; the first error ends the
    loop. Returns each op's value (every element equal, else "uneven") or the error's type
    name, and the membership afterwards (a rank may SIGKILL itself through
    MOONCAKE_FAULT_INJECT). After an error the rank stays linger_s before it returns: rank 0
    hosts the store, which the others still need to read the agreed outcome."""
    import mooncake_pg

    results = []
    for _ in range(ops):
        t = torch.full((count,), rank + 1.0)
        try:
            dist.all_reduce(t)
        except Exception as e:  # the outcome is what is compared
            results.append(type(e).__name__)
            time.sleep(linger_s)
            break
        results.append(t[0].item() if bool((t == t[0]).all()) else "uneven")
    return {
        "results": results,
        "active": mooncake_pg.get_active_ranks().tolist(),
        "epoch": mooncake_pg.get_epoch(),
    }


SCENARIOS = {
    "loop_all_reduce": loop_all_reduce,
    "large_ops": large_ops,
    "bytes_out": bytes_out,
    "every_op": every_op,
    "conformance": conformance,
    "until_host_lost": until_host_lost,
    "busy_between_ops": busy_between_ops,
    "ep_layout": ep_layout,
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
    print("RESULT " + json.dumps(_jsonable(res)), flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
