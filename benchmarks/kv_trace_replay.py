"""Replays a FAST'25 request trace (Mooncake's) through ``KVCacheStore`` on a real store.

Each request of the trace (``timestamp`` in ms, ``input_length``, ``hash_ids``: one id per
``--block-tokens`` block, chained: an id stands for its block and every block before it)
becomes a prompt of deterministic tokens (block id ``h`` is the tokens
``h * B .. h * B + B - 1``; equal ids, equal tokens; the last block cut to the input
length) and runs as a serving instance would: ``match_prefix``, ``get`` of the hit (every
token's K/V checked against the tokens it stands for), ``put`` of the whole prompt (its
whole chunks; the chunks already stored are skipped). The K/V payload is small and
deterministic (``--token-bytes`` per token, int32: ``[1 layer, K and V, 1 head, T,
token_bytes / 8]``), so 16M tokens take 256 MiB.

The store: a master process, one segment holder per host (a ``MooncakeStore`` that
contributes ``--memory-tokens`` of memory and, with ``--ssd-tokens``, an SSD directory
bounded to that many tokens) and ``--clients`` replay processes (no memory of their own),
requests dealt round-robin, each started at its timestamp divided by ``--speedup`` (0: as
fast as possible), never more than ``--window`` requests ahead of the slowest client.

Reported over the last 50% of requests (the first half warms the cache, as
``kvcache-simulator`` counts): block hit rate (whole chunks served / blocks of the
prompts) and token hit rate, next to a simulation of the same trace at the same budget
(prefix hits of whole blocks; a prompt's partial last block is never cached, as the
store does not store it): LRU, LFU with dynamic aging and Belady-optimal; with
``--ssd-tokens``, LRU of memory + SSD. ``kvcache-simulator``'s figures are added when it
is installed. Also lookup and get latency p50/p99, requests/s, the speed against the
trace's real time, and the store's counters (evictions, offloads, SSD reads, lost and wrong
chunks).

    .venv/bin/python benchmarks/kv_trace_replay.py --memory-tokens 1M --clients 4
    .venv/bin/python benchmarks/kv_trace_replay.py --memory-tokens 1M --ssd-tokens 16M
    .venv/bin/python benchmarks/kv_trace_replay.py --smoke           # CI: 400 requests
    .venv/bin/python benchmarks/kv_trace_replay.py --hosts 2 --memory-tokens 4M  # 2 emulated hosts
    .venv/bin/python benchmarks/kv_trace_replay.py --sim-only        # the simulations alone
    .venv/bin/python benchmarks/kv_trace_replay.py --hosts 2 --memory-tokens 4M --kill-holder --replicas 2

``--kill-holder`` (with ``--hosts 2``): host 0's serving clients also hold a segment each
(host 0's memory budget split between them and its holder), the master runs outside both
hosts, and when every request before the trace's midpoint is done every process of host 0
is SIGKILLed; host 1's clients replay the second half alone. Reported over host 1's
requests: block hit rate before the kill (requests 25-50%) and after it (50-100%), the
same requests' simulated LRU at the budget of distinct chunks (memory / ``--replicas``),
chunks the master dropped because their holder died, misses ``explain`` attributes to
``holder_lost`` and wrong K/V (which must stay 0).

``--gate`` exits 1 when the store's block hit rate is more than 1 percentage point below
the simulated LRU (memory only) or below 0.97x of it (with SSD), or when the replay is
slower than 20x real time (not with ``--smoke``). Lost or wrong chunks always fail.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import heapq
import json
import mmap
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
DEFAULT_TRACE = os.path.join(
    os.path.dirname(REPO), "shared", "data", "traces", "conversation_trace.jsonl"
)
_children: list = []


def _kill_children():
    from tests.faults import kill_group

    for p in _children:
        kill_group(p)


def parse_tokens(s: str) -> int:
    """``1M``, ``16M``, ``512K``, ``100000`` -> tokens (K = 1024, M = 2**20)."""
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(float(s[:-1] if mult > 1 else s) * mult)


def load_trace(path: str, limit: int | None = None) -> list:
    """The trace's requests as ``(timestamp_ms, input_length, hash_ids)``, in arrival order."""
    out = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            out.append((int(r["timestamp"]), int(r["input_length"]), list(r["hash_ids"])))
            if limit is not None and len(out) >= limit:
                break
    return out


def synthetic_trace(path: str, conversations: int = 120, block: int = 512, seed: int = 0) -> None:
    """Writes a conversation trace in the FAST'25 format, for where the published one is absent.

    Conversations over a shared system prompt, each turn's prompt its previous one plus a few
    blocks, turns interleaved in time over a minute.
    """
    import random

    rng = random.Random(seed)
    ids = iter(range(1 << 40))
    system = [next(ids) for _ in range(4)]
    reqs = []
    for _conv in range(conversations):
        hist = list(system)
        t = rng.uniform(0, 60_000)
        for _turn in range(rng.randint(1, 8)):
            hist = hist + [next(ids) for _ in range(rng.randint(1, 8))]
            n = len(hist) * block - rng.randint(0, block - 1)
            reqs.append({"timestamp": int(t), "input_length": n, "hash_ids": hist})
            t += rng.uniform(1_000, 20_000)
    reqs.sort(key=lambda r: r["timestamp"])
    with open(path, "w") as f:
        for r in reqs:
            f.write(json.dumps(r) + "\n")


def cached_blocks(req, block: int) -> list:
    """The blocks of a request the cache can hold: its whole blocks (a partial tail is not stored)."""
    _ts, n, ids = req
    return ids[: n // block]


# ---------------------------------------------------------------------- simulation
def simulate(reqs: list, block: int, capacity_tokens: int | None, policy: str) -> dict:
    """Prefix hits of a block cache of ``capacity_tokens`` over ``reqs`` (None: unbounded).

    Each request hits its longest prefix of cached blocks, then every cacheable block of it is
    used (inserted or refreshed). Counted over the last 50% of requests. ``policy``: ``lru``,
    ``lfu`` (LFU with dynamic aging: priority = the last evicted priority + uses) or
    ``belady`` (evicts the block used again farthest in the future).

    Returns:
        ``{"block_hit_rate", "token_hit_rate"}`` (fractions).
    """
    cap = None if capacity_tokens is None else capacity_tokens // block
    half = len(reqs) // 2
    hit_b = tot_b = hit_t = tot_t = 0
    seqs = [cached_blocks(r, block) for r in reqs]
    if policy == "belady":
        nxt, last, j = [], {}, sum(len(s) for s in seqs)
        flat = [x for s in seqs for x in s]
        nxt = [0] * len(flat)
        for j in range(len(flat) - 1, -1, -1):
            nxt[j] = last.get(flat[j], 1 << 62)
            last[flat[j]] = j
    cache: dict = {}
    lru: collections.OrderedDict = collections.OrderedDict()
    heap: list = []
    level = 0.0
    uses: dict = {}
    j = tick = 0
    for i, s in enumerate(seqs):
        k = 0
        members = lru if policy == "lru" else cache
        while k < len(s) and s[k] in members:
            k += 1
        if i >= half:
            _ts, n, ids = reqs[i]
            hit_b += k
            tot_b += len(ids)
            hit_t += k * block
            tot_t += n
        if policy == "lru":
            # the store's order: a prefix's blocks after the blocks that continue it, so the
            # leaves of a chain go first and no block outlives its prefix
            for x in reversed(s):
                if x in lru:
                    lru.move_to_end(x)
                else:
                    lru[x] = None
            while cap is not None and len(lru) > cap:
                lru.popitem(last=False)
            continue
        for x in s:
            tick += 1
            if policy == "belady":
                pri = -nxt[j]
                j += 1
            else:
                uses[x] = uses.get(x, 0) + 1 if x in cache else 1
                pri = level + uses[x]
            cache[x] = pri
            heapq.heappush(heap, (pri, tick, x))
            while cap is not None and len(cache) > cap:
                p, _t, y = heapq.heappop(heap)
                if cache.get(y) == p:
                    del cache[y]
                    uses.pop(y, None)
                    if policy == "lfu":
                        level = p
    return {
        "block_hit_rate": hit_b / tot_b if tot_b else 0.0,
        "token_hit_rate": hit_t / tot_t if tot_t else 0.0,
    }


def kvcache_simulator_figures(path: str, capacity_tokens: int, block: int, limit) -> dict | None:
    """``kvcache-simulator``'s token hit rates (LRU, optimal) at this budget, when installed.

    Its LRU evicts leaves of the prefix trie, as the store does; its figures are token hit
    rates over the last 50% of requests, in its own counting.
    """
    try:
        from kvcache_sim.plan import build_execution_plan
        from kvcache_sim.policies import simulate_policy
        from kvcache_sim.trace import parse_trace_file
    except ImportError:
        return None
    try:  # its internals are not ours to pin down: any failure means no cross-check figures
        trace = parse_trace_file(path, block_size=block, max_records=limit or 0)
        plan = build_execution_plan(trace, 0.5)
        cap = capacity_tokens // block
        return {
            f"{p}_token_hit_rate": simulate_policy(plan, p, cap).hitRate for p in ("lru", "optimal")
        }
    except Exception as e:
        return {"error": repr(e)}


# ---------------------------------------------------------------------- --kill-holder
def lru_block_hits(reqs: list, block: int, capacity_tokens: int) -> list:
    """Per request, the prefix blocks a block LRU of ``capacity_tokens`` hits (``simulate``'s LRU)."""
    cap = capacity_tokens // block
    lru: collections.OrderedDict = collections.OrderedDict()
    out = []
    for r in reqs:
        s = cached_blocks(r, block)
        k = 0
        while k < len(s) and s[k] in lru:
            k += 1
        out.append(k)
        for x in reversed(s):
            if x in lru:
                lru.move_to_end(x)
            else:
                lru[x] = None
        while len(lru) > cap:
            lru.popitem(last=False)
    return out


def _share(a: dict, n: int) -> list:
    """The requests client ``a["index"]`` runs: round-robin; with ``--kill-holder`` the second
    half goes round-robin to host 1's clients only (host 0 is dead by then)."""
    me, clients = a["index"], a["clients"]
    if not a.get("kill_holder"):
        return list(range(me, n, clients))
    mid = n // 2
    mine = list(range(me, mid, clients))
    survivors = [c for c in range(clients) if c % 2 == 1]
    if me in survivors:
        k = survivors.index(me)
        mine += range(mid + k, n, len(survivors))
    return mine


def _kill_host_at_midpoint(a, n: int, progress_path: str, victims: list, clients: list) -> float:
    """SIGKILLs ``victims`` (host 0's processes) once every request before ``n // 2`` is done.

    Returns:
        the wall-clock time (``time.time()``) the kill began.
    Raises:
        RuntimeError: a replay client died first, or ``a.timeout`` seconds passed.
    """
    import numpy as np

    from tests.faults import kill_group

    fd = os.open(progress_path, os.O_RDONLY)
    try:
        progress = np.frombuffer(mmap.mmap(fd, 8 * a.clients, prot=mmap.PROT_READ), dtype=np.int64)
        deadline = time.monotonic() + a.timeout
        while progress.min() < n // 2:
            if any(p.poll() is not None for p in clients):
                raise RuntimeError("kv_trace_replay --kill-holder: a replay client died")
            if time.monotonic() > deadline:
                raise RuntimeError("kv_trace_replay --kill-holder: timed out before the midpoint")
            time.sleep(0.005)
    finally:
        os.close(fd)
    t = time.time()
    for p in victims:
        kill_group(p, wait_s=10)
    return t


def kill_holder_figures(a, reqs: list, recs: list, kill_t: float, drops: dict) -> dict:
    """Host 1's block hit rates before and after host 0's kill, next to the simulated LRU.

    ``recs`` are the clients' records (``[i, hit, got, wrong, 3 latencies, start, cause]``);
    before: host 1's requests in [25%, 50%) of the trace, after: in [50%, 100%).
    """
    n, b = len(reqs), a.block_tokens
    sim = lru_block_hits(reqs, b, a.memory_tokens // a.replicas)
    # after the kill host 1's memory alone holds the distinct chunks
    sim1 = sim if a.replicas == 2 else lru_block_hits(reqs, b, a.memory_tokens // 2)
    on_b = [r for r in recs if r[0] % a.clients % 2 == 1 or r[0] >= n // 2]

    def rates(rows):
        tot = sum(len(reqs[r[0]][2]) for r in rows)
        return (
            sum(r[2] // b for r in rows) / tot if tot else 0.0,
            sum(sim[r[0]] for r in rows) / tot if tot else 0.0,
        )

    before = [r for r in on_b if n // 4 <= r[0] < n // 2]
    after = [r for r in on_b if r[0] >= n // 2]
    (hb, sb), (ha, sa) = rates(before), rates(after)
    sa1 = sum(sim1[r[0]] for r in after) / max(1, sum(len(reqs[r[0]][2]) for r in after))
    causes = collections.Counter(r[8] for r in after if r[8])
    return {
        "replicas": a.replicas,
        "b_requests_before": len(before),
        "b_requests_after": len(after),
        "after_started_before_kill": sum(r[7] < kill_t for r in after),
        "block_hit_rate_before": hb,
        "block_hit_rate_after": ha,
        "after_over_before": ha / hb if hb else 0.0,
        "lru_block_hit_rate_before": sb,
        "lru_block_hit_rate_after": sa,
        "lru_after_over_before": sa / sb if sb else 0.0,
        "lru_capacity_tokens": a.memory_tokens // a.replicas,
        "lru_block_hit_rate_after_host1_memory": sa1,
        "holder_lost_drops": drops.get("holder_lost", 0),
        "holder_lost_misses": causes.get("holder_lost", 0),
        "miss_causes_after": dict(causes),
        "lost_chunks_after": sum(
            (r[1] - r[2] + b - 1) // b for r in after
        ),  # found by the lookup, not readable by get
        "wrong_chunks": sum(r[3] > 0 for r in recs),
    }


def kill_holder_lines(k: dict) -> list:
    """The report lines of ``kill_holder_figures``."""
    return [
        "",
        f"--kill-holder, replica_num {k['replicas']}: host 1's block hit rate before the kill "
        f"{100 * k['block_hit_rate_before']:.2f}% ({k['b_requests_before']} requests), after "
        f"{100 * k['block_hit_rate_after']:.2f}% ({k['b_requests_after']}, "
        f"{k['after_started_before_kill']} started before the kill): "
        f"{k['after_over_before']:.3f}x; simulated LRU at "
        f"{k['lru_capacity_tokens'] / (1 << 20):g}M tokens {100 * k['lru_block_hit_rate_before']:.2f}%"
        f" -> {100 * k['lru_block_hit_rate_after']:.2f}% ({k['lru_after_over_before']:.3f}x); "
        f"at host 1's memory alone after: {100 * k['lru_block_hit_rate_after_host1_memory']:.2f}%",
        f"chunks dropped as holder_lost {k['holder_lost_drops']}, misses explained as "
        f"holder_lost {k['holder_lost_misses']} (causes after: {k['miss_causes_after']}), "
        f"found but unreadable after {k['lost_chunks_after']}, wrong K/V {k['wrong_chunks']}",
    ]


# ---------------------------------------------------------------------- payload
def prompt_tokens(req, block: int):
    """The prompt of a request: block id ``h`` is tokens ``h*B .. h*B+B-1``, cut to its length."""
    import numpy as np

    _ts, n, ids = req
    base = np.asarray(ids, dtype=np.int64)[:, None] * block
    return (base + np.arange(block, dtype=np.int64)[None, :]).reshape(-1)[:n]


def kv_payload(tokens, head_dim: int):
    """The K/V that stands for ``tokens``: int32 ``[1, 2, 1, T, head_dim]``.

    K holds the token and its position, V a mix of both, so a chunk of other tokens or at
    another position differs.
    """
    import torch

    t = torch.from_numpy(tokens).to(torch.int64)
    pos = torch.arange(len(tokens), dtype=torch.int64)
    cols = torch.arange(head_dim, dtype=torch.int64)
    k = (t[:, None] + cols[None, :] * pos[:, None]) & 0x7FFFFFFF
    v = (t[:, None] * 31 + pos[:, None] * 7 + cols[None, :]) & 0x7FFFFFFF
    return torch.stack([k, v]).to(torch.int32)[None, :, None]


# ---------------------------------------------------------------------- replay client
def _client() -> None:
    """A serving process: replays its share of the trace, writes its records as JSON."""
    import numpy as np
    import torch

    sys.path.insert(0, REPO)
    from mooncake_store import KVCacheConfig, KVCacheStore, MooncakeStore

    torch.set_num_threads(1)
    a = json.loads(sys.argv[sys.argv.index("--client") + 1])
    me, n_clients, block = a["index"], a["clients"], a["block_tokens"]
    head_dim = a["token_bytes"] // 8
    reqs = load_trace(a["trace"], a["requests"])
    fd = os.open(a["progress"], os.O_RDWR)
    progress = np.frombuffer(mmap.mmap(fd, 8 * n_clients), dtype=np.int64)
    seg = a.get("segment_bytes", 0)  # --kill-holder: host 0's clients hold a segment
    store = MooncakeStore(
        master=a["master"],
        segment_size=seg,
        serve_tcp=a["serve_tcp"],
        name=f"replay{me}",
        **({"put_reservation_bytes": 0} if seg else {}),
    )
    kv = KVCacheStore(
        store,
        config=KVCacheConfig(chunk_tokens=block, model="trace", replica_num=a.get("replicas", 1)),
    )
    mine = _share(a, len(reqs))
    print(json.dumps({"ready": True}), flush=True)
    sys.stdin.readline()  # the start signal
    t0 = time.time()
    recs = []
    for j, i in enumerate(mine):
        while progress.min() < i - a["window"]:
            time.sleep(0.0005)
        if a["speedup"] > 0:
            wait = t0 + reqs[i][0] / 1000 / a["speedup"] - time.time()
            if wait > 0:
                time.sleep(wait)
        toks = prompt_tokens(reqs[i], block)
        w0 = time.time()
        s0 = time.perf_counter()
        hit = kv.match_prefix(toks)
        s1 = time.perf_counter()
        got = kv.get(toks, hit)
        s2 = time.perf_counter()
        wrong = 0
        if got.tokens:
            want = kv_payload(toks[: got.tokens], head_dim)
            if not torch.equal(got.kv, want):
                bad = (got.kv != want).reshape(-1, got.tokens, head_dim)
                wrong = int(bad.any(dim=2).any(dim=0).reshape(-1).nonzero()[0]) // block + 1
        cause = ""
        if a.get("kill_holder") and i >= len(reqs) // 2 and got.tokens < len(toks) // block * block:
            cause = kv.explain(toks).cause  # after the kill: why B misses (before B's put)
        s25 = time.perf_counter()
        kv.put(toks, kv_payload(toks[: (len(toks) // block) * block], head_dim))
        s3 = time.perf_counter()
        # the wall-clock start (one clock in every namespace) places it against the kill
        recs.append([i, hit, got.tokens, wrong, s1 - s0, s2 - s1, s3 - s25, w0, cause])
        # the next request it runs: all below are done
        progress[me] = mine[j + 1] if j + 1 < len(mine) else 1 << 60
    progress[me] = 1 << 60
    wall = time.time() - t0
    with open(a["out"], "w") as f:
        json.dump({"records": recs, "wall_s": wall, "stats": vars(kv.stats)}, f)
    if a.get("kill_holder") and a.get("segment_bytes"):
        sys.stdin.readline()  # host 0 holds its segment until it is SIGKILLed
    store.close()


def _holder() -> None:
    """A segment holder: contributes the memory (and SSD directory) of one emulated host."""
    sys.path.insert(0, REPO)
    from mooncake_store import MooncakeStore

    a = json.loads(sys.argv[sys.argv.index("--holder") + 1])
    store = MooncakeStore(
        master=a["master"],
        segment_size=a["segment_bytes"],
        ssd_dir=a["ssd_dir"],
        ssd_max_bytes=a["ssd_max_bytes"],
        serve_tcp=a["serve_tcp"],
        put_reservation_bytes=0,
        name=f"holder{a['index']}",
    )
    print(json.dumps({"ready": True}), flush=True)
    sys.stdin.readline()
    print(json.dumps({"stats": _stats_dict(store.stats())}), flush=True)
    sys.stdin.readline()
    store.close()


def _stats_dict(st) -> dict:
    out = {}
    for k in dir(st):
        if k.startswith("_"):
            continue
        v = getattr(st, k)
        if isinstance(v, (int, float, str, dict, list)):
            out[k] = v
    return out


# ---------------------------------------------------------------------- driver
def _spawn(argv: list, env: dict, topo=None, host: int = 0):
    if topo is not None:
        from tests import netns

        env = dict(env, MOONCAKE_HOST_ID=f"trace-host-{host}")
        p = netns.run_in(
            topo.hosts[host], argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
    else:
        p = subprocess.Popen(
            argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True
        )
    _children.append(p)
    return p


def _start_master(a, host="127.0.0.1", ns=None) -> str:
    from tests.store import store_agents as sa

    flags = {
        "lease_ttl": a.lease_ttl,
        "high_watermark": a.high_watermark,
        "low_watermark": a.low_watermark,
    }
    if a.eviction_policy:
        flags["eviction_policy"] = a.eviction_policy
    m = sa.start_master(host=host, ns=ns, **flags)
    atexit.register(sa.cleanup)  # its log and port file
    _children.append(m.p)
    return m.address


def _readline(p, what: str) -> dict:
    line = p.stdout.readline()
    if not line:
        raise RuntimeError(f"kv_trace_replay: {what} died")
    return json.loads(line)


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))] if xs else 0.0


def replay(a, reqs: list, topo=None) -> dict:
    """Runs the store replay; the figures of the last 50% of requests."""
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    me = os.path.abspath(__file__)
    work = tempfile.mkdtemp(prefix="kv-trace-")
    if topo is not None and getattr(a, "kill_holder", False):  # the master outlives host 0
        master = _start_master(a, topo.addr[topo.hub], topo.hub)
    elif topo is not None:
        master = _start_master(a, topo.addr[topo.hosts[0]], topo.hosts[0])
    else:
        master = _start_master(a)
    from mooncake_store.common.layout import SEG_HEADER

    hosts = a.hosts
    kill = getattr(a, "kill_holder", False)
    # --kill-holder: host 0's memory is split between its holder and its clients
    share0 = a.memory_tokens // hosts * a.token_bytes // (1 + len(range(0, a.clients, 2)))
    holders = []
    for h in range(hosts):
        mem = a.memory_tokens // hosts * a.token_bytes
        if h == 0 and kill:
            mem = share0
        ssd = a.ssd_tokens // hosts * a.token_bytes if a.ssd_tokens else None
        cfg = {
            "index": h,
            "master": master,
            "segment_bytes": SEG_HEADER + mem,
            "ssd_dir": os.path.join(work, f"ssd{h}") if ssd else None,
            "ssd_max_bytes": ssd,
            "serve_tcp": topo is not None,
        }
        holders.append(_spawn([sys.executable, me, "--holder", json.dumps(cfg)], env, topo, h))
    for p in holders:
        _readline(p, "a segment holder")
    progress = os.path.join(work, "progress")
    with open(progress, "wb") as f:  # per client, the next request it runs
        f.write(b"".join(c.to_bytes(8, "little") for c in range(a.clients)))
    clients, outs = [], []
    for c in range(a.clients):
        out = os.path.join(work, f"client{c}.json")
        outs.append(out)
        cfg = {
            "index": c,
            "clients": a.clients,
            "master": master,
            "trace": a.trace,
            "requests": len(reqs),
            "block_tokens": a.block_tokens,
            "token_bytes": a.token_bytes,
            "speedup": a.speedup,
            "window": a.window,
            "progress": progress,
            "out": out,
            "serve_tcp": topo is not None,
            "replicas": getattr(a, "replicas", 1),
        }
        if kill:
            cfg["kill_holder"] = True
            if c % hosts == 0:
                cfg["segment_bytes"] = SEG_HEADER + share0
        clients.append(
            _spawn([sys.executable, me, "--client", json.dumps(cfg)], env, topo, c % hosts)
        )
    for p in clients:
        _readline(p, "a replay client")
    t0 = time.time()
    for p in clients:
        p.stdin.write(b"go\n")
        p.stdin.flush()
    kill_t = None
    if kill:
        victims = [holders[0]] + clients[0::2]
        kill_t = _kill_host_at_midpoint(a, len(reqs), progress, victims, clients)
        clients, holders = clients[1::2], holders[1:]
    for p in clients:
        if p.wait(timeout=a.timeout) != 0:
            raise RuntimeError("kv_trace_replay: a replay client failed")
    wall = time.time() - t0
    store_stats = []
    for p in holders:
        p.stdin.write(b"stats\n")
        p.stdin.flush()
        store_stats.append(_readline(p, "a segment holder")["stats"])
        p.stdin.write(b"exit\n")
        p.stdin.flush()
    for p in holders:
        p.wait(timeout=60)
    recs, kv_stats = [], collections.Counter()
    for out in outs:
        with open(out) as f:
            got = json.load(f)
        recs += got["records"]
        kv_stats.update(got["stats"])
    shutil.rmtree(work, ignore_errors=True)  # the SSD directories: up to GiBs
    recs.sort()
    killed = {}
    if kill_t is not None:
        drops = store_stats[0].get("drops", {}) if store_stats else {}
        killed = {"kill_holder": kill_holder_figures(a, reqs, recs, kill_t, drops)}
    half = len(reqs) // 2
    hit_b = tot_b = hit_t = tot_t = 0
    lost = wrong = 0
    for i, hit, got_tokens, bad, *_ in recs:
        _ts, n, ids = reqs[i]
        lost += (hit - got_tokens + a.block_tokens - 1) // a.block_tokens
        wrong += bad > 0
        if i >= half:
            hit_b += got_tokens // a.block_tokens
            tot_b += len(ids)
            hit_t += got_tokens
            tot_t += n
    lookups = [r[4] for r in recs]
    gets = [r[5] for r in recs if r[2]]
    puts = [r[6] for r in recs]
    trace_s = (reqs[-1][0] - reqs[0][0]) / 1000
    return {
        "requests": len(recs),
        "block_hit_rate": hit_b / tot_b if tot_b else 0.0,
        "token_hit_rate": hit_t / tot_t if tot_t else 0.0,
        "lost_chunks": lost,
        "wrong_chunks": wrong,
        "wall_s": wall,
        "requests_per_s": len(recs) / wall,
        "speedup_vs_trace": trace_s / wall if wall else 0.0,
        "lookup_p50_ms": 1000 * _pct(lookups, 50),
        "lookup_p99_ms": 1000 * _pct(lookups, 99),
        "get_p50_ms": 1000 * _pct(gets, 50),
        "get_p99_ms": 1000 * _pct(gets, 99),
        "put_p50_ms": 1000 * _pct(puts, 50),
        "put_p99_ms": 1000 * _pct(puts, 99),
        "kv_stats": dict(kv_stats),
        "store_stats": store_stats[0] if store_stats else {},
        **killed,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=DEFAULT_TRACE)
    ap.add_argument("--block-tokens", type=int, default=512)
    ap.add_argument("--memory-tokens", default="1M", help="memory budget (K, M suffixes)")
    ap.add_argument("--ssd-tokens", default="0", help="SSD tier budget (0: none)")
    ap.add_argument("--token-bytes", type=int, default=16, help="K/V bytes per token (x8)")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--hosts", type=int, default=1, choices=(1, 2))
    ap.add_argument("--speedup", type=float, default=0.0, help="x real time (0: as fast as can)")
    ap.add_argument(
        "--window", type=int, default=16, help="most requests ahead of the slowest (0: in order)"
    )
    ap.add_argument("--requests", type=int, default=None, help="the first N requests only")
    ap.add_argument("--eviction-policy", default=None, help="MasterConfig.eviction_policy")
    ap.add_argument("--lease-ttl", type=float, default=5.0, help="MasterConfig.lease_ttl_s")
    ap.add_argument("--high-watermark", type=float, default=0.95)
    ap.add_argument("--low-watermark", type=float, default=0.85)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--sim-only", action="store_true", help="the simulations, no store")
    ap.add_argument("--smoke", action="store_true", help="400 requests, 256K tokens (CI)")
    ap.add_argument("--gate", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", default=None)
    ap.add_argument(
        "--kill-holder", action="store_true", help="SIGKILL host 0 at the midpoint (--hosts 2)"
    )
    ap.add_argument("--replicas", type=int, default=1, choices=(1, 2), help="KV replica_num")
    ap.add_argument("--client", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--holder", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.client is not None:
        _client()
        return 0
    if a.holder is not None:
        _holder()
        return 0
    if a.smoke:
        a.requests = a.requests or 400
        a.memory_tokens = "256K"
    if a.smoke and not os.path.exists(a.trace):
        # a fresh clone without the published trace beside it: the same format, generated
        missing = a.trace
        a.trace = os.path.join(tempfile.mkdtemp(prefix="kv-trace-"), "synthetic_trace.jsonl")
        synthetic_trace(a.trace, block=a.block_tokens)
        print(f"kv_trace_replay --smoke: no trace at {missing}; a synthetic one: {a.trace}")
    a.memory_tokens = parse_tokens(a.memory_tokens)
    a.ssd_tokens = parse_tokens(a.ssd_tokens)
    if a.token_bytes < 8 or a.token_bytes % 8:
        ap.error("--token-bytes must be a positive multiple of 8")
    if a.kill_holder and (a.hosts != 2 or a.clients < 2 or a.sim_only):
        ap.error("--kill-holder needs --hosts 2, --clients >= 2 and a store (not --sim-only)")
    atexit.register(_kill_children)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # atexit then kills the children
    sys.path.insert(0, REPO)
    load0 = os.getloadavg()[0]
    reqs = load_trace(a.trace, a.requests)
    total = a.memory_tokens + a.ssd_tokens
    t = time.perf_counter()
    sim = {
        "lru": simulate(reqs, a.block_tokens, total, "lru"),
        "lfu": simulate(reqs, a.block_tokens, total, "lfu"),
        "belady": simulate(reqs, a.block_tokens, total, "belady"),
        "unbounded": simulate(reqs, a.block_tokens, None, "lru"),
    }
    if a.ssd_tokens:
        sim["lru_memory_only"] = simulate(reqs, a.block_tokens, a.memory_tokens, "lru")
    sim_s = time.perf_counter() - t
    ext = kvcache_simulator_figures(a.trace, total, a.block_tokens, a.requests)
    res: dict = {
        "lru_block_hit_rate": sim["lru"]["block_hit_rate"],
        "lfu_block_hit_rate": sim["lfu"]["block_hit_rate"],
        "opt_block_hit_rate": sim["belady"]["block_hit_rate"],
        "lru_token_hit_rate": sim["lru"]["token_hit_rate"],
        "unbounded_block_hit_rate": sim["unbounded"]["block_hit_rate"],
        "simulation": sim,
        "simulation_s": sim_s,
        "kvcache_simulator": ext,
    }
    if not a.sim_only:
        topo_cm = None
        if a.hosts == 2:
            from tests import netns

            ok, why = netns.available()
            if not ok:
                print(f"kv_trace_replay --hosts 2: skipped: network namespaces: {why}")
                return 0
            topo_cm = netns.hosts(2, "mcktr")
        if topo_cm is not None:
            with topo_cm as topo:
                res.update(replay(a, reqs, topo))
        else:
            res.update(replay(a, reqs))
    tiers = f"memory {a.memory_tokens / (1 << 20):g}M tokens" + (
        f" + SSD {a.ssd_tokens / (1 << 20):g}M" if a.ssd_tokens else ""
    )
    lines = [
        f"{len(reqs)} requests of {os.path.basename(a.trace)}, {a.block_tokens}-token blocks, "
        f"{tiers}, {a.token_bytes} B of K/V per token, {a.clients} clients on {a.hosts} host(s), "
        f"policy {a.eviction_policy or 'lru'}, speedup {a.speedup or 'max'}; "
        f"{time.strftime('%Y-%m-%d %H:%M')}, load {load0:.1f} before",
        "",
        "| | block hit rate | token hit rate |",
        "|---|---|---|",
    ]
    if not a.sim_only:
        lines.append(
            f"| store | {100 * res['block_hit_rate']:.2f}% | {100 * res['token_hit_rate']:.2f}% |"
        )
    for name in ("lru", "lfu", "belady", "unbounded", "lru_memory_only"):
        if name in sim:
            s = sim[name]
            lines.append(
                f"| sim {name} | {100 * s['block_hit_rate']:.2f}% | {100 * s['token_hit_rate']:.2f}% |"
            )
    if ext is not None:
        lines.append(f"kvcache-simulator: {ext}")
    gates = {}
    if not a.sim_only:
        st = res["store_stats"]
        lines += [
            "",
            f"{res['requests']} requests in {res['wall_s']:.1f} s: {res['requests_per_s']:.1f} req/s, "
            f"{res['speedup_vs_trace']:.1f}x real time; lookup p50/p99 {res['lookup_p50_ms']:.2f}/"
            f"{res['lookup_p99_ms']:.2f} ms, get {res['get_p50_ms']:.2f}/{res['get_p99_ms']:.2f} ms, "
            f"put {res['put_p50_ms']:.2f}/{res['put_p99_ms']:.2f} ms",
            f"lost chunks {res['lost_chunks']}, wrong chunks {res['wrong_chunks']}; store: "
            f"evictions {st.get('evictions')}, offloads {st.get('offloads')}, ssd drops "
            f"{st.get('ssd_drops')}, promotes {st.get('promotes')}",
        ]
        lru = res["lru_block_hit_rate"]
        if a.ssd_tokens:
            gates["block hit rate >= 0.97x simulated LRU at memory + SSD"] = (
                res["block_hit_rate"] >= 0.97 * lru
            )
        else:
            gates["block hit rate within 1 point of simulated LRU"] = (
                res["block_hit_rate"] >= lru - 0.01
            )
        if not a.smoke and a.requests is None:
            gates[">= 20x real time"] = res["speedup_vs_trace"] >= 20
        gates["0 lost or wrong chunks"] = res["wrong_chunks"] == 0 and res["lost_chunks"] == 0
        if "kill_holder" in res:
            lines += kill_holder_lines(res["kill_holder"])
            k = res["kill_holder"]
            # the whole run's rate mixes two hosts and one; a dead holder's chunks are lost
            gates = {}
            if a.replicas >= 2:
                gates["host 1's hit rate after the kill >= 0.9x before"] = (
                    k["after_over_before"] >= 0.9
                )
            gates["0 wrong K/V"] = k["wrong_chunks"] == 0
        lines.append("")
        lines += [f"gate {'PASS' if ok else 'FAIL'}: {name}" for name, ok in gates.items()]
    print("\n".join(lines))
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write("\n".join(lines) + "\n")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({**res, "gates": gates, "args": vars(a)}, f, indent=1)
    if not a.sim_only and res["wrong_chunks"]:
        return 1
    return 1 if a.gate and not all(gates.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
