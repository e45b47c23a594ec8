"""The collective plumbing under :class:`mooncake_ep.Buffer`.

Its group and the group's membership, the header exchange every op starts with, and the all-to-all
of rows over the group's ``all_to_all_single`` or NVSHMEM (:mod:`mooncake_ep._nvshmem`).

:class:`Transport` holds what Buffer's ops share; :class:`mooncake_ep.Buffer` derives from it and
adds DeepEP's API. Devices, headers, dead ranks and the low-latency backend choice behave as
:mod:`mooncake_ep.buffer` describes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import _hosts, _nvshmem
from . import kernels as K_
from ._checks import DTYPE_NAMES, BadArgs
from ._comm import all_gather_single
from .config import EPConfig, resolve
from .kernels import FP8_DTYPES

# header codes (one int64 each): op ids, status, the low-latency backend wanted
_OPS = {"dispatch": 1, "combine": 2, "low_latency_dispatch": 3, "low_latency_combine": 4}
HDR = (
    9  # status, op, then 7 op-specific fields every rank must agree on (or 6 and a per-rank value)
)
LL_CODES = {"auto": 0, "nvshmem": 1, "group": 2}
FORCED = "low_latency_backend='nvshmem' (EPConfig or MOONCAKE_EP_LOW_LATENCY_BACKEND)"
_OK, _BAD = 1, 2


def _storage_uses(t: torch.Tensor) -> int:
    return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))


class _Recycler:
    """Large receive buffers, reused once nothing outside the cache refers to them.

    A fresh multi-MiB CPU tensor costs a page fault per 4 KiB page on first touch (the kernel zeroes
    it), which on this path costs as much as the copy itself. A cached flat tensor is handed out
    again (as a view) only when its storage has no other user: no result the caller still holds, no
    tensor saved for backward, no view. Results stay valid as long as they are referenced. A request
    gets the smallest free buffer that holds it but is at most twice its size (so a small request
    never takes a big buffer that the next big request would then allocate again: cached bytes stay
    within about twice what one call had alive). Up to ``per_dtype`` buffers per dtype stay cached:
    a round trip across hosts has about 10 large ones alive at once (the result, up to three pieces'
    rows in flight each way, the pieces being summed) in several sizes, and a low-latency one adds
    its slot buffers; with a smaller cap the least recently used, the largest, would go first and be
    allocated afresh every call.
    """

    def __init__(self, per_dtype: int = 32, min_bytes: int = 1 << 20):
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
        fits = [
            (f.numel(), i)
            for i, (f, base) in enumerate(lst)
            if n <= f.numel() <= 2 * n and _storage_uses(f) == base
        ]
        if fits:
            i = min(fits)[1]
            flat = lst[i][0]
            lst.append(lst.pop(i))  # most recently used last
            return flat[:n].view(shape)
        flat = torch.empty(n, dtype=dtype, device=device)
        out = flat[:n].view(shape)
        # "free" = no user but the cache (out is one now)
        lst.append((flat, _storage_uses(flat) - 1))
        free = [i for i, (f, b) in enumerate(lst) if _storage_uses(f) == b]
        for i in reversed(free[: max(0, len(lst) - self.per_dtype)]):
            lst.pop(i)  # keep at most per_dtype buffers, oldest free ones go
        return out


class Transport:
    """Group, membership, header exchange and row transport of one :class:`mooncake_ep.Buffer`.

    It is Buffer's base class; the arguments are Buffer's.

    Raises ``TypeError`` when ``group`` is not a process group (or ``None``), ``RuntimeError`` when
    ``torch.distributed`` is not initialised and ``ValueError`` when this process is not a member of
    ``group``.
    """

    def __init__(self, group: dist.ProcessGroup | None, config: EPConfig | None) -> None:
        # NON_GROUP_MEMBER is what new_group returns on a process outside the group
        if not (
            group is None
            or group is dist.GroupMember.NON_GROUP_MEMBER
            or isinstance(group, dist.ProcessGroup)
        ):
            raise TypeError(
                "mooncake_ep.Buffer: group must be a torch.distributed.ProcessGroup or None "
                f"(the default group), got {type(group).__name__}"
            )
        if not dist.is_initialized():
            raise RuntimeError("mooncake_ep.Buffer: torch.distributed is not initialised")
        self.group = group if group is not None else dist.distributed_c10d._get_default_group()
        if self.group is dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(self.group) < 0:
            raise ValueError("mooncake_ep.Buffer: this process is not a member of the group")
        self.rank = dist.get_rank(self.group)
        self.group_size = dist.get_world_size(self.group)
        # errors name group ranks: on a subgroup, say so and map them to global ranks
        global_ranks = dist.get_process_group_ranks(self.group)
        self.where = f"rank {self.rank}"
        if global_ranks != list(range(dist.get_world_size())):
            self.where = (
                f"group rank {self.rank}; ranks named here are ranks of the EP group, whose "
                f"global ranks are {global_ranks}"
            )
        self._cfg = resolve(config, self.group_size)
        self._recycler = _Recycler()
        self._device_types = {}
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
        self._topo_cache = (None, None)  # (get_rank_hosts, its Topology)

    # ----------------------------------------------------------- membership

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
        raise BadArgs(
            f"{what} is on {dev}, expected a device the group's backend "
            f"({dist.get_backend(self.group)}) serves: {' or '.join(served) or 'none'}{hint}"
        )

    def _topology(self):
        """The group's hosts now, or ``None`` on one host or without a ``mooncake`` group.

        A :class:`mooncake_ep._hosts.Topology`, hosts numbered as :func:`mooncake_pg.get_rank_hosts`
        numbers them: the same on every rank of one epoch.
        """
        if self._mooncake is None:
            return None
        raw = tuple(self._mooncake.get_rank_hosts(self.group).tolist())
        if raw != self._topo_cache[0]:
            dense = {h: i for i, h in enumerate(dict.fromkeys(raw))}
            topo = None
            if len(dense) > 1:
                topo = _hosts.Topology(torch.tensor([dense[h] for h in raw], dtype=torch.int64))
            self._topo_cache = (raw, topo)
        return self._topo_cache[1]

    def _membership_and_topology(self):
        """``(active, epoch, topology)`` of one epoch.

        The host map is recomputed at every membership change: read again if the epoch moved
        meanwhile.
        """
        while True:
            active, epoch = self._membership()
            topo = self._topology()
            if self._membership()[1] == epoch:
                return active, epoch, topo

    def _membership(self):
        if self._mooncake is None:
            return [1] * self.group_size, 0
        be = self._mooncake.backend_of(self.group)
        return [int(a) for a in be.active_ranks()], int(be.epoch())

    # ------------------------------------------------------------- transport

    def _err(self, op, msg):
        return ValueError(f"mooncake_ep {op} ({self.where}): {msg}")

    def _header(self, op, fields, counts=None, error=None, names=(), extra=None):
        """Collective header exchange; returns (headers int64 [W, n], active mask, epoch).

        ``extra``: a per-rank value in the last field, not compared across ranks.
        """
        n_counts = 0 if counts is None else int(counts.numel())
        hdr = torch.zeros(HDR + n_counts, dtype=torch.int64)
        hdr[0] = _BAD if error else _OK
        hdr[1] = _OPS[op]
        if not error:
            assert len(fields) <= (HDR - 3 if extra is not None else HDR - 2)
            for i, f in enumerate(fields):
                hdr[2 + i] = int(f)
            if extra is not None:
                hdr[HDR - 1] = int(extra)
            if n_counts:
                hdr[HDR:] = counts.to(torch.int64).cpu()
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
                    f"{nm}={DTYPE_NAMES.get(v, v) if nm == 'dtype' else v}"
                    for nm, v in zip(names, vals)
                )

            what = show(ref)
            got = "; ".join(f"rank {r}: {show(r)}" for r in diff)
            raise self._err(
                op, f"rank(s) {diff} disagree with rank {ref} ({what}): {got}; nothing was sent"
            )
        return out, active, epoch

    def _a2a(self, send, send_counts, recv_counts):
        """Rows of ``send`` (grouped by destination) to every rank.

        Returns the received rows grouped by source. Rows an inactive rank did not send are zero.
        """
        return self._a2a_start(send, send_counts, recv_counts, async_op=False)()

    def _a2a_start(self, send, send_counts, recv_counts, async_op=True):
        """:meth:`_a2a` started on the group's progress thread (``async_op``).

        Returns the function that waits for it and returns its rows (every rank must start the same
        all-to-alls in the same order, as for any collective).
        """
        send = send.contiguous()
        row_dtype = send.dtype
        if row_dtype in FP8_DTYPES:  # moved as bytes: gloo has no float8 all_to_all
            send = send.view(torch.uint8)
        out = self._recycler.empty(
            (sum(recv_counts),) + tuple(send.shape[1:]), send.dtype, send.device
        )
        work = dist.all_to_all_single(
            out, send, list(recv_counts), list(send_counts), group=self.group, async_op=async_op
        )

        def wait(_moving=send):  # the rows to send stay alive until they have moved
            if work is not None:
                work.wait()
            rows = out.view(row_dtype)
            if self._mooncake is not None and rows.numel():
                active, _ = self._membership()
                start = 0
                for s, c in enumerate(recv_counts):
                    if c and not active[s]:
                        rows[start : start + c].zero_()
                    start += c
            return rows

        return wait

    def _fwd(self, handle, send):
        return self._fwd_start(handle, send)()

    def _fwd_start(self, handle, send):
        """:meth:`_fwd` started (on the group: asynchronously).

        Returns the function that waits for its rows.
        """
        if getattr(handle, "backend", "group") == "nvshmem":
            rows = self._nvshmem_a2a(handle, send, handle.send_counts, handle.recv_counts)
            return lambda: rows
        return self._a2a_start(send, handle.send_counts, handle.recv_counts)

    def _bwd(self, handle, recv):
        if getattr(handle, "backend", "group") == "nvshmem":
            return self._nvshmem_a2a(handle, recv, handle.recv_counts, handle.send_counts)
        return self._a2a(recv, handle.recv_counts, handle.send_counts)

    def _route(self, handle):
        """The handle's two-level route while the group's membership is the one it was planned for.

        ``None``: move rows rank to rank.
        """
        route = handle.route
        if route is None or tuple(self._membership()[0]) != route.active:
            return None
        return route

    def _fwd_tokens(self, handle, x, tasks=()):
        """A normal-mode dispatch's rows of tokens ``x`` [T, H] to its destinations.

        Returns [N_recv, H], by source rank then token (two-level across hosts when the handle has a
        route; a membership change during it reruns the op rank to rank).

        ``tasks``: callables run once each while the rows move, in order and at the same point on
        every rank (they may start collectives): across hosts one after each of the route's
        all-to-alls is started (:func:`mooncake_ep._hosts.forward`), rank to rank the first
        before the rows' all-to-all and the others after it.
        """
        kern = self._cfg["kernels"]
        route = self._route(handle)
        if route is not None:
            epoch = self._membership()[1]
            out = _hosts.forward(self._a2a_start, route, x, self._recycler.empty, tasks)
            if self._membership()[1] == epoch:
                return out
            tasks = ()  # they ran
        if tasks:
            tasks[0]()
        rows = K_.gather_rows(x, handle.send_token_idx, kern, self._recycler.empty)
        out = self._fwd(handle, rows)
        for task in tasks[1:]:
            task()
        return out

    def _bwd_tokens(self, handle, rows, out_dtype):
        """The reverse of :meth:`_fwd_tokens`: ``rows`` [N_recv, H] -> [T, H] of ``out_dtype``.

        Each token's rows are summed (float32 with ``fp32_accumulate``).
        """
        fp32 = self._cfg["fp32_accumulate"]
        route = self._route(handle)
        if route is not None:
            epoch = self._membership()[1]
            out = _hosts.backward(
                self._a2a_start,
                route,
                rows,
                handle.num_tokens,
                fp32,
                out_dtype,
                self._recycler.empty,
            )
            if self._membership()[1] == epoch:
                return out
        back = self._bwd(handle, rows)
        if K_._use_triton(back, self._cfg["kernels"]):
            # Triton: each token sums its rows in rank order, as index_add_ does on CPU
            out = K_.sum_rows_by_table(
                back.contiguous(),
                handle.row_table(),
                kernels=self._cfg["kernels"],
                fp32_accumulate=fp32,
                max_per_row=handle.max_ranks_per_token,
            )
            if out is not None:
                return out.to(out_dtype)
        return K_.scatter_add_rows(
            back,
            handle.send_token_idx,
            handle.num_tokens,
            max_per_row=handle.max_ranks_per_token,
            alloc=self._recycler.empty,
            fp32_accumulate=fp32,
            out_dtype=out_dtype,
        )

    # ------------------------------------------------- low-latency backend

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
        """Collective: NVSHMEM world and this Buffer's symmetric buffers.

        Returns ``None``, or why not (the same on every rank; the Buffer then stays on the group).
        """
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
        """After the header: ``("nvshmem" | "group", why not NVSHMEM)``, the same on every rank.

        The choice comes from the gathered header. ``want="nvshmem"`` raises ``ValueError`` on every
        rank instead of falling back.
        """
        W = self.group_size
        live = [r for r in range(W) if active[r]]
        codes = {r: int(hdr[r, HDR - 1]) >> 1 for r in live}
        if len(set(codes.values())) > 1:
            names = {c: n for n, c in LL_CODES.items()}
            got = ", ".join(f"rank {r}: {names.get(c, c)!r}" for r, c in codes.items())
            raise self._err(
                op,
                f"ranks disagree on low_latency_backend (EPConfig or "
                f"MOONCAKE_EP_LOW_LATENCY_BACKEND): {got}; nothing was sent",
            )
        if want == "group":
            return "group", None
        inactive = [r for r in range(W) if not active[r]]
        no = [r for r in live if not int(hdr[r, HDR - 1]) & 1]
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
            raise self._err(op, f"{FORCED} cannot be served: {why}; nothing was sent")
        return "group", why

    def _nvshmem_a2a(self, handle, send, send_counts, recv_counts):
        active, _ = self._membership()
        if not all(active):
            raise RuntimeError(
                f"mooncake_ep low-latency ({self.where}): rank(s) "
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
