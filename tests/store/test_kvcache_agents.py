"""KVCacheStore for agent workflows: transformers caches in and out (generation with reuse
equals a full prefill), exact breakpoints, weight versions, tenants and salts at every
tier, per-tenant quotas, invalidation by tag with readers in other processes, miss
diagnosis (every cause), holds, prefetch from the SSD tier, metrics, and bad input.

Real processes: the master and segment owners are started by store_agents; readers of
the invalidation test are processes of their own (tests/store/kv_reader.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from mooncake_store import (
    KVCacheConfig,
    KVCacheStore,
    MooncakeStore,
    WeightSync,
)
from tests import REPO_ROOT
from tests.store import store_agents as sa
from tests.store.tiny_models import MODELS

MiB = 1 << 20
pytestmark = pytest.mark.timeout(180)
L, H, D = 2, 2, 8


def _kv_for(tokens, *, d=D, layers=L):
    """Deterministic K/V of a token sequence: position i holds a function of tokens[:i+1]."""
    t = torch.as_tensor(tokens, dtype=torch.float64)
    run = torch.cumsum(t * 1.000001 + 1, 0)
    base = torch.stack([run * (l + 1) + s for l in range(layers) for s in range(2)]).reshape(
        layers, 2, 1, -1, 1
    )
    return (base + torch.arange(H * d, dtype=torch.float64).reshape(1, 1, H, 1, d)).float()


def _client(addr, **kw):
    return MooncakeStore(serve_tcp=False, master=addr, segment_size=0, **kw)


def _node(m, size=16 * MiB, **cfg):
    return sa.start_agent({"master": m.address, "segment_size": size, "name": "node", **cfg})


# ---------------------------------------------------------------------- transformers
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_transformers_reuse_equals_a_full_prefill(procs, family):
    """K/V goes in as the model's DynamicCache and comes out as one the model continues
    from: logits equal a full prefill's within float rounding and greedy generation is the
    same token for token, at hit lengths on a chunk boundary (48) and off it (37, at a
    breakpoint; 69, inside the partial chunk of the breakpoint at 70)."""
    m = sa.start_master()
    _node(m)
    model = MODELS[family]()
    g = torch.Generator().manual_seed(3)
    a = torch.randint(3, 512, (70,), generator=g)
    with _client(m.address) as s:
        kv = KVCacheStore(s, tenant="t", config=KVCacheConfig(chunk_tokens=16, model=family))
        with torch.no_grad():
            out = model(a.unsqueeze(0), use_cache=True)
        r = kv.put(a, out.cache, breakpoints=[37, 70])
        assert (r.stored_chunks, r.existing_chunks, r.tokens) == (4 + 2, 0, 70)
        cases = [
            (torch.cat([a[:37], torch.randint(3, 512, (20,), generator=g)]), 37),
            (torch.cat([a[:48], torch.randint(3, 512, (9,), generator=g)]), 48),
            (a, 69),
        ]
        for prompt, want in cases:
            n = min(kv.match_prefix(prompt), len(prompt) - 1)
            assert n == want
            hit = kv.get(prompt, n)
            assert hit.tokens == want
            with torch.no_grad():
                full = model(prompt.unsqueeze(0)).logits[0, n:]
                part = model(prompt[n:].unsqueeze(0), cache=hit.to_dynamic_cache()).logits[0]
            assert torch.allclose(part, full, atol=1e-5, rtol=0), (part - full).abs().max()
            with torch.no_grad():
                ref = model.generate(
                    prompt.unsqueeze(0), max_new_tokens=8, do_sample=False, pad_token_id=0
                )
                got = model.generate(
                    prompt.unsqueeze(0),
                    cache=kv.get(prompt, n).to_dynamic_cache(),
                    max_new_tokens=8,
                    do_sample=False,
                    pad_token_id=0,
                )
            assert torch.equal(got, ref), (got, ref)
        assert kv.stats.hit_rate > 0


def test_a_cache_whose_layers_disagree_is_refused_before_anything_is_written(procs):
    from transformers import DynamicCache

    m = sa.start_master()
    _node(m)
    with _client(m.address) as s:
        kv = KVCacheStore(s, tenant="t", config=KVCacheConfig(chunk_tokens=4))
        bad = DynamicCache()
        bad.update(torch.randn(1, 2, 8, 8), torch.randn(1, 2, 8, 8), 0)
        bad.update(torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4), 1)
        before = s.stats().puts
        with pytest.raises(ValueError, match=r"layers disagree.*layer 1 K"):
            kv.put(list(range(8)), bad)
        two = DynamicCache()
        two.update(torch.randn(2, 2, 8, 8), torch.randn(2, 2, 8, 8), 0)
        with pytest.raises(ValueError, match=r"batch of one"):
            kv.put(list(range(8)), two)
        with pytest.raises(ValueError, match=r"no layers"):
            kv.put(list(range(8)), DynamicCache())
        assert s.stats().puts == before and kv.match_prefix(list(range(8))) == 0


# ---------------------------------------------------------------------- breakpoints
def test_breakpoints_hit_to_their_exact_end(procs):
    m = sa.start_master()
    _node(m)
    with _client(m.address) as s:
        kv = KVCacheStore(s, tenant="t", config=KVCacheConfig(chunk_tokens=16))
        p = list(range(1000, 1050))  # 3 whole chunks and a tail of 2
        # without breakpoints, today's behaviour: whole chunks only
        assert kv.put(p[:40], _kv_for(p[:40])).stored_chunks == 2
        assert kv.match_prefix(p[:40]) == 32
        r = kv.put(p, _kv_for(p), breakpoints=[5, 40, 48, 50])  # 48: a whole chunk ends there
        assert (r.stored_chunks, r.existing_chunks, r.tokens) == (1 + 3, 2, 50)
        assert kv.stats.partial_chunks == 3
        for n in (5, 40, 48, 50):
            assert kv.match_prefix(p[:n]) == n
            g = kv.get(p[:n], n)
            assert g.tokens == n and torch.equal(g.kv, _kv_for(p)[:, :, :, :n])
        # a prefix shorter than a breakpoint: whole chunks serve it, sliced where they can
        assert kv.match_prefix(p[:39]) == 32
        assert kv.match_prefix(p[:45]) == 40  # the partial chunk of 8 after chunk 1
        assert kv.get(p[:45], 36).tokens == 36
        # whole chunks still serve every longer prompt; a diverging tail does not hit
        q = p[:48] + [7] * 30
        assert kv.match_prefix(q) == 48
        assert kv.match_prefix(p[:40] + [9] * 3) == 40  # the partial chunk of breakpoint 40
        st = kv.stats
        assert st.hit_tokens >= 5 + 40 + 48 + 50 and st.hit_rate > 0.5
        before = s.stats().puts
        for bad, msg in (
            ([10, 5], "strictly increasing"),
            ([0], r"in \[1, 50\]"),
            ([51], r"in \[1, 50\]"),
            ([True], r"in \[1, 50\]"),
            ("12", "sequence of ints"),
        ):
            with pytest.raises(ValueError, match=msg):
                kv.put(p, _kv_for(p), breakpoints=bad)
        assert s.stats().puts == before


# ---------------------------------------------------------------------- versions
def test_weight_versions_never_mix_unless_asked(procs):
    m = sa.start_master()
    _node(m, size=32 * MiB)
    p = list(range(64))
    with _client(m.address) as s:
        v7 = KVCacheStore(s, tenant="t", config=KVCacheConfig(chunk_tokens=16, weight_version=7))
        v8 = KVCacheStore(s, tenant="t", config=KVCacheConfig(chunk_tokens=16, weight_version=8))
        v7.put(p, _kv_for(p))
        assert v7.match_prefix(p) == 64 and v8.match_prefix(p) == 0
        g = v8.get(p)
        assert g.tokens == 0 and g.kv is None
        stale = KVCacheStore(
            s,
            tenant="t",
            config=KVCacheConfig(chunk_tokens=16, weight_version=8, max_stale_versions=1),
        )
        assert stale.match_prefix(p) == 64
        g = stale.get(p)
        assert g.tokens == 64 and g.version == 7 and g.stale
        assert stale.stats.stale_hit_tokens == 64
        v8.put(p, _kv_for(p) + 1)  # the current version's own K/V wins once stored
        g = stale.get(p)
        assert g.version == 8 and not g.stale and torch.equal(g.kv, _kv_for(p) + 1)
        v9 = KVCacheStore(
            s,
            tenant="t",
            config=KVCacheConfig(chunk_tokens=16, weight_version=9, max_stale_versions=1),
        )
        assert v9.get(p).version == 8  # two versions old is too old
        v9.put(p, _kv_for(p) + 2)
        assert v9.retire_versions(keep=1) == 8  # versions 7 and 8: 4 chunks each
        assert v7.match_prefix(p) == 0 and v8.match_prefix(p) == 0 and v9.match_prefix(p) == 64
        assert v9.explain(list(p)).cause == "hit"
        with pytest.raises(ValueError, match="keep must be an int >= 0"):
            v9.retire_versions(keep=-1)
        with pytest.raises(ValueError, match="max_stale_versions needs a weight version"):
            KVCacheStore(s, config=KVCacheConfig(max_stale_versions=2))


def test_weight_version_taken_from_a_weight_sync_reader(procs):
    """A rollout worker's cache keys its K/V by the version its reader installed: K/V of
    version 1 is never served once version 2 is installed."""
    m = sa.start_master()
    _node(m, size=64 * MiB)
    p = list(range(32))
    with MooncakeStore(master=m.address, segment_size=32 * MiB, serve_tcp=False) as s:
        trainer = WeightSync(s, "policy")
        reader = WeightSync(s, "policy")
        kv = KVCacheStore(s, tenant="t", config=KVCacheConfig(chunk_tokens=16), weights=reader)
        with pytest.raises(ValueError, match="holds no version yet"):
            kv.match_prefix(p)
        state = {"w": torch.zeros(1024)}
        trainer.publish(state, version=1)
        reader.pull(into={"w": torch.empty(1024)})
        kv.put(p, _kv_for(p))
        assert kv.match_prefix(p) == 32 and kv.keys(p)[0].split("/")[4] == "v1"
        trainer.publish({"w": torch.ones(1024)}, version=2)
        reader.pull(into={"w": torch.empty(1024)})
        # the get after a match_prefix made at version 1 looks again at version 2
        assert kv.get(p).tokens == 0
        assert reader.version == 2 and kv.match_prefix(p) == 0
        assert kv.explain(p).cause == "other_weight_version"
        with pytest.raises(ValueError, match="either as config.weight_version or"):
            KVCacheStore(s, config=KVCacheConfig(weight_version=3), weights=reader)


# ---------------------------------------------------------------------- tenants
def test_no_tenant_or_salt_ever_hits_another_at_any_tier(procs, tmp_path):
    """The same tokens under tenants a/b and salts None/x/y: each lookup hits only its own
    chunks, in memory, after they moved to the SSD tier, and from another host."""
    m = sa.start_master(high_watermark=0.8, low_watermark=0.5)
    sa.start_agent(
        {
            "master": m.address,
            "segment_size": 2 * MiB + 4096,
            "name": "owner",
            "ssd_dir": str(tmp_path / "ssd"),
            "heartbeat_interval_s": 0.2,
        },
        serve_tcp=True,
        env={"MOONCAKE_HOST_ID": "host-a"},
    )
    spaces = [("a", None), ("a", "x"), ("b", None), ("b", "x"), ("b", "y")]
    p = list(range(5000, 5128))  # 8 chunks of 16
    with _client(m.address, host_id="host-a") as s:
        stores = {
            sp: KVCacheStore(s, tenant=sp[0], config=KVCacheConfig(chunk_tokens=16, salt=sp[1]))
            for sp in spaces
        }
        for i, sp in enumerate(spaces[:3]):  # a, a/x and b store their own K/V
            stores[sp].put(p, _kv_for(p) + 100 * i)

        def check(clients):
            for i, sp in enumerate(spaces):
                g = clients[sp].get(p)
                if i < 3:
                    assert g.tokens == 128 and torch.equal(g.kv, _kv_for(p) + 100 * i), sp
                else:
                    assert g.tokens == 0, sp  # b/x and b/y stored nothing: no hit of a's or b's

        check(stores)
        # push everything to the SSD tier: 300 other chunks through the 2 MiB segment
        filler = KVCacheStore(s, tenant="filler", config=KVCacheConfig(chunk_tokens=16))
        for j in range(40):
            q = [j] + list(range(j * 1000, j * 1000 + 127))
            filler.put(q, _kv_for(q, d=64))
        deadline = time.monotonic() + 30
        while s.stats().ssd_objects < 24:
            assert time.monotonic() < deadline, s.stats()
            time.sleep(0.05)
        check(stores)
        with _client(m.address, host_id="host-b") as remote:  # another host: over TCP
            check(
                {
                    sp: KVCacheStore(
                        remote, tenant=sp[0], config=KVCacheConfig(chunk_tokens=16, salt=sp[1])
                    )
                    for sp in spaces
                }
            )
        assert stores[("b", "y")].explain(p).cause == "other_tenant"


def test_a_tenant_over_its_quota_evicts_its_own_chunks_first(procs):
    m = sa.start_master()
    _node(m, size=32 * MiB)
    with _client(m.address) as s:
        quota = 64 * 1024
        a = KVCacheStore(
            s, tenant="a", config=KVCacheConfig(chunk_tokens=16, tenant_quota_bytes=quota)
        )
        b = KVCacheStore(s, tenant="b", config=KVCacheConfig(chunk_tokens=16))
        bp = list(range(9000, 9064))
        b.put(bp, _kv_for(bp))  # 4 chunks of 4 KiB, no quota
        prompts = [[i] + list(range(i * 100, i * 100 + 63)) for i in range(12)]  # 48 chunks
        for q in prompts:
            a.put(q, _kv_for(q))
        held = sum(a.match_prefix(q) for q in prompts)
        assert 0 < held <= quota // 4096 * 16, held  # at most the quota's worth of chunks
        assert a.match_prefix(prompts[-1]) == 64  # the newest stay
        assert b.match_prefix(bp) == 64  # b's chunks were not evicted for a's quota
        e = a.explain(prompts[0])
        assert e.cause == "evicted" and "quota" in e.detail, e


def test_a_quota_evicts_whole_chains_and_never_what_a_put_continues(procs):
    """A tenant over a new, smaller quota makes room by evicting whole chains of its own (a
    parent after the chunks that continue it), and a put larger than the room stores its
    leading chunks, then raises NoSpaceError: never a chunk whose parent the quota
    evicted."""
    from mooncake_store import NoSpaceError

    m = sa.start_master()
    _node(m, size=32 * MiB)
    chunk_bytes = L * 2 * H * 16 * D * 4  # 4 KiB: 16 tokens
    with _client(m.address) as s:
        free = KVCacheStore(s, tenant="q", config=KVCacheConfig(chunk_tokens=16))
        prompts = [[i] + list(range(i * 1000, i * 1000 + 159)) for i in range(20)]  # 10 chunks
        for q in prompts:
            assert free.put(q, _kv_for(q)).stored_chunks == 10
        quota = 25 * chunk_bytes
        capped = KVCacheStore(
            s, tenant="q", config=KVCacheConfig(chunk_tokens=16, tenant_quota_bytes=quota)
        )
        new = list(range(50_000, 50_064))
        assert capped.put(new, _kv_for(new)).stored_chunks == 4
        held = sum(capped.match_prefix(q) for q in prompts) // 16 + 4
        assert held <= 25, held
        assert capped.match_prefix(new) == 64
        # reachable chunks only: every stored key's prefix is stored
        for q in prompts:
            there = s.exists_batch(capped.keys(q))
            assert there == sorted(there, reverse=True), there

        big = list(range(90_000, 90_000 + 16 * 40))  # 40 chunks, 25 fit the quota
        with pytest.raises(NoSpaceError):
            capped.put(big, _kv_for(big))
        there = s.exists_batch(capped.keys(big))
        assert there == sorted(there, reverse=True), there  # a prefix, never orphans
        n = sum(there)
        assert 0 < n <= 25 and capped.match_prefix(big) == 16 * n
        assert torch.equal(capped.get(big).kv, _kv_for(big)[:, :, :, : 16 * n])


# ---------------------------------------------------------------------- invalidation
def _tagged_prompt(agent: int, tools: int):
    """System prompt (32 tokens), a tool block (tokens 32-56, version ``tools``), then the
    agent's history (42 tokens): 6 whole chunks of 16 and a tail of 2."""
    system = list(range(100, 132))
    tool_block = [700 + tools] * 24
    history = list(range(10_000 + 1000 * agent, 10_042 + 1000 * agent))
    return system + tool_block + history


def test_invalidate_retires_tagged_chunks_everywhere_with_concurrent_readers(procs):
    """``invalidate("tools@v3")`` retires every chunk that covers a token of the tagged
    range (32-56), in every chain through it, and nothing before it; readers in two other
    processes loop ``get`` meanwhile, and no get they start after it returned serves a
    retired chunk. A chunk stored before, without the tag, is tagged by a later put."""
    m = sa.start_master()
    _node(m, size=32 * MiB)
    c = 16
    with _client(m.address) as s:
        kv = KVCacheStore(s, tenant="t", config=KVCacheConfig(chunk_tokens=c))
        first = _tagged_prompt(0, 3)
        kv.put(first[:48], _kv_for(first[:48]))  # chunks 0-2 untagged
        prompts = [_tagged_prompt(ag, 3) for ag in range(4)]
        for q in prompts:
            kv.put(q, _kv_for(q), tags={"tools@v3": (32, 56)}, breakpoints=[len(q)])
        assert all(kv.match_prefix(q) == len(q) for q in prompts)
        out = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"kv-readers-{os.getpid()}")
        readers = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.store.kv_reader",
                    m.address,
                    json.dumps(prompts),
                    f"{out}.{i}",
                    str(c),
                ],
                cwd=REPO_ROOT,
                env={**os.environ, "PYTHONPATH": REPO_ROOT},
                start_new_session=True,
            )
            for i in range(2)
        ]
        try:
            deadline = time.monotonic() + 60
            while not all(os.path.exists(f"{out}.{i}.ready") for i in range(2)):
                assert time.monotonic() < deadline
                time.sleep(0.05)
            time.sleep(0.5)
            began = time.monotonic()
            retired = kv.invalidate("tools@v3")
            done = time.monotonic()
            time.sleep(1.0)
        finally:
            for r in readers:
                r.terminate()
            for r in readers:
                r.wait(timeout=30)
        # chunk 2 (tokens 32-48) and everything after it in each chain: 4 chains of 4 whole
        # chunks (2-5) and a partial, sharing chunk 2: 1 + 4 * (3 + 1)
        assert retired == 1 + 4 * 4, retired
        samples = []
        for i in range(2):
            with open(f"{out}.{i}") as f:
                samples += [json.loads(line) for line in f]
            os.remove(f"{out}.{i}")
            os.remove(f"{out}.{i}.ready")
        after = [x for x in samples if x["start"] > done]
        # whole before the invalidate began (a get that overlapped it may serve less)
        before = [x for x in samples if x["end"] < began]
        assert after and before, (len(samples), len(after), len(before))
        assert all(x["tokens"] == len(prompts[0]) and x["ok"] for x in before)
        assert all(x["tokens"] <= 32 and x["ok"] for x in after), [
            x for x in after if x["tokens"] > 32
        ]
        for q in prompts:
            assert kv.match_prefix(q) == 32  # chunks 0-1 stay
            e = kv.explain(q)
            assert (e.cause, e.miss_token, e.chunk) == ("invalidated", 32, 2), e
            assert "tools@v3" in e.detail
        assert kv.invalidate("tools@v3") == 0 and kv.invalidate("no such tag") == 0
        # the new tool text: new chunks, no stale serve of the old tool block
        new = _tagged_prompt(0, 4)
        kv.put(new, _kv_for(new), tags={"tools@v4": (32, 56)})
        g = kv.get(new)
        assert g.tokens == 96 and torch.equal(g.kv, _kv_for(new)[:, :, :, :96])
        for bad, msg in (
            ({"x": (5, 5)}, "non-empty token range"),
            ({"x": (0, 200)}, "non-empty token range"),
            ({"x": (0, 10), "y": (5, 20)}, "tag ranges overlap"),
            ({"": (0, 1)}, "tag name"),
            ([("x", (0, 1))], "tags must be a dict"),
        ):
            with pytest.raises(ValueError, match=msg):
                kv.put(new, _kv_for(new), tags=bad)
        with pytest.raises(ValueError, match="tag must be a non-empty str"):
            kv.invalidate("")


# ---------------------------------------------------------------------- explain
def test_explain_names_every_cause(procs, tmp_path):
    m = sa.start_master(client_ttl=1.0)
    node = sa.start_agent({"master": m.address, "segment_size": 512 * 1024 + 4096, "name": "node"})
    c = 16
    with _client(m.address) as s:
        kv = KVCacheStore(s, tenant="t", config=KVCacheConfig(chunk_tokens=c, weight_version=1))
        p = list(range(64))
        kv.put(p, _kv_for(p), breakpoints=[50])
        e = kv.explain(p[:50])
        assert (e.hit_tokens, e.miss_token, e.cause) == (50, None, "hit")
        e = kv.explain(p[:60])  # ends inside chunk 3, no breakpoint at 60
        assert (e.hit_tokens, e.miss_token, e.chunk, e.cause) == (50, 50, 3, "unsaved_tail")
        e = kv.explain(list(range(500, 540)))
        assert (e.hit_tokens, e.miss_token, e.chunk, e.cause) == (0, 0, 0, "never_stored")
        other = KVCacheStore(s, tenant="u", config=KVCacheConfig(chunk_tokens=c, weight_version=1))
        assert other.explain(p).cause == "other_tenant"
        v2 = KVCacheStore(s, tenant="t", config=KVCacheConfig(chunk_tokens=c, weight_version=2))
        e = v2.explain(p)
        assert e.cause == "other_weight_version" and "v1" in e.detail
        # layout: chunk 1 of another prompt stored with 4 layers behind put's back
        q = list(range(2000, 2048))
        kv.put(q[:16], _kv_for(q[:16]))
        s.put_tensor(kv.keys(q)[1], torch.randn(4, 2, 2, 16, 8))
        e = kv.explain(q)
        assert (e.hit_tokens, e.chunk, e.cause) == (16, 1, "layout_mismatch")
        # removed by retire_versions
        v3 = KVCacheStore(s, tenant="t", config=KVCacheConfig(chunk_tokens=c, weight_version=3))
        v3.put(p, _kv_for(p))
        v3.retire_versions(keep=0)
        assert v3.explain(p).cause == "removed"
        # evicted: 60 prompts of 4 chunks of 4 KiB through a 512 KiB segment
        ev = KVCacheStore(s, tenant="ev", config=KVCacheConfig(chunk_tokens=c))
        prompts = [[i] + list(range(i * 100, i * 100 + 63)) for i in range(60)]
        for q in prompts:
            ev.put(q, _kv_for(q))
        e = ev.explain(prompts[0])
        assert e.cause == "evicted" and "memory" in e.detail, e
        # holder lost: the segment's owner dies, the master declares it dead (client_ttl 1 s)
        last = prompts[-1]
        assert ev.match_prefix(last) == 64
        node.kill()
        # until the master notices, explain says what a get does: a hit while the dead
        # owner's memory can still be read (same host), holder_lost once it cannot
        e, g = ev.explain(last), ev.get(last)
        assert e.hit_tokens in (g.tokens, 0), (e, g.tokens)
        assert e.cause == ("hit" if e.hit_tokens == 64 else "holder_lost"), e
        deadline = time.monotonic() + 20
        while ev.match_prefix(last):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        e = ev.explain(last)
        assert (e.hit_tokens, e.chunk, e.cause) == (0, 0, "holder_lost"), e
        assert "node" in e.detail


# ---------------------------------------------------------------------- holds, prefetch
def test_a_held_prefix_survives_eviction_until_released(procs):
    m = sa.start_master(high_watermark=0.8, low_watermark=0.5)
    _node(m, size=512 * 1024 + 4096)
    with _client(m.address) as s:
        kv = KVCacheStore(s, tenant="t", config=KVCacheConfig(chunk_tokens=16))
        held = list(range(64))
        kv.put(held, _kv_for(held))
        with kv.hold(held, ttl_s=60) as n:
            assert n == 64
            for i in range(60):  # 240 chunks of 4 KiB through 512 KiB
                q = [i + 1] + list(range(i * 100 + 1000, i * 100 + 1063))
                kv.put(q, _kv_for(q))
            assert kv.match_prefix(held) == 64
        for i in range(60, 120):
            q = [i + 1] + list(range(i * 100 + 1000, i * 100 + 1063))
            kv.put(q, _kv_for(q))
        assert kv.match_prefix(held) < 64  # released: evicted like any other
        for bad in (0, -1, float("nan"), 4000, True):
            with pytest.raises(ValueError, match="ttl_s must be seconds"):
                with kv.hold(held, ttl_s=bad):
                    pass


def test_prefetch_brings_ssd_chunks_back_to_memory(procs, tmp_path):
    m = sa.start_master(high_watermark=0.8, low_watermark=0.5)
    sa.start_agent(
        {
            "master": m.address,
            "segment_size": 2 * MiB + 4096,
            "name": "owner",
            "ssd_dir": str(tmp_path / "ssd"),
            "heartbeat_interval_s": 0.2,
        },
        serve_tcp=True,
        env={"MOONCAKE_HOST_ID": "host-a"},
    )
    with _client(m.address, host_id="host-b") as s:
        kv = KVCacheStore(s, tenant="t", config=KVCacheConfig(chunk_tokens=16))
        first = list(range(64))
        kv.put(first, _kv_for(first, d=64))
        for j in range(40):
            q = [j + 1] + list(range(j * 1000, j * 1000 + 63))
            kv.put(q, _kv_for(q, d=64))
        keys = kv.keys(first)
        deadline = time.monotonic() + 30
        while not all(s.where(k).memory == [] and s.where(k).ssd for k in keys):
            assert time.monotonic() < deadline, [s.where(k) for k in keys]
            time.sleep(0.05)
        assert kv.prefetch(first) == 4
        deadline = time.monotonic() + 30
        while not all(s.where(k).memory for k in keys):
            assert time.monotonic() < deadline, [s.where(k) for k in keys]
            time.sleep(0.05)
        g = kv.get(first)
        assert g.tokens == 64 and torch.equal(g.kv, _kv_for(first, d=64))


# ---------------------------------------------------------------------- metrics
def test_metrics_count_tokens_per_tenant(procs):
    from prometheus_client import REGISTRY

    m = sa.start_master()
    _node(m)
    with _client(m.address) as s:
        kv = KVCacheStore(s, tenant="metrics-t", config=KVCacheConfig(chunk_tokens=16, model="mm"))
        p = list(range(40))
        kv.put(p, _kv_for(p))

        def value(name, **labels):
            return (
                REGISTRY.get_sample_value(name, {"model": "mm", "tenant": "metrics-t", **labels})
                or 0
            )

        h0, m0 = value("mooncake_kv_hit_tokens_total"), value("mooncake_kv_miss_tokens_total")
        kv.get(p, kv.match_prefix(p))
        assert value("mooncake_kv_hit_tokens_total") - h0 == 32
        assert value("mooncake_kv_miss_tokens_total") - m0 == 8
        assert value("mooncake_kv_request_hit_ratio_count") >= 1
        assert value("mooncake_kv_get_seconds_count") >= 1
        # the master counts the tenant's bytes and drops by cause
        kv.put(p, _kv_for(p), tags={"t": (0, 8)})
        assert kv.invalidate("t") == 2
        st = s.stats()
        assert st.group_drops["kv/mm/metrics-t/"]["invalidated"] == 2
        assert st.group_bytes.get("kv/mm/metrics-t/", 0) == 0
        assert (
            'mooncake_store_group_drops_total{cause="invalidated",group="kv/mm/metrics-t/"} 2.0'
            in s.metrics()
        )
