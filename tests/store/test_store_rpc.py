"""The client side of the store's metadata RPC (``protocol.Connection``): the bounded busy
poll for replies (``StoreConfig.rpc_busy_poll_us``), whole-call timeouts, frames larger
than one read or one send, and the warm-up of a put reservation's pages
(``transfer.touch_pages``). A plain-socket peer on 127.0.0.1 plays the master where a
master that stalls or answers late is needed; the real master elsewhere."""

import os
import socket
import struct
import threading
import time

import msgpack
import pytest
import torch  # noqa: F401  (before the extension)

from mooncake_pg import transfer
from mooncake_store import MooncakeStore, StoreConfig
from mooncake_store.common import protocol

pytestmark = pytest.mark.timeout(60)
MiB = 1 << 20


def frame(obj) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


def read_frame(conn):
    head = b""
    while len(head) < 4:
        chunk = conn.recv(4 - len(head))
        if not chunk:
            return None
        head += chunk
    (n,) = struct.unpack(">I", head)
    body = b""
    while len(body) < n:
        chunk = conn.recv(min(65536, n - len(body)))
        if not chunk:
            return None
        body += chunk
    return msgpack.unpackb(body, raw=False)


class Peer:
    """A one-connection stand-in for a master: greets, then answers each request with
    ``answer(request)`` after ``delay`` seconds (``None``: never answers; ``"close"``:
    closes the connection)."""

    def __init__(self, answer, delay=0.0, recv_pause=0.0):
        self.srv = socket.socket()
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(1)
        self.port = self.srv.getsockname()[1]
        self.answer, self.delay, self.recv_pause = answer, delay, recv_pause
        self.requests = []
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self):
        conn, _ = self.srv.accept()
        with conn:
            conn.sendall(frame([0, 0, {"v": 1, "nonce": b"n" * 32, "auth": False}]))
            while True:
                if self.recv_pause:
                    time.sleep(self.recv_pause)  # a slow reader: the client's send buffer fills
                req = read_frame(conn)
                if req is None:
                    return
                self.requests.append(req)
                rep = self.answer(req)
                if rep == "close":
                    return
                if rep is None:
                    continue
                time.sleep(self.delay)
                conn.sendall(frame(rep))

    def close(self):
        self.srv.close()


def echo(req):
    return [req[0], 0, req[2]]


@pytest.mark.parametrize("busy_poll_us", [0, 200])
def test_answers_fast_late_and_large(busy_poll_us):
    """A reply within the spin, one after it (the poll() path), and a 9 MiB reply that
    arrives over many reads all come back whole and in order."""
    peer = Peer(echo)
    c = protocol.Connection(
        "127.0.0.1", peer.port, secret=None, timeout=5, busy_poll_us=busy_poll_us
    )
    try:
        for i in range(50):
            assert c.call("x", {"i": i}) == {"i": i}
        peer.delay = 0.05  # 50 ms: far past a 200 us spin
        t0 = time.monotonic()
        assert c.call("x", {"late": True}) == {"late": True}
        assert time.monotonic() - t0 >= 0.04
        peer.delay = 0.0
        big = os.urandom(9 * MiB)
        assert c.call("x", {"blob": big}) == {"blob": big}
        assert [r[0] for r in peer.requests] == list(range(1, 53))
    finally:
        c.close()
        peer.close()


def test_busy_poll_backs_off_after_misses():
    """A spin that misses the reply turns spinning off for the next 1, 2, 4 ... calls (at most
    64); a spin that catches one resets that. Replies stay whole and in order throughout."""
    peer = Peer(echo, delay=0.3)  # past the 0.1 s spin
    c = protocol.Connection("127.0.0.1", peer.port, secret=None, timeout=5, busy_poll_us=100_000)
    try:
        assert c.call("x", {"i": 0}) == {"i": 0}  # spun, missed: the next call waits unspun
        assert (c._spin_skip, c._spin_backoff) == (1, 1)
        assert c.call("x", {"i": 1}) == {"i": 1}  # not spun
        assert (c._spin_skip, c._spin_backoff) == (0, 1)
        assert c.call("x", {"i": 2}) == {"i": 2}  # spun, missed again: twice as many
        assert (c._spin_skip, c._spin_backoff) == (2, 2)
        peer.delay = 0.0
        for i in range(3, 6):  # two unspun calls, then a spin that catches its reply
            assert c.call("x", {"i": i}) == {"i": i}
        assert (c._spin_skip, c._spin_backoff) == (0, 0)
        assert [r[2]["i"] for r in peer.requests] == list(range(6))
    finally:
        c.close()
        peer.close()


def test_large_request_to_a_slow_reader():
    """A request larger than the socket's send buffer, to a peer that reads slowly, is sent
    whole (the non-blocking send waits for room instead of dropping bytes)."""
    peer = Peer(lambda req: [req[0], 0, {"n": len(req[2]["blob"])}], recv_pause=0.2)
    c = protocol.Connection("127.0.0.1", peer.port, secret=None, timeout=10, busy_poll_us=200)
    try:
        c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
        assert c.call("x", {"blob": b"\x01" * (16 * MiB)}) == {"n": 16 * MiB}
    finally:
        c.close()
        peer.close()


@pytest.mark.parametrize("busy_poll_us", [0, 1000])
def test_silent_master_times_out(busy_poll_us):
    """A master that never answers: the call raises TimeoutError (an OSError, which the
    client treats as a lost connection) after its timeout, not before, and not much later."""
    peer = Peer(lambda req: None)
    c = protocol.Connection(
        "127.0.0.1", peer.port, secret=None, timeout=5, busy_poll_us=busy_poll_us
    )
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            c.call("x", {}, timeout=0.5)
        took = time.monotonic() - t0
        assert 0.45 <= took < 3.0, took
    finally:
        c.close()
        peer.close()


def test_greeting_timeout_and_closed_peer():
    """A peer that accepts but never greets: TimeoutError after the connection's timeout; a
    peer that closes mid-call: ConnectionResetError."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            protocol.Connection(
                "127.0.0.1", srv.getsockname()[1], secret=None, timeout=0.5, busy_poll_us=200
            )
        assert time.monotonic() - t0 < 3.0
    finally:
        srv.close()
    peer = Peer(lambda req: None)
    c = protocol.Connection("127.0.0.1", peer.port, secret=None, timeout=5, busy_poll_us=200)
    try:
        peer.answer = lambda req: "close"
        with pytest.raises(ConnectionError):
            c.call("x", {})
    finally:
        c.close()
        peer.close()


@pytest.mark.parametrize(
    "field,default,bad,var,good,malformed,says,too_big",
    [
        (
            "rpc_busy_poll_us",
            0,  # with a master address; the embedded master's default is the next test's
            (-1, 1_000_001, 1.5, True, "200"),
            "MOONCAKE_STORE_RPC_BUSY_POLL_US",
            "50",
            "50us",
            "must be a whole number of microseconds",
            "2000000",
        ),
        (
            "put_reservation_bytes",
            64 * MiB,
            (-1, 1 << 50, 1 << 70, 1.5, True),
            "MOONCAKE_STORE_PUT_RESERVATION_BYTES",
            "1048576",
            "1M",
            "must be a byte count",
            str(1 << 50),
        ),
    ],
)
def test_config_and_env(monkeypatch, field, default, bad, var, good, malformed, says, too_big):
    """The default; bad values raise naming the field; the variable is read, an explicit
    argument wins over it (also over a malformed one), a malformed one (also non-ASCII
    digits) raises naming the variable, and so does one out of range."""

    def resolved(**kw):
        return getattr(StoreConfig(master="127.0.0.1:1", **kw).resolved(), field)

    assert resolved() == default
    for b in bad:
        with pytest.raises(ValueError, match=field):
            resolved(**{field: b})
    monkeypatch.setenv(var, good)
    assert resolved() == int(good)
    assert resolved(**{field: 0}) == 0
    for m in (malformed, "\u0663", "\u00b2"):  # ARABIC-INDIC DIGIT THREE, SUPERSCRIPT TWO
        monkeypatch.setenv(var, m)
        with pytest.raises(ValueError, match=f"{var} {says}"):
            resolved()
        assert resolved(**{field: int(good)}) == int(good)
    monkeypatch.setenv(var, too_big)
    with pytest.raises(ValueError, match=f"{field} .*\\(from {var}\\)"):
        resolved()


def test_env_value_reads_one_variable(monkeypatch):
    """The master reads its secret and event-loop choice one variable at a time: a malformed
    store variable it does not use does not stop it; the malformed one itself raises,
    naming it."""
    from store.common.config import env_value

    monkeypatch.setenv("MOONCAKE_STORE_SEGMENT_SIZE", "lots")
    monkeypatch.setenv("MOONCAKE_STORE_SECRET", "s3")
    monkeypatch.setenv("MOONCAKE_STORE_NO_UVLOOP", "1")
    assert env_value("secret") == "s3"
    assert env_value("no_uvloop") is True
    monkeypatch.delenv("MOONCAKE_STORE_SECRET")
    assert env_value("secret") is None
    with pytest.raises(ValueError, match="MOONCAKE_STORE_SEGMENT_SIZE must be a byte count"):
        env_value("segment_size")


def test_rpc_busy_poll_default_spins_only_for_the_embedded_master():
    """A client spins for its reply (200 us) only with the embedded master, which does not
    busy-poll; with a master process (an address or etcd) it sleeps (docs/store.md)."""
    assert StoreConfig().resolved().rpc_busy_poll_us == 200
    assert StoreConfig(master="127.0.0.1:1").resolved().rpc_busy_poll_us == 0
    assert StoreConfig(etcd="127.0.0.1:1").resolved().rpc_busy_poll_us == 0
    assert (
        StoreConfig(master="127.0.0.1:1", rpc_busy_poll_us=200).resolved().rpc_busy_poll_us == 200
    )


def test_touch_pages_reads_and_changes_nothing():
    buf = bytearray(os.urandom(5 * 4096 + 7))
    before = bytes(buf)
    assert transfer.touch_pages(buf) == 6  # one read per started page
    assert transfer.touch_pages(memoryview(buf)[:0]) == 0
    assert bytes(buf) == before
    assert transfer.touch_pages(b"read-only is fine") == 1
    # strided buffers are refused (they were read past their end: a broadcast array crashed)
    np = pytest.importorskip("numpy")
    for strided in (
        np.broadcast_to(np.zeros(1), (1 << 24,)),
        np.arange(8192, dtype=np.uint8)[::-1],
        memoryview(bytearray(8192))[::2],
    ):
        with pytest.raises(RuntimeError, match="touch_pages: buffer is not contiguous"):
            transfer.touch_pages(strided)
        with pytest.raises(RuntimeError, match="copy_to_bytes: buffer is not contiguous"):
            transfer.copy_to_bytes([strided])
        with pytest.raises(RuntimeError, match="copy_buffers: source: buffer is not contiguous"):
            transfer.copy_buffers([bytearray(strided.nbytes)], [strided])
    assert transfer.copy_to_bytes([np.arange(4, dtype=np.uint8)]) == [b"\x00\x01\x02\x03"]
    assert transfer.touch_pages(np.zeros((3, 4096), dtype=np.uint8)[1:2]) == 1  # a contiguous row


def test_reservation_warmed_and_client_closes_cleanly():
    """A client with its own segment in 4 KiB pages warms each new reservation on a background thread;
    the values written meanwhile read back exactly, and close() (which waits for that
    thread before unmapping the segment) works, also right after a warm-up started."""
    for _ in range(3):
        s = MooncakeStore(
            serve_tcp=False,
            segment_size=64 * MiB + 4096,
            put_reservation_bytes=4 * MiB,
            rpc_busy_poll_us=200,
            huge_pages=False,
        )  # 2 MiB pages need no warm-up
        vals = {f"k{i}": os.urandom(1000 + 37 * i) for i in range(200)}
        for k, v in vals.items():
            assert s.put(k, v) == 1
        resv = s.internal.reservations
        assert resv.warm_thread is not None and resv.warm_thread.is_alive()
        assert all(s.get(k) == v for k, v in vals.items())
        s.close()
        assert not resv.warm_thread.is_alive()
