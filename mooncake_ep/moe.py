"""``ExpertParallelMoE``: an existing MoE layer (router + experts) with its experts sharded
over the ranks of a group, tokens moved by :class:`mooncake_ep.Buffer`."""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .buffer import Buffer


def route_topk(logits: torch.Tensor, top_k: int):
    """Softmax over experts, then the ``top_k`` largest: ``(topk_idx int64 [T, K],
    topk_weights float32 [T, K])``. The reference routing of :class:`ExpertParallelMoE`
    when the gate returns logits."""
    probs = torch.softmax(logits.float(), dim=-1)
    w, idx = torch.topk(probs, top_k, dim=-1)
    return idx, w


class ExpertParallelMoE(nn.Module):
    """Wraps a MoE layer: ``forward(x) = sum_k w_k * expert_{idx_k}(x)`` per token, with the
    experts spread over the ranks of ``group`` (rank ``r`` holds experts
    ``[r L, (r + 1) L)``, ``L = E / W``).

    Args:
        gate: ``nn.Module`` mapping tokens [T, H] to either router logits [T, E] (then
            softmax + top-``top_k``, see :func:`route_topk`) or a pair
            ``(topk_idx [T, K] int, topk_weights [T, K] float)`` (custom routing; -1 slots
            allowed). Replicated: every rank has the same gate (keep it in sync with data
            parallelism, e.g. all-reduce its gradients).
        experts: the experts, each mapping [n, H] -> [n, H]: either all E of them (this
            rank keeps its L and drops the rest) or only this rank's L (then pass
            ``num_experts``).
        group: the expert-parallel process group (default: the default group).
        num_experts: E; needed when ``experts`` holds only the local ones.
        top_k: slots per token when ``gate`` returns logits.
        buffer: a :class:`Buffer` to use (default: a new one on ``group``).

    ``forward`` takes x [..., H] and returns the same shape and dtype. Every rank calls
    forward (and backward) together, also with zero tokens. Gradients reach x, the
    local experts' parameters and the gate (through the top-k weights, which are applied
    to the expert outputs before the combine). Experts on inactive ranks of a ``mooncake``
    group contribute zero.
    """

    def __init__(self, gate: nn.Module, experts: Sequence[nn.Module], group: Optional[dist.ProcessGroup] = None,
                 *, num_experts: Optional[int] = None, top_k: Optional[int] = None,
                 buffer: Optional[Buffer] = None):
        super().__init__()
        self.buffer = buffer if buffer is not None else Buffer(group)
        W, rank = self.buffer.group_size, self.buffer.rank
        experts = list(experts)
        E = int(num_experts) if num_experts is not None else len(experts)
        L = self.buffer.num_local_experts(E)
        if len(experts) == E:
            local = experts[rank * L:(rank + 1) * L]
        elif len(experts) == L:
            local = experts
        else:
            raise ValueError(f"ExpertParallelMoE: got {len(experts)} experts; expected all {E} or this "
                             f"rank's {L} (num_experts={E}, group size {W})")
        self.gate = gate
        self.experts = nn.ModuleList(local)
        self.num_experts = E
        self.num_local_experts = L
        self.top_k = top_k
        self.first_expert = rank * L

    def route(self, x: torch.Tensor):
        """``(topk_idx int64 [T, K], topk_weights float32 [T, K])`` for tokens x [T, H]."""
        g = self.gate(x)
        if isinstance(g, (tuple, list)):
            idx, w = g
            return idx.long(), w.float()
        if self.top_k is None:
            raise ValueError("ExpertParallelMoE: the gate returned logits; pass top_k=")
        return route_topk(g, self.top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        topk_idx, topk_weights = self.route(x2)
        res = self.buffer.dispatch(x2, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=self.num_experts)
        recv_x, recv_idx, recv_w = res.recv_x, res.recv_topk_idx, res.recv_topk_weights
        y = self._experts(recv_x, recv_idx, recv_w)
        out = self.buffer.combine(y, res.handle).combined_x
        return out.reshape(shape)

    def _experts(self, recv_x, recv_idx, recv_w):
        """Weighted outputs of the local experts, one row per received token."""
        H = recv_x.shape[1]
        y = torch.zeros((recv_x.shape[0], H), dtype=torch.float32)
        for l, expert in enumerate(self.experts):
            hit = recv_idx == l                                   # [N, K]
            rows = hit.any(1).nonzero().squeeze(1)
            if rows.numel() == 0:
                continue
            w = (recv_w * hit).sum(1).index_select(0, rows)       # duplicates add up
            out = expert(recv_x.index_select(0, rows))
            y = y.index_add(0, rows, out.float() * w.unsqueeze(1))
        if torch.is_grad_enabled():
            # Keep every rank's graph the same shape: the combine's and the dispatch's
            # backward move data, so they must run on every rank, also where no rows
            # arrived or no expert was hit.
            y = y + (recv_x.sum() * 0 + recv_w.sum() * 0)
            y = y + _anchor()
        return y.to(recv_x.dtype)


def _anchor():
    return torch.zeros((), requires_grad=True)
