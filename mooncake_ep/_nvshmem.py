"""NVSHMEM transport of ``mooncake_ep``'s low-latency mode (optional).

Used by :class:`mooncake_ep.Buffer` when ``EPConfig(low_latency_backend=...)`` (or
``MOONCAKE_EP_LOW_LATENCY_BACKEND``) allows it, the tensors are CUDA tensors and
``nvshmem.core`` (PyPI ``nvshmem4py-cu13``, which pulls ``nvidia-nvshmem-cu13``) imports.
``nvshmem`` itself is imported only when a low-latency op asks for NVSHMEM, and every
import of it is guarded: without it the package works as before.

Design (one :class:`SymmetricExchange` per ``Buffer``):

* Bootstrap: NVSHMEM has one world per process. The first ``Buffer`` that uses it
  initialises it over its group with NVSHMEM's unique-id method: group rank 0 creates the
  id, its raw bytes travel to the other ranks in a CPU ``uint8`` tensor broadcast over the
  group (plain bytes copied into the id's struct; nothing is unpickled), and every rank
  calls ``nvshmem.core.init(uid=..., rank=group rank, nranks=W, initializer_method="uid")``.
  PE numbers are then the group's ranks. A ``Buffer`` on another group cannot use it in
  the same process (``auto`` falls back to the group; ``nvshmem`` raises).
* Memory: a symmetric send and receive buffer (``nvshmem.core.tensor``, a collective
  allocation on every rank) of ``W * cap * row_bytes`` bytes each, ``cap = T_max * L``
  (the most rows one rank can send another in the low-latency mode: each of its at most
  ``T_max`` tokens once per local expert of the destination), plus one 8-byte signal
  word. Allocated at the first use (rows of ``H * max(4, element size)`` bytes) and grown,
  collectively, when a later exchange needs wider rows (e.g. float64).
* One exchange (the all-to-all of rows grouped by destination, as the group path's
  ``all_to_all_single``), all on the current CUDA stream: pack the rows into the symmetric
  send buffer; ``barrier_all`` (every rank packed, and has copied its previous receive out);
  to each rank ``d``: ``put_signal_nbi`` of the slice for ``d`` into ``d``'s receive buffer
  at this rank's slot (``rank * cap`` rows), adding 1 to ``d``'s signal word (``signal_op``
  alone when nothing goes to ``d``); ``quiet``; ``signal_wait`` until the signal word has
  grown by ``W`` (every rank's rows have landed: a put-with-signal delivers the signal
  after its data); copy the ``recv_counts[s]`` rows of each slot ``s`` out into a fresh
  tensor. Row counts are known on both sides from ``Buffer``'s header exchange, which
  still travels over the process group before anything moves (bad arguments raise on
  every rank first, as on the group path). The result is bit for bit the group path's.
* The path needs every seat of the group active (a dead PE would hang NVSHMEM's barrier);
  it does not follow membership changes.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ._comm import all_gather_single

# (module, None) once nvshmem.core imported; (None, reason) when it does not
_IMPORT = None
# tests only: let CPU tensors use a stand-in ``nvshmem.core`` (tests/ep/fake_nvshmem.py)
_TEST_ALLOW_CPU = False
# NVSHMEM's one world per process: the global ranks it was initialised over (ours or not)
_PROC = {"ranks": None, "ours": False, "error": None}


def import_core() -> tuple[object | None, str | None]:
    """``(nvshmem.core, None)``, or ``(None, why)`` when it does not import."""
    global _IMPORT
    if _IMPORT is None:
        try:
            import nvshmem.core as nc

            _IMPORT = (nc, None)
        except Exception as e:  # ImportError, a missing libnvshmem (OSError), ...
            _IMPORT = (
                None,
                f"nvshmem.core does not import ({type(e).__name__}: {e}); "
                "pip install nvshmem4py-cu13",
            )
    return _IMPORT


def _reset_for_tests():
    """Forget the import and the process state (tests swap ``nvshmem.core`` in and out)."""
    global _IMPORT, _TEST_ALLOW_CPU
    _IMPORT = None
    _TEST_ALLOW_CPU = False
    _PROC.update(ranks=None, ours=False, error=None)


def _initialised(nc) -> bool:
    try:
        st = nc.init_status()
    except Exception:  # the library is loaded by init; before that the query may fail
        return False
    names = {
        getattr(nc.InitStatus, n, None)
        for n in ("STATUS_IS_INITIALIZED", "STATUS_LIMITED_MPG", "STATUS_FULL_MPG")
    }
    return st in names


def local_unusable(
    device: torch.device, rank: int, world: int, global_ranks: Sequence[int]
) -> str | None:
    """Why this rank cannot run a low-latency op on ``device`` over NVSHMEM (``None``: it can).

    ``None`` means it can as far as this rank alone can tell. Collective agreement is the caller's
    job.
    """
    if device.type != "cuda" and not (_TEST_ALLOW_CPU and device.type == "cpu"):
        return f"expected CUDA tensors, got x on {device}"
    nc, why = import_core()
    if nc is None:
        return why
    if _PROC["error"]:
        return _PROC["error"]
    ranks = tuple(int(r) for r in global_ranks)
    if _PROC["ranks"] is not None:
        if _PROC["ranks"] != ranks:
            return (
                f"NVSHMEM is initialised in this process over global ranks {list(_PROC['ranks'])}, "
                f"expected this group's {list(ranks)} (one NVSHMEM world per process)"
            )
        return None
    if _initialised(nc):  # initialised by someone else: usable when its PEs are our ranks
        try:
            pe, npes = int(nc.my_pe()), int(nc.n_pes())
        except Exception as e:
            return f"NVSHMEM is initialised but my_pe()/n_pes() failed ({type(e).__name__}: {e})"
        if (pe, npes) != (rank, world):
            return (
                f"NVSHMEM was initialised outside mooncake_ep with PE {pe} of {npes}, expected "
                f"PE {rank} of {world} (this group's rank and size)"
            )
    return None


def _gather_flags(group, world: int, value: int):
    """all_gather of one int64 per rank (CPU) -> list of W ints."""
    out = torch.zeros(world, dtype=torch.int64)
    all_gather_single(out, torch.tensor([int(value)], dtype=torch.int64), group=group)
    return [int(v) for v in out]


def _uid_nbytes(nc) -> int:
    try:
        import nvshmem.bindings as b

        return int(b.uniqueid_dtype.itemsize)
    except Exception:
        return 128  # sizeof(nvshmemx_uniqueid_t)


def _init_world(nc, group, rank: int, world: int, device: torch.device):
    """NVSHMEM's unique-id init over ``group`` (collective; PE = group rank)."""
    n = _uid_nbytes(nc)
    uid = nc.get_unique_id(empty=(rank != 0))
    buf = torch.zeros(n, dtype=torch.uint8)
    if rank == 0:
        buf.copy_(torch.frombuffer(bytearray(ctypes.string_at(int(uid.ptr), n)), dtype=torch.uint8))
    dist.broadcast(buf, src=dist.get_global_rank(group, 0), group=group)
    if rank != 0:  # raw bytes into the id's struct
        ctypes.memmove(int(uid.ptr), buf.numpy().ctypes.data, n)
    dev = None
    if device.type == "cuda":
        torch.cuda.set_device(device)
        try:
            from cuda.core import Device
        except ImportError:
            Device = None
        if Device is not None:
            dev = Device(device.index if device.index is not None else torch.cuda.current_device())
            dev.set_current()
    nc.init(device=dev, uid=uid, rank=rank, nranks=world, initializer_method="uid")


class SymmetricExchange:
    """All-to-all of rows over NVSHMEM symmetric buffers for one ``Buffer``.

    See the module docstring. Every method is collective over the group.
    """

    def __init__(
        self, group: dist.ProcessGroup, rank: int, world: int, device: torch.device
    ) -> None:
        self.group, self.rank, self.world, self.device = group, rank, world, device
        self.nbytes = 0
        self.send_t = self.recv_t = self.sig_t = None
        self.send_b = self.recv_b = self.sig_b = None
        self.expected = 0

    # ------------------------------------------------------------ setup

    def setup(self, nbytes: int) -> str | None:
        """Initialises NVSHMEM (once per process) and allocates ``nbytes`` per buffer.

        Returns ``None``, or why it failed (the same text on every rank).
        """
        nc, why = import_core()
        ranks = tuple(dist.get_process_group_ranks(self.group))
        need = int(_PROC["ranks"] is None and not _initialised(nc)) if nc is not None else 0
        flags = _gather_flags(self.group, self.world, need)
        if len(set(flags)) > 1:
            return (
                f"ranks disagree on whether NVSHMEM is initialised (needs init per rank: {flags}); "
                "initialise it on all ranks or on none"
            )
        err = ""
        if flags[0]:
            try:
                _init_world(nc, self.group, self.rank, self.world, self.device)
                _PROC.update(ranks=ranks, ours=True)
            except Exception as e:
                err = f"nvshmem.core.init failed on rank {self.rank} ({type(e).__name__}: {e})"
        elif _PROC["ranks"] is None:
            _PROC.update(ranks=ranks, ours=False)
        why = self._agree(err)
        if why:
            _PROC["error"] = why
            return why
        return self._grow(nbytes)

    def _agree(self, err: str) -> str | None:
        """Every rank learns whether any failed; returns the reason (same on all ranks)."""
        flags = _gather_flags(self.group, self.world, 1 if err else 0)
        bad = [r for r, f in enumerate(flags) if f]
        if not bad:
            return None
        return f"NVSHMEM setup failed on rank(s) {bad}" + (
            f": {err}" if err else " (see their error)"
        )

    def _alloc(self, nc, shape, dtype):
        t = nc.tensor(shape, dtype=dtype, except_on_del=False)
        return t, nc.tensor_get_buffer(t)[0]

    def _grow(self, nbytes: int) -> str | None:
        """(Re)allocates the symmetric buffers to at least ``nbytes`` each (collective)."""
        if nbytes <= self.nbytes:
            return None
        nc, _ = import_core()
        err = ""
        try:
            if self.send_t is not None and self.device.type == "cuda":
                # queued exchanges may still read them; nvshmem_free does not wait for streams
                torch.cuda.current_stream(self.device).synchronize()
            for t in (self.send_t, self.recv_t):
                if t is not None:
                    nc.free_tensor(t)
            self.send_t = self.recv_t = None
            nbytes = max(nbytes, 2 * self.nbytes)
            self.send_t, self.send_b = self._alloc(nc, (nbytes,), torch.uint8)
            self.recv_t, self.recv_b = self._alloc(nc, (nbytes,), torch.uint8)
            if self.sig_t is None:
                self.sig_t, self.sig_b = self._alloc(nc, (1,), torch.int64)
                self.sig_t.zero_()
                self.expected = 0
                nc.barrier_all(stream=self._stream(nc))  # zeroed everywhere before anyone signals
            self.nbytes = nbytes
        except Exception as e:
            err = (
                f"allocating {nbytes} bytes of NVSHMEM symmetric memory failed on rank {self.rank} "
                f"({type(e).__name__}: {e}); NVSHMEM_SYMMETRIC_SIZE sets the heap size"
            )
        why = self._agree(err)
        if why:
            self.nbytes = 0
        return why

    # ---------------------------------------------------------- exchange

    def _stream(self, nc):
        if self.device.type == "cuda":
            return nc.NvshmemStream(torch.cuda.current_stream(self.device))
        return None  # tests: the stand-in runs synchronously

    def _slice(self, buf, offset: int, nbytes: int):
        """A non-owning view of ``nbytes`` of a symmetric buffer at ``offset``.

        It is still a symmetric address: the put translates it to the remote PE's copy.
        """
        return type(buf).from_handle(int(buf.handle) + offset, nbytes)

    def alltoallv(
        self,
        send: torch.Tensor,
        send_counts: Sequence[int],
        recv_counts: Sequence[int],
        cap: int,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """Rows of ``send`` to every rank; fills ``out`` and returns it.

        ``send`` is [sum(send_counts), ...], grouped by destination rank; ``out`` is
        [sum(recv_counts), ...], of the same dtype, grouped by source. ``cap``: the most rows one
        rank may send another.
        """
        nc, _ = import_core()
        W = self.world
        if max(list(send_counts) + list(recv_counts) + [0]) > cap:
            raise RuntimeError(
                f"mooncake_ep NVSHMEM exchange (rank {self.rank}): {max(send_counts)} or "
                f"{max(recv_counts)} rows for one rank, expected at most {cap}"
            )
        per_row = 1
        for d in send.shape[1:]:
            per_row *= int(d)
        row_bytes = per_row * send.element_size()
        if row_bytes == 0:
            return out
        why = self._grow(W * cap * row_bytes)
        if why:
            raise RuntimeError(f"mooncake_ep NVSHMEM exchange (rank {self.rank}): {why}")
        stream = self._stream(nc)
        sbytes = send.contiguous().view(-1).view(torch.uint8)
        self.send_t[: sbytes.numel()].copy_(sbytes)
        nc.barrier_all(stream=stream)  # all packed; all copied their previous receive out
        slot = cap * row_bytes
        off = 0
        for d in range(W):
            nb = int(send_counts[d]) * row_bytes
            if nb:
                nc.put_signal_nbi(
                    self._slice(self.recv_b, self.rank * slot, nb),
                    self._slice(self.send_b, off, nb),
                    self.sig_b,
                    1,
                    nc.SignalOp.SIGNAL_ADD,
                    d,
                    stream=stream,
                )
            else:
                nc.signal_op(self.sig_b, 1, nc.SignalOp.SIGNAL_ADD, d, stream=stream)
            off += nb
        nc.quiet(stream=stream)
        self.expected += W
        nc.signal_wait(self.sig_b, self.expected, nc.ComparisonType.CMP_GE, stream=stream)
        obytes = out.view(-1).view(torch.uint8)
        o = 0
        for s in range(W):
            nb = int(recv_counts[s]) * row_bytes
            if nb:
                obytes[o : o + nb].copy_(self.recv_t[s * slot : s * slot + nb])
            o += nb
        return out
