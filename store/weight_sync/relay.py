"""Weight sync across hosts: one pull per host, and hosts that pass the buckets on in a chain.

The hosts pass the buckets on to each other (``WeightSyncConfig.relay``; docs/weight-sync.md "Across
hosts").

A reader whose version's pieces lie on another host takes a role per pull:

* **relay** of its host: the first reader of the version there. It claims the host (a
  plain put of ``ws/M/v<v>/relay/h<host>``) and then the first free chain position
  ``relay/c<k>``; both are one-byte objects in its own segment, so they go away with it
  (the master drops a dead client's segment after ``client_ttl_s``). It reads each bucket
  in parts (``WeightSyncConfig.relay_part_bytes``), each from the relay at position k-1
  as soon as that one has it (position 0 from the publisher's pieces) straight into a
  copy in its own segment, ``<pid>/r<rid>/b<s>.<i>.p<j>`` (``rid``: its reader id, in its
  position record; placed before the read, committed right after it: no copy on the next
  host's path, which waits for one part, not the whole bucket), and copies them into its
  staging. Without room for a copy it steps down: its position record goes at once, its
  copies at the end of the pull.
* **follower**: another reader of a host that has a relay. It reads the relay's copies,
  which lie in memory on its host (a mapped segment: no network).
* **plain**: no relay on its host and none possible (no transfer engine serving its
  segment, a segment smaller than the version, or one without room for a copy: copies go
  to its own segment only): it reads from the newest relay.

Each reader reads from positions below its own only (a follower from its relay's), so the
chain has no cycle. A source whose position record is gone (dead, resigned after a
failure, or stepped down), whose copy cannot be read, or that has not had a part for
``relay_wait_s`` is left for the next one up, for that part and the rest; the publisher's
pieces come last. The bytes' checks are the reader's own (``pull.py``: every piece's
digest from the publisher's manifest, before anything is installed), so a relay never
changes what a reader installs, only where its bytes come from.

This follows checkpoint-engine's bucketed pipeline through a broadcast (each host link
carries the weights about once); the chain is its store-side form: a relay needs no
other reader to be alive, and readers may come at different times.
"""

from __future__ import annotations

import hashlib
import threading
import time
from typing import TYPE_CHECKING

import msgpack

from ..client import ReplicateConfig
from ..common.errors import ObjectExistsError, ObjectNotFoundError, StoreError, TransferError
from .common import _torch
from .config import WeightSyncConfig
from .records import ModelRecords

if TYPE_CHECKING:
    import torch

_ONE_BYTE = memoryview(b"\0")


# seconds a relay waits for the claim of a position below its own to be committed (a
# one-byte put: milliseconds, more on a loaded host)
_CLAIM_GRACE_S = 0.5

# chain positions a version may have (hosts reading it); the records of all are read at
# once (metadata from the master, one request)
MAX_POSITIONS = 256


def host_tag(host_id: str) -> str:
    """The part of a relay record's key naming a host.

    ``StoreConfig.host_id`` may hold any character.
    """
    return hashlib.sha1(host_id.encode()).hexdigest()[:16]


def position_keys(vp: str, n: int) -> list:
    """Keys of chain positions 0..n-1 of the version whose keys start with ``vp``."""
    return [f"{vp}relay/c{k}" for k in range(n)]


def part_ranges(nbytes: int, part_bytes: int) -> list:
    """``[(offset, size)]`` of the parts of a bucket of ``nbytes`` (> 0) bytes that relays pass on.

    The part size is ``part_bytes`` (``WeightSyncConfig.relay_part_bytes``).
    """
    return [(off, min(part_bytes, nbytes - off)) for off in range(0, nbytes, part_bytes)]


def copy_key(pp: str, rid: str, bucket_key: str, part: int) -> str:
    """The key of the copy of part ``part`` of ``bucket_key`` that the relay of reader ``rid`` made.

    ``bucket_key`` is ``<pp>b<s>.<i>``. Named by the reader, not its position: a reader that takes a
    position another one left may not overwrite copies that one still removes.
    """
    return f"{pp}r{rid}/{bucket_key[len(pp) :]}.p{part}"


def copy_keys(pp: str, rid: str, bucket_key: str, nbytes: int, part_bytes: int) -> list:
    """The keys of the copies of the parts of ``bucket_key`` that the relay of reader ``rid`` made.

    ``bucket_key`` holds ``nbytes``.
    """
    n = len(part_ranges(nbytes, part_bytes))
    return [copy_key(pp, rid, bucket_key, j) for j in range(n)]


def _rid_of(meta) -> str | None:
    """The reader id in a position record's metadata (None if it holds none)."""
    try:
        rec = msgpack.unpackb(meta, raw=False)
        return rec.get("rid") if isinstance(rec, dict) else None
    except Exception:
        return None


class RelayPull:
    """The relay side of one pull of one version (see the module docstring)."""

    def __init__(
        self,
        records: ModelRecords,
        cfg: WeightSyncConfig,
        rid: str,
        vp: str,
        pp: str,
        part_bytes: int,
    ):
        self.records, self.store, self.cfg, self.rid = records, records.store, cfg, rid
        self.vp, self.pp, self.part_bytes = vp, pp, part_bytes
        self.position: int | None = None  # this reader's chain position, as a relay
        # (position, reader id) of the relays to read from, nearest first; then the publisher
        self.sources: list = []
        self.own: list = []  # keys this reader put for this version
        # claims go to this reader's own segment alone (put_many's own_segment_only): a
        # copy in another host's segment would help nobody and take its space
        self._here = ReplicateConfig(preferred_segment=self.store.name, pin=True)
        # `own`, `sources` and `position`: the pull's two read threads and its caller
        self._lock = threading.Lock()
        self._stepped_down = False
        self.timeline = None  # the pull's PullTimeline (timeline.py), set by the puller

    def describe(self) -> str:
        """This reader's role and sources, for a pull's timeline."""
        role = "follower" if self.position is None else f"relay c{self.position}"
        src = ", ".join(f"c{j}" for j, _ in self.sources)
        return f"{role}, reads from {src + ', ' if src else ''}the publisher"

    def _mark(self, phase: str, detail: str) -> None:
        if self.timeline is not None:
            self.timeline.mark(phase, detail)

    @classmethod
    def start(
        cls,
        records: ModelRecords,
        cfg: WeightSyncConfig,
        rid: str,
        vp: str,
        pp: str,
        first_key: str,
        nbytes: int,
        part_bytes: int,
    ) -> RelayPull | None:
        """The role of reader ``rid`` for the version at ``vp``, or None when no relay is needed.

        Publish ``pp``, ``nbytes`` in its buckets, relayed in parts of ``part_bytes``; None when the
        publisher's pieces lie on this host (read in place, no relay).
        """
        store = records.store
        if store.internal.replica_is_local(first_key) is not False:
            return None
        self = cls(records, cfg, rid, vp, pp, part_bytes)
        tag = host_tag(store.cfg.host_id)
        n = MAX_POSITIONS
        host_claimed = False  # by another reader of this host (its put may still be going on)
        if store.internal.serves_transfers and store.cfg.segment_size >= nbytes:
            try:
                self._put_here(f"{vp}relay/h{tag}", _ONE_BYTE, {"rid": rid})
                for k in range(n):
                    try:
                        self._put_here(f"{vp}relay/c{k}", _ONE_BYTE, {"host": tag, "rid": rid})
                        self.position = k
                        break
                    except ObjectExistsError:
                        continue
                else:
                    self.resign()  # every position taken: follow
            except ObjectExistsError:
                host_claimed = True  # the host has a relay: follow it
            except StoreError:
                self.resign()  # no room here: read from the others
        recs = records.get_many(position_keys(vp, n))
        if self.position is not None:
            self.sources = self._claimed_below(self.position, recs)
            return self

        def ours(recs):  # this host's relay position, or None
            return next(
                (k for k, r in enumerate(recs) if isinstance(r, dict) and r.get("host") == tag),
                None,
            )

        top = ours(recs)
        # the host's relay may hold the host claim without its position yet (a loaded host
        # takes a while to put its claims: reading elsewhere meanwhile would cost the
        # publisher's link a copy), and a claim this reader found taken may not be visible
        # yet (as in _claimed_below)
        # (two master requests a try, the second for every position's record: the pause
        # grows, as the wait can last up to relay_wait_s)
        now = time.monotonic()
        deadline, grace = now + self.cfg.relay_wait_s, now + _CLAIM_GRACE_S
        pause = 0.005
        while top is None and time.monotonic() < deadline:
            if store.internal.metadata([f"{vp}relay/h{tag}"])[0] is None and not (
                host_claimed and time.monotonic() < grace
            ):
                break
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
            recs = records.get_many(position_keys(vp, n))
            top = ours(recs)
        top = len(recs) - 1 if top is None else top
        self.sources = [
            (j, recs[j].get("rid")) for j in range(top, -1, -1) if isinstance(recs[j], dict)
        ]
        return self

    def _claimed_below(self, position: int, recs: list) -> list:
        """``(position, reader id)`` of the relays below ``position``, nearest first.

        Claims take the first free position, so every one below this relay's was claimed when it
        claimed its own; a record not there yet is a claim still being written (readers start at
        once after a publish: a one-byte put between its two requests to the master), waited for up
        to ``_CLAIM_GRACE_S``; one still missing then is gone (its relay resigned meanwhile).
        Leaving a claim being written out would make this relay read from the one before it, or the
        publisher: another copy over that link.
        """
        rids = {j: r.get("rid") for j, r in enumerate(recs[:position]) if isinstance(r, dict)}
        missing = [j for j in range(position) if j not in rids]
        deadline = time.monotonic() + _CLAIM_GRACE_S
        pause = 0.002
        while missing and time.monotonic() < deadline:
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
            got = self.records.get_many([f"{self.vp}relay/c{j}" for j in missing])
            rids.update((j, g.get("rid")) for j, g in zip(missing, got) if isinstance(g, dict))
            missing = [j for j in missing if j not in rids]
        return [(j, rids[j]) for j in range(position - 1, -1, -1) if j in rids]

    def _put_here(self, key: str, value: memoryview, record: dict) -> None:
        """Puts a claim, ``value`` with ``record`` as its metadata, into this client's own segment.

        Raises ``ObjectExistsError`` when another reader claimed it first, ``NoSpaceError`` when the
        segment has no room for it.
        """
        self.store.internal.put_many(
            [key], [value], [msgpack.packb(record)], self._here, own_segment_only=True
        )
        with self._lock:
            self.own.append(key)

    def _wait(self, j: int, rid: str, ck: str) -> bool:
        """Whether the copy ``ck`` of the relay at position ``j`` (reader ``rid``) exists in time.

        In time: within ``relay_wait_s`` (False at once when that relay is gone: no record at ``j``,
        or another reader's, which took the position after it left).
        """
        ok = f"{self.vp}relay/c{j}"
        deadline = time.monotonic() + self.cfg.relay_wait_s
        pause = 0.001
        while True:
            have, alive = self.store.internal.metadata([ck, ok])
            if have is not None:
                return True
            gone = alive is None or (alive is not True and _rid_of(alive) != rid)
            if gone or time.monotonic() > deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 0.004)

    def read_into(self, key: str, dst: torch.Tensor, on_part=None) -> torch.Tensor:
        """Reads bucket ``key`` into ``dst`` part by part, each from the nearest source that has it.

        ``dst`` is of its size, uint8, non-empty; returns ``dst``. As a relay, each part lands first
        in its copy in this reader's segment (placed before the read: no staging copy on the next
        host's path) and is committed, readable by the next host, before it is copied into ``dst``.
        A relay without room for the copies, or whose copy could not be committed, stops relaying
        (:meth:`_step_down`) and reads into ``dst``. ``on_part(part, offset)``, if given, is called
        with each part's bytes (a uint8 view of ``dst``) once they are in ``dst``, in order of
        offset, while the next part is read (the reader digests them on the way).
        """
        mv = memoryview(dst.numpy())
        parts = part_ranges(dst.numel(), self.part_bytes)
        position = self.position  # the other read thread may step down meanwhile
        placed = None
        if position is not None:
            keys = [copy_key(self.pp, self.rid, key, j) for j in range(len(parts))]
            placed = self.store.internal.place(keys, [n for _, n in parts], pin=True)
            if placed is None:
                self._step_down()
        elif not self.sources:  # the publisher's piece alone: one read
            if self.timeline is not None:
                self.timeline.first_byte(key[len(self.pp) :])
            self.store.internal.read_into(key, mv, scratch=True)
            return dst
        torch = _torch()
        for j, (off, n) in enumerate(parts):
            if placed is None:
                self._read_part(key, j, off, mv[off : off + n])
                if on_part is not None:
                    on_part(dst[off : off + n], off)
                continue
            view, version = placed[j]
            unused = [[k, p[1]] for k, p in zip(keys[j:], placed[j:])]  # given back on failure
            try:
                self._read_part(key, j, off, view)
            except BaseException:
                self.store.internal.revoke(unused)
                raise
            try:
                self.store.internal.commit(keys[j], version)
                with self._lock:
                    self.own.append(keys[j])
                self._mark("committed", f"{key[len(self.pp) :]}.p{j}")
            except StoreError:  # not committed (a leader change lost it): no more copies
                placed = None
            dst[off : off + n].copy_(torch.frombuffer(view, dtype=torch.uint8))
            if on_part is not None:
                on_part(dst[off : off + n], off)
            if placed is None:  # after the copy: the space of this part goes back too
                self.store.internal.revoke(unused)
                self._step_down()
        return dst

    def _read_part(self, key: str, part: int, offset: int, mv: memoryview) -> None:
        """Reads part ``part`` of bucket ``key`` (its bytes from ``offset`` on) into ``mv``.

        From the nearest source that has it (the publisher's piece last).
        """
        name = f"{key[len(self.pp) :]}.p{part}"
        while self.sources:
            src = self.sources[0]
            j, rid = src
            ck = copy_key(self.pp, rid, key, part)
            if self._wait(j, rid, ck):
                try:
                    if self.timeline is not None:
                        self.timeline.first_byte(name)
                    if self.store.internal.read_into(ck, mv, scratch=True) == len(mv):
                        self._mark("part", f"{name} from c{j}")
                        return
                except (ObjectNotFoundError, TransferError, ValueError):
                    pass
            with self._lock:  # gone, unreadable, stalled or of another size: the next one up
                if self.sources and self.sources[0] == src:
                    self.sources.pop(0)
        if self.timeline is not None:
            self.timeline.first_byte(name)
        self.store.internal.read_into(key, mv, scratch=True, offset=offset)
        self._mark("part", f"{name} from the publisher")

    def _step_down(self) -> None:
        """Stops relaying this version: its position record goes at once.

        Readers after this one move up the chain; its copies stay until :meth:`finish`, as the pull
        may still stage from them.
        """
        with self._lock:
            position, self.position = self.position, None
            self._stepped_down = True
            if position is None:
                return
            pk = f"{self.vp}relay/c{position}"
            # a later reader may take the position: its record is not removed again
            self.own = [k for k in self.own if k != pk]
        self.store.remove_batch([pk], force=True, return_exceptions=True)

    def finish(self) -> None:
        """The pull's bytes are all read and staged: a relay that stepped down removes its copies.

        It removes them now.
        """
        if self._stepped_down:
            self._remove_own()

    def resign(self) -> None:
        """Stops relaying this version: removes what this reader put for it.

        Its position record goes with the rest: readers after it move up the chain.
        """
        self.position = None
        self._remove_own()

    def _remove_own(self) -> None:
        with self._lock:
            self.position = None
            own, self.own = self.own, []
        if own:
            self.store.remove_batch(own, force=True, return_exceptions=True)
