"""Links between objects and what the master does with them (docs/store.md "Links, tags,
groups and holds"): parents and cascading drops, tags and ``invalidate``, the drop
history, quota groups, holds, ``promote``, prefix listing and removal, their metrics,
and their persistence through an etcd failover and a full restart from the SSD tier.
Real master and client processes on 127.0.0.1."""

import glob
import hashlib
import os
import random
import time
import urllib.request

import pytest

from mooncake_store import (
    InvalidatedError,
    MooncakeStore,
    NoSpaceError,
    ParentMissingError,
    ReplicateConfig,
)
from tests.store import store_agents as sa
from tests.store.test_store_ha import is_leader, start_pair

KiB, MiB = 1 << 10, 1 << 20
pytestmark = pytest.mark.timeout(120)


def client(m, **kw) -> MooncakeStore:
    return MooncakeStore(serve_tcp=False, master=m.address, segment_size=0, **kw)


def put(s, keys, size=1000, *, pref=None, seed=0, **kw) -> list:
    """``internal.put_many`` of ``sa.pattern(seed + i, size)`` values; per key the replicas
    placed or the error (in place)."""
    vals = [sa.pattern(seed + i, size) for i in range(len(keys))]
    return s.internal.put_many(
        keys,
        vals,
        [b""] * len(keys),
        ReplicateConfig(preferred_segment=pref),
        return_exceptions=True,
        **kw,
    )


def chain(prefix: str, n: int) -> tuple:
    """``(keys, parents)`` of a chain of ``n`` objects: each one hangs off the one before."""
    keys = [f"{prefix}/{i}" for i in range(n)]
    return keys, [None] + keys[:-1]


def node(m, name: str, size: int, **kw) -> sa.Agent:
    return sa.start_agent(
        {
            "master": m.address,
            "segment_size": size,
            "name": name,
            "heartbeat_interval_s": 0.2,
            **kw,
        }
    )


def wait_for(cond, what: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_parents_refused_when_missing_and_removes_cascade(procs):
    m = sa.start_master()
    node(m, "node", 16 * MiB)
    # a writer that pauses between put_start and the copy (so the two-request way)
    slow = sa.start_agent(
        {"master": m.address, "segment_size": 0}, env={"MOONCAKE_STORE_TEST_PAUSE": "put:1.0"}
    )
    with client(m) as s:
        with pytest.raises(ValueError, match="names itself"):
            put(s, ["a"], parents=["a"])
        with pytest.raises(ValueError, match="parents"):
            put(s, ["a", "b"], parents=[None])
        (r,) = put(s, ["orphan"], parents=["never-put"])
        assert isinstance(r, ParentMissingError) and not s.exists("orphan")
        # parents earlier in the same call count, on both put paths (1000 B: one request
        # into the put reservation; 512 KiB: put_start + put_end)
        for size, name in ((1000, "small"), (512 * KiB, "large")):
            keys, parents = chain(name, 4)
            assert put(s, keys, size, parents=parents) == [1] * 4
            assert all(s.exists_batch(keys))
        # a parent removed while its child is being written: the child's commit fails
        assert put(s, ["p"]) == [1]
        slow.send("iput", keys=["p/c"], seeds=[1], sizes=[300 * KiB], parents=["p"])
        time.sleep(0.3)
        s.remove("p")
        assert slow.reply() == ["ParentMissingError"]
        assert not s.exists("p/c")
        # an upsert of a parent keeps its children; a remove drops them all
        s.upsert("large/0", b"new value")
        assert all(s.exists_batch(chain("large", 4)[0]))
        s.remove("large/1")
        assert s.exists_batch(chain("large", 4)[0]) == [True, False, False, False]
        h = s.internal.history(["large/0", "large/1", "large/2", "large/3", "small/0"])
        assert h[0] is None and h[4] is None
        assert (h[1].cause, h[1].tier, h[1].detail) == ("removed", "memory", "")
        assert [(e.cause, e.detail) for e in h[2:4]] == [("removed", "with parent large/1")] * 2
        # the same key put again leaves the history
        put(s, ["large/1"], parents=["large/0"])
        assert s.internal.history(["large/1"]) == [None]


def test_eviction_cascades_across_segments_and_holds_stop_it(procs):
    """The root of a chain lies in segment A, its descendants in B: evicting the root to
    make room in A drops them too, unless one of them is held."""
    # high watermark 1.0: only a put's own eviction runs (no background pass in between)
    m = sa.start_master(high_watermark=1.0)
    node(m, "A", 4 * MiB + 4096)
    node(m, "B", 16 * MiB)
    with client(m) as s:
        keys, parents = chain("e", 4)
        assert put(s, keys[:1], 512 * KiB, pref="A") == [1]
        assert put(s, keys[1:], 512 * KiB, pref="B", parents=parents[1:]) == [1] * 3
        assert s.where("e/0").memory == ["A"] and s.where("e/3").memory == ["B"]
        h = s.internal.hold(["e/3", "no-such-key"], 60)
        assert isinstance(h, int) and h.held == 1
        for i in range(5):  # 1 MiB each through A's 4 MiB (in A alone: B has room)
            assert put(s, [f"f{i}"], MiB, pref="A", seed=10, own_segment_only=True) == [1]
        assert all(s.exists_batch(keys)), "a chain with a held object was evicted"
        assert not s.exists("f0")
        assert s.internal.release(h) is True and s.internal.release(h) is False
        for i in range(5, 8):
            assert put(s, [f"f{i}"], MiB, pref="A", seed=10, own_segment_only=True) == [1]
        assert not any(s.exists_batch(keys))
        hist = s.internal.history(keys)
        assert (hist[0].cause, hist[0].tier, hist[0].detail) == ("evicted", "memory", "")
        assert {(e.cause, e.tier, e.detail) for e in hist[1:]} == {
            ("evicted", "memory", "with parent e/0")
        }


def test_eviction_never_leaves_a_child_without_its_parent(procs):
    """Chains of 64 KiB chunks over two small segments, put and read in random order, many
    times what fits: after every round, each chain's stored chunks are a prefix of it."""
    m = sa.start_master(high_watermark=0.9, low_watermark=0.6)
    node(m, "A", 2 * MiB + 4096)
    node(m, "B", 2 * MiB + 4096)
    rnd = random.Random(7)
    with client(m) as s:
        lengths = {}
        for rnd_i in range(3):
            for j in range(12):
                keys, parents = chain(f"c{j}", 6)
                start = lengths.get(j, 0)
                for i in range(start, 6):
                    (r,) = put(s, keys[i : i + 1], 64 * KiB, pref=rnd.choice("AB"),
                               parents=parents[i : i + 1])  # fmt: skip
                    if not isinstance(r, int):
                        assert isinstance(r, ParentMissingError), r
                        break
                lengths[j] = 6
                if rnd.random() < 0.5:  # a reader of a chain's first chunks
                    s.get_batch(keys[: rnd.randint(1, 6)], return_exceptions=True)
            for j in range(12):
                stored = s.internal.list_prefixes(f"c{j}/")
                idx = sorted(int(i) for i in stored)
                assert idx == list(range(len(idx))), (rnd_i, j, idx)
                assert all(n == 1 for n in stored.values())
                lengths[j] = len(idx)
        st = s.stats()
        assert st.evictions > 0 and st.drops["evicted"] > 0
        assert 0 < st.objects < 12 * 6


def test_invalidate_with_a_concurrent_reader(procs):
    """After invalidate returns, no get that starts afterwards (in another process) finds
    an object carrying the tag, nor one that hangs off such an object; leased objects go
    too, and other tags stay."""
    m = sa.start_master()
    node(m, "node", 16 * MiB)
    reader = sa.start_agent({"master": m.address, "segment_size": 0})
    with client(m) as s:
        a = [f"a{i}" for i in range(20)]
        assert put(s, a, 4 * KiB, tags=[["t:a", "t:x"]] * 20) == [1] * 20
        kids = [f"a{i}/kid" for i in range(5)]
        assert put(s, kids, 4 * KiB, parents=a[:5]) == [1] * 5
        b = [f"b{i}" for i in range(5)]
        assert put(s, b, 4 * KiB, tags=[["t:b"]] * 5) == [1] * 5
        s.get("a7")  # leased by this reader for 5 s
        keys = a + kids + b
        reader.send("get_loop", keys=keys, seconds=2.5)
        time.sleep(1.0)
        t0 = time.monotonic()
        assert s.internal.invalidate(["t:a", "no-such-tag"]) == 25
        t1 = time.monotonic()
        gone = set(a + kids)
        assert not any(s.exists_batch(sorted(gone))) and all(s.exists_batch(b))
        log = reader.reply(timeout=30)
        late = [(t, keys[i], found) for t, i, found, _ in log if t > t1]
        # over before invalidate was called (one called before it may reach the master after)
        early = [(t, keys[i], found) for t, i, found, done in log if done < t0]
        assert late and early
        assert not [x for x in late if x[1] in gone and x[2]], "a get after invalidate found one"
        assert all(found for _, _, found in early)
        assert all(found for _, k, found in late if k not in gone)
        assert s.internal.invalidate(["no-such-tag"]) == 0
        h = s.internal.history(["a3", "a3/kid", "b0"])
        assert (h[0].cause, h[0].detail) == ("invalidated", "t:a")
        assert (h[1].cause, h[1].detail) == ("invalidated", "with parent a3: t:a")
        assert h[2] is None
        st = s.stats()
        assert st.invalidations == 2 and st.drops["invalidated"] == 25
        with pytest.raises(ValueError, match="tag"):
            s.internal.invalidate(["x" * 257])


def test_tags_added_later_and_puts_in_progress_are_invalidated(procs):
    """``add_tags`` tags objects already stored, which ``invalidate`` then drops; a
    two-request put of a tagged object that is in progress when its tag is invalidated
    stores nothing (``InvalidatedError``), and a put that starts afterwards stores anew."""
    import threading

    m = sa.start_master()
    node(m, "node", 64 * MiB)
    with client(m) as s, client(m, test_pause=("put", 1.5)) as slow:
        assert put(s, ["x0", "x1", "x2"], 4 * KiB) == [1] * 3
        assert (
            s.internal.add_tags(["x0", "x1", "missing"], [["t:late"], ["t:late"], ["t:late"]]) == 2
        )
        assert s.internal.add_tags(["x0"], [["t:late"]]) == 0  # already carried
        assert s.internal.invalidate(["t:late"]) == 2
        assert s.exists_batch(["x0", "x1", "x2"]) == [False, False, True]
        assert s.internal.history(["x0"])[0].cause == "invalidated"
        with pytest.raises(ValueError, match="one list of tags per key"):
            s.internal.add_tags(["x2"], [])
        # a large object goes the two-request way; the slow client pauses between its
        # put_start and its put_end
        got = []
        big = sa.pattern(1, 8 * MiB)
        cfg = ReplicateConfig()
        t = threading.Thread(
            target=lambda: got.append(
                slow.internal.put_many(
                    ["p"], [big], [b""], cfg, tags=[["t:p"]], return_exceptions=True
                )
            )
        )
        t.start()
        time.sleep(0.5)
        assert s.internal.invalidate(["t:p"]) == 0  # not committed yet: nothing to drop
        t.join(timeout=30)
        assert isinstance(got[0][0], InvalidatedError), got
        assert not s.exists("p")
        assert put(s, ["p"], 4 * KiB, tags=[["t:p"]]) == [1]  # a new put of the tag stores


def test_holder_death_drops_the_descendants(procs):
    m = sa.start_master(client_ttl=1.0)
    a = node(m, "A", 4 * MiB)
    node(m, "B", 4 * MiB)
    with client(m) as s:
        keys, parents = chain("h", 3)
        assert put(s, keys[:1], 100 * KiB, pref="A") == [1]
        assert put(s, keys[1:], 100 * KiB, pref="B", parents=parents[1:]) == [1, 1]
        assert put(s, ["on-b"], 100 * KiB, pref="B") == [1]
        a.kill()
        wait_for(lambda: s.stats().segments == 1, "A was not declared dead")
        assert s.exists_batch(keys + ["on-b"]) == [False, False, False, True]
        h = s.internal.history(keys)
        assert (h[0].cause, h[0].tier, h[0].detail) == ("holder_lost", "memory", "A")
        assert [(e.cause, e.detail) for e in h[1:]] == [("holder_lost", "with parent h/0: A")] * 2


def test_history_is_bounded(procs):
    m = sa.start_master(history_entries=5)
    node(m, "node", 4 * MiB)
    with client(m) as s:
        keys = [f"k{i}" for i in range(10)]
        put(s, keys)
        t0 = time.time()
        for k in keys:
            s.remove(k)
        t1 = time.time()
        h = s.internal.history(keys)
        assert h[:5] == [None] * 5
        assert all(e.cause == "removed" and t0 - 1 <= e.unix_s <= t1 + 1 for e in h[5:])
        put(s, ["k9"])
        assert s.internal.history(["k9", "k8"])[0] is None
        assert s.internal.history(["k8"])[0].cause == "removed"


@pytest.mark.parametrize("size", [100 * KiB, MiB], ids=["reserved", "two-request"])
def test_quota_groups_evict_inside_the_group(procs, size):
    """A group over its quota drops its own least recently used objects; other groups and
    objects without a group stay; held objects are not dropped: NoSpaceError then."""
    m = sa.start_master()
    node(m, "node", 32 * MiB)
    with client(m) as s:
        quota = 3 * size
        assert put(s, ["free"], size) == [1]
        assert put(s, ["other/0"], size, group="other", quota_bytes=size) == [1]
        assert put(s, ["other/1"], size, group="other") == [1]  # the group's quota holds
        assert s.exists_batch(["other/0", "other/1"]) == [False, True]
        for i in range(4):
            assert put(s, [f"g/{i}"], size, group="g", quota_bytes=quota) == [1]
        assert s.exists_batch(["g/0", "g/1", "g/2", "g/3"]) == [False, True, True, True]
        s.get("g/1")  # now g/2 is the group's least recently used
        assert put(s, ["g/4"], size, group="g") == [1]  # the quota named last holds
        assert s.exists_batch(["g/1", "g/2", "g/3", "g/4"]) == [True, False, True, True]
        assert s.exists_batch(["free", "other/1"]) == [True, True]
        st = s.stats()
        assert st.group_bytes == {"g": 3 * size, "other": size}
        h = s.internal.history(["g/0"])[0]
        assert (h.cause, h.detail) == ("evicted", f"group 'g' over its quota of {quota} bytes")
        hid = s.internal.hold(["g/1", "g/3", "g/4"], 60)
        (r,) = put(s, ["g/5"], size, group="g")
        assert isinstance(r, NoSpaceError) and "group 'g'" in str(r) and str(quota) in str(r)
        s.internal.release(hid)
        (r,) = put(s, ["g/big"], quota + 1, group="g")
        assert isinstance(r, NoSpaceError) and "larger than its quota" in str(r)
        assert s.exists_batch(["g/1", "g/3", "g/4"]) == [True] * 3
        with pytest.raises(ValueError, match="quota_bytes needs a group"):
            put(s, ["x"], quota_bytes=10)


def test_holds_expire(procs):
    m = sa.start_master(high_watermark=1.0)
    node(m, "node", 4 * MiB + 4096)
    with client(m) as s:
        assert put(s, ["h0", "h1"], MiB) == [1, 1]
        assert s.internal.hold(["h0", "h1", "h0"], 1.0).held == 2
        for i in range(4):
            assert put(s, [f"f{i}"], MiB, seed=5) == [1]
        assert s.exists_batch(["h0", "h1"]) == [True, True]
        time.sleep(1.3)
        for i in range(4, 6):
            assert put(s, [f"f{i}"], MiB, seed=5) == [1]
        assert s.exists_batch(["h0", "h1"]) == [False, False]
        for bad in (0, -1, 3601, "1"):
            with pytest.raises(ValueError, match="ttl_s"):
                s.internal.hold(["f5"], bad)


def test_promote_loads_from_ssd(procs, tmp_path):
    m = sa.start_master(high_watermark=0.8, low_watermark=0.5)
    node(m, "disk", 4 * MiB + 4096, ssd_dir=str(tmp_path / "ssd"))
    with client(m) as s:
        keys = [f"p{i}" for i in range(8)]
        for i, k in enumerate(keys):
            assert put(s, [k], 512 * KiB, seed=i) == [1]
        # the tick that finds use above the high watermark may come after the 7th put (3
        # evicted down to the low one, the 8th fits) or after the 8th (4 evicted)
        wait_for(lambda: s.stats().ssd_objects >= 3, "nothing went to SSD")
        time.sleep(0.3)
        on_disk = [k for k in keys if not s.where(k).memory]
        assert len(on_disk) >= 2
        assert s.internal.promote(on_disk[:2] + ["missing"]) == 2
        wait_for(lambda: all(s.where(k).memory for k in on_disk[:2]), "not loaded")
        assert s.internal.promote(on_disk[:2]) == 0  # in memory already
        assert s.stats().promotes == 2
        s.remove(on_disk[0])  # no read lease was taken: a plain remove goes through
        assert s.get(on_disk[1]) == sa.pattern(keys.index(on_disk[1]), 512 * KiB)


def test_list_and_remove_prefix(procs):
    m = sa.start_master()
    node(m, "node", 8 * MiB)
    with client(m) as s:
        t1, p1 = chain("kv/m1/t1", 3)
        t2, p2 = chain("kv/m1/t2", 2)
        t3, p3 = chain("kv/m2/t1", 2)
        for keys, parents in ((t1, p1), (t2, p2), (t3, p3)):
            assert put(s, keys, parents=parents) == [1] * len(keys)
        # a kept key that hangs off a removed one goes too
        assert put(s, ["kv/keep/x"], parents=["kv/m1/t1/0"]) == [1]
        assert s.internal.list_prefixes("kv/") == {"m1": 5, "m2": 2, "keep": 1}
        assert s.internal.list_prefixes("kv/m1/") == {"t1": 3, "t2": 2}
        assert s.internal.list_prefixes("kv/m1/t1/") == {"0": 1, "1": 1, "2": 1}
        assert s.internal.list_prefixes("kv", sep="m") == {"/": 7, "/keep/x": 1}
        assert s.internal.list_prefixes("nothing/") == {}
        assert s.internal.remove_prefix("kv/", keep=["kv/m1/t2/", "kv/keep/"]) == 6
        assert s.internal.list_prefixes("") == {"kv": 2}
        assert s.internal.list_prefixes("kv/m1/t2/") == {"0": 1, "1": 1}
        assert s.internal.history(["kv/m2/t1/0"])[0].detail == "prefix kv/"
        with pytest.raises(ValueError):
            s.internal.remove_prefix("")


def test_metrics_name_the_new_series(procs):
    m = sa.start_master(metrics_port=0)
    node(m, "node", 8 * MiB)
    with client(m) as s:
        put(s, ["x", "y"], tags=[["t"], None], group="grp", quota_bytes=1 << 20)
        s.internal.invalidate(["t"])
        s.internal.hold(["y"], 10)
        s.remove("y")
        text = (
            urllib.request.urlopen(f"http://127.0.0.1:{m.metrics_port}/metrics", timeout=10)
            .read()
            .decode()
        )
    vals = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert vals['mooncake_store_drops_total{cause="invalidated"}'] == 1
    assert vals['mooncake_store_drops_total{cause="removed"}'] == 1
    assert vals["mooncake_store_invalidations_total"] == 1
    assert vals["mooncake_store_holds_taken_total"] == 1 and vals["mooncake_store_holds"] == 1
    assert vals["mooncake_store_promotes_total"] == 0
    assert vals["mooncake_store_objects"] == 0 and vals["mooncake_store_puts_total"] == 2
    assert "mooncake_store_group_bytes" in text and "mooncake_store_leader 1.0" in text


def test_links_survive_an_etcd_failover(procs, etcd):
    m1, m2, prefix = start_pair(etcd)
    cfg = {"etcd": etcd, "etcd_prefix": prefix, "heartbeat_interval_s": 0.2}
    sa.start_agent({**cfg, "segment_size": 16 * MiB, "name": "node"})
    with MooncakeStore(serve_tcp=False, segment_size=0, **cfg) as s:
        keys, parents = chain("f", 3)
        tags = [None, ["T"], None]
        assert (
            put(s, keys, 100 * KiB, parents=parents, tags=tags, group="G", quota_bytes=MiB)
            == [1] * 3
        )
        hid = s.internal.hold(["f/0"], 60)
        m1.kill()
        wait_for(lambda: is_leader(m2.address), "no standby took over", 10)
        assert all(s.exists_batch(keys))
        assert s.stats().group_bytes == {"G": 300 * KiB}
        assert s.internal.release(hid) is False  # holds are not carried over
        assert s.internal.invalidate(["T"]) == 2  # f/1 and f/2, which hangs off it
        assert s.exists_batch(keys) == [True, False, False]
        # the group's quota came along (a new leader evicts nothing for a lease TTL, but
        # an object larger than the quota is refused at once)
        (r,) = put(s, ["big"], MiB + 1, group="G")
        assert isinstance(r, NoSpaceError) and f"larger than its quota of {MiB} bytes" in str(r)


def test_links_survive_a_full_restart_from_ssd(procs, tmp_path):
    """Objects on the SSD tier keep their parent, tags and group through a restart of
    master and client; one whose parent's file is gone waits orphan_grace_s, then goes."""
    ssd_dir = str(tmp_path / "ssd")
    m = sa.start_master(high_watermark=0.8, low_watermark=0.5)
    owner = node(m, "node", 4 * MiB + 4096, ssd_dir=ssd_dir)
    keys, parents = chain("c", 4)
    lost, lost_parents = chain("o", 2)
    with client(m) as s:
        assert (
            put(s, keys, 256 * KiB, parents=parents, tags=[None, None, ["T"], None], group="G")
            == [1] * 4
        )
        assert put(s, lost, 256 * KiB, parents=lost_parents, seed=20) == [1, 1]
        for i in range(16):
            assert put(s, [f"fill{i}"], 256 * KiB, seed=40) == [1]
        wait_for(
            lambda: all(not s.where(k).memory and s.where(k).ssd for k in keys + lost),
            "the chains did not go to SSD",
        )
    owner.kill()
    m.kill()
    h = hashlib.sha256(b"o/0").hexdigest()
    (path,) = glob.glob(os.path.join(ssd_dir, h[:2], f"{h}-*.obj"))
    os.unlink(path)
    m2 = sa.start_master(orphan_grace=1.0)
    node(m2, "node2", 4 * MiB, ssd_dir=ssd_dir)
    with client(m2) as s:
        assert all(s.exists_batch(keys))
        assert s.stats().group_bytes == {"G": 4 * 256 * KiB}
        wait_for(lambda: not s.exists("o/1"), "the orphan was not dropped", 10)
        h = s.internal.history(["o/1"])[0]
        assert (h.cause, h.tier) == ("orphaned", "ssd") and "o/0" in h.detail
        assert s.internal.invalidate(["T"]) == 2  # c/2 and c/3, which hangs off it
        s.remove("c/0")
        assert not any(s.exists_batch(keys))
        assert s.internal.history(["c/1"])[0].detail == "with parent c/0"
