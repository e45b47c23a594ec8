"""Shared-memory segments: the memory a client contributes, and mappings of same-host segments.

The mappings are of other clients' segments on the same host.

A segment is a memfd (anonymous: nothing to unlink, a SIGKILL leaks nothing) that other
processes of the host open through ``/proc/<owner pid>/fd/<fd>``. Its first
``SEG_HEADER`` bytes hold a magic and a random token (``common/layout.py``), which a reader
checks after mapping (a recycled pid cannot hand it someone else's memory).
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading

from ..common.errors import TransferError
from ..common.layout import MAGIC, SEG_HEADER


class LocalSegment:
    """``size`` bytes of shared memory owned by this process.

    See :func:`_map` for how they are mapped; ``huge_bytes`` of them are backed by 2 MiB pages.
    """

    def __init__(self, name: str, size: int, prefault: bool = True, huge_pages: bool = True):
        self.name = name
        self.size = size
        self.token = os.urandom(16)
        self.fd = os.memfd_create(f"mooncake-store-{name}"[:200], os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self.view, self.huge_bytes = _map(
                self.fd, size, prefault, writable=True, huge_pages=huge_pages
            )
        except OSError as e:
            os.close(self.fd)
            raise OSError(
                e.errno, f"cannot create a segment of {size} bytes (segment_size): {e.strerror}"
            ) from None
        self.all_huge = (
            size >= _HUGE and self.huge_bytes == size // _HUGE * _HUGE
        )  # all but a tail < 2 MiB
        self.view[0 : len(MAGIC) + 16] = MAGIC + self.token

    def desc(self, host_id: str, te: list | None) -> dict:
        """The segment's descriptor for the master: size, ``/proc`` path, token, host, engine.

        ``host_id`` is this host's id, ``te`` where the transfer engine serves the segment (or
        None); the data starts after the ``SEG_HEADER`` bytes of header (``base``).
        """
        return {
            "size": self.size,
            "path": f"/proc/{os.getpid()}/fd/{self.fd}",
            "token": self.token.hex(),
            "host": host_id,
            "te": te,
            "base": SEG_HEADER,
        }

    def close(self) -> None:
        """Releases this process's view and closes the memfd.

        The memory is unmapped once no view of it is left (a transfer engine registration keeps one
        until it is unregistered).
        """
        _release(self.view)
        try:
            os.close(self.fd)
        except OSError:
            pass


def _release(view: memoryview):
    try:
        view.release()
    except BufferError:
        pass  # a buffer taken straight from it is still in use: unmapped when that goes


_MADV_POPULATE_READ, _MADV_POPULATE_WRITE = 22, 23  # Linux 5.14+
_MADV_HUGEPAGE, _MADV_COLLAPSE = 14, 25  # MADV_COLLAPSE: Linux 6.1+
_HUGE = 2 << 20  # bytes of one PMD-mapped page on x86-64 and arm64 (4 KiB base pages)
_PROT_NONE, _PROT_READ, _PROT_WRITE = 0, 1, 2
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS = 0x01, 0x02, 0x10, 0x20
_MAP_FAILED = ctypes.c_void_p(-1).value
_libc = None


def _lib():
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        lib.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        _libc = lib
    return _libc


def _madvise(addr: int, n: int, advice: int) -> bool:
    return _lib().madvise(addr, n, advice) == 0


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt(3) parameters (<malloc.h>)
MALLOC_MMAP_THRESHOLD = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
MALLOC_TRIM_THRESHOLD = 2 * MALLOC_MMAP_THRESHOLD
_malloc_tuned = False


def tune_malloc() -> bool:
    """Sets glibc malloc's mmap threshold to 32 MiB and its trim threshold to 64 MiB, once.

    It sets them for this process (``mallopt(3)``); returns whether they are set (``False``: not
    glibc, or the user set either threshold: ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``,
    or ``glibc.malloc.mmap_threshold`` / ``glibc.malloc.trim_threshold`` in ``GLIBC_TUNABLES``,
    which win).

    Why: every ``get`` returns new ``bytes``. With glibc's defaults, a batch of 16 x 1 MiB
    values freed together is more free heap than the trim threshold (twice the adaptive
    mmap threshold, here 2 MiB), so it goes back to the kernel and the next batch's values
    take fresh pages: a page fault and zeroing per 4 KiB. Measured on the 2-core CI VM
    (``store_bench``, one client, batch get of 1 MiB values on one host): 3.86 GiB/s with
    the defaults, 7.12 GiB/s with these values. They are the values glibc's adaptive
    threshold itself reaches once a process frees a 32 MiB block (glibc ``malloc.c``,
    ``DEFAULT_MMAP_THRESHOLD_MAX``): blocks of 128 KiB to 32 MiB come from the heap from
    the start, and the process keeps up to 64 MiB of freed heap for reuse.
    """
    global _malloc_tuned
    if _malloc_tuned:
        return True
    env = os.environ
    tunables = env.get("GLIBC_TUNABLES", "")
    if (
        env.get("MALLOC_MMAP_THRESHOLD_")
        or env.get("MALLOC_TRIM_THRESHOLD_")
        or "glibc.malloc.mmap_threshold" in tunables
        or "glibc.malloc.trim_threshold" in tunables
    ):
        return False
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return False
    except (ValueError, OSError):  # not glibc
        return False
    lib = _lib()
    _malloc_tuned = (
        lib.mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD) == 1
        and lib.mallopt(_M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD) == 1
    )
    return _malloc_tuned


class _Mapping:
    """Owns ``[addr, addr + size)``: unmapped when the last view of it is released."""

    def __init__(self, addr: int, size: int):
        self.addr, self.size = addr, size

    def view(self, readonly: bool) -> memoryview:
        arr = (ctypes.c_char * self.size).from_address(self.addr)
        arr._owner = self  # the array (held by every view cast from it) keeps the mapping
        mv = memoryview(arr).cast("B")
        return mv.toreadonly() if readonly else mv

    def __del__(self):
        _lib().munmap(self.addr, self.size)


def _map(fd: int, size: int, prefault: bool, writable: bool, huge_pages: bool = False) -> tuple:
    """Maps ``fd`` (``size`` bytes, shared) at a 2 MiB-aligned address.

    Returns ``(memoryview, huge_bytes)``. The view is read-only unless ``writable``; the memory is
    unmapped once every view of it is released.

    ``huge_pages`` (the owner, at creation, with ``prefault``): the segment's pages become
    2 MiB pages with ``MADV_COLLAPSE`` (Linux 6.1+; it works whatever
    ``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` says, except ``deny``);
    ``huge_bytes`` is how many bytes were collapsed (0 where the kernel refuses). Other
    processes that map the segment at an aligned address map those pages whole too. On
    VMs (the 2-core CI VM among them) memory in 4 KiB pages nobody touched for about a
    second costs 0.5 to several us per page at its next access; in 2 MiB pages it does
    not: a 1 MiB copy into a segment idle for 2 s measured 840-1300 us with 4 KiB pages
    and 52-57 us with 2 MiB pages (60-65 us into memory in use), both for writes and for
    reads through another process's mapping. Collapsing costs ~0.2 s per GiB at start.

    With ``prefault``, every page is then allocated and mapped now instead of one fault
    per page during the first copies: writable mappings with ``MADV_POPULATE_WRITE``
    (a shared page populated for reading is mapped read-only, and the first write to it
    faults again: a first 1 MiB write measured 274 us against 63 us), read-only ones with
    ``MADV_POPULATE_READ``. Raises ``OSError``.
    """
    lib = _lib()
    prot = _PROT_READ | (_PROT_WRITE if writable else 0)
    span = size + _HUGE
    res = lib.mmap(None, span, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS, -1, 0)
    if res in (None, _MAP_FAILED):
        e = ctypes.get_errno()
        raise OSError(e, f"mmap of {span} bytes: {os.strerror(e)}")
    addr = (res + _HUGE - 1) & ~(_HUGE - 1)
    got = lib.mmap(addr, size, prot, _MAP_SHARED | _MAP_FIXED, fd, 0)
    if got != addr:
        e = ctypes.get_errno()
        lib.munmap(res, span)
        raise OSError(e, f"mmap of {size} bytes: {os.strerror(e)}")
    if addr > res:
        lib.munmap(res, addr - res)
    end = (addr + size + 4095) & ~4095
    if res + span > end:
        lib.munmap(end, res + span - end)
    m = _Mapping(addr, size)
    huge = 0
    if huge_pages and prefault and writable:
        _madvise(
            addr, size, _MADV_HUGEPAGE
        )  # faults then allocate 2 MiB pages where the kernel allows it
        for off in range(0, size - _HUGE + 1, _HUGE):
            ctypes.memset(
                addr + off, 0, 1
            )  # one page present per 2 MiB: the collapse fills in the rest
            if _madvise(addr + off, _HUGE, _MADV_COLLAPSE):
                huge += _HUGE
            elif ctypes.get_errno() == errno.EINVAL:
                break  # not supported here (before Linux 6.1, shmem_enabled "deny"): the first try tells
            # else no free 2 MiB page just now (EAGAIN, ENOMEM): this one stays in 4 KiB pages
    if prefault and not _madvise(
        addr, size, _MADV_POPULATE_WRITE if writable else _MADV_POPULATE_READ
    ):
        # before Linux 5.14: read one byte per page (never write: the owner may be writing there)
        page = os.sysconf("SC_PAGESIZE")
        buf = (ctypes.c_char * size).from_address(addr)
        for off in range(0, size, page):
            buf[off]
    return m.view(readonly=not writable), huge


class MappedSegment:
    """A same-host segment of another process, mapped read/write (or read-only).

    Read-only: a write through it kills the process with SIGSEGV instead of changing the owner's
    bytes.
    """

    def __init__(self, desc: dict, prefault: bool = True, readonly: bool = False):
        path, size, token = desc["path"], int(desc["size"]), bytes.fromhex(desc["token"])
        try:
            with open(path, "rb" if readonly else "r+b") as f:
                self.view, _ = _map(f.fileno(), size, prefault, writable=not readonly)
        except (OSError, ValueError) as e:
            raise TransferError(f"cannot map segment {desc.get('name')!r} at {path}: {e}") from None
        if self.view[0 : len(MAGIC) + 16] != MAGIC + token:
            self.view.release()
            raise TransferError(
                f"segment {desc.get('name')!r} at {path} is not the registered one (owner gone)"
            )
        self.size = size

    def close(self) -> None:
        """Releases this mapping's view."""
        _release(self.view)  # unmapped once views handed out of it are released too


class SegmentCache:
    """Mappings of same-host segments by name, opened on first use."""

    def __init__(self, prefault: bool = True, readonly: bool = False):
        self.prefault = prefault
        self.readonly = readonly
        self._maps: dict[str, MappedSegment] = {}
        self._lock = threading.Lock()

    def get(self, desc: dict) -> MappedSegment:
        """The mapping of the segment ``desc`` describes, opened on first use.

        A mapping whose token differs from ``desc``'s (the name was registered again) is replaced
        and closed.
        """
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

    def retain(self, live: set) -> None:
        """Unmaps segments that are no longer registered."""
        with self._lock:
            for name in [n for n in self._maps if n not in live]:
                self._maps.pop(name).close()

    def close(self) -> None:
        """Unmaps every segment."""
        self.retain(set())
