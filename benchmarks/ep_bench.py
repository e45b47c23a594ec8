#!/usr/bin/env python3
"""MoE dispatch + combine round trip on CPU: ``mooncake_ep`` against a plain implementation
over gloo, in the same run.

Workload per rank (defaults): T=4096 tokens, H=2048, bfloat16, top-8 of 32 experts chosen
uniformly at random per token (rank-dependent seed), float32 weights, identity experts;
world sizes 2 and 4. A round trip delivers ``out[t] = sum_k w[t,k] * x[t]`` to the
token's rank (the expert outputs of identity experts):

* ``mooncake``: ``Buffer.dispatch`` (one row per token and destination rank; across hosts
  one per token and remote host, forwarded inside the host) -> the caller weights each
  received row by its local weights (DeepEP's normal mode) -> ``Buffer.combine``; over a
  ``mooncake`` group.
* ``mooncake-flat`` (``--hosts`` only): the same with ``EPConfig(hierarchical=False)``: one
  row per token and destination rank across hosts too.
* ``mooncake-ll``: ``low_latency_dispatch`` (one row per (token, expert), packed per
  expert; across hosts one per token and destination rank on the normal mode's route)
  -> ``low_latency_combine`` (applies the weights); over the same group.
* ``mooncake-ll-flat`` (``--hosts`` only): the same with ``EPConfig(hierarchical=False)``:
  one row per (token, expert) across hosts too.
* ``plain-gloo``: the textbook version: sort the T*K (token, slot) rows by expert, counts
  with ``all_to_all_single``, rows with ``all_to_all_single``, back again, then
  ``index_add_`` of the weighted rows into the output (float32, rounded once); over gloo.

Method: one set of rank processes (tests/rankpool.py: forked, own sessions, killed as a
group; one torch thread each) runs all three; the default group is ``mooncake``, a second
group uses gloo. One checked round trip per implementation (the output compared with
the float64 reference), warm-up, then timed round trips in blocks that alternate
between the implementations (a barrier before each block). The time of a round trip is
the maximum over ranks; the reported time is the median over round trips. tokens/s =
W * T / time (all ranks' tokens); GB/s = the top-k payload W * T * K * H * 2 bytes, both
directions, / time (the same numerator for every implementation, so it compares
effective speed); "moved/rank" is the bytes each rank actually sent per round trip.

    .venv/bin/python benchmarks/ep_bench.py            # full run (about 1-2 minutes on 2 cores)
    .venv/bin/python benchmarks/ep_bench.py --smoke    # CI: small sizes, W=2, seconds
    .venv/bin/python benchmarks/ep_bench.py --gate     # also checks: mooncake >= 3x plain-gloo at W=2
    .venv/bin/python benchmarks/ep_bench.py --hosts 2x2 --link-rate 1G   # across emulated hosts

Across hosts (``--hosts 2x2``, ``4x2``, ``3+1``): the ranks live in network namespaces
(tests/netns.py) whose links ``tc`` limits to ``--link-rate`` (each direction), and
rendezvous through ``init_method="tcp://..."``; the same implementations and method,
plus the bytes that left the busiest host per round trip (its interface counters around the
checked round trip) and the **link bound**: the bytes that must leave the busiest host when
a token crosses to each remote host it needs once and comes back as one row per (token,
host) (DeepEP's internode scheme), over the link rate. Each rank counts its tokens per
destination host with ``get_dispatch_layout``'s ``num_tokens_per_rdma_rank``. "CPU s" is
the processor time of a round trip (user + system, every thread, summed over the ranks;
median), and "CPU / cores" that over the machine's cores: a floor the round trip cannot
beat here however fast the links.

Output: a table on stdout, JSON (``--json``, default bench_out/ep_bench.json) and the
table in markdown beside it (.md). Exit status 0 when every checked result was right
(with ``--gate-strict`` also 1 when the gate fails).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the repository root: the test helpers' package

from tests import rankpool  # noqa: E402

IMPLS = ["mooncake", "mooncake-ll", "plain-gloo"]
# --hosts also runs both modes rank to rank (EPConfig(hierarchical=False))
HOST_IMPLS = ["mooncake", "mooncake-flat", "mooncake-ll", "mooncake-ll-flat", "plain-gloo"]
GATE_X = 3.0


# ---------------------------------------------------------------- rank side


def _inputs(rank, T, H, E, K, seed):
    import torch

    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = (torch.randint(-8, 9, (T, H), generator=g).float() / 8).to(torch.bfloat16)
    idx = torch.argsort(torch.rand((T, E), generator=g), dim=1)[:, :K].contiguous()
    w = torch.randint(1, 16, (T, K), generator=g).float() / 16
    return x, idx, w


def plain_round_trip(x, idx, w, E, group, W):
    """Sort by expert + all_to_all_single (gloo) + index_add_."""
    import torch
    import torch.distributed as dist

    T, K = idx.shape
    L = E // W
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tok = order // K
    rows = x.index_select(0, tok)
    send = torch.bincount(flat // L, minlength=W)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    sc, rc = send.tolist(), recv.tolist()
    got = torch.empty((sum(rc), x.shape[1]), dtype=x.dtype)
    dist.all_to_all_single(got, rows, rc, sc, group=group)
    # identity experts: the rows go straight back
    back = torch.empty_like(rows)
    dist.all_to_all_single(back, got, sc, rc, group=group)
    out = torch.zeros((T, x.shape[1]), dtype=torch.float32)
    out.index_add_(0, tok, back.float() * w.reshape(-1).index_select(0, order).unsqueeze(1))
    return out.to(x.dtype), rows.numel() * rows.element_size() * 2


# seconds the last mooncake round trip spent in its dispatch (the rest is the weighting and
# combine): the per-phase split the --hosts table prints
_LAST_DISPATCH_S = [float("nan")]


def mooncake_round_trip(buf, x, idx, w, E):
    t0 = time.perf_counter()
    r = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    _LAST_DISPATCH_S[0] = time.perf_counter() - t0
    # the caller's weighting, in bf16 and in place: recv_x is the caller's (an out-of-place
    # product is a fresh [N_recv, H] tensor, whose first touch costs a page fault per 4 KiB)
    y = r.recv_x.mul_(r.recv_topk_weights.sum(1, keepdim=True).to(x.dtype))
    out = buf.combine(y, r.handle).combined_x
    moved = sum(r.handle.send_counts) * x.shape[1] * x.element_size() * 2
    return out, moved


def mooncake_ll_round_trip(buf, x, idx, w, E):
    ll = buf.low_latency_dispatch(x, idx, x.shape[0], E)
    out = buf.low_latency_combine(ll.recv_x, idx, w, ll.handle).combined_x
    moved = ll.handle.pair_token.numel() * x.shape[1] * x.element_size() * 2
    return out, moved


def _tx_bytes() -> int:
    with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
        return int(f.read())


def rank_bench(rank, ws, cfg, count_host_tx=False):
    """The round trips of every implementation on this rank. count_host_tx: the checked
    round trip runs between barriers and records the bytes that left this rank's host
    (its eth0) meanwhile ("host_tx"), and "per_host" gets this rank's tokens per host."""
    import torch.distributed as dist

    import mooncake_ep

    T, H, E, K = cfg["T"], cfg["H"], cfg["E"], cfg["K"]
    gloo = dist.new_group(list(range(ws)), backend="gloo")
    buf = mooncake_ep.Buffer()
    flat = mooncake_ep.Buffer(config=mooncake_ep.EPConfig(hierarchical=False))
    x, idx, w = _inputs(rank, T, H, E, K, cfg["seed"])
    calls = {
        "mooncake": lambda: mooncake_round_trip(buf, x, idx, w, E),
        "mooncake-flat": lambda: mooncake_round_trip(flat, x, idx, w, E),
        "mooncake-ll": lambda: mooncake_ll_round_trip(buf, x, idx, w, E),
        "mooncake-ll-flat": lambda: mooncake_ll_round_trip(flat, x, idx, w, E),
        "plain-gloo": lambda: plain_round_trip(x, idx, w, E, gloo, ws),
    }
    impls = [i for i in cfg["impls"] if i in calls]
    # 1. one checked call each, against the float64 reference sum_k w_k x
    ref = x.double() * w.double().sum(1, keepdim=True)
    res = {}
    for name in impls:
        if count_host_tx:
            dist.barrier(group=gloo)
            tx0 = _tx_bytes()
        out, moved = calls[name]()
        err = float((out.double() - ref).abs().max()) if out.numel() else 0.0
        tol = float(ref.abs().max()) * 2**-7 + 1e-6 if out.numel() else 0.0  # one bf16 rounding
        res[name] = {
            "ok": err <= tol,
            "max_err": err,
            "moved_bytes": moved,
            "times": [],
            "cpu": [],
            "dispatch": [],
        }
        if count_host_tx:
            dist.barrier(group=gloo)
            time.sleep(0.2)  # the host's other ranks' last segments leave too
            res[name]["host_tx"] = _tx_bytes() - tx0
            dist.barrier(group=gloo)
    if count_host_tx:
        per_host = buf.get_dispatch_layout(idx, E).num_tokens_per_rdma_rank
        res["per_host"] = per_host.tolist() if per_host is not None else None
    # 2. warm-up, 3. timed blocks alternating between the implementations
    for name in impls:
        for _ in range(cfg["warmup"]):
            calls[name]()
    for rnd in range(cfg["rounds"]):
        k = rnd % len(impls)
        for name in impls[k:] + impls[:k]:
            dist.barrier(group=gloo)
            for _ in range(cfg["block"]):
                _LAST_DISPATCH_S[0] = float("nan")
                t0, c0 = time.perf_counter(), time.process_time()
                calls[name]()
                res[name]["times"].append(time.perf_counter() - t0)
                res[name]["dispatch"].append(_LAST_DISPATCH_S[0])
                res[name]["cpu"].append(time.process_time() - c0)  # all threads, user + sys
    dist.barrier(group=gloo)
    dist.destroy_process_group(gloo)
    return res


# --------------------------------------------------------------- orchestrator


def _slowest(per_rank, name, ws) -> list:
    """Each timed round trip's time: the slowest rank's."""
    n = len(per_rank[0][name]["times"])
    return [max(per_rank[r][name]["times"][i] for r in range(ws)) for i in range(n)]


def measure(ws, cfg, timeout):
    pool = rankpool.get_pool(ws, "mooncake", None, timeout=120)
    try:
        per_rank = pool.run(rank_bench, cfg, timeout=timeout)
    finally:
        pool.close()
    out = {}
    for name in cfg["impls"]:
        times = _slowest(per_rank, name, ws)
        t = statistics.median(times)
        payload = ws * cfg["T"] * cfg["K"] * cfg["H"] * 2 * 2
        out[name] = {
            "world_size": ws,
            "impl": name,
            "time_ms": t * 1e3,
            "min_ms": min(times) * 1e3,
            "max_ms": max(times) * 1e3,
            "calls": len(times),
            "tokens_per_s": ws * cfg["T"] / t,
            "gbs": payload / t / 1e9,
            "moved_bytes_per_rank": statistics.mean(
                per_rank[r][name]["moved_bytes"] for r in range(ws)
            ),
            "ok": all(per_rank[r][name]["ok"] for r in range(ws)),
            "max_err": max(per_rank[r][name]["max_err"] for r in range(ws)),
        }
    return out


def hosts_worker() -> None:
    """One rank of a ``--hosts`` run (tests.multihost.run_ranks sets MH_*)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import mooncake_pg

    torch.set_num_threads(1)
    cfg = json.loads(os.environ["MH_ARGS"])
    rank, ws = int(os.environ["MH_RANK"]), int(os.environ["MH_WORLD_SIZE"])
    dist.init_process_group(
        "mooncake",
        init_method=os.environ["MH_INIT"],
        rank=rank,
        world_size=ws,
        pg_options=mooncake_pg.MooncakeOptions(timeout=300.0),
        timeout=timedelta(seconds=300),
    )
    res = rank_bench(rank, ws, cfg, count_host_tx=True)
    print("RESULT " + json.dumps(res), flush=True)
    dist.destroy_process_group()
    os._exit(0)


def measure_hosts(rph, cfg, rate_bit, timeout):
    """The implementations on hosts of rph[h] ranks (network namespaces, links of rate_bit)."""
    from tests.multihost import rank_hosts, run_bench

    ws = sum(rph)
    argv = [sys.executable, os.path.abspath(__file__), "--hosts-worker"]
    per_rank = run_bench(rph, argv, cfg, prefix="mcepb", rate_bit=rate_bit, timeout_s=timeout)
    bad = {r: v for r, v in per_rank.items() if "per_host" not in v}
    if bad:
        for r, v in bad.items():
            print(f"--- rank {r}: {v.get('error')}\n{v.get('log', '')[-3000:]}", file=sys.stderr)
        raise RuntimeError(f"ep_bench --hosts: ranks {sorted(bad)} failed")
    host = rank_hosts(rph)
    H = len(rph)
    row_bytes = cfg["H"] * 2  # bf16
    # bytes that must leave host h: its tokens once to each remote host they need, and one
    # row per (token of another host, h) back
    need = [0] * H
    for r in range(ws):
        counts = per_rank[r]["per_host"]
        for h in range(H):
            if h == host[r]:
                need[h] += sum(c for j, c in enumerate(counts) if j != h) * row_bytes
            else:
                need[h] += counts[h] * row_bytes
    bound_s = max(need) / (rate_bit / 8)
    out = {}
    for name in cfg["impls"]:
        times = _slowest(per_rank, name, ws)
        t = statistics.median(times)
        # a host's counter holds all its ranks' traffic: the tightest window of its ranks
        host_tx = max(
            min(per_rank[r][name]["host_tx"] for r in range(ws) if host[r] == h) for h in range(H)
        )
        n = len(times)
        cpu_s = statistics.median(
            sum(per_rank[r][name]["cpu"][i] for r in range(ws)) for i in range(n)
        )
        # dispatch and combine (with the weighting) of each call, slowest rank; nan where the
        # implementation has no separate dispatch
        disp = [max(per_rank[r][name]["dispatch"][i] for r in range(ws)) for i in range(n)]
        comb = [
            max(per_rank[r][name]["times"][i] - per_rank[r][name]["dispatch"][i] for r in range(ws))
            for i in range(n)
        ]
        out[name] = {
            "impl": name,
            "time_ms": t * 1e3,
            "dispatch_ms": statistics.median(disp) * 1e3,
            "combine_ms": statistics.median(comb) * 1e3,
            "calls": len(times),
            # the CPU time of a round trip, all ranks together, over the machine's cores: a
            # floor the round trip cannot beat on this machine whatever the links
            "cpu_s": cpu_s,
            "cpu_bound_ms": cpu_s / (os.cpu_count() or 1) * 1e3,
            "mb_out_busiest_host": host_tx / 1e6,
            "bound_mb": max(need) / 1e6,
            "bound_ms": bound_s * 1e3,
            "pct_bound": 100 * bound_s / t,
            "ok": all(per_rank[r][name]["ok"] for r in range(ws)),
            "max_err": max(per_rank[r][name]["max_err"] for r in range(ws)),
        }
    return out


def _table(title, head, rows, md) -> str:
    """Markdown (md) or an aligned text table under its title."""
    if md:
        lines = [f"**{title}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    else:
        widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
        fmt = lambda cells: "  ".join(str(c).rjust(w) for c, w in zip(cells, widths))  # noqa: E731
        lines = [title, fmt(head), "-" * (sum(widths) + 2 * len(widths))] + [fmt(r) for r in rows]
    return "\n".join(lines)


def _ms(v) -> str:
    return "-" if v is None or math.isnan(v) else f"{v:.0f}"


def render_hosts(topo, per, cfg, rate_bit, md=False):
    head = ["implementation", "round trip (ms)", "dispatch ms", "combine ms", "vs plain-gloo"]
    head += [
        "MB out (busiest host)",
        "bound MB",
        "bound ms",
        "% of bound",
        "CPU s (all ranks)",
        "CPU / cores ms",
        "check",
    ]
    base = per.get("plain-gloo")
    rows = [
        [
            name,
            f"{r['time_ms']:.0f}",
            _ms(r.get("dispatch_ms")),
            _ms(r.get("combine_ms")),
            f"{base['time_ms'] / r['time_ms']:.2f}x" if base else "-",
            f"{r['mb_out_busiest_host']:.1f}",
            f"{r['bound_mb']:.1f}",
            f"{r['bound_ms']:.0f}",
            f"{r['pct_bound']:.0f}%",
            f"{r['cpu_s']:.2f}",
            f"{r['cpu_bound_ms']:.0f}",
            "ok" if r["ok"] else "WRONG",
        ]
        for name, r in per.items()
    ]
    title = (
        f"{topo} hosts, links {rate_bit / 1e9:g} Gbit/s: T={cfg['T']} tokens/rank, H={cfg['H']}, "
        f"top-{cfg['K']} of {cfg['E']} experts, bf16; median of {cfg['rounds'] * cfg['block']} "
        "round trips (slowest rank)"
    )
    return _table(title, head, rows, md)


def render(results, cfg, md=False):
    head = [
        "W",
        "implementation",
        "round trip (ms)",
        "tokens/s",
        "GB/s",
        "moved/rank (MiB)",
        "vs plain-gloo",
        "check",
    ]
    rows = []
    for ws, per in results.items():
        base = per.get("plain-gloo")
        for name, r in per.items():
            ratio = f"{base['time_ms'] / r['time_ms']:.2f}x" if base else "-"
            rows.append(
                [
                    ws,
                    name,
                    f"{r['time_ms']:.1f}",
                    f"{r['tokens_per_s']:,.0f}",
                    f"{r['gbs']:.2f}",
                    f"{r['moved_bytes_per_rank'] / 2**20:.1f}",
                    ratio,
                    "ok" if r["ok"] else "WRONG",
                ]
            )
    title = (
        f"T={cfg['T']} tokens/rank, H={cfg['H']}, top-{cfg['K']} of {cfg['E']} experts, bf16, CPU, "
        f"one torch thread per rank; median of {cfg['rounds'] * cfg['block']} round trips (slowest rank)"
    )
    return _table(title, head, rows, md)


def gate(results):
    per = results.get(2)
    if not per or "mooncake" not in per or "plain-gloo" not in per:
        return None, "SKIP  W=2 mooncake >= 3x plain-gloo: not measured"
    x = per["plain-gloo"]["time_ms"] / per["mooncake"]["time_ms"]
    ok = x >= GATE_X and per["mooncake"]["ok"]
    return ok, (
        f"{'PASS' if ok else 'FAIL'}  W=2 round trip: mooncake {per['mooncake']['tokens_per_s']:,.0f} tokens/s "
        f"vs plain-gloo {per['plain-gloo']['tokens_per_s']:,.0f} = {x:.2f}x (gate >= {GATE_X:.0f}x)"
    )


def main(argv=None):
    summary, _, details = __doc__.partition("\n\n")
    ap = argparse.ArgumentParser(
        description=summary, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=details
    )
    ap.add_argument("--world-sizes", default=None, help="comma list (default 2,4; smoke 2)")
    ap.add_argument("--tokens", type=int, default=None, help="T per rank (default 4096; smoke 256)")
    ap.add_argument("--hidden", type=int, default=None, help="H (default 2048; smoke 256)")
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument(
        "--impls",
        default=None,
        help=f"comma list (default {','.join(IMPLS)}; with --hosts {','.join(HOST_IMPLS)})",
    )
    ap.add_argument(
        "--rounds", type=int, default=None, help="blocks per implementation (default 5; smoke 2)"
    )
    ap.add_argument(
        "--block", type=int, default=None, help="round trips per block (default 3; smoke 2)"
    )
    ap.add_argument("--warmup", type=int, default=None, help="default 2 (smoke 1)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--smoke", action="store_true", help="CI: small sizes, W=2")
    ap.add_argument(
        "--gate", action="store_true", help="print the gate line (mooncake >= 3x plain-gloo at W=2)"
    )
    ap.add_argument("--gate-strict", action="store_true", help="like --gate; exit 1 when it fails")
    ap.add_argument(
        "--hosts", default=None, help="emulated hosts: HxG or uneven A+B+... (e.g. 2x2, 4x2, 3+1)"
    )
    ap.add_argument(
        "--link-rate", default="1G", help="with --hosts: each host link's rate (bit/s; K/M/G)"
    )
    ap.add_argument("--hosts-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", default=os.path.join("bench_out", "ep_bench.json"))
    ap.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds per world size (default 900; smoke 120)",
    )
    args = ap.parse_args(argv)
    if args.hosts_worker:
        hosts_worker()
        return 0
    s = args.smoke
    cfg = {
        "T": args.tokens or (256 if s else 4096),
        "H": args.hidden or (256 if s else 2048),
        "E": args.experts,
        "K": args.topk,
        "seed": args.seed,
        "impls": [
            i for i in (args.impls or ",".join(HOST_IMPLS if args.hosts else IMPLS)).split(",") if i
        ],
        "rounds": args.rounds or (2 if s else 5),
        "block": args.block or (2 if s else 3),
        "warmup": args.warmup if args.warmup is not None else (1 if s else 2),
    }
    world_sizes = [int(w) for w in (args.world_sizes or ("2" if s else "2,4")).split(",")]
    timeout = args.timeout or (120 if s else 900)
    if args.hosts:
        return main_hosts(args, cfg, timeout)
    results = {}
    t0 = time.monotonic()
    try:
        for ws in world_sizes:
            results[ws] = measure(ws, cfg, timeout)
    finally:
        rankpool.shutdown_all()
    text = render(results, cfg)
    print(text)
    lines = []
    ok_gate = None
    if args.gate or args.gate_strict:
        ok_gate, line = gate(results)
        lines.append(line)
        print(line)
    print(f"[ep_bench] {time.monotonic() - t0:.1f} s")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(
                {"config": cfg, "results": {str(k): v for k, v in results.items()}, "gate": lines},
                f,
                indent=1,
            )
        md = os.path.splitext(args.json)[0] + ".md"
        with open(md, "w") as f:
            f.write(render(results, cfg, md=True) + "\n" + "".join(f"\n{x}\n" for x in lines))
        print(f"[ep_bench] wrote {args.json} and {md}")
    wrong = [(ws, n) for ws, per in results.items() for n, r in per.items() if not r["ok"]]
    if wrong:
        print(f"[ep_bench] WRONG results: {wrong}", file=sys.stderr)
        return 1
    if args.gate_strict and ok_gate is False:
        return 1
    return 0


def main_hosts(args, cfg, timeout) -> int:
    from multihost_bench import parse_rate, parse_topology

    from tests import netns

    ok, why = netns.available()
    if not ok:
        print(f"ep_bench --hosts: skipped: network namespaces: {why}")
        return 0
    rph = parse_topology(args.hosts)
    rate_bit = parse_rate(args.link_rate)
    if cfg["E"] % sum(rph):
        print(f"ep_bench --hosts: --experts {cfg['E']} must be a multiple of {sum(rph)} ranks")
        return 2
    t0, load0 = time.monotonic(), os.getloadavg()[0]
    per = measure_hosts(rph, cfg, rate_bit, timeout)
    text = render_hosts(args.hosts, per, cfg, rate_bit)
    print(text)
    print(
        f"[ep_bench] {time.monotonic() - t0:.1f} s, load {load0:.1f} before, "
        f"{time.strftime('%Y-%m-%d %H:%M')}"
    )
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"config": cfg, "hosts": args.hosts, "results": per}, f, indent=1)
        md = os.path.splitext(args.json)[0] + ".md"
        with open(md, "w") as f:
            f.write(render_hosts(args.hosts, per, cfg, rate_bit, md=True) + "\n")
        print(f"[ep_bench] wrote {args.json} and {md}")
    return 0 if all(r["ok"] for r in per.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
