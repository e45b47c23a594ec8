"""The client's data plane: where its bytes live and how they move.

This client's own segment, mappings of the other segments of its host (copied into directly), the
TCP transfer engine for segments of other hosts (``mooncake_pg.transfer.TransferEngine``) and the
C++ extension's parallel copies.
"""

from __future__ import annotations

import os
import sys
import threading

from ..common.config import parse_hostport
from ..common.errors import TransferError
from .config import StoreConfig
from .segment import LocalSegment, SegmentCache

# copies from this size on go through the parallel C++ copy
FAST_COPY_BYTES = 64 << 10


class DataPlane:
    """The segments this client reads and writes, and the transfer engine.

    Attributes:
        segment: this client's own segment (``LocalSegment``), None with
            ``segment_size=0``.
        te: the transfer engine (``TransferEngine``), None until one is needed (it serves
            this client's segment from the start with ``serve_tcp``).
        fast: ``mooncake_pg.transfer`` (parallel copies, page warm-up) when the C++
            extension is loaded, else None (plain memoryview copies).

    Raises ``ValueError`` (a segment larger than the machine's memory with ``prefault``),
    ``OSError`` (no shared memory for the segment) and the transfer engine's errors.
    """

    def __init__(self, cfg: StoreConfig):
        self.cfg = cfg
        self.segment: LocalSegment | None = None
        self.te = None
        self.fast = None
        self._te_region = None
        self._maps = SegmentCache(prefault=cfg.prefault)
        self._ro_maps = SegmentCache(prefault=cfg.prefault, readonly=True)  # local_views'
        self._lock = threading.Lock()  # starts the transfer engine once
        try:
            if cfg.segment_size:
                phys = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
                if (
                    cfg.prefault and cfg.segment_size > phys
                ):  # it would be committed at once, until memory ran out
                    raise ValueError(
                        f"segment_size of {cfg.segment_size} bytes is more than this machine's memory "
                        f"({phys} bytes), and prefault commits it at start"
                    )
                self.segment = LocalSegment(
                    cfg.name, cfg.segment_size, prefault=cfg.prefault, huge_pages=cfg.huge_pages
                )
            if cfg.serve_tcp or cfg.transfer == "tcp":
                self._start_te(serve=cfg.serve_tcp and self.segment is not None)
            if self.te is not None or "torch" in sys.modules:
                try:
                    from mooncake_pg import transfer as fast

                    self.fast = fast
                except ImportError:  # the extension is not built: plain memoryview copies
                    pass
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ segments
    def segment_desc(self) -> dict | None:
        """The descriptor of this client's segment that the master hands to readers and writers.

        None without a segment.
        """
        if self.segment is None:
            return None
        return self.segment.desc(self.cfg.host_id, self.te_desc())

    def te_desc(self) -> list | None:
        """``[host, port, region]`` where the transfer engine serves this client's segment, or None.

        None: clients of other hosts cannot reach it.
        """
        if self.te is None or self._te_region is None:
            return None
        return [self.te.host, self.te.port, self._te_region]

    def is_local(self, desc: dict) -> bool:
        """Whether the segment of ``desc`` is mapped and copied directly (same host)."""
        return self.cfg.transfer == "auto" and desc.get("host") == self.cfg.host_id

    def view(self, desc: dict) -> memoryview:
        """A writable view of a segment of this host (this client's own, or mapped).

        ``TransferError`` when it cannot be mapped (its owner is gone).
        """
        if self.segment is not None and desc["name"] == self.cfg.name:
            return self.segment.view
        return self._maps.get(desc).view

    def readonly_view(self, desc: dict) -> memoryview:
        """A read-only view of a segment of this host, this client's own included.

        A view handed out must not be writable in the owner either.
        """
        return self._ro_maps.get(desc).view

    def retain(self, live: set) -> None:
        """Unmaps the segments not in ``live`` (the master's segment names)."""
        self._maps.retain(live)
        self._ro_maps.retain(live)

    # ------------------------------------------------------------------ copies
    def engine_for(self, desc: dict) -> tuple:
        """``(host, port, region)`` of the transfer engine serving another host's segment.

        The segment is ``desc``'s. Starts this client's engine (as a client only) if needed.
        ``TransferError`` when that segment serves none.
        """
        te = desc.get("te")
        if not te:
            raise TransferError(
                f"segment {desc['name']!r} is on another host and serves no transfer engine"
            )
        if self.te is None:
            with self._lock:
                if self.te is None:
                    self._start_te(serve=False)
        return te

    def copy(self, dsts: list, srcs: list) -> None:
        """Copies each of ``srcs`` into the view of the same index in ``dsts``."""
        if self.fast is not None and sum(len(v) for v in srcs) >= FAST_COPY_BYTES:
            self.fast.copy_buffers(dsts, srcs)
        else:
            for d, v in zip(dsts, srcs):
                d[:] = v

    def to_bytes(self, srcs: list) -> list:
        """A new ``bytes`` of each view in ``srcs``."""
        if self.fast is not None and sum(len(v) for v in srcs) >= FAST_COPY_BYTES:
            return self.fast.copy_to_bytes(srcs)
        return [bytes(v) for v in srcs]

    def write(self, jobs: list, segs: dict) -> None:
        """Writes ``jobs``: same-host segments in one parallel copy, others through the engine.

        ``jobs`` is ``[(segment name, offset, view)]``; ``segs``: name -> descriptor. Raises
        ``TransferError``; its ``segment`` names a segment that could not be reached (the put is
        placed again elsewhere).
        """
        remote: dict = {}
        dsts, srcs = [], []
        for name, off, mv in jobs:
            desc = segs[name]
            if len(mv) == 0:
                continue
            if self.is_local(desc):
                try:
                    view = self.view(desc)
                except TransferError as e:
                    e.segment = name  # its owner is gone: the put is placed again elsewhere
                    raise
                if off + len(mv) > len(view):
                    raise TransferError(f"write to segment {name!r} at {off} leaves the segment")
                dsts.append(view[off : off + len(mv)])
                srcs.append(mv)
            else:
                remote.setdefault(name, []).append((off, mv))
        if dsts:
            self.copy(dsts, srcs)
        for name, items in remote.items():
            host, port, region = self.engine_for(segs[name])
            try:
                self.te.batch_write(
                    host, port, region, [o for o, _ in items], [m for _, m in items]
                )
            except RuntimeError as e:
                err = TransferError(f"write to segment {name!r} at {host}:{port} failed: {e}")
                err.segment = name
                raise err from None

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Stops the transfer engine and unmaps every segment (this client's own last)."""
        if self.te is not None:
            self.te.close()
            self.te = None
        self._maps.close()
        self._ro_maps.close()
        if self.segment is not None:
            self.segment.close()
            self.segment = None

    def _start_te(self, serve: bool) -> None:
        from mooncake_pg.transfer import TransferEngine

        host = ""
        if serve:
            host = self.cfg.listen_host
            if host is None:
                mhost = (
                    parse_hostport(self.cfg.master, "master")[0] if self.cfg.master else "127.0.0.1"
                )
                host = TransferEngine.local_address_for(mhost, self.cfg.ifname or "")
        self.te = TransferEngine(listen_host=host, secret=self.cfg.secret or "")
        if serve:
            self._te_region = self.te.register_memory(self.segment.view)
