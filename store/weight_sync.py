"""Weight sync from trainers to rollout workers (see DESIGN.md "Store", ``WeightSync``).

Two paths:

* **Store path** (:class:`WeightSync`): the trainer ``publish``-es a state dict under a
  model name and an increasing version; rollout workers ``pull`` the latest (or a given)
  version into their model. Atomic per reader: a reader stages the whole version, checks
  that every piece is present (and its checksum), and only then copies it into its
  tensors; on any error it keeps (and reports) its previous version.
* **Process-group path** (:class:`GroupWeightSync`): a bucketed broadcast over a
  ``mooncake`` (or any) process group from a source rank; atomic for the whole group:
  every bucket is staged, after each bucket the group agrees (``all_reduce`` of a failure
  count) whether to go on, and the staged tensors are installed only when every rank
  staged every bucket.

Store layout of model ``M`` (all values are msgpack or raw tensor bytes; nothing is
unpickled)::

    ws/M/latest            {"version": v}: newest committed version (upserted after commit)
    ws/M/versions          [v, ...]: committed versions not dropped yet (both records are
                           the metadata of empty objects: they live in the master alone)
    ws/M/v<v>/a<k>         {"pid", "shard", "n", "t"}: publish attempt k of version v (a plain
                           put of the first free k, before any piece): what each publisher
                           writes under v, so that a later commit or drop can remove it
    ws/M/v<v>/<pid>/b<s>.<i>  bucket i of shard s of publish <pid> (tensor bytes, packed)
    ws/M/v<v>/<pid>/m<s>   manifest of shard s of publish <pid>: its buckets and tensor pieces
    ws/M/v<v>/commit       {"num_shards": n, "pid": pid}: written (put, never replaced) by shard
                           0 after every shard's manifest exists; a version is visible only
                           then, and readers read only the pieces of the publish it names
    ws/M/slot/<i>          reader slot i (taken with a plain put: first come, first served)
    ws/M/hold/<i>          {"version": v, "t": unix time}: reader i is pulling version v
                           (slot and hold records are metadata of empty objects too)

Two publishers of one version (an old trainer not yet dead while its replacement
republishes ``latest_version() + 1``) write disjoint keys (each publish has its own id
``pid``: a fresh one per call, or ``publish_id`` shared by the shards of one sharded
publish); the commit record is a plain put, so exactly one commits. The loser's shard 0
removes what it wrote and raises ``StaleVersionError``; the winner's commit removes the
pieces of every other attempt at that version (losers, dead publishers), and dropping a
version removes every attempt's.

Old versions: after each commit, shard 0 drops committed versions older than the newest
``keep_versions + 1`` unless a reader holds them (a hold younger than ``hold_ttl_s``):
commit record first, then the pieces (``remove(force=True)``: a copy in progress is safe,
the store reuses leased space only after the lease ends). A reader whose version vanished
under it fails its pull and keeps its old version; the next ``pull()`` takes the newest.
A publish that fails with an exception (``NoSpaceError``, ``TransferError``, ...) before its
commit removes the pieces its shard wrote; a ``NoSpaceError`` while the store still has
space to give back (dropped versions a reader read less than ``lease_ttl_s`` ago) is
retried for up to ``lease_ttl_s``. Pieces of a trainer that died mid-publish stay (pinned)
until a publish of the same version commits (or the version is dropped).

Sharded trainers (DTensor / FSDP2 state dicts): every rank calls ``publish`` with its own
state dict, ``shard=rank``, ``num_shards=world`` and the same ``publish_id`` (unique per
publish, e.g. a uuid broadcast from rank 0); each rank writes only its local
shards (replicated DTensor placements: only the rank at coordinate 0 of those mesh
dimensions; plain tensors: only shard 0) with their global offsets; shard 0 commits once
all manifests exist. Readers assemble full tensors from the pieces and check that the
pieces cover every element.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import logging
import re
import sys
import threading
import time
import uuid
import warnings
import weakref
from collections.abc import Callable
from typing import NamedTuple

import msgpack

from .config import ReplicateConfig, WeightSyncConfig
from .errors import (
    LeaseExpiredError,
    NoSpaceError,
    ObjectExistsError,
    ObjectNotFoundError,
    StaleVersionError,
    StoreError,
    WeightSyncAbortedError,
)

log = logging.getLogger(__name__)

__all__ = [
    "GroupSyncResult",
    "GroupWeightSync",
    "PublishResult",
    "PullResult",
    "WeightSync",
    "tensor_digest",
]


class PublishResult(NamedTuple):
    """What :meth:`WeightSync.publish` did."""

    version: int
    shard: int
    committed: bool  #: this call wrote the commit record (shard 0)
    buckets: int  #: store objects written by this shard
    bytes: int  #: tensor bytes written by this shard
    dropped: list  #: old versions dropped after the commit


class PullResult(NamedTuple):
    """What :meth:`WeightSync.pull` did."""

    version: int  #: the version the reader holds now
    previous: int  #: the version it held before (-1: none)
    installed: bool  #: False when it already held the newest (or asked) version
    bytes: int  #: tensor bytes read
    state_dict: dict | None  #: the installed tensors when ``into`` was None


class GroupSyncResult(NamedTuple):
    """What :meth:`GroupWeightSync.sync` did on this rank."""

    version: int
    previous: int
    buckets: int
    bytes: int


def _torch():
    import torch

    return torch


def _byte_view(t):
    """The bytes of a CPU tensor (contiguous copy if needed) as a flat uint8 tensor."""
    torch = _torch()
    t = t.detach()
    if t.device.type != "cpu":
        raise ValueError(f"tensors must be on the CPU, got {t.device}")
    t = t.contiguous()
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return t.reshape(-1).view(torch.uint8)


def _piece_digest(data, algo: str) -> str:
    """``algo:hex`` digest of a uint8 tensor's bytes: ``xxh3`` (XXH3-128, xxhash) or ``blake2b``
    (BLAKE2b-128, hashlib)."""
    buf = data.numpy() if data.numel() else b""
    if algo == "xxh3":
        import xxhash

        return "xxh3:" + xxhash.xxh3_128_hexdigest(buf)
    if algo == "blake2b":
        return "blake2b:" + hashlib.blake2b(buf, digest_size=16).hexdigest()
    raise WeightSyncAbortedError(f"unknown checksum algorithm {algo!r} in a manifest")


def _default_algo() -> str:
    try:
        import xxhash  # noqa: F401

        return "xxh3"
    except ImportError:
        return "blake2b"


def tensor_digest(t) -> str:
    """BLAKE2b-128 hex digest of a CPU tensor's bytes (row-major order)."""
    b = _byte_view(t)
    return hashlib.blake2b(b.numpy() if b.numel() else b"", digest_size=16).hexdigest()


def _unref(refs: dict, v: int):
    n = refs.get(v, 0) - 1
    if n > 0:
        refs[v] = n
    else:
        refs.pop(v, None)


@functools.cache
def _copyable(dt) -> bool:
    """Whether torch can copy tensors of ``dt`` (readers copy every piece into place; some
    sub-byte dtypes, e.g. ``torch.int4``, ``torch.uint4`` or ``torch.uint1``, have no copy
    kernel)."""
    torch = _torch()
    try:
        t = torch.empty(2, dtype=dt)
        t[0:1].copy_(t[1:2])
        return True
    except (NotImplementedError, RuntimeError, TypeError):
        return False


def _dtype_name(dt) -> str:
    return str(dt).removeprefix("torch.")


def _dtype_of(name: str):
    dt = getattr(_torch(), name, None)
    if not isinstance(dt, _torch().dtype):
        raise WeightSyncAbortedError(f"unknown dtype {name!r} in a manifest")
    return dt


def _target_dict(into) -> dict:
    torch = _torch()
    if into is None:
        return {}
    if isinstance(into, torch.nn.Module):
        return into.state_dict(keep_vars=True)
    if isinstance(into, dict):
        return into
    raise ValueError(
        f"into must be an nn.Module, a dict of tensors or None, got {type(into).__name__}"
    )


def _local_pieces(state_dict: dict, shard: int, num_shards: int) -> list:
    """[(name, dtype, global_shape, offset, local_tensor)] this shard writes."""
    torch = _torch()
    DTensor = None
    # no DTensor exists before its module is imported; importing it takes about a second
    if "torch.distributed.tensor" in sys.modules:
        try:
            from torch.distributed.tensor import DTensor, Replicate, Shard
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        except ImportError:  # pragma: no cover
            DTensor = None
    out = []
    for name, t in state_dict.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"state dict keys must be non-empty str, got {name!r}")
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"state dict entry {name!r} is a {type(t).__name__}, not a tensor")
        if not (DTensor is not None and isinstance(t, DTensor)) and (
            t.layout != torch.strided or t.is_nested
        ):
            raise ValueError(
                f"{name!r}: tensors must be dense (strided), got layout {t.layout}"
                + (" (nested)" if t.is_nested else "")
            )
        if not _copyable(t.dtype):
            raise ValueError(
                f"{name!r}: dtype {t.dtype} cannot be published: torch has no copy kernel for it, so "
                "no reader could install it (publish its bytes, e.g. t.view(torch.uint8), instead)"
            )
        if DTensor is not None and isinstance(t, DTensor):
            coord = t.device_mesh.get_coordinate()
            if coord is None:
                continue
            skip = False
            for d, p in enumerate(t.placements):
                if isinstance(p, Shard):
                    continue
                if isinstance(p, Replicate):
                    skip = skip or coord[d] != 0
                else:
                    raise ValueError(
                        f"{name!r}: placement {p} is not supported (Shard or Replicate only)"
                    )
            if skip:
                continue
            local_shape, offset = compute_local_shape_and_global_offset(
                t.shape, t.device_mesh, t.placements
            )
            local = t.to_local()
            if local.layout != torch.strided:
                raise ValueError(
                    f"{name!r}: tensors must be dense (strided), got layout {local.layout}"
                )
            if local.device.type != "cpu":
                raise ValueError(f"{name!r}: tensors must be on the CPU, got {local.device}")
            if tuple(local.shape) != tuple(local_shape):
                raise ValueError(
                    f"{name!r}: local shard shape {tuple(local.shape)} != expected {tuple(local_shape)}"
                )
            out.append((name, t.dtype, list(t.shape), [int(o) for o in offset], local))
        else:
            if t.device.type != "cpu":
                raise ValueError(f"{name!r}: tensors must be on the CPU, got {t.device}")
            if shard == 0:
                out.append((name, t.dtype, list(t.shape), [0] * t.dim(), t))
    return out


class WeightSync:
    """Versioned weights of one model in a :class:`~mooncake_store.MooncakeStore`.

    ``WeightSync(store, "policy")``; trainer: ``publish(state_dict, version)``; rollout:
    ``pull(into=model)``. ``config`` is a :class:`WeightSyncConfig`. One object per
    process and model; a reader's ``version`` is the version it holds (-1: none)."""

    def __init__(self, store, model: str, *, config: WeightSyncConfig | None = None):
        if not isinstance(model, str) or not model or "/" in model or len(model) > 200:
            raise ValueError(
                f"model must be a non-empty str without '/' (at most 200 chars), got {model!r}"
            )
        self.store = store
        self.model = model
        self.cfg = config or WeightSyncConfig()
        if not isinstance(self.cfg, WeightSyncConfig):
            raise ValueError("config must be a WeightSyncConfig")
        self._p = f"ws/{model}/"
        self._rc = ReplicateConfig(pin=self.cfg.pin)
        self.version = -1
        self._slot: int | None = None
        self._spare: dict = {}  # staging tensors of the last pull, reused by the next one
        self._rid = uuid.uuid4().hex  # this reader, in its slot and hold records
        self._hold_lock = threading.Lock()  # pulls and the refresh thread write one hold key
        # version -> live view arrays of it: a version stays held while any tensor viewing
        # it lives (also one the caller detached or kept from an earlier pull)
        self._refs: dict = {}
        self._view_targets: dict = {}  # id(target tensor) -> (weakref to it, data_ptr of its view)
        self._into = None  # (id, weakref or None) of the last `into`, or "none" (into=None)
        self._refresher: threading.Thread | None = None
        self._stop = threading.Event()
        # viewed versions found dropped while this reader still had views of them (its hold
        # lapsed: the process was stopped or starved past hold_ttl_s); see _refresh_main
        self.lapsed_versions: list = []
        hooks = getattr(store, "_close_hooks", None)
        if (
            hooks is not None
        ):  # closing the store (or the process exiting) releases this reader first
            hooks.append(weakref.WeakMethod(self.release))

    # ------------------------------------------------------------------ helpers
    def _get_msg(self, key, default=ObjectNotFoundError):
        try:
            return msgpack.unpackb(self.store.get(key), raw=False)
        except ObjectNotFoundError:
            if default is ObjectNotFoundError:
                raise
            return default

    def _put_record(self, key: str, rec, upsert: bool = True) -> None:
        """Writes ``rec`` (msgpack) as the metadata of an empty object: it lives in the
        master alone, so it needs no segment and outlives whoever wrote it (a trainer
        holding the store's memory that restarts still finds its version history; a reader
        records its holds with no trainer alive). ``upsert=False``: a plain put
        (``ObjectExistsError`` if the key exists)."""
        self.store._put_many(
            [key], [memoryview(b"")], [msgpack.packb(rec)], self._rc, upsert, False
        )

    def _get_records(self, keys: list) -> list:
        """The records :meth:`_put_record` wrote (None where a key does not exist or holds
        no valid record)."""
        out = []
        for key, meta in zip(keys, self.store._exists_meta(keys)):
            try:
                if meta is None:
                    out.append(None)
                elif (
                    meta is True or not meta
                ):  # an older master without metadata, or a record written as a value
                    out.append(self._get_msg(key, None))
                else:
                    out.append(msgpack.unpackb(meta, raw=False))
            except Exception:
                out.append(None)
        return out

    def _get_record(self, key: str, default=None):
        rec = self._get_records([key])[0]
        return default if rec is None else rec

    def latest_version(self) -> int:
        """The newest committed version in the store (-1: none). Read from the master's
        metadata alone, so a restarted trainer or a new reader sees it, also when the
        segment that held the versions' bytes is gone."""
        rec = self._get_record(self._p + "latest")
        return int(rec["version"]) if isinstance(rec, dict) else -1

    def committed_versions(self) -> list:
        """Committed versions not dropped yet, oldest first."""
        return [int(v) for v in (self._get_record(self._p + "versions") or [])]

    # ------------------------------------------------------------------ publish
    def publish(
        self,
        state_dict,
        version: int,
        *,
        shard: int = 0,
        num_shards: int = 1,
        publish_id: str | None = None,
    ) -> PublishResult:
        """Writes ``state_dict`` (CPU tensors or DTensors; an ``nn.Module`` is taken by its
        state dict) as ``version``.

        Raises ``StaleVersionError`` if ``version`` is at or below the latest committed
        one, or if another publisher committed ``version`` first (two trainers publishing
        one version: exactly one commits; the loser's shard 0 removes what it wrote and
        raises, naming the version). ``ValueError`` for bad input (before anything is
        written: sparse or nested tensors, dtypes torch cannot copy such as
        ``torch.int4``). ``StoreError``s of the store: a failure before the commit removes
        what this shard wrote of ``version``, so a retry needs no more room than the first
        try; a ``NoSpaceError`` while the store has space of dropped versions to give back
        (read leases) is retried until that space is back (up to ``lease_ttl_s``).

        With ``num_shards > 1`` every shard calls this with the same ``publish_id`` (a
        str of 1-64 letters, digits, ``_.-``, unique per publish: e.g. a uuid4 hex
        broadcast from rank 0), which names the pieces of this publish; shard 0 waits up
        to ``commit_timeout_s`` for the others' manifests and commits. A single-shard
        publish takes a fresh id when none is given."""
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
                f"need 0 <= shard < num_shards, got shard={shard!r} num_shards={num_shards!r}"
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
                f"state_dict must be a dict of tensors, got {type(state_dict).__name__}"
            )
        if not state_dict:
            raise ValueError(
                f"{self.model}: publish: the state dict is empty (nothing to publish as version {version})"
            )
        pieces = _local_pieces(state_dict, shard, num_shards)
        latest = self.latest_version()
        if version <= latest:
            raise StaleVersionError(
                f"{self.model}: version {version} is not above the latest committed version "
                f"{latest}; publish {latest + 1} or higher"
            )
        vp = f"{self._p}v{version}/"
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
        attempt = self._claim_attempt(vp, publish_id, shard, len(plan))
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
                    deadline = now + float(getattr(self.store, "_lease_ttl", 5.0)) + 0.5
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

    def _claim_attempt(self, vp: str, pid: str, shard: int, nbuckets: int) -> str:
        """Records (a plain put of the first free ``a<k>``) that publish ``pid`` writes
        ``nbuckets`` buckets of ``shard`` under ``vp``, so that a commit or drop of the
        version finds and removes them even if this publisher dies."""
        rec = msgpack.packb({"pid": pid, "shard": shard, "n": nbuckets, "t": time.time()})
        k = 0
        while True:
            try:
                self.store.put(f"{vp}a{k}", rec, self._rc)
                return f"{vp}a{k}"
            except ObjectExistsError:
                k += 1

    def _attempts(self, vp: str) -> list:
        """[(key, record)] of the publish attempts at ``vp`` (read 16 at a time, up to the
        first 16 free numbers in a row: a failed publish frees its number, the next takes
        the lowest free one)."""
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
        """Removes the pieces of every publish attempt at ``vp`` except ``keep_pid``'s
        (``None``: all of them, and the attempt records too)."""
        keys = []
        for key, rec in self._attempts(vp):
            if rec is not None and rec.get("pid") == keep_pid:
                continue
            if rec is not None:
                pp, s = f"{vp}{rec['pid']}/", int(rec["shard"])
                keys += [f"{pp}b{s}.{i}" for i in range(int(rec["n"]))] + [f"{pp}m{s}"]
            if keep_pid is None:
                keys.append(key)
        if keys:
            self.store.remove_batch(keys, force=True, return_exceptions=True)

    def _write_pieces(
        self, torch, pp: str, shard: int, num_shards: int, version: int, plan: list
    ) -> tuple:
        """Writes this shard's buckets (bucket i put while bucket i+1 is packed) under the
        publish prefix ``pp``, then its manifest; returns ``(manifest, bytes written)``."""
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
                pending = ex.submit(self.store.upsert, key, buf, self._rc)
            if pending is not None:
                pending.result()
        self.store.upsert(f"{pp}m{shard}", msgpack.packb(manifest), self._rc)
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
                f"{max(version, self.latest_version()) + 1} or higher"
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
                            "time": time.time(),
                        }
                    ),
                    self._rc,
                )
            except ObjectExistsError:
                raise lost() from None
        except BaseException:
            give_back(True)
            raise
        # committed: the pieces of every other attempt at this version (a loser still
        # writing, a publisher that died) are never read; give their space back
        self._sweep(vp, pid)
        versions = sorted(set(self.committed_versions()) | {version})
        if version > self.latest_version():
            self._put_record(self._p + "latest", {"version": version})
        dropped = self._drop_old(versions)
        self._put_record(self._p + "versions", [v for v in versions if v not in dropped])
        return PublishResult(version, 0, True, len(plan), total, dropped)

    def _holds(self) -> set:
        """Versions some reader holds. Slots of readers silent for ``hold_ttl_s`` (dead, or
        between pulls without views) are reclaimed here, by the committing shard only."""
        n = self.cfg.max_readers
        got = self._get_records(
            [f"{self._p}slot/{i}" for i in range(n)] + [f"{self._p}hold/{i}" for i in range(n)]
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
                [f"{self._p}{k}/{i}" for i in stale for k in ("hold", "slot")],
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
            vp = f"{self._p}v{v}/"
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

    # ------------------------------------------------------------------ pull
    def _held_versions(self) -> list:
        return sorted(v for v, c in list(self._refs.items()) if c > 0)

    def _hold(self, versions: list, verify: bool = False) -> bool:
        """Records that this reader uses ``versions`` (publishers do not drop them). False
        if no reader slot is free. ``verify``: check first that the slot is still ours (a
        publisher reclaims the slot of a reader silent for ``hold_ttl_s``)."""
        with self._hold_lock:
            return self._hold_locked(versions, verify)

    def _hold_locked(self, versions: list, verify: bool) -> bool:
        if self._slot is not None and verify:
            rec = self._get_record(f"{self._p}slot/{self._slot}")
            if not isinstance(rec, dict) or rec.get("rid") != self._rid:
                self._slot = None
        if self._slot is None:
            rec = {"rid": self._rid, "t": time.time()}
            for i in range(self.cfg.max_readers):
                try:
                    self._put_record(f"{self._p}slot/{i}", rec, upsert=False)
                    self._slot = i
                    break
                except ObjectExistsError:
                    continue
            else:
                return False  # no slot: copies still work, the version is just not protected from dropping
        self._put_record(
            f"{self._p}hold/{self._slot}",
            {"rid": self._rid, "versions": list(versions), "t": time.time()},
        )
        return True

    def _refresh_main(self):
        # keeps the holds on viewed versions younger than hold_ttl_s while this reader lives
        written = True
        while not self._stop.wait(self.cfg.hold_ttl_s / 4):
            held = self._held_versions()
            if held or written:
                try:
                    self._hold(held, verify=True)
                    written = bool(held)
                    if held:
                        self._check_not_dropped(held)
                except StoreError:
                    pass  # retried at the next tick; the hold counts for hold_ttl_s

    def _check_not_dropped(self, held: list):
        """A reader stopped or starved past ``hold_ttl_s`` (a debugger, a paused VM) lost
        its hold: a publisher may have dropped a version it still views and reused that
        memory. Nothing can stop the model from reading it then; this makes it loud
        (``lapsed_versions``, an error in the log and a ``RuntimeWarning``) until the next
        pull installs a newer version."""
        alive = self.store.exists_batch([f"{self._p}v{v}/commit" for v in held])
        gone = [v for v, ok in zip(held, alive) if not ok]
        if gone and gone != self.lapsed_versions:
            self.lapsed_versions = gone
            msg = (
                f"{self.model}: version(s) {gone} were dropped while this reader still had views of them (its "
                f"hold lapsed: stopped or starved past hold_ttl_s={self.cfg.hold_ttl_s} s); those parameters may "
                "now read another version's bytes: pull() again"
            )
            log.error(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=1)

    def release(self):
        """Gives up this reader's slot (call when the reader goes away for good). With
        ``install="view"`` the parameters it installed as views become private copies
        first; tensors the caller kept or detached from views are not protected after
        this (a warning says so): publishers may reuse that memory."""
        self._stop.set()
        torch = _torch()
        with torch.no_grad():
            for ref, ptr in self._view_targets.values():  # installed views become private copies
                t = ref()
                if t is not None and t.numel() and t.data_ptr() == ptr:
                    t.data = t.data.clone()
        self._view_targets = {}
        left = self._held_versions()
        if left:
            log.warning(
                "%s: release() while tensors viewing version(s) %s are alive (kept or detached by the "
                "caller): their bytes may change once publishers reuse the memory",
                self.model,
                left,
            )
        if self._slot is not None:
            self.store.remove_batch(
                [f"{self._p}hold/{self._slot}", f"{self._p}slot/{self._slot}"],
                force=True,
                return_exceptions=True,
            )
            self._slot = None

    def pull(
        self,
        into=None,
        version="latest",
        *,
        dtype=None,
        strict: bool = True,
        stage_hook: Callable[[int], None] | None = None,
    ) -> PullResult:
        """Installs ``version`` (``"latest"`` or an int) into ``into`` (an ``nn.Module`` or a
        dict of tensors; ``None``: the tensors come back in ``PullResult.state_dict``).

        All or nothing: the whole version is read and checked (every piece present,
        checksums, shapes, every element covered) before the first tensor of ``into``
        changes; on any error the previous version stays and the error is raised
        (``WeightSyncAbortedError`` for a missing/corrupt piece, or the error raised).
        ``dtype`` casts floating-point tensors; a tensor of ``into`` keeps its dtype, and one
        whose dtype differs from the published one raises ``ValueError`` unless both are
        floating-point (then the values are cast). Never goes back: an int ``version`` below
        the one held raises ``StaleVersionError``; ``"latest"`` at or below it, or before
        any publish, does nothing (``installed=False``). ``strict``: ``into`` must have exactly the
        published names. ``stage_hook(i)`` runs before bucket ``i`` is staged (for
        validation and tests; its exception aborts the pull).

        With ``WeightSyncConfig(install="view")`` (``into`` an ``nn.Module`` or ``None``),
        every tensor published whole, in memory on this host and not cast is installed
        as a view of the store's memory (``param.data = view``: no copy, shared by all
        readers of the host; read-only, a write kills the process with SIGSEGV); the
        reader keeps a hold on that version until its next pull or ``release()``.
        Other tensors are copied as above (into fresh memory when the target was a
        view)."""
        torch = _torch()
        view_mode = self.cfg.install == "view"
        if view_mode and into is not None and not isinstance(into, torch.nn.Module):
            raise ValueError(
                f"{self.model}: install='view' needs into=nn.Module (its parameters take the views) "
                f"or None, got {type(into).__name__}"
            )
        targets = _target_dict(into)
        if dtype is not None and (
            not isinstance(dtype, torch.dtype) or not dtype.is_floating_point
        ):
            raise ValueError(
                f"{self.model}: pull: dtype must be a floating-point torch.dtype or None (only "
                f"floating-point tensors are cast), got {dtype!r}"
            )
        prev = self.version
        # a different `into` than last time gets the held version too (it is not installed there yet)
        if into is None:
            same_into = self._into == "none"
        else:
            same_into = (
                isinstance(self._into, tuple)
                and self._into[0] == id(into)
                and (self._into[1] is None or self._into[1]() is into)
            )
        if version == "latest":
            v = self.latest_version()
            if v < 0 or v < prev or (v == prev and same_into):  # v < 0: nothing published yet
                return PullResult(prev, prev, False, 0, None)
        elif isinstance(version, int) and not isinstance(version, bool) and version >= 0:
            v = version
            if v < prev:
                raise StaleVersionError(
                    f"{self.model}: holds version {prev}; will not go back to {v}"
                )
            if v == prev and same_into:
                return PullResult(prev, prev, False, 0, None)
        else:
            raise ValueError(f"version must be 'latest' or an int >= 0, got {version!r}")
        kept = self._held_versions()  # viewed versions stay held while the new one is staged
        if not self._hold(kept + [v], verify=True) and view_mode:
            view_mode = (
                False  # every reader slot taken: unprotected memory must not be viewed; copy
            )
        try:
            for attempt in range(3 if version == "latest" else 1):
                try:
                    staged, raw, nbytes, viewed = self._stage(
                        v, targets, dtype, strict, stage_hook, view_mode
                    )
                    break
                except (ObjectNotFoundError, WeightSyncAbortedError):
                    # "latest" dropped under us by a faster publisher: take the newer one
                    newer = self.latest_version() if version == "latest" else v
                    if attempt == 2 or newer <= v:
                        raise
                    v = newer
                    self._hold(kept + [v])
            handed = set()
            self._view_targets = {k: e for k, e in self._view_targets.items() if e[0]() is not None}
            with torch.no_grad():
                for name, t in staged.items():
                    if name not in targets:
                        continue
                    tgt = targets[name]
                    e = self._view_targets.get(id(tgt))
                    is_view = (
                        e is not None and e[0]() is tgt and tgt.numel() and tgt.data_ptr() == e[1]
                    )
                    if name in viewed or is_view:
                        # a view goes in by reference; a copy replaces a view by reference too
                        # (the view's memory is read-only), in the target's dtype
                        targets[name].data = (
                            t if t.dtype == targets[name].dtype else t.to(targets[name].dtype)
                        )
                        handed.add(name)
                        if name in viewed:
                            self._view_targets[id(targets[name])] = (
                                weakref.ref(targets[name]),
                                t.data_ptr() if t.numel() else -1,
                            )
                        else:
                            self._view_targets.pop(id(targets[name]), None)
                    else:
                        targets[name].copy_(t)
            # keep the staging tensors for the next pull (into given and they were not handed out)
            if into is not None and (dtype is None or raw is not staged):
                self._spare = {k: t for k, t in raw.items() if k not in handed and k not in viewed}
            else:
                self._spare = {}
            staged = staged if into is None else None
            raw = None
        finally:
            try:
                self._hold(
                    self._held_versions()
                )  # the new version if viewed, and views still alive
            except StoreError:
                pass
        if into is None:
            self._into = "none"
        else:
            try:
                self._into = (id(into), weakref.ref(into))
            except TypeError:  # a dict: its id alone (a reused id only costs an install skipped)
                self._into = (id(into), None)
        if self._refs and (self._refresher is None or not self._refresher.is_alive()):
            self._stop = threading.Event()
            self._refresher = threading.Thread(
                target=self._refresh_main, name="ws-hold", daemon=True
            )
            self._refresher.start()
        self.version = max(v, prev)
        self.lapsed_versions = [x for x in self.lapsed_versions if x in self._held_versions()]
        return PullResult(v, prev, True, nbytes, staged)

    def _stage(
        self, v: int, targets: dict, dtype, strict: bool, stage_hook, view_mode: bool = False
    ) -> tuple:
        torch = _torch()
        vp = f"{self._p}v{v}/"
        try:
            commit = self._get_msg(vp + "commit")
        except ObjectNotFoundError:
            raise ObjectNotFoundError(
                f"{self.model}: version {v} is not committed (or was dropped)"
            ) from None
        n = int(commit["num_shards"])
        pp = vp + (
            f"{commit['pid']}/" if commit.get("pid") else ""
        )  # the committed publish's pieces only
        try:
            mans = [
                msgpack.unpackb(m, raw=False)
                for m in self.store.get_batch([f"{pp}m{s}" for s in range(n)])
            ]
        except ObjectNotFoundError as e:
            raise WeightSyncAbortedError(
                f"{self.model} v{v}: a manifest is missing ({e}); kept version {self.version}"
            ) from None
        # full tensors, in the published dtype
        specs: dict = {}
        for m in mans:
            for p in m["pieces"]:
                spec = specs.setdefault(p["name"], [p["dtype"], p["gshape"], 0])
                if spec[0] != p["dtype"] or spec[1] != p["gshape"]:
                    raise WeightSyncAbortedError(
                        f"{self.model} v{v}: shards disagree on {p['name']!r}"
                    )
                c = 1
                for d in p["shape"]:
                    c *= d
                spec[2] += c
        if strict and targets and set(targets) != set(specs):
            missing, extra = sorted(set(specs) - set(targets)), sorted(set(targets) - set(specs))
            raise ValueError(
                f"{self.model} v{v}: names differ (not in into: {missing[:5]}; not published: "
                f"{extra[:5]}); kept version {self.version}"
            )
        staged = {}
        for name, (dt, gshape, count) in specs.items():
            numel = 1
            for d in gshape:
                numel *= d
            if count != numel:
                raise WeightSyncAbortedError(
                    f"{self.model} v{v}: pieces of {name!r} cover {count} of {numel} elements"
                )
            if name in targets and tuple(targets[name].shape) != tuple(gshape):
                raise ValueError(
                    f"{self.model} v{v}: {name!r} has shape {tuple(gshape)}, into has "
                    f"{tuple(targets[name].shape)}; kept version {self.version}"
                )
            pub, tdt = _dtype_of(dt), (targets[name].dtype if name in targets else None)
            if (
                tdt is not None
                and tdt != pub
                and not (tdt.is_floating_point and pub.is_floating_point)
            ):
                raise ValueError(
                    f"{self.model} v{v}: {name!r} is published as {pub}, into has {tdt} (only "
                    f"floating-point tensors are cast); kept version {self.version}"
                )
        buckets = [
            (b[0], b[1], [p for p in m["pieces"] if p["bucket"] == i])
            for m in mans
            for i, b in enumerate(m["buckets"])
        ]
        views: dict = {}  # name -> read-only tensor over the store's memory (install="view")
        if view_mode and buckets:
            import numpy as np

            bviews, _ = self.store._local_views([b[0] for b in buckets])
            with warnings.catch_warnings():
                warnings.filterwarnings(
                    "ignore", message="The given (buffer|NumPy array) is not writable"
                )
                for b, bv in zip(buckets, bviews):
                    if bv is None:
                        continue
                    for p in b[2]:
                        dt = _dtype_of(p["dtype"])
                        tgt = targets.get(p["name"])
                        if (
                            p["shape"] != p["gshape"]
                            or not p["nbytes"]
                            or p["boff"] + p["nbytes"] > len(bv)
                            or (dtype is not None and dt.is_floating_point and dt != dtype)
                            or (tgt is not None and tgt.dtype != dt)
                        ):
                            continue
                        if p["digest"] is not None:
                            flat = torch.frombuffer(
                                bv[p["boff"] : p["boff"] + p["nbytes"]], dtype=torch.uint8
                            )
                            if (
                                _piece_digest(flat, str(p["digest"]).partition(":")[0])
                                != p["digest"]
                            ):
                                raise WeightSyncAbortedError(
                                    f"{self.model} v{v}: checksum of {p['name']!r} differs; "
                                    f"kept version {self.version}"
                                )
                        # through a NumPy array: torch keeps it alive as long as any tensor
                        # shares the bytes, and its finalizer tells when none does
                        arr = np.frombuffer(bv[p["boff"] : p["boff"] + p["nbytes"]], dtype=np.uint8)
                        self._refs[v] = self._refs.get(v, 0) + 1
                        weakref.finalize(arr, _unref, self._refs, v)
                        views[p["name"]] = torch.from_numpy(arr).view(dt).reshape(p["gshape"])
        for name, (dt, gshape, _count) in specs.items():
            if name in views:
                staged[name] = views[name]
                continue
            spare = self._spare.pop(name, None)
            if (
                spare is not None
                and spare.dtype == _dtype_of(dt)
                and list(spare.shape) == list(gshape)
            ):
                staged[name] = spare  # the last pull's staging tensor: no fresh pages to fault in
            else:
                staged[name] = torch.empty(gshape, dtype=_dtype_of(dt))
        fetched = [b for b in buckets if any(p["name"] not in views for p in b[2])]
        total = sum(b[1] for b in buckets if b not in fetched)  # bytes viewed in place

        def fetch(b):
            for attempt in range(
                3
            ):  # a copy that outlasted its read lease (a loaded host) is redone
                try:
                    return fetch_once(b)
                except LeaseExpiredError:
                    if attempt == 2:
                        raise

        def fetch_once(b):
            key, nb, pieces = b
            # a bucket that is one whole tensor is read straight into the staged tensor
            if len(pieces) == 1 and pieces[0]["shape"] == pieces[0]["gshape"] and nb:
                dst = _byte_view(staged[pieces[0]["name"]])
                self.store.get_into(key, dst)
                return dst
            buf = torch.empty(nb, dtype=torch.uint8)
            if nb:
                self.store.get_into(key, buf)
            return buf

        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ws-get") as ex:
            nxt = ex.submit(fetch, fetched[0]) if fetched else None
            for i, b in enumerate(fetched):
                try:
                    buf = nxt.result()
                except ObjectNotFoundError as e:
                    raise WeightSyncAbortedError(
                        f"{self.model} v{v}: {e} (dropped meanwhile?); kept version {self.version}"
                    ) from None
                if stage_hook is not None:
                    stage_hook(i)
                nxt = ex.submit(fetch, fetched[i + 1]) if i + 1 < len(fetched) else None
                for p in b[2]:
                    if p["name"] in views:
                        continue
                    piece = buf[p["boff"] : p["boff"] + p["nbytes"]]
                    if p["digest"] is not None:
                        if _piece_digest(piece, str(p["digest"]).partition(":")[0]) != p["digest"]:
                            raise WeightSyncAbortedError(
                                f"{self.model} v{v}: checksum of {p['name']!r} differs; "
                                f"kept version {self.version}"
                            )
                    dst = staged[p["name"]]
                    if piece.data_ptr() == (_byte_view(dst).data_ptr() if dst.numel() else -1):
                        continue  # read in place
                    if p["nbytes"]:
                        src = piece.view(dst.dtype).reshape(p["shape"])
                        dst[tuple(slice(o, o + s) for o, s in zip(p["offset"], p["shape"]))].copy_(
                            src
                        )
                total += b[1]
        raw = staged
        if dtype is not None:
            staged = {
                k: (t.to(dtype) if t.is_floating_point() and k not in views else t)
                for k, t in staged.items()
            }
        return staged, raw, total, set(views)


class GroupWeightSync:
    """Bucketed broadcast of weights over a process group, atomic for the whole group.

    Every rank of ``group`` calls :meth:`sync` with its model (or state dict); ``src``
    (a global rank) passes the ``version``. Either every rank installs the new version
    or none does: each bucket is staged into new tensors; after each bucket the group
    agrees (``all_reduce`` of a failure count) whether to go on, so no rank starts bucket
    ``i+1`` after a failure in bucket ``i``; the staged tensors are copied in only after
    the last bucket. On failure every rank raises ``WeightSyncAbortedError`` (the rank that
    failed chains its own error; the others' message names the first failing rank and its
    error) and keeps its previous version; a retry may follow. A rank that dies mid-sync
    (the backend raises, e.g. ``RankFailureError`` of the ``mooncake`` backend) is reported
    the same way on every survivor: ``WeightSyncAbortedError`` chained to the backend's error.

    Must agree across ranks: ``group`` and ``src`` (same on every rank, or the collectives
    do not match up), the names and shapes of the tensors (those of ``src`` are sent; a
    rank whose model lacks a name or has another shape refuses the version, before any
    bucket), and ``version`` (``None`` on the other ranks takes the source's; another value
    refuses the version). Dtypes may differ (values are cast into each rank's tensors);
    ``bucket_bytes`` matters on ``src`` only."""

    def __init__(self, *, group=None, src: int = 0, bucket_bytes: int = 64 << 20):
        if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be an int >= 1, got {bucket_bytes!r}")
        self.group = group
        self.src = src
        self.bucket_bytes = bucket_bytes
        self.version = -1
        self._spare: dict = {}  # staging tensors of the last sync, reused by the next one

    def _coll(self, what: str, fn, *args, **kw):
        """Runs one collective; a failure of the backend (a rank died: ``RankFailureError``,
        a timeout, ...) becomes ``WeightSyncAbortedError`` chained to it."""
        try:
            return fn(*args, group=self.group, **kw)
        except Exception as e:
            v = "(the source's)" if self._new_version is None else self._new_version
            raise WeightSyncAbortedError(
                f"rank {self._rank}: version {v} aborted: {what} failed ({type(e).__name__}: "
                f"{str(e)[:300]}): a rank died or left; kept version {self._prev}"
            ) from e

    def _agree(self, failed: bool) -> int:
        torch = _torch()
        import torch.distributed as dist

        flag = torch.tensor([1 if failed else 0], dtype=torch.int64)
        self._coll("all_reduce", dist.all_reduce, flag, op=dist.ReduceOp.SUM)
        return int(flag.item())

    def _first_error(self, err: BaseException | None, nbytes: int = 1024) -> str:
        """On a failure: the message of the lowest failing rank, sent to every rank (two
        more collectives, on the failure path only)."""
        torch = _torch()
        import torch.distributed as dist

        big = 1 << 62
        who = torch.tensor([self._rank if err is not None else big], dtype=torch.int64)
        self._coll("all_reduce", dist.all_reduce, who, op=dist.ReduceOp.MIN)
        first = int(who.item())
        buf = torch.zeros(nbytes, dtype=torch.uint8)
        if first == self._rank:
            msg = f"{type(err).__name__}: {err}".encode("utf-8", "replace")[:nbytes]
            buf[: len(msg)].copy_(torch.frombuffer(bytearray(msg), dtype=torch.uint8))
        self._coll("broadcast", dist.broadcast, buf, src=first)
        return bytes(buf.numpy()).rstrip(b"\0").decode("utf-8", "replace")

    def sync(
        self,
        model_or_state_dict,
        version: int | None = None,
        *,
        stage_hook: Callable[[int], None] | None = None,
    ) -> GroupSyncResult:
        """Installs ``src``'s tensors as ``version`` on every rank of the group.

        ``model_or_state_dict``: an ``nn.Module`` or a dict of CPU tensors (the same names
        and shapes on every rank; see the class docstring). ``version``: an int >= 0 on
        ``src`` (above the version the ranks hold); ``None`` or the same int elsewhere.
        ``stage_hook(i)`` runs on each rank after bucket ``i`` arrived (tests, validation;
        its exception aborts the sync). Returns :class:`GroupSyncResult`. Raises
        ``ValueError`` on ``src`` for a bad ``version`` (before any collective);
        ``WeightSyncAbortedError`` on every rank when any rank refuses the version (name,
        shape, version mismatch, a stale version; the message names the rank, the tensor
        and both shapes), fails staging a bucket, or dies (the backend's error chained)."""
        torch = _torch()
        import torch.distributed as dist

        rank = dist.get_rank()
        targets = _target_dict(model_or_state_dict)
        is_src = rank == self.src
        prev = self.version
        self._rank, self._prev, self._new_version = rank, prev, version
        header = torch.zeros(2, dtype=torch.int64)
        local_err: BaseException | None = None
        if is_src:
            if isinstance(version, bool) or not isinstance(version, int) or version < 0:
                raise ValueError(f"src must pass version as an int >= 0, got {version!r}")
            names = list(targets)
            plan, cur, cur_b = [], [], 0
            for nme in names:
                nb = targets[nme].numel() * targets[nme].element_size()
                if cur and cur_b + nb > self.bucket_bytes:
                    plan.append(cur)
                    cur, cur_b = [], 0
                cur.append(nme)
                cur_b += nb
            if cur:
                plan.append(cur)
            man = msgpack.packb(
                {
                    "version": version,
                    "buckets": [
                        [[n, _dtype_name(targets[n].dtype), list(targets[n].shape)] for n in b]
                        for b in plan
                    ],
                }
            )
            header[0], header[1] = len(man), version
        self._coll("broadcast of the manifest", dist.broadcast, header, src=self.src)
        mbuf = torch.empty(int(header[0]), dtype=torch.uint8)
        if is_src:
            mbuf.copy_(torch.frombuffer(bytearray(man), dtype=torch.uint8))
        self._coll("broadcast of the manifest", dist.broadcast, mbuf, src=self.src)
        new_version = self._new_version = int(header[1])
        man = msgpack.unpackb(mbuf.numpy().tobytes(), raw=False)
        buckets = man["buckets"]
        try:
            if (
                not is_src
                and version is not None
                and (isinstance(version, bool) or version != new_version)
            ):
                raise ValueError(
                    f"rank {rank} passed version {version!r}, src {self.src} sends {new_version}: every "
                    "rank must pass the source's version (or None)"
                )
            if new_version <= prev:
                raise StaleVersionError(
                    f"rank {rank} holds version {prev}; will not install {new_version}"
                )
            for b in buckets:
                for n, _dt, shape in b:
                    if n not in targets:
                        raise ValueError(f"rank {rank}: {n!r} is not in the model")
                    if list(targets[n].shape) != shape:
                        raise ValueError(
                            f"rank {rank}: {n!r} has shape {tuple(targets[n].shape)}, src sends "
                            f"{tuple(shape)}"
                        )
        except Exception as e:
            local_err = e
        if self._agree(local_err is not None):
            first = self._first_error(local_err)
            raise WeightSyncAbortedError(
                f"rank {rank}: the group refused version {new_version} before any bucket "
                f"({first}); kept version {prev}"
            ) from local_err
        staged: dict = {}
        total = 0

        def staging(n, d, s):
            t = self._spare.pop(n, None)  # the last sync's staging tensor: no fresh pages
            return (
                t
                if t is not None and t.dtype == d and list(t.shape) == list(s)
                else torch.empty(s, dtype=d)
            )

        for i, b in enumerate(buckets):
            specs = [(n, _dtype_of(dt), shape) for n, dt, shape in b]
            sizes = [torch.empty(0, dtype=d).element_size() * _numel(s) for _, d, s in specs]
            direct = len(specs) == 1 and sizes[0] > 0
            if direct:  # one tensor: broadcast its bytes in place (src) / into its staging tensor
                if is_src:
                    buf = _byte_view(targets[specs[0][0]])
                else:
                    staged[specs[0][0]] = staging(*specs[0])
                    buf = _byte_view(staged[specs[0][0]])
            else:
                buf = torch.empty(sum(sizes), dtype=torch.uint8)
            if is_src and not direct:
                off = 0
                for (n, _, _), sz in zip(specs, sizes):
                    if sz:
                        buf[off : off + sz].copy_(_byte_view(targets[n]))
                    off += sz
            self._coll(f"broadcast of bucket {i}", dist.broadcast, buf, src=self.src)
            total += buf.numel()
            try:
                if stage_hook is not None:
                    stage_hook(i)
                if not is_src and not direct:
                    off = 0
                    for (n, d, s), sz in zip(specs, sizes):
                        t = staging(n, d, s)
                        if sz:
                            _byte_view(t).copy_(buf[off : off + sz])
                        staged[n] = t
                        off += sz
            except Exception as e:
                local_err = e
            if self._agree(local_err is not None):
                first = self._first_error(local_err)
                raise WeightSyncAbortedError(
                    f"rank {rank}: version {new_version} aborted at bucket {i} (a rank "
                    f"failed staging it: {first}); kept version {prev}"
                ) from local_err
        with torch.no_grad():
            for n, t in staged.items():
                targets[n].copy_(t)
        self._spare = staged
        self.version = new_version
        return GroupSyncResult(new_version, prev, len(buckets), total)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
