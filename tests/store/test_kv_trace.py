"""The trace replay (``benchmarks/kv_trace_replay.py``) against an independent simulation.

A small conversation trace in the FAST'25 format (chained block ids) is replayed through
``KVCacheStore`` on a real master, segment holder and client processes; the store's block
hit rate must equal that of a block LRU cache of the same budget computed here, and every
chunk read must hold the K/V of its tokens.
"""

from __future__ import annotations

import collections
import json
import os
import random
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(REPO, "benchmarks", "kv_trace_replay.py")
BLOCK = 64


def _trace(path: str, seed: int = 0) -> list:
    """Conversations over a shared system prompt, turns interleaved in time."""
    rng = random.Random(seed)
    next_id = [0]

    def new_id():
        next_id[0] += 1
        return next_id[0] - 1

    system = [new_id() for _ in range(4)]
    reqs = []
    for conv in range(40):
        ids = list(system)
        t = rng.uniform(0, 60_000)
        for _turn in range(rng.randint(1, 8)):
            ids = ids + [new_id() for _ in range(rng.randint(1, 6))]
            n = len(ids) * BLOCK - rng.randint(0, BLOCK - 1)
            reqs.append(
                {"timestamp": int(t), "input_length": n, "output_length": 1, "hash_ids": ids}
            )
            t += rng.uniform(1_000, 20_000)
        del conv
    reqs.sort(key=lambda r: r["timestamp"])
    with open(path, "w") as f:
        for r in reqs:
            f.write(json.dumps(r) + "\n")
    return reqs


def _lru_block_hits(reqs: list, capacity_blocks: int) -> float:
    """Block LRU: a prompt hits its longest cached prefix of whole blocks, then uses them all.

    A prompt's blocks are used from its last to its first, so a prefix is more recently used
    than every block after it (the store's order: no chunk outlives its prefix).
    """
    cache = collections.OrderedDict()
    half = len(reqs) // 2
    hit = total = 0
    for i, r in enumerate(reqs):
        blocks = r["hash_ids"][: r["input_length"] // BLOCK]
        k = 0
        while k < len(blocks) and blocks[k] in cache:
            k += 1
        if i >= half:
            hit += k
            total += len(r["hash_ids"])
        for b in reversed(blocks):
            cache[b] = None
            cache.move_to_end(b)
        while len(cache) > capacity_blocks:
            cache.popitem(last=False)
    return hit / total


def _replay(tmp_path, trace: str, memory_tokens: int, clients: int, extra: list, timeout_s):
    """Runs the benchmark on ``trace`` in strict order (``--window 0``: each request after
    the previous one, whichever client serves it) and returns its ``--json`` figures."""
    out = str(tmp_path / "out.json")
    subprocess.run(
        [
            sys.executable,
            BENCH,
            "--trace",
            trace,
            "--block-tokens",
            str(BLOCK),
            "--memory-tokens",
            str(memory_tokens),
            "--clients",
            str(clients),
            "--window",
            "0",
            *extra,
            "--json",
            out,
        ],
        check=True,
        timeout=timeout_s,
        env={**os.environ, "PYTHONPATH": REPO},
        stdout=subprocess.DEVNULL,
    )
    with open(out) as f:
        return json.load(f)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("clients", [1, 2])
def test_replay_hit_rate_equals_lru_simulation(tmp_path, clients):
    trace = str(tmp_path / "trace.jsonl")
    reqs = _trace(trace)
    capacity = 96  # blocks: well below the trace's working set, so eviction decides the hits
    got = _replay(
        tmp_path,
        trace,
        capacity * BLOCK,
        clients,
        # evict on demand only: the cache holds all of its memory, as the simulation does
        ["--high-watermark", "1", "--low-watermark", "1"],
        timeout_s=170,
    )
    want = _lru_block_hits(reqs, capacity)
    assert got["requests"] == len(reqs)
    assert got["wrong_chunks"] == 0 and got["lost_chunks"] == 0
    assert want > 0.05  # the trace reuses prefixes at this budget
    assert got["block_hit_rate"] == pytest.approx(want, abs=1e-9), (got["block_hit_rate"], want)


def _prefix_hits(reqs: list, rows: list) -> float:
    """Block hit rate of ``rows`` (request indices) under a cache that keeps every block."""
    seen: set = set()
    hits = {}
    for i, r in enumerate(reqs):
        blocks = r["hash_ids"][: r["input_length"] // BLOCK]
        k = 0
        while k < len(blocks) and blocks[k] in seen:
            k += 1
        hits[i] = k
        seen.update(blocks)
    return sum(hits[i] for i in rows) / sum(len(reqs[i]["hash_ids"]) for i in rows)


@pytest.mark.timeout(240)
# in the full run: tests/store/test_kv_hosts.py covers a dead holder with 1 and 2 replicas
# in the default run
@pytest.mark.slow
@pytest.mark.parametrize("replicas", [2, 1])
def test_replay_kill_holder(tmp_path, replicas):
    """``--kill-holder``: host 0 dies at the midpoint; host 1 keeps its hits with 2 replicas."""
    from tests import netns

    ok, why = netns.available()
    if not ok:
        pytest.skip(f"network namespaces: {why}")
    trace = str(tmp_path / "trace.jsonl")
    reqs = _trace(trace, seed=1)
    clients, n = 4, len(reqs)
    blocks = len({b for r in reqs for b in r["hash_ids"][: r["input_length"] // BLOCK]})
    # every chunk fits, evictions aside. 2 replicas: host 1's holder takes one of each (2x);
    # 1 replica: 1.5x, host 1's holder 0.75x of them, host 0's holder and 2 clients 0.25x
    # each, so host 0 holds a good part (placement picks the segment with most free space)
    memory = blocks * BLOCK * 4 if replicas == 2 else blocks * BLOCK * 3 // 2
    extra = ["--hosts", "2", "--kill-holder", "--replicas", str(replicas)]
    got = _replay(tmp_path, trace, memory, clients, extra, timeout_s=230)["kill_holder"]
    # host 1's requests: its clients' (odd) share of the first half, all of the second
    before = [i for i in range(n // 4, n // 2) if i % clients % 2 == 1]
    after = list(range(n // 2, n))
    assert got["b_requests_before"] == len(before) and got["b_requests_after"] == len(after)
    assert got["wrong_chunks"] == 0
    want_before, want_after = _prefix_hits(reqs, before), _prefix_hits(reqs, after)
    assert want_after > 0.3  # the second half reuses prefixes of the first
    assert got["block_hit_rate_before"] == pytest.approx(want_before, abs=1e-9)
    if replicas == 2:
        assert got["holder_lost_drops"] == 0
        assert got["block_hit_rate_after"] == pytest.approx(want_after, abs=1e-9)
    else:
        assert got["holder_lost_drops"] > 0
        assert got["block_hit_rate_after"] < want_after
        assert got["holder_lost_misses"] > 0
