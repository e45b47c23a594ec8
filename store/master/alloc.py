"""Best-fit allocator over one segment's byte range (metadata only, no memory touched).

Free blocks are kept twice: sorted by (size, offset) for best-fit lookup by bisection,
and by start and end offset for coalescing on free. Sizes are rounded up to ``ALIGN``
(``common/layout.py``).
"""

from __future__ import annotations

import bisect

from ..common.layout import ALIGN, aligned


class Allocator:
    """Allocates ranges of ``[base, base + size)``."""

    def __init__(self, size: int, base: int = 0):
        self.base = base
        self.size = size
        self.used = 0
        self._by_size: list[tuple[int, int]] = []
        self._start: dict[int, int] = {}
        self._end: dict[int, int] = {}
        if size > 0:
            self._insert(base, size)

    def _insert(self, off: int, n: int):
        bisect.insort(self._by_size, (n, off))
        self._start[off] = n
        self._end[off + n] = off

    def _remove(self, off: int, n: int):
        i = bisect.bisect_left(self._by_size, (n, off))
        del self._by_size[i]
        del self._start[off]
        del self._end[off + n]

    def alloc(self, n: int) -> int | None:
        """Offset of a free range of ``aligned(n)`` bytes, or ``None`` if none is large enough."""
        n = aligned(n)
        i = bisect.bisect_left(self._by_size, (n, -1))
        if i == len(self._by_size):
            return None
        size, off = self._by_size[i]
        self._remove(off, size)
        if size > n:
            self._insert(off + n, size - n)
        self.used += n
        return off

    def free(self, off: int, n: int) -> None:
        """Returns ``[off, off + aligned(n))`` to the free blocks (coalescing neighbours)."""
        n = (n + ALIGN - 1) & ~(ALIGN - 1)  # aligned(n), inline: every remove frees
        self.used -= n
        prev = self._end.get(off)
        if prev is not None:
            psize = self._start[prev]
            self._remove(prev, psize)
            off, n = prev, n + psize
        nsize = self._start.get(off + n)
        if nsize is not None:
            self._remove(off + n, nsize)
            n += nsize
        self._insert(off, n)

    def rebuild(self, used: list[tuple[int, int]]) -> None:
        """Resets to exactly the ``(offset, size)`` ranges in ``used`` being allocated.

        Used after a leader change. Raises ``ValueError`` on overlaps or out-of-range ranges.
        """
        self._by_size, self._start, self._end = [], {}, {}
        self.used = 0
        pos = self.base
        for off, n in sorted((o, aligned(s)) for o, s in used if s > 0):
            if off < pos or off + n > self.base + self.size:
                raise ValueError(
                    f"allocation [{off}, {off + n}) overlaps another or leaves the segment"
                )
            if off > pos:
                self._insert(pos, off - pos)
            pos = off + n
            self.used += n
        if pos < self.base + self.size:
            self._insert(pos, self.base + self.size - pos)

    def free_spans(self) -> list[tuple[int, int]]:
        """The free blocks as ``(offset, bytes)``, in no particular order."""
        return list(self._start.items())

    def largest_free(self) -> int:
        """Bytes of the largest free block (0 when nothing is free)."""
        return self._by_size[-1][0] if self._by_size else 0
