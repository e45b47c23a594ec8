"""``ExpertParallelMoE``: an existing MoE layer with its experts sharded over the ranks of a group.

The layer is a router and experts; tokens are moved by :class:`mooncake_ep.Buffer`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ._comm import all_gather_single
from .buffer import Buffer


def route_topk(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts, then the ``top_k`` largest.

    Returns ``(topk_idx int64 [T, K], topk_weights float32 [T, K])``. The reference routing of
    :class:`ExpertParallelMoE` when the gate returns logits.
    """
    probs = torch.softmax(logits.float(), dim=-1)
    w, idx = torch.topk(probs, top_k, dim=-1)
    return idx, w


class ExpertParallelMoE(nn.Module):
    """Wraps a MoE layer: ``forward(x) = sum_k w_k * expert_{idx_k}(x)`` per token.

    The experts are spread over the ranks of ``group``: rank ``r`` holds experts
    ``[r L, (r + 1) L)``, ``L = E / W``.

    ``forward`` takes x [..., H] and returns the same shape and dtype. Every rank calls forward (and
    backward) together, also with zero tokens. Gradients reach x, the local experts' parameters and
    the gate (through the top-k weights, which are applied to the expert outputs before the
    combine). Experts on inactive ranks of a ``mooncake`` group contribute zero.

    Rejoined ranks: take :meth:`snapshot_experts` every few steps (each rank's experts are copied to
    the next active rank); after ``recover_ranks``/``join_group`` every rank calls
    :meth:`restore_experts` before the next forward, and until then forward raises ``RuntimeError``
    on every rank, before any collective: on the survivors (which saw the rank come back) and on the
    rejoined process itself (which knows it joined, whether it built this module before or after
    ``join_group``).

    Args:
        gate: ``nn.Module`` mapping tokens [T, H] to either router logits [T, E] (then softmax +
            top-``top_k``, see :func:`route_topk`) or a pair ``(topk_idx [T, K] int, topk_weights
            [T, K] float)`` (custom routing; -1 slots allowed). Replicated: every rank has the same
            gate (keep it in sync with data parallelism, e.g. all-reduce its gradients).
        experts: the experts, each mapping [n, H] -> [n, H]: either all E of them (this rank keeps
            its L and drops the rest) or only this rank's L (then pass ``num_experts``).
        group: the expert-parallel process group (default: the default group).
        num_experts: E; needed when ``experts`` holds only the local ones.
        top_k: slots per token when ``gate`` returns logits (``1 <= top_k <= E``); with a gate that
            returns ``(topk_idx, topk_weights)`` it is optional and, when given, must equal their K.
        buffer: a :class:`Buffer` to use (default: a new one on ``group``).

    Raises:
        ValueError: at construction for a bad ``top_k``, an expert count that is neither E nor L, or
            a gate whose output width is known (``out_features``, as for ``nn.Linear``) and differs
            from E; in forward (on every rank, before anything is sent, as the gate is replicated)
            for logits whose width is not E or a ``(topk_idx, topk_weights)`` pair whose K is not
            ``top_k``. A list of all experts passed with ``num_experts`` = W times its length reads
            as this rank's local experts; when the gate's width says otherwise the error says so.
    """

    def __init__(
        self,
        gate: nn.Module,
        experts: Sequence[nn.Module],
        group: dist.ProcessGroup | None = None,
        *,
        num_experts: int | None = None,
        top_k: int | None = None,
        buffer: Buffer | None = None,
    ) -> None:
        super().__init__()
        self.buffer = buffer if buffer is not None else Buffer(group)
        W, rank = self.buffer.group_size, self.buffer.rank
        experts = list(experts)
        E = int(num_experts) if num_experts is not None else len(experts)
        L = self.buffer.num_local_experts(E)
        if len(experts) == E:
            local = experts[rank * L : (rank + 1) * L]
        elif len(experts) == L:
            local = experts
        else:
            raise ValueError(
                f"ExpertParallelMoE: got {len(experts)} experts; expected all {E} or this "
                f"rank's {L} (num_experts={E}, group size {W})"
            )
        if top_k is not None:
            if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= E:
                raise ValueError(
                    f"ExpertParallelMoE: top_k must be an int in [1, num_experts={E}], got {top_k!r}"
                )
        self._num_given = len(experts)
        width = getattr(gate, "out_features", None)
        if isinstance(width, int):
            self._check_width(gate, width, E, W)
        self.gate = gate
        self.experts = nn.ModuleList(local)
        self.num_experts = E
        self.num_local_experts = L
        self.top_k = top_k
        self.first_expert = rank * L
        # membership bookkeeping for restore_experts (see there)
        self._members = self.buffer.get_active_ranks().tolist()
        self._backup = {}  # owner rank -> uint8 snapshot of its experts' state
        self._unrestored = set()  # ranks whose experts must be restored before routing
        # This process replaced a dead rank (it was built before or after join_group): its
        # experts hold fresh weights until restore_experts() ran.
        self._fresh = self._joining() or rank in self._last_joined()
        self._note_fresh()

    def _check_width(self, gate, width, E, W):
        if width == E:
            return
        msg = (
            f"ExpertParallelMoE: the gate ({_gate_name(gate)}) gives {width} logits per token, "
            f"but num_experts is {E}"
        )
        if width == self._num_given and self._num_given != E:
            msg += (
                f"; the {self._num_given} experts given were read as this rank's local experts (group size "
                f"{W}), but the gate routes over {width}: this is ambiguous. Pass all experts without "
                f"num_experts=, or this rank's experts with a gate of width num_experts"
            )
        raise ValueError(msg)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(topk_idx int64 [T, K], topk_weights float32 [T, K])`` for tokens x [T, H]."""
        g = self.gate(x)
        if isinstance(g, (tuple, list)):
            name = _gate_name(self.gate)
            if len(g) != 2:
                raise ValueError(
                    f"ExpertParallelMoE: the gate ({name}) returned a {type(g).__name__} of "
                    f"{len(g)} items; expected logits or (topk_idx, topk_weights)"
                )
            idx, w = g
            if self.top_k is not None and idx.dim() == 2 and idx.shape[1] != self.top_k:
                raise ValueError(
                    f"ExpertParallelMoE: the gate ({name}) returned top-{idx.shape[1]} routing "
                    f"(topk_idx {tuple(idx.shape)}), but top_k={self.top_k}"
                )
            return idx.long(), w.float()
        self._check_width(self.gate, int(g.shape[-1]), self.num_experts, self.buffer.group_size)
        if self.top_k is None:
            raise ValueError("ExpertParallelMoE: the gate returned logits; pass top_k=")
        return route_topk(g, self.top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [..., H] -> [..., H] of x's dtype: each token's weighted sum of expert outputs.

        The sum is over the token's top-k experts. Collective; see the class docstring on gradients,
        dead ranks and the ``RuntimeError`` before :meth:`restore_experts`.
        """
        self._check_membership()
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        topk_idx, topk_weights = self.route(x2)
        res = self.buffer.dispatch(
            x2, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=self.num_experts
        )
        recv_x, recv_idx, recv_w = res.recv_x, res.recv_topk_idx, res.recv_topk_weights
        y = self._experts(recv_x, recv_idx, recv_w)
        out = self.buffer.combine(y, res.handle).combined_x
        self._members = self.buffer.get_active_ranks().tolist()  # failures seen during this call
        return out.reshape(shape)

    def _experts(self, recv_x, recv_idx, recv_w):
        """Weighted outputs of the local experts, one row per received token."""
        H = recv_x.shape[1]
        y = torch.zeros((recv_x.shape[0], H), dtype=torch.float32, device=recv_x.device)
        for l, expert in enumerate(self.experts):
            hit = recv_idx == l  # [N, K]
            rows = hit.any(1).nonzero().squeeze(1)
            if rows.numel() == 0:
                continue
            w = (recv_w * hit).sum(1).index_select(0, rows)  # duplicates add up
            out = expert(recv_x.index_select(0, rows))
            y = y.index_add(0, rows, out.float() * w.unsqueeze(1))
        if torch.is_grad_enabled():
            # Keep every rank's graph the same shape: the combine's and the dispatch's
            # backward move data, so they must run on every rank, also where no rows
            # arrived or no expert was hit.
            y = y + (recv_x.sum() * 0 + recv_w.sum() * 0)
            y = y + _anchor(recv_x.device)
        return y.to(recv_x.dtype)

    # ------------------------------------------------------ recovery of expert weights

    def _last_joined(self):
        mp = self.buffer._mooncake
        if mp is None:
            return []
        try:
            return list(mp.backend_of(self.buffer.group).last_joined())
        except (AttributeError, ValueError):
            return []

    def _joining(self):
        mp = self.buffer._mooncake
        if mp is None:
            return False
        try:
            return bool(mp.backend_of(self.buffer.group).joining)
        except (AttributeError, ValueError):
            return False

    def _note_fresh(self):
        """On a rejoined process (until its experts are restored): note the unrestored ranks.

        Itself and the ranks that joined with it are unrestored, as the survivors see them.
        """
        if self._fresh and not self._joining():
            self._unrestored.add(self.buffer.rank)
            self._unrestored |= set(self._last_joined())

    def _check_membership(self):
        if self._joining():
            raise RuntimeError(
                f"ExpertParallelMoE ({self.buffer.where}): this process replaces a dead rank and has not "
                "joined the group yet; call mooncake_pg.join_group(), then restore_experts() on every rank"
            )
        self._note_fresh()
        active = self.buffer.get_active_ranks().tolist()
        back = {r for r in range(len(active)) if active[r] and not self._members[r]}
        self._unrestored |= back
        self._members = active
        live = {r for r in self._unrestored if active[r]}
        if live:
            raise RuntimeError(
                f"ExpertParallelMoE ({self.buffer.where}): rank(s) {sorted(live)} rejoined and their "
                "experts' weights are not restored yet; every rank calls restore_experts() first"
            )

    def _flat_state(self):
        ts = [t for ex in self.experts for t in list(ex.parameters()) + list(ex.buffers())]
        return ts, sum(t.numel() * t.element_size() for t in ts)

    def snapshot_experts(self) -> None:
        """Collective: every active rank sends a copy of its experts to the next active rank.

        The copy is of its local experts' parameters and buffers; the next active rank (cyclically)
        keeps it in memory. Call it every few steps; :meth:`restore_experts` hands a rejoined rank
        its copy back.
        """
        active = self.buffer.get_active_ranks().tolist()
        W, rank = len(active), self.buffer.rank
        live = [r for r in range(W) if active[r]]
        buddy = {r: live[(live.index(r) + 1) % len(live)] for r in live}
        src = [r for r in live if buddy[r] == rank]
        ts, n = self._flat_state()
        sdev = ts[0].device if ts else torch.device("cpu")  # the experts' device
        with torch.no_grad():
            mine = (
                torch.cat([t.detach().reshape(-1).view(torch.uint8) for t in ts])
                if ts
                else torch.zeros(0, dtype=torch.uint8, device=sdev)
            )
            send = [n if r == buddy.get(rank) else 0 for r in range(W)]
            recv = [n if r in src else 0 for r in range(W)]
            out = torch.empty(sum(recv), dtype=torch.uint8, device=sdev)
            dist.all_to_all_single(out, mine, recv, send, group=self.buffer.group)
        after = self.buffer.get_active_ranks().tolist()
        # copies of ranks that are gone now stay until they are restored (a snapshot taken
        # while a rank is dead must not drop the only copy of its experts)
        self._backup = {r: b for r, b in self._backup.items() if not after[r]}
        start = 0
        for r in range(W):
            if recv[r]:
                if after[r]:
                    self._backup[r] = out[start : start + recv[r]].clone()
                start += recv[r]

    def restore_experts(self, ranks: Sequence[int] | None = None) -> None:
        """Gives rejoined ranks their experts back from the latest :meth:`snapshot_experts` copy.

        Collective over the active ranks, right after ``recover_ranks`` / ``join_group`` (and before
        any forward): ranks that rejoined get their experts' parameters and buffers from the peer
        holding the latest :meth:`snapshot_experts` copy; then a new snapshot is taken (the rejoined
        rank's own copies were lost with it). Forward raises ``RuntimeError`` until this ran.
        Optimizer state of the restored experts is not restored (use ``mooncake_pg.sync_state`` for
        replicated parts).

        Args:
            ranks: the ranks to restore; defaults to the ranks that rejoined (the group's last join
                record) and the ranks this module saw come back.

        Raises:
            RuntimeError: on every rank if no copy of a rejoined rank's experts exists (no snapshot
                was taken before it died).
        """
        self._note_fresh()
        active = self.buffer.get_active_ranks().tolist()
        W, rank = len(active), self.buffer.rank
        want = (
            set(self._unrestored) | set(self._last_joined())
            if ranks is None
            else {int(r) for r in ranks}
        )
        want = {r for r in want if 0 <= r < W and active[r]}
        # who holds which copy, and which ranks want theirs (one small all_gather)
        table = torch.zeros(2 * W, dtype=torch.int64)
        for o in self._backup:
            table[o] = 1
        for r in want:
            table[W + r] = 1
        tables = torch.zeros(W * 2 * W, dtype=torch.int64)
        all_gather_single(tables, table, group=self.buffer.group)
        tables = tables.view(W, 2 * W)
        live = [r for r in range(W) if active[r]]
        want_all = sorted({j for r in live for j in range(W) if int(tables[r, W + j])})
        holder = {}
        for j in want_all:
            hs = [r for r in live if r != j and int(tables[r, j])]
            if not hs:
                raise RuntimeError(
                    f"ExpertParallelMoE ({self.buffer.where}): no copy of rank {j}'s experts exists "
                    "(snapshot_experts was not called while it was alive)"
                )
            holder[j] = hs[0]
        ts, n = self._flat_state()
        send = [0] * W
        recv = [0] * W
        chunks = []
        for j in want_all:
            if holder[j] == rank:
                send[j] = n
                chunks.append(self._backup[j])
            if j == rank:
                recv[holder[j]] = n
        sdev = ts[0].device if ts else torch.device("cpu")  # the experts' device
        inp = torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.uint8, device=sdev)
        out = torch.empty(sum(recv), dtype=torch.uint8, device=sdev)
        dist.all_to_all_single(out, inp, recv, send, group=self.buffer.group)
        if rank in want_all:
            with torch.no_grad():
                off = 0
                for t in ts:
                    nb = t.numel() * t.element_size()
                    t.copy_(out[off : off + nb].view(t.dtype).view(t.shape))
                    off += nb
        self._unrestored -= set(want_all)
        if rank in want_all:
            self._fresh = False
        self._members = self.buffer.get_active_ranks().tolist()
        self.snapshot_experts()


def _gate_name(gate):
    r = repr(gate)
    return r if "\n" not in r and len(r) <= 100 else type(gate).__name__


def _anchor(device):
    return torch.zeros((), requires_grad=True, device=device)
