"""``mooncake_pg``: the ``"mooncake"`` backend for ``torch.distributed``.

Importing this package registers the backend::

    import torch.distributed as dist
    import mooncake_pg
    dist.init_process_group("mooncake", rank=r, world_size=w, init_method=...)

Options go in ``pg_options=MooncakeOptions(...)``; groups made without options
(``new_group``, DeviceMesh) inherit the default group's options. The functions here take
``group=None`` for the default group; each raises ``ValueError`` when the group's CPU
backend is not ``mooncake``.
"""

from __future__ import annotations

import numbers
import operator
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ._loader import _C
from .config import MooncakeOptions, env_defaults
from .errors import RankFailureError, RankFencedError
from .hardware import WITH_CUDA, WITH_RDMA, RdmaDevice, RdmaPort, rdma_devices

if TYPE_CHECKING:
    from ._C import MooncakeBackend

__all__ = [
    "BACKEND_NAME",
    "WITH_CUDA",
    "WITH_RDMA",
    "MooncakeOptions",
    "RankFailureError",
    "RankFencedError",
    "RdmaDevice",
    "RdmaPort",
    "backend_of",
    "cuda_path",
    "deactivate_ranks",
    "env_defaults",
    "get_active_ranks",
    "get_epoch",
    "get_failed_ranks",
    "get_pending_ranks",
    "get_rank_hosts",
    "is_joining",
    "join_group",
    "leave_group",
    "rdma_devices",
    "recover_ranks",
    "sync_state",
]

BACKEND_NAME = "mooncake"

from ._backend import _register  # noqa: E402  (needs _C loaded and the names above)

_register()


def backend_of(group: dist.ProcessGroup | None = None) -> MooncakeBackend:
    """The ``mooncake`` backend object of ``group``.

    Exposes ``transport`` (``"shm"`` or ``"tcp"``) and ``ops_issued``.

    Args:
        group: a process group; ``None`` for the default group.

    Returns:
        The C++ backend (``mooncake_pg._C.MooncakeBackend``) serving ``group``'s CPU tensors.

    Raises:
        ValueError: the group's CPU backend is not ``mooncake``.
    """
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    be = pg._get_backend(torch.device("cpu"))
    if not isinstance(be, _C.MooncakeBackend):
        raise ValueError(
            f"backend_of: the group's CPU backend is {type(be).__name__}, not mooncake"
        )
    return be


def get_active_ranks(group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Which seats of ``group`` take part in its ops.

    Args:
        group: a process group; ``None`` for the default group.

    Returns:
        ``int32 [world_size]`` CPU tensor (``world_size`` = ``max_group_size``): 1 for the
        seats taking part, 0 for failed or empty ones. The same on every active rank once
        they have run an op in the same epoch.
    """
    return torch.tensor(backend_of(group).active_ranks(), dtype=torch.int32)


def get_epoch(group: dist.ProcessGroup | None = None) -> int:
    """Membership epoch of ``group``: the number of membership changes applied so far.

    Args:
        group: a process group; ``None`` for the default group.

    Returns:
        The epoch, equal on every active rank between two ops.
    """
    return int(backend_of(group).epoch())


def get_rank_hosts(group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The host of each seat of ``group``, as the backend groups ranks.

    The grouping is ``MOONCAKE_HOST_ID`` (default hostname + boot id), the one the
    two-level collectives use. Hosts are numbered in the order of their lowest active
    rank, and a seat that is not active (failed, or an empty extension seat) counts as a
    host of its own. Recomputed at every membership change.

    Args:
        group: a process group; ``None`` for the default group.

    Returns:
        ``int32 [world_size]`` CPU tensor; equal values mean one host. The same on every
        rank of one epoch.
    """
    return torch.tensor(backend_of(group).rank_hosts(), dtype=torch.int32)


def get_failed_ranks(work: dist.Work) -> list[int]:
    """The ranks whose failure made ``work`` fail.

    For ops issued with ``async_op=False`` catch :class:`RankFailureError` instead.

    Args:
        work: the ``Work`` an op with ``async_op=True`` returned.

    Returns:
        The agreed failed ranks (``[]`` if ``work`` did not fail that way).
    """
    return list(getattr(work, "failed_ranks", []))


def _seat_list(op: str, ranks: Iterable[int]) -> list[int]:
    """``ranks`` as a list of ints, checked before the backend is asked.

    Raises:
        ValueError: a float, a bool, a string or a non-iterable, naming ``op``'s argument.
    """
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


def deactivate_ranks(group: dist.ProcessGroup | None, ranks: Iterable[int]) -> None:
    """Takes ``ranks`` out of ``group`` (epoch + 1).

    With ``on_failure="manual"`` every survivor calls this with the failed ranks before
    further ops; it is agreed through the control store, so survivors that pass the same
    ranks end in the same epoch. A rank that names only itself leaves the group (see
    :func:`leave_group`).

    Args:
        group: a process group; ``None`` for the default group.
        ranks: seats of ``group`` (group ranks) to deactivate.

    Raises:
        ValueError: a rank that is not an int or is outside ``[0, world_size)``, or the
            caller's own rank named together with others.
    """
    seats = _seat_list("deactivate_ranks", ranks)
    backend_of(group).deactivate_ranks(seats)


def leave_group(group: dist.ProcessGroup | None = None) -> None:
    """This rank leaves ``group`` for good (a preemption notice, a scale-down), between two ops.

    The leave is agreed like a failure (epoch + 1) but needs no timeout or death: the
    others' next op notices it within about 0.1 s while waiting for this rank and runs over
    the remaining ranks under every ``on_failure`` policy (the leaver sent nothing for that
    op, so nothing is lost); its seat is inactive (:func:`get_active_ranks`) and
    :func:`recover_ranks` can refill it as after a death. Afterwards every op of this rank
    on ``group`` raises ``DistBackendError``. The same as
    ``deactivate_ranks(group, [own rank])``. In the other ranks' processes the leaver
    counts as failed in every group that contains it (as an agreed failure does), so a
    rank that goes away for good leaves each of its groups.

    Args:
        group: a process group; ``None`` for the default group.
    """
    be = backend_of(group)
    be.deactivate_ranks([be.rank()])


def get_pending_ranks(group: dist.ProcessGroup | None = None) -> list[int]:
    """Seats of ``group`` whose replacement process asked to join and is not admitted yet.

    A replacement asks by creating the group with ``MooncakeOptions(is_recovery=True)``.

    Args:
        group: a process group; ``None`` for the default group.

    Returns:
        Group ranks, ascending; may differ between ranks until they agree in
        :func:`recover_ranks`.
    """
    return list(backend_of(group).pending_ranks())


def recover_ranks(group: dist.ProcessGroup | None, ranks: Iterable[int]) -> list[int]:
    """Admits replacement ranks into ``group``.

    Every active rank calls it between the same two ops (usually with
    ``get_pending_ranks(group)``); the union of their arguments is admitted (a no-op when
    empty), the epoch goes up by one and the group's transport is rebuilt over the new
    member set. Pending p2p ops fail.

    Args:
        group: a process group; ``None`` for the default group.
        ranks: group ranks to admit.

    Returns:
        The admitted ranks, the same list on every caller (``[]`` when none), so callers
        know to run :func:`sync_state`.

    Raises:
        ValueError: a rank that is not an int, is active, is out of range, or has no
            replacement waiting.
    """
    seats = _seat_list("recover_ranks", ranks)
    be = backend_of(group)
    before = be.epoch()
    be.recover_ranks(seats)
    return list(be.last_joined()) if be.epoch() != before else []


def is_joining(group: dist.ProcessGroup | None = None) -> bool:
    """Whether this process must call :func:`join_group` before any op of ``group``.

    ``True`` on a process that created ``group`` with ``is_recovery`` (a replacement for a
    dead rank, or a process for an extension seat; ``mooncake-run`` sets
    ``MOONCAKE_IS_RECOVERY=1`` on respawned ranks) and has not joined it yet.

    Args:
        group: a process group; ``None`` for the default group.
    """
    return bool(backend_of(group).joining)


def join_group(group: dist.ProcessGroup | None = None, timeout: float = 300.0) -> None:
    """On a replacement rank (``is_recovery=True``): blocks until the survivors admit it.

    The survivors admit it with :func:`recover_ranks`. Recreate subgroups in the order
    the survivors created them and join each one.

    Args:
        group: a process group; ``None`` for the default group.
        timeout: seconds to wait, in ``(0, 1e9]``.

    Raises:
        ValueError: ``timeout`` is not a number in ``(0, 1e9]``.
        torch.distributed.DistBackendError: not admitted within ``timeout``.
    """
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


def sync_state(
    module: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    src: int | None = None,
    group: dist.ProcessGroup | None = None,
    step: int | None = None,
) -> int | None:
    """Hands a rejoined rank the training state.

    Sends parameters and buffers of ``module``, ``optimizer`` state (tensors, step
    counters, hyper-parameters), the torch RNG state and a step counter. Collective over
    ``group`` (the rejoined ranks and the survivors). Metadata travels as JSON (never
    unpickled); tensors are broadcast in place.

    Args:
        module: its parameters and buffers are overwritten on every rank but ``src``; the
            same structure on every rank.
        optimizer: its state likewise; the same structure on every rank.
        src: the global rank that sends; default the lowest active rank that did not just
            join.
        group: a process group; ``None`` for the default group.
        step: ``src``'s step counter (ignored on the other ranks).

    Returns:
        ``src``'s ``step`` (an int, or ``None`` if ``src`` passed none) on every rank.

    Raises:
        RankFailureError: a rank died meanwhile.
        ValueError: no active rank that did not just join, for the default ``src``.
    """
    from ._sync import sync_state as _impl

    return _impl(module, optimizer, src, group, step)


def cuda_path(group: dist.ProcessGroup | None = None) -> str:
    """How the group moves CUDA tensors for its four IPC-capable collectives.

    The collectives are ``all_reduce``, ``broadcast``, ``all_gather_into_tensor`` and
    ``reduce_scatter_tensor``; other ops always stage for now.

    Args:
        group: a process group; ``None`` for the default group.

    Returns:
        ``"ipc"`` (CUDA IPC buffers and reduction kernels, every rank on this host),
        ``"staging: <why not>"`` (pinned host staging over the group's transport), or
        ``"unavailable: <why>"`` on a build without CUDA.
    """
    return backend_of(group)._cuda_ipc_status()
