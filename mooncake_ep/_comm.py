"""Collective helpers that :mod:`mooncake_ep.buffer`, :mod:`mooncake_ep.moe` and
:mod:`mooncake_ep._nvshmem` share; this module imports none of them."""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_single(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None
) -> None:
    """``torch.distributed.all_gather_single`` (torch 2.13's name), or
    ``all_gather_into_tensor`` on a torch without it (on 2.13 the old name warns
    ``FutureWarning``).

    Args:
        output: [W * n] of ``input``'s dtype and device (``W`` ranks in the group); rank
            ``r``'s ``input`` lands in ``[r n, (r + 1) n)``. Callers keep both flat: gloo
            wants the output one-dimensional.
        input: [n], this rank's contribution.
        group: the process group (default: the default group).

    Synchronous (no ``async_op``); errors and dead-peer behaviour are the group's backend's.
    """
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(output, input, group=group)
