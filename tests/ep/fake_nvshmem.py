"""A CPU stand-in for the part of ``nvshmem.core`` (nvshmem4py) that ``mooncake_ep`` uses,
so that the NVSHMEM low-latency path's protocol (unique-id bootstrap over the group,
collective symmetric allocation, put-with-signal into the peer's slot, barrier, signal
wait, compaction) runs between real rank processes on a machine without a GPU.

The functions keep nvshmem4py's names and signatures (read from nvshmem4py-cu13 0.4.1's
``nvshmem/core/*.py``). Symmetric memory is a file per (allocation, PE) under
``FAKE_NVSHMEM_DIR/<unique id>/``, mapped shared; a put writes into the target PE's file
at the offset its symmetric address has locally; signals add under a file lock; the
barrier is one marker file per PE and round. Everything completes synchronously (streams
are ignored). ``CALLS`` counts the calls; ``FAKE_NVSHMEM_FAIL_INIT=<rank>`` makes that
rank's ``init`` raise.

``install()`` puts it in ``sys.modules`` as ``nvshmem``, ``nvshmem.core`` and
``nvshmem.bindings``; ``uninstall()`` takes it out.
"""

from __future__ import annotations

import collections
import ctypes
import fcntl
import os
import sys
import time
import types

import torch

CALLS = collections.Counter()
_UID_BYTES = 128
_TOKEN = 32
_S = {}


def _reset():
    CALLS.clear()
    _S.clear()
    _S.update(dir=None, rank=None, n=None, k=0, bar=0, allocs={}, maps={}, init=False, token=None)


_reset()


class SignalOp:
    SIGNAL_SET = 0
    SIGNAL_ADD = 5


class ComparisonType:
    CMP_EQ, CMP_NE, CMP_GT, CMP_LE, CMP_LT, CMP_GE = range(6)


class InitStatus:
    STATUS_NOT_INITIALIZED = 0
    STATUS_IS_BOOTSTRAPPED = 1
    STATUS_IS_INITIALIZED = 2


class NvshmemStream:
    def __init__(self, pt_stream):
        self.pt_stream = pt_stream


class Buffer:
    """``cuda.core.Buffer`` stand-in: ``handle`` (address) and ``size``."""

    def __init__(self, ptr, size):
        self.handle, self.size = int(ptr), int(size)

    @classmethod
    def from_handle(cls, ptr, size, mr=None, owner=None):
        return cls(ptr, size)


class _UniqueId:
    def __init__(self):
        self._raw = ctypes.create_string_buffer(_UID_BYTES)
        self.ptr = ctypes.addressof(self._raw)


class _Bindings(types.ModuleType):
    class uniqueid_dtype:
        itemsize = _UID_BYTES


def get_unique_id(empty=False):
    CALLS["get_unique_id"] += 1
    u = _UniqueId()
    if not empty:
        ctypes.memmove(u.ptr, os.urandom(_TOKEN // 2).hex().encode(), _TOKEN)
    return u


def init(device=None, uid=None, rank=None, nranks=None, mpi_comm=None, initializer_method=""):
    CALLS["init"] += 1
    if initializer_method != "uid" or uid is None or rank is None or nranks is None:
        raise ValueError("fake nvshmem: only the uid method is implemented")
    if os.environ.get("FAKE_NVSHMEM_FAIL_INIT") == str(rank):
        raise RuntimeError("fake nvshmem: init failure injected (FAKE_NVSHMEM_FAIL_INIT)")
    token = ctypes.string_at(uid.ptr, _TOKEN).decode("ascii")
    if not token.isalnum():
        raise ValueError(f"fake nvshmem: the unique id did not arrive intact: {token!r}")
    d = os.path.join(os.environ["FAKE_NVSHMEM_DIR"], token)
    os.makedirs(d, exist_ok=True)
    _S.update(dir=d, rank=int(rank), n=int(nranks), init=True, token=token)


def init_status():
    return InitStatus.STATUS_IS_INITIALIZED if _S["init"] else InitStatus.STATUS_NOT_INITIALIZED


def my_pe():
    return _S["rank"]


def n_pes():
    return _S["n"]


def _wait(pred, what, timeout=30.0):
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise TimeoutError(f"fake nvshmem (PE {_S['rank']}): timed out waiting for {what}")
        time.sleep(0.001)


def _file(k, pe):
    return os.path.join(_S["dir"], f"a{k}_pe{pe}")


def _map(k, pe):
    key = (k, pe)
    if key not in _S["maps"]:
        _S["maps"][key] = torch.from_file(
            _file(k, pe), shared=True, size=_S["allocs"][k][1], dtype=torch.uint8
        )
    return _S["maps"][key]


def tensor(shape, dtype=torch.float32, release=False, morder="C", except_on_del=True):
    """Collective: every PE maps a file of the same size; returns this PE's as a tensor."""
    CALLS["tensor"] += 1
    numel = 1
    for s in shape:
        numel *= int(s)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    k = _S["k"]
    _S["k"] += 1
    with open(_file(k, _S["rank"]), "wb") as f:
        f.truncate(nbytes)
    open(_file(k, _S["rank"]) + ".ready", "w").close()
    _wait(
        lambda: all(os.path.exists(_file(k, pe) + ".ready") for pe in range(_S["n"])),
        f"allocation {k}",
    )
    _S["allocs"][k] = (None, nbytes)
    t = _map(k, _S["rank"])
    _S["allocs"][k] = (t.data_ptr(), nbytes)
    return t.view(dtype).view(tuple(shape))


def tensor_get_buffer(t):
    for _k, (base, n) in _S["allocs"].items():
        if base == t.data_ptr():
            return Buffer(base, n), n, str(t.dtype)
    raise ValueError("fake nvshmem: tensor not allocated by nvshmem")


def free_tensor(t):
    CALLS["free_tensor"] += 1


def _locate(ptr):
    for k, (base, n) in _S["allocs"].items():
        if base is not None and base <= ptr < base + n:
            return k, ptr - base
    raise ValueError(f"fake nvshmem (PE {_S['rank']}): address {ptr:#x} is not symmetric")


def _signal(sig, val, op, pe):
    k, off = _locate(sig.handle)
    word = _map(k, pe)[off : off + 8].view(torch.int64)
    with open(os.path.join(_S["dir"], f"lock_pe{pe}"), "a") as lk:
        fcntl.flock(lk, fcntl.LOCK_EX)
        if op == SignalOp.SIGNAL_ADD:
            word += int(val)
        else:
            word.fill_(int(val))
        fcntl.flock(lk, fcntl.LOCK_UN)


def put_signal_nbi(dst, src, signal_var, signal_val, signal_op, remote_pe=-1, stream=None):
    CALLS["put_signal_nbi"] += 1
    if not all(isinstance(b, Buffer) for b in (dst, src, signal_var)):
        raise TypeError("fake nvshmem: put_signal_nbi takes Buffers")
    size = min(src.size, dst.size)
    ks, os_ = _locate(src.handle)
    kd, od = _locate(dst.handle)
    if not 0 <= remote_pe < _S["n"] or od + size > _S["allocs"][kd][1]:
        raise ValueError(
            f"fake nvshmem: put out of range (PE {remote_pe}, offset {od}, {size} bytes)"
        )
    CALLS["put_bytes"] += size
    _map(kd, remote_pe)[od : od + size].copy_(_map(ks, _S["rank"])[os_ : os_ + size])
    _signal(signal_var, signal_val, signal_op, remote_pe)


def signal_op(signal_var, signal_val, signal_op, remote_pe=-1, stream=None):
    CALLS["signal_op"] += 1
    _signal(signal_var, signal_val, signal_op, remote_pe)


def signal_wait(signal_var, signal_val, signal_op, stream=None):
    CALLS["signal_wait"] += 1
    if signal_op != ComparisonType.CMP_GE:
        raise NotImplementedError("fake nvshmem: CMP_GE only")
    k, off = _locate(signal_var.handle)
    word = _map(k, _S["rank"])[off : off + 8].view(torch.int64)
    _wait(lambda: int(word[0]) >= signal_val, f"signal >= {signal_val}")


def barrier_all(stream=None):
    CALLS["barrier_all"] += 1
    g = _S["bar"]
    _S["bar"] += 1
    open(os.path.join(_S["dir"], f"bar{g}_pe{_S['rank']}"), "w").close()
    _wait(
        lambda: all(
            os.path.exists(os.path.join(_S["dir"], f"bar{g}_pe{pe}")) for pe in range(_S["n"])
        ),
        f"barrier {g}",
    )


def quiet(stream=None):
    CALLS["quiet"] += 1


def install():
    """``nvshmem``, ``nvshmem.core`` (this module) and ``nvshmem.bindings`` in sys.modules."""
    _reset()
    pkg = types.ModuleType("nvshmem")
    pkg.__path__ = []
    core = sys.modules[__name__]
    bindings = _Bindings("nvshmem.bindings")
    pkg.core, pkg.bindings = core, bindings
    sys.modules.update({"nvshmem": pkg, "nvshmem.core": core, "nvshmem.bindings": bindings})


def uninstall():
    for name in ("nvshmem", "nvshmem.core", "nvshmem.bindings"):
        sys.modules.pop(name, None)
    _reset()
