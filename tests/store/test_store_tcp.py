"""The store across hosts: segment owners with different host ids are reached through the
C++ TransferEngine over TCP (127.0.0.1), replicas fall back when an owner dies, and the
engine itself refuses out-of-bounds requests and wrong secrets."""

import os
import sys
import time

import pytest

from tests.faults import kill_group
from tests.store import store_agents as sa

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from mooncake_store import MooncakeStore, ReplicateConfig, TransferError  # noqa: E402

MiB = 1 << 20
pytestmark = pytest.mark.timeout(180)


def test_transfer_engine_bounds_and_secret():
    from mooncake_pg.transfer import TransferEngine

    srv = TransferEngine("127.0.0.1", secret="k")
    buf = bytearray(4096)
    region = srv.register_memory(buf)
    cli = TransferEngine(secret="k")
    try:
        cli.batch_write("127.0.0.1", srv.port, region, [0, 4000], [b"abc", b"x" * 96])
        out = bytearray(3)
        cli.batch_read("127.0.0.1", srv.port, region, [0], [out])
        assert out == b"abc" and buf[4000:4096] == b"x" * 96
        with pytest.raises(
            RuntimeError, match="TransferEngine::batch_write: .*out of bounds"
        ) as refused:
            cli.batch_write("127.0.0.1", srv.port, region, [4000], [b"y" * 97])
        assert not isinstance(refused.value, dist.DistNetworkError)  # a live peer refused it
        assert buf[4000:4096] == b"x" * 96  # nothing written
        with pytest.raises(RuntimeError, match="TransferEngine::batch_read: .*unknown region"):
            cli.batch_read("127.0.0.1", srv.port, region + 7, [0], [out])
        with pytest.raises(dist.DistNetworkError, match="rejected the shared secret"):
            TransferEngine(secret="bad").batch_read("127.0.0.1", srv.port, region, [0], [out])
        with pytest.raises(dist.DistNetworkError, match="cannot connect"):  # a RuntimeError too
            cli.batch_read("127.0.0.1", 1, region, [0], [out])
        cli.batch_read("127.0.0.1", srv.port, region, [1], [out])  # the engine still serves
        assert out == bytes(buf[1:4])
        # bad arguments: ValueError before anything is sent (a port past 65535 wrapped
        # around to a real one)
        for kw, says in (
            (dict(port=srv.port + 65536), "port must be 1..65535"),
            (dict(port=-1), "port"),
            (dict(port=0), "port"),
            (dict(region=-1), "region"),
            (dict(offsets=[-1]), "offsets"),
            (dict(offsets=[1.5]), "offsets"),
            (dict(host=""), "host"),
        ):
            args = dict(host="127.0.0.1", port=srv.port, region=region, offsets=[0]) | kw
            with pytest.raises(ValueError, match=f"TransferEngine.batch_read_bytes: {says}"):
                cli.batch_read_bytes(
                    args["host"], args["port"], args["region"], args["offsets"], [3]
                )
        for bad_len in (-3, 1 << 63, 1 << 64):  # 2**63 and up: SystemError from Python's bytes
            with pytest.raises(ValueError, match="lens"):
                cli.batch_read_bytes("127.0.0.1", srv.port, region, [0], [bad_len])
    finally:
        cli.close()
        srv.close()
    with pytest.raises(RuntimeError, match="engine is closed"):
        srv.register_memory(bytearray(8))


def test_transfer_engine_large_batches_and_a_peer_killed_mid_batch():
    """Batches of 4 MiB and more (a helper thread reads the caller's pages ahead of the
    kernel's copies) move the exact bytes both ways, into fresh bytes objects too; a peer
    killed in the middle of one raises promptly and leaves the engine usable."""
    import signal
    import subprocess

    from mooncake_pg.transfer import TransferEngine

    code = (
        "import signal, sys; import torch; from mooncake_pg.transfer import TransferEngine\n"
        "te = TransferEngine('127.0.0.1'); buf = bytearray(64 << 20); r = te.register_memory(buf)\n"
        "print(te.port, r, flush=True); signal.pause()\n"
    )
    srv = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    cli = TransferEngine()
    try:
        port, region = map(int, srv.stdout.readline().split())
        vals = [os.urandom(n) for n in (5 * MiB + 3, 1, 3 * MiB)]
        offs = [0, 6 * MiB, 7 * MiB]
        cli.batch_write("127.0.0.1", port, region, offs, vals)
        outs = [bytearray(len(v)) for v in vals]
        cli.batch_read("127.0.0.1", port, region, offs, outs)
        assert outs == vals
        assert cli.batch_read_bytes("127.0.0.1", port, region, offs, [len(v) for v in vals]) == vals
        # stopped, then killed while a 48 MiB batch waits on it
        os.kill(srv.pid, signal.SIGSTOP)
        killer = __import__("threading").Timer(0.5, lambda: kill_group(srv))
        killer.start()
        t0 = time.monotonic()
        with pytest.raises(
            dist.DistNetworkError,
            match="TransferEngine::batch_write: peer .* (stopped taking ops|closed the connection)",
        ):
            cli.batch_write(
                "127.0.0.1", port, region, [0, 16 * MiB, 32 * MiB], [os.urandom(16 * MiB)] * 3
            )
        assert time.monotonic() - t0 < 20
        killer.join()
        srv.wait(10)  # gone, listening socket included
        with pytest.raises(dist.DistNetworkError, match="cannot connect"):
            cli.batch_read("127.0.0.1", port, region, [0], [bytearray(8)])
    finally:
        cli.close()
        kill_group(srv, wait_s=10)


def test_store_over_tcp_between_hosts(procs):
    m = sa.start_master(client_ttl=1.0)
    nodes = [
        sa.start_agent(
            {
                "master": m.address,
                "segment_size": 64 * MiB,
                "name": f"h{i}",
                "heartbeat_interval_s": 0.2,
            },
            serve_tcp=True,
            env={"MOONCAKE_HOST_ID": f"host{i}"},
        )
        for i in range(2)
    ]
    with MooncakeStore(master=m.address, segment_size=0, host_id="client-host") as s:
        for size in (0, 1, 4096, MiB + 3, 16 * MiB):
            data = sa.pattern(size, size)
            assert s.put(f"s{size}", data, ReplicateConfig(replica_num=2)) == 2
            assert s.get(f"s{size}") == data
            assert nodes[0].cmd("get", key=f"s{size}")["sha"] == sa.digest(data)
        keys = [f"b{i}" for i in range(64)]
        vals = [sa.pattern(i, 4096 + i) for i in range(64)]
        s.put_batch(keys, vals)
        assert s.get_batch(keys) == vals
        bufs = [bytearray(5000) for _ in keys]
        assert s.get_into_batch(keys, bufs) == [4096 + i for i in range(64)]
        assert all(bytes(b[: len(v)]) == v for b, v in zip(bufs, vals))
        t = torch.arange(1000, dtype=torch.float32).reshape(10, 100).t()  # non-contiguous
        s.put_tensor("t", t)
        assert torch.equal(s.get_tensor("t"), t)
        # a batch with two replicas per key, read in one pipelined engine batch per segment;
        # a missing key in the middle comes back in its place
        rkeys = [f"r{i}" for i in range(40)]
        rvals = [sa.pattern(100 + i, 3000 + 97 * i) for i in range(40)]
        assert s.put_batch(rkeys, rvals, ReplicateConfig(replica_num=2)) == [2] * 40
        got = s.get_batch(rkeys[:20] + ["missing"] + rkeys[20:], return_exceptions=True)
        assert got[:20] + got[21:] == rvals and isinstance(got[20], KeyError)
        first = s.where(f"s{16 * MiB}").memory[0]
        lone = [f"lone{i}" for i in range(12)]  # one replica each, all in the segment that dies
        s.put_batch(lone, [b"v" * 5000] * 12, ReplicateConfig(preferred_segment=first))
        assert all(s.where(k).memory == [first] for k in lone)
        # the first holder dies: reads fall back to the other replica over TCP, a batch whose
        # engine read from the dead segment fails object by object
        nodes[int(first[1])].kill()
        assert s.get(f"s{16 * MiB}") == sa.pattern(16 * MiB, 16 * MiB)
        assert s.get_batch(rkeys) == rvals
        # objects only there fail in place, after one connect timeout for the batch (about
        # 2 s), not one per object (was about 5 s each)
        t0 = time.monotonic()
        got = s.get_batch(lone, return_exceptions=True)
        assert all(isinstance(g, TransferError) for g in got), got
        assert time.monotonic() - t0 < 15
        bufs = [bytearray(8000) for _ in rkeys]
        assert s.get_into_batch(rkeys, bufs) == [len(v) for v in rvals]
        assert all(bytes(b[: len(v)]) == v for b, v in zip(bufs, rvals))
        time.sleep(1.5)
        assert s.get(f"s{16 * MiB}") == sa.pattern(16 * MiB, 16 * MiB)


@pytest.mark.slow
def test_dead_or_stopped_owner_costs_one_wait_per_batch(procs):
    """A batch get from an owner that died after the connection to it was cached, and a
    batch put into one that stopped (SIGSTOP): one wait for the whole batch (was one per
    object: 5 s each for a dead owner, 30 s each for a stopped one; a put waited two
    engine timeouts), the error is the write's TransferError (was NoSpaceError from the
    retry elsewhere), and nothing becomes visible."""
    import signal

    m = sa.start_master(client_ttl=1.0)
    node = sa.start_agent(
        {
            "master": m.address,
            "segment_size": 256 * MiB,
            "name": "owner",
            "heartbeat_interval_s": 0.2,
        },
        serve_tcp=True,
        env={"MOONCAKE_HOST_ID": "owner-host"},
    )
    with MooncakeStore(master=m.address, segment_size=0, host_id="client-host") as s:
        keys = [f"k{i}" for i in range(6)]
        vals = [sa.pattern(i, MiB + i) for i in range(6)]
        s.put_batch(keys, vals)
        assert s.get_batch(keys) == vals  # the engine connection to the owner is cached now
        node.kill()
        t0 = time.monotonic()
        got = s.get_batch(keys, return_exceptions=True)
        assert all(isinstance(g, TransferError) for g in got), got
        assert time.monotonic() - t0 < 8
    node = sa.start_agent(
        {
            "master": m.address,
            "segment_size": 256 * MiB,
            "name": "owner2",
            "heartbeat_interval_s": 0.2,
        },
        serve_tcp=True,
        env={"MOONCAKE_HOST_ID": "owner-host"},
    )
    with MooncakeStore(master=m.address, segment_size=0, host_id="client-host") as s:
        keys = [f"p{i}" for i in range(20)]
        vals = [os.urandom(8 * MiB) for _ in keys]
        os.killpg(node.p.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="write to segment 'owner2'"):
            s.put_batch(keys, vals)
        assert time.monotonic() - t0 < 50
        assert not any(s.exists_batch(keys))
    node.kill()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["kill", "stop"])
def test_unreachable_owner_does_not_expire_a_batch_lease(procs, how):
    """An owner killed or stopped (SIGSTOP) while the master still lists it (its client TTL
    is 60 s here), read by a client with no connection to it yet, with the default 5 s
    read lease: the wait for that owner (2 s for a refused connection, 5 s for an
    unanswered handshake) used to outlast the lease and turn the whole batch into
    LeaseExpiredError, objects on a healthy segment and replicated ones included. Now the
    batch is read again with a new lease, skipping that segment: healthy and replicated
    objects come back right, the ones only there fail with TransferError, and the next
    batch waits for nothing."""
    import signal

    m = sa.start_master(client_ttl=60.0)
    nodes = [
        sa.start_agent(
            {"master": m.address, "segment_size": 64 * MiB, "name": f"seg{i}"},
            serve_tcp=True,
            env={"MOONCAKE_HOST_ID": f"host{i}"},
        )
        for i in range(2)
    ]
    with MooncakeStore(master=m.address, segment_size=0, host_id="writer-host") as w:
        healthy = [f"g{i}" for i in range(8)]
        both = [f"r{i}" for i in range(8)]
        lone = [f"l{i}" for i in range(4)]
        w.put_batch(
            healthy,
            [sa.pattern(i, 5000 + i) for i in range(8)],
            ReplicateConfig(preferred_segment="seg1"),
        )
        w.put_batch(
            both,
            [sa.pattern(50 + i, 7000 + i) for i in range(8)],
            ReplicateConfig(replica_num=2, preferred_segment="seg0"),
        )
        w.put_batch(lone, [b"L" * 3000] * 4, ReplicateConfig(preferred_segment="seg0"))
        assert all(w.where(k).memory[0] == "seg0" for k in both + lone)
    nodes[0].kill(signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    try:
        with MooncakeStore(master=m.address, segment_size=0, host_id="reader-host") as r:
            t0 = time.monotonic()
            got = r.get_batch(healthy + both + lone, return_exceptions=True)
            took = time.monotonic() - t0
            assert got[:8] == [sa.pattern(i, 5000 + i) for i in range(8)], got[:8]
            assert got[8:16] == [sa.pattern(50 + i, 7000 + i) for i in range(8)], got[8:16]
            assert all(isinstance(g, TransferError) for g in got[16:]), got[16:]
            assert took < 20, took
            t0 = time.monotonic()
            assert r.get_batch(both) == [sa.pattern(50 + i, 7000 + i) for i in range(8)]
            assert r.get(both[0]) == sa.pattern(50, 7000)
            out = bytearray(8000)
            assert r.get_into(both[1], out) == 7001 and bytes(out[:7001]) == sa.pattern(51, 7001)
            with pytest.raises(TransferError, match="could not be reached"):
                r.get(lone[0])
            assert time.monotonic() - t0 < 2  # the segment is skipped for a while: no wait
    finally:
        nodes[0].kill(signal.SIGKILL)


def test_ssd_replica_read_from_another_host(procs, tmp_path):
    """An object evicted to the SSD of a client on another host is loaded back into that
    client's segment on request and read over TCP (readers wait while the segment is full
    of leased objects: 1 s leases here)."""
    m = sa.start_master(high_watermark=0.8, low_watermark=0.5, lease_ttl=1.0)
    sa.start_agent(
        {
            "master": m.address,
            "segment_size": 4 * MiB + 4096,
            "name": "disk-host",
            "ssd_dir": str(tmp_path / "ssd"),
            "heartbeat_interval_s": 0.2,
        },
        serve_tcp=True,
        env={"MOONCAKE_HOST_ID": "host-with-disk"},
    )
    with MooncakeStore(master=m.address, segment_size=0, host_id="reader-host") as s:
        for i in range(8):
            s.put(f"o{i}", sa.pattern(i, MiB))
        deadline = time.monotonic() + 20
        while s.stats().ssd_objects < 4:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        on_disk = [i for i in range(8) if not s.where(f"o{i}").memory]
        assert on_disk
        for i in range(8):
            assert s.get(f"o{i}") == sa.pattern(i, MiB), i
        # a batch is loaded whole before it is read: at most 3 of the 4 slots of the segment
        # (more objects may be on disk by now on a loaded machine; a batch larger than the
        # owner's memory cannot be served, see README "Store")
        batch = on_disk[:3]
        assert s.get_batch([f"o{i}" for i in batch]) == [sa.pattern(i, MiB) for i in batch]


def test_replicas_go_to_distinct_hosts_first(procs):
    """Two segments on host0 (the larger ones, which placement by free space alone would
    pick) and one on host1: two replicas take one segment per host; three take all three."""
    m = sa.start_master()
    for name, host, size in (("a0", "host0", 64), ("b0", "host0", 48), ("c1", "host1", 16)):
        sa.start_agent(
            {"master": m.address, "segment_size": size * MiB, "name": name},
            serve_tcp=True,
            env={"MOONCAKE_HOST_ID": host},
        )
    with MooncakeStore(master=m.address, segment_size=0, host_id="client-host") as s:
        for i in range(4):
            assert s.put(f"k{i}", b"x" * 5000, ReplicateConfig(replica_num=2)) == 2
            mem = s.where(f"k{i}").memory
            assert "c1" in mem and len(set(mem)) == 2, mem
        assert s.put("k3r", b"y" * 5000, ReplicateConfig(replica_num=3)) == 3
        assert sorted(s.where("k3r").memory) == ["a0", "b0", "c1"]
