"""``mooncake_ep.Buffer``: MoE dispatch and combine over a process group (DeepEP's names).

Dimensions: ``W`` ranks in the group (seats, fixed), ``E`` experts (``num_experts``, a
multiple of ``W``), ``L = E / W`` experts per rank (rank ``r`` holds experts
``[r L, (r + 1) L)``), ``T`` tokens of this rank, ``K`` top-k slots per token, ``H``
hidden size, ``T_max`` ``num_max_dispatch_tokens_per_rank`` (low-latency mode).

Routing (docs/design.md "Expert parallel"): ``topk_idx[t, k] == -1`` means no expert (the slot
is never sent and its weight is ignored); any other negative id or an id ``>= E`` is
rejected with ``ValueError`` before anything is sent. A token whose top-k names one
expert twice goes to it once; the two weights add up.

Devices: every op takes tensors on one device (CPU, or CUDA where the group's backend
serves CUDA tensors: a ``mooncake`` group of a build with ``mooncake_pg.WITH_CUDA``, or
e.g. gloo); all of an op's tensor arguments must be on ``x``'s device (a combine's on its
dispatch's), its results and handles are there too. A device the group cannot serve, or
mixed devices, raise ``ValueError`` (op, rank, expected vs actual device) on every rank
before anything is sent. The small header always travels as CPU int64; the row kernels
are the Triton ones on CUDA tensors (``EPConfig(kernels=...)``). Ops are synchronous with
the host (they read counts), so ``async_finish``/events have no effect on any device.

Low-latency transport (``EPConfig(low_latency_backend=...)``, environment
``MOONCAKE_EP_LOW_LATENCY_BACKEND``; default ``"auto"``): the rows of
``low_latency_dispatch``/``low_latency_combine`` and their backward passes move either with
the group's ``all_to_all_single`` (``"group"``) or with one-sided NVSHMEM puts into
symmetric buffers (``"nvshmem"``; CUDA tensors, ``nvshmem.core`` from ``nvshmem4py-cu13``,
every rank of the group active; see :mod:`mooncake_ep._nvshmem`). ``"auto"`` uses NVSHMEM
when every rank can, else the group, silently (``Buffer.low_latency_backend``,
``Buffer.low_latency_fallback_reason``); ``"nvshmem"`` that cannot be served raises
``ValueError`` on every rank before any token moves. Both give the same rows bit for bit;
the header still travels over the group.

Every op that moves tokens is collective over the group (``get_dispatch_layout`` is
local). Each one first exchanges a small header
(``all_gather_single`` of a few int64 per rank: status, op, sizes, row counts), so
a rank's bad arguments make *every* rank raise ``ValueError`` (the offending rank with
the details, the others naming it) before any token is moved, and ranks that disagree on
sizes raise on every rank too. Tokens then move with the group's ``all_to_all_single``.

Dead ranks: on a ``mooncake`` group the buffer follows the group's agreed
``active_ranks`` and ``epoch`` (``mooncake_pg.get_active_ranks``); experts on inactive
ranks get no tokens and contribute zero; rows that an inactive rank did not send are
zero, never stale. With ``on_failure="mask"`` an op that sees a rank fail completes over
the survivors (a normal-mode dispatch restarts from its header when the epoch moves
under it, so every survivor returns the same layout); with ``"raise"`` the op raises
``RankFailureError`` on every survivor and a retry (same arguments, same handle) runs
over the survivors; with ``"manual"`` it raises until ``deactivate_ranks``.

Code layout: this module holds :class:`Buffer`'s API (its ops' arguments, checks and
layouts); the results and handles are in :mod:`mooncake_ep.results` (also importable from
here), the argument checks in :mod:`mooncake_ep._checks`, the group, header exchange and
row transport that Buffer derives from in :mod:`mooncake_ep._transport`, the autograd
functions in :mod:`mooncake_ep._autograd`.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.distributed as dist

from . import _hosts
from . import kernels as K_
from ._autograd import CombineFn, DispatchFn, LowLatencyCombineFn, LowLatencyDispatchFn
from ._checks import (
    DTYPES,
    BadArgs,
    check_int_arg,
    check_int_tensor,
    check_same_device,
    check_topk_idx,
    check_weights,
    check_x,
    input_device,
)
from ._transport import FORCED, HDR, LL_CODES, Transport
from .config import EPConfig
from .results import (
    CombineResult,
    DispatchHandle,
    DispatchLayout,
    DispatchResult,
    LowLatencyCombineResult,
    LowLatencyDispatchResult,
    LowLatencyHandle,
)

__all__ = ["Buffer"]


def _token_expert_counts(topk_idx, num_experts):
    """int32 [T, E]: how many slots of token t name expert e (-1 slots dropped)."""
    T = topk_idx.shape[0]
    idx = topk_idx.long()
    idx = torch.where(idx < 0, torch.full_like(idx, num_experts), idx)
    cnt = torch.zeros((T, num_experts + 1), dtype=torch.int32, device=topk_idx.device)
    cnt.scatter_add_(1, idx, torch.ones_like(idx, dtype=torch.int32))
    return cnt[:, :num_experts]


def _token_rank_mask(topk_idx, num_experts, world_size):
    """Which ranks each token goes to: bool [T, W], rank r holding experts ``r * L .. r * L + L - 1``.

    The ids are checked (-1 or in ``[0, E)``); a [T, W] scatter rather than a [T, E] count.
    """
    T, W = topk_idx.shape[0], world_size
    idx = topk_idx.long()
    dest = torch.where(idx < 0, torch.full_like(idx, W), idx // (num_experts // W))
    mask = torch.zeros((T, W + 1), dtype=torch.bool, device=topk_idx.device)
    mask.scatter_(1, dest, True)
    return mask[:, :W]


class Buffer(Transport):
    """Dispatch/combine of MoE tokens over ``group`` (DeepEP's ``Buffer``).

    CPU or CUDA tensors, see the module docstring on devices.

    Collective calls: every rank of the group calls the same ops in the same order, and runs the
    backward of the same differentiable ops (backward passes move data too).

    Args:
        group: the process group (default: the default group); a ``mooncake`` group gives dead-rank
            awareness, any other backend with ``all_to_all_single`` works with every rank taken as
            active.
        num_nvl_bytes: accepted for DeepEP compatibility; buffers are allocated per call (on the
            inputs' device, large ones recycled), so it is unused. (The NVSHMEM low-latency path
            sizes its symmetric buffers itself: 2 x ``W * T_max * L * H * max(4, element size)``
            bytes, allocated at its first use, grown when wider rows need it, kept until the process
            ends; ``nvshmem.core.finalize()`` frees them, after which this Buffer must not run
            low-latency ops.)
        num_rdma_bytes: accepted for DeepEP compatibility; unused, as ``num_nvl_bytes``.
        low_latency_mode: accepted for DeepEP compatibility; unused, as ``num_nvl_bytes``.
        num_qps_per_rank: accepted for DeepEP compatibility; unused, as ``num_nvl_bytes``.
        config: :class:`EPConfig` (keyword-only).

    Attributes:
        group: the process group.
        rank: this process's rank in it.
        group_size: W.
        low_latency_mode: as given (unused).

    Raises:
        TypeError: ``group`` is not a process group (or ``None``).
        RuntimeError: ``torch.distributed`` is not initialised.
        ValueError: this process is not a member of ``group``.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 1,
        *,
        config: EPConfig | None = None,
    ) -> None:
        super().__init__(group, config)
        self.low_latency_mode = bool(low_latency_mode)

    # ----------------------------------------------------------- membership

    def get_active_ranks(self) -> torch.Tensor:
        """int32 [W]: 1 for the ranks taking part (the group's agreed mask)."""
        return torch.tensor(self._membership()[0], dtype=torch.int32)

    def get_epoch(self) -> int:
        """The group's membership epoch (0 for groups that are not ``mooncake``)."""
        return self._membership()[1]

    def num_local_experts(self, num_experts: int) -> int:
        """The number of experts each rank holds: L = ``num_experts / W``.

        Args:
            num_experts: E, a positive multiple of the group size W.

        Raises:
            ValueError: ``num_experts`` is not an int or not a positive multiple of W.
        """
        try:
            num_experts = check_int_arg("num_experts", num_experts)
        except BadArgs as e:
            raise ValueError(f"mooncake_ep: {e}") from None
        if num_experts <= 0 or num_experts % self.group_size:
            raise ValueError(
                f"mooncake_ep: num_experts ({num_experts}) must be a positive multiple of "
                f"the group size ({self.group_size})"
            )
        return num_experts // self.group_size

    # ------------------------------------------------- low-latency backend

    @property
    def low_latency_backend(self) -> str | None:
        """How the last ``low_latency_dispatch`` moved its rows: ``"nvshmem"`` or ``"group"``.

        ``None`` before the first one. Its combine and backward passes use the same (the handle
        remembers).
        """
        return self._ll_backend

    @property
    def low_latency_fallback_reason(self) -> str | None:
        """Why the last ``low_latency_dispatch`` did not use NVSHMEM.

        ``None`` when it did, or when the configuration is ``"group"``.
        """
        return self._ll_why

    # ---------------------------------------------------------------- layout

    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event: object | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> DispatchLayout:
        """Which ranks and experts each token goes to (local; moves nothing).

        The layout is pure routing: ``dispatch`` leaves out ranks that are inactive.

        Args:
            topk_idx: int64 (or int32) [T, K]; -1 = no expert.
            num_experts: E, a multiple of W.
            previous_event: DeepEP's stream argument; ignored on CPU (the result is ready on
                return).
            async_finish: DeepEP's stream argument; ignored on CPU.
            allocate_on_comm_stream: DeepEP's stream argument; ignored on CPU.

        Returns:
            :class:`DispatchLayout` (counts as int32, ``is_token_in_rank`` bool).

        Raises:
            ValueError: a bad id (naming its position), a non-2-D or non-integer ``topk_idx``, or E
                not a multiple of W.
        """
        try:
            self.num_local_experts(num_experts)
            check_int_tensor("topk_idx", topk_idx)
            check_topk_idx(topk_idx, num_experts)
        except BadArgs as e:
            raise self._err("get_dispatch_layout", str(e)) from None
        T = topk_idx.shape[0]
        cnt = _token_expert_counts(topk_idx, num_experts) > 0
        per_expert = cnt.sum(0, dtype=torch.int32)
        in_rank = cnt.view(T, self.group_size, num_experts // self.group_size).any(2)
        per_host = None
        topo = self._topology()
        if topo is not None:
            per_host = topo.tokens_per_host(in_rank).to(torch.int32)
        return DispatchLayout(in_rank.sum(0, dtype=torch.int32), per_host, per_expert, in_rank)

    # -------------------------------------------------------------- dispatch

    def dispatch(
        self,
        x: torch.Tensor,
        handle: DispatchHandle | None = None,
        num_tokens_per_rank: torch.Tensor | None = None,
        num_tokens_per_rdma_rank: torch.Tensor | None = None,
        is_token_in_rank: torch.Tensor | None = None,
        num_tokens_per_expert: torch.Tensor | None = None,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: object | None = None,
        previous_event: object | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
        *,
        num_experts: int | None = None,
    ) -> DispatchResult:
        """Sends each token of ``x`` once to every rank that holds one of its experts.

        Args:
            x: [T, H] float32/bfloat16/float16/float64 tokens of this rank (T may be 0), on a device
                the group serves; every other tensor argument on the same device.
            handle: a :class:`DispatchHandle` from an earlier dispatch: reuse its layout (no header
                exchange, ``topk_*`` must be ``None``); returns only ``recv_x``.
            num_tokens_per_rank: DeepEP's layout argument: only its shape is checked; the layout is
                recomputed from ``topk_idx`` (it is cheap and cannot disagree with it).
            num_tokens_per_rdma_rank: DeepEP argument without effect on CPU.
            is_token_in_rank: DeepEP's layout argument: only its shape is checked (as
                ``num_tokens_per_rank``).
            num_tokens_per_expert: DeepEP's layout argument: only its shape is checked (as
                ``num_tokens_per_rank``).
            topk_idx: int64/int32 [T, K], expert ids or -1 (required without ``handle``).
            topk_weights: float32 [T, K] or ``None``; differentiable.
            expert_alignment: counts in ``num_recv_tokens_per_expert_list`` are rounded up to a
                multiple of it.
            num_worst_tokens: DeepEP argument without effect on CPU; must be 0.
            config: DeepEP argument without effect on CPU.
            previous_event: DeepEP argument without effect on CPU.
            async_finish: DeepEP argument without effect on CPU.
            allocate_on_comm_stream: DeepEP argument without effect on CPU.
            num_experts: E (keyword; else taken from ``len(num_tokens_per_expert)``).

        Returns:
            :class:`DispatchResult`. Differentiable in ``x`` and ``topk_weights``: the backward is a
            combine (gradients of the rows a token went to are summed).

        Raises:
            ValueError: on every rank, before any token moves, when some rank's arguments are
                invalid (bad ids: -2 or below, or ``>= E``; shapes; dtypes; counts such as
                ``num_experts`` that are not ints) or the ranks disagree on E, H, K or dtype.
            RankFailureError: per the group's policy.
        """
        op = "dispatch"
        if handle is not None:
            err = None
            try:
                if not isinstance(handle, DispatchHandle):
                    raise BadArgs(f"handle must be a DispatchHandle, got {type(handle).__name__}")
                if topk_idx is not None or topk_weights is not None:
                    raise BadArgs("a cached dispatch (handle given) takes no topk_idx/topk_weights")
                check_x(x)
                self._check_device(x)
                check_same_device("x", x, handle.device, "the handle's dispatch ran there")
                if tuple(x.shape) != (handle.num_tokens, handle.hidden):
                    raise BadArgs(
                        f"x must have shape {(handle.num_tokens, handle.hidden)} (the handle's), "
                        f"got {tuple(x.shape)}"
                    )
            except BadArgs as e:
                err = str(e)
            fields = [getattr(handle, "hidden", 0), DTYPES.get(getattr(x, "dtype", None), 0), 1]
            self._header(op, fields, error=err, names=("hidden", "dtype", "cached"))
            recv_x, _, _ = DispatchFn.apply(self, handle, None, x, None)
            return DispatchResult(recv_x, None, None, None, handle)

        W = self.group_size
        err = None
        E = T = H = Kk = 0
        dev = input_device(x)
        # Every check sits inside this try: a check that raised anything but BadArgs would
        # leave this rank out of the header exchange the other ranks are waiting in.
        try:
            if num_experts is not None:
                E = check_int_arg("num_experts", num_experts)
            elif isinstance(num_tokens_per_expert, torch.Tensor):
                E = int(num_tokens_per_expert.numel())
            else:
                raise BadArgs("num_experts is unknown: pass num_experts= or num_tokens_per_expert")
            if E <= 0 or E % W:
                raise BadArgs(
                    f"num_experts ({E}) must be a positive multiple of the group size ({W})"
                )
            check_x(x)
            self._check_device(x)
            T, H = x.shape
            if topk_idx is None:
                raise BadArgs("topk_idx is required without a handle")
            check_int_tensor("topk_idx", topk_idx, T)
            check_same_device("topk_idx", topk_idx, dev)
            Kk = topk_idx.shape[1]
            check_topk_idx(topk_idx, E)
            if topk_weights is not None:
                check_weights(topk_weights, (T, Kk))
                check_same_device("topk_weights", topk_weights, dev)
            if check_int_arg("num_worst_tokens", num_worst_tokens):
                raise BadArgs("num_worst_tokens must be 0 (not supported on CPU)")
            align = check_int_arg("expert_alignment", expert_alignment)
            if align < 1:
                raise BadArgs(f"expert_alignment must be >= 1, got {align}")
            for nm, t, shp in (
                ("num_tokens_per_rank", num_tokens_per_rank, (W,)),
                ("is_token_in_rank", is_token_in_rank, (T, W)),
                ("num_tokens_per_expert", num_tokens_per_expert, (E,)),
            ):
                if t is None:
                    continue
                if not isinstance(t, torch.Tensor):
                    raise BadArgs(f"{nm} must be a tensor of shape {shp}, got {type(t).__name__}")
                if tuple(t.shape) != shp:
                    raise BadArgs(f"{nm} must have shape {shp}, got {tuple(t.shape)}")
        except BadArgs as e:
            err = str(e)

        in_rank = None
        if err is None:
            L = E // W
            in_rank = _token_rank_mask(topk_idx, E, W)
        hierarchical = bool(self._cfg["hierarchical"])
        fields = [
            E,
            H,
            DTYPES.get(getattr(x, "dtype", None), 0),
            Kk,
            int(topk_weights is not None),
            int(hierarchical),
        ]
        names = ("num_experts", "hidden", "dtype", "num_topk", "has_weights", "hierarchical")
        tries = self._cfg["max_membership_retries"]
        for attempt in range(tries + 1):
            active0, epoch0, topo = self._membership_and_topology()
            counts = self._row_counts(in_rank, active0, epoch0, topo)
            hdr, active, epoch = self._header(op, fields, counts, error=err, names=names)
            act = torch.tensor(
                [int(a and b) for a, b in zip(active, active0)], dtype=torch.bool, device=dev
            )
            h, local = self._rows_handle(
                (T, H, E, Kk),
                topk_idx,
                in_rank & act,
                active,
                epoch,
                hdr[:, HDR:],
                topo,
                x.element_size(),
            )
            stats = {"num_local_experts": L}
            recv_x, recv_w, recv_idx = DispatchFn.apply(self, h, local, x, topk_weights, stats)
            if self._membership()[1] == epoch or attempt == tries:
                break
        if self._membership()[1] != epoch:
            raise self._err(
                op, f"the group's membership changed {tries + 1} times during one dispatch"
            )
        recv_idx = recv_idx.long()
        per_expert = stats["rows_per_expert"]
        counts_list = [int((c + align - 1) // align * align) for c in per_expert.tolist()]
        return DispatchResult(recv_x, recv_idx, recv_w, counts_list, h)

    def _rows_handle(self, dims, topk_idx, sent, active, epoch, counts, topo, row_bytes):
        """The handle of one row per (token, destination rank); collective in two levels.

        Returns that :class:`DispatchHandle` and the function (cached) that returns the local expert
        ids of each row sent (int32 [N_send, K], -1 where that slot's expert is on another rank).

        ``dims`` (T, H, E, K); ``sent`` bool [T, W]: where each token goes (active ranks only);
        ``counts`` int64 [W, >= 2 W + 1]: per source rank, as :meth:`_row_counts` lays them out,
        from the header the ranks exchanged; ``row_bytes``: bytes per element of the rows (agreed),
        which with the counts sizes the route's pieces.
        """
        T, H, E, Kk = dims
        W, L = self.group_size, E // self.group_size
        send_counts = tuple(int(c) for c in sent.sum(0))
        recv_counts = tuple(int(counts[s, self.rank]) if active[s] else 0 for s in range(W))
        nz = sent.t().nonzero()
        send_tok = nz[:, 1].contiguous()
        mx = int(sent.sum(1).max()) if T else 0
        route = None
        live = [r for r in range(W) if active[r]]
        # two levels only when every rank counted with the membership the header agreed
        # on (the relays' counts come from those counts)
        if (
            self._cfg["hierarchical"]
            and topo is not None
            and topo.spans_hosts(live)
            and all(int(counts[r, 2 * W]) == epoch for r in live)
        ):
            host_counts = counts[:, W : W + topo.num_hosts].tolist()
            # the busiest rank's rows, sent or received (a host that many send to pipelines too)
            flat = counts[live][:, live]
            most = int(max(flat.sum(1).max(), flat.sum(0).max())) * H * row_bytes
            P = _hosts.MAX_PIECES
            fine = counts[:, 2 * W + 1 + self.rank * P : 2 * W + 1 + (self.rank + 1) * P]
            route = _hosts.plan_route(
                topo,
                self.rank,
                active,
                sent,
                host_counts,
                recv_counts,
                self._a2a,
                _hosts.pieces(most),
                [fine[s].tolist() if active[s] else [0] * P for s in range(W)],
            )
            if self._membership()[1] != epoch:
                route = None  # on every survivor: the op restarts
        h = DispatchHandle(T, H, E, Kk, send_tok, send_counts, recv_counts, sent, epoch, mx, route)
        dest = nz[:, 0]

        @functools.cache
        def local_ids():  # computed while the rows move (DispatchFn)
            rows_idx = topk_idx.long().index_select(0, send_tok)
            local = rows_idx - (dest * L).unsqueeze(1)
            local = torch.where(
                (rows_idx >= 0) & (local >= 0) & (local < L), local, torch.full_like(local, -1)
            )
            return local.to(torch.int32)

        return h, local_ids

    def _row_counts(self, in_rank, active, epoch, topo) -> torch.Tensor:
        """This rank's part of a header for :meth:`_rows_handle`.

        int64 [2 W + 1] on one host, [2 W + 1 + W x MAX_PIECES] across hosts: its rows per
        destination rank, its tokens per host (at most W hosts; for the relays), the epoch these
        counts saw and, across hosts, its rows per destination and token range (the route's pieces).
        ``in_rank`` bool [T, W] (``None``: bad arguments, zeros).
        """
        W = self.group_size
        n = 2 * W + 1
        counts = torch.zeros(
            n + (W * _hosts.MAX_PIECES if topo is not None else 0), dtype=torch.int64
        )
        counts[2 * W] = epoch
        if in_rank is not None:
            mask = torch.tensor(active, dtype=torch.bool, device=in_rank.device)
            counts[:W] = (in_rank & mask).sum(0).cpu()
            if topo is not None:
                counts[W : W + topo.num_hosts] = topo.tokens_per_host(in_rank & mask).cpu()
                counts[n:] = _hosts.piece_counts(in_rank & mask).reshape(-1)
        return counts

    # --------------------------------------------------------------- combine

    def combine(
        self,
        x: torch.Tensor,
        handle: DispatchHandle,
        topk_weights: torch.Tensor | None = None,
        bias: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
        config: object | None = None,
        previous_event: object | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> CombineResult:
        """Sends each received row back to its token's rank and sums the rows per token.

        Rows from ranks inactive by now count as zero.

        Args:
            x: [N_recv, H] (the rows of ``dispatch``'s ``recv_x``, typically the weighted expert
                outputs), float32/bfloat16/float16/float64, on the dispatch's device.
            handle: the :class:`DispatchHandle` of the dispatch.
            topk_weights: float32 [N_recv, K] or ``None``: summed back the same way.
            bias: DeepEP argument; must be ``None``.
            config: DeepEP argument; no effect on CPU.
            previous_event: DeepEP argument; no effect on CPU.
            async_finish: DeepEP argument; no effect on CPU.
            allocate_on_comm_stream: DeepEP argument; no effect on CPU.

        Returns:
            :class:`CombineResult`; ``combined_x`` [T, H] in x's dtype (16-bit data sums in float32
            and rounds once unless ``EPConfig(fp32_accumulate=False)``). Differentiable in ``x`` and
            ``topk_weights`` (the backward is a dispatch).

        Raises:
            ValueError: on every rank (before any row moves) when some rank's arguments are bad or
                the ranks disagree on H or dtype.
        """
        op = "combine"
        err = None
        H = Kk = 0
        try:
            if not isinstance(handle, DispatchHandle):
                raise BadArgs(f"handle must be a DispatchHandle, got {type(handle).__name__}")
            check_x(x)
            self._check_device(x)
            check_same_device("x", x, handle.device, "the dispatch's device")
            n = sum(handle.recv_counts)
            if tuple(x.shape) != (n, handle.hidden):
                raise BadArgs(
                    f"x must have shape {(n, handle.hidden)} (rows received by the dispatch), "
                    f"got {tuple(x.shape)}"
                )
            H = handle.hidden
            if topk_weights is not None:
                Kk = handle.num_topk
                check_weights(topk_weights, (n, Kk))
                check_same_device("topk_weights", topk_weights, x.device)
            if bias is not None:
                raise BadArgs("bias is not supported")
        except BadArgs as e:
            err = str(e)
        fields = [H, DTYPES.get(getattr(x, "dtype", None), 0), int(topk_weights is not None), Kk]
        self._header(op, fields, error=err, names=("hidden", "dtype", "has_weights", "num_topk"))
        out, out_w = CombineFn.apply(self, handle, x, topk_weights)
        return CombineResult(out, out_w)

    # ---------------------------------------------------------- low latency

    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        use_fp8: bool = False,
        round_scale: bool = False,
        use_ue8m0: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
    ) -> LowLatencyDispatchResult:
        """Sends each (token, expert) pair to the expert's rank, packed per local expert.

        The rows move over NVSHMEM or the group per ``EPConfig.low_latency_backend`` (module
        docstring); ``self.low_latency_backend`` then says which, and the handle keeps it for the
        combine and the backward passes. On the NVSHMEM path the first call (per process, then per
        Buffer) initialises NVSHMEM over the group and allocates the symmetric buffers (collective).
        Over a group that spans hosts (``EPConfig(hierarchical=True)``, the default) the group path
        moves one row per (token, destination rank) on the normal mode's two-level route and each
        rank fills its experts' slots; the layout of ``recv_x`` is the same.

        Args:
            x: [T, H] float32/bfloat16/float16/float64 (T <= T_max), on a device the group serves;
                ``topk_idx`` and the stats tensor on the same device.
            topk_idx: int64/int32 [T, K], expert ids or -1.
            num_max_dispatch_tokens_per_rank: T_max, the same on every rank.
            num_experts: E, a multiple of W.
            cumulative_local_expert_recv_stats: int32 [L] or ``None``; ``recv_count`` is added to
                it.
            use_fp8: send e4m3 with one float32 scale per 128 channels (the last block may be
                shorter), from any of x's dtypes; ``recv_x`` is then ``(x_fp8, scales)`` and not
                differentiable.
            round_scale: DeepEP argument; must be ``False`` (not supported on CPU).
            use_ue8m0: DeepEP argument; must be ``False`` (not supported on CPU).
            async_finish: no effect on CPU (the op has finished when it returns).
            return_recv_hook: DeepEP argument; must be ``False`` (not supported on CPU).

        Returns:
            :class:`LowLatencyDispatchResult`. Without fp8, differentiable in ``x`` (the backward
            sums each pair's gradient back to its token).

        Raises:
            ValueError: on every rank before any token moves for bad arguments or disagreeing
                T_max/E/H/dtype/use_fp8/low_latency_backend/hierarchical, and, with
                ``low_latency_backend="nvshmem"``, when NVSHMEM cannot serve the op on some rank
                (tensors not on CUDA, ``nvshmem.core`` not importable, an inactive rank, NVSHMEM
                initialised over another group, its init or allocation failed), e.g. ``mooncake_ep
                low_latency_dispatch (rank 0): low_latency_backend='nvshmem' (EPConfig or
                MOONCAKE_EP_LOW_LATENCY_BACKEND) cannot be served: expected CUDA tensors, got x on
                cpu; nothing was sent``. Exception: a ``num_experts`` that is not an int raises only
                on the ranks that passed it (E sizes the header, so they cannot join the exchange);
                the other ranks wait in it until the group's op timeout.
        """
        op = "low_latency_dispatch"
        W = self.group_size
        err = None
        T = H = Kk = 0
        try:
            E = check_int_arg("num_experts", num_experts)
        except BadArgs as e:
            # E sizes the header's counts, so without it this rank cannot take part in the
            # exchange that would tell the others
            raise self._err(op, str(e)) from None
        dev = input_device(x)
        Tm = 0
        try:
            Tm = check_int_arg("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank)
            if Tm < 1:
                raise BadArgs(f"num_max_dispatch_tokens_per_rank must be >= 1, got {Tm}")
            if E <= 0 or E % W:
                raise BadArgs(
                    f"num_experts ({E}) must be a positive multiple of the group size ({W})"
                )
            check_x(x)
            self._check_device(x)
            T, H = x.shape
            if T > Tm:
                raise BadArgs(f"x has {T} tokens, more than num_max_dispatch_tokens_per_rank={Tm}")
            check_int_tensor("topk_idx", topk_idx, T)
            check_same_device("topk_idx", topk_idx, dev)
            Kk = topk_idx.shape[1]
            check_topk_idx(topk_idx, E)
            if round_scale or use_ue8m0 or return_recv_hook:
                raise BadArgs(
                    "round_scale, use_ue8m0 and return_recv_hook are not supported on CPU"
                )
            if cumulative_local_expert_recv_stats is not None:
                st = cumulative_local_expert_recv_stats
                if (
                    not isinstance(st, torch.Tensor)
                    or st.dtype != torch.int32
                    or tuple(st.shape) != (E // W,)
                ):
                    raise BadArgs(f"cumulative_local_expert_recv_stats must be int32 [{E // W}]")
                check_same_device("cumulative_local_expert_recv_stats", st, dev)
        except BadArgs as e:
            err = str(e)
        want = self._cfg["low_latency_backend"]
        nvs_ok, local_why = 0, None
        if err is None and want != "group":
            local_why = self._nvshmem_unusable(dev)
            nvs_ok = int(local_why is None)
            if local_why is not None and want == "nvshmem":
                err = f"{FORCED} cannot be served: {local_why}"
        L = E // W if E > 0 and E % W == 0 else 1
        cnt = in_rank = None
        if err is None:
            cnt = _token_expert_counts(topk_idx, E) > 0  # [T, E]
            in_rank = cnt.view(T, W, L).any(2)
        hierarchical = bool(self._cfg["hierarchical"])
        fields = [
            E,
            H,
            DTYPES.get(getattr(x, "dtype", None), 0),
            Tm,
            int(bool(use_fp8)),
            int(hierarchical),
        ]
        names = (
            "num_experts",
            "hidden",
            "dtype",
            "num_max_dispatch_tokens_per_rank",
            "use_fp8",
            "hierarchical",
        )
        tries = self._cfg["max_membership_retries"]
        for attempt in range(tries + 1):
            active0, epoch0, topo = self._membership_and_topology()
            # pairs per expert, then the counts of the two-level route (one row per token
            # and destination rank)
            rc = self._row_counts(in_rank, active0, epoch0, topo)
            counts = torch.cat([torch.zeros(max(E, 0), dtype=torch.int64), rc])
            if err is None:
                emask = torch.tensor(active0, dtype=torch.bool, device=dev).repeat_interleave(L)
                counts[:E] = (cnt & emask).sum(0).cpu()
            hdr, active, epoch = self._header(
                op, fields, counts, error=err, names=names, extra=nvs_ok | (LL_CODES[want] << 1)
            )
            backend, why = self._choose_ll_backend(
                op, want, hdr, active, dev, Tm * L * H * max(4, x.element_size()), local_why
            )
            self._ll_backend, self._ll_why = backend, why
            act = [int(a and b) for a, b in zip(active, active0)]
            rows = local = None
            if backend == "group" and topo is not None:
                # across hosts: a token crosses to each remote host once and the host's
                # ranks place it in their experts' slots (the normal mode's route, when
                # _rows_handle plans one)
                rows, local = self._rows_handle(
                    (T, H, E, Kk),
                    topk_idx,
                    in_rank & torch.tensor(act, dtype=torch.bool, device=dev),
                    active,
                    epoch,
                    hdr[:, HDR + E :],
                    topo,
                    x.element_size(),
                )
                if rows.route is None:
                    rows = local = None
            emask = torch.tensor(act, dtype=torch.bool, device=dev).repeat_interleave(L)
            pairs = (cnt & emask).t().nonzero()  # [P, 2] (expert, token)
            pair_e, pair_t = pairs[:, 0].contiguous(), pairs[:, 1].contiguous()
            send_counts = (
                tuple(int(c) for c in torch.bincount(pair_e // L, minlength=W))
                if pairs.numel()
                else (0,) * W
            )
            # rows per (source, local expert) for this rank's experts
            c = hdr[:, HDR + self.rank * L : HDR + (self.rank + 1) * L].clone()
            for s in range(W):
                if not active[s]:
                    c[s] = 0
            recv_counts = tuple(int(v) for v in c.sum(1))
            WT = W * Tm
            recv_dst = None  # two levels: _ll_dispatch_two_level lays the pairs out
            if rows is None:
                off = torch.cumsum(c, 0) - c  # [W, L] start of (s, l) within expert l
                sizes = c.reshape(-1)
                gid = torch.repeat_interleave(torch.arange(W * L), sizes)
                starts = torch.cumsum(sizes, 0) - sizes
                q = torch.arange(int(sizes.sum())) - starts[gid]
                lid = gid % L
                # computed from the (CPU) header, then moved to the data's device
                recv_dst = (lid * WT + off.reshape(-1)[gid] + q).contiguous().to(dev)
            recv_count = c.sum(0).to(device=dev, dtype=torch.int32)
            # slot -> pair (pairs are sorted by expert, then token)
            keys = pair_e * max(T, 1) + pair_t
            sidx = topk_idx.long()
            skeys = sidx * max(T, 1) + torch.arange(T, device=dev).unsqueeze(1)
            pos = (
                torch.searchsorted(keys, skeys.reshape(-1)).reshape(T, Kk)
                if keys.numel()
                else torch.zeros((T, Kk), dtype=torch.int64, device=dev)
            )
            posc = pos.clamp(max=max(keys.numel() - 1, 0))
            found = (sidx >= 0) & (pos < keys.numel())
            if keys.numel():
                found &= keys[posc] == skeys
            slot_pair = torch.where(found, posc, torch.full_like(posc, -1))
            h = LowLatencyHandle(
                T,
                H,
                E,
                Tm,
                topk_idx,
                pair_t,
                slot_pair,
                send_counts,
                recv_counts,
                recv_dst,
                recv_count,
                bool(use_fp8),
                epoch,
                backend,
            )
            if rows is not None:
                recv_x, h = self._ll_dispatch_two_level(h, rows, local, x)
            elif use_fp8:
                with torch.no_grad():
                    send = K_.gather_rows(x, pair_t, self._cfg["kernels"])
                    qx, sc = K_.fp8_quantize(send, self._cfg["kernels"])
                    rq, rs = self._fwd(h, qx), self._fwd(h, sc)
                    nb = sc.shape[1]
                    px = self._recycler.empty((L * WT, H), K_.FP8_DTYPE, dev)
                    ps = self._recycler.empty((L * WT, nb), torch.float32, dev)
                    K_.scatter_rows(rq, recv_dst, px)
                    K_.scatter_rows(rs, recv_dst, ps)
                    recv_x = (px.view(L, WT, H), ps.view(L, WT, nb))
            else:
                recv_x = LowLatencyDispatchFn.apply(self, h, x)
            if self._membership()[1] == epoch or attempt == tries:
                break
        if self._membership()[1] != epoch:
            raise self._err(
                op, f"the group's membership changed {tries + 1} times during one dispatch"
            )
        if cumulative_local_expert_recv_stats is not None:
            cumulative_local_expert_recv_stats += recv_count
        return LowLatencyDispatchResult(recv_x, recv_count.clone(), h)

    def _ll_dispatch_two_level(self, h, rows, local, x):
        """A low-latency dispatch across hosts, on ``rows``' two-level route.

        Each token's row goes once to every rank that holds one of its experts (one row per (token,
        remote host) crosses a link), with its local expert ids (``local`` int32 [N_send, K]); each
        rank then copies a row into the slot of every local expert it chose. Returns ``recv_x`` (as
        the rank-to-rank path lays it out) and ``h`` with the route's tables. fp8 rows are quantized
        once per token at the source.
        """
        L = h.num_experts // self.group_size
        WT = self.group_size * h.num_max_dispatch_tokens_per_rank
        H = h.hidden
        if h.use_fp8:
            with torch.no_grad():
                qx, sc = K_.fp8_quantize(x, self._cfg["kernels"])
                rq, _, recv_idx = DispatchFn.apply(self, rows, local, qx.view(torch.uint8), None)
                rs = self._fwd_tokens(rows, sc)
        else:
            rx, _, recv_idx = DispatchFn.apply(self, rows, local, x, None)
        pair_row, recv_dst, slot_dst = _hosts.ll_pairs(recv_idx.long(), L, WT)
        h = dataclasses.replace(
            h,
            recv_dst=recv_dst,
            rows=rows,
            pair_row=pair_row,
            slot_dst=slot_dst,
            send_local=local(),
        )
        if not h.use_fp8:
            return LowLatencyDispatchFn.apply(self, h, rx), h
        px = self._recycler.empty((L * WT, H), torch.uint8, rq.device)
        ps = self._recycler.empty((L * WT, rs.shape[1]), torch.float32, rs.device)
        kern = self._cfg["kernels"]
        K_.scatter_rows(K_.gather_rows(rq, pair_row, kern), recv_dst, px)
        K_.scatter_rows(K_.gather_rows(rs, pair_row, kern), recv_dst, ps)
        return (px.view(K_.FP8_DTYPE).view(L, WT, H), ps.view(L, WT, -1)), h

    def low_latency_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: LowLatencyHandle,
        use_logfmt: bool = False,
        zero_copy: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: torch.Tensor | None = None,
    ) -> LowLatencyCombineResult:
        """Returns each pair's expert output to its token and sums them with the weights.

        ``combined_x[t] = sum_k topk_weights[t, k] *
        x[l_k, j_k]`` over the slots of token ``t`` whose expert took part (``(l_k, j_k)``: where
        the pair landed; duplicate ids count once per slot, so their weights add up). Rows move the
        way the dispatch's did (``handle.backend``: NVSHMEM or the group).

        Args:
            x: [L, W * T_max, H] float32/bfloat16/float16/float64 (not float8: dequantize first),
                the experts' outputs in the layout of ``low_latency_dispatch``'s ``recv_x``; it need
                not be the dispatched dtype; on the dispatch's device (as ``topk_idx``,
                ``topk_weights`` and ``out``).
            topk_idx: the dispatch's ``topk_idx`` ([T, K]; checked to be the same).
            topk_weights: float32 [T, K]; differentiable.
            handle: the :class:`LowLatencyHandle` of the dispatch.
            use_logfmt: must be ``False`` (not supported on CPU).
            zero_copy: must be ``False`` (not supported on CPU).
            async_finish: no effect on CPU.
            return_recv_hook: must be ``False`` (not supported on CPU).
            out: optional [T, H] tensor to write the result into.

        Returns:
            :class:`LowLatencyCombineResult` ``(combined_x, event, hook)``: ``combined_x`` [T, H] in
            x's dtype (accumulated in float32), ``event`` and ``hook`` ``None`` on CPU.
            Differentiable in ``x`` and ``topk_weights``.

        Raises:
            ValueError: on every rank, before any row moves, for bad arguments on some rank.
            RuntimeError: on the NVSHMEM path when a rank has left the group since the dispatch
                (NVSHMEM cannot run without it; dispatch again).
        """
        op = "low_latency_combine"
        err = None
        H = 0
        try:
            if not isinstance(handle, LowLatencyHandle):
                raise BadArgs(f"handle must be a LowLatencyHandle, got {type(handle).__name__}")
            check_x(
                x.reshape(-1, x.shape[-1]) if isinstance(x, torch.Tensor) and x.dim() == 3 else x
            )
            self._check_device(x)
            check_same_device("x", x, handle.device, "the dispatch's device")
            L = handle.num_experts // self.group_size
            shp = (L, self.group_size * handle.num_max_dispatch_tokens_per_rank, handle.hidden)
            if tuple(x.shape) != shp:
                raise BadArgs(f"x must have shape {shp}, got {tuple(x.shape)}")
            H = handle.hidden
            check_int_tensor("topk_idx", topk_idx, handle.num_tokens)
            check_same_device("topk_idx", topk_idx, x.device)
            if not torch.equal(topk_idx.long(), handle.topk_idx.long()):
                raise BadArgs("topk_idx differs from the one given to low_latency_dispatch")
            check_weights(topk_weights, tuple(topk_idx.shape))
            check_same_device("topk_weights", topk_weights, x.device)
            if use_logfmt or zero_copy or return_recv_hook:
                raise BadArgs("use_logfmt, zero_copy and return_recv_hook are not supported on CPU")
            if out is not None and (
                tuple(out.shape) != (handle.num_tokens, H) or out.dtype != x.dtype
            ):
                raise BadArgs(f"out must be {x.dtype} [{handle.num_tokens}, {H}]")
            check_same_device("out", out, x.device)
        except BadArgs as e:
            err = str(e)
        fields = [H, DTYPES.get(getattr(x, "dtype", None), 0)]
        self._header(op, fields, error=err, names=("hidden", "dtype"))
        res = LowLatencyCombineFn.apply(self, handle, x, topk_weights)
        if out is not None:
            with torch.no_grad():
                out.copy_(res)
            return LowLatencyCombineResult(out, None, None)
        return LowLatencyCombineResult(res, None, None)
