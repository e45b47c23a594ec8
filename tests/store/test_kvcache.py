"""KVCacheStore: chained chunk hashes, shared and diverging prompts, chunk boundaries,
tenant isolation, eviction (misses only, never wrong data), reuse after a full restart
from the SSD tier, logits with reuse equal to a full prefill (a tiny decoder), one layout
per prefix (put refuses another, get never mixes), and the lookup / lost-chunk counters.
Real processes: the master and the segment owner are started by store_agents; this
process is a client without a segment."""

import importlib.util
import os
import subprocess
import sys
import time

import pytest
import torch

from mooncake_store import KVCacheConfig, KVCacheStore, MooncakeStore, chunk_hashes
from tests import REPO_ROOT
from tests.store import store_agents as sa

MiB = 1 << 20
pytestmark = pytest.mark.timeout(180)
L, H, D = 2, 2, 8


def _kv_for(tokens, *, d=D):
    """Deterministic K/V of a token sequence: position i holds a function of tokens[:i+1]
    (so equal prefixes have equal K/V, as in a real model)."""
    t = torch.as_tensor(tokens, dtype=torch.float64)
    run = torch.cumsum(t * 1.000001 + 1, 0)
    base = torch.stack([run * (l + 1) + s for l in range(L) for s in range(2)]).reshape(
        L, 2, 1, -1, 1
    )
    return (base + torch.arange(H * d, dtype=torch.float64).reshape(1, 1, H, 1, d)).float()


def _client(addr):
    return MooncakeStore(serve_tcp=False, master=addr, segment_size=0)


def test_shared_diverging_prompts_and_chunk_boundaries(procs):
    m = sa.start_master()
    sa.start_agent({"master": m.address, "segment_size": 16 * MiB, "name": "node"})
    with _client(m.address) as s:
        kv = KVCacheStore(s, tenant="a", config=KVCacheConfig(chunk_tokens=4))
        p = list(range(100, 110))  # 10 tokens: 2 whole chunks and a tail of 2
        r = kv.put(p, _kv_for(p))
        assert (r.stored_chunks, r.existing_chunks, r.tokens) == (2, 0, 8)
        assert kv.match_prefix(p) == 8
        assert kv.match_prefix(p[:8]) == 8  # exactly on a boundary
        assert kv.match_prefix(p[:7]) == 4  # one short of a boundary
        assert kv.match_prefix(p[:3]) == 0  # less than a chunk
        assert kv.match_prefix(p[:5] + [0] * 5) == 4  # diverges inside chunk 2
        assert (
            kv.match_prefix([0] + p[1:]) == 0
        )  # diverges at token 0: chained hash, nothing shared
        q = p[:8] + [7, 7, 7, 7, 7]  # shares both chunks, then diverges
        r = kv.put(q, _kv_for(q))
        assert (r.stored_chunks, r.existing_chunks) == (1, 2)  # existing chunks are hits, no error
        assert kv.stats.existing_chunks == 2 and kv.stats.stored_chunks == 3
        assert kv.match_prefix(q) == 12
        g = kv.get(q, 12)
        assert g.tokens == 12 and torch.equal(
            g.kv, _kv_for(q)[:, :, :, :12]
        )  # bytes exactly as put
        g = kv.get(p, 4)
        assert g.tokens == 4 and torch.equal(g.kv, _kv_for(p)[:, :, :, :4])
        # per-layer (K, V) pairs in and out
        r3 = list(range(300, 308))
        pairs = [(layer[0], layer[1]) for layer in _kv_for(r3)]
        assert kv.put(r3, pairs).stored_chunks == 2
        got = kv.get(r3).layers()
        assert len(got) == L and all(
            torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, pairs)
        )
        g = kv.get(p, 6)  # ends inside a stored whole chunk: that chunk, sliced
        assert g.tokens == 6 and torch.equal(g.kv, _kv_for(p)[:, :, :, :6])
        with pytest.raises(ValueError, match=r"upto must be an int in \[0, 10\]"):
            kv.get(p, 11)
        with pytest.raises(ValueError):
            kv.put(p, _kv_for(p)[:, :, :, :5])  # K/V shorter than the whole chunks
        st = kv.stats
        # 7 match_prefix calls (10+8+7+3+10+10+13 tokens, 8+8+4+0+4+0+12 hit), plus the gets
        # of a prompt no match_prefix had looked up since its last get: get(r3) (8 of 8) and
        # get(p, 6) (6 of 6); get(q, 12) and get(p, 4) used their match_prefix's lookups
        assert st.lookups == 7 + 2
        assert st.hit_tokens == 36 + 8 + 6 and st.miss_tokens == 61 - 36
        assert st.lost_tokens == 0 and st.inconsistent_chunks == 0
        # the same tokens as a tensor give the same keys; other processes compute the same hashes
        assert kv.keys(torch.tensor(p)) == kv.keys(p)
        code = (
            f"import sys; sys.path.insert(0, {os.getcwd()!r}); from mooncake_store.kvcache import chunk_hashes; "
            "print(','.join(chunk_hashes(list(range(100, 110)), 4)))"
        )
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONHASHSEED": "123"},
        )
        assert out.stdout.strip().split(",") == chunk_hashes(p, 4), out.stderr


def test_tenant_and_model_isolation(procs):
    m = sa.start_master()
    sa.start_agent({"master": m.address, "segment_size": 16 * MiB, "name": "node"})
    with _client(m.address) as s:
        a = KVCacheStore(s, tenant="a", config=KVCacheConfig(chunk_tokens=4))
        b = KVCacheStore(s, tenant="b", config=KVCacheConfig(chunk_tokens=4))
        other_model = KVCacheStore(
            s, tenant="a", config=KVCacheConfig(chunk_tokens=4, model="other")
        )
        p = list(range(16))
        a.put(p, _kv_for(p))
        assert a.match_prefix(p) == 16
        assert b.match_prefix(p) == 0 and other_model.match_prefix(p) == 0
        assert b.get(p).tokens == 0
        bk = _kv_for(p) + 1000
        assert b.put(p, bk).stored_chunks == 4  # b's own copy, a's is untouched
        assert torch.equal(a.get(p).kv, _kv_for(p)) and torch.equal(b.get(p).kv, bk)
        with pytest.raises(ValueError):
            KVCacheStore(s, tenant="x/y")


def test_salt_dash_is_its_own_namespace_and_bad_puts_write_nothing(procs):
    """A salt spelled like the no-salt marker ("-") is a namespace of its own; K/V of more
    tokens than given, more than 16 tags on a chunk, a long tag name and a non-bool pin are
    ValueErrors before anything is written; an empty prompt is a hit of 0 tokens."""
    m = sa.start_master()
    sa.start_agent({"master": m.address, "segment_size": 16 * MiB, "name": "node"})
    with _client(m.address) as s:
        plain = KVCacheStore(s, tenant="a", config=KVCacheConfig(chunk_tokens=4))
        dash = KVCacheStore(s, tenant="a", config=KVCacheConfig(chunk_tokens=4, salt="-"))
        eq = KVCacheStore(s, tenant="a", config=KVCacheConfig(chunk_tokens=4, salt="=-"))
        p = list(range(8))
        plain.put(p, _kv_for(p))
        assert dash.match_prefix(p) == 0 and eq.match_prefix(p) == 0
        assert dash.put(p, _kv_for(p) + 1).stored_chunks == 2
        assert eq.match_prefix(p) == 0
        assert torch.equal(plain.get(p).kv, _kv_for(p))
        assert torch.equal(dash.get(p).kv, _kv_for(p) + 1)

        q = list(range(50, 58))
        with pytest.raises(
            ValueError, match=r"^KVCacheStore\.put: kv covers 9 tokens, more than the 8"
        ):
            plain.put(q, _kv_for(q + [1]))
        assert plain.match_prefix(q) == 0
        plain.put(q, _kv_for(q))  # stored: the same check holds for chunks already stored
        with pytest.raises(ValueError, match="more than the 8 tokens given"):
            plain.put(q, _kv_for(q + [1]))
        many = {f"t{i}": (i, i + 1) for i in range(4)} | {f"u{i}": (4 + i, 5 + i) for i in range(4)}
        r = list(range(200, 240))
        tags = {f"t{i}": (i, i + 1) for i in range(17)}
        with pytest.raises(ValueError, match="chunk 0 .* would carry 17 tags, at most 16"):
            KVCacheStore(s, tenant="a", config=KVCacheConfig(chunk_tokens=20)).put(
                r, _kv_for(r), tags=tags
            )
        assert plain.match_prefix(r) == 0
        assert plain.put(r[:8], _kv_for(r[:8]), tags=many).stored_chunks == 2
        with pytest.raises(ValueError, match="at most 200 bytes of UTF-8"):
            plain.put(r, _kv_for(r), tags={"\u00e9" * 101: (0, 1)})
        with pytest.raises(ValueError, match="pin must be a bool"):
            KVCacheConfig(pin="yes")

        assert plain.put([], _kv_for([1])[:, :, :, :0]).stored_chunks == 0
        assert plain.get([]).kv is None and plain.match_prefix([]) == 0
        e = plain.explain([])
        assert (e.cause, e.hit_tokens) == ("hit", 0)


def test_eviction_only_misses_never_wrong_data(procs):
    m = sa.start_master(high_watermark=0.8, low_watermark=0.5)
    sa.start_agent({"master": m.address, "segment_size": 2 * MiB + 4096, "name": "node"})
    with _client(m.address) as s:
        kv = KVCacheStore(s, tenant="t", config=KVCacheConfig(chunk_tokens=64))
        prompts = [[i] * 3 + list(range(i, i + 509)) for i in range(40)]  # 8 chunks of 8 KiB each
        for p in prompts:  # 40 x 64 KiB through a 2 MiB segment
            kv.put(p, _kv_for(p, d=64))
        hits = 0
        for p in prompts:
            n = kv.match_prefix(p)
            g = kv.get(p, n)
            hits += g.tokens
            if g.tokens:
                assert torch.equal(g.kv, _kv_for(p, d=64)[:, :, :, : g.tokens])  # never wrong data
        assert 0 < hits < 40 * 512  # some chunks were evicted (misses), some survived
        assert kv.stats.miss_tokens > 0 and s.stats().evictions > 0


def test_reuse_after_full_restart_from_ssd(procs, tmp_path):
    ssd = str(tmp_path / "ssd")
    m = sa.start_master(high_watermark=0.8, low_watermark=0.5)
    node = sa.start_agent(
        {
            "master": m.address,
            "segment_size": 2 * MiB + 4096,
            "name": "node",
            "ssd_dir": ssd,
            "heartbeat_interval_s": 0.2,
        }
    )
    prompts = [
        [7] * 64 + list(range(i * 1000, i * 1000 + 448)) for i in range(12)
    ]  # shared first chunk
    with _client(m.address) as s:
        kv = KVCacheStore(s, tenant="t", config=KVCacheConfig(chunk_tokens=64))
        for p in prompts:
            kv.put(p, _kv_for(p, d=64))
        deadline = time.monotonic() + 20
        while s.stats().ssd_objects < 20 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert s.stats().ssd_objects >= 20
    node.kill()
    m.kill()
    m2 = sa.start_master()
    sa.start_agent({"master": m2.address, "segment_size": 8 * MiB, "name": "node2", "ssd_dir": ssd})
    with _client(m2.address) as s:
        kv = KVCacheStore(s, tenant="t", config=KVCacheConfig(chunk_tokens=64))
        reused = 0
        for p in prompts:
            n = kv.match_prefix(p)
            g = kv.get(p, n)
            assert g.tokens == n
            if n:
                assert torch.equal(g.kv, _kv_for(p, d=64)[:, :, :, :n])
            reused += n
        assert reused >= 20 * 64  # at least the chunks that were on SSD


def _load_example():
    path = os.path.join(REPO_ROOT, "examples", "prefix_reuse.py")
    spec = importlib.util.spec_from_file_location("prefix_reuse_example", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_logits_equal_with_and_without_reuse(procs):
    """The example's prefill with reuse (a transformers Llama) gives the logits of a full
    prefill, and the stored system prompt's K/V equals a fresh computation."""
    ex = _load_example()
    m = sa.start_master()
    sa.start_agent({"master": m.address, "segment_size": 32 * MiB, "name": "node"})
    model = ex.tiny_llama()
    g = torch.Generator().manual_seed(1)
    system = torch.randint(3, 512, (256,), generator=g)
    with _client(m.address) as s:
        kv = KVCacheStore(s, tenant="t", config=KVCacheConfig(chunk_tokens=32))
        computed = []
        for _agent in range(3):
            toks = torch.cat([system, torch.randint(3, 512, (40,), generator=g)])
            logits, n = ex.prefill(model, kv, toks)
            with torch.no_grad():
                full = model(toks.unsqueeze(0), use_cache=True)
            assert torch.allclose(logits, full.logits[0, -1], atol=1e-5, rtol=0), (
                (logits - full.logits[0, -1]).abs().max()
            )
            hit = kv.get(toks, 256)  # the stored system prompt K/V equals a fresh computation
            for layer, ref in zip(hit.layers(), full.cache.layers):
                assert torch.allclose(layer[0], ref.keys[0, :, :256], atol=1e-5, rtol=0)
                assert torch.allclose(layer[1], ref.values[0, :, :256], atol=1e-5, rtol=0)
            computed.append(n)
    assert computed[0] == 296 and computed[1] == computed[2] == 296 - 256  # prefill saved


def test_example_runs():
    out = subprocess.run(
        [
            sys.executable,
            os.path.join("examples", "prefix_reuse.py"),
            "--agents",
            "3",
            "--turns",
            "2",
            "--system-tokens",
            "256",
            "--chunk",
            "64",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert (
        "logits equal (within float32 rounding): True" in out.stdout
        and "TTFT with reuse" in out.stdout
    )


def test_one_layout_per_prefix(procs):
    """``put`` refuses K/V whose layout (layers, kv heads, head_dim, dtype) differs from the
    chunks of the same tokens already stored, or whose per-layer K and V differ, before
    writing anything; ``get`` returns only the leading chunks of the first chunk's layout
    when the store holds a mix anyway (written behind KVCacheStore's back), never raises."""
    m = sa.start_master()
    sa.start_agent({"master": m.address, "segment_size": 16 * MiB, "name": "node"})
    with _client(m.address) as s:
        kv = KVCacheStore(s, tenant="lay", config=KVCacheConfig(chunk_tokens=16))
        X = list(range(500, 548))  # 3 chunks
        first = torch.randn(2, 2, 2, 16, 8)
        assert kv.put(X[:16], first).stored_chunks == 1
        before = s.stats()
        for bad, got in (
            (torch.randn(3, 2, 2, 32, 8), "layers=3, kv_heads=2, head_dim=8, dtype=float32"),
            (torch.randn(2, 2, 2, 48, 4), "layers=2, kv_heads=2, head_dim=4, dtype=float32"),
            (torch.randn(2, 2, 4, 32, 8), "layers=2, kv_heads=4, head_dim=8, dtype=float32"),
            (
                torch.randn(2, 2, 2, 32, 8).bfloat16(),
                "layers=2, kv_heads=2, head_dim=8, dtype=bfloat16",
            ),
        ):
            with pytest.raises(
                ValueError,
                match=r"^KVCacheStore\.put: kv layout differs .*expected layers=2, kv_heads=2, "
                r"head_dim=8, dtype=float32 as stored in chunk 0 .*got " + got,
            ):
                kv.put(X[: bad.shape[3]], bad)
        pairs = [
            (torch.randn(2, 32, 8), torch.randn(2, 32, 8).half()),
            (torch.randn(2, 32, 8), torch.randn(2, 32, 8)),
        ]
        with pytest.raises(
            ValueError,
            match=r"^KVCacheStore\.put: per-layer K and V .*expected \[2, 32, 8\] float32 .*"
            r"\(layer 0 K\), got \[2, 32, 8\] float16 .*\(layer 0 V\)",
        ):
            kv.put(X[:32], pairs)
        pairs = [
            (torch.randn(2, 32, 8), torch.randn(2, 32, 8)),
            (torch.randn(2, 32, 4), torch.randn(2, 32, 4)),
        ]
        with pytest.raises(ValueError, match=r"got \[2, 32, 4\] float32 .*\(layer 1 K\)"):
            kv.put(X[:32], pairs)
        after = s.stats()  # nothing was written; the check read metadata only (no get, no lease)
        assert after.puts == before.puts and after.gets == before.gets and kv.match_prefix(X) == 16
        g = kv.get(X)
        assert g.tokens == 16 and torch.equal(g.kv, first)
        # the same layout is accepted and extends the prefix; another tenant has its own layout
        rest = torch.randn(2, 2, 2, 48, 8)
        assert kv.put(X, rest) == (2, 1, 48, 0)
        g = kv.get(X)
        assert (
            g.tokens == 48
            and torch.equal(g.kv[:, :, :, :16], first)
            and torch.equal(g.kv[:, :, :, 16:], rest[:, :, :, 16:])
        )
        other = KVCacheStore(s, tenant="lay2", config=KVCacheConfig(chunk_tokens=16))
        assert other.put(X, torch.randn(3, 2, 2, 48, 4).bfloat16()).stored_chunks == 3

        # a mix written around put's check (another writer, an older version): get never mixes
        Y = list(range(900, 964))  # 4 chunks
        ky = kv.keys(Y)
        y0 = torch.randn(2, 2, 2, 16, 8)
        s.put_tensor(ky[0], y0)
        s.put_tensor(ky[1], torch.randn(3, 2, 2, 16, 8))  # 3 layers
        s.put_tensor(ky[2], torch.randn(2, 2, 2, 16, 8))  # the first layout again, after the cut
        s.put(ky[3], b"not a tensor")
        g = kv.get(Y)
        assert g.tokens == 16 and torch.equal(g.kv, y0)
        # the lookup ends the prefix at chunk 1 (another layout) and reads nothing after it
        assert kv.stats.inconsistent_chunks == 1 and kv.stats.lost_tokens == 0
        with pytest.raises(
            ValueError, match=r"^KVCacheStore\.put: kv layout differs .*chunk 1 of 4"
        ):
            kv.put(Y, torch.randn(2, 2, 2, 64, 8))
        W = list(range(1200, 1232))
        s.put(kv.keys(W)[1], b"not a tensor")
        with pytest.raises(
            ValueError,
            match=r"expected a K/V chunk there \(it holds another object\) .*chunk 1 of 2",
        ):
            kv.put(W, torch.randn(2, 2, 2, 32, 8))
        assert not s.exists(kv.keys(W)[0])
        Z = list(range(2000, 2032))
        kz = kv.keys(Z)
        s.put_tensor(kz[0], torch.randn(2, 2, 2, 16, 8))
        s.put_tensor(kz[1], torch.randn(2, 2, 2, 16, 8).bfloat16())  # float32 then bf16
        g = kv.get(Z)
        assert g.tokens == 16 and g.kv.dtype == torch.float32
        s.put_tensor(
            kv.keys(list(range(3000, 3016)))[0], torch.randn(2, 16, 8)
        )  # not [layers, 2, heads, T, D]
        g = kv.get(list(range(3000, 3016)))
        assert g.tokens == 0 and g.kv is None


def test_stats_lookups_and_lost_tokens(procs):
    """Lookups count tokens: a prompt's stored prefix as hits, the rest as misses. ``get``
    is a lookup except right after a ``match_prefix`` of the same prompt; ``lost_tokens``
    counts only tokens a lookup found that ``get`` could not read, never tokens that were
    not stored."""
    m = sa.start_master()
    sa.start_agent({"master": m.address, "segment_size": 16 * MiB, "name": "node"})
    with _client(m.address) as s:
        cfg = KVCacheConfig(chunk_tokens=16)
        kv = KVCacheStore(s, tenant="st", config=cfg)
        unknown = list(range(7000, 7040))
        g = kv.get(unknown, 32)  # never stored: misses, not lost
        assert g.tokens == 0 and g.kv is None
        st = kv.stats
        assert (st.lookups, st.hit_tokens, st.miss_tokens, st.lost_tokens) == (1, 0, 32, 0)
        assert st.hit_rate == 0.0
        p = list(range(64))
        kv.put(p, _kv_for(p))
        reader = KVCacheStore(s, tenant="st", config=cfg)
        g = reader.get(p)  # a get alone of 4 chunks that all hit: 64 hit tokens
        assert g.tokens == 64 and torch.equal(g.kv, _kv_for(p))
        st = reader.stats
        assert (st.lookups, st.hit_tokens, st.miss_tokens, st.hit_chunks, st.lost_tokens) == (
            1,
            64,
            0,
            4,
            0,
        )
        assert st.hit_rate == 1.0
        # match_prefix then get of the same prompt: one lookup
        longer = p + [1, 2, 3] * 10
        assert reader.match_prefix(longer) == 64  # 64 hits, 30 misses
        assert reader.get(longer, 64).tokens == 64
        st = reader.stats
        assert (st.lookups, st.hit_tokens, st.miss_tokens, st.lost_tokens) == (2, 128, 30, 0)
        # a chunk removed between match_prefix and get (with the chunk after it, its child):
        # its tokens and the child's are lost; the chunks before it are read
        assert reader.match_prefix(p) == 64
        s.remove(reader.keys(p)[2], force=True)
        g = reader.get(p, 64)
        assert g.tokens == 32 and torch.equal(g.kv, _kv_for(p)[:, :, :, :32])
        st = reader.stats
        assert (st.lookups, st.hit_tokens, st.miss_tokens, st.lost_tokens) == (3, 192, 30, 32)
        # without a match_prefix, the missing chunks are misses of get's own lookup (not lost)
        g = reader.get(p)
        assert g.tokens == 32
        st = reader.stats
        assert (st.lookups, st.hit_tokens, st.miss_tokens, st.lost_tokens) == (4, 224, 62, 32)
        # match_prefix found nothing for unknown tokens: get of them loses nothing
        assert reader.match_prefix(unknown) == 0 and reader.get(unknown, 32).tokens == 0
        assert reader.stats.lost_tokens == 32 and reader.stats.miss_tokens == 62 + 40


def test_tokens_as_lists_tensors_and_numpy_arrays_hash_alike():
    """Token ids may come as ints, a 1-D integer tensor or a 1-D NumPy integer array (of
    any width: an int32 array was refused), with the same chunk hashes; anything else
    that is not a 64-bit integer is a ValueError naming the value."""
    import numpy as np
    import torch

    from mooncake_store import chunk_hashes

    ids = list(range(1000, 1100))
    ref = chunk_hashes(ids, 16)
    for same in (
        torch.tensor(ids, dtype=torch.int32),
        np.array(ids, dtype=np.int32),
        np.array(ids, dtype=np.uint16),
        [np.int64(t) for t in ids],
    ):
        assert chunk_hashes(same, 16) == ref
    for bad in (
        [True] * 16,
        [1.5] * 16,
        np.ones(16),
        np.ones((4, 4), dtype=np.int64),
        np.full(16, 2**64 - 1, dtype=np.uint64),
        [np.bool_(True)] * 16,
    ):
        with pytest.raises(ValueError, match="tokens must be"):
            chunk_hashes(bad, 16)


def test_prefix_larger_than_the_owners_memory(procs, tmp_path):
    """Found by a new-user trial: a one-shot put of 40 chunks of 1 MiB into an 8 MiB
    segment with an SSD tier raised NoSpaceError after 7 chunks (the whole batch was placed
    at once); it now goes in waves and stores every chunk. A get of that prefix from
    another host (the owner loads SSD chunks back into its memory, which holds 7, some of
    them the newest chunks, leased by the get itself) waited rpc_timeout_s (10 s) and now
    returns the readable prefix about a second after the loads stop, equal to the
    reference; once the leases end, a shorter prefix loads whole."""
    m = sa.start_master()
    sa.start_agent(
        {
            "master": m.address,
            "segment_size": 8 * MiB,
            "name": "owner",
            "ssd_dir": str(tmp_path / "ssd"),
            "heartbeat_interval_s": 0.2,
        },
        serve_tcp=True,
        env={"MOONCAKE_HOST_ID": "host-a"},
    )
    toks = list(range(40 * 256))
    ref = _kv_for(toks, d=128)  # [L=2, 2, H=2, T, 128] float32: 1 MiB per chunk of 256 tokens
    with MooncakeStore(master=m.address, segment_size=0, host_id="host-b", serve_tcp=False) as s:
        kv = KVCacheStore(s, config=KVCacheConfig(chunk_tokens=256))
        assert kv.put(toks, ref).stored_chunks == 40
        deadline = time.monotonic() + 20
        while s.stats().ssd_objects < 30:
            assert time.monotonic() < deadline, s.stats()
            time.sleep(0.05)
        t0 = time.monotonic()
        g = kv.get(toks)
        took = time.monotonic() - t0
        assert 256 <= g.tokens < 40 * 256 and torch.equal(g.kv, ref[:, :, :, : g.tokens]), g.tokens
        assert took < 6.0, f"get took {took:.1f} s"
        time.sleep(5.5)  # the first get's read leases (5 s) hold the owner's memory until then
        g4 = kv.get(toks, 4 * 256)
        assert g4.tokens == 4 * 256 and torch.equal(g4.kv, ref[:, :, :, : 4 * 256])
