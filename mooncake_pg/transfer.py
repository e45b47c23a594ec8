"""``TransferEngine``: moves bytes between registered memory of two processes over TCP.

The store uses it to read and write segments of clients on other hosts::

    from mooncake_pg.transfer import TransferEngine
    server = TransferEngine(listen_host="127.0.0.1")          # serves registered memory
    region = server.register_memory(buf)                       # any writable buffer
    client = TransferEngine()                                  # client only
    client.batch_write("127.0.0.1", server.port, region, [0, 4096], [b"abc", b"def"])
    client.batch_read("127.0.0.1", server.port, region, [0], [out])

Wire format and bounds checks: ``csrc/transport/transfer_engine.hpp``. A request outside
a registered region is refused by the server before any byte is touched. An optional
shared secret is checked when a connection opens (sent as is: use it on trusted networks).
Errors raise ``RuntimeError`` with a ``TransferEngine::method:`` prefix. When the
connection to the peer fails (it cannot be reached within 2 s, does not answer the
handshake within 5 s, rejects the secret, closes the connection, or moves no byte for
10 s) the error is the subclass
``torch.distributed.DistNetworkError``; a plain ``RuntimeError`` from a batch means a live
peer refused an op (unknown region, out of bounds) and closed that connection. Bad
arguments (a port outside 1..65535, a negative offset or length, a region id that is not
a 32-bit number) raise ``ValueError`` before anything is sent.
"""

from __future__ import annotations

from collections.abc import Sequence

from ._loader import _C


class TransferEngine:
    """One engine: a server for the memory registered here, and a client.

    The server runs when ``listen_host`` is given (port chosen by the kernel); the client keeps
    one cached connection per peer.

    Args:
        listen_host: address to listen on (``""``: no server, client only).
        secret: shared secret peers must present (``""``: none). Must match the peer's.
    """

    def __init__(self, listen_host: str = "", secret: str = ""):
        if not isinstance(listen_host, str) or not isinstance(secret, str):
            raise ValueError("TransferEngine: listen_host and secret must be str")
        self._te = _C.TransferEngine(listen_host, secret)
        self._keep: dict = {}
        self._closed = False

    @staticmethod
    def local_address_for(peer_host: str, ifname: str = "") -> str:
        """Address of the local interface that routes to ``peer_host`` (or of ``ifname``)."""
        return _C.local_address_for(peer_host, ifname)

    @property
    def host(self) -> str:
        """Listening address: the ``listen_host`` given (``""`` without a server)."""
        return self._te.host

    @property
    def port(self) -> int:
        """Listening port (0 without a server)."""
        return self._te.port

    def register_memory(self, buffer) -> int:
        """Registers a writable buffer (kept referenced until unregistered); returns its region id."""
        if self._closed:
            raise RuntimeError("TransferEngine::register_memory: engine is closed")
        mv = memoryview(buffer)
        if mv.readonly or not mv.contiguous:
            raise ValueError(
                "TransferEngine.register_memory: buffer must be writable and contiguous"
            )
        region = self._te.register_memory(mv.cast("B"))
        self._keep[region] = mv
        return region

    def unregister_memory(self, region: int) -> None:
        """Waits for transfers into the region in progress, then forgets it."""
        self._te.unregister_memory(region)
        mv = self._keep.pop(region, None)
        if mv is not None:
            mv.release()

    def batch_write(
        self, host: str, port: int, region: int, offsets: Sequence[int], buffers: Sequence
    ) -> None:
        """Writes ``buffers[i]`` at ``offsets[i]`` of the peer's region (bytes)."""
        offsets = _check_peer_op("batch_write", host, port, region, offsets)
        self._te.batch_write(host, port, region, offsets, list(buffers))

    def batch_read(
        self, host: str, port: int, region: int, offsets: Sequence[int], buffers: Sequence
    ) -> None:
        """Fills each writable ``buffers[i]`` from ``offsets[i]`` of the peer's region."""
        offsets = _check_peer_op("batch_read", host, port, region, offsets)
        self._te.batch_read(host, port, region, offsets, list(buffers))

    def batch_read_bytes(
        self, host: str, port: int, region: int, offsets: Sequence[int], lens: Sequence[int]
    ) -> list:
        """Reads ``lens[i]`` bytes at ``offsets[i]`` of the peer's region into new ``bytes``."""
        offsets = _check_peer_op("batch_read_bytes", host, port, region, offsets)
        lens = _check_counts(
            "batch_read_bytes", "lens", lens, bits=63
        )  # a bytes object's largest size
        return self._te.batch_read_bytes(host, port, region, offsets, lens)

    def close(self) -> None:
        """Stops the server and closes connections (idempotent)."""
        self._closed = True
        self._te.close()
        for mv in self._keep.values():
            mv.release()
        self._keep.clear()


def _check_counts(op: str, what: str, values: Sequence, bits: int = 64) -> list:
    values = list(values)
    for v in values:
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 1 << bits:
            raise ValueError(
                f"TransferEngine.{op}: {what} must be whole numbers of bytes in 0..2**{bits}-1, got {v!r}"
            )
    return values


def _check_peer_op(op: str, host, port, region, offsets) -> list:
    """The checks of a batch's arguments, before anything is sent; returns the offsets as a list.

    Raises ``ValueError``.
    """
    if not isinstance(host, str) or not host:
        raise ValueError(f"TransferEngine.{op}: host must be a non-empty str, got {host!r}")
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        raise ValueError(f"TransferEngine.{op}: port must be 1..65535, got {port!r}")
    if not isinstance(region, int) or isinstance(region, bool) or not 0 <= region < 1 << 32:
        raise ValueError(
            f"TransferEngine.{op}: region must be a region id in 0..2**32-1, got {region!r}"
        )
    return _check_counts(op, "offsets", offsets)


def copy_buffers(dsts: Sequence, srcs: Sequence, threads: int = 0) -> None:
    """Copies ``srcs[i]`` into ``dsts[i]`` (equal sizes; writable destinations), GIL released.

    Large copies are spread over ``threads`` threads (0: one per CPU, at most 4).
    """
    _C.copy_buffers(list(dsts), list(srcs), _threads(threads))


def copy_to_bytes(srcs: Sequence, threads: int = 0) -> list:
    """New ``bytes`` objects with the contents of ``srcs`` (one parallel copy each)."""
    return _C.copy_to_bytes(list(srcs), _threads(threads))


def touch_pages(buffer) -> int:
    """Reads one byte of every page of ``buffer`` with the GIL released; returns the pages read.

    The contents are unchanged. Memory idle for about a second costs ~0.5 us per 4 KiB page at its
    next access on VMs; this pays that ahead of a copy, on another thread.
    """
    return _C.touch_pages(buffer)


def _threads(threads: int) -> int:
    return threads if threads > 0 else max(1, min(4, _C.available_cpus()))
