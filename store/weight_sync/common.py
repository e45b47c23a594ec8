"""What :class:`~mooncake_store.WeightSync` and :class:`~mooncake_store.GroupWeightSync` share.

Their result records, tensor digests, dtype names, byte views of tensors, and the pieces of a
(possibly sharded, DTensor) state dict that one shard writes.
"""

from __future__ import annotations

import functools
import hashlib
import sys
from typing import TYPE_CHECKING, NamedTuple

from ..client.args import copyable
from ..common.errors import WeightSyncAbortedError

if TYPE_CHECKING:
    import torch


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
    #: this reader's place in the version's chain of relay hosts (0: reads from the
    #: publisher's host), None when it was no relay (``WeightSyncConfig.relay``)
    relay_position: int | None = None
    #: when each phase of the pull happened (``timeline.PullEvent`` tuples, in time order)
    timeline: tuple = ()


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
    """``algo:hex`` digest of a uint8 tensor's bytes.

    ``xxh3`` (XXH3-128, xxhash) or ``blake2b`` (BLAKE2b-128, hashlib).
    """
    buf = data.numpy() if data.numel() else b""
    if algo == "xxh3":
        import xxhash

        return "xxh3:" + xxhash.xxh3_128_hexdigest(buf)
    if algo == "blake2b":
        return "blake2b:" + hashlib.blake2b(buf, digest_size=16).hexdigest()
    raise WeightSyncAbortedError(f"unknown checksum algorithm {algo!r} in a manifest")


class _StreamDigests:
    """Digests of a bucket's pieces, fed part by part while the bucket's later parts are on the wire.

    ``pieces``: the manifest's pieces of one bucket (``boff``, ``nbytes``, ``digest``); parts must be
    fed in order of their offsets. :meth:`result` gives a piece's ``algo:hex`` once every byte of it
    was fed, else None (the caller digests it whole).
    """

    def __init__(self, pieces: list):
        self._todo = []  # [boff, end, algo, hasher, name], by offset
        for p in pieces:
            algo = str(p["digest"]).partition(":")[0] if p["digest"] is not None else None
            if algo in ("xxh3", "blake2b") and p["nbytes"]:
                if algo == "xxh3":
                    import xxhash

                    h = xxhash.xxh3_128()
                else:
                    h = hashlib.blake2b(digest_size=16)
                self._todo.append([p["boff"], p["boff"] + p["nbytes"], algo, h, p["name"]])
        self._todo.sort(key=lambda e: e[0])
        self._fed = 0  # bytes of the bucket fed so far (parts come in order)
        self._done: dict = {}  # (name, boff) -> "algo:hex"

    def feed(self, data, offset: int) -> None:
        """Feeds the bucket's bytes ``[offset, offset + len(data))`` (a flat uint8 tensor)."""
        if offset != self._fed:  # out of order: nothing more is digested on the way
            self._todo = []
            return
        end = offset + data.numel()
        self._fed = end
        while self._todo and self._todo[0][0] < end:
            boff, pend, algo, h, name = self._todo[0]
            lo, hi = max(boff, offset), min(pend, end)
            if hi > lo:
                h.update(data[lo - offset : hi - offset].numpy())
            if pend > end:
                break
            self._done[(name, boff)] = f"{algo}:{h.hexdigest()}"
            self._todo.pop(0)

    def result(self, piece: dict) -> str | None:
        """The digest of ``piece`` if all its bytes were fed, else None."""
        return self._done.get((piece["name"], piece["boff"]))


def _default_algo() -> str:
    try:
        import xxhash  # noqa: F401

        return "xxh3"
    except ImportError:
        return "blake2b"


def tensor_digest(t: torch.Tensor) -> str:
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
def _dtype_name(dt) -> str:
    return str(dt).removeprefix("torch.")


def _dtype_of(name: str):
    dt = getattr(_torch(), name, None)
    if not isinstance(dt, _torch().dtype):
        raise WeightSyncAbortedError(f"unknown dtype {name!r} in a manifest")
    return dt


def _target_dict(into, where: str) -> dict:
    torch = _torch()
    if into is None:
        return {}
    if isinstance(into, torch.nn.Module):
        return into.state_dict(keep_vars=True)
    if isinstance(into, dict):
        return into
    raise ValueError(
        f"{where}: into must be an nn.Module, a dict of tensors or None, got {type(into).__name__}"
    )


def _local_pieces(state_dict: dict, shard: int, num_shards: int, where: str) -> list:
    """[(name, dtype, global_shape, offset, local_tensor)] this shard writes.

    Errors start with ``where`` (the model and the op).
    """
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
            raise ValueError(f"{where}: state dict keys must be non-empty str, got {name!r}")
        if not isinstance(t, torch.Tensor):
            raise ValueError(
                f"{where}: state dict entry {name!r} is a {type(t).__name__}, not a tensor"
            )
        if not (DTensor is not None and isinstance(t, DTensor)) and (
            t.layout != torch.strided or t.is_nested
        ):
            raise ValueError(
                f"{where}: {name!r}: tensors must be dense (strided), got layout {t.layout}"
                + (" (nested)" if t.is_nested else "")
            )
        if not (DTensor is not None and isinstance(t, DTensor)) and (t.is_conj() or t.is_neg()):
            t = t.resolve_conj().resolve_neg()  # the flag's meaning into the bytes published
        if not copyable(t.dtype):
            raise ValueError(
                f"{where}: {name!r}: dtype {t.dtype} cannot be published: torch has no copy kernel for it, so "
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
                        f"{where}: {name!r}: placement {p} is not supported (Shard or Replicate only)"
                    )
            if skip:
                continue
            local_shape, offset = compute_local_shape_and_global_offset(
                t.shape, t.device_mesh, t.placements
            )
            local = t.to_local()
            if local.layout != torch.strided:
                raise ValueError(
                    f"{where}: {name!r}: tensors must be dense (strided), got layout {local.layout}"
                )
            if local.device.type != "cpu":
                raise ValueError(
                    f"{where}: {name!r}: tensors must be on the CPU, got {local.device}"
                )
            if tuple(local.shape) != tuple(local_shape):
                raise ValueError(
                    f"{where}: {name!r}: local shard shape {tuple(local.shape)} != expected {tuple(local_shape)}"
                )
            out.append((name, t.dtype, list(t.shape), [int(o) for o in offset], local))
        else:
            if t.device.type != "cpu":
                raise ValueError(f"{where}: {name!r}: tensors must be on the CPU, got {t.device}")
            if shard == 0:
                out.append((name, t.dtype, list(t.shape), [0] * t.dim(), t))
    return out


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
