"""The process-group path of weight sync: :class:`GroupWeightSync`.

A bucketed broadcast from a source rank, atomic for the whole group (see ``sync.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import msgpack

from ..common.errors import (
    StaleVersionError,
    WeightSyncAbortedError,
)
from .common import (
    GroupSyncResult,
    _byte_view,
    _dtype_name,
    _dtype_of,
    _numel,
    _target_dict,
    _torch,
)

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist


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
    ``bucket_bytes`` matters on ``src`` only.
    """

    def __init__(
        self, *, group: dist.ProcessGroup | None = None, src: int = 0, bucket_bytes: int = 64 << 20
    ):
        if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ValueError(
                f"GroupWeightSync: bucket_bytes must be an int >= 1, got {bucket_bytes!r}"
            )
        self.group = group
        self.src = src
        self.bucket_bytes = bucket_bytes
        self.version = -1
        self._spare: dict = {}  # staging tensors of the last sync, reused by the next one
        # bucket i's bytes, kept between syncs: a fresh buffer costs a page fault per 4 KiB
        # (on the 2-core VM about as long as the copy into it); a version stays staged in
        # them, as views, until it is installed
        self._bufs: list = []

    def _bucket_buffer(self, i: int, nbytes: int):
        torch = _torch()
        while len(self._bufs) <= i:
            self._bufs.append(None)
        buf = self._bufs[i]
        if buf is None or buf.numel() < nbytes:
            buf = self._bufs[i] = torch.empty(nbytes, dtype=torch.uint8)
        return buf[:nbytes]

    def _coll(self, what: str, fn, *args, **kw):
        """Runs one collective; a failure of the backend becomes ``WeightSyncAbortedError``.

        The failure (a rank died: ``RankFailureError``, a timeout, ...) is chained to it.
        """
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
        """On a failure: the message of the lowest failing rank, sent to every rank.

        Two more collectives, on the failure path only.
        """
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
        model_or_state_dict: torch.nn.Module | dict[str, torch.Tensor],
        version: int | None = None,
        *,
        stage_hook: Callable[[int], None] | None = None,
    ) -> GroupSyncResult:
        """Installs ``src``'s tensors as ``version`` on every rank of the group.

        Args:
            model_or_state_dict: an ``nn.Module`` or a dict of CPU tensors (the same names and
                shapes on every rank; see the class docstring).
            version: an int >= 0 on ``src`` (above the version the ranks hold); ``None`` or the same
                int elsewhere.
            stage_hook: ``stage_hook(i)`` runs on each rank after bucket ``i`` arrived (tests,
                validation; its exception aborts the sync).

        Returns:
            :class:`GroupSyncResult`.

        Raises:
            ValueError: on ``src`` for a bad ``version`` (before any collective).
            WeightSyncAbortedError: on every rank when any rank refuses the version (name, shape,
                version mismatch, a stale version; the message names the rank, the tensor and both
                shapes), fails staging a bucket, or dies (the backend's error chained).
        """
        torch = _torch()
        import torch.distributed as dist

        rank = dist.get_rank()
        group_ranks = dist.get_process_group_ranks(self.group or dist.group.WORLD)
        if (
            isinstance(self.src, bool)
            or not isinstance(self.src, int)
            or self.src not in group_ranks
        ):
            # every rank sees the same src and group: all refuse, before any collective
            raise ValueError(
                f"GroupWeightSync.sync (rank {rank}): src must be a (global) rank of the group "
                f"{group_ranks}, got {self.src!r}"
            )
        targets = _target_dict(model_or_state_dict, f"GroupWeightSync.sync (rank {rank})")
        is_src = rank == self.src
        prev = self.version
        self._rank, self._prev, self._new_version = rank, prev, version
        header = torch.zeros(2, dtype=torch.int64)
        local_err: BaseException | None = None
        if is_src:
            if isinstance(version, bool) or not isinstance(version, int) or version < 0:
                raise ValueError(
                    f"GroupWeightSync.sync (rank {rank}): src must pass version as an int >= 0, "
                    f"got {version!r}"
                )
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
                    f"GroupWeightSync.sync (rank {rank}): passed version {version!r}, src {self.src} sends {new_version}: every "
                    "rank must pass the source's version (or None)"
                )
            if new_version <= prev:
                raise StaleVersionError(
                    f"GroupWeightSync.sync (rank {rank}): holds version {prev}; will not install {new_version}"
                )
            for b in buckets:
                for n, _dt, shape in b:
                    if n not in targets:
                        raise ValueError(
                            f"GroupWeightSync.sync (rank {rank}): {n!r} is not in the model"
                        )
                    if list(targets[n].shape) != shape:
                        raise ValueError(
                            f"GroupWeightSync.sync (rank {rank}): {n!r} has shape {tuple(targets[n].shape)}, src sends "
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
        in_bucket: set = set()  # names staged as views of a bucket buffer
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
                buf = self._bucket_buffer(i, sum(sizes))
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
                        esz = torch.empty(0, dtype=d).element_size()
                        if sz and off % esz == 0:  # aligned: stage as a view, no copy
                            staged[n] = buf[off : off + sz].view(d).view(s)
                            in_bucket.add(n)
                        else:
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
        self._spare = {n: t for n, t in staged.items() if n not in in_bucket}
        self.version = new_version
        return GroupSyncResult(new_version, prev, len(buckets), total)
