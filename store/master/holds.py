"""Holds in the master's metadata core: objects a client asks to stay where they are.

A client asks that some objects stay where they
are for a while (``hold``): they are not evicted, nor dropped with an evicted ancestor,
until the hold is released (``release``), its TTL ends or its client dies. A hold does not
stop a forced ``remove`` nor ``invalidate``. Holds are not written to etcd: a new leader
knows none.
"""

from __future__ import annotations

import heapq

from ..common.errors import ProtocolError
from .records import Client, Records

MAX_HOLD_TTL_S = 3600.0


class Holds:
    """The holds of every client (``Records.held``: key -> number of holds on it)."""

    def __init__(self, records: Records):
        self.records = records
        self._holds: dict = {}  # hold id -> (until, client id, keys)
        self._expiry: list = []  # heap of (until, hold id)

    def __len__(self) -> int:
        return len(self._holds)

    def hold(self, a: dict) -> dict:
        """The ``hold`` request: holds the committed objects of ``keys`` for ``ttl_s`` seconds.

        Keys without a committed object are ignored; ``ttl_s`` is in (0, 3600].

        Returns:
            ``{"id": hold id, "held": how many of the keys were held}``.

        Raises:
            ProtocolError: malformed arguments.
        """
        rec = self.records
        c = rec.client(a.get("client"))
        keys = rec.check_keys(a.get("keys"))
        ttl = a.get("ttl_s")
        if not (
            isinstance(ttl, (int, float))
            and not isinstance(ttl, bool)
            and 0 < ttl <= MAX_HOLD_TTL_S
        ):
            raise ProtocolError(f"hold: ttl_s must be a number in (0, {MAX_HOLD_TTL_S:g}]")
        keys = [k for k in dict.fromkeys(keys) if k in rec.objects]
        hid = rec.next_version()  # unique, and above any id an earlier master handed out
        until = rec.clock() + float(ttl)
        for k in keys:
            rec.held[k] = rec.held.get(k, 0) + 1
        self._holds[hid] = (until, c.id, keys)
        heapq.heappush(self._expiry, (until, hid))
        rec.counters.holds += 1
        return {"id": hid, "held": len(keys)}

    def release(self, a: dict) -> dict:
        """The ``release`` request: ends hold ``id``.

        Returns:
            ``{"released": False}`` when this master knows no such hold (released, expired, or
            taken from another leader), else ``{"released": True}``.
        """
        hid = a.get("id")
        if not isinstance(hid, int) or isinstance(hid, bool):
            raise ProtocolError("release: id must be an int")
        return {"released": self._end(hid)}

    def _end(self, hid: int) -> bool:
        h = self._holds.pop(hid, None)
        if h is None:
            return False
        held = self.records.held
        for k in h[2]:
            n = held.get(k, 0) - 1
            if n > 0:
                held[k] = n
            else:
                held.pop(k, None)
        return True

    def expire(self, now: float) -> None:
        """Ends the holds whose TTL has run out."""
        while self._expiry and self._expiry[0][0] <= now:
            _, hid = heapq.heappop(self._expiry)
            self._end(hid)

    def drop_client(self, c: Client) -> None:
        """Ends the holds of client ``c`` (it died or left)."""
        for hid in [h for h, v in self._holds.items() if v[1] == c.id]:
            self._end(hid)
