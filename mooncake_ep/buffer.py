"""``mooncake_ep.Buffer``: MoE dispatch and combine over a process group (DeepEP's names).

Dimensions: ``W`` ranks in the group (seats, fixed), ``E`` experts (``num_experts``, a
multiple of ``W``), ``L = E / W`` experts per rank (rank ``r`` holds experts
``[r L, (r + 1) L)``), ``T`` tokens of this rank, ``K`` top-k slots per token, ``H``
hidden size, ``T_max`` ``num_max_dispatch_tokens_per_rank`` (low-latency mode).

Routing (DESIGN.md "Expert parallel"): ``topk_idx[t, k] == -1`` means no expert (the slot
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
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import torch.distributed as dist

from . import _nvshmem
from . import kernels as K_
from ._comm import all_gather_single
from .config import EPConfig, resolve

# ------------------------------------------------------------------------ results


class DispatchLayout(NamedTuple):
    """Result of :meth:`Buffer.get_dispatch_layout`.

    Attributes:
        num_tokens_per_rank: int32 [W], tokens that go to each rank (a token counts once
            per rank however many of its experts live there).
        num_tokens_per_expert: int32 [E], tokens routed to each expert (a token naming an
            expert twice counts once).
        is_token_in_rank: bool [T, W], whether token ``t`` goes to rank ``r``.
    """

    num_tokens_per_rank: torch.Tensor
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
    """Result of :meth:`Buffer.low_latency_combine`; unpacks like DeepEP's
    ``combined_x, event, hook = buf.low_latency_combine(...)``.

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
    destination rank then token; ``send_counts``/``recv_counts`` are rows per rank.
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

    @property
    def device(self) -> torch.device:
        """The device of the dispatch's tensors (its inputs, results and index tensors)."""
        return self.send_token_idx.device

    def row_table(self) -> torch.Tensor:
        """int64 [T, W]: the row (of the rows sent, in send order) that carried token ``t``
        to rank ``r``, -1 where it did not go there."""
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

    @property
    def device(self) -> torch.device:
        """The device of the dispatch's tensors (its inputs, results and index tensors)."""
        return self.pair_token.device


# ------------------------------------------------------------------------ helpers


_OPS = {"dispatch": 1, "combine": 2, "low_latency_dispatch": 3, "low_latency_combine": 4}
_DTYPES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.float64: 4}
_DTYPE_NAMES = {code: str(dt).replace("torch.", "") for dt, code in _DTYPES.items()}
_HDR = 8  # status, op, then 6 op-specific fields every rank must agree on
_LL_CODES = {"auto": 0, "nvshmem": 1, "group": 2}
_FORCED = "low_latency_backend='nvshmem' (EPConfig or MOONCAKE_EP_LOW_LATENCY_BACKEND)"
_OK, _BAD = 1, 2


class _BadArgs(Exception):
    """A rank's own arguments are invalid (message says which); raised to the caller as
    ValueError after the header exchange told every rank."""


def _int_tensor(name, t, op, rank, shape0=None):
    if not isinstance(t, torch.Tensor):
        raise _BadArgs(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype not in (torch.int64, torch.int32):
        raise _BadArgs(f"{name} must be int64 (or int32), got {t.dtype}")
    if t.dim() != 2:
        raise _BadArgs(f"{name} must be 2-D [num_tokens, num_topk], got shape {tuple(t.shape)}")
    if shape0 is not None and t.shape[0] != shape0:
        raise _BadArgs(f"{name} has {t.shape[0]} rows but x has {shape0} tokens")


def _check_topk_idx(topk_idx, num_experts):
    bad = (topk_idx < -1) | (topk_idx >= num_experts)
    if bool(bad.any()):
        pos = bad.nonzero()[0].tolist()
        val = int(topk_idx[pos[0], pos[1]])
        n = int(bad.sum())
        raise _BadArgs(
            f"topk_idx[{pos[0]}, {pos[1]}] = {val} ({n} bad id{'s' if n > 1 else ''}); "
            f"expected -1 (no expert) or an expert id in [0, {num_experts})"
        )


def _same_device(name, t, device, whose="x's device"):
    """``t`` must be on ``device`` (all inputs of an op share one device)."""
    if isinstance(t, torch.Tensor) and t.device != device:
        raise _BadArgs(
            f"{name} is on {t.device}, expected {device} ({whose}): all inputs of one op "
            "must be on one device"
        )


def _input_device(x) -> torch.device:
    return x.device if isinstance(x, torch.Tensor) else torch.device("cpu")


def _check_x(x, what="x"):
    if not isinstance(x, torch.Tensor):
        raise _BadArgs(f"{what} must be a tensor, got {type(x).__name__}")
    if x.dtype not in _DTYPES:
        raise _BadArgs(f"{what} must be float32, bfloat16, float16 or float64, got {x.dtype}")
    if x.dim() != 2:
        raise _BadArgs(f"{what} must be 2-D [num_tokens, hidden], got shape {tuple(x.shape)}")


def _check_weights(w, shape, what="topk_weights"):
    if not isinstance(w, torch.Tensor):
        raise _BadArgs(f"{what} must be a tensor, got {type(w).__name__}")
    if w.dtype != torch.float32:
        raise _BadArgs(f"{what} must be float32, got {w.dtype}")
    if tuple(w.shape) != tuple(shape):
        raise _BadArgs(f"{what} must have shape {tuple(shape)}, got {tuple(w.shape)}")


def _token_expert_counts(topk_idx, num_experts):
    """int32 [T, E]: how many slots of token t name expert e (-1 slots dropped)."""
    T = topk_idx.shape[0]
    idx = topk_idx.long()
    idx = torch.where(idx < 0, torch.full_like(idx, num_experts), idx)
    cnt = torch.zeros((T, num_experts + 1), dtype=torch.int32, device=topk_idx.device)
    cnt.scatter_add_(1, idx, torch.ones_like(idx, dtype=torch.int32))
    return cnt[:, :num_experts]


# ------------------------------------------------------------------- recycling


def _storage_uses(t: torch.Tensor) -> int:
    return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))


class _Recycler:
    """Large receive buffers, reused once nothing outside the cache refers to them.

    A fresh multi-MiB CPU tensor costs a page fault per 4 KiB page on first touch (the
    kernel zeroes it), which on this path costs as much as the copy itself. A cached flat
    tensor is handed out again (as a view) only when its storage has no other user: no
    result the caller still holds, no tensor saved for backward, no view. Results stay
    valid as long as they are referenced."""

    def __init__(self, per_dtype: int = 3, min_bytes: int = 1 << 20):
        self.per_dtype, self.min_bytes = per_dtype, min_bytes
        self._cache = {}

    def empty(self, shape, dtype, device="cpu") -> torch.Tensor:
        """An uninitialised ``dtype`` tensor of ``shape`` on ``device``."""
        device = torch.device(device)
        n = 1
        for d in shape:
            n *= int(d)
        if n * torch.empty((), dtype=dtype).element_size() < self.min_bytes:
            return torch.empty(shape, dtype=dtype, device=device)
        lst = self._cache.setdefault((dtype, device), [])
        for i, (flat, base) in enumerate(lst):
            if flat.numel() >= n and _storage_uses(flat) == base:
                lst.append(lst.pop(i))  # most recently used last
                return flat[:n].view(shape)
        flat = torch.empty(n, dtype=dtype, device=device)
        out = flat[:n].view(shape)
        lst.append(
            (flat, _storage_uses(flat) - 1)
        )  # "free" = no user but the cache (out is one now)
        free = [i for i, (f, b) in enumerate(lst) if _storage_uses(f) == b]
        for i in reversed(free[: max(0, len(lst) - self.per_dtype)]):
            lst.pop(i)  # keep at most per_dtype buffers, oldest free ones go
        return out


# ------------------------------------------------------------------------- buffer


class Buffer:
    """Dispatch/combine of MoE tokens over ``group`` (DeepEP's ``Buffer``; CPU or CUDA
    tensors, see the module docstring on devices).

    Args:
        group: the process group (default: the default group); a ``mooncake`` group
            gives dead-rank awareness, any other backend with ``all_to_all_single`` works
            with every rank taken as active.
        num_nvl_bytes, num_rdma_bytes, low_latency_mode, num_qps_per_rank: accepted for
            DeepEP compatibility; buffers are allocated per call (on the inputs' device,
            large ones recycled), so they are unused. (The NVSHMEM low-latency path sizes
            its symmetric buffers itself: 2 x ``W * T_max * L * H * max(4, element size)``
            bytes, allocated at its first use, grown when wider rows need it, kept until
            the process ends; ``nvshmem.core.finalize()`` frees them, after which this
            Buffer must not run low-latency ops.)
        config: :class:`EPConfig` (keyword-only).

    Collective calls: every rank of the group calls the same ops in the same order, and
    runs the backward of the same differentiable ops (backward passes move data too).
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
    ):
        if not dist.is_initialized():
            raise RuntimeError("mooncake_ep.Buffer: torch.distributed is not initialised")
        self.group = group if group is not None else dist.distributed_c10d._get_default_group()
        if self.group is dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(self.group) < 0:
            raise ValueError("mooncake_ep.Buffer: this process is not a member of the group")
        self.rank = dist.get_rank(self.group)
        self.group_size = dist.get_world_size(self.group)
        self._cfg = resolve(config, self.group_size)
        self._recycler = _Recycler()
        self._device_types = {}
        self.low_latency_mode = bool(low_latency_mode)
        self._ll_backend = None  # "nvshmem" / "group" of the last low_latency_dispatch
        self._ll_why = None  # why it was not NVSHMEM
        self._nvs = None  # _nvshmem.SymmetricExchange, made at the first NVSHMEM use
        self._nvs_disabled = None  # why NVSHMEM failed for this Buffer (agreed by every rank)
        self._mooncake = None
        try:
            import mooncake_pg

            mooncake_pg.backend_of(self.group)
            self._mooncake = mooncake_pg
        except (ImportError, ValueError, RuntimeError):
            self._mooncake = None

    # ----------------------------------------------------------- membership

    def get_active_ranks(self) -> torch.Tensor:
        """int32 [W]: 1 for the ranks taking part (the group's agreed mask)."""
        return torch.tensor(self._membership()[0], dtype=torch.int32)

    def get_epoch(self) -> int:
        """The group's membership epoch (0 for groups that are not ``mooncake``)."""
        return self._membership()[1]

    def _takes_device(self, device: torch.device) -> bool:
        """Whether the group's backend serves tensors of ``device``'s type (asked once per type)."""
        ok = self._device_types.get(device.type)
        if ok is None:
            try:
                self.group._get_backend(torch.device(device.type))
                ok = True
            except (RuntimeError, ValueError):
                ok = False
            self._device_types[device.type] = ok
        return ok

    def _check_device(self, x, what="x"):
        """The group must be able to move tensors of ``x``'s device (before anything is sent)."""
        dev = x.device
        if self._takes_device(dev):
            return
        served = [t for t in ("cpu", "cuda") if self._takes_device(torch.device(t))]
        hint = ""
        if (
            dev.type == "cuda"
            and self._mooncake is not None
            and not getattr(self._mooncake, "WITH_CUDA", False)
        ):
            hint = (
                "; this mooncake_pg build has no CUDA (mooncake_pg.WITH_CUDA is False: rebuild with "
                "MOONCAKE_WITH_CUDA=1, or pass CPU tensors)"
            )
        raise _BadArgs(
            f"{what} is on {dev}, expected a device the group's backend "
            f"({dist.get_backend(self.group)}) serves: {' or '.join(served) or 'none'}{hint}"
        )

    def _membership(self):
        if self._mooncake is None:
            return [1] * self.group_size, 0
        be = self._mooncake.backend_of(self.group)
        return [int(a) for a in be.active_ranks()], int(be.epoch())

    def num_local_experts(self, num_experts: int) -> int:
        """``num_experts / W``; raises ``ValueError`` if it does not divide."""
        if num_experts <= 0 or num_experts % self.group_size:
            raise ValueError(
                f"mooncake_ep: num_experts ({num_experts}) must be a positive multiple of "
                f"the group size ({self.group_size})"
            )
        return num_experts // self.group_size

    # ------------------------------------------------------------- transport

    def _err(self, op, msg):
        return ValueError(f"mooncake_ep {op} (rank {self.rank}): {msg}")

    def _header(self, op, fields, counts=None, error=None, names=(), extra=None):
        """Collective header exchange; returns (headers int64 [W, n], active mask, epoch).
        ``extra``: a per-rank value in the last field, not compared across ranks."""
        n_counts = 0 if counts is None else int(counts.numel())
        hdr = torch.zeros(_HDR + n_counts, dtype=torch.int64)
        hdr[0] = _BAD if error else _OK
        hdr[1] = _OPS[op]
        if not error:
            assert len(fields) <= (_HDR - 3 if extra is not None else _HDR - 2)
            for i, f in enumerate(fields):
                hdr[2 + i] = int(f)
            if extra is not None:
                hdr[_HDR - 1] = int(extra)
            if n_counts:
                hdr[_HDR:] = counts.to(torch.int64).cpu()
        out = torch.zeros(
            self.group_size * hdr.numel(), dtype=torch.int64
        )  # flat: gloo wants [W * n]
        all_gather_single(out, hdr, group=self.group)
        out = out.view(self.group_size, hdr.numel())
        active, epoch = self._membership()
        if error:
            raise self._err(op, f"{error}; nothing was sent")
        live = [r for r in range(self.group_size) if active[r]]
        bad = [r for r in live if int(out[r, 0]) == _BAD]
        if bad:
            raise self._err(
                op,
                f"rank(s) {bad} passed invalid arguments (their error says which); "
                "nothing was sent",
            )
        ref = live[0]
        nf = 2 + len(fields)
        diff = [r for r in live if not torch.equal(out[r, 1:nf], out[ref, 1:nf])]
        if diff:

            def show(r):
                vals = (int(out[r, 2 + i]) for i in range(len(names)))
                return ", ".join(
                    f"{nm}={_DTYPE_NAMES.get(v, v) if nm == 'dtype' else v}"
                    for nm, v in zip(names, vals)
                )

            what = show(ref)
            got = "; ".join(f"rank {r}: {show(r)}" for r in diff)
            raise self._err(
                op, f"rank(s) {diff} disagree with rank {ref} ({what}): {got}; nothing was sent"
            )
        return out, active, epoch

    def _a2a(self, send, send_counts, recv_counts):
        """Rows of ``send`` (grouped by destination) to every rank; returns the received rows
        grouped by source. Rows an inactive rank did not send are zero."""
        send = send.contiguous()
        out = self._recycler.empty(
            (sum(recv_counts),) + tuple(send.shape[1:]), send.dtype, send.device
        )
        dist.all_to_all_single(out, send, list(recv_counts), list(send_counts), group=self.group)
        if self._mooncake is not None and out.numel():
            active, _ = self._membership()
            start = 0
            for s, c in enumerate(recv_counts):
                if c and not active[s]:
                    out[start : start + c].zero_()
                start += c
        return out

    def _fwd(self, handle, send):
        if getattr(handle, "backend", "group") == "nvshmem":
            return self._nvshmem_a2a(handle, send, handle.send_counts, handle.recv_counts)
        return self._a2a(send, handle.send_counts, handle.recv_counts)

    def _bwd(self, handle, recv):
        if getattr(handle, "backend", "group") == "nvshmem":
            return self._nvshmem_a2a(handle, recv, handle.recv_counts, handle.send_counts)
        return self._a2a(recv, handle.recv_counts, handle.send_counts)

    # ------------------------------------------------- low-latency backend

    @property
    def low_latency_backend(self) -> str | None:
        """How the last ``low_latency_dispatch`` moved its rows: ``"nvshmem"`` or
        ``"group"`` (``None`` before the first one). Its combine and backward passes use
        the same (the handle remembers)."""
        return self._ll_backend

    @property
    def low_latency_fallback_reason(self) -> str | None:
        """Why the last ``low_latency_dispatch`` did not use NVSHMEM (``None`` when it did,
        or when the configuration is ``"group"``)."""
        return self._ll_why

    def _nvshmem_unusable(self, dev: torch.device) -> str | None:
        """Why this rank cannot move low-latency rows over NVSHMEM (``None``: it can)."""
        if self._nvs_disabled:
            return self._nvs_disabled
        if self._nvs is not None and self._nvs.device != dev:
            return (
                f"this Buffer's NVSHMEM buffers live on {self._nvs.device}, expected x there, got x on "
                f"{dev} (one device per Buffer)"
            )
        return _nvshmem.local_unusable(
            dev, self.rank, self.group_size, dist.get_process_group_ranks(self.group)
        )

    def _nvshmem_setup(self, dev: torch.device, nbytes: int) -> str | None:
        """Collective: NVSHMEM world and this Buffer's symmetric buffers. Returns ``None``,
        or why not (the same on every rank; the Buffer then stays on the group)."""
        if self._nvs is not None:  # same device (checked before the header)
            why = self._nvs._grow(nbytes)
        else:
            nvs = _nvshmem.SymmetricExchange(self.group, self.rank, self.group_size, dev)
            why = nvs.setup(nbytes)
            if why is None:
                self._nvs = nvs
        if why:
            self._nvs_disabled = why
        return why

    def _choose_ll_backend(self, op, want, hdr, active, dev, slot_bytes, local_why=None):
        """After the header: ``("nvshmem" | "group", why not NVSHMEM)``, the same on every
        rank (from the gathered header). ``want="nvshmem"`` raises ``ValueError`` on every
        rank instead of falling back."""
        W = self.group_size
        live = [r for r in range(W) if active[r]]
        codes = {r: int(hdr[r, _HDR - 1]) >> 1 for r in live}
        if len(set(codes.values())) > 1:
            names = {c: n for n, c in _LL_CODES.items()}
            got = ", ".join(f"rank {r}: {names.get(c, c)!r}" for r, c in codes.items())
            raise self._err(
                op,
                f"ranks disagree on low_latency_backend (EPConfig or "
                f"MOONCAKE_EP_LOW_LATENCY_BACKEND): {got}; nothing was sent",
            )
        if want == "group":
            return "group", None
        inactive = [r for r in range(W) if not active[r]]
        no = [r for r in live if not int(hdr[r, _HDR - 1]) & 1]
        if inactive:
            why = (
                f"rank(s) {inactive} are inactive (the NVSHMEM path needs every rank of the group)"
            )
        elif no:
            why = (
                f"NVSHMEM is not usable on rank(s) {no} (CUDA tensors, nvshmem4py-cu13 installed and "
                "initialised over this group are needed on every rank)"
            )
            if local_why:
                why += f"; on rank {self.rank}: {local_why}"
        else:
            why = self._nvshmem_setup(dev, W * slot_bytes)
        if why is None:
            return "nvshmem", None
        if want == "nvshmem":
            raise self._err(op, f"{_FORCED} cannot be served: {why}; nothing was sent")
        return "group", why

    def _nvshmem_a2a(self, handle, send, send_counts, recv_counts):
        active, _ = self._membership()
        if not all(active):
            raise RuntimeError(
                f"mooncake_ep low-latency (rank {self.rank}): rank(s) "
                f"{[r for r, a in enumerate(active) if not a]} left the group since the "
                "dispatch; the NVSHMEM path needs every rank (dispatch again: it falls "
                "back to the group with low_latency_backend='auto')"
            )
        send = send.contiguous()
        out = self._recycler.empty(
            (sum(recv_counts),) + tuple(send.shape[1:]), send.dtype, send.device
        )
        cap = handle.num_max_dispatch_tokens_per_rank * (handle.num_experts // self.group_size)
        return self._nvs.alltoallv(send, send_counts, recv_counts, cap, out)

    # ---------------------------------------------------------------- layout

    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event=None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> DispatchLayout:
        """Which ranks and experts each token goes to (local; moves nothing).

        Args:
            topk_idx: int64 (or int32) [T, K]; -1 = no expert.
            num_experts: E, a multiple of W.
            previous_event, async_finish, allocate_on_comm_stream: DeepEP's stream
                arguments; ignored on CPU (the result is ready on return).

        Returns: :class:`DispatchLayout` (counts as int32, ``is_token_in_rank`` bool).
        Raises ``ValueError`` for a bad id (naming its position), a non-2-D or
        non-integer ``topk_idx``, or E not a multiple of W. The layout is pure routing:
        ``dispatch`` leaves out ranks that are inactive.
        """
        try:
            self.num_local_experts(num_experts)
            _int_tensor("topk_idx", topk_idx, "get_dispatch_layout", self.rank)
            _check_topk_idx(topk_idx, num_experts)
        except _BadArgs as e:
            raise self._err("get_dispatch_layout", str(e)) from None
        T = topk_idx.shape[0]
        cnt = _token_expert_counts(topk_idx, num_experts) > 0
        per_expert = cnt.sum(0, dtype=torch.int32)
        in_rank = cnt.view(T, self.group_size, num_experts // self.group_size).any(2)
        return DispatchLayout(in_rank.sum(0, dtype=torch.int32), per_expert, in_rank)

    # -------------------------------------------------------------- dispatch

    def dispatch(
        self,
        x: torch.Tensor,
        handle: DispatchHandle | None = None,
        num_tokens_per_rank: torch.Tensor | None = None,
        num_tokens_per_rdma_rank=None,
        is_token_in_rank: torch.Tensor | None = None,
        num_tokens_per_expert: torch.Tensor | None = None,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config=None,
        previous_event=None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
        *,
        num_experts: int | None = None,
    ) -> DispatchResult:
        """Sends each token of ``x`` once to every rank that holds one of its experts.

        Args:
            x: [T, H] float32/bfloat16/float16/float64 tokens of this rank (T may be 0), on
                a device the group serves; every other tensor argument on the same device.
            handle: a :class:`DispatchHandle` from an earlier dispatch: reuse its layout
                (no header exchange, ``topk_*`` must be ``None``); returns only ``recv_x``.
            topk_idx: int64/int32 [T, K], expert ids or -1 (required without ``handle``).
            topk_weights: float32 [T, K] or ``None``; differentiable.
            num_experts: E (keyword; else taken from ``len(num_tokens_per_expert)``).
            num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert: DeepEP's layout
                arguments: only their shapes are checked; the layout is recomputed from
                ``topk_idx`` (it is cheap and cannot disagree with it).
            expert_alignment: counts in ``num_recv_tokens_per_expert_list`` are rounded up
                to a multiple of it.
            num_tokens_per_rdma_rank, num_worst_tokens, config, previous_event,
            async_finish, allocate_on_comm_stream: DeepEP arguments without effect on CPU
                (``num_worst_tokens`` must be 0).

        Returns: :class:`DispatchResult`. Differentiable in ``x`` and ``topk_weights``: the
        backward is a combine (gradients of the rows a token went to are summed).

        Raises: ``ValueError`` on every rank, before any token moves, when some rank's
        arguments are invalid (bad ids: -2 or below, or ``>= E``; shapes; dtypes) or the
        ranks disagree on E, H, K or dtype. ``RankFailureError`` per the group's policy.
        """
        op = "dispatch"
        if handle is not None:
            err = None
            try:
                if not isinstance(handle, DispatchHandle):
                    raise _BadArgs(f"handle must be a DispatchHandle, got {type(handle).__name__}")
                if topk_idx is not None or topk_weights is not None:
                    raise _BadArgs(
                        "a cached dispatch (handle given) takes no topk_idx/topk_weights"
                    )
                _check_x(x)
                self._check_device(x)
                _same_device("x", x, handle.device, "the handle's dispatch ran there")
                if tuple(x.shape) != (handle.num_tokens, handle.hidden):
                    raise _BadArgs(
                        f"x must have shape {(handle.num_tokens, handle.hidden)} (the handle's), "
                        f"got {tuple(x.shape)}"
                    )
            except _BadArgs as e:
                err = str(e)
            fields = [getattr(handle, "hidden", 0), _DTYPES.get(getattr(x, "dtype", None), 0), 1]
            self._header(op, fields, error=err, names=("hidden", "dtype", "cached"))
            recv_x, _, _ = _DispatchFn.apply(self, handle, None, x, None)
            return DispatchResult(recv_x, None, None, None, handle)

        W = self.group_size
        err = None
        E = (
            num_experts
            if num_experts is not None
            else (
                int(num_tokens_per_expert.numel())
                if isinstance(num_tokens_per_expert, torch.Tensor)
                else None
            )
        )
        T = H = Kk = 0
        dev = _input_device(x)
        try:
            if E is None:
                raise _BadArgs("num_experts is unknown: pass num_experts= or num_tokens_per_expert")
            if E <= 0 or E % W:
                raise _BadArgs(
                    f"num_experts ({E}) must be a positive multiple of the group size ({W})"
                )
            _check_x(x)
            self._check_device(x)
            T, H = x.shape
            if topk_idx is None:
                raise _BadArgs("topk_idx is required without a handle")
            _int_tensor("topk_idx", topk_idx, op, self.rank, T)
            _same_device("topk_idx", topk_idx, dev)
            Kk = topk_idx.shape[1]
            _check_topk_idx(topk_idx, E)
            if topk_weights is not None:
                _check_weights(topk_weights, (T, Kk))
                _same_device("topk_weights", topk_weights, dev)
            if num_worst_tokens:
                raise _BadArgs("num_worst_tokens must be 0 (not supported on CPU)")
            if int(expert_alignment) < 1:
                raise _BadArgs(f"expert_alignment must be >= 1, got {expert_alignment}")
            for nm, t, shp in (
                ("num_tokens_per_rank", num_tokens_per_rank, (W,)),
                ("is_token_in_rank", is_token_in_rank, (T, W)),
                ("num_tokens_per_expert", num_tokens_per_expert, (E,)),
            ):
                if t is not None and tuple(t.shape) != shp:
                    raise _BadArgs(f"{nm} must have shape {shp}, got {tuple(t.shape)}")
        except _BadArgs as e:
            err = str(e)

        in_rank = None
        if err is None:
            L = E // W
            cnt = _token_expert_counts(topk_idx, E) > 0
            in_rank = cnt.view(T, W, L).any(2)
        fields = [
            E or 0,
            H,
            _DTYPES.get(getattr(x, "dtype", None), 0),
            Kk,
            int(topk_weights is not None),
        ]
        names = ("num_experts", "hidden", "dtype", "num_topk", "has_weights")
        tries = self._cfg["max_membership_retries"]
        for attempt in range(tries + 1):
            active0, _ = self._membership()
            counts = None
            if err is None:
                mask = torch.tensor(active0, dtype=torch.bool, device=dev)
                counts = (in_rank & mask).sum(0)
            hdr, active, epoch = self._header(
                op, fields, counts if counts is not None else torch.zeros(W), error=err, names=names
            )
            act = torch.tensor(
                [int(a and b) for a, b in zip(active, active0)], dtype=torch.bool, device=dev
            )
            sent = in_rank & act
            send_counts = tuple(int(c) for c in sent.sum(0))
            recv_counts = tuple(int(hdr[s, _HDR + self.rank]) if active[s] else 0 for s in range(W))
            nz = sent.t().nonzero()
            send_tok = nz[:, 1].contiguous()
            mx = int(sent.sum(1).max()) if T else 0
            h = DispatchHandle(T, H, E, Kk, send_tok, send_counts, recv_counts, sent, epoch, mx)
            # local ids of each sent row at its destination (-1: that slot's expert is elsewhere)
            dest = nz[:, 0]
            rows_idx = topk_idx.long().index_select(0, send_tok)
            local = rows_idx - (dest * L).unsqueeze(1)
            local = torch.where(
                (rows_idx >= 0) & (local >= 0) & (local < L), local, torch.full_like(local, -1)
            )
            recv_x, recv_w, recv_idx = _DispatchFn.apply(
                self, h, local.to(torch.int32), x, topk_weights
            )
            if self._membership()[1] == epoch or attempt == tries:
                break
        if self._membership()[1] != epoch:
            raise self._err(
                op, f"the group's membership changed {tries + 1} times during one dispatch"
            )
        recv_idx = recv_idx.long()
        per_expert = (_token_expert_counts(recv_idx, L) > 0).sum(0)
        a = int(expert_alignment)
        counts_list = [int((c + a - 1) // a * a) for c in per_expert.tolist()]
        return DispatchResult(recv_x, recv_idx, recv_w, counts_list, h)

    # --------------------------------------------------------------- combine

    def combine(
        self,
        x: torch.Tensor,
        handle: DispatchHandle,
        topk_weights: torch.Tensor | None = None,
        bias=None,
        config=None,
        previous_event=None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> CombineResult:
        """Sends each received row back to its token's rank and sums the rows per token.

        Args:
            x: [N_recv, H] (the rows of ``dispatch``'s ``recv_x``, typically the weighted
                expert outputs), float32/bfloat16/float16/float64, on the dispatch's device.
            handle: the :class:`DispatchHandle` of the dispatch.
            topk_weights: float32 [N_recv, K] or ``None``: summed back the same way.
            bias, config, previous_event, async_finish, allocate_on_comm_stream: DeepEP
                arguments; ``bias`` must be ``None``, the others have no effect on CPU.

        Returns: :class:`CombineResult`; ``combined_x`` [T, H] in x's dtype (16-bit data
        sums in float32 and rounds once unless ``EPConfig(fp32_accumulate=False)``).
        Differentiable in ``x`` and ``topk_weights`` (the backward is a dispatch).
        Rows from ranks inactive by now count as zero.

        Raises: ``ValueError`` on every rank (before any row moves) when some rank's
        arguments are bad or the ranks disagree on H or dtype.
        """
        op = "combine"
        err = None
        H = Kk = 0
        try:
            if not isinstance(handle, DispatchHandle):
                raise _BadArgs(f"handle must be a DispatchHandle, got {type(handle).__name__}")
            _check_x(x)
            self._check_device(x)
            _same_device("x", x, handle.device, "the dispatch's device")
            n = sum(handle.recv_counts)
            if tuple(x.shape) != (n, handle.hidden):
                raise _BadArgs(
                    f"x must have shape {(n, handle.hidden)} (rows received by the dispatch), "
                    f"got {tuple(x.shape)}"
                )
            H = handle.hidden
            if topk_weights is not None:
                Kk = handle.num_topk
                _check_weights(topk_weights, (n, Kk))
                _same_device("topk_weights", topk_weights, x.device)
            if bias is not None:
                raise _BadArgs("bias is not supported")
        except _BadArgs as e:
            err = str(e)
        fields = [H, _DTYPES.get(getattr(x, "dtype", None), 0), int(topk_weights is not None), Kk]
        self._header(op, fields, error=err, names=("hidden", "dtype", "has_weights", "num_topk"))
        out, out_w = _CombineFn.apply(self, handle, x, topk_weights)
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

        Args:
            x: [T, H] float32/bfloat16/float16/float64 (T <= T_max), on a device the group
                serves; ``topk_idx`` and the stats tensor on the same device.
            topk_idx: int64/int32 [T, K], expert ids or -1.
            num_max_dispatch_tokens_per_rank: T_max, the same on every rank.
            num_experts: E, a multiple of W.
            cumulative_local_expert_recv_stats: int32 [L] or ``None``; ``recv_count`` is
                added to it.
            use_fp8: send e4m3 with one float32 scale per 128 channels (the last block may
                be shorter), from any of x's dtypes; ``recv_x`` is then ``(x_fp8, scales)``
                and not differentiable.
            async_finish: no effect on CPU (the op has finished when it returns).
            round_scale, use_ue8m0, return_recv_hook: DeepEP arguments; must be ``False``
                (not supported on CPU).

        Returns: :class:`LowLatencyDispatchResult`. Without fp8, differentiable in ``x``
        (the backward sums each pair's gradient back to its token). The rows move over
        NVSHMEM or the group per ``EPConfig.low_latency_backend`` (module docstring);
        ``self.low_latency_backend`` then says which, and the handle keeps it for the
        combine and the backward passes. On the NVSHMEM path the first call (per process,
        then per Buffer) initialises NVSHMEM over the group and allocates the symmetric
        buffers (collective).

        Raises: ``ValueError`` on every rank before any token moves for bad arguments or
        disagreeing T_max/E/H/dtype/use_fp8/low_latency_backend, and, with
        ``low_latency_backend="nvshmem"``, when NVSHMEM cannot serve the op on some rank
        (tensors not on CUDA, ``nvshmem.core`` not importable, an inactive rank, NVSHMEM
        initialised over another group, its init or allocation failed), e.g.
        ``mooncake_ep low_latency_dispatch (rank 0): low_latency_backend='nvshmem' (EPConfig
        or MOONCAKE_EP_LOW_LATENCY_BACKEND) cannot be served: expected CUDA tensors, got x
        on cpu; nothing was sent``.
        """
        op = "low_latency_dispatch"
        W = self.group_size
        err = None
        T = H = Kk = 0
        E, Tm = int(num_experts), int(num_max_dispatch_tokens_per_rank)
        dev = _input_device(x)
        try:
            if E <= 0 or E % W:
                raise _BadArgs(
                    f"num_experts ({E}) must be a positive multiple of the group size ({W})"
                )
            _check_x(x)
            self._check_device(x)
            T, H = x.shape
            if T > Tm:
                raise _BadArgs(f"x has {T} tokens, more than num_max_dispatch_tokens_per_rank={Tm}")
            _int_tensor("topk_idx", topk_idx, op, self.rank, T)
            _same_device("topk_idx", topk_idx, dev)
            Kk = topk_idx.shape[1]
            _check_topk_idx(topk_idx, E)
            if round_scale or use_ue8m0 or return_recv_hook:
                raise _BadArgs(
                    "round_scale, use_ue8m0 and return_recv_hook are not supported on CPU"
                )
            if cumulative_local_expert_recv_stats is not None:
                st = cumulative_local_expert_recv_stats
                if (
                    not isinstance(st, torch.Tensor)
                    or st.dtype != torch.int32
                    or tuple(st.shape) != (E // W,)
                ):
                    raise _BadArgs(f"cumulative_local_expert_recv_stats must be int32 [{E // W}]")
                _same_device("cumulative_local_expert_recv_stats", st, dev)
        except _BadArgs as e:
            err = str(e)
        want = self._cfg["low_latency_backend"]
        nvs_ok, local_why = 0, None
        if err is None and want != "group":
            local_why = self._nvshmem_unusable(dev)
            nvs_ok = int(local_why is None)
            if local_why is not None and want == "nvshmem":
                err = f"{_FORCED} cannot be served: {local_why}"
        L = E // W if E > 0 and E % W == 0 else 1
        cnt = None
        if err is None:
            cnt = _token_expert_counts(topk_idx, E) > 0  # [T, E]
        fields = [E, H, _DTYPES.get(getattr(x, "dtype", None), 0), Tm, int(bool(use_fp8))]
        names = ("num_experts", "hidden", "dtype", "num_max_dispatch_tokens_per_rank", "use_fp8")
        tries = self._cfg["max_membership_retries"]
        for attempt in range(tries + 1):
            active0, _ = self._membership()
            per_expert = None
            if err is None:
                emask = torch.tensor(active0, dtype=torch.bool, device=dev).repeat_interleave(L)
                per_expert = (cnt & emask).sum(0)
            hdr, active, epoch = self._header(
                op,
                fields,
                per_expert if per_expert is not None else torch.zeros(E),
                error=err,
                names=names,
                extra=nvs_ok | (_LL_CODES[want] << 1),
            )
            backend, why = self._choose_ll_backend(
                op, want, hdr, active, dev, Tm * L * H * max(4, x.element_size()), local_why
            )
            self._ll_backend, self._ll_why = backend, why
            act = [int(a and b) for a, b in zip(active, active0)]
            emask = torch.tensor(act, dtype=torch.bool, device=dev).repeat_interleave(L)
            pairs = (cnt & emask).t().nonzero()  # [P, 2] (expert, token)
            pair_e, pair_t = pairs[:, 0].contiguous(), pairs[:, 1].contiguous()
            send_counts = (
                tuple(int(c) for c in torch.bincount(pair_e // L, minlength=W))
                if pairs.numel()
                else (0,) * W
            )
            # rows per (source, local expert) for this rank's experts
            c = hdr[:, _HDR + self.rank * L : _HDR + (self.rank + 1) * L].clone()
            for s in range(W):
                if not active[s]:
                    c[s] = 0
            recv_counts = tuple(int(v) for v in c.sum(1))
            WT = W * Tm
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
            if use_fp8:
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
                recv_x = _LLDispatchFn.apply(self, h, x)
            if self._membership()[1] == epoch or attempt == tries:
                break
        if self._membership()[1] != epoch:
            raise self._err(
                op, f"the group's membership changed {tries + 1} times during one dispatch"
            )
        if cumulative_local_expert_recv_stats is not None:
            cumulative_local_expert_recv_stats += recv_count
        return LowLatencyDispatchResult(recv_x, recv_count.clone(), h)

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

        ``combined_x[t] = sum_k topk_weights[t, k] * x[l_k, j_k]`` over the slots of token
        ``t`` whose expert took part (``(l_k, j_k)``: where the pair landed; duplicate ids
        count once per slot, so their weights add up).

        Args:
            x: [L, W * T_max, H] float32/bfloat16/float16/float64 (not float8: dequantize
                first), the experts' outputs in the layout of ``low_latency_dispatch``'s
                ``recv_x``; it need not be the dispatched dtype; on the dispatch's device
                (as ``topk_idx``, ``topk_weights`` and ``out``).
            topk_idx: the dispatch's ``topk_idx`` ([T, K]; checked to be the same).
            topk_weights: float32 [T, K]; differentiable.
            handle: the :class:`LowLatencyHandle` of the dispatch.
            out: optional [T, H] tensor to write the result into.
            async_finish: no effect on CPU.
            use_logfmt, zero_copy, return_recv_hook: must be ``False`` (not supported on CPU).

        Returns: :class:`LowLatencyCombineResult` ``(combined_x, event, hook)``:
        ``combined_x`` [T, H] in x's dtype (accumulated in float32), ``event`` and ``hook``
        ``None`` on CPU. Differentiable in ``x`` and ``topk_weights``. Rows move the way
        the dispatch's did (``handle.backend``: NVSHMEM or the group). Raises ``ValueError``
        on every rank, before any row moves, for bad arguments on some rank;
        ``RuntimeError`` on the NVSHMEM path when a rank has left the group since the
        dispatch (NVSHMEM cannot run without it; dispatch again).
        """
        op = "low_latency_combine"
        err = None
        H = 0
        try:
            if not isinstance(handle, LowLatencyHandle):
                raise _BadArgs(f"handle must be a LowLatencyHandle, got {type(handle).__name__}")
            _check_x(
                x.reshape(-1, x.shape[-1]) if isinstance(x, torch.Tensor) and x.dim() == 3 else x
            )
            self._check_device(x)
            _same_device("x", x, handle.device, "the dispatch's device")
            L = handle.num_experts // self.group_size
            shp = (L, self.group_size * handle.num_max_dispatch_tokens_per_rank, handle.hidden)
            if tuple(x.shape) != shp:
                raise _BadArgs(f"x must have shape {shp}, got {tuple(x.shape)}")
            H = handle.hidden
            _int_tensor("topk_idx", topk_idx, op, self.rank, handle.num_tokens)
            _same_device("topk_idx", topk_idx, x.device)
            if not torch.equal(topk_idx.long(), handle.topk_idx.long()):
                raise _BadArgs("topk_idx differs from the one given to low_latency_dispatch")
            _check_weights(topk_weights, tuple(topk_idx.shape))
            _same_device("topk_weights", topk_weights, x.device)
            if use_logfmt or zero_copy or return_recv_hook:
                raise _BadArgs(
                    "use_logfmt, zero_copy and return_recv_hook are not supported on CPU"
                )
            if out is not None and (
                tuple(out.shape) != (handle.num_tokens, H) or out.dtype != x.dtype
            ):
                raise _BadArgs(f"out must be {x.dtype} [{handle.num_tokens}, {H}]")
            _same_device("out", out, x.device)
        except _BadArgs as e:
            err = str(e)
        fields = [H, _DTYPES.get(getattr(x, "dtype", None), 0)]
        self._header(op, fields, error=err, names=("hidden", "dtype"))
        res = _LLCombineFn.apply(self, handle, x, topk_weights)
        if out is not None:
            with torch.no_grad():
                out.copy_(res)
            return LowLatencyCombineResult(out, None, None)
        return LowLatencyCombineResult(res, None, None)


# ------------------------------------------------------------ autograd functions


class _DispatchFn(torch.autograd.Function):
    """(local idx of sent rows, x, topk_weights) -> (recv_x, recv_topk_weights, recv_topk_idx)."""

    @staticmethod
    def forward(ctx, buf, handle, local_idx, x, w):
        ctx.buf, ctx.handle = buf, handle
        ctx.x_dtype = x.dtype
        kern = buf._cfg["kernels"]
        recv_x = buf._fwd(handle, K_.gather_rows(x.detach(), handle.send_token_idx, kern))
        recv_w = recv_idx = None
        if local_idx is not None:
            if w is not None:
                w_rows = w.detach().index_select(0, handle.send_token_idx)
                w_rows = torch.where(local_idx >= 0, w_rows, torch.zeros_like(w_rows))
                meta = torch.cat([local_idx, w_rows.view(torch.int32)], 1)
            else:
                meta = local_idx
            recv_meta = buf._fwd(handle, meta)
            k = local_idx.shape[1]
            recv_idx = recv_meta[:, :k].contiguous()
            # rows an inactive source did not send are zero: make their slots "no expert"
            if w is not None:
                recv_w = recv_meta[:, k:].contiguous().view(torch.float32)
            if buf._mooncake is not None and recv_idx.numel():
                active, _ = buf._membership()
                start = 0
                for s, c in enumerate(handle.recv_counts):
                    if c and not active[s]:
                        recv_idx[start : start + c] = -1
                    start += c
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
            rows = buf._bwd(h, g_x.contiguous())
            gx = K_.scatter_add_rows(
                rows,
                h.send_token_idx,
                h.num_tokens,
                max_per_row=h.max_ranks_per_token,
                fp32_accumulate=buf._cfg["fp32_accumulate"],
                out_dtype=rows.dtype,
            )
        if ctx.needs_input_grad[4]:
            n = sum(h.recv_counts)
            if g_w is None:
                g_w = torch.zeros((n, h.num_topk), device=h.device)
            g_w = torch.where(ctx.recv_idx >= 0, g_w, torch.zeros_like(g_w))
            rows = buf._bwd(h, g_w.float().contiguous())
            gw = K_.scatter_add_rows(rows, h.send_token_idx, h.num_tokens, out_dtype=torch.float32)
        return None, None, None, gx, gw


class _CombineFn(torch.autograd.Function):
    """(recv rows x, topk_weights) -> (combined_x, combined_topk_weights)."""

    @staticmethod
    def forward(ctx, buf, handle, x, w):
        ctx.buf, ctx.handle = buf, handle
        ctx.x_dtype = x.dtype
        rows = buf._bwd(handle, x.detach())
        out = None
        if K_._use_triton(rows, buf._cfg["kernels"]):
            # Triton: each token sums its rows in rank order, as index_add_ does on CPU
            out = K_.sum_rows_by_table(
                rows.contiguous(),
                handle.row_table(),
                kernels=buf._cfg["kernels"],
                fp32_accumulate=buf._cfg["fp32_accumulate"],
                max_per_row=handle.max_ranks_per_token,
            )
        if out is None:
            out = K_.scatter_add_rows(
                rows,
                handle.send_token_idx,
                handle.num_tokens,
                max_per_row=handle.max_ranks_per_token,
                alloc=buf._recycler.empty,
                fp32_accumulate=buf._cfg["fp32_accumulate"],
                out_dtype=x.dtype,
            )
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
            gx = buf._fwd(h, K_.gather_rows(g_out.contiguous(), h.send_token_idx, kern))
        if ctx.needs_input_grad[3]:
            if g_w is None:
                g_w = torch.zeros((h.num_tokens, h.num_topk), device=h.device)
            gw = buf._fwd(h, K_.gather_rows(g_w.float().contiguous(), h.send_token_idx, kern))
        return None, None, gx, gw


class _LLDispatchFn(torch.autograd.Function):
    """x [T, H] -> packed [L, W * T_max, H]."""

    @staticmethod
    def forward(ctx, buf, handle, x):
        ctx.buf, ctx.handle = buf, handle
        L = handle.num_experts // buf.group_size
        WT = buf.group_size * handle.num_max_dispatch_tokens_per_rank
        rows = buf._fwd(handle, K_.gather_rows(x.detach(), handle.pair_token, buf._cfg["kernels"]))
        packed = buf._recycler.empty((L * WT, handle.hidden), x.dtype, x.device)
        K_.scatter_rows(rows, handle.recv_dst, packed)
        return packed.view(L, WT, handle.hidden)

    @staticmethod
    def backward(ctx, g):
        buf, h = ctx.buf, ctx.handle
        flat = g.reshape(-1, h.hidden)
        rows = buf._bwd(h, K_.gather_rows(flat.contiguous(), h.recv_dst, buf._cfg["kernels"]))
        gx = K_.scatter_add_rows(
            rows,
            h.pair_token,
            h.num_tokens,
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


class _LLCombineFn(torch.autograd.Function):
    """(packed x [L, W * T_max, H], topk_weights [T, K]) -> combined [T, H]."""

    @staticmethod
    def forward(ctx, buf, handle, x, w):
        ctx.buf, ctx.handle = buf, handle
        flat = x.detach().reshape(-1, handle.hidden)
        rows = buf._bwd(handle, K_.gather_rows(flat, handle.recv_dst, buf._cfg["kernels"]))
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
    def backward(ctx, g):
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
