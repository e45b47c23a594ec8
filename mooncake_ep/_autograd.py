"""The autograd functions of :class:`mooncake_ep.Buffer`'s ops.

Each forward moves rows with the Buffer's transport, each backward moves the gradients the other way
(a dispatch's backward is a combine and vice versa). Every rank runs the same backward passes (they
are collective). ``buf`` is the :class:`mooncake_ep.Buffer`, ``handle`` its dispatch's handle.
"""

from __future__ import annotations

import torch

from . import kernels as K_


def _rows_per_expert(recv_idx, num_local_experts):
    """int64 [L]: received rows that name each local expert (a row once per expert; -1 skipped)."""
    L = num_local_experts
    idx = recv_idx.long()
    idx = torch.where(idx < 0, torch.full_like(idx, L), idx)
    mask = torch.zeros((idx.shape[0], L + 1), dtype=torch.bool, device=idx.device)
    mask.scatter_(1, idx, True)
    return mask[:, :L].sum(0)


class DispatchFn(torch.autograd.Function):
    """(local idx of sent rows, x, topk_weights) -> (recv_x, recv_topk_weights, recv_topk_idx).

    The local idx (int32 [N_send, K]) may be given as the function that returns it (called while
    the rows move). ``stats``: ``None``, or a dict with ``"num_local_experts"`` L, which gets ``"rows_per_expert"``
    (int64 [L], the received rows that name each local expert).
    """

    @staticmethod
    def forward(ctx, buf, handle, local_idx, x, w, stats=None):
        ctx.buf, ctx.handle = buf, handle
        ctx.x_dtype = x.dtype
        got = {}
        tasks = ()
        if local_idx is not None:

            def start_meta():  # the rows' expert ids and weights, rank to rank
                local_idx_ = local_idx() if callable(local_idx) else local_idx
                got["k"] = local_idx_.shape[1]
                if w is not None:
                    w_rows = w.detach().index_select(0, handle.send_token_idx)
                    w_rows = torch.where(local_idx_ >= 0, w_rows, torch.zeros_like(w_rows))
                    meta = torch.cat([local_idx_, w_rows.view(torch.int32)], 1)
                else:
                    meta = local_idx_
                got["wait"] = buf._fwd_start(handle, meta)

            def finish_meta():
                recv_meta = got.pop("wait")()
                k = got["k"]
                recv_idx = recv_meta[:, :k].contiguous()
                # rows an inactive source did not send are zero: make their slots "no expert"
                if w is not None:
                    got["w"] = recv_meta[:, k:].contiguous().view(torch.float32)
                if buf._mooncake is not None and recv_idx.numel():
                    active, _ = buf._membership()
                    start = 0
                    for s, c in enumerate(handle.recv_counts):
                        if c and not active[s]:
                            recv_idx[start : start + c] = -1
                        start += c
                got["idx"] = recv_idx
                if stats is not None:
                    stats["rows_per_expert"] = _rows_per_expert(
                        recv_idx, stats["num_local_experts"]
                    )

            # started after the rows' first all-to-all and finished while the rows move (across
            # hosts), or around the rows rank to rank: their latency and CPU hide behind the rows
            tasks = (start_meta, finish_meta)
        recv_x = buf._fwd_tokens(handle, x.detach(), tasks)
        recv_w, recv_idx = got.get("w"), got.get("idx")
        if recv_idx is not None:
            ctx.mark_non_differentiable(recv_idx)
        ctx.recv_idx = recv_idx
        return recv_x, recv_w, recv_idx

    @staticmethod
    def backward(ctx, g_x, g_w, g_idx):
        buf, h = ctx.buf, ctx.handle
        gx = gw = None
        if ctx.needs_input_grad[3]:
            if g_x is None:
                g_x = torch.zeros(
                    (sum(h.recv_counts), h.hidden), dtype=ctx.x_dtype, device=h.device
                )
            gx = buf._bwd_tokens(h, g_x.contiguous(), g_x.dtype)
        if ctx.needs_input_grad[4]:
            n = sum(h.recv_counts)
            if g_w is None:
                g_w = torch.zeros((n, h.num_topk), device=h.device)
            g_w = torch.where(ctx.recv_idx >= 0, g_w, torch.zeros_like(g_w))
            rows = buf._bwd(h, g_w.float().contiguous())
            gw = K_.scatter_add_rows(rows, h.send_token_idx, h.num_tokens, out_dtype=torch.float32)
        return None, None, None, gx, gw, None


class CombineFn(torch.autograd.Function):
    """(recv rows x, topk_weights) -> (combined_x, combined_topk_weights)."""

    @staticmethod
    def forward(ctx, buf, handle, x, w):
        ctx.buf, ctx.handle = buf, handle
        ctx.x_dtype = x.dtype
        out = buf._bwd_tokens(handle, x.detach(), x.dtype)
        out_w = None
        if w is not None:
            wr = buf._bwd(handle, w.detach())
            out_w = K_.scatter_add_rows(
                wr, handle.send_token_idx, handle.num_tokens, out_dtype=torch.float32
            )
        return out, out_w

    @staticmethod
    def backward(ctx, g_out, g_w):
        buf, h = ctx.buf, ctx.handle
        gx = gw = None
        kern = buf._cfg["kernels"]
        if ctx.needs_input_grad[2]:
            if g_out is None:
                g_out = torch.zeros((h.num_tokens, h.hidden), dtype=ctx.x_dtype, device=h.device)
            gx = buf._fwd_tokens(h, g_out.contiguous())
        if ctx.needs_input_grad[3]:
            if g_w is None:
                g_w = torch.zeros((h.num_tokens, h.num_topk), device=h.device)
            gw = buf._fwd(h, K_.gather_rows(g_w.float().contiguous(), h.send_token_idx, kern))
        return None, None, gx, gw


class LowLatencyDispatchFn(torch.autograd.Function):
    """x [T, H] -> packed [L, W * T_max, H]: each (token, expert) pair's row to the expert's rank.

    Two levels (``handle.rows``): the input is the rows that arrived one per (token, rank)
    [N_rows, H] instead, each copied into the slot of every local expert its token chose; the
    backward sums a row's slots there.
    """

    @staticmethod
    def forward(ctx, buf, handle, x):
        ctx.buf, ctx.handle, ctx.num_rows = buf, handle, x.shape[0]
        L = handle.num_experts // buf.group_size
        WT = buf.group_size * handle.num_max_dispatch_tokens_per_rank
        kern = buf._cfg["kernels"]
        if handle.rows is None:
            pairs = K_.gather_rows(x.detach(), handle.pair_token, kern, buf._recycler.empty)
            pairs = buf._fwd(handle, pairs)
        else:
            pairs = K_.gather_rows(x.detach(), handle.pair_row, kern, buf._recycler.empty)
        packed = buf._recycler.empty((L * WT, handle.hidden), x.dtype, x.device)
        K_.scatter_rows(pairs, handle.recv_dst, packed)
        return packed.view(L, WT, handle.hidden)

    @staticmethod
    def backward(ctx, g):
        buf, h = ctx.buf, ctx.handle
        flat = g.reshape(-1, h.hidden).contiguous()
        pairs = K_.gather_rows(flat, h.recv_dst, buf._cfg["kernels"], buf._recycler.empty)
        if h.rows is None:
            pairs, idx = buf._bwd(h, pairs), h.pair_token
        else:
            idx = h.pair_row
        gx = K_.scatter_add_rows(
            pairs,
            idx,
            ctx.num_rows,
            fp32_accumulate=buf._cfg["fp32_accumulate"],
            out_dtype=g.dtype,
        )
        return None, None, gx


def _pair_weights(handle, topk_weights):
    """float32 [P]: sum of the weights of the slots that map to each pair."""
    P = handle.pair_token.numel()
    wp = torch.zeros(P, dtype=torch.float32, device=handle.device)
    sel = handle.slot_pair >= 0
    if P and bool(sel.any()):
        wp.index_add_(0, handle.slot_pair[sel], topk_weights[sel].float())
    return wp


def _slots(handle):
    """Two levels: where the received rows' top-k slots of this rank's experts are.

    (row, k, flat slot) of every received row's top-k slot whose expert is on this rank, each
    int64 [S].
    """
    n, k = (handle.slot_dst >= 0).nonzero().unbind(1)
    return n, k, handle.slot_dst[n, k]


class LowLatencyCombineFn(torch.autograd.Function):
    """(packed x [L, W * T_max, H], topk_weights [T, K]) -> combined [T, H].

    Two levels (``handle.rows``): each row's weights travel to its destination, which sums its
    experts' outputs of the row's token (float32, rounded once to x's dtype); the row then goes back
    as a normal combine's does (summed per host, then at the source).
    """

    @staticmethod
    def forward(ctx, buf, handle, x, w):
        ctx.buf, ctx.handle = buf, handle
        if handle.rows is not None:
            return LowLatencyCombineFn._two_level(ctx, buf, handle, x.detach(), w.detach())
        flat = x.detach().reshape(-1, handle.hidden)
        alloc = buf._recycler.empty
        rows = buf._bwd(handle, K_.gather_rows(flat, handle.recv_dst, buf._cfg["kernels"], alloc))
        wp = _pair_weights(handle, w.detach())
        out = K_.scatter_add_rows(
            rows,
            handle.pair_token,
            handle.num_tokens,
            weights=wp,
            out_dtype=x.dtype,
            alloc=buf._recycler.empty,
        )
        ctx.save_for_backward(rows, wp)
        ctx.x_dtype = x.dtype
        return out

    @staticmethod
    def _two_level(ctx, buf, h, x, w):
        rh = h.rows
        w_rows = w.float().index_select(0, rh.send_token_idx)
        w_rows = torch.where(h.send_local >= 0, w_rows, torch.zeros_like(w_rows))
        w_recv = buf._fwd(rh, w_rows)  # [N_rows, K]; zero from inactive sources
        n, k, dst = _slots(h)
        flat = x.reshape(-1, h.hidden)
        alloc = buf._recycler.empty
        y = K_.scatter_add_rows(
            K_.gather_rows(flat, dst, buf._cfg["kernels"], alloc),
            n,
            sum(rh.recv_counts),
            weights=w_recv[n, k],
            out_dtype=x.dtype,
            alloc=alloc,
        )
        ctx.save_for_backward(flat, w_recv)
        ctx.x_dtype = x.dtype
        return buf._bwd_tokens(rh, y, x.dtype)

    @staticmethod
    def _two_level_backward(ctx, g):
        buf, h = ctx.buf, ctx.handle
        rh = h.rows
        flat, w_recv = ctx.saved_tensors
        kern = buf._cfg["kernels"]
        g_rows = buf._fwd_tokens(rh, g.contiguous())  # [N_rows, H]
        n, k, dst = _slots(h)
        alloc = buf._recycler.empty
        g_slots = K_.gather_rows(g_rows, n, kern, alloc)
        gx = gw = None
        if ctx.needs_input_grad[2]:
            L = h.num_experts // buf.group_size
            WT = buf.group_size * h.num_max_dispatch_tokens_per_rank
            gx = K_.scatter_add_rows(
                g_slots, dst, L * WT, weights=w_recv[n, k], out_dtype=ctx.x_dtype
            ).view(L, WT, h.hidden)
        if ctx.needs_input_grad[3]:
            dots = (g_slots.float() * K_.gather_rows(flat, dst, kern).float()).sum(1)
            g_recv = torch.zeros_like(w_recv)
            g_recv[n, k] = dots
            back = buf._bwd(rh, g_recv)  # [N_send, K]: a slot is nonzero at one rank only
            gw = K_.scatter_add_rows(back, rh.send_token_idx, h.num_tokens, out_dtype=torch.float32)
        return None, None, gx, gw

    @staticmethod
    def backward(ctx, g):
        if ctx.handle.rows is not None:
            return LowLatencyCombineFn._two_level_backward(ctx, g)
        buf, h = ctx.buf, ctx.handle
        rows, wp = ctx.saved_tensors
        gx = gw = None
        g_rows = K_.gather_rows(g.contiguous(), h.pair_token, buf._cfg["kernels"])  # [P, H]
        if ctx.needs_input_grad[3]:
            gp = (g_rows.float() * rows.float()).sum(1)  # [P]
            sel = h.slot_pair >= 0
            gw = torch.zeros(h.slot_pair.shape, dtype=torch.float32, device=h.device)
            if bool(sel.any()):
                gw[sel] = gp[h.slot_pair[sel]]
        if ctx.needs_input_grad[2]:
            send = (g_rows.float() * wp.unsqueeze(1)).to(ctx.x_dtype)
            recv = buf._fwd(h, send)
            L = h.num_experts // buf.group_size
            WT = buf.group_size * h.num_max_dispatch_tokens_per_rank
            packed = torch.zeros((L * WT, h.hidden), dtype=ctx.x_dtype, device=h.device)
            K_.scatter_rows(recv, h.recv_dst, packed)
            gx = packed.view(L, WT, h.hidden)
        return None, None, gx, gw
