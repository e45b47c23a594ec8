"""SSD tier: objects evicted from memory drop to a client's SSD directory, read back
correctly, and survive a full restart of master and clients."""

import hashlib
import os
import time

import pytest

from mooncake_store import MooncakeStore, NoSpaceError, ReplicateConfig
from tests.store import store_agents as sa

MiB = 1 << 20
pytestmark = pytest.mark.timeout(120)


def put_until_on_ssd(s, n: int, want: int, settle: float = 0.3):
    """Puts ``o0`` .. ``o{n-1}`` (1 MiB of ``sa.pattern(i)`` each) and waits until ``want``
    objects have an SSD copy (offloads run after the puts returned), then ``settle`` s more."""
    for i in range(n):
        s.put(f"o{i}", sa.pattern(i, MiB))
    deadline = time.monotonic() + 20
    while s.stats().ssd_objects < want:
        assert time.monotonic() < deadline, s.stats()
        time.sleep(0.05)
    time.sleep(settle)


def _files_of(root: str, key: str) -> list:
    """The SSD files of ``key`` under ``root`` (named by the SHA-256 of the key)."""
    h = hashlib.sha256(key.encode()).hexdigest()
    d = os.path.join(root, h[:2])
    return (
        [n for n in os.listdir(d) if n.startswith(h) and n.endswith(".obj")]
        if os.path.isdir(d)
        else []
    )


def test_ssd_tier_evict_read_back_and_restart(procs, tmp_path):
    ssd_dir = str(tmp_path / "ssd")
    m = sa.start_master(high_watermark=0.8, low_watermark=0.5)
    node = sa.start_agent(
        {
            "master": m.address,
            "segment_size": 8 * MiB + 4096,
            "name": "node",
            "ssd_dir": ssd_dir,
            "heartbeat_interval_s": 0.2,
        }
    )
    n = 20
    with MooncakeStore(serve_tcp=False, master=m.address, segment_size=0) as s:
        for i in range(n):  # 20 MiB through an 8 MiB segment
            assert s.put(f"obj{i}", sa.pattern(i, MiB)) == 1
        deadline = time.monotonic() + 20
        while s.stats().ssd_objects < n // 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        st = s.stats()
        assert st.objects == n and st.ssd_objects >= n // 2 and st.evictions > 0
        assert st.used_bytes <= 8 * MiB
        assert s.where("obj0") == ([], ["node"])
        for i in range(n):
            assert s.get(f"obj{i}") == sa.pattern(i, MiB), i
        buf = bytearray(MiB)
        assert s.get_into("obj1", buf) == MiB and bytes(buf) == sa.pattern(1, MiB)
        on_ssd = [i for i in range(n) if s.where(f"obj{i}").ssd]
        # upsert and remove delete the stale files
        s.upsert("obj0", b"new value")
        s.remove("obj1", force=True)
        assert s.get("obj0") == b"new value"
        # the owner deletes the stale files as tasks of its next heartbeats; a crash before
        # that would find them at the restart, so the restart waits for the deletions
        deadline = time.monotonic() + 20
        while _files_of(ssd_dir, "obj0") or _files_of(ssd_dir, "obj1"):
            assert time.monotonic() < deadline, (
                _files_of(ssd_dir, "obj0"),
                _files_of(ssd_dir, "obj1"),
            )
            time.sleep(0.05)
    # full restart: master and clients
    node.kill()
    m.kill()
    m2 = sa.start_master()
    sa.start_agent(
        {"master": m2.address, "segment_size": 8 * MiB, "name": "node2", "ssd_dir": ssd_dir}
    )
    with MooncakeStore(serve_tcp=False, master=m2.address, segment_size=0) as s:
        for i in on_ssd:
            if i in (0, 1):
                continue
            assert s.get(f"obj{i}") == sa.pattern(i, MiB), i
            assert s.where(f"obj{i}").ssd == ["node2"]
        assert not s.exists("obj1")
        # objects that were only in memory are gone with the restart; the store goes on
        s.put("fresh", b"abc")
        assert s.get("fresh") == b"abc"


def test_no_space_when_nothing_evictable(procs):
    """Without an SSD tier, a full segment evicts LRU objects; when everything is pinned or
    leased the put fails fast with NoSpaceError."""
    m = sa.start_master()
    sa.start_agent({"master": m.address, "segment_size": 4 * MiB + 4096})
    with MooncakeStore(serve_tcp=False, master=m.address, segment_size=0) as s:
        for i in range(4):
            s.put(f"p{i}", b"x" * MiB, ReplicateConfig(pin=True))
        t0 = time.monotonic()
        with pytest.raises(NoSpaceError):
            s.put("more", b"y" * MiB)
        assert time.monotonic() - t0 < 1.0
        for i in range(4):
            s.remove(f"p{i}")
        for i in range(8):  # LRU eviction makes room
            s.put(f"q{i}", bytes([i]) * MiB)
        assert s.get("q7") == bytes([7]) * MiB
        assert s.stats().evictions >= 4
        assert not s.exists("q0")


def test_eviction_skips_leased_objects(procs):
    """LRU eviction passes over the least recently used object while a reader holds a
    lease on it and takes the next one."""
    # high watermark 1.0: only the put's own eviction runs (the background one, above the
    # high watermark, would go on to the next object whenever its tick came first)
    m = sa.start_master(lease_ttl=30.0, high_watermark=1.0)
    sa.start_agent({"master": m.address, "segment_size": 4 * MiB + 4096})
    with MooncakeStore(serve_tcp=False, master=m.address, segment_size=0) as s:
        s.put("o0", bytes([0]) * MiB)
        assert s.get("o0") == bytes([0]) * MiB  # leased for 30 s
        for i in range(1, 4):
            s.put(f"o{i}", bytes([i]) * MiB)  # o0 is now the least recently used
        s.put("o4", bytes([4]) * MiB)
        assert s.exists("o0") and s.get("o0") == bytes([0]) * MiB
        assert not s.exists("o1") and s.exists("o2") and s.exists("o3") and s.exists("o4")


def test_ssd_max_bytes_drops_the_least_recently_used(procs, tmp_path):
    """ssd_max_bytes=3 MiB: evictions to SSD past it first drop the least recently used
    objects that live only on that SSD; the directory holds at most 3 objects of 1 MiB once
    the deletes are done (one more while a drop's delete, on a thread of its own, lags the
    next write), what is read is always the right data, and the newest objects stay."""
    ssd_dir = tmp_path / "ssd"
    m = sa.start_master(high_watermark=0.8, low_watermark=0.5)
    sa.start_agent(
        {
            "master": m.address,
            "segment_size": 4 * MiB + 4096,
            "name": "node",
            "ssd_dir": str(ssd_dir),
            "ssd_max_bytes": 3 * MiB,
            "heartbeat_interval_s": 0.2,
        }
    )
    n = 16
    with MooncakeStore(serve_tcp=False, master=m.address, segment_size=0) as s:
        for i in range(n):
            assert s.put(f"o{i}", sa.pattern(i, MiB)) == 1
            files = list(
                ssd_dir.rglob("*.obj")
            )  # complete object files (writes go to *.tmp<pid> first)
            assert len(files) <= 4, files
        deadline = time.monotonic() + 20
        last = None
        while True:  # until the evictions settle (offloads run after the puts returned)
            st = s.stats()
            now = (st.offloads, st.evictions, st.ssd_drops)
            if now == last and st.ssd_drops > 0:
                break
            assert time.monotonic() < deadline, st
            last = now
            time.sleep(0.5)
        assert st.ssd_objects <= 3 and len(list(ssd_dir.rglob("*.obj"))) <= 3, st
        got = {}
        for i in range(n):  # a cache: hits return the right bytes, dropped objects miss
            try:
                got[i] = s.get(f"o{i}")
            except KeyError:
                continue
            assert got[i] == sa.pattern(i, MiB), i
        assert 0 not in got and n - 1 in got, sorted(got)
        metrics = s.metrics()
        assert "mooncake_store_ssd_drops_total" in metrics


def test_ssd_max_bytes_smaller_than_an_object_evicts_without_ssd(procs, tmp_path):
    m = sa.start_master(high_watermark=0.8, low_watermark=0.5)
    sa.start_agent(
        {
            "master": m.address,
            "segment_size": 4 * MiB + 4096,
            "name": "node",
            "ssd_dir": str(tmp_path / "ssd"),
            "ssd_max_bytes": MiB // 2,
            "heartbeat_interval_s": 0.2,
        }
    )
    with MooncakeStore(serve_tcp=False, master=m.address, segment_size=0) as s:
        for i in range(8):
            s.put(f"o{i}", sa.pattern(i, MiB))
        st = s.stats()
        assert st.ssd_objects == 0 and st.offloads == 0 and st.evictions > 0
        assert not list((tmp_path / "ssd").rglob("*.obj"))
        for i in range(8):  # the watermark eviction may still drop objects: misses are fine
            try:
                assert s.get(f"o{i}") == sa.pattern(i, MiB)
            except KeyError:
                pass
    with pytest.raises(ValueError, match="ssd_max_bytes"):
        MooncakeStore(serve_tcp=False, master=m.address, segment_size=0, ssd_max_bytes=-1)


def test_a_failing_ssd_write_evicts_without_ssd(procs, tmp_path):
    """The SSD directory stops taking writes (here: replaced by a file, so every write
    fails as on a full disk): evicted objects are dropped instead of staying in memory
    for good, so puts keep succeeding, and reads return the right data or a miss."""
    import shutil

    ssd_dir = tmp_path / "ssd"
    m = sa.start_master(high_watermark=0.8, low_watermark=0.5)
    sa.start_agent(
        {
            "master": m.address,
            "segment_size": 4 * MiB + 4096,
            "name": "node",
            "ssd_dir": str(ssd_dir),
            "heartbeat_interval_s": 0.2,
        }
    )
    shutil.rmtree(ssd_dir)
    ssd_dir.write_bytes(b"not a directory")
    with MooncakeStore(serve_tcp=False, master=m.address, segment_size=0) as s:
        for i in range(12):
            deadline = time.monotonic() + 20
            while True:  # a put may find the segment full while a failed offload is reported
                try:
                    s.put(f"o{i}", sa.pattern(i, MiB))
                    break
                except NoSpaceError:
                    assert time.monotonic() < deadline, f"put {i} never found room"
                    time.sleep(0.05)
        st = s.stats()
        assert st.ssd_objects == 0 and st.evictions > 0 and st.objects <= 4, st
        assert s.exists("o11")
        for i in range(12):
            try:
                assert s.get(f"o{i}") == sa.pattern(i, MiB)
            except KeyError:
                pass


def test_corrupt_ssd_files_are_dropped_once_read(procs, tmp_path):
    """Found by a new-user trial: an SSD file corrupted while its client was down was
    registered again at restart, so exists() stayed True while every get raised
    TransferError for good. The read that finds a file corrupt (CRC mismatch, truncated,
    deleted) still fails with TransferError; the master then drops that replica and
    deletes the file, so later gets miss. Same host (read from the file) and another host
    (the owner loads it back into memory first)."""
    from mooncake_store import TransferError
    from mooncake_store.client.ssd import scan

    ssd_dir = tmp_path / "ssd"
    m = sa.start_master(high_watermark=0.8, low_watermark=0.5)
    node = sa.start_agent(
        {
            "master": m.address,
            "segment_size": 4 * MiB + 4096,
            "name": "node",
            "ssd_dir": str(ssd_dir),
            "heartbeat_interval_s": 0.2,
        }
    )
    with MooncakeStore(serve_tcp=False, master=m.address, segment_size=0) as s:
        put_until_on_ssd(s, 10, 4, settle=0)
    node.kill()
    m.kill()
    files = {e[0]: e[4] for e in scan(str(ssd_dir))}
    flip, cut, gone, good = sorted(files)[:4]
    with open(files[flip], "r+b") as f:  # one data byte flipped: header and length still valid
        f.seek(-100, os.SEEK_END)
        b = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))
    m2 = sa.start_master()
    sa.start_agent(
        {
            "master": m2.address,
            "segment_size": 4 * MiB + 4096,
            "name": "node2",
            "ssd_dir": str(ssd_dir),
            "heartbeat_interval_s": 0.2,
        },
        serve_tcp=True,
        env={"MOONCAKE_HOST_ID": "disk-host"},
    )
    os.truncate(files[cut], os.path.getsize(files[cut]) - 10)  # after the restart's scan
    os.unlink(files[gone])
    with (
        MooncakeStore(
            serve_tcp=False, master=m2.address, segment_size=0, host_id="disk-host"
        ) as same,
        MooncakeStore(master=m2.address, segment_size=0, host_id="reader-host") as remote,
    ):
        assert all(same.exists(k) for k in (flip, cut, gone, good))
        for key in (flip, gone):
            with pytest.raises(TransferError, match="is corrupt"):
                same.get(key)
        with pytest.raises(
            KeyError
        ):  # the owner's load failed and dropped it: a miss by the time it asks again
            remote.get(cut)
        deadline = time.monotonic() + 20
        while any(same.exists(k) for k in (flip, cut, gone)):
            assert time.monotonic() < deadline, [same.exists(k) for k in (flip, cut, gone)]
            time.sleep(0.05)
        for key in (flip, cut, gone):
            with pytest.raises(KeyError):
                remote.get(key)
        assert (
            same.stats().ssd_corrupt == 3 and "mooncake_store_ssd_corrupt_total 3" in same.metrics()
        )
        i = int(good[1:])
        assert same.get(good) == sa.pattern(i, MiB) and remote.get(good) == sa.pattern(i, MiB)
        deadline = time.monotonic() + 10
        while os.path.exists(files[flip]) or os.path.exists(files[cut]):
            assert time.monotonic() < deadline, "corrupt files not deleted"
            time.sleep(0.05)


def test_owner_restarted_within_its_ttl_keeps_its_ssd_objects(procs, tmp_path):
    """Found by a new-user trial: an SSD owner SIGKILLed and restarted on the same
    directory before the master declared the old process dead (a supervisor restarting it)
    found its files registered to the old process, so the old one's death dropped them all.
    The new process now takes the files over."""
    ssd_dir = str(tmp_path / "ssd")
    m = sa.start_master(high_watermark=0.8, low_watermark=0.5, client_ttl=4.0)
    cfg = {
        "master": m.address,
        "segment_size": 4 * MiB + 4096,
        "ssd_dir": ssd_dir,
        "heartbeat_interval_s": 0.2,
    }
    node = sa.start_agent({**cfg, "name": "node"})
    with MooncakeStore(serve_tcp=False, master=m.address, segment_size=0) as s:
        put_until_on_ssd(s, 10, 5)
        on_ssd = [i for i in range(10) if s.where(f"o{i}").ssd]
        node.kill()
        t0 = time.monotonic()
        sa.start_agent({**cfg, "name": "node-again"})
        assert time.monotonic() - t0 < 4.0, (
            "the restart took longer than the client TTL: the test proves nothing"
        )
        deadline = time.monotonic() + 20
        while s.stats().clients_lost == 0:  # the old process is declared dead
            assert time.monotonic() < deadline, s.stats()
            time.sleep(0.1)
        for i in on_ssd:
            assert s.where(f"o{i}").ssd == ["node-again"], i
            assert s.get(f"o{i}") == sa.pattern(i, MiB), i
        assert s.stats().ssd_objects == len(on_ssd)


def test_ssd_max_bytes_keeps_the_newest_under_a_burst(procs, tmp_path):
    """Found by a new-user trial: 40 puts of 1 MiB back to back into a 16 MiB segment with
    ssd_max_bytes=10 MiB kept objects 4..9, 14, 19, ... on SSD and lost 25 (ssd_drops 4):
    writes still in flight held the directory's room, so later evictions skipped the SSD.
    Now such an eviction waits for the writes in flight; what is kept is the newest objects,
    and every object gone is counted in ssd_drops."""
    ssd_dir = tmp_path / "ssd"
    m = sa.start_master()
    n = 40
    with MooncakeStore(
        serve_tcp=False,
        master=m.address,
        segment_size=16 * MiB,
        ssd_dir=str(ssd_dir),
        ssd_max_bytes=10 * MiB,
        name="h",
    ) as s:
        for i in range(n):
            s.put(f"m{i}", sa.pattern(i, MiB))
        deadline = time.monotonic() + 20
        last = None
        while True:  # until the offloads settle
            st = s.stats()
            if (st.offloads, st.ssd_drops, st.evictions) == last:
                break
            assert time.monotonic() < deadline, st
            last = (st.offloads, st.ssd_drops, st.evictions)
            time.sleep(0.5)
        where = {i: s.where(f"m{i}") for i in range(n) if s.exists(f"m{i}")}
        kept = sorted(where)
        assert kept == list(range(n - len(kept), n)), kept  # the newest, none lost in between
        on_ssd = [i for i in kept if where[i].ssd]
        assert len(on_ssd) == 10 and len(list(ssd_dir.rglob("*.obj"))) == 10, (on_ssd, st)
        assert st.ssd_drops == n - len(kept), st
        for i in kept:
            assert s.get(f"m{i}") == sa.pattern(i, MiB), i


def test_ssd_dir_checks(procs, tmp_path):
    """Found by a new-user trial: one directory shared by two clients (each registers every
    file as its own) is refused while the first holds it, and free again once it exits; a
    FIFO named like an object file no longer blocks start for good; a file with bytes
    appended reads as corrupt, as it is treated at restart; ssd_dir on a file, ssd_max_bytes
    without ssd_dir and ssd_dir without a segment are refused with ValueError."""
    from mooncake_store import StoreError, TransferError

    m = sa.start_master(high_watermark=0.8, low_watermark=0.5)
    ssd_dir = tmp_path / "ssd"
    (ssd_dir / "ab").mkdir(parents=True)
    os.mkfifo(ssd_dir / "ab" / "fifo.obj")
    cfg = {
        "master": m.address,
        "segment_size": 4 * MiB + 4096,
        "ssd_dir": str(ssd_dir),
        "heartbeat_interval_s": 0.2,
    }
    node = sa.start_agent({**cfg, "name": "node"}, timeout=30)  # the FIFO blocked start forever
    with pytest.raises(StoreError, match=f"in use by another store client \\(pid {node.pid}\\)"):
        MooncakeStore(serve_tcp=False, **cfg)
    with MooncakeStore(serve_tcp=False, master=m.address, segment_size=0) as s:
        put_until_on_ssd(s, 8, 3)
        i = next(i for i in range(8) if s.where(f"o{i}").ssd and not s.where(f"o{i}").memory)
        from mooncake_store.client.ssd import scan

        path = next(e[4] for e in scan(str(ssd_dir)) if e[0] == f"o{i}")
        with open(path, "ab") as f:
            f.write(b"0123456789")
        with pytest.raises(TransferError, match="length does not match"):
            s.get(f"o{i}")
    node.kill()
    with MooncakeStore(serve_tcp=False, **cfg) as again:  # the lock went with the process
        assert again.stats().clients >= 1
    bad = [
        (dict(ssd_dir=str(tmp_path / "file")), "not a directory"),
        (dict(ssd_max_bytes=MiB), "ssd_max_bytes needs ssd_dir"),
        (dict(ssd_dir=str(tmp_path / "x"), segment_size=0), "needs segment_size > 0"),
    ]
    (tmp_path / "file").write_bytes(b"x")
    for kw, says in bad:
        kw.setdefault("segment_size", MiB)
        with pytest.raises(ValueError, match=says):
            MooncakeStore(serve_tcp=False, master=m.address, **kw)


def test_ssd_deletes_run_apart_and_never_remove_a_newer_write(tmp_path):
    """The holder's SSD deletes run on a thread of their own: every delete asked for is done
    by ``close``; a file written again at a path whose delete is still queued survives (the
    write settles that delete first); a path outside the SSD directory is left alone."""
    from mooncake_store.client.tasks import _Deleter

    root = tmp_path / "ssd"
    root.mkdir()
    outside = tmp_path / "outside.obj"
    outside.write_bytes(b"keep")
    old = [root / f"{i:04d}.obj" for i in range(500)]
    for p in old:
        p.write_bytes(b"old")
    again = old[-1]
    d = _Deleter(str(root))
    for p in old:
        d.put(str(p))
    d.put(str(outside))
    d.settle([str(again)])  # the offload about to write this path
    again.write_bytes(b"new")
    d.close()
    assert again.read_bytes() == b"new"
    assert [p for p in old[:-1] if p.exists()] == []
    assert outside.read_bytes() == b"keep"
