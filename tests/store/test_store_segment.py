"""Segment memory (``store/client/segment.py``): a client's segment in 2 MiB pages
(``StoreConfig.huge_pages``, ``MADV_COLLAPSE``), mapped at 2 MiB-aligned addresses so
that other mappings of it use those pages whole too; mappings that live as long as any
view of them; read-only mappings of other clients' segments. The kernel's own account
(``/proc/self/smaps``) is the reference for what is mapped how."""

import json
import os
import subprocess
import sys

import pytest

from mooncake_store import MooncakeStore
from mooncake_store.client import segment as S

MiB = 1 << 20


def collapse_supported() -> bool:
    """Whether this kernel turns shared memory into 2 MiB pages on request (Linux 6.1+)."""
    fd = os.memfd_create("probe", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, 2 * MiB)
        view, huge = S._map(fd, 2 * MiB, prefault=True, writable=True, huge_pages=True)
        view.release()
        return huge == 2 * MiB
    finally:
        os.close(fd)


needs_collapse = pytest.mark.skipif(
    not collapse_supported(),
    reason="the kernel refuses MADV_COLLAPSE on shmem (before Linux 6.1, or shmem_enabled=deny)",
)


def vmas(fd: int):
    """smaps entries (dict of field -> kB, plus 'start') of this process's mappings of ``fd``."""
    target = os.stat(f"/proc/self/fd/{fd}")
    out, cur = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and len(parts) >= 5 and ":" in parts[3]:
                cur = None
                if int(parts[4]) == target.st_ino:
                    cur = {"start": int(parts[0].split("-")[0], 16)}
                    out.append(cur)
            elif (
                cur is not None
                and parts[0].endswith(":")
                and len(parts) >= 2
                and parts[1].isdigit()
            ):
                cur[parts[0][:-1]] = int(parts[1])
    return out


@needs_collapse
def test_segment_in_huge_pages_and_peer_mappings_use_them():
    s = MooncakeStore(serve_tcp=False, segment_size=64 * MiB + 4096)
    try:
        seg = s.internal.segment
        assert seg.huge_bytes == 64 * MiB and seg.all_huge  # the 4 KiB tail stays in small pages
        (own,) = vmas(seg.fd)
        assert own["start"] % (2 * MiB) == 0
        assert own["ShmemPmdMapped"] == 64 * 1024  # kB, the kernel's count
        # another mapping of the segment (what a same-host reader makes) maps the same pages whole
        peer = S.MappedSegment(seg.desc("h", None) | {"name": seg.name}, readonly=True)
        try:
            both = vmas(seg.fd)
            assert len(both) == 2 and all(v["ShmemPmdMapped"] == 64 * 1024 for v in both)
            vals = {f"k{i}": os.urandom(3 * MiB + i) for i in range(8)}
            for k, v in vals.items():
                assert s.put(k, v) == 1
            assert all(s.get(k) == v for k, v in vals.items())
            (obj,), _segs, _ = s.internal.locate(["k3"])
            off = obj.replicas[0][2]
            assert peer.view[off : off + obj.size] == vals["k3"]
        finally:
            peer.close()
        assert (
            s.internal.reservations.warm_thread is None
        )  # 2 MiB pages do not go cold: no warm-up thread
    finally:
        s.close()


def test_huge_pages_off_keeps_small_pages_and_warms_up():
    pytest.importorskip("torch")  # the warm-up runs in the C++ extension, loaded once torch is
    s = MooncakeStore(
        serve_tcp=False, segment_size=64 * MiB, huge_pages=False, put_reservation_bytes=4 * MiB
    )
    try:
        assert s.internal.segment.huge_bytes == 0 and not s.internal.segment.all_huge
        (own,) = vmas(s.internal.segment.fd)
        assert own.get("ShmemPmdMapped", 0) == 0
        assert own["Rss"] == 64 * 1024  # prefaulted all the same
        for i in range(50):
            assert s.put(f"k{i}", bytes([i]) * 1000) == 1
        assert s.internal.reservations.warm_thread is not None
        assert all(s.get(f"k{i}") == bytes([i]) * 1000 for i in range(50))
    finally:
        s.close()


def test_mapping_lives_while_a_view_does():
    seg = S.LocalSegment("life", 4 * MiB + 100)
    seg.view[5000:5004] = b"abcd"
    v = seg.view[5000:5004]
    fd = os.dup(seg.fd)  # to find the mapping after close() closed the segment's own fd
    try:
        seg.close()
        assert bytes(v) == b"abcd"  # still mapped: no crash, same bytes
        assert len(vmas(fd)) == 1
        v.release()
        assert vmas(fd) == []  # unmapped with the last view
    finally:
        os.close(fd)
    np = pytest.importorskip("numpy")
    seg = S.LocalSegment("life2", 2 * MiB)
    arr = np.frombuffer(seg.view, dtype=np.uint8)  # a buffer taken from the segment's own view
    seg.close()  # no BufferError: the mapping waits for the array
    assert arr[:8].tobytes() == S.MAGIC


def test_read_only_peer_mapping_refuses_writes():
    seg = S.LocalSegment("ro", 2 * MiB)
    try:
        peer = S.MappedSegment(seg.desc("h", None) | {"name": "ro"}, readonly=True)
        assert peer.view.readonly
        with pytest.raises(TypeError):
            peer.view[100:101] = b"x"
        seg.view[100:101] = b"y"
        assert peer.view[100:101] == b"y"
        peer.close()
    finally:
        seg.close()


def test_wrong_token_and_missing_file_are_transfer_errors():
    from mooncake_store import TransferError

    seg = S.LocalSegment("tok", 2 * MiB)
    try:
        bad = seg.desc("h", None) | {"name": "tok", "token": os.urandom(16).hex()}
        with pytest.raises(TransferError, match="not the registered one"):
            S.MappedSegment(bad)
        gone = seg.desc("h", None) | {"name": "tok", "path": "/proc/self/fd/999999"}
        with pytest.raises(TransferError, match="cannot map segment"):
            S.MappedSegment(gone)
    finally:
        seg.close()


@needs_collapse
def test_peer_process_maps_whole_pages():
    """A second process maps the segment through /proc/<pid>/fd and reads it through 2 MiB
    mappings (its own smaps), getting the owner's bytes."""
    seg = S.LocalSegment("peer", 8 * MiB)
    try:
        data = os.urandom(MiB)
        seg.view[3 * MiB : 4 * MiB] = data
        code = (
            "import sys, json, hashlib; from mooncake_store.client import segment as S\n"
            "desc = json.loads(sys.argv[1])\n"
            "m = S.MappedSegment(desc, readonly=True)\n"
            "pmd = sum(int(l.split()[1]) for l in open('/proc/self/smaps') if l.startswith('ShmemPmdMapped:'))\n"
            "print(hashlib.sha256(m.view[3 << 20:4 << 20]).hexdigest(), pmd)\n"
        )
        import hashlib

        desc = seg.desc("h", None) | {"name": "peer"}
        out = subprocess.run(
            [sys.executable, "-c", code, json.dumps(desc)],
            capture_output=True,
            text=True,
            timeout=60,
            start_new_session=True,
        )
        assert out.returncode == 0, out.stderr
        digest, pmd = out.stdout.split()
        assert digest == hashlib.sha256(data).hexdigest()
        assert int(pmd) >= 8 * 1024
    finally:
        seg.close()


def test_map_errors_are_oserrors():
    fd = os.memfd_create("small", os.MFD_CLOEXEC)
    try:
        with pytest.raises(OSError):
            S._map(fd, 1 << 60, prefault=False, writable=True)  # no such address space
    finally:
        os.close(fd)


def test_copies_exact_at_odd_sizes_and_alignments():
    """The C++ copies (non-temporal from 64 KiB, two threads from 4 MiB) against Python's
    own slicing, at sizes and offsets that leave heads and tails around the 32-byte and
    128-byte steps."""
    transfer = pytest.importorskip("mooncake_pg.transfer")
    seg = S.LocalSegment("copies", 16 * MiB)
    try:
        src = os.urandom(6 * MiB + 999)
        for n in (1, 4095, 4096, 4097, 64 * 1024 + 7, MiB + 123, 5 * MiB + 3):
            for soff, doff in ((0, 0), (1, 5), (31, 64), (100, 4096 + 17)):
                piece = memoryview(src)[soff : soff + n]
                transfer.copy_buffers([seg.view[doff : doff + n]], [piece])
                assert seg.view[doff : doff + n] == piece, (n, soff, doff)
                assert transfer.copy_to_bytes([seg.view[doff : doff + n]]) == [bytes(piece)], (
                    n,
                    soff,
                    doff,
                )
    finally:
        seg.close()


@pytest.mark.parametrize("threads", [2, 3, 4])
def test_parallel_copies_cover_every_byte(threads):
    """Copies split over threads cover every byte, also where the total divided by the
    threads is a multiple of 4096 with a remainder (those lost their last bytes: a 4 MiB + 1
    value read back with its last byte wrong), over several pieces too, and into fresh
    outputs (each thread prefaults its part)."""
    transfer = pytest.importorskip("mooncake_pg.transfer")
    for total in (
        threads * 4096 * 256 + 1,
        threads * 4096 * 300 + threads - 1,
        4 * MiB + 8193,
        8 * MiB + 1,
    ):
        src = os.urandom(total)
        dst = bytearray(total)
        transfer.copy_buffers([dst], [src], threads)
        assert dst == src, (threads, total)
        assert transfer.copy_to_bytes([src], threads) == [src], (threads, total)
        # a batch: a large piece and a one-byte value after it (the byte was left unwritten)
        pieces = [src[:-1], src[-1:]]
        outs = [bytearray(len(p)) for p in pieces]
        transfer.copy_buffers(outs, pieces, threads)
        assert outs == pieces, (threads, total)
        assert transfer.copy_to_bytes(pieces, threads) == pieces, (threads, total)


def test_store_values_one_past_a_page_multiple_read_back_exactly():
    """The store's same-host path (C++ copies) at the sizes that lost their last byte."""
    pytest.importorskip("mooncake_pg.transfer")
    s = MooncakeStore(serve_tcp=False, segment_size=64 * MiB)
    try:
        vals = {f"v{n}": os.urandom(n) for n in (4 * MiB + 1, 5 * MiB + 1, 8 * MiB + 1)}
        for k, v in vals.items():
            s.put(k, v)
        s.put_batch(["big", "flag"], [os.urandom(4 * MiB), b"\x07"])
        assert s.get("flag") == b"\x07"
        assert s.get_batch(list(vals) + ["flag"]) == list(vals.values()) + [b"\x07"]
        for k, v in vals.items():
            assert s.get(k) == v, k
            out = bytearray(len(v))
            s.get_into(k, out)
            assert out == v, k
    finally:
        s.close()


@pytest.mark.parametrize(
    "kw, says",
    [
        (
            dict(huge_pages="False"),
            "huge_pages must be True or False",
        ),  # was: a truthy string, huge pages on
        (dict(prefault="no"), "prefault must be True or False"),
        (dict(serve_tcp=1), "serve_tcp must be True or False"),
        (dict(host_id=5), "host_id must be a str"),  # was: the master's "register: bad arguments"
        (dict(segment_size=True), "segment_size must be a byte count"),
        (dict(ssd_dir=3), "ssd_dir must be a path"),
    ],
)
def test_config_types_checked_before_anything_starts(kw, says):
    from mooncake_store import StoreConfig

    with pytest.raises(ValueError, match=says):
        StoreConfig(**kw).validate()
    with pytest.raises(ValueError, match=says):
        MooncakeStore(**kw)


def test_segment_that_cannot_be_mapped_leaks_nothing():
    def memfds():
        out = 0
        for f in os.listdir("/proc/self/fd"):
            try:
                out += "mooncake-store-" in os.readlink(f"/proc/self/fd/{f}")
            except OSError:
                pass
        return out

    before = memfds()
    for _ in range(3):
        with pytest.raises(OSError, match="segment_size"):
            S.LocalSegment("toobig", 1 << 48)
    assert memfds() == before


_FAULTS_SCRIPT = r"""
import json, resource, sys
import torch  # the C++ copies, as a client that uses tensors has them
from mooncake_store import MooncakeStore
from mooncake_store.client import segment as S
MiB = 1 << 20
s = MooncakeStore(serve_tcp=False, segment_size=64 * MiB, put_reservation_bytes=0)
keys = [f"k{i}" for i in range(16)]
vals = [bytes([i]) * MiB for i in range(16)]
s.put_batch(keys, vals)
faults = []
for _ in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    got = s.get_batch(keys)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    assert got == vals
    del got  # 16 MiB of values freed together
s.close()
print(json.dumps({"tuned": S._malloc_tuned, "faults": faults}))
"""


@pytest.mark.skipif(not os.confstr("CS_GNU_LIBC_VERSION"), reason="mallopt thresholds are glibc's")
@pytest.mark.parametrize(
    "env, tuned",
    [
        ({}, True),
        ({"MOONCAKE_STORE_TUNE_MALLOC": "0"}, False),
        ({"MALLOC_TRIM_THRESHOLD_": "131072"}, False),
        ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"}, False),
        ({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"}, True),
    ],
)
def test_tune_malloc_gets_reuse_freed_heap(env, tuned):
    """With ``tune_malloc`` (default), a batch get of 16 x 1 MiB takes its values from the
    heap the previous batch freed: the kernel's count of this process's page faults stays
    far below one per 4 KiB of output (4096); nearly that many when the freed
    values went back to the kernel (``tune_malloc=False``, or the user's own malloc
    settings, which win)."""
    penv = {k: v for k, v in os.environ.items() if "MALLOC" not in k and k != "GLIBC_TUNABLES"}
    penv.update(env)
    out = subprocess.run(
        [sys.executable, "-c", _FAULTS_SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
        env=penv,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["tuned"] is tuned
    later = res["faults"][1:]  # the first batch grows the heap either way
    if tuned:
        assert max(later) < 1024, res
    else:
        assert min(later) >= 3072, res  # most of the 4096 pages are fresh


def test_tune_malloc_config_and_env(monkeypatch):
    from mooncake_store import StoreConfig

    def resolved(**kw):
        return StoreConfig(master="127.0.0.1:1", **kw).resolved().tune_malloc

    monkeypatch.delenv("MOONCAKE_STORE_TUNE_MALLOC", raising=False)
    assert resolved() is True
    with pytest.raises(ValueError, match="tune_malloc must be True or False"):
        resolved(tune_malloc="no")
    monkeypatch.setenv("MOONCAKE_STORE_TUNE_MALLOC", "0")
    assert resolved() is False
    assert resolved(tune_malloc=True) is True  # an explicit argument wins
    monkeypatch.setenv("MOONCAKE_STORE_TUNE_MALLOC", "yes")
    with pytest.raises(ValueError, match="MOONCAKE_STORE_TUNE_MALLOC must be 0 or 1"):
        resolved()
