"""``mooncake_ep``: expert-parallel MoE dispatch/combine over a process group.

DeepEP's vocabulary (docs/design.md "Expert parallel")::

    buf = mooncake_ep.Buffer(group)
    layout = buf.get_dispatch_layout(topk_idx, num_experts)              # DispatchLayout
    recv = buf.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights,
                        num_experts=num_experts)                         # DispatchResult
    y = weighted expert outputs of recv.recv_x (weights: recv.recv_topk_weights)
    out = buf.combine(y, recv.handle).combined_x                         # CombineResult

    ll = buf.low_latency_dispatch(x, topk_idx, T_max, num_experts, use_fp8=False)
    out = buf.low_latency_combine(expert_out, topk_idx, topk_weights,
                                  ll.handle).combined_x                  # LowLatencyCombineResult

    moe = mooncake_ep.ExpertParallelMoE(gate, experts, group, top_k=2)

Results are NamedTuples with the fields of docs/design.md, which differ from DeepEP's tuples (no
``num_tokens_per_rdma_rank``, no event objects; only :class:`LowLatencyCombineResult`
keeps DeepEP's ``(combined_x, event, hook)``, with ``None`` for both on CPU): read them by
field name.

The data path on CPU tensors is vectorized torch plus the group's ``all_to_all_single``;
Triton kernels (:mod:`mooncake_ep.triton_kernels`) serve CUDA tensors.
"""

from __future__ import annotations

from .buffer import Buffer
from .config import EPConfig, env_defaults
from .kernels import fp8_dequantize, fp8_quantize
from .moe import ExpertParallelMoE, route_topk
from .results import (
    CombineResult,
    DispatchHandle,
    DispatchLayout,
    DispatchResult,
    LowLatencyCombineResult,
    LowLatencyDispatchResult,
    LowLatencyHandle,
)

__all__ = [
    "Buffer",
    "CombineResult",
    "DispatchHandle",
    "DispatchLayout",
    "DispatchResult",
    "EPConfig",
    "ExpertParallelMoE",
    "LowLatencyCombineResult",
    "LowLatencyDispatchResult",
    "LowLatencyHandle",
    "env_defaults",
    "fp8_dequantize",
    "fp8_quantize",
    "route_topk",
]
