"""The order in which the master evicts objects from memory (``MasterConfig.eviction_policy``).

``"lru"``: least recently used first (``Records.lru``). ``"lfu"``: least frequently used
first, with dynamic aging (LFU-DA): an object's priority is the priority of the last object
evicted when it was last used, plus how often it was used, so objects used often stay
while objects used often long ago age out. Under either policy an object's ancestors
(``parent`` links) go after it: a get or put orders them after their descendants, and an
eviction that would drop a parent drops what hangs off it with it, so no chunk outlives
its prefix.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

POLICIES = ("lru", "lfu")


class LfuOrder:
    """LFU with dynamic aging over the committed objects that have a memory replica.

    Kept as a heap of ``(priority, sequence, key)`` with lazy deletion: an entry counts only
    while its sequence is the key's latest. Objects without a memory replica (on SSD only,
    empty) leave the heap when an eviction pass meets them and come back at their next use
    or load.
    """

    def __init__(self):
        self.uses: dict[str, int] = {}
        self.prio: dict[str, float] = {}
        self.seq: dict[str, int | None] = {}
        self.heap: list = []
        self.level = 0.0  # the priority of the last object evicted
        self._n = 0

    def _push(self, key: str) -> None:
        self._n += 1
        self.seq[key] = self._n
        heapq.heappush(self.heap, (self.prio[key], self._n, key))
        if len(self.heap) > 2 * len(self.seq) + 1024:
            self.heap = [(self.prio[k], n, k) for k, n in self.seq.items() if n is not None]
            heapq.heapify(self.heap)

    def add(self, key: str) -> None:
        """A committed object enters with one use."""
        self.uses[key] = 1
        self.prio[key] = self.level + 1
        self._push(key)

    def use(self, key: str, count: bool = True) -> None:
        """A use of ``key``: its priority is the current level plus its uses.

        ``count``: one more use (a read); False: the uses stay, only the level is the current
        one (a lookup before the read, a put under this prefix), so that the object is not
        evicted first between the lookup and the read.
        """
        if key in self.uses:
            if count:
                self.uses[key] += 1
            self.prio[key] = self.level + self.uses[key]

    def push(self, key: str) -> None:
        """Puts ``key`` (back) in the order, after the keys of equal priority pushed before."""
        if key in self.uses:
            self._push(key)

    def remove(self, key: str) -> None:
        """``key``'s committed object is gone."""
        self.uses.pop(key, None)
        self.prio.pop(key, None)
        self.seq.pop(key, None)

    def evicted(self, key: str) -> None:
        """``key``'s memory replicas are evicted: the level rises to its priority."""
        p = self.prio.get(key)
        if p is not None and p > self.level:
            self.level = p

    def candidates(self, objects: dict) -> Iterator[str]:
        """Keys in eviction order, lowest priority first, among objects with a memory replica.

        Keys the caller did not evict go back into the order when the iteration ends (the
        caller breaks out of it or exhausts it).
        """
        taken = []
        try:
            while self.heap:
                p, n, key = heapq.heappop(self.heap)
                if self.seq.get(key) != n:
                    continue
                o = objects.get(key)
                if o is None or not o.repl:
                    self.seq[key] = None  # out of the order until its next use or load
                    continue
                taken.append((p, n, key))
                yield key
        finally:
            for entry in taken:
                if self.seq.get(entry[2]) == entry[1]:
                    heapq.heappush(self.heap, entry)
