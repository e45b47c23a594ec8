"""``mooncake_pg``: the ``"mooncake"`` backend for ``torch.distributed``.

Importing this package registers the backend::

    import torch.distributed as dist
    import mooncake_pg
    dist.init_process_group("mooncake", rank=r, world_size=w, init_method=...)

Options go in ``pg_options=MooncakeOptions(...)``; groups made without options
(``new_group``, DeviceMesh) inherit the default group's options.
"""

from __future__ import annotations

import numbers
import operator

import torch  # noqa: F401  (must be imported before the extension)
import torch.distributed as dist

from ._loader import load_extension
from .config import MooncakeOptions, env_defaults
from .errors import RankFailureError, RankFencedError

_C = load_extension()

__all__ = ["BACKEND_NAME", "MooncakeOptions", "RankFailureError", "RankFencedError", "env_defaults"]

BACKEND_NAME = "mooncake"

from ._backend import _register  # noqa: E402

_register()


def backend_of(group=None):
    """The ``mooncake`` backend object of ``group`` (default: the default group).

    Exposes ``transport`` (``"shm"`` or ``"tcp"``) and ``ops_issued``. Raises
    ``ValueError`` if the group's CPU backend is not ``mooncake``.
    """
    import torch as _torch

    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    be = pg._get_backend(_torch.device("cpu"))
    if not isinstance(be, _C.MooncakeBackend):
        raise ValueError(
            f"backend_of: the group's CPU backend is {type(be).__name__}, not mooncake"
        )
    return be


__all__.append("backend_of")


def get_active_ranks(group=None):
    """``torch.int32`` tensor of shape ``[world_size]`` (= ``max_group_size``): 1 for the
    seats taking part in ``group``'s ops, 0 for failed or empty ones. The same on every
    active rank once they have run an op in the same epoch."""
    import torch as _torch

    return _torch.tensor(backend_of(group).active_ranks(), dtype=_torch.int32)


def get_epoch(group=None) -> int:
    """Membership epoch of ``group``: the number of membership changes applied so far."""
    return int(backend_of(group).epoch())


def get_rank_hosts(group=None):
    """``torch.int32`` tensor of shape ``[world_size]``: the host of each seat of ``group``,
    as the backend groups ranks (``MOONCAKE_HOST_ID``, default hostname + boot id; the
    grouping the two-level collectives use). Equal values mean one host; hosts are numbered
    in the order of their lowest active rank, and a seat that is not active (failed, or an
    empty extension seat) counts as a host of its own. Recomputed at every membership
    change; the same on every rank of one epoch."""
    import torch as _torch

    return _torch.tensor(backend_of(group).rank_hosts(), dtype=_torch.int32)


def get_failed_ranks(work) -> list:
    """The ranks whose failure made ``work`` fail (``[]`` if it did not fail that way).
    For ops issued with ``async_op=False`` catch :class:`RankFailureError` instead."""
    return list(getattr(work, "failed_ranks", []))


def _seat_list(op: str, ranks) -> list:
    """``ranks`` as a list of ints; anything else (a float, a bool, a string, a
    non-iterable) raises ``ValueError`` naming ``op``'s argument, before the backend is asked."""
    try:
        if isinstance(ranks, (str, bytes)):
            raise TypeError
        out = []
        for r in ranks:
            if isinstance(r, bool):
                raise TypeError
            out.append(operator.index(r))
    except TypeError:
        raise ValueError(
            f"{op}: ranks must be a sequence of int seat numbers, got {ranks!r}"
        ) from None
    return out


def deactivate_ranks(group, ranks) -> None:
    """Takes ``ranks`` out of ``group`` (epoch + 1). With ``on_failure="manual"`` every
    survivor calls this with the failed ranks before further ops; it is agreed through
    the control store, so survivors that pass the same ranks end in the same epoch.
    A rank that names only itself leaves the group (see :func:`leave_group`).
    Raises ``ValueError`` for a rank that is not an int or is outside ``[0, world_size)``,
    or for the caller's own rank named together with others."""
    seats = _seat_list("deactivate_ranks", ranks)
    backend_of(group).deactivate_ranks(seats)


def leave_group(group=None) -> None:
    """This rank leaves ``group`` for good (a preemption notice, a scale-down), between two
    ops. The leave is agreed like a failure (epoch + 1) but needs no timeout or death: the
    others' next op notices it within about 0.1 s while waiting for this rank and runs over
    the remaining ranks under every ``on_failure`` policy (the leaver sent nothing for that
    op, so nothing is lost); its seat is inactive (``get_active_ranks``) and ``recover_ranks``
    can refill it as after a death. Afterwards every op of this rank on ``group`` raises
    ``DistBackendError``. The same as ``deactivate_ranks(group, [own rank])``. In the other
    ranks' processes the leaver counts as failed in every group that contains it (as an
    agreed failure does), so a rank that goes away for good leaves each of its groups."""
    be = backend_of(group)
    be.deactivate_ranks([be.rank()])


__all__ += [
    "deactivate_ranks",
    "get_active_ranks",
    "get_epoch",
    "get_failed_ranks",
    "get_rank_hosts",
    "leave_group",
]


def get_pending_ranks(group=None) -> list:
    """Seats of ``group`` whose replacement process asked to join (it created the group
    with ``MooncakeOptions(is_recovery=True)``) and is not admitted yet."""
    return list(backend_of(group).pending_ranks())


def recover_ranks(group, ranks) -> list:
    """Admits replacement ranks into ``group``. Every active rank calls it between the same
    two ops (usually with ``get_pending_ranks(group)``); the union of their arguments is
    admitted (a no-op when empty), the epoch goes up by one and the group's transport is
    rebuilt over the new member set. Pending p2p ops fail. Returns the admitted ranks (the
    same list on every caller; ``[]`` when none), so callers know to run ``sync_state``.
    Raises ``ValueError`` for a rank that is not an int, is active, out of range, or has
    no replacement waiting."""
    seats = _seat_list("recover_ranks", ranks)
    be = backend_of(group)
    before = be.epoch()
    be.recover_ranks(seats)
    return list(be.last_joined()) if be.epoch() != before else []


def is_joining(group=None) -> bool:
    """``True`` on a process that created ``group`` with ``is_recovery`` (a replacement for
    a dead rank, or a process for an extension seat; ``mooncake-run`` sets
    ``MOONCAKE_IS_RECOVERY=1`` on respawned ranks) and has not joined it yet: it must call
    :func:`join_group` before any op."""
    return bool(backend_of(group).joining)


def join_group(group=None, timeout: float = 300.0) -> None:
    """On a replacement rank (``is_recovery=True``): blocks until the survivors admitted it
    with ``recover_ranks`` (seconds; raises ``DistBackendError`` after ``timeout``). Recreate
    subgroups in the order the survivors created them and join each one. Raises
    ``ValueError`` for a ``timeout`` that is not a number in ``(0, 1e9]`` seconds."""
    from .config import MAX_TIMEOUT_S

    # the backend's deadline is int64 nanoseconds: past MAX_TIMEOUT_S it overflows
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, numbers.Real)
        or not (0 < timeout <= MAX_TIMEOUT_S)
    ):
        raise ValueError(
            f"join_group: timeout must be seconds in (0, {MAX_TIMEOUT_S:g}], got {timeout!r}"
        )
    backend_of(group).join_group(float(timeout))


def sync_state(module=None, optimizer=None, src=None, group=None, step=None):
    """Hands a rejoined rank the training state: parameters and buffers of ``module``,
    ``optimizer`` state (tensors, step counters, hyper-parameters), the torch RNG state and
    a step counter. Collective over ``group`` (the rejoined ranks and the survivors), with
    the same ``module``/``optimizer`` structure everywhere. ``src`` (a global rank)
    defaults to the lowest active rank that did not just join. Returns ``src``'s ``step``
    (an int, or ``None`` if ``src`` passed none) on every rank. Metadata travels as JSON
    (never unpickled); tensors are broadcast in place. A rank dying meanwhile raises
    ``RankFailureError``."""
    from ._sync import sync_state as _impl

    return _impl(module, optimizer, src, group, step)


__all__ += ["get_pending_ranks", "is_joining", "join_group", "recover_ranks", "sync_state"]

from .hardware import WITH_CUDA, WITH_RDMA, RdmaDevice, RdmaPort, rdma_devices  # noqa: E402

__all__ += ["WITH_CUDA", "WITH_RDMA", "RdmaDevice", "RdmaPort", "rdma_devices"]


def cuda_path(group=None) -> str:
    """How ``all_reduce``, ``broadcast``, ``all_gather_into_tensor`` and
    ``reduce_scatter_tensor`` move CUDA tensors in ``group`` (default: the default group):
    ``"ipc"`` (CUDA IPC buffers and reduction kernels, every rank on this host),
    ``"staging: <why not>"`` (pinned host staging over the group's transport), or
    ``"unavailable: <why>"`` on a build without CUDA. Other ops always stage for now."""
    return backend_of(group)._cuda_ipc_status()


__all__.append("cuda_path")
