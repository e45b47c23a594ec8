"""Token rows across hosts in two stages: each token crosses a host link at most once per
remote host it needs, and is forwarded inside that host (DeepEP's internode scheme, its
"RDMA then NVLink" forwarding, here over the process group's TCP links and shared memory).

A normal-mode dispatch in a group that spans hosts plans a :class:`HostRoute` (kept in its
:class:`mooncake_ep.DispatchHandle`); the rows of x (dispatch, the combine's backward) move
with :func:`forward`, the rows summed back per token (combine, the dispatch's backward)
with :func:`backward`:

- stage 1 (``all_to_all_single`` over the group): a source sends a token once to every
  rank of its own host that needs it, and once to the *relay* of every other host that
  needs it: the live rank of that host whose local index is the source's local index
  (modulo the host's live ranks, so uneven hosts and dead ranks have a relay too). With
  each relayed row goes a bit mask of the host's ranks that want it (local indices).
- stage 2 (the group again, rows only between ranks of one host): each relay forwards the
  rows it received to the ranks of its host in its masks (itself included).
- each rank then lays its rows out as a flat dispatch would: by source rank, then token.

``backward`` runs the stages in reverse: each rank sends a remote token's rows to the
relay that brought it, the relay sums a token's rows (in float32 with
``fp32_accumulate``) and rounds once to the rows' dtype, one row per (token, host) goes
back and the source sums its token's rows from its own host's ranks and the relays. A
16-bit sum across hosts thus rounds once per host and once more at the source, as
DeepEP's internode combine does.

Planning uses the group's agreed membership of the dispatch: a route whose membership is
no longer the group's is not used (the handle's rank-to-rank counts serve instead), and a
membership change during a route's stages reruns the op rank to rank on every survivor.
"""

from __future__ import annotations

import dataclasses

import torch

from . import kernels as K_

PIECE_BYTES = 8 << 20  # a combine's last stage moves in pieces of about this much ...
MAX_PIECES = 4  # ... and at most this many (each piece is one more collective)


def pieces(most_bytes: int) -> int:
    """How many pieces a combine's last stage moves in when the rank that sends the most
    rows in a dispatch sends ``most_bytes`` (1 below 2 x PIECE_BYTES: a small op pays a
    collective's latency per piece and has little to overlap)."""
    return max(1, min(MAX_PIECES, most_bytes // PIECE_BYTES))


@dataclasses.dataclass(frozen=True, eq=False)
class HostRoute:
    """One rank's plan of the two stages (indices on the dispatch's device).

    ``send_token_idx`` int64 [N1]: the token of each stage-1 row, grouped by destination
    rank then token; ``relay_rows`` int64 [N2]: the stage-1 received row that each stage-2
    row forwards, grouped by destination then source then token; ``segments``: per source
    rank in order, ``(stage, offset, rows)`` of its final rows in that stage's received
    rows (stage 1: a source of this host; stage 2: a remote source via its relay).
    ``chunks``: how many pieces :func:`backward`'s last stage moves in (the same on every
    rank); a token's piece is ``token * chunks // T`` at its source. ``send_chunk`` int64
    [N1]: the piece of each stage-1 row sent, ``recv_chunk`` [N1_recv] of each received.
    """

    active: tuple[int, ...]
    send_token_idx: torch.Tensor
    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]
    relay_rows: torch.Tensor
    relay_send_counts: tuple[int, ...]
    relay_recv_counts: tuple[int, ...]
    segments: tuple[tuple[int, int, int], ...]
    num_recv: int
    max_rows_per_token: int
    ranks_on_host: int
    chunks: int = 1
    send_chunk: torch.Tensor | None = None
    recv_chunk: torch.Tensor | None = None


class Topology:
    """The group's hosts: ``hosts`` int64 [W], each rank's host numbered ``0..num_hosts-1``."""

    def __init__(self, hosts: torch.Tensor):
        self.hosts = hosts
        self.host_of = [int(h) for h in hosts.tolist()]
        self.num_hosts = max(self.host_of) + 1
        self.members = [[] for _ in range(self.num_hosts)]
        for r, h in enumerate(self.host_of):
            self.members[h].append(r)
        self.local_index = [self.members[h].index(r) for r, h in enumerate(self.host_of)]
        self.max_ranks_per_host = max(len(m) for m in self.members)
        # int64 [W]: each rank's bit in its host's masks (1 << local index)
        self.bits = torch.tensor([1 << i for i in self.local_index], dtype=torch.int64)

    def spans_hosts(self, ranks) -> bool:
        """Whether ``ranks`` live on more than one host, and the route can serve them (a
        relay's mask has one bit per rank of its host: at most 62)."""
        return self.max_ranks_per_host <= 62 and len({self.host_of[r] for r in ranks}) > 1

    def relays(self, active) -> list[list[int | None]]:
        """``[s][h]``: the rank of host ``h`` that relays source ``s``'s tokens (``None``
        when no rank of ``h`` is active; ``s`` itself on its own host)."""
        live = [[r for r in m if active[r]] for m in self.members]
        out = []
        for s in range(len(self.host_of)):
            row = []
            for h in range(self.num_hosts):
                if h == self.host_of[s]:
                    row.append(s)
                elif live[h]:
                    row.append(live[h][self.local_index[s] % len(live[h])])
                else:
                    row.append(None)
            out.append(row)
        return out

    def tokens_per_host(self, sent: torch.Tensor) -> torch.Tensor:
        """int64 [num_hosts]: tokens of ``sent`` (bool [T, W]) that go to each host."""
        return self.token_bits(sent).ne(0).sum(0)

    def token_bits(self, sent: torch.Tensor) -> torch.Tensor:
        """int64 [T, num_hosts]: per token and host, the bit mask of the host's ranks (by
        local index) that ``sent`` (bool [T, W]) sends the token to."""
        dev = sent.device
        out = torch.zeros((sent.shape[0], self.num_hosts), dtype=torch.int64, device=dev)
        out.index_add_(1, self.hosts.to(dev), sent.to(torch.int64) * self.bits.to(dev))
        return out


def plan_route(
    topo: Topology,
    rank: int,
    active,
    sent: torch.Tensor,
    host_counts,
    recv_counts,
    a2a,
    chunks: int = 1,
) -> HostRoute:
    """Collective: this rank's :class:`HostRoute`. ``sent`` bool [T, W]: where each token
    goes (active ranks only); ``host_counts`` [W] lists of [num_hosts]: each source's tokens
    per host (from the header); ``recv_counts`` [W]: the rows each source sends this rank in
    a flat dispatch; ``a2a(rows, send_counts, recv_counts)``: the group's row all-to-all,
    which carries each stage-1 row's bit mask of the ranks that want it to its relay, and
    the row's piece of :func:`backward`'s last stage (``chunks``, the same on every rank)."""
    W = len(topo.host_of)
    me, hm = rank, topo.host_of[rank]
    local = topo.members[hm]
    relay = topo.relays(active)
    # stage 1, sending: a token to each rank of this host that wants it, and once to the
    # relay of every other host that wants it
    bits = topo.token_bits(sent)  # [T, num_hosts]
    dest = torch.zeros_like(sent)
    for d in local:
        dest[:, d] = sent[:, d]
    for h in range(topo.num_hosts):
        r = relay[me][h]
        if h != hm and r is not None:
            dest[:, r] = bits[:, h] != 0
    nz = dest.t().nonzero()  # (destination, token)
    send_tok = nz[:, 1].contiguous()
    send_counts = tuple(int(c) for c in dest.sum(0))
    # stage 1, receiving: a flat dispatch's rows from this host's sources, and one row per
    # token from the remote sources this rank relays
    recv1 = tuple(
        int(recv_counts[s])
        if topo.host_of[s] == hm
        else (int(host_counts[s][hm]) if relay[s][hm] == me and active[s] else 0)
        for s in range(W)
    )
    dev = send_tok.device
    send_chunk = send_tok * chunks // max(sent.shape[0], 1)
    meta = torch.stack([bits[send_tok, topo.hosts.to(dev)[nz[:, 0]]], send_chunk], 1)
    recv_meta = a2a(meta, send_counts, recv1).to(dev)
    recv_masks, recv_chunk = recv_meta[:, 0].contiguous(), recv_meta[:, 1].contiguous()
    # stage 2, sending: the rows this rank relays (those of remote sources), per local
    # destination in its masks
    keep = torch.zeros(len(recv_masks), dtype=torch.bool, device=dev)
    start = 0
    for s, c in enumerate(recv1):
        if c and topo.host_of[s] != hm:
            keep[start : start + c] = True
        start += c
    m = torch.where(keep, recv_masks, torch.zeros_like(recv_masks))
    shifts = torch.tensor([topo.local_index[d] for d in local], dtype=torch.int64, device=dev)
    want = (m.unsqueeze(1) >> shifts).bitwise_and(1).bool()  # [N1_recv, G]
    relay_rows = want.t().nonzero()[:, 1].contiguous()  # by local destination, then row
    per_local = want.sum(0).tolist()
    relay_send = [0] * W
    for j, d in enumerate(local):
        relay_send[d] = int(per_local[j])
    # stage 2, receiving: from each relay of this host, the rows of the remote sources it
    # relays here, by source
    relay_recv = [0] * W
    for s in range(W):
        if topo.host_of[s] != hm and relay[s][hm] is not None:
            relay_recv[relay[s][hm]] += int(recv_counts[s])
    off1 = [0] * W
    off2 = [0] * W
    acc1 = acc2 = 0
    for r in range(W):
        off1[r], off2[r] = acc1, acc2
        acc1 += recv1[r]
        acc2 += relay_recv[r]
    segments = []
    for s in range(W):
        n = int(recv_counts[s])
        if topo.host_of[s] == hm:
            segments.append((1, off1[s], n))
        else:
            r = relay[s][hm]
            segments.append((2, off2[r] if r is not None else 0, n))
            if r is not None:
                off2[r] += n
    return HostRoute(
        tuple(int(a) for a in active),
        send_tok,
        send_counts,
        recv1,
        relay_rows,
        tuple(relay_send),
        tuple(relay_recv),
        tuple(segments),
        sum(int(c) for c in recv_counts),
        int(dest.sum(1).max()) if sent.shape[0] else 0,
        len(local),
        chunks,
        send_chunk,
        recv_chunk,
    )


def forward(a2a, route: HostRoute, x: torch.Tensor, kernels: str, alloc) -> torch.Tensor:
    """Rows of tokens ``x`` [T, H] to the ranks the dispatch sends them to; returns
    [N_recv, H] by source rank, then token (a flat dispatch's layout). ``a2a(rows,
    send_counts, recv_counts)`` is the group's row all-to-all."""
    r1 = a2a(
        K_.gather_rows(x, route.send_token_idx, kernels, alloc),
        route.send_counts,
        route.recv_counts,
    )
    r2 = a2a(
        K_.gather_rows(r1, route.relay_rows, kernels, alloc),
        route.relay_send_counts,
        route.relay_recv_counts,
    )
    out = alloc((route.num_recv,) + tuple(x.shape[1:]), x.dtype, x.device)
    at = 0
    for stage, off, n in route.segments:
        if n:
            out[at : at + n] = (r1 if stage == 1 else r2)[off : off + n]
        at += n
    return out


def backward(
    a2a,
    route: HostRoute,
    rows: torch.Tensor,
    num_tokens: int,
    fp32_accumulate: bool,
    out_dtype,
    alloc,
    a2a_start=None,
) -> torch.Tensor:
    """The reverse of :func:`forward`: ``rows`` [N_recv, H] in its layout -> [T, H] of
    ``out_dtype``, each token's rows summed (per host at its relay, then at the source).

    With ``route.chunks > 1`` and ``a2a_start`` (``a2a_start(rows, send_counts,
    recv_counts)`` starts the group's all-to-all and returns a function that waits for
    its result) the last stage moves in pieces of tokens: a relay sums the next piece
    while the last one crosses the link, and the source sums a piece while the next one
    crosses (a piece is a range of the source's tokens, summed on its own)."""
    H = tuple(rows.shape[1:])
    back = alloc((sum(route.relay_recv_counts),) + H, rows.dtype, rows.device)
    direct = []
    at = 0
    for stage, off, n in route.segments:
        if n:
            if stage == 2:
                back[off : off + n] = rows[at : at + n]
            else:
                direct.append((off, at, n))
        at += n
    at_relay = a2a(back, route.relay_recv_counts, route.relay_send_counts)
    if route.chunks > 1 and a2a_start is not None:
        return _backward_in_pieces(
            route, rows, at_relay, direct, num_tokens, fp32_accumulate, out_dtype, alloc, a2a_start
        )
    summed = K_.scatter_add_rows(
        at_relay,
        route.relay_rows,
        sum(route.recv_counts),
        max_per_row=route.ranks_on_host,
        fp32_accumulate=fp32_accumulate,
        out_dtype=rows.dtype,
        alloc=alloc,
    )
    for off, at, n in direct:
        summed[off : off + n] = rows[at : at + n]
    at_source = a2a(summed, route.recv_counts, route.send_counts)
    return K_.scatter_add_rows(
        at_source,
        route.send_token_idx,
        num_tokens,
        max_per_row=route.max_rows_per_token,
        fp32_accumulate=fp32_accumulate,
        out_dtype=out_dtype,
        alloc=alloc,
    )


def _backward_in_pieces(
    route, rows, at_relay, direct, num_tokens, fp32_accumulate, out_dtype, alloc, a2a_start
):
    """:func:`backward`'s last stage in ``route.chunks`` pieces (see there)."""
    W, C, dev = len(route.recv_counts), route.chunks, rows.device
    H = tuple(rows.shape[1:])
    n1 = sum(route.recv_counts)
    ranks = torch.arange(W, device=dev)
    src_of = torch.repeat_interleave(ranks, torch.tensor(route.recv_counts, device=dev))
    dst_of = torch.repeat_interleave(ranks, torch.tensor(route.send_counts, device=dev))
    # per stage-1 received row: the input row that answers it (a source of this host), or
    # -1 (a relayed row: the sum of the host's rows for it)
    direct_row = torch.full((n1,), -1, dtype=torch.int64, device=dev)
    for off, at, n in direct:
        direct_row[off : off + n] = torch.arange(at, at + n, device=dev)
    relay_chunk = route.recv_chunk.index_select(0, route.relay_rows)
    started = []
    for c in range(C):
        mine = (route.recv_chunk == c).nonzero()[:, 0]  # by source, then token
        pos = torch.full((n1,), -1, dtype=torch.int64, device=dev)
        pos[mine] = torch.arange(mine.numel(), device=dev)
        p = (relay_chunk == c).nonzero()[:, 0]
        piece = K_.scatter_add_rows(
            K_.gather_rows(at_relay, p, "torch", alloc),
            pos.index_select(0, route.relay_rows.index_select(0, p)),
            mine.numel(),
            max_per_row=route.ranks_on_host,
            fp32_accumulate=fp32_accumulate,
            out_dtype=rows.dtype,
            alloc=alloc,
        )
        d = mine[direct_row.index_select(0, mine) >= 0]
        if d.numel():
            piece.index_copy_(0, pos.index_select(0, d), rows.index_select(0, direct_row[d]))
        back_idx = (route.send_chunk == c).nonzero()[:, 0]  # by relay, then token
        wait = a2a_start(
            piece,
            torch.bincount(src_of.index_select(0, mine), minlength=W).tolist(),
            torch.bincount(dst_of.index_select(0, back_idx), minlength=W).tolist(),
        )
        started.append((wait, back_idx))
    out = alloc((num_tokens,) + H, out_dtype, dev)
    for c, (wait, back_idx) in enumerate(started):
        t0, t1 = (c * num_tokens + C - 1) // C, ((c + 1) * num_tokens + C - 1) // C
        out[t0:t1] = K_.scatter_add_rows(
            wait(),
            route.send_token_idx.index_select(0, back_idx) - t0,
            t1 - t0,
            max_per_row=route.max_rows_per_token,
            fp32_accumulate=fp32_accumulate,
            out_dtype=out_dtype,
            alloc=alloc,
        )
    return out


def ll_pairs(recv_idx: torch.Tensor, num_local_experts: int, slots_per_expert: int):
    """Where a low-latency dispatch's rows go at their destination when they arrive one per
    (token, rank) (two levels) rather than one per (token, expert): ``recv_idx`` int64
    [N, K] local expert ids of each received row (-1: elsewhere) -> ``(pair_row, recv_dst,
    slot_dst)``: int64 [P] the row of each distinct (row, local expert) pair, [P] its flat
    slot ``l * slots_per_expert + j`` (``j``: its place among expert ``l``'s pairs, by
    source rank then token, as the rank-to-rank path packs them) and [N, K] each top-k
    slot's flat slot (-1 where its expert is elsewhere; a duplicate id shares its pair's)."""
    N, L = recv_idx.shape[0], num_local_experts
    dev = recv_idx.device
    ids = torch.where(recv_idx < 0, torch.full_like(recv_idx, L), recv_idx)
    bits = torch.zeros((N, L + 1), dtype=torch.bool, device=dev)
    bits.scatter_(1, ids, True)
    nz = bits[:, :L].t().nonzero()  # (expert, row): by expert, then row
    lid, pair_row = nz[:, 0], nz[:, 1].contiguous()
    per_expert = torch.bincount(lid, minlength=L)
    start = torch.cumsum(per_expert, 0) - per_expert
    q = torch.arange(lid.numel(), device=dev) - start[lid]
    recv_dst = (lid * slots_per_expert + q).contiguous()
    table = torch.full((N, L + 1), -1, dtype=torch.int64, device=dev)
    table[pair_row, lid] = recv_dst
    slot_dst = table.gather(1, ids).contiguous()
    return pair_row, recv_dst, slot_dst
