"""Token rows across hosts in two stages, each token crossing a host link once per remote host.

Each token crosses a host link at most once per remote host it needs, and is forwarded inside that
host (DeepEP's internode scheme, its "RDMA then NVLink" forwarding, here over the process group's
TCP links and shared memory).

A normal-mode dispatch in a group that spans hosts plans a :class:`HostRoute` (kept in its
:class:`mooncake_ep.DispatchHandle`); the rows of x (dispatch, the combine's backward) move with
:func:`forward`, the rows summed back per token (combine, the dispatch's backward) with
:func:`backward`:

- stage 1 (``all_to_all_single`` over the group): a source sends a token once to every rank of its
  own host that needs it, and once to the *relay* of every other host that needs it: the live rank
  of that host whose local index is the source's local index (modulo the host's live ranks, so
  uneven hosts and dead ranks have a relay too). With each relayed row goes a bit mask of the host's
  ranks that want it (local indices).
- stage 2 (the group again, rows only between ranks of one host): each relay forwards the rows it
  received to the ranks of its host in its masks (itself included).
- each rank then lays its rows out as a flat dispatch would: by source rank, then token.

Both move in pieces of tokens, pipelined (:class:`_Pieces`). ``backward`` runs the stages in
reverse: each rank sends a remote token's rows to the relay that brought it, the relay sums a
token's rows (in float32 with ``fp32_accumulate``) and rounds once to the rows' dtype, one row per
(token, host) goes back and the source sums its token's rows from its own host's ranks and the
relays. A 16-bit sum across hosts thus rounds once per host and once more at the source, as DeepEP's
internode combine does.

Planning uses the group's agreed membership of the dispatch: a route whose membership is no longer
the group's is not used (the handle's rank-to-rank counts serve instead), and a membership change
during a route's stages reruns the op rank to rank on every survivor.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import torch

from . import kernels as K_

PIECE_BYTES = 2 << 20  # the stages crossing hosts move in pieces of about this much ...
# ... and at most this many (each piece is one more collective). A power of two: the
# header counts each source's rows per destination in MAX_PIECES ranges of its tokens,
# and a route's pieces are unions of those ranges.
MAX_PIECES = 8


def pieces(most_bytes: int) -> int:
    """How many pieces (1, 2, 4, ... up to MAX_PIECES) a two-level dispatch and combine move in.

    The count follows ``most_bytes``, what the rank that sends or receives the most rows moves: 1
    below 2 x PIECE_BYTES (a small op pays a collective's latency per piece and has little to
    overlap).
    """
    n = 1
    while 2 * n <= min(MAX_PIECES, most_bytes // PIECE_BYTES):
        n *= 2
    return n


def piece_bounds(num_tokens: int, chunks: int) -> list[int]:
    """Token ``t`` is in piece ``t * chunks // num_tokens``: the ``chunks + 1`` bounds."""
    return [(c * num_tokens + chunks - 1) // chunks for c in range(chunks + 1)]


def piece_counts(sent: torch.Tensor) -> torch.Tensor:
    """int64 [W, MAX_PIECES] (CPU): rows per destination rank in each of MAX_PIECES token ranges.

    The token ranges are those of ``sent`` (bool [T, W]); the counts go into the header.
    """
    b = piece_bounds(sent.shape[0], MAX_PIECES)
    return torch.stack([sent[b[p] : b[p + 1]].sum(0) for p in range(MAX_PIECES)], 1).cpu()


@dataclasses.dataclass(frozen=True, eq=False)
class HostRoute:
    """One rank's plan of the two stages (indices on the dispatch's device).

    ``send_token_idx`` int64 [N1]: the token of each stage-1 row, grouped by destination
    rank then token; ``relay_rows`` int64 [N2]: the stage-1 received row that each stage-2
    row forwards, grouped by destination then source then token. ``chunks``: how many
    pieces :func:`forward` and :func:`backward` move in (the same on every rank); a
    token's piece is ``token * chunks // T`` at its source.
    ``send_chunk`` int64 [N1]: the piece of each stage-1 row sent, ``recv_chunk``
    [N1_recv] of each received. ``piece_rows`` [W][chunks]: the rows each source sends
    this rank per piece in a flat dispatch; ``delivered_by`` [W]: the rank whose stage
    brings them (the source itself on this host, else its relay here; ``None``: none).
    ``pieces``: where each piece's rows are (:class:`_Pieces`, computed once per route).
    """

    active: tuple[int, ...]
    send_token_idx: torch.Tensor
    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]
    relay_rows: torch.Tensor
    relay_send_counts: tuple[int, ...]
    num_recv: int
    max_rows_per_token: int
    ranks_on_host: int
    chunks: int
    send_chunk: torch.Tensor
    recv_chunk: torch.Tensor
    piece_rows: tuple[tuple[int, ...], ...]
    delivered_by: tuple[int | None, ...]

    @functools.cached_property
    def pieces(self) -> _Pieces:
        return _Pieces(self)


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
        """Whether ``ranks`` live on more than one host, and the route can serve them.

        A relay's mask has one bit per rank of its host: at most 62.
        """
        return self.max_ranks_per_host <= 62 and len({self.host_of[r] for r in ranks}) > 1

    def relays(self, active) -> list[list[int | None]]:
        """``[s][h]``: the rank of host ``h`` that relays source ``s``'s tokens.

        ``None`` when no rank of ``h`` is active; ``s`` itself on its own host.
        """
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
        """int64 [T, num_hosts]: per token and host, the bit mask of the host's ranks it is sent to.

        The ranks are by local index; ``sent`` (bool [T, W]) says where each token is sent.
        """
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
    chunks: int,
    fine_rows,
) -> HostRoute:
    """Collective: this rank's :class:`HostRoute`.

    Args:
        topo: the group's hosts.
        rank: this rank.
        active: [W], whether each rank is in the dispatch's agreed membership.
        sent: bool [T, W]: where each token goes (active ranks only).
        host_counts: [W] lists of [num_hosts]: each source's tokens per host (from the header).
        recv_counts: [W]: the rows each source sends this rank in a flat dispatch.
        a2a: ``a2a(rows, send_counts, recv_counts)``: the group's row all-to-all, which carries each
            stage-1 row's bit mask of the ranks that want it to its relay, and the row's piece.
        chunks: the number of pieces, a power of two up to MAX_PIECES, the same on every rank.
        fine_rows: [W] lists of [MAX_PIECES]: ``recv_counts`` per token range (:func:`piece_counts`,
            from the header; zeros for an inactive source).
    """
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
    # stage 2, receiving, and the layout: per source and piece, from the source itself
    # (this host) or its relay here
    per = MAX_PIECES // chunks
    piece_rows = tuple(
        tuple(sum(int(v) for v in fine_rows[s][c * per : (c + 1) * per]) for c in range(chunks))
        for s in range(W)
    )
    delivered_by = tuple(s if topo.host_of[s] == hm else relay[s][hm] for s in range(W))
    return HostRoute(
        tuple(int(a) for a in active),
        send_tok,
        send_counts,
        recv1,
        relay_rows,
        tuple(relay_send),
        sum(int(c) for c in recv_counts),
        int(dest.sum(1).max()) if sent.shape[0] else 0,
        len(local),
        chunks,
        send_chunk,
        recv_chunk,
        piece_rows,
        delivered_by,
    )


class _Pieces:
    """Where the rows of each piece are, for :func:`forward` and :func:`backward`.

    Counts per rank and piece are ``[W][C]`` lists; "key order" is by rank, then piece.

    All-to-all ``k`` (of ``ops``) carries piece :meth:`first` of ``k``'s first stage and piece
    :meth:`second`'s second stage, in each rank's block in that order.

    ``n1``: stage-1 rows sent per (destination, piece), blocks of ``send_token_idx`` at ``at1``;
    ``r1``: stage-1 rows received per (source, piece); ``n2``: stage-2 rows sent per (rank of this
    host, piece), blocks at ``at2`` of the stage-1 received rows they forward (by source then token
    within a piece); ``r2``: stage-2 rows received per (relay, piece); ``out_at[s][c]``: where
    source ``s``'s rows of piece ``c`` start in the flat layout. ``recv_fwd``/``recv_bwd``: each
    all-to-all's rows per rank received by :func:`forward`/:func:`backward`,
    ``base_fwd``/``base_bwd`` where each rank's block starts. For those forwarded rows, int64 [N2]
    in ``at2``'s order: ``fwd_pos``, where each arrived in :func:`forward`'s all-to-alls, and
    ``fwd_dense``, its place among its piece's relayed rows (:func:`backward`'s relay sums), where
    remote source ``s``'s rows of piece ``c`` start at ``dense[c][s]``.
    """

    def __init__(self, route: HostRoute):
        W, C, dev = len(route.send_counts), route.chunks, route.send_token_idx.device
        self.W, self.C, self.route = W, C, route
        # with lag 2 the second stage of a piece needs an all-to-all that ended before the
        # one in flight began, so the next one is started while one is in flight (the
        # links never wait for a host's forwarding or sums)
        self.lag = 2 if C > 1 else 1
        self.ops = C + self.lag
        ranks = torch.arange(W, device=dev)

        def per_rank_piece(counts, chunk):  # rows grouped by rank -> keys, [W][C] counts
            key = torch.repeat_interleave(ranks, torch.tensor(counts, device=dev)) * C + chunk
            return key, torch.bincount(key, minlength=W * C).view(W, C).tolist()

        _, self.n1 = per_rank_piece(route.send_counts, route.send_chunk)
        self.at1 = _starts(self.n1)
        key1, self.r1 = per_rank_piece(route.recv_counts, route.recv_chunk)
        # stage 2 by (rank of this host, piece), by source then token within a piece
        k2, self.n2 = per_rank_piece(route.relay_send_counts, route.recv_chunk[route.relay_rows])
        fwd_rows = route.relay_rows[torch.sort(k2, stable=True).indices]
        self.at2 = _starts(self.n2)
        self.r2 = [[0] * C for _ in range(W)]
        for s, r in enumerate(route.delivered_by):
            if self.relayed(s):
                for c in range(C):
                    self.r2[r][c] += route.piece_rows[s][c]
        at = _starts(route.piece_rows)
        self.out_at = [at[s * C : (s + 1) * C] for s in range(W)]
        self.recv_fwd = [self.counts(k, self.r1, self.r2) for k in range(self.ops)]
        self.recv_bwd = [self.counts(k, self.n2, self.n1) for k in range(self.ops)]
        self.base_fwd = [_bases(rc) for rc in self.recv_fwd]
        self.base_bwd = [_bases(rc) for rc in self.recv_bwd]
        self.dense = [
            _bases([self.r1[s][c] if self.relayed(s) else 0 for s in range(W)]) for c in range(C)
        ]
        # per stage-1 received row (of source s, piece c): its place in rows where
        # (s, c) starts at bases[c][s]; each piece's stage-1 rows lead its all-to-all
        full = _starts(self.r1)

        def place(bases):
            delta = [bases[c][s] - full[s * C + c] for s in range(W) for c in range(C)]
            delta = torch.tensor(delta, dtype=torch.int64, device=dev)
            return (torch.arange(len(key1), device=dev) + delta[key1])[fwd_rows]

        self.fwd_pos = place(self.base_fwd[:C])
        self.fwd_dense = place(self.dense)

    def relayed(self, s) -> bool:
        """Whether source ``s``'s rows reach this rank through a relay (a remote source)."""
        r = self.route.delivered_by[s]
        return r is not None and r != s

    def first(self, k) -> int | None:
        """The piece whose first stage all-to-all ``k`` carries (``None``: none)."""
        return k if k < self.C else None

    def second(self, k) -> int | None:
        """The piece whose second stage all-to-all ``k`` carries (``None``: none)."""
        return k - self.lag if 0 <= k - self.lag < self.C else None

    def counts(self, k, a, b) -> list[int]:
        """All-to-all ``k``'s rows per rank: ``a``'s of one piece, then ``b``'s of another.

        ``a``'s are those of piece :meth:`first`, ``b``'s those of piece :meth:`second`.
        """
        f, g = self.first(k), self.second(k)
        return [
            (a[r][f] if f is not None else 0) + (b[r][g] if g is not None else 0)
            for r in range(self.W)
        ]


def _bases(counts) -> list[int]:
    """Where each block starts (and, last, the total) for blocks of ``counts`` rows."""
    return list(itertools.accumulate(counts, initial=0))


def _starts(n) -> list[int]:
    """[W][C] counts -> the start of each (rank, piece) block in key order."""
    return _bases(v for row in n for v in row)


def _positions(spans, dev) -> torch.Tensor:
    """int64 [sum of n]: the row numbers of ``(start, n)`` spans, in order."""
    return torch.cat(
        [torch.arange(a, a + n, device=dev) for a, n in spans if n]
        or [torch.zeros(0, dtype=torch.int64, device=dev)]
    )


def forward(a2a_start, route: HostRoute, x: torch.Tensor, alloc, tasks=()) -> torch.Tensor:
    """Rows of tokens ``x`` [T, H] to the ranks the dispatch sends them to.

    Returns [N_recv, H] by source rank, then token (a flat dispatch's layout).

    The stages move in ``route.chunks`` pieces, pipelined: an all-to-all carries one piece's stage-1
    rows and an earlier piece's stage-2 rows (:class:`_Pieces`), so a host's forwarding rides along
    with the next piece crossing the links; the next all-to-all is started while one is in flight,
    and the rows of one that ended are laid out meanwhile. ``a2a_start(rows, send_counts,
    recv_counts)`` starts the group's row all-to-all and returns the function that waits for its
    rows (by source). ``tasks``: callables, the ``k``-th run right after all-to-all ``k`` is started
    (those left over at the end), so that their work and any collectives they start (the same on
    every rank) overlap the rows in flight.
    """
    dev, H = x.device, tuple(x.shape[1:])
    P = route.pieces
    W, C = P.W, P.C
    base = P.base_fwd
    out = alloc((route.num_recv,) + H, x.dtype, dev)

    def stage1(k, send):  # x's rows of piece k, by destination (runs of blocks: one gather)
        f, g = P.first(k), P.second(k)
        if f is None:
            return
        at, run_at, run = 0, 0, []
        for d in range(W):
            n = P.n1[d][f]
            if n:
                run.append(route.send_token_idx[P.at1[d * C + f] : P.at1[d * C + f] + n])
            at += n
            if g is not None and P.n2[d][g]:  # the stage-2 rows follow: the run ends
                if run:
                    torch.index_select(x, 0, torch.cat(run), out=send[run_at:at])
                at += P.n2[d][g]
                run_at, run = at, []
        if run:
            torch.index_select(x, 0, torch.cat(run), out=send[run_at:at])

    def stage2(k, send, prev):  # piece g's rows, received in all-to-all g, forwarded
        f, g = P.first(k), P.second(k)
        at = 0
        for d in range(W):
            at += P.n1[d][f] if f is not None else 0
            n = P.n2[d][g]
            if n:
                o = P.at2[d * C + g]
                torch.index_select(prev, 0, P.fwd_pos[o : o + n], out=send[at : at + n])
            at += n

    def lay_out(k, rows):  # all-to-all k's rows into the flat layout
        f, g = P.first(k), P.second(k)
        for s in range(W):
            n = P.r1[s][f] if f is not None and route.delivered_by[s] == s else 0
            if n:  # a source of this host, directly
                out[P.out_at[s][f] : P.out_at[s][f] + n] = rows[base[k][s] : base[k][s] + n]
        if g is None:
            return
        at = [base[k][r] + (P.r1[r][f] if f is not None else 0) for r in range(W)]
        for s in range(W):
            r, n = route.delivered_by[s], route.piece_rows[s][g]
            if P.relayed(s) and n:  # a remote source, through relay r
                out[P.out_at[s][g] : P.out_at[s][g] + n] = rows[at[r] : at[r] + n]
                at[r] += n

    waits = []
    for k in range(P.ops):
        send_counts = P.counts(k, P.n1, P.n2)
        send = alloc((sum(send_counts),) + H, x.dtype, dev)
        stage1(k, send)
        prev = None
        if P.second(k) is not None:
            prev = waits[k - P.lag]()
            stage2(k, send, prev)
        waits.append(a2a_start(send, send_counts, P.recv_fwd[k]))
        del send  # held by the all-to-all until it has moved
        if k < len(tasks):
            tasks[k]()
        if prev is not None:
            waits[k - P.lag] = None
            lay_out(k - P.lag, prev)
    for task in tasks[P.ops :]:
        task()
    for k in range(P.ops - P.lag, P.ops):
        lay_out(k, waits[k]())
        waits[k] = None
    return out


def backward(
    a2a_start,
    route: HostRoute,
    rows: torch.Tensor,
    num_tokens: int,
    fp32_accumulate: bool,
    out_dtype,
    alloc,
) -> torch.Tensor:
    """The reverse of :func:`forward`: ``rows`` [N_recv, H] in its layout -> [T, H].

    The result is of ``out_dtype``. Each token's rows are summed (per host at its relay, then at the
    source).

    Pipelined as :func:`forward`, reversed: an all-to-all carries one piece's rows of remote sources
    to their relays and an earlier piece's answers to the sources (a relay's sums of its host's
    rows, a row of this host as it is); a relay sums a piece and a source sums a piece's answers
    while the next ones move.
    """
    dev, H = rows.device, tuple(rows.shape[1:])
    P = route.pieces
    W, C = P.W, P.C
    base, dense = P.base_bwd, P.dense
    out = alloc((num_tokens,) + H, out_dtype, dev)
    bounds = piece_bounds(num_tokens, C)

    def to_relays(k, send, send_base):  # this rank's rows of remote sources, piece f
        f = P.first(k)
        if f is None:
            return
        at = list(send_base)
        for s in range(W):
            n = route.piece_rows[s][f]
            if P.relayed(s) and n:
                r = route.delivered_by[s]
                send[at[r] : at[r] + n] = rows[P.out_at[s][f] : P.out_at[s][f] + n]
                at[r] += n

    def direct(g, send, send_base, heads):  # answers of this host's sources, piece g
        for s in range(W):
            n = P.r1[s][g] if route.delivered_by[s] == s else 0
            if n:
                a = send_base[s] + heads[s]
                send[a : a + n] = rows[P.out_at[s][g] : P.out_at[s][g] + n]

    def relay_sums(g, send, send_base, heads, prev):  # piece g summed, as answers
        m = dense[g][W]
        if not m:
            return
        spans = [(base[g][d], P.n2[d][g]) for d in range(W)]
        into = torch.cat(
            [P.fwd_dense[P.at2[d * C + g] : P.at2[d * C + g] + P.n2[d][g]] for d in range(W)]
        )
        summed = K_.scatter_add_rows(
            prev,
            into,
            m,
            src=_positions(spans, dev),
            max_per_row=route.ranks_on_host,
            fp32_accumulate=fp32_accumulate,
            out_dtype=rows.dtype,
            alloc=alloc,
        )
        for s in range(W):
            n = dense[g][s + 1] - dense[g][s]
            if n:
                a = send_base[s] + heads[s]
                send[a : a + n] = summed[dense[g][s] : dense[g][s] + n]

    def answers(k, got):  # all-to-all k's answers (piece g) summed into out
        f, g = P.first(k), P.second(k)
        if g is None:
            return
        t0, t1 = bounds[g], bounds[g + 1]
        heads = [P.n2[d][f] if f is not None else 0 for d in range(W)]
        spans = [(base[k][d] + heads[d], P.n1[d][g]) for d in range(W)]
        tok = torch.cat(
            [
                route.send_token_idx[P.at1[d * C + g] : P.at1[d * C + g] + P.n1[d][g]]
                for d in range(W)
            ]
        )
        out[t0:t1] = K_.scatter_add_rows(
            got,
            tok - t0,
            t1 - t0,
            src=_positions(spans, dev),
            max_per_row=route.max_rows_per_token,
            fp32_accumulate=fp32_accumulate,
            out_dtype=out_dtype,
            alloc=alloc,
        )

    waits = []
    for k in range(P.ops):
        f, g = P.first(k), P.second(k)
        send_counts = P.counts(k, P.r2, P.r1)
        send_base = _bases(send_counts)
        heads = [P.r2[d][f] if f is not None else 0 for d in range(W)]
        send = alloc((sum(send_counts),) + H, rows.dtype, dev)
        to_relays(k, send, send_base)
        prev = None
        if g is not None:
            direct(g, send, send_base, heads)
            prev = waits[g]()  # all-to-all g brought piece g's rows to this relay
            relay_sums(g, send, send_base, heads, prev)
        waits.append(a2a_start(send, send_counts, P.recv_bwd[k]))
        del send  # held by the all-to-all until it has moved
        if prev is not None:
            waits[g] = None
            answers(g, prev)
    for k in range(P.ops - P.lag, P.ops):
        answers(k, waits[k]())
        waits[k] = None
    return out


def ll_pairs(recv_idx: torch.Tensor, num_local_experts: int, slots_per_expert: int):
    """Where a low-latency dispatch's rows go at their destination, in two levels.

    In two levels the rows arrive one per (token, rank) rather than one per (token, expert).
    ``recv_idx`` int64 [N, K]: local expert ids of each received row (-1: elsewhere) ->
    ``(pair_row, recv_dst, slot_dst)``: int64 [P] the row of each distinct (row, local expert) pair,
    [P] its flat slot ``l * slots_per_expert + j`` (``j``: its place among expert ``l``'s pairs, by
    source rank then token, as the rank-to-rank path packs them) and [N, K] each top-k slot's flat
    slot (-1 where its expert is elsewhere; a duplicate id shares its pair's).
    """
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
