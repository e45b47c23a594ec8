"""One-round-trip puts (put reservations, ``StoreConfig.put_reservation_bytes``): a client
writes small objects into segment space the master reserved for it and commits them with
one request. Real master and client processes on 127.0.0.1; the master's bookkeeping is
also driven directly through ``Core`` (its state machine, no I/O) where a race is needed."""

import os
import time

import pytest

from mooncake_store import MooncakeStore, ObjectExistsError, ReplicateConfig
from mooncake_store.common.layout import aligned
from mooncake_store.master import MasterConfig
from mooncake_store.master.core import Core
from tests.store import store_agents as sa

pytestmark = pytest.mark.timeout(120)
MiB = 1 << 20


class Calls:
    """Records the metadata requests one client sends (its link's method, wrapped)."""

    def __init__(self, store):
        self.names = []
        link = store.internal.link
        inner = link.call

        def call(method, args, register=True, **kw):
            self.names.append(method)
            return inner(method, args, register, **kw)

        link.call = call


def wait_for(pred, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_small_puts_take_one_round_trip(procs):
    """After one reserve request, every put of a small object is one request; another
    process reads the bytes back; the master counts the reserved space as used."""
    m = sa.start_master()
    with MooncakeStore(
        serve_tcp=False, master=m.address, segment_size=64 * MiB + 4096, name="w"
    ) as s:
        calls = Calls(s)
        vals = {f"k{i}": sa.pattern(i, 1000 + 4099 * i) for i in range(20)}
        for k, v in vals.items():
            assert s.put(k, v) == 1
        assert calls.names == ["reserve"] + ["put"] * 20
        st = s.stats()
        assert st.reserved_bytes == 4 * MiB - sum(
            aligned(len(v)) for v in vals.values()
        )  # 1/16 of the segment
        assert st.used_bytes == 4 * MiB and st.objects == 20 and st.puts == 20
        reader = sa.start_agent({"master": m.address, "segment_size": 0})
        for k, v in vals.items():
            assert reader.cmd("get", key=k) == {"size": len(v), "sha": sa.digest(v)}
        # a batch too: one request, results per key, the existing key refused and its bytes freed
        calls.names.clear()
        res = s.put_batch(
            ["b0", "k3", "b1"], [b"x" * 5000, b"y" * 7000, b"z" * 3], return_exceptions=True
        )
        assert calls.names == ["put"]
        assert res[0] == 1 and isinstance(res[1], ObjectExistsError) and res[2] == 1
        assert s.get("k3") == vals["k3"] and s.get("b0") == b"x" * 5000 and s.get("b1") == b"z" * 3
        st = s.stats()
        committed = sum(aligned(len(v)) for v in vals.values()) + aligned(5000) + aligned(3)
        assert st.used_bytes - st.reserved_bytes == committed
        # upsert through the same path replaces the value; zero-byte objects too
        assert s.upsert("k0", b"new") == 1 and s.get("k0") == b"new"
        assert s.put("empty", b"") == 1 and s.get("empty") == b""
        assert reader.cmd("get", key="k0") == {"size": 3, "sha": sa.digest(b"new")}


def test_large_objects_and_replicas_take_two_round_trips(procs):
    """Objects above a quarter of put_reservation_bytes, replica_num > 1, pinned objects
    and put_reservation_bytes=0 use put_start/put_end."""
    m = sa.start_master()
    sa.start_agent({"master": m.address, "segment_size": 64 * MiB, "name": "other"})
    with MooncakeStore(
        serve_tcp=False,
        master=m.address,
        segment_size=64 * MiB,
        name="w",
        put_reservation_bytes=4 * MiB,
    ) as s:
        calls = Calls(s)
        s.put("big", b"b" * (MiB + 1))
        s.put("two", b"t" * 100, ReplicateConfig(replica_num=2))
        # pinned: placed by the master, not at the front of a reservation that may lie
        # anywhere (pinned islands there split the segment's free space for good)
        s.put("pinned", b"p" * 100, ReplicateConfig(pin=True))
        assert calls.names == ["put_start", "put_end"] * 3
        assert s.stats().reserved_bytes == 0
        assert s.get("big") == b"b" * (MiB + 1) and sorted(s.where("two").memory) == ["other", "w"]
    with MooncakeStore(
        serve_tcp=False, master=m.address, segment_size=64 * MiB, name="w2", put_reservation_bytes=0
    ) as s:
        calls = Calls(s)
        s.put("small", b"s" * 100)
        assert calls.names == ["put_start", "put_end"] and s.stats().reserved_bytes == 0


def test_preferred_segment_is_honoured(procs):
    """A reservation lives in the preferred segment; changing the preference moves it."""
    m = sa.start_master()
    sa.start_agent({"master": m.address, "segment_size": 64 * MiB, "name": "a"})
    sa.start_agent({"master": m.address, "segment_size": 64 * MiB, "name": "b"})
    with MooncakeStore(serve_tcp=False, master=m.address, segment_size=0) as s:
        for i in range(3):
            s.put(f"a{i}", b"1" * 1000, ReplicateConfig(preferred_segment="a"))
            s.put(f"b{i}", b"2" * 1000, ReplicateConfig(preferred_segment="b"))
        assert all(
            s.where(f"a{i}").memory == ["a"] and s.where(f"b{i}").memory == ["b"] for i in range(3)
        )
        assert s.stats().reserved_bytes <= 4 * MiB  # one reservation at a time
        assert s.get("a2") == b"1" * 1000 and s.get("b2") == b"2" * 1000


def test_reserved_space_comes_back_before_anything_is_evicted(procs):
    """Client A holds a reservation; client B then fills the segment: B's put that needs
    A's reserved space waits for A to give it back instead of evicting A's objects (the
    watermarks are at 100 %: no background eviction either)."""
    m = sa.start_master(high_watermark=1.0, low_watermark=1.0)
    sa.start_agent({"master": m.address, "segment_size": 32 * MiB + 4096, "name": "node"})
    a = sa.start_agent({"master": m.address, "segment_size": 0})
    a.cmd("put", key="a-small", seed=1, size=4096)  # reserves 2 MiB (1/16 of 32 MiB)
    with MooncakeStore(
        serve_tcp=False, master=m.address, segment_size=0, put_reservation_bytes=0
    ) as b:
        assert b.stats().reserved_bytes == 2 * MiB - 4096
        for i in range(30):  # the segment is now full, A's reservation included
            b.put(f"b{i}", bytes([i]) * MiB)
        t0 = time.monotonic()
        b.put("b-last", b"L" * MiB)  # fits only in what A holds
        assert time.monotonic() - t0 < 5
        st = b.stats()
        assert st.evictions == 0 and st.reserved_bytes == 0
        assert a.cmd("get", key="a-small") == {"size": 4096, "sha": sa.digest(sa.pattern(1, 4096))}
        assert (
            all(b.get(f"b{i}") == bytes([i]) * MiB for i in range(30))
            and b.get("b-last") == b"L" * MiB
        )


def test_idle_and_dead_holders_give_space_back(procs):
    """A reservation unused for a few seconds goes back; a SIGKILLed holder's goes back
    once its heartbeat lease ends; the store's used bytes are then the objects' alone."""
    m = sa.start_master(client_ttl=1.0)
    sa.start_agent({"master": m.address, "segment_size": 64 * MiB, "name": "node"})
    idle = sa.start_agent({"master": m.address, "segment_size": 0})
    idle.cmd("put", key="i", seed=2, size=10_000)
    with MooncakeStore(
        serve_tcp=False, master=m.address, segment_size=0, put_reservation_bytes=0
    ) as obs:
        assert obs.stats().reserved_bytes > 0
        wait_for(lambda: obs.stats().reserved_bytes == 0, 10, "the idle reservation to come back")
        assert obs.stats().used_bytes == aligned(10_000)
        victim = sa.start_agent(
            {"master": m.address, "segment_size": 0, "heartbeat_interval_s": 0.2}
        )
        victim.cmd("put", key="v", seed=3, size=20_000)
        assert obs.stats().reserved_bytes > 0
        victim.kill()
        wait_for(
            lambda: obs.stats().reserved_bytes == 0 and obs.stats().clients == 3,
            10,
            "the dead client's reservation to be freed",
        )
        assert obs.stats().used_bytes == aligned(10_000) + aligned(20_000)
        assert idle.cmd("get", key="v") == {"size": 20_000, "sha": sa.digest(sa.pattern(3, 20_000))}


def test_core_commit_rules():
    """The master's side in isolation: a commit must start at the reservation's front and
    fit in it (else nothing changes and the client is told to put the slow way); a request
    sent again (reply lost) gets the same answer and commits nothing twice; returning a
    reservation that does not match is ignored; the segment's owner dying drops others'
    reservations in it."""
    core = Core(MasterConfig())
    seg = {
        "size": 64 * MiB + 4096,
        "path": "/x",
        "token": "00",
        "host": "h",
        "te": None,
        "base": 4096,
    }
    core.register({"client": "owner", "name": "seg", "host": "h", "pid": 1, "segs": [seg]})
    core.register({"client": "c", "name": "c", "host": "h", "pid": 2, "segs": []})
    r = core.reserve({"client": "c", "bytes": 64 * MiB, "min": 4096})["resv"]
    assert r is not None and r[0] == "seg" and r[2] == 4 * MiB
    _, off, n = r
    used0 = core.records.used
    assert core.put({"client": "c", "seg": "seg", "off": off + 64, "items": [["k", 10, b""]]}) == {
        "lost": True
    }
    assert core.put({"client": "c", "seg": "seg", "off": off, "items": [["k", n + 1, b""]]}) == {
        "lost": True
    }
    assert core.records.used == used0 and not core.records.objects
    req = {
        "client": "c",
        "rid": 7,
        "seg": "seg",
        "off": off,
        "items": [["k", 100, b"m"], ["k2", 0, b""]],
    }
    rep = core.put(dict(req))
    assert rep["items"] == [[0, 1], [0, 1]] and rep["resv"] == [off + 128, n - 128]
    assert core.put(dict(req)) == rep and core.records.counters.puts == 2  # the resend
    assert (
        core.records.objects["k"].repl == [["seg", off, 128]]
        and core.records.objects["k"].meta == b"m"
    )
    core.reserve({"client": "c", "ret": [["seg", off, n]]})  # stale figures: ignored
    assert core.records.reserved_bytes == n - 128
    core.reserve({"client": "c", "ret": [["seg", off + 128, n - 128]]})
    assert core.records.reserved_bytes == 0 and core.records.used == used0 - n + 128
    assert (
        core.reserve({"client": "c", "bytes": 64 * MiB, "min": 8 * MiB})["resv"] is None
    )  # more than 1/16
    assert core.reserve({"client": "c", "bytes": MiB})["resv"] is not None
    core.unregister({"client": "owner"})
    assert core.records.clients["c"].reserved == {} and core.records.reserved_bytes == 0


def test_core_resent_put_after_a_leader_change():
    """Found by a new-user trial: a put the old leader committed (and wrote to etcd) whose
    reply was lost was sent again to the new leader, which knew no reservation, so the
    client redid it the two-request way and got ObjectExistsError for its own object. The
    new leader now recognises the objects at exactly the ranges the client wrote."""
    import json

    from mooncake_store.master.ha import client_record, load_into, obj_record

    old = Core(MasterConfig())
    seg = {
        "size": 64 * MiB + 4096,
        "path": "/x",
        "token": "00",
        "host": "h",
        "te": None,
        "base": 4096,
    }
    old.register({"client": "c", "name": "seg", "host": "h", "pid": 1, "segs": [seg]})
    _, off, _n = old.reserve({"client": "c", "bytes": MiB})["resv"]
    req = {
        "client": "c",
        "rid": 1,
        "seg": "seg",
        "off": off,
        "items": [["a", 1000, b""], ["b", 0, b""], ["c", 5000, b""]],
    }
    assert old.put(dict(req))["items"] == [[0, 1]] * 3
    new = Core(MasterConfig())  # the standby, from what the old leader wrote to etcd
    load_into(
        new.records,
        [json.loads(client_record(c)) for c in old.records.clients.values()],
        [json.loads(obj_record(o)) for o in old.records.objects.values()],
    )
    rep = new.put(dict(req))
    assert rep["resv"] is None and rep["items"][0] == [0, 1] and rep["items"][2] == [0, 1]
    assert rep["items"][1][1] == "PutLost"  # zero bytes: no range to recognise it by; put again
    assert new.put({**req, "items": [["x", 10, b""]]}) == {"lost": True}  # never committed


def test_commit_lost_in_a_stall_gives_the_reservation_back(procs):
    """A put whose commit request times out (the master stopped longer than the client's
    failover timeout) leaves the master holding the client's reservation at an extent the
    client no longer knows: the client gives it back as a whole by itself (was: held until
    the client exited, and the client never got another one in that segment)."""
    import signal

    from mooncake_store import StoreError

    m = sa.start_master()
    with MooncakeStore(
        serve_tcp=False,
        master=m.address,
        segment_size=16 * MiB + 4096,
        rpc_timeout_s=1,
        failover_timeout_s=2,
        name="w",
    ) as s:
        s.put("a", b"x" * 1000)
        assert s.stats().reserved_bytes > 0
        os.kill(m.p.pid, signal.SIGSTOP)
        try:
            with pytest.raises(StoreError):
                s.put("b", b"y" * 1000)
        finally:
            os.kill(m.p.pid, signal.SIGCONT)
        wait_for(
            lambda: s.stats().reserved_bytes == 0,
            timeout=10,
            what="the orphaned reservation given back",
        )
        for i in range(20):
            s.put(f"c{i}", b"z" * 4096)
        assert (
            s.internal.reservations.current is not None and s.stats().reserved_bytes > 0
        )  # a new one, in the same segment
        assert s.get("a") == b"x" * 1000 and s.get("c19") == b"z" * 4096


def test_core_ssd_load_slot_and_corrupt_replica():
    """The master's side of SSD loads: an object removed while its owner loads it back from
    SSD keeps its slot until the owner's load_done (found in review: the slot was reused at
    once, so the late load could overwrite a new object), or LOAD_ORPHAN_S at most; an SSD
    replica reported missing or corrupt is dropped, its file deleted, and the object with
    no replica left is gone."""
    from mooncake_store.master.records import LOAD_ORPHAN_S

    now = [1000.0]
    core = Core(MasterConfig(), clock=lambda: now[0])
    seg = {
        "size": 8 * MiB + 4096,
        "path": "/x",
        "token": "00",
        "host": "h",
        "te": None,
        "base": 4096,
    }
    core.register(
        {
            "client": "o",
            "name": "seg",
            "host": "h",
            "pid": 1,
            "segs": [seg],
            "ssd_dir": "/d",
            "ssd": [["k", 5, MiB, b"", "/d/k.obj"], ["j", 6, MiB, b"", "/d/j.obj"]],
        }
    )
    core.register({"client": "r", "name": "r", "host": "h2", "pid": 2, "segs": []})
    used0 = core.records.used
    assert core.get({"client": "r", "keys": ["k"]})["objs"][0][4] is True  # a load is asked for
    assert core.records.clients["o"].tasks[-1][:4] == ["load", "k", 5, "/d/k.obj"]
    assert core.records.used == used0 + MiB
    core.remove({"client": "r", "keys": ["k"], "force": True})
    now[0] += 1.0
    core.tick()
    assert core.records.used == used0 + MiB  # the owner may still be writing into it
    core.load_done({"client": "o", "key": "k", "version": 5, "ok": True})
    assert core.records.used == used0 and not core.records.orphan_loads
    # without a load_done, the slot comes back after LOAD_ORPHAN_S
    core.register(
        {
            "client": "o",
            "name": "seg",
            "host": "h",
            "pid": 1,
            "segs": [seg],
            "ssd_dir": "/d",
            "ssd": [["k", 7, MiB, b"", "/d/k7.obj"], ["j", 6, MiB, b"", "/d/j.obj"]],
        }
    )
    core.register({"client": "r", "name": "r", "host": "h2", "pid": 2, "segs": []})
    used0 = core.records.used
    core.get({"client": "r", "keys": ["k"]})
    core.remove({"client": "r", "keys": ["k"], "force": True})
    now[0] += LOAD_ORPHAN_S - 1
    core.tick()
    assert core.records.used == used0 + MiB
    now[0] += 2
    core.tick()
    assert core.records.used == used0 and not core.records.orphan_loads
    # a corrupt SSD replica: dropped, its file deleted, the object gone
    core.records.clients["o"].tasks = []
    core.ssd_bad(
        {"client": "r", "key": "j", "version": 99, "path": "/d/j.obj"}
    )  # another version: ignored
    assert "j" in core.records.objects and core.records.counters.ssd_corrupt == 0
    core.ssd_bad({"client": "r", "key": "j", "version": 6, "path": "/d/j.obj"})
    assert "j" not in core.records.objects and core.records.counters.ssd_corrupt == 1
    assert ["delete", "/d/j.obj"] in core.records.clients["o"].tasks
    assert core.records.clients["o"].ssd_bytes == 0 and core.stats()["ssd_corrupt"] == 1


def test_core_new_leader_grace_asks_puts_to_retry():
    """Found by a new-user trial: for one lease TTL after taking over, a new leader evicts
    nothing (the old leader's read leases are unknown), and a put needing eviction failed
    at once with "nothing can be evicted (leased, pinned or being written)". It is now
    NoSpaceRetry (the client retries it) with the reason."""
    now = [100.0]
    core = Core(MasterConfig(), clock=lambda: now[0])
    seg = {
        "size": 2 * MiB + 4096,
        "path": "/x",
        "token": "00",
        "host": "h",
        "te": None,
        "base": 4096,
    }
    core.register({"client": "o", "name": "seg", "host": "h", "pid": 1, "segs": [seg]})
    for k in ("a", "b"):
        (it,) = core.put_start({"client": "o", "items": [[k, MiB, b""]], "r": 1})["items"]
        core.put_end({"client": "o", "items": [[k, it[1]]]})
    core.records.no_evict_until = now[0] + 5.0
    (it,) = core.put_start({"client": "o", "items": [["c", MiB, b""]], "r": 1})["items"]
    assert it[0] == 1 and it[1] == "NoSpaceRetry" and "new leader evicts nothing" in it[2], it
    now[0] += 5.1
    (it,) = core.put_start({"client": "o", "items": [["c", MiB, b""]], "r": 1})["items"]
    assert it[0] == 0, it  # evicts "a" now


def test_space_of_a_version_replaced_while_read_comes_back_when_its_reader_is_done(procs):
    """A client upserts a 1 MiB value and reads it back, 100 times, in a 32 MiB segment
    with the 5 s default lease: each get leases the version the next upsert replaces, so
    its space waits for the lease; the client's next request says its read is done, and
    that frees the replaced version's space at once (docs/store.md, leases), so no upsert
    finds the segment full and nothing stays deferred for long."""
    m = sa.start_master(high_watermark=1.0, low_watermark=1.0)
    with MooncakeStore(serve_tcp=False, master=m.address, segment_size=32 * MiB) as s:
        for i in range(100):
            s.upsert("u", bytes([i % 251]) * MiB)
            assert s.get("u") == bytes([i % 251]) * MiB
        s.exists("u")  # the last read's done note
        assert s.stats().deferred <= 1
