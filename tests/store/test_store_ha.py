"""High availability with a real etcd: two masters elect a leader; SIGKILL of the leader
makes the standby lead within 5 s; every committed object stays readable; clients and
segment owners go on without a restart."""

import os
import time
import uuid

import pytest

from mooncake_store import MooncakeStore, ReplicateConfig
from mooncake_store.common.protocol import Connection
from tests.faults import kill_group
from tests.store import store_agents as sa

MiB = 1 << 20
pytestmark = pytest.mark.timeout(180)


def is_leader(address) -> bool:
    host, port = address.split(":")
    try:
        c = Connection(host, int(port), secret=None, timeout=2)
        try:
            return c.call("leader", {})["leader"]
        finally:
            c.close()
    except OSError:
        return False


def start_pair(etcd, **flags):
    """A leader and a standby on a fresh etcd prefix: (leader, standby, prefix)."""
    prefix = f"/mooncake_test/{uuid.uuid4().hex}"
    flags.update(etcd=etcd, etcd_prefix=prefix)
    m1 = sa.start_master(**flags)
    deadline = time.monotonic() + 15
    while not is_leader(m1.address):
        assert time.monotonic() < deadline, m1.log()
        time.sleep(0.05)
    return m1, sa.start_master(**flags), prefix


def test_leader_kill_standby_takes_over(procs, etcd):
    m1, m2, prefix = start_pair(etcd, client_ttl=3.0)
    time.sleep(0.3)
    assert is_leader(m1.address) and not is_leader(m2.address)
    cfg = {"etcd": etcd, "etcd_prefix": prefix, "heartbeat_interval_s": 0.2}
    nodes = [
        sa.start_agent({**cfg, "segment_size": 32 * MiB, "name": f"node{i}"}) for i in range(2)
    ]
    with MooncakeStore(serve_tcp=False, segment_size=0, **cfg) as s:
        expect = {}
        for i in range(10):
            s.put(f"k{i}", sa.pattern(i, 100_000 * (i + 1)), ReplicateConfig(replica_num=2))
            expect[f"k{i}"] = sa.pattern(i, 100_000 * (i + 1))
        keys = [f"b{i}" for i in range(50)]
        s.put_batch(keys, [sa.pattern(100 + i, 4096) for i in range(50)])
        expect.update({k: sa.pattern(100 + i, 4096) for i, k in enumerate(keys)})
        nodes[0].cmd("put", key="from-node", seed=9, size=MiB)
        expect["from-node"] = sa.pattern(9, MiB)
        s.upsert("k0", b"updated")
        expect["k0"] = b"updated"
        s.remove("k1")
        del expect["k1"]

        m1.kill()
        t0 = time.monotonic()
        while not is_leader(m2.address):
            assert time.monotonic() - t0 < 5.0, (
                "the standby did not take over within 5 s:\n" + m2.log()
            )
            time.sleep(0.05)
        took = time.monotonic() - t0
        print(f"standby took over after {took:.2f} s")
        # the same client, no restart
        for k, v in expect.items():
            assert s.get(k) == v, k
        assert not s.exists("k1")
        assert nodes[1].cmd("get", key="from-node")["sha"] == sa.digest(expect["from-node"])
        s.put("after", b"new leader")
        assert nodes[0].cmd("get", key="after")["sha"] == sa.digest(b"new leader")
        # small puts go on through a put reservation of the new leader (the old one's is
        # dropped): nothing written after the change overlaps what was committed before
        for i in range(40):
            s.put(f"n{i}", sa.pattern(200 + i, 30_000))
            expect[f"n{i}"] = sa.pattern(200 + i, 30_000)
        assert s.stats().reserved_bytes > 0
        for k, v in expect.items():
            assert s.get(k) == v, k
        # clients keep their heartbeats with the new leader: nobody is declared dead
        time.sleep(3.5)
        st = s.stats()
        assert st.clients == 3 and st.segments == 2, st
        assert s.get("k5") == expect["k5"]


@pytest.mark.slow
def test_leader_stopped_clients_keep_their_objects(procs, etcd):
    """Found by a new-user trial: with the leader SIGSTOPped (not dead: its TCP port still
    accepts), a client's heartbeat waited rpc_timeout_s + 3 s on it, so the new leader
    declared every client dead after client_ttl_s and dropped all their objects. Now a
    heartbeat gives up on a silent master after a third of the client TTL and finds the
    leader again; SSD and other tasks run on their own thread. Default TTLs and intervals;
    one client keeps reading throughout."""
    import signal
    import threading

    m1, m2, prefix = start_pair(etcd)
    cfg = {"etcd": etcd, "etcd_prefix": prefix}
    node = sa.start_agent({**cfg, "segment_size": 32 * MiB, "name": "node"})
    with (
        MooncakeStore(serve_tcp=False, segment_size=0, **cfg) as busy,
        MooncakeStore(serve_tcp=False, segment_size=8 * MiB, name="idle", **cfg) as idle,
    ):
        expect = {f"k{i}": sa.pattern(i, 50_000 + i) for i in range(30)}
        busy.put_batch(list(expect), list(expect.values()))
        idle.put("on-idle", b"idle's own segment", ReplicateConfig(preferred_segment="idle"))
        assert idle.where("on-idle").memory == ["idle"]
        errors, stop = [], threading.Event()

        def reader():
            while not stop.is_set():
                try:
                    assert busy.get("k3") == expect["k3"]
                except Exception as e:  # a call may wait out rpc_timeout_s on the stopped master
                    errors.append(repr(e))

        t = threading.Thread(target=reader)
        t.start()
        time.sleep(0.5)
        os.killpg(m1.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            while not is_leader(m2.address):
                assert time.monotonic() - t0 < 10, m2.log()
                time.sleep(0.05)
            time.sleep(5.0 + 3.0)  # past the client TTL the new leader grants every client
            stop.set()
            t.join(30)
            st = busy.stats()
            assert st.clients == 3 and st.segments == 2 and st.clients_lost == 0, st
            for k, v in expect.items():
                assert busy.get(k) == v, k
            assert idle.get("on-idle") == b"idle's own segment"
            assert node.cmd("get", key="k7")["sha"] == sa.digest(expect["k7"])
            assert not [e for e in errors if "k3" in e and "not found" in e], errors
        finally:
            stop.set()
            kill_group(m1.pid)


def test_resumed_stale_leader_answers_nothing(procs, etcd):
    """Found by a new-user trial: a leader SIGSTOPped past its lease and then resumed
    answered the requests queued meanwhile from its old metadata before it noticed its
    successor: a get returned another object's bytes, and a put reservation it handed out
    overwrote an object the new leader had placed in that range. A leader now answers
    only while its etcd lease is certainly alive, and a client writes into a reservation
    only while the master that granted it certainly leads."""
    import signal
    import threading

    m1, m2, prefix = start_pair(etcd)
    cfg = {"etcd": etcd, "etcd_prefix": prefix}
    rc = ReplicateConfig(preferred_segment="owner")
    K = 64 << 10
    with (
        MooncakeStore(
            serve_tcp=False, segment_size=8 * MiB, name="owner", put_reservation_bytes=0, **cfg
        ) as owner,
        MooncakeStore(serve_tcp=False, segment_size=MiB, name="a", **cfg) as a,
    ):
        owner.put("k", b"A" * MiB, rc)
        a.put("a0", b"a" * K, rc)  # a now holds a put reservation in owner's segment
        assert a.stats().reserved_bytes > 0
        got = {}

        def read_k():  # sent while the leader is stopped: answered when it resumes
            try:
                got["k"] = a.get("k")
            except Exception as e:
                got["k"] = e

        def put_a1():
            try:
                got["a1"] = a.put("a1", b"Q" * K, rc)
            except Exception as e:
                got["a1"] = e

        os.killpg(m1.pid, signal.SIGSTOP)
        try:
            t = threading.Thread(target=read_k)
            t.start()
            t0 = time.monotonic()
            while not is_leader(m2.address):
                assert time.monotonic() - t0 < 10, m2.log()
                time.sleep(0.05)
            with MooncakeStore(
                serve_tcp=False, segment_size=MiB, name="c", put_reservation_bytes=0, **cfg
            ) as c:
                c.upsert("k", b"B" * MiB, rc)
                for i in range(16):  # whatever the new leader places in owner's segment
                    c.put(f"c{i}", b"C" * K, rc)
                t2 = threading.Thread(target=put_a1)
                t2.start()
                time.sleep(1.0)
                os.killpg(m1.pid, signal.SIGCONT)
                t.join(40)
                t2.join(40)
                assert got["k"] in (b"A" * MiB, b"B" * MiB), (
                    got["k"] if isinstance(got["k"], Exception) else set(got["k"])
                )
                assert got["a1"] == 1, got["a1"]
                for i in range(16):
                    assert c.get(f"c{i}") == b"C" * K, i
                assert c.get("a1") == b"Q" * K and c.get("k") == b"B" * MiB
        finally:
            kill_group(m1.pid)
