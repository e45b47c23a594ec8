"""Metadata RPC wire format: length-prefixed msgpack frames.

A frame is a 4-byte big-endian length followed by that many bytes of one msgpack value.
msgpack (the ``msgpack`` package, C accelerated) decodes only plain data (ints, floats,
str, bytes, lists, maps): nothing is ever unpickled or evaluated.

* request: ``[id, method, args]`` (``id`` an int, ``method`` a str, ``args`` a map)
* reply:   ``[id, 0, result]`` or ``[id, 1, [code, message]]``
* on connect the master sends a greeting ``[0, 0, {"v": 1, "nonce": bytes, "auth": bool}]``;
  when ``auth`` is true the first request must be ``hello`` with
  ``{"mac": HMAC-SHA256(secret, nonce)}``.

A frame longer than the limit gets an error reply and the connection is closed (its
bytes are never buffered); a frame that is not valid msgpack, or not a request, gets an
error reply with id -1 (or its id when readable) and the connection goes on.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import select
import socket
import struct
import threading
import time
from typing import Any

import msgpack

from .errors import AuthError, ProtocolError, from_code

VERSION = 1
_LEN = struct.Struct(">I")


_tls = threading.local()  # a Packer per thread: ``msgpack.packb`` builds one per call


def pack(obj: Any) -> bytes:
    """One frame of ``obj``: the 4-byte big-endian length, then its msgpack bytes.

    Raises ``TypeError`` (or ``ValueError``/``OverflowError``) for what msgpack cannot encode.
    """
    try:
        packer = _tls.packer
    except AttributeError:
        packer = _tls.packer = msgpack.Packer(use_bin_type=True)
    body = packer.pack(obj)  # a failed pack leaves the packer's buffer empty
    return _LEN.pack(len(body)) + body


def unpack(body: bytes) -> Any:
    """Decodes one frame body; raises ``ProtocolError`` if it is not valid msgpack.

    The caller checks the frame's length against its limit before reading the body.
    """
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # msgpack raises several types (ExtraData, ValueError, ...)
        raise ProtocolError(f"malformed frame: {type(e).__name__}: {e}") from None


def mac(secret: str, nonce: bytes) -> bytes:
    """HMAC-SHA256 of ``nonce`` with ``secret``: the proof a ``hello`` request carries."""
    return hmac.new(secret.encode(), nonce, hashlib.sha256).digest()


_SPIN_BACKOFF_MAX = 64  # most calls a missed spin turns spinning off for
# a sched_yield that took longer than this ran another task: a spinner that shares its core
# burns the CPU time that the scheduler's fairness would give it back at a wake-up, and each
# yield can hand the core over for a whole time slice, so the spin ends as a miss
YIELD_LOST_S = 50e-6


class Connection:
    """A blocking client connection to a master (one request at a time).

    ``busy_poll_us``: after sending a request, check for the reply without sleeping for up to this
    many microseconds before waiting in ``poll()``. On VMs a sleeping vCPU costs tens of
    microseconds to wake (measured on the 2-core CI VM: a 64-byte loopback ping-pong takes 70-80 us
    when the caller sleeps, 21-22 us when it spins), which is as long as the master's whole answer;
    0 always sleeps. The spin is bounded, so a slow answer costs at most this much CPU.

    The spin adapts: one that runs out before the reply (the master is busy, or waits for a core
    that this spinning caller and others occupy, as when more clients than cores share a host)
    turns spinning off for the next calls, twice as many after each further miss (up to
    ``_SPIN_BACKOFF_MAX``), and one that catches the reply resets that. Each turn of the spin
    yields the core (``sched_yield``), so a master woken on the same core runs at once; a
    yield that ran another task for more than ``YIELD_LOST_S`` (the core is shared with other
    work) ends the spin as a miss. On a 2-core VM at load average 4-5, one client's 1-key
    removes ran at 7-12K/s with a fixed 200 us spin (p90 257 us: missed spins), 31-32K/s
    without spinning and 35-38K/s with this one (benchmarks/RESULTS.md, "Metadata load").

    Raises ``OSError`` (connection problems; ``TimeoutError`` after ``timeout`` seconds),
    ``ProtocolError`` and the store errors the master replies with.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        secret: str | None,
        timeout: float,
        max_frame: int = 256 << 20,
        busy_poll_us: int = 0,
    ):
        self.host, self.port = host, port
        self.timeout = timeout
        self.max_frame = max_frame
        self.busy_poll_s = busy_poll_us / 1e6
        self._spin_skip = 0  # calls left that wait without spinning
        self._spin_backoff = 0  # how many the next miss skips
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.setblocking(
            False
        )  # waits are ours: a bounded spin, then poll() with the deadline
        self._poller = select.poll()
        self._poller.register(self.sock, select.POLLIN)
        self._next = 1
        self._buf = bytearray()
        self._pos = 0
        try:
            greet = self._read_frame(time.monotonic() + timeout, spin=False)
        except BaseException:
            self.close()
            raise
        if (
            isinstance(greet, list)
            and len(greet) == 3
            and greet[1] == 1
            and isinstance(greet[2], list)
            and len(greet[2]) == 2
        ):
            self.close()  # the master refused the connection (e.g. too many connections)
            raise from_code(
                greet[2][0], f"master {host}:{port} refused the connection: {greet[2][1]}"
            )
        if not (isinstance(greet, list) and len(greet) == 3 and isinstance(greet[2], dict)):
            self.close()
            raise ProtocolError(f"{host}:{port} is not a mooncake store master")
        info = greet[2]
        self.greeting = info
        if info.get("auth"):
            if not secret:
                self.close()
                raise AuthError(
                    f"master {host}:{port} requires a shared secret (StoreConfig.secret / MOONCAKE_STORE_SECRET)"
                )
            self.call("hello", {"mac": mac(secret, info["nonce"])})

    def _wait(self, events: int, deadline: float, spin: bool):
        """Returns once the socket is ready for ``events``.

        Raises ``TimeoutError`` at ``deadline`` (``time.monotonic()``).
        """
        if spin and self.busy_poll_s > 0:
            if self._spin_skip > 0:
                self._spin_skip -= 1
            else:
                end = time.perf_counter() + self.busy_poll_s
                while True:
                    if self._poller.poll(0):
                        self._spin_backoff = 0
                        return
                    now = time.perf_counter()
                    if now > end:
                        break
                    os.sched_yield()
                    if time.perf_counter() - now > YIELD_LOST_S:
                        break  # another task had the core: the core is shared, a miss
                self._spin_backoff = min(_SPIN_BACKOFF_MAX, 2 * self._spin_backoff or 1)
                self._spin_skip = self._spin_backoff
        if events != select.POLLIN:
            self._poller.modify(self.sock, events)
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no answer from master {self.host}:{self.port} in time")
                if self._poller.poll(max(1, int(left * 1000 + 0.999))):
                    return
        finally:
            if events != select.POLLIN:
                self._poller.modify(self.sock, select.POLLIN)

    def _send(self, data: bytes, deadline: float):
        view = memoryview(data)
        while view:
            try:
                n = self.sock.send(view)
            except BlockingIOError:
                self._wait(select.POLLOUT, deadline, spin=False)
                continue
            view = view[n:]

    def _fill(self, need: int, deadline: float, spin: bool):
        """Reads until the buffer holds ``need`` unread bytes."""
        while len(self._buf) - self._pos < need:
            if self._pos:
                del self._buf[: self._pos]
                self._pos = 0
            try:
                chunk = self.sock.recv(max(65536, need - len(self._buf)))
            except BlockingIOError:
                self._wait(select.POLLIN, deadline, spin)
                continue
            if not chunk:
                raise ConnectionResetError("master closed the connection")
            self._buf += chunk

    def _read_whole(self):
        """One read into an empty buffer: the frame it holds whole, decoded, or None.

        The usual reply comes whole in one read and is decoded from it without being buffered;
        anything else (part of a frame, several frames, nothing yet) is buffered for
        :meth:`_read_frame`.
        """
        try:
            chunk = self.sock.recv(65536)
        except BlockingIOError:
            return None
        if not chunk:
            raise ConnectionResetError("master closed the connection")
        if len(chunk) >= 4:
            (n,) = _LEN.unpack_from(chunk, 0)
            if n == len(chunk) - 4 and n <= self.max_frame:
                return unpack(memoryview(chunk)[4:])
        del self._buf[:]
        self._pos = 0
        self._buf += chunk
        return None

    def _read_frame(self, deadline: float, spin: bool = True):
        self._fill(4, deadline, spin)
        (n,) = _LEN.unpack_from(self._buf, self._pos)
        if n > self.max_frame:
            raise ProtocolError(f"reply frame of {n} bytes exceeds {self.max_frame}")
        self._fill(4 + n, deadline, spin)
        start = self._pos + 4
        body = memoryview(self._buf)[start : start + n]
        try:
            return unpack(body)
        finally:
            body.release()
            self._pos = start + n

    def call(self, method: str, args: dict, timeout: float | None = None) -> Any:
        """Sends one request and returns its result (raises the master's error).

        Args:
            method: the name of the master's method.
            args: its arguments (a map).
            timeout: seconds for the whole call (default: the connection's).
        """
        mid = self._next
        self._next += 1
        deadline = time.monotonic() + (timeout or self.timeout)
        data = pack([mid, method, args])
        try:
            sent = self.sock.send(data)
        except BlockingIOError:
            sent = 0
        if sent < len(data):
            self._send(memoryview(data)[sent:], deadline)
        rep = None
        if self._pos == len(self._buf):
            # nothing buffered: wait for the reply before reading (a read now would find
            # nothing, costing a system call and an exception on every call)
            self._wait(select.POLLIN, deadline, True)
            rep = self._read_whole()
        while True:
            if rep is None:
                rep = self._read_frame(deadline)
            if not (isinstance(rep, list) and len(rep) == 3):
                raise ProtocolError("malformed reply")
            if rep[0] == mid:
                break
            if rep[0] == -1 and rep[1] == 1:  # a protocol error about our request
                break
            rep = None
        if rep[1] == 0:
            return rep[2]
        code, message = rep[2][0], rep[2][1]
        raise from_code(code, message)

    def close(self) -> None:
        """Closes the socket (an ``OSError`` while closing is ignored)."""
        try:
            self.sock.close()
        except OSError:
            pass
