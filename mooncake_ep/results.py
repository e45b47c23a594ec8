"""Results and handles of :class:`mooncake_ep.Buffer`'s ops.

They are public: exported by :mod:`mooncake_ep`. Dimensions as in :mod:`mooncake_ep.buffer`: ``W``
ranks, ``E`` experts, ``L = E / W`` experts per rank, ``T`` tokens of this rank, ``K`` top-k slots,
``H`` hidden size, ``T_max`` ``num_max_dispatch_tokens_per_rank``; ``N_recv`` rows received, ``P``
pairs. Results are NamedTuples: read them by field name. Handles are frozen dataclasses, opaque to
callers, that hand one dispatch's layout to its combine and backward passes.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch


class DispatchLayout(NamedTuple):
    """Result of :meth:`Buffer.get_dispatch_layout`.

    Attributes:
        num_tokens_per_rank: int32 [W], tokens that go to each rank (a token counts once
            per rank however many of its experts live there).
        num_tokens_per_rdma_rank: int32 [num_hosts], tokens that go to each host (once per
            host however many of its ranks they reach), hosts as
            :func:`mooncake_pg.get_rank_hosts` numbers them now (recomputed at every
            membership change; an inactive seat counts as a host of its own); DeepEP's
            name, where an "RDMA rank" is a node. ``None`` when the group lives on one
            host or its backend is not ``mooncake`` (no host topology), as DeepEP gives
            ``None`` inside a node.
        num_tokens_per_expert: int32 [E], tokens routed to each expert (a token naming an
            expert twice counts once).
        is_token_in_rank: bool [T, W], whether token ``t`` goes to rank ``r``.
    """

    num_tokens_per_rank: torch.Tensor
    num_tokens_per_rdma_rank: torch.Tensor | None
    num_tokens_per_expert: torch.Tensor
    is_token_in_rank: torch.Tensor


class DispatchResult(NamedTuple):
    """Result of :meth:`Buffer.dispatch`.

    Attributes:
        recv_x: [N_recv, H] (x's dtype), the tokens this rank received, ordered by source
            rank, then by token index at the source; one row per (token, this rank).
        recv_topk_idx: int64 [N_recv, K], the token's top-k with ids local to this rank
            (``id - rank * L``) and -1 for slots whose expert lives elsewhere (or was -1);
            ``None`` for a cached dispatch (``handle=`` given).
        recv_topk_weights: float32 [N_recv, K], the weights of the local slots (0 for the
            others); ``None`` without ``topk_weights`` or for a cached dispatch.
        num_recv_tokens_per_expert_list: list of L ints, received tokens per local expert
            (each rounded up to a multiple of ``expert_alignment``); ``None`` when cached.
        handle: :class:`DispatchHandle` for :meth:`Buffer.combine` and cached dispatches.
    """

    recv_x: torch.Tensor
    recv_topk_idx: torch.Tensor | None
    recv_topk_weights: torch.Tensor | None
    num_recv_tokens_per_expert_list: list[int] | None
    handle: DispatchHandle


class CombineResult(NamedTuple):
    """Result of :meth:`Buffer.combine`.

    Attributes:
        combined_x: [T, H] (x's dtype), for each token of this rank the sum of the rows
            the ranks it went to sent back (zero for tokens sent nowhere).
        combined_topk_weights: float32 [T, K], the same sum over the ``topk_weights``
            given to combine; ``None`` if none were given.
    """

    combined_x: torch.Tensor
    combined_topk_weights: torch.Tensor | None


class LowLatencyDispatchResult(NamedTuple):
    """Result of :meth:`Buffer.low_latency_dispatch`.

    Attributes:
        recv_x: [L, W * T_max, H] of x's dtype; with ``use_fp8`` a pair ``(x_fp8, scales)``
            of float8_e4m3fn [L, W * T_max, H] and float32 [L, W * T_max, ceil(H / 128)].
            Expert ``l``'s rows ``[0, recv_count[l])`` are its tokens, ordered by source
            rank, then by token index at the source; later rows are left uninitialised
            (as in DeepEP; combine never reads them).
        recv_count: int32 [L], tokens received per local expert.
        handle: :class:`LowLatencyHandle` for :meth:`Buffer.low_latency_combine`.
    """

    recv_x: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    recv_count: torch.Tensor
    handle: LowLatencyHandle


class LowLatencyCombineResult(NamedTuple):
    """Result of :meth:`Buffer.low_latency_combine`.

    It unpacks like DeepEP's ``combined_x, event, hook = buf.low_latency_combine(...)``.

    Attributes:
        combined_x: [T, H] in the experts' output dtype (``out`` when given).
        event: ``None`` on CPU (the op has finished when it returns).
        hook: ``None`` on CPU (``return_recv_hook`` is not supported).
    """

    combined_x: torch.Tensor
    event: object | None = None
    hook: object | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class DispatchHandle:
    """Communication layout of one normal-mode dispatch (opaque; pass it to ``combine``).

    ``send_token_idx`` (int64 [N_send]) lists the token of each row sent, ordered by
    destination rank then token; ``send_counts``/``recv_counts`` are rows per rank (rank
    to rank). ``route``: in a group that spans hosts, how the rows travel in two levels
    (:class:`mooncake_ep._hosts.HostRoute`), ``None`` rank to rank.
    """

    num_tokens: int
    hidden: int
    num_experts: int
    num_topk: int
    send_token_idx: torch.Tensor
    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]
    is_token_in_rank: torch.Tensor
    epoch: int
    max_ranks_per_token: int = 0
    route: object | None = None

    @property
    def device(self) -> torch.device:
        """The device of the dispatch's tensors (its inputs, results and index tensors)."""
        return self.send_token_idx.device

    def row_table(self) -> torch.Tensor:
        """int64 [T, W]: the row that carried token ``t`` to rank ``r``.

        Rows are numbered among the rows sent, in send order; -1 where the token did not go there.
        """
        T, W = self.is_token_in_rank.shape
        pos = torch.full((T, W), -1, dtype=torch.int64, device=self.device)
        nz = self.is_token_in_rank.t().nonzero()  # (rank, token) in send order
        pos[nz[:, 1], nz[:, 0]] = torch.arange(nz.shape[0], device=self.device)
        return pos


@dataclasses.dataclass(frozen=True, eq=False)
class LowLatencyHandle:
    """Communication layout of one low-latency dispatch (opaque).

    One row moves per distinct (token, expert) pair ("pair"); pairs are ordered by
    expert id, then token. ``pair_token`` int64 [P] is each pair's token; ``slot_pair``
    int64 [T, K] maps each top-k slot to its pair (-1: masked slot or expert on an
    inactive rank); ``recv_dst`` int64 [N_recv] is the flat row (``l * W * T_max + j``) of
    ``recv_x`` that each received row went to. ``backend`` is how its rows move
    (``"nvshmem"`` or ``"group"``): the combine and the backward passes use the same.

    Across hosts (two levels) one row per (token, destination rank) moves instead, on
    ``rows``' route (a :class:`DispatchHandle`); then ``pair_row`` int64 [P_recv] is the
    received row of each received pair and ``recv_dst`` [P_recv] its flat row of
    ``recv_x``; ``slot_dst`` int64 [N_rows, K] the flat row of each received row's top-k
    slot (-1: that slot's expert is elsewhere); ``send_local`` int32 [N_send, K] the local
    expert ids of the rows sent (-1 likewise), by which ``low_latency_combine`` sends
    each row's weights along.
    """

    num_tokens: int
    hidden: int
    num_experts: int
    num_max_dispatch_tokens_per_rank: int
    topk_idx: torch.Tensor
    pair_token: torch.Tensor
    slot_pair: torch.Tensor
    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]
    recv_dst: torch.Tensor
    recv_count: torch.Tensor
    use_fp8: bool
    epoch: int
    backend: str = "group"
    rows: DispatchHandle | None = None
    pair_row: torch.Tensor | None = None
    slot_dst: torch.Tensor | None = None
    send_local: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        """The device of the dispatch's tensors (its inputs, results and index tensors)."""
        return self.pair_token.device
