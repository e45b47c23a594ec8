"""Shared-memory segments: the memory a client contributes, and mappings of other
clients' segments on the same host.

A segment is a memfd (anonymous: nothing to unlink, a SIGKILL leaks nothing) that other
processes of the host open through ``/proc/<owner pid>/fd/<fd>``. Its first
``SEG_HEADER`` bytes hold a magic and a random token, which a reader checks after
mapping (a recycled pid cannot hand it someone else's memory).
"""
from __future__ import annotations

import mmap
import os
import threading

from .core import SEG_HEADER
from .errors import TransferError

MAGIC = b"MCSTSEG1"


class LocalSegment:
    """``size`` bytes of shared memory owned by this process."""

    def __init__(self, name: str, size: int, prefault: bool = True):
        self.name = name
        self.size = size
        self.token = os.urandom(16)
        self.fd = os.memfd_create(f"mooncake-store-{name}"[:200], os.MFD_CLOEXEC)
        os.ftruncate(self.fd, size)
        self.mm = _map(self.fd, size, prefault, writable=True)
        self.mm[0:len(MAGIC) + 16] = MAGIC + self.token
        self.view = memoryview(self.mm)

    def desc(self, host_id: str, te) -> dict:
        return {"size": self.size, "path": f"/proc/{os.getpid()}/fd/{self.fd}", "token": self.token.hex(),
                "host": host_id, "te": te, "base": SEG_HEADER}

    def close(self):
        try:
            self.view.release()
            self.mm.close()
        except (BufferError, ValueError):
            pass  # an exported buffer (transfer engine registration) keeps it open until exit
        try:
            os.close(self.fd)
        except OSError:
            pass


_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14+


def _map(fd: int, size: int, prefault: bool, writable: bool) -> mmap.mmap:
    """Maps ``fd`` shared. With ``prefault``, every page is allocated and mapped now
    instead of one fault per 4 KiB page during the first copies: writable mappings with
    ``MADV_POPULATE_WRITE`` (``MAP_POPULATE`` maps shared pages read-only first, and the
    first write to each page then still faults: a first 1 MiB write measured 274 us
    against 63 us), read-only ones (and kernels before 5.14) with ``MAP_POPULATE``."""
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    if prefault and writable:
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)
        try:
            mm.madvise(_MADV_POPULATE_WRITE)
            return mm
        except (OSError, ValueError):
            mm.close()
    flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if prefault else 0)
    return mmap.mmap(fd, size, flags=flags, prot=prot)


class MappedSegment:
    """A same-host segment of another process, mapped read/write (or read-only: a write
    through it kills the process with SIGSEGV instead of changing the owner's bytes)."""

    def __init__(self, desc: dict, prefault: bool = True, readonly: bool = False):
        path, size, token = desc["path"], int(desc["size"]), bytes.fromhex(desc["token"])
        try:
            with open(path, "rb" if readonly else "r+b") as f:
                self.mm = _map(f.fileno(), size, prefault, writable=not readonly)
        except (OSError, ValueError) as e:
            raise TransferError(f"cannot map segment {desc.get('name')!r} at {path}: {e}") from None
        if self.mm[0:len(MAGIC) + 16] != MAGIC + token:
            self.mm.close()
            raise TransferError(f"segment {desc.get('name')!r} at {path} is not the registered one (owner gone)")
        self.view = memoryview(self.mm)
        self.size = size

    def close(self):
        try:
            self.view.release()
            self.mm.close()
        except (BufferError, ValueError):
            pass


class SegmentCache:
    """Mappings of same-host segments by name, opened on first use."""

    def __init__(self, prefault: bool = True, readonly: bool = False):
        self.prefault = prefault
        self.readonly = readonly
        self._maps: dict[str, MappedSegment] = {}
        self._lock = threading.Lock()

    def get(self, desc: dict) -> MappedSegment:
        name = desc["name"]
        m = self._maps.get(name)
        if m is not None and m.desc_token == desc["token"]:
            return m
        with self._lock:
            m = self._maps.get(name)
            if m is None or m.desc_token != desc["token"]:
                m = MappedSegment(desc, self.prefault, self.readonly)
                m.desc_token = desc["token"]
                old = self._maps.get(name)
                self._maps[name] = m
                if old is not None:
                    old.close()
        return m

    def retain(self, live: set):
        """Unmaps segments that are no longer registered."""
        with self._lock:
            for name in [n for n in self._maps if n not in live]:
                self._maps.pop(name).close()

    def close(self):
        self.retain(set())
