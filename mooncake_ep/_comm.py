"""Collective helpers shared by the buffer, the MoE layer and the NVSHMEM path.

They serve :mod:`mooncake_ep.buffer`, :mod:`mooncake_ep.moe` and :mod:`mooncake_ep._nvshmem`; this
module imports none of them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_single(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None
) -> None:
    """``torch.distributed.all_gather_single``, or ``all_gather_into_tensor`` on a torch without it.

    ``all_gather_single`` is torch 2.13's name; on 2.13 the old name warns ``FutureWarning``.
    Synchronous (no ``async_op``); errors and dead-peer behaviour are the group's backend's.

    Args:
        output: [W * n] of ``input``'s dtype and device (``W`` ranks in the group); rank ``r``'s
            ``input`` lands in ``[r n, (r + 1) n)``. Callers keep both flat: gloo wants the output
            one-dimensional.
        input: [n], this rank's contribution.
        group: the process group (default: the default group).
    """
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(output, input, group=group)
