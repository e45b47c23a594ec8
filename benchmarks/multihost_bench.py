#!/usr/bin/env python3
"""Collectives across emulated hosts, against gloo and the link bound, in the same run.

H hosts of G ranks each are network namespaces on one bridge (tests/netns.py); every host's
link is limited with tc (tbf, full duplex: the rate applies to each direction), so the link
and not the machine's two cores decides the time, and the figures are stable enough to
compare. Ranks rendezvous through ``init_method="tcp://<host 0>:PORT"`` with no interface
hint for mooncake (gloo needs ``GLOO_SOCKET_IFNAME=eth0``: the namespaces' hostnames do not
resolve).

    python benchmarks/multihost_bench.py                         # 2x2 and 4x2, 2 Gbit/s
    python benchmarks/multihost_bench.py --topologies 2x4 --sizes 4M,16M --link-rate 1G
    python benchmarks/multihost_bench.py --smoke                 # CI: 2x2, small sizes

Method. One set of rank processes per topology runs both backends. The default group is
gloo and only the control plane (barriers, iteration counts, collecting times); each
backend under test has its own group over all ranks. For every (op, size) and backend: one
checked call (outputs compared exactly with values computed independently on each rank),
one counted call (the bytes that left each host's eth0 during it, read from the kernel's
counters: traffic that was measured, not assumed), one warm-up, then N timed calls in
rounds that alternate the backends, every call started on all ranks at once (below). The
time of a call is the maximum over ranks, the reported time the median over calls.

Columns. size is the largest buffer, as in nccl-tests (all_gather: the output,
reduce_scatter: the input, all_to_all: each rank's input); busbw follows nccl-tests. The
**link bound** is the bytes that must leave the busiest host at least, divided by the
link rate (S = size, H hosts, G ranks on the largest host):

    all_reduce        2 (H-1)/H x S     reduce-scatter then all-gather between hosts
    reduce_scatter    (H-1)/H x S       each host's sum of the other hosts' stripes
    all_gather        (H-1)/H x S       every host receives the others' parts (relays allowed)
    broadcast         S                 the root's host sends S once (pipelined chain)
    all_to_all        G x S x (H-1)/H   each rank's rows for the other hosts

(Thakur, Rabenseifner and Gropp 2005 for the collective lower bounds; the factors are the
standard ones of a full-duplex link per host.) %bound = bound / time. "MB out" is the
busiest host's counted bytes per call. "CPU ms" is the user + system time of every rank
process (all its threads, ``time.process_time``) during one timed call, summed over the
ranks, median over calls: what the collective costs the hosts' cores, waiting included
(a rank that spins while it waits shows here, not in the time). "CPU mc/gloo" is ours
over gloo's; below 1 we use fewer cores.

Start. Before every timed call the ranks agree (one control all_reduce) on a moment 10 ms
ahead and sleep until it, so they enter the call together, within the wake-up spread of
8 processes on 2 cores (about 0.5 ms). A barrier alone releases them one by one, up to
4 ms apart, and that spread would count in the time of an op that waits for every rank
but not in one whose late ranks find their data already there (gloo's broadcast). The
moment comes from ``time.perf_counter`` (CLOCK_MONOTONIC), one clock for every rank
because the hosts are namespaces of one kernel. "start spread" is the median over calls of
how far apart the ranks entered (ours / gloo's; a rank that keeps the cores busy when it
enters shows here too), and the JSON adds ``after_last_start_s``, the median time from
the last rank's entry to the last exit.

Output: a table per topology on stdout, JSON (--json, default bench_out/multihost_bench.json)
and the same tables in markdown beside it (.md).
Exit status 0 when every rank finished and every checked result was right (slower numbers
never fail the run), else 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the repository root: the test helpers' package

from pg_bench import human, make_cell, parse_size  # noqa: E402

OPS = {  # display name -> pg_bench's cell name
    "all_reduce": "all_reduce",
    "reduce_scatter": "reduce_scatter_single",
    "all_gather": "all_gather_single",
    "broadcast": "broadcast",
    "all_to_all": "all_to_all_single",
}
BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}
ELEM = 4  # float32


def bound_bytes(op: str, size: int, hosts: int, per_host: int) -> float:
    """Bytes that must leave the busiest host per call (see the module docstring)."""
    h = hosts
    if h < 2 or size < 64 * 1024:  # latency, not bandwidth, decides small messages
        return 0.0
    return {
        "all_reduce": 2 * (h - 1) / h * size,
        "reduce_scatter": (h - 1) / h * size,
        "all_gather": (h - 1) / h * size,
        "broadcast": float(size),
        "all_to_all": per_host * size * (h - 1) / h,
    }[op]


def parse_rate(s: str) -> int:
    """'2G' / '500M' / '2000000000' -> bit/s."""
    s = s.strip().upper().removesuffix("BIT").removesuffix("BPS")
    mult = {"K": 10**3, "M": 10**6, "G": 10**9}
    return int(float(s[:-1]) * mult[s[-1]]) if s and s[-1] in mult else int(s)


def parse_topology(s: str) -> list:
    """'2x2' -> [2, 2]; '3+1' -> [3, 1] (uneven)."""
    if "x" in s:
        h, g = s.split("x")
        return [int(g)] * int(h)
    return [int(x) for x in s.split("+")]


# ----------------------------------------------------------------------------- rank side


def _tx_bytes() -> int:
    with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
        return int(f.read())


# How far ahead of the control all_reduce the ranks agree to start a timed call: more than
# that all_reduce's release spread (1-4 ms measured for 8 ranks on 2 cores).
START_AHEAD_S = 0.010


def aligned_start(dist, torch, ctrl) -> None:
    """Returns on every rank at one moment, START_AHEAD_S after the last rank entered (the
    module docstring's "Start" says why)."""
    at = torch.tensor([time.perf_counter() + START_AHEAD_S], dtype=torch.float64)
    dist.all_reduce(at, op=dist.ReduceOp.MAX, group=ctrl)
    left = at.item() - time.perf_counter()
    if left > 0:
        time.sleep(left)


def worker() -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import mooncake_pg

    torch.set_num_threads(1)
    rank, world = int(os.environ["MH_RANK"]), int(os.environ["MH_WORLD_SIZE"])
    leader = os.environ["MH_LOCAL_RANK"] == "0"
    plan = json.loads(os.environ["MH_ARGS"])
    timeout = timedelta(seconds=plan["op_timeout"] * 4)
    dist.init_process_group(
        "gloo", init_method=os.environ["MH_INIT"], rank=rank, world_size=world, timeout=timeout
    )
    ctrl = dist.group.WORLD
    groups = {}
    for b in plan["backends"]:
        opts = (
            mooncake_pg.MooncakeOptions(timeout=float(plan["op_timeout"]))
            if b == "mooncake"
            else None
        )
        groups[b] = dist.new_group(backend=b, pg_options=opts, timeout=timeout)
        t = torch.zeros(1)
        for _ in range(3):  # connections and buffers are set up before any timing
            dist.all_reduce(t, group=groups[b])
    records, ok = [], True
    for op in plan["ops"]:
        for size in plan["sizes"]:
            cells = {
                b: make_cell(dist, torch, OPS[op], size, rank, world, groups[b]) for b in groups
            }
            rec = {"op": op, "size": size}
            for b, (call, result, want, reset, count) in cells.items():
                call()  # on the fresh inputs: the checked call
                good = torch.equal(result(), want)
                flags = torch.tensor([0.0 if good else 1.0])
                dist.all_reduce(flags, group=ctrl)
                if flags.item():
                    ok = False
                    rec[b] = {"error": "wrong result"}
                    continue
                dist.barrier(group=ctrl)
                tx0 = _tx_bytes() if leader else 0
                reset()
                t0 = time.perf_counter()
                call()
                t_one = time.perf_counter() - t0
                dist.barrier(group=ctrl)
                tx = torch.tensor([float(_tx_bytes() - tx0) if leader else 0.0, t_one])
                gathered = [torch.zeros(2) for _ in range(world)]
                dist.all_gather(gathered, tx, group=ctrl)
                rec[b] = {
                    "bytes_out_max": max(g[0].item() for g in gathered),
                    "count": count,
                }
                t_warm = max(g[1].item() for g in gathered)
                iters = int(
                    min(
                        plan["max_iters"],
                        max(plan["min_iters"], plan["budget_s"] / max(t_warm, 1e-6)),
                    )
                )
                rec[b]["iters"] = iters
            times = {b: [] for b in cells if "error" not in rec[b]}
            cpus = {b: [] for b in times}
            starts = {b: [] for b in times}
            n_iters = max((rec[b]["iters"] for b in times), default=0)
            order = list(times)
            for it in range(n_iters):
                for b in order[it % len(order) :] + order[: it % len(order)]:
                    if it >= rec[b]["iters"]:
                        continue
                    call, _, _, reset, _ = cells[b]
                    reset()
                    aligned_start(dist, torch, ctrl)
                    c0, t0 = time.process_time(), time.perf_counter()
                    call()
                    t1 = time.perf_counter()
                    times[b].append(t1 - t0)
                    cpus[b].append(time.process_time() - c0)
                    starts[b].append(t0)
            for b, ts in times.items():
                mine = torch.tensor([ts, cpus[b], starts[b]], dtype=torch.float64)
                gathered = [torch.zeros_like(mine) for _ in range(world)]
                dist.all_gather(gathered, mine, group=ctrl)
                every = torch.stack(gathered)  # [rank, time / cpu, call]
                per_call = every[:, 0].max(dim=0).values
                rec[b]["time_s"] = float(per_call.median())
                rec[b]["times_s"] = per_call.tolist()
                # user + system seconds of every rank process (all its threads) per call
                cpu_call = every[:, 1].sum(dim=0)
                rec[b]["cpu_s"] = float(cpu_call.median())
                # perf_counter is one clock for every rank (aligned_start): how far apart
                # the ranks entered the call, and how long it ran after the last one did
                start = every[:, 2]
                rec[b]["start_spread_s"] = float(
                    (start.max(0).values - start.min(0).values).median()
                )
                end = start + every[:, 0]
                rec[b]["after_last_start_s"] = float(
                    (end.max(0).values - start.max(0).values).median()
                )
            records.append(rec)
    for g in groups.values():
        dist.destroy_process_group(g)
    dist.destroy_process_group()
    print("RESULT " + json.dumps({"ok": ok, "records": records if rank == 0 else []}), flush=True)
    os._exit(0)


# ---------------------------------------------------------------------------- launcher


def run_topology(ranks_per_host: list, args) -> dict:
    from tests.multihost import run_bench

    plan = {
        "backends": args.backends.split(","),
        "ops": args.ops.split(","),
        "sizes": [parse_size(s) for s in args.sizes.split(",")],
        "op_timeout": args.op_timeout,
        "min_iters": args.min_iters,
        "max_iters": args.max_iters,
        "budget_s": args.budget,
    }
    res = run_bench(
        ranks_per_host,
        [sys.executable, os.path.abspath(__file__), "--worker"],
        plan,
        prefix="mcbench",
        rate_bit=args.rate_bit,
        delay_us=args.delay_us,
        timeout_s=args.timeout,
    )
    bad = {r: v for r, v in res.items() if "error" in v or not v.get("ok")}
    return {
        "ranks_per_host": ranks_per_host,
        "records": res.get(0, {}).get("records", []),
        "failed": bad,
    }


def render(topo: dict, args, md: bool = False) -> str:
    rph = topo["ranks_per_host"]
    h, g, n = len(rph), max(rph), sum(rph)
    rate = args.rate_bit / 8  # bytes/s
    title = f"{h} hosts x {'+'.join(map(str, rph)) if len(set(rph)) > 1 else g} ranks, link {args.rate_bit / 1e9:g} Gbit/s"
    if args.delay_us:
        title += f", delay {args.delay_us} us"
    head = [
        "op",
        "size",
        "mooncake ms",
        "busbw GB/s",
        "gloo ms",
        "ratio",
        "bound ms",
        "%bound",
        "MB out mc",
        "MB out gloo",
        "bound MB",
        "CPU ms mc",
        "CPU ms gloo",
        "CPU mc/gloo",
        "start spread ms mc/gloo",
    ]
    rows = []
    for rec in topo["records"]:
        op, size = rec["op"], rec["size"]
        mc, gl = rec.get("mooncake", {}), rec.get("gloo", {})
        bb = bound_bytes(op, size, h, g)
        bound_s = bb / rate
        t_mc, t_gl = mc.get("time_s"), gl.get("time_s")
        c_mc, c_gl = mc.get("cpu_s"), gl.get("cpu_s")
        busbw = size / t_mc * BUS_FACTOR[op](n) / 1e9 if t_mc else None

        def f(x, fmt):
            return "-" if x is None else format(x, fmt)

        rows.append(
            [
                op,
                human(size),
                f(t_mc and t_mc * 1e3, ".2f"),
                f(busbw, ".3f"),
                f(t_gl and t_gl * 1e3, ".2f"),
                f(t_gl / t_mc if t_mc and t_gl else None, ".2f") + ("x" if t_mc and t_gl else ""),
                f(bound_s * 1e3 if bb else None, ".2f"),
                f(100 * bound_s / t_mc if t_mc and bb else None, ".0f")
                + ("%" if t_mc and bb else ""),
                f(mc.get("bytes_out_max", 0) / 1e6, ".2f"),
                f(gl.get("bytes_out_max", 0) / 1e6, ".2f"),
                f(bb / 1e6, ".2f"),
                f(c_mc and c_mc * 1e3, ".2f"),
                f(c_gl and c_gl * 1e3, ".2f"),
                f(c_mc / c_gl if c_mc and c_gl else None, ".2f") + ("x" if c_mc and c_gl else ""),
                f(mc.get("start_spread_s", 0) * 1e3, ".2f")
                + "/"
                + f(gl.get("start_spread_s", 0) * 1e3, ".2f"),
            ]
        )
    if md:
        lines = [f"**{title}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    lines = [title, "  ".join(c.rjust(w) for c, w in zip(head, widths))]
    lines += ["  ".join(str(c).rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    if argv is None and "--worker" in sys.argv:
        worker()
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--topologies", default="2x2,4x2", help="HxG or uneven A+B+..., comma-separated")
    p.add_argument("--sizes", default="8,1M,4M,16M,64M")
    p.add_argument("--ops", default=",".join(OPS), help="comma-separated, of: " + ", ".join(OPS))
    p.add_argument("--backends", default="mooncake,gloo")
    p.add_argument(
        "--link-rate", default="2G", help="each host link's rate per direction (bit/s; K/M/G)"
    )
    p.add_argument(
        "--delay-us", type=int, default=0, help="one-way delay per host link (needs tc netem)"
    )
    p.add_argument(
        "--budget", type=float, default=1.5, help="seconds of timed calls per cell and backend"
    )
    p.add_argument("--min-iters", type=int, default=3)
    p.add_argument("--max-iters", type=int, default=30)
    p.add_argument("--op-timeout", type=float, default=60.0)
    p.add_argument("--timeout", type=float, default=1500.0, help="seconds per topology")
    p.add_argument("--smoke", action="store_true", help="CI: 2x2, 8 B and 1 MiB, 3 calls")
    p.add_argument("--json", default=os.path.join("bench_out", "multihost_bench.json"))
    args = p.parse_args(argv)
    unknown = sorted(set(args.ops.split(",")) - set(OPS))
    if unknown:
        p.error(f"--ops: unknown {', '.join(unknown)} (known: {', '.join(OPS)})")
    if args.smoke:
        args.topologies, args.sizes, args.min_iters, args.max_iters = "2x2", "8,1M", 3, 3
    args.rate_bit = parse_rate(args.link_rate)
    from tests import netns

    ok, why = netns.available()
    if not ok:
        print(f"multihost_bench: skipped: network namespaces: {why}")
        return 0
    t0 = time.time()
    print(
        f"multihost_bench: {args.topologies}, link {args.rate_bit / 1e9:g} Gbit/s, sizes {args.sizes}, "
        f"load {os.getloadavg()[0]:.1f}, {time.strftime('%Y-%m-%d %H:%M')}",
        flush=True,
    )
    out = {
        "args": vars(args),
        "date": time.strftime("%Y-%m-%d"),
        "load_before": os.getloadavg()[0],
        "topologies": [],
    }
    status = 0
    for spec in args.topologies.split(","):
        topo = run_topology(parse_topology(spec), args)
        out["topologies"].append(topo)
        print("\n" + render(topo, args), flush=True)
        if topo["failed"] or not topo["records"]:
            status = 1
            for r, v in sorted(topo["failed"].items()):
                print(
                    f"rank {r}: {v.get('error')}: {v.get('message', '')}\n{v.get('tb') or v.get('log', '')}"
                )
    out["load_after"] = os.getloadavg()[0]
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    with open(os.path.splitext(args.json)[0] + ".md", "w") as f:
        f.write("\n\n".join(render(t, args, md=True) for t in out["topologies"]) + "\n")
    print(f"\n{time.time() - t0:.0f} s; load after {out['load_after']:.1f}; JSON: {args.json}")
    return status


if __name__ == "__main__":
    sys.exit(main())
