"""The segment layout that clients and the master agree on.

A segment's first ``SEG_HEADER`` bytes hold its header: ``MAGIC`` and a random token,
which a reader checks after mapping it (``client/segment.py``); the master places objects
after it. Every allocation in a segment is a multiple of ``ALIGN`` bytes: the master's
allocator rounds sizes up with :func:`aligned`, and a client that fills its put
reservation lays its objects back to back at those sizes (``Core.put``).
"""

from __future__ import annotations

SEG_HEADER = 4096  # bytes at the start of every segment kept for its header (magic + token)
MAGIC = b"MCSTSEG1"
ALIGN = 64


def aligned(n: int) -> int:
    """``n`` rounded up to a multiple of ``ALIGN``."""
    return (n + ALIGN - 1) & ~(ALIGN - 1)
