"""Store cases ST-1, ST-3, ST-4, ST-6 and ST-7 (shared/cases/CASES.md) with real processes:
a master process, segment-owning client processes ("agents", tests/store/store_agents.py) and
the test process as one more client. Everything on 127.0.0.1."""

import time

import pytest

from mooncake_store import (
    LeaseExpiredError,
    MooncakeStore,
    ObjectExistsError,
    ObjectHasLeaseError,
    ObjectNotFoundError,
    ReplicaShortfallError,
    ReplicateConfig,
)
from tests.store import store_agents as sa

MiB = 1 << 20
pytestmark = pytest.mark.timeout(120)


def client(master, **kw):
    kw.setdefault("segment_size", 0)
    return MooncakeStore(serve_tcp=False, master=master.address, **kw)


def test_st1_put_on_existing_key(procs):
    """ST-1: a plain put on an existing key raises ObjectExistsError (it never reports
    success while get returns the old value); upsert with the same and with a different
    size returns the new data and shape."""
    torch = pytest.importorskip("torch")
    m = sa.start_master()
    node = sa.start_agent({"master": m.address, "segment_size": 32 * MiB, "name": "node"})
    with client(m) as s:
        assert s.put_tensor("w", torch.tensor([1, 2, 3])) == 1
        with pytest.raises(ObjectExistsError):
            s.put_tensor("w", torch.tensor([4, 5, 6]))
        assert s.get_tensor("w").tolist() == [1, 2, 3]
        s.put_tensor("w", torch.tensor([4, 5, 6]), upsert=True)
        assert s.get_tensor("w").tolist() == [4, 5, 6]
        s.put_tensor("w", torch.tensor([4, 5, 6, 7]), upsert=True)
        t = s.get_tensor("w")
        assert t.tolist() == [4, 5, 6, 7] and t.shape == (4,) and t.dtype == torch.int64
        assert s.where("w").memory == ["node"]
        # the same through plain bytes, written by another process
        node.cmd("put", key="b", seed=1, size=3)
        with pytest.raises(sa.AgentError, match="ObjectExistsError"):
            node.cmd("put", key="b", seed=2, size=3)
        assert s.get("b") == sa.pattern(1, 3)
        node.cmd("put", key="b", seed=3, size=4, upsert=True)
        assert s.get("b") == sa.pattern(3, 4)
        s.upsert("b", b"xy")
        assert node.cmd("get", key="b")["sha"] == sa.digest(b"xy")


def test_st3_empty_values(procs):
    """ST-3: b"" exists and reads back as b""; a missing key raises ObjectNotFoundError (a
    KeyError) and exists() is False; a (0, 128) bf16 tensor round-trips with shape and
    dtype; a batch put of [empty, normal] succeeds."""
    torch = pytest.importorskip("torch")
    m = sa.start_master()
    node = sa.start_agent({"master": m.address, "segment_size": 16 * MiB})
    with client(m) as s:
        assert s.put("e", b"") == 1
        assert s.exists("e") and s.get("e") == b""
        assert node.cmd("get", key="e") == {"size": 0, "sha": sa.digest(b"")}
        assert not s.exists("never")
        with pytest.raises(KeyError):
            s.get("never")
        with pytest.raises(ObjectNotFoundError):
            s.get_into("never", bytearray(4))
        t = torch.empty((0, 128), dtype=torch.bfloat16)
        s.put_tensor("t", t)
        r = s.get_tensor("t")
        assert r.shape == (0, 128) and r.dtype == torch.bfloat16
        assert s.put_batch(["b0", "b1"], [b"", b"normal"]) == [1, 1]
        assert s.get_batch(["b0", "b1"]) == [b"", b"normal"]
        assert node.cmd("get_batch", keys=["b0", "b1", "never"]) == [
            {"size": 0, "sha": sa.digest(b"")},
            {"size": 6, "sha": sa.digest(b"normal")},
            {"err": "ObjectNotFoundError"},
        ]


def test_st4_leases_short_ttl(procs):
    """ST-4, 500 ms TTL: two gets take leases, 600 ms later a batch get and a single get
    agree (each takes a fresh lease and returns the right bytes). A read that outlasts its
    lease raises LeaseExpiredError, single and batch alike."""
    m = sa.start_master(lease_ttl=0.5)
    node = sa.start_agent({"master": m.address, "segment_size": 16 * MiB})
    node.cmd("put_batch", keys=["k1", "k2"], seeds=[1, 2], sizes=[1000, MiB])
    with client(m) as s:
        assert s.get("k1") == sa.pattern(1, 1000)
        assert s.get("k2") == sa.pattern(2, MiB)
        time.sleep(0.6)
        batch = s.get_batch(["k1", "k2"])
        single = [s.get("k1"), s.get("k2")]
        assert batch == single == [sa.pattern(1, 1000), sa.pattern(2, MiB)]
    with client(m, test_pause=("get", 0.7)) as slow:
        with pytest.raises(LeaseExpiredError):
            slow.get("k2")
        with pytest.raises(LeaseExpiredError):
            slow.get_batch(["k1", "k2"])
        buf = bytearray(MiB)
        with pytest.raises(LeaseExpiredError):
            slow.get_into("k2", buf)


def test_st4_remove_with_lease(procs):
    """ST-4, 5 s TTL: get k then remove k -> ObjectHasLeaseError; force -> OK; remove again
    -> ObjectNotFoundError. The forced removal keeps the space until the lease ends."""
    m = sa.start_master(lease_ttl=5.0)
    node = sa.start_agent({"master": m.address, "segment_size": 16 * MiB})
    node.cmd("put", key="k", seed=5, size=4096)
    with client(m) as s:
        used = s.stats().used_bytes
        assert s.get("k") == sa.pattern(5, 4096)
        with pytest.raises(ObjectHasLeaseError):
            s.remove("k")
        with pytest.raises(sa.AgentError, match="ObjectHasLeaseError"):
            node.cmd("remove", key="k")
        s.remove("k", force=True)
        with pytest.raises(ObjectNotFoundError):
            s.remove("k")
        assert not s.exists("k")
        st = s.stats()
        assert st.used_bytes == used and st.deferred == 1  # freed when the lease ends


def test_st6_replica_placement(procs):
    """ST-6: 3 nodes, a 4 MiB put with 2 replicas lands on 2 distinct nodes; SIGKILL of the
    first holder leaves the object readable (before and after the master notices); with one
    node left a 2-replica put returns 1 (placed 1 of 2) and require_all raises
    ReplicaShortfallError and stores nothing."""
    m = sa.start_master(client_ttl=1.0)
    nodes = {}
    for i in range(3):
        a = sa.start_agent(
            {
                "master": m.address,
                "segment_size": 16 * MiB,
                "name": f"node{i}",
                "heartbeat_interval_s": 0.2,
            }
        )
        nodes[f"node{i}"] = a
    data = sa.pattern(6, 4 * MiB)
    with client(m) as s:
        assert s.put("obj", data, ReplicateConfig(replica_num=2)) == 2
        where = s.where("obj").memory
        assert len(where) == 2 and len(set(where)) == 2
        first = nodes.pop(where[0])
        first.kill()
        assert s.get("obj") == data  # the master may not know yet: the reader falls back
        deadline = time.monotonic() + 10
        while s.stats().clients > 3 and time.monotonic() < deadline:  # 2 nodes + this client
            time.sleep(0.1)
        assert s.where("obj").memory == [where[1]]
        assert s.get("obj") == data
        other = [n for n in nodes if n != where[1]]
        for n in other:
            nodes.pop(n).kill()
        while s.stats().segments > 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert s.stats().segments == 1
        assert s.put("two", b"x" * 1000, ReplicateConfig(replica_num=2)) == 1
        with pytest.raises(ReplicaShortfallError):
            s.put("strict", b"y" * 1000, ReplicateConfig(replica_num=2, require_all=True))
        assert not s.exists("strict")
        assert s.get("obj") == data


def test_st7_writer_dies_mid_put(procs):
    """ST-7: writer A pauses after put-start (test hook) of 64 MiB and is SIGKILLed; B sees
    not-found (never partial bytes) meanwhile; once A's heartbeat lease expires the key and
    space are freed (used bytes back to the earlier figure) and B's put succeeds."""
    m = sa.start_master(client_ttl=1.0)
    sa.start_agent({"master": m.address, "segment_size": 160 * MiB, "name": "storage"})
    writer = sa.start_agent(
        {"master": m.address, "segment_size": 0, "heartbeat_interval_s": 0.2},
        env={"MOONCAKE_STORE_TEST_PAUSE": "put:60"},
    )
    with client(m) as b:
        used0 = b.stats().used_bytes
        writer.send("put", key="big", seed=7, size=64 * MiB)
        deadline = time.monotonic() + 20
        while b.stats().pending == 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert b.stats().used_bytes >= used0 + 64 * MiB
        with pytest.raises(ObjectNotFoundError):
            b.get("big")
        assert not b.exists("big")
        with pytest.raises(ObjectExistsError):  # being written
            b.put("big", b"mine")
        writer.kill()
        t0 = time.monotonic()
        while b.stats().pending:
            assert time.monotonic() - t0 < 10, "the dead writer's put was never aborted"
            time.sleep(0.05)
        # the space comes back too (a lease TTL later when the abort came from the writer's
        # connection closing: a live writer could still be copying); b's own put reservation
        # (its failed put asked for one) is not the writer's
        while (lambda st: st.used_bytes - st.reserved_bytes)(b.stats()) != used0:
            assert time.monotonic() - t0 < 15, "the dead writer's space was never freed"
            time.sleep(0.05)
        mine = sa.pattern(8, 64 * MiB)
        assert b.put("big", mine) == 1
        assert b.get("big") == mine


def test_embedded_master_serves_other_processes(procs):
    """MooncakeStore() without a master runs one in-process (127.0.0.1, ephemeral port);
    other processes join it through ``master_address``; its segment is mapped by them."""
    with MooncakeStore(serve_tcp=False, segment_size=8 * MiB, name="embedded") as s:
        host, port = s.master_address.split(":")
        assert host == "127.0.0.1" and int(port) > 0
        other = sa.start_agent({"master": s.master_address, "segment_size": 0})
        other.cmd("put", key="x", seed=3, size=MiB)
        assert s.where("x").memory == ["embedded"]
        assert s.get("x") == sa.pattern(3, MiB)
        s.put("y", b"from the embedding process")
        assert other.cmd("get", key="y")["sha"] == sa.digest(b"from the embedding process")
