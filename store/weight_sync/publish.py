"""The trainer's side of :class:`~mooncake_store.WeightSync`: ``publish`` and dropping old versions.

``publish``: publish attempts, bucketed pieces and manifests, the commit record; and the drop of old
versions no reader holds. The store layout it reads and writes is described in ``sync.py``.
"""

from __future__ import annotations

import concurrent.futures
import re
import time
import uuid
from collections.abc import Callable

import msgpack

from ..common.errors import (
    NoSpaceError,
    ObjectExistsError,
    StaleVersionError,
    WeightSyncAbortedError,
)
from .common import (
    PublishResult,
    _byte_view,
    _default_algo,
    _dtype_name,
    _local_pieces,
    _piece_digest,
    _torch,
)
from .config import WeightSyncConfig
from .records import ModelRecords
from .relay import MAX_POSITIONS, copy_keys, position_keys


class Publisher:
    """The publishing side of one :class:`~mooncake_store.WeightSync`.

    ``publish`` and the drop of old versions.
    """

    def __init__(self, records: ModelRecords, cfg: WeightSyncConfig):
        self.records = records
        self.store = records.store
        self.model = records.model
        self.cfg = cfg
        self._published = (
            -1
        )  # the highest version this object committed (a floor the master may forget)

    def publish(
        self, state_dict, version: int, shard: int, num_shards: int, publish_id: str | None
    ) -> PublishResult:
        """:meth:`WeightSync.publish <mooncake_store.WeightSync.publish>`.

        Its docstring says what it does and raises.
        """
        torch = _torch()
        if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version < 2**63:
            raise ValueError(
                f"{self.model}: publish: version must be an int in [0, 2**63), got {version!r}"
            )
        if (
            not isinstance(num_shards, int)
            or num_shards < 1
            or not isinstance(shard, int)
            or not 0 <= shard < num_shards
        ):
            raise ValueError(
                f"{self.model}: publish: need 0 <= shard < num_shards, got shard={shard!r} num_shards={num_shards!r}"
            )
        if publish_id is None:
            if num_shards > 1:
                raise ValueError(
                    f"{self.model}: publish: with num_shards > 1 every shard must pass the same "
                    "publish_id (unique per publish, e.g. a uuid.uuid4().hex broadcast from rank 0): it "
                    "keeps the pieces of two groups publishing one version apart"
                )
            publish_id = uuid.uuid4().hex
        elif not isinstance(publish_id, str) or not re.fullmatch(
            r"[A-Za-z0-9_.-]{1,64}", publish_id
        ):
            raise ValueError(
                f"{self.model}: publish: publish_id must be a str of 1-64 letters, digits, '_', '.' or "
                f"'-', got {publish_id!r}"
            )
        if isinstance(state_dict, torch.nn.Module):
            state_dict = state_dict.state_dict()
        if not isinstance(state_dict, dict):
            raise ValueError(
                f"{self.model}: publish: state_dict must be a dict of tensors, got {type(state_dict).__name__}"
            )
        if not state_dict:
            raise ValueError(
                f"{self.model}: publish: the state dict is empty (nothing to publish as version {version})"
            )
        pieces = _local_pieces(state_dict, shard, num_shards, f"{self.model}: publish")
        latest = self.records.latest_version()
        if version <= max(latest, self._published):
            floor = max(latest, self._published)
            why = (
                ""
                if latest >= self._published
                else f" (committed by this publisher; the store now knows {latest}: its master "
                "restarted without etcd and forgot the versions)"
            )
            raise StaleVersionError(
                f"{self.model}: version {version} is not above the latest committed version "
                f"{floor}{why}; publish {floor + 1} or higher"
            )
        vp = f"{self.records.prefix}v{version}/"
        if self.store.exists(vp + "commit"):
            raise StaleVersionError(f"{self.model}: version {version} is already committed")

        # pack into buckets; put bucket i while packing bucket i+1
        plan, cur, cur_bytes = [], [], 0
        for p in pieces:
            n = p[4].numel() * p[4].element_size()
            if n >= self.cfg.bucket_bytes:
                plan.append([p])
                continue
            if cur and cur_bytes + n > self.cfg.bucket_bytes:
                plan.append(cur)
                cur, cur_bytes = [], 0
            cur.append(p)
            cur_bytes += n
        if cur or not plan:
            plan.append(cur)
        pp = f"{vp}{publish_id}/"  # this publish's pieces: no other publisher writes these keys
        sizes = [sum(p[4].numel() * p[4].element_size() for p in group) for group in plan]
        attempt = self._claim_attempt(vp, publish_id, shard, sizes)
        own = [f"{pp}b{shard}.{i}" for i in range(len(plan))] + [f"{pp}m{shard}"]

        def give_back(with_attempt: bool):
            # nothing of this publish is committed: give back what this shard wrote (it is
            # pinned, so it would stay, and the next try would need room for all of it again)
            try:
                self.store.remove_batch(
                    own + ([attempt] if with_attempt else []), force=True, return_exceptions=True
                )
            except Exception:
                pass

        deadline = None
        while True:
            try:
                _, total = self._write_pieces(torch, pp, shard, num_shards, version, plan)
                break
            except NoSpaceError:
                give_back(False)
                # space of dropped versions that a reader read comes back when its read
                # lease ends (lease_ttl_s): wait for it rather than fail a publish that fits
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self.store.internal.lease_ttl_s + 0.5
                if now < deadline and self._space_coming_back():
                    time.sleep(0.05)
                    continue
                give_back(True)
                raise
            except BaseException:
                give_back(True)
                raise
        if shard != 0:
            return PublishResult(version, shard, False, len(plan), total, [])
        return self._commit(vp, version, publish_id, num_shards, plan, total, give_back)

    def _space_coming_back(self) -> bool:
        """Whether the master holds allocations that come back when a read lease ends."""
        try:
            return self.store.stats().deferred > 0
        except Exception:
            return False

    def _claim_attempt(self, vp: str, pid: str, shard: int, sizes: list) -> str:
        """Records that publish ``pid`` writes buckets of ``sizes`` bytes of ``shard`` under ``vp``.

        The record is a plain put of the first free ``a<k>``, so that a commit or drop of the
        version finds and removes them (and relays' copies of them) even if this publisher dies.
        """
        rec = msgpack.packb(
            {
                "pid": pid,
                "shard": shard,
                "n": len(sizes),
                "nb": sizes,
                "part": self.cfg.relay_part_bytes,
                "t": time.time(),
            }
        )
        k = 0
        while True:
            try:
                self.store.put(f"{vp}a{k}", rec, self.records.placement)
                return f"{vp}a{k}"
            except ObjectExistsError:
                k += 1

    def _attempts(self, vp: str) -> list:
        """[(key, record)] of the publish attempts at ``vp``.

        Read 16 at a time, up to the first 16 free numbers in a row: a failed publish frees its
        number, the next takes the lowest free one.
        """
        out, k = [], 0
        while True:
            keys = [f"{vp}a{i}" for i in range(k, k + 16)]
            found = False
            for key, raw in zip(keys, self.store.get_batch(keys, return_exceptions=True)):
                if isinstance(raw, BaseException):
                    continue
                found = True
                try:
                    rec = msgpack.unpackb(raw, raw=False)
                    out.append((key, rec))
                except Exception:
                    out.append((key, None))
            if not found:
                return out
            k += 16

    def _sweep(self, vp: str, keep_pid: str | None) -> None:
        """Removes the pieces of every publish attempt at ``vp`` except ``keep_pid``'s.

        ``None``: all of them, the attempt records, and the relays' records and copies.
        """
        keys = []
        relays = []  # (position, host tag, reader id) of the version's live relays (relay.py)
        if keep_pid is None:
            recs = self.records.get_many(position_keys(vp, MAX_POSITIONS))
            relays = [
                (k, r.get("host"), str(r.get("rid")))
                for k, r in enumerate(recs)
                if isinstance(r, dict)
            ]
            keys += [f"{vp}relay/c{k}" for k, _, _ in relays]
            keys += [f"{vp}relay/h{h}" for _, h, _ in relays]
        for key, rec in self._attempts(vp):
            if rec is not None and rec.get("pid") == keep_pid:
                continue
            if rec is not None:
                pp, s = f"{vp}{rec['pid']}/", int(rec["shard"])
                pieces = [f"{pp}b{s}.{i}" for i in range(int(rec["n"]))]
                keys += pieces + [f"{pp}m{s}"]
                # the relays' copies of the buckets' parts
                sizes, part = rec.get("nb") or [], int(rec.get("part") or 0)
                keys += [
                    c
                    for _, _, rid in relays
                    for b, nb in zip(pieces, sizes)
                    if part > 0 and nb
                    for c in copy_keys(pp, rid, b, int(nb), part)
                ]
            if keep_pid is None:
                keys.append(key)
        if keys:
            self.store.remove_batch(keys, force=True, return_exceptions=True)

    def _write_pieces(
        self, torch, pp: str, shard: int, num_shards: int, version: int, plan: list
    ) -> tuple:
        """Writes this shard's buckets under the publish prefix ``pp``, then its manifest.

        Bucket i is put while bucket i+1 is packed. Returns ``(manifest, bytes written)``.
        """
        manifest = {
            "version": version,
            "shard": shard,
            "num_shards": num_shards,
            "buckets": [],
            "pieces": [],
        }
        total = 0
        algo = _default_algo() if self.cfg.checksums else None
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ws-put") as ex:
            pending = None
            for i, group in enumerate(plan):
                key = f"{pp}b{shard}.{i}"
                views = [_byte_view(p[4]) for p in group]
                offs, nbytes = [], 0
                for (
                    v
                ) in views:  # pieces start 64-byte aligned, so readers can view them as any dtype
                    offs.append(nbytes)
                    nbytes = (nbytes + v.numel() + 63) // 64 * 64
                if len(views) == 1:
                    buf = views[0]
                    nbytes = buf.numel()
                else:
                    buf = torch.zeros(nbytes, dtype=torch.uint8)
                for p, v, off in zip(group, views, offs):
                    n = v.numel()
                    if buf is not v and n:
                        buf[off : off + n].copy_(v)
                    manifest["pieces"].append(
                        {
                            "name": p[0],
                            "dtype": _dtype_name(p[1]),
                            "gshape": p[2],
                            "offset": p[3],
                            "shape": list(p[4].shape),
                            "bucket": i,
                            "boff": off,
                            "nbytes": n,
                            "digest": _piece_digest(v, algo) if algo else None,
                        }
                    )
                manifest["buckets"].append([key, nbytes])
                total += nbytes
                if pending is not None:
                    pending.result()
                pending = ex.submit(self.store.upsert, key, buf, self.records.placement)
            if pending is not None:
                pending.result()
        self.store.upsert(f"{pp}m{shard}", msgpack.packb(manifest), self.records.placement)
        return manifest, total

    def _commit(
        self,
        vp: str,
        version: int,
        pid: str,
        num_shards: int,
        plan: list,
        total: int,
        give_back: Callable[[bool], None],
    ) -> PublishResult:
        mkeys = [f"{vp}{pid}/m{s}" for s in range(num_shards)]

        def lost():
            return StaleVersionError(
                f"{self.model}: version {version} was committed by another publisher meanwhile (a second trainer "
                f"publishing it?); this publish ({pid!r}) removed what it wrote; publish "
                f"{max(version, self.records.latest_version()) + 1} or higher"
            )

        try:
            deadline = time.monotonic() + self.cfg.commit_timeout_s
            while True:
                *mans, done = self.store.exists_batch(mkeys + [vp + "commit"])
                if done:  # another publisher won (and its commit removed this publish's pieces)
                    raise lost()
                if all(mans):
                    break
                if time.monotonic() > deadline:
                    raise WeightSyncAbortedError(
                        f"{self.model} v{version}: not every shard wrote its manifest of "
                        f"publish {pid!r} within {self.cfg.commit_timeout_s}s; nothing "
                        "committed"
                    )
                time.sleep(0.01)
            try:
                # a plain put: of two publishers of this version exactly one commits
                self.store.put(
                    vp + "commit",
                    msgpack.packb(
                        {
                            "version": version,
                            "num_shards": num_shards,
                            "pid": pid,
                            "part": self.cfg.relay_part_bytes,  # relays pass on parts this big
                            "time": time.time(),
                        }
                    ),
                    self.records.placement,
                )
            except ObjectExistsError:
                raise lost() from None
        except BaseException:
            give_back(True)
            raise
        # committed: the pieces of every other attempt at this version (a loser still
        # writing, a publisher that died) are never read; give their space back
        self._sweep(vp, pid)
        versions = sorted(set(self.records.committed_versions()) | {version})
        self._published = max(self._published, version)
        if version > self.records.latest_version():
            self.records.put(self.records.prefix + "latest", {"version": version, "pid": pid})
        dropped = self._drop_old(versions)
        self.records.put(
            self.records.prefix + "versions", [v for v in versions if v not in dropped]
        )
        return PublishResult(version, 0, True, len(plan), total, dropped)

    def _holds(self) -> set:
        """Versions some reader holds.

        Slots of readers silent for ``hold_ttl_s`` (dead, or between pulls without views) are
        reclaimed here, by the committing shard only.
        """
        n = self.cfg.max_readers
        got = self.records.get_many(
            [f"{self.records.prefix}slot/{i}" for i in range(n)]
            + [f"{self.records.prefix}hold/{i}" for i in range(n)]
        )
        now, held, stale = time.time(), set(), []
        for i in range(n):
            srec, hrec = got[i], got[n + i]
            if srec is None:
                continue
            try:
                if hrec is not None and hrec.get("rid") == srec["rid"]:
                    if now - float(hrec["t"]) < self.cfg.hold_ttl_s:
                        held.update(int(x) for x in hrec["versions"] if int(x) >= 0)
                        continue
                elif now - float(srec["t"]) < self.cfg.hold_ttl_s:
                    continue  # claimed a moment ago, its hold not written yet
            except Exception:
                pass
            stale.append(i)
        if stale:
            self.store.remove_batch(
                [f"{self.records.prefix}{k}/{i}" for i in stale for k in ("hold", "slot")],
                force=True,
                return_exceptions=True,
            )
        return held

    def _drop_old(self, versions: list) -> list:
        keep = set(versions[-(self.cfg.keep_versions + 1) :]) | self._holds()
        dropped = []
        for v in versions:
            if v in keep:
                continue
            vp = f"{self.records.prefix}v{v}/"
            # the commit record first: the version is invisible to pulls from here on. A
            # reader takes its hold before it reads the commit record, so a reader that saw
            # it shows in the holds read next: then the pieces stay (a later publish drops
            # them). force=True is safe for a copy in progress: the store reuses the space
            # of a leased object only after the lease ends
            self.store.remove_batch([vp + "commit"], force=True, return_exceptions=True)
            if v in self._holds():
                continue
            self._sweep(
                vp, None
            )  # every attempt's pieces (the committed one's too) and their records
            dropped.append(v)
        return dropped
