"""Shared helpers of the process-group tests: dtypes, the dtype/op table of docs/design.md,
rank-dependent inputs, independent (pure torch/numpy) references, comparisons.

Imported both by the test process and by the rank processes (keep it light).
"""

from __future__ import annotations

import os

import numpy as np
import torch

# ------------------------------------------------------------------ dtypes and ops

FLOATS = ["float64", "float32", "float16", "bfloat16"]
FLOAT8 = ["float8_e4m3fn", "float8_e5m2"]
SIGNED = ["int8", "int16", "int32", "int64"]
UNSIGNED = ["uint8", "uint16", "uint32", "uint64"]
BOOL = ["bool"]
COMPLEX = ["complex64", "complex128"]
ALL_DTYPES = FLOATS + FLOAT8 + SIGNED + UNSIGNED + BOOL + COMPLEX

FLOAT_OPS = ["SUM", "PRODUCT", "MIN", "MAX", "AVG", "PREMUL_SUM"]
INT_OPS = ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG"]
BOOL_OPS = ["SUM", "PRODUCT", "MIN", "MAX"]
COMPLEX_OPS = ["SUM", "AVG"]

PREMUL_FACTOR = 0.5

# What gloo (torch 2.13) serves; everything else gets an independent reference.
GLOO_DTYPES = {
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "int8",
    "int32",
    "int64",
    "uint8",
    "bool",
    "complex64",
    "complex128",
}


def dt(name: str) -> torch.dtype:
    return getattr(torch, name)


def category(name: str) -> str:
    if name in FLOATS:
        return "float"
    if name in FLOAT8:
        return "float8"
    if name in SIGNED:
        return "signed"
    if name in UNSIGNED:
        return "unsigned"
    if name in BOOL:
        return "bool"
    return "complex"


def ops_for(name: str):
    """The reductions docs/design.md's table promises for this dtype."""
    return {
        "float": FLOAT_OPS,
        "float8": FLOAT_OPS,
        "signed": INT_OPS,
        "unsigned": INT_OPS,
        "bool": BOOL_OPS,
        "complex": COMPLEX_OPS,
    }[category(name)]


def gloo_reduces(name: str, op: str) -> bool:
    """Whether gloo can serve as reference for this (dtype, reduction)."""
    if name not in GLOO_DTYPES or op.startswith("PREMUL_SUM"):
        return False
    if op == "AVG" and category(name) in ("signed", "unsigned", "bool"):
        return False
    return True


def redop(op: str, dtype_name: str | None = None):
    """The ReduceOp for a name; "PREMUL_SUM_TENSOR" is PREMUL_SUM with the factor given
    as a one-element tensor of the data's dtype (the other form torch accepts)."""
    import torch.distributed as dist

    if op == "PREMUL_SUM":
        return dist._make_nccl_premul_sum(PREMUL_FACTOR)
    if op == "PREMUL_SUM_TENSOR":
        return dist._make_nccl_premul_sum(
            torch.tensor([PREMUL_FACTOR], dtype=dt(dtype_name or "float32"))
        )
    return getattr(dist.ReduceOp, op)


# ------------------------------------------------------------------------- inputs

_WIDTH = {
    "int8": 8,
    "int16": 16,
    "int32": 32,
    "int64": 64,
    "uint8": 8,
    "uint16": 16,
    "uint32": 32,
    "uint64": 64,
}


def kind_for(op: str | None) -> str:
    if op in ("PRODUCT",):
        return "prod"
    if op in ("MIN", "MAX", "BAND", "BOR", "BXOR"):
        return "bits"
    return "sum"


def make(name: str, rank: int, shape, kind: str = "sum", salt: int = 0) -> torch.Tensor:
    """Deterministic rank-dependent values of dtype ``name`` (never equal across ranks).

    ``kind`` picks the value range so that no reduction over <= 4 ranks overflows or
    rounds (<= 8 for everything but uint32/uint64 sums): "sum" (sums, averages), "prod" (products stay small), "bits" (full bit range
    for min/max/bitwise ops: top bits set, so signed/unsigned mix-ups show).
    """
    if isinstance(shape, int):
        shape = (shape,)
    n = 1
    for s in shape:
        n *= s
    i = torch.arange(n, dtype=torch.int64)
    base = 7 * i + 13 * rank + 29 * salt
    cat = category(name)
    if cat == "bool":
        v = (((i + salt) >> (rank % 8)) & 1) == 1
        return v.reshape(shape)
    if cat in ("float", "float8", "complex"):
        if kind == "prod":
            table = torch.tensor([0.5, 1.0, 2.0, -1.0, -2.0], dtype=torch.float64)
            v = table[base % 5]
        elif cat == "float8":
            v = ((base % 5) - 2).to(torch.float64)  # integers -2..2: sums exact
        else:
            v = ((base % 17) - 8).to(torch.float64) * 0.25  # multiples of 1/4 in [-2, 2]
        if cat == "complex":
            im = ((3 * i + 7 * rank + 5 * salt) % 11 - 5).to(torch.float64) * 0.5
            return torch.complex(v, im).to(dt(name)).reshape(shape)
        return v.to(dt(name)).reshape(shape)
    width = _WIDTH[name]
    if kind == "prod":
        table = [-2, -1, 1, 2, 3] if cat == "signed" else [1, 2, 3]
        v = torch.tensor(table, dtype=torch.int64)[base % len(table)]
        return v.to(dt(name)).reshape(shape)
    if kind == "bits":
        h = _mix64(base + 1)
        if width == 64:
            return (h if cat == "signed" else h.view(torch.uint64)).reshape(shape)
        mask = (1 << width) - 1
        v = (h >> (64 - width)) & mask  # the well-mixed top bits
        if cat == "signed":
            v = torch.where(v >= (1 << (width - 1)), v - (1 << width), v)
        return v.to(dt(name)).reshape(shape)
    # "sum": no overflow for <= 8 ranks; big per-rank offsets catch narrowed lanes
    if cat == "signed":
        if width == 8:
            v = (base % 31) - 15
        else:
            off = {16: 1000, 32: 1 << 24, 64: 1 << 40}[width]
            v = (base % 201) - 100 + rank * off
        return v.to(dt(name)).reshape(shape)
    if width == 8:
        v = base % 31
        return v.to(dt(name)).reshape(shape)
    if width == 64:
        # 2**61 + rank * 2**60: the sum over four ranks passes 2**63 without wrapping
        # (AVG must divide as unsigned); stays below 2**64 for up to 4 ranks
        v = (base % 1000) + (1 << 61) + (rank % 4) * (1 << 60)
        return v.view(torch.uint64).reshape(shape)
    # rank * 2**29 for uint32: the sum over four ranks passes 2**31 (not 2**32)
    off = {16: 4000, 32: 1 << 29}[width]
    v = (base % 1000) + (rank % 4) * off
    return v.to(dt(name)).reshape(shape)


def _lsr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of an int64 tensor."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 lanes (wrapping arithmetic)."""
    z = z * -7046029254386353131  # 0x9E3779B97F4A7C15
    z = (z ^ _lsr(z, 30)) * -4658895280553007687  # 0xBF58476D1CE4E5B9
    z = (z ^ _lsr(z, 27)) * -7723592293110705685  # 0x94D049BB133111EB
    return z ^ _lsr(z, 31)


# --------------------------------------------------------------- numpy conversions


def to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.float16):
        return t.to(torch.float64).numpy()
    return t.contiguous().numpy()


def from_numpy(a: np.ndarray, name: str) -> torch.Tensor:
    d = dt(name)
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t.to(d) if t.dtype != d else t


# ------------------------------------------------------------------ reductions


def reduce_ref(name: str, op: str, tensors, ws: int | None = None) -> torch.Tensor:
    """Independent reference of an all-reduce over ``tensors`` (one per rank)."""
    ws = len(tensors) if ws is None else ws
    cat = category(name)
    shape = tensors[0].shape
    if cat == "bool":
        a = np.stack([to_numpy(t) for t in tensors])
        if op in ("SUM", "MAX", "BOR"):
            r = a.any(axis=0)
        elif op in ("PRODUCT", "MIN", "BAND"):
            r = a.all(axis=0)
        elif op == "BXOR":
            r = np.logical_xor.reduce(a, axis=0)
        else:
            raise ValueError(f"no bool reference for {op}")
        return torch.from_numpy(np.ascontiguousarray(r)).reshape(shape)
    if cat in ("float", "float8", "complex"):
        wide = torch.complex128 if cat == "complex" else torch.float64
        a = torch.stack([t.to(wide) for t in tensors])
        if op == "SUM":
            r = a.sum(0)
        elif op == "AVG":
            r = a.sum(0) / ws
        elif op in ("PREMUL_SUM", "PREMUL_SUM_TENSOR"):
            r = (a * PREMUL_FACTOR).sum(0)
        elif op == "PRODUCT":
            r = a.prod(0)
        elif op == "MIN":
            r = a.min(0).values
        elif op == "MAX":
            r = a.max(0).values
        else:
            raise ValueError(f"no float reference for {op}")
        return r.to(dt(name)).reshape(shape)
    # integers: numpy in the tensor's own dtype (wrap-around semantics)
    a = np.stack([to_numpy(t) for t in tensors])
    npd = a.dtype
    if op == "SUM":
        r = a.sum(axis=0, dtype=npd)
    elif op == "PRODUCT":
        r = a.prod(axis=0, dtype=npd)
    elif op == "MIN":
        r = a.min(axis=0)
    elif op == "MAX":
        r = a.max(axis=0)
    elif op == "BAND":
        r = np.bitwise_and.reduce(a, axis=0)
    elif op == "BOR":
        r = np.bitwise_or.reduce(a, axis=0)
    elif op == "BXOR":
        r = np.bitwise_xor.reduce(a, axis=0)
    elif op == "AVG":
        # truncated mean (C integer division), computed exactly in Python integers
        sums = [sum(int(x) for x in col) for col in a.reshape(a.shape[0], -1).T]
        q = [(abs(s) // ws) * (1 if s >= 0 else -1) for s in sums]
        r = np.array(q, dtype=npd).reshape(a.shape[1:])
    else:
        raise ValueError(f"no integer reference for {op}")
    return from_numpy(np.asarray(r, dtype=npd), name).reshape(shape)


# ---------------------------------------------------------------- comparisons

_TOL = {  # rtol, atol
    "float64": (1e-12, 1e-12),
    "float32": (1.3e-6, 1e-5),
    "float16": (1e-3, 1e-5),
    "bfloat16": (1.6e-2, 1e-5),
    "float8_e4m3fn": (0.125, 1e-3),
    "float8_e5m2": (0.25, 1e-3),
    "complex64": (1.3e-6, 1e-5),
    "complex128": (1e-12, 1e-12),
}


def mismatch(got, exp, where: str = "") -> str | None:
    """None if ``got`` equals ``exp`` (exact for integers/bool, dtype tolerance for
    floats); else a one-paragraph description. Works on tensors, lists/tuples/dicts of
    them and plain values."""
    if isinstance(exp, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"{where}: expected a tensor, got {type(got).__name__}: {got!r:.200}"
        if got.dtype != exp.dtype:
            return f"{where}: dtype {got.dtype} != expected {exp.dtype}"
        if tuple(got.shape) != tuple(exp.shape):
            return f"{where}: shape {tuple(got.shape)} != expected {tuple(exp.shape)}"
        if exp.numel() == 0:
            return None
        name = str(exp.dtype).replace("torch.", "")
        if name in _TOL:
            rtol, atol = _TOL[name]
            wide = torch.complex128 if exp.is_complex() else torch.float64
            g, e = got.to(wide), exp.to(wide)
            bad = ~torch.isclose(g, e, rtol=rtol, atol=atol, equal_nan=True)
        else:
            g, e = to_numpy(got), to_numpy(exp)
            bad = torch.from_numpy(np.asarray(g != e))
        if bool(bad.any()):
            idx = bad.reshape(-1).nonzero().reshape(-1)
            gf, ef = got.reshape(-1), exp.reshape(-1)
            show = ", ".join(
                f"[{int(k)}] got {_item(gf[k])} expected {_item(ef[k])}" for k in idx[:6]
            )
            return (
                f"{where}: {int(idx.numel())} of {exp.numel()} elements differ "
                f"(dtype {exp.dtype}, shape {tuple(exp.shape)}): {show}"
            )
        return None
    if isinstance(exp, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(exp):
            return f"{where}: expected a sequence of {len(exp)}, got {_short(got)}"
        for k, (g, e) in enumerate(zip(got, exp)):
            m = mismatch(g, e, f"{where}[{k}]")
            if m:
                return m
        return None
    if isinstance(exp, dict):
        for k, e in exp.items():
            if k not in got:
                return f"{where}: missing {k!r}"
            m = mismatch(got[k], e, f"{where}[{k!r}]")
            if m:
                return m
        return None
    if got != exp:
        return f"{where}: got {_short(got)}, expected {_short(exp)}"
    return None


def bitwise_equal(a, b) -> bool:
    """Exact (bit for bit) equality of tensors or nested lists/tuples of them."""
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
            return False
        return torch.equal(
            a.contiguous().reshape(-1).view(torch.uint8),
            b.contiguous().reshape(-1).view(torch.uint8),
        )
    if isinstance(a, (list, tuple)):
        return (
            isinstance(b, (list, tuple))
            and len(a) == len(b)
            and all(bitwise_equal(x, y) for x, y in zip(a, b))
        )
    return a == b


def _item(x):
    x = x.detach()
    if x.dtype in (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2):
        return float(x.to(torch.float64))
    if x.dtype in (torch.uint16, torch.uint32, torch.uint64):
        return int(to_numpy(x.reshape(1))[0])
    return x.item()


def _short(x):
    s = repr(x)
    return s if len(s) < 300 else s[:300] + "..."


# ------------------------------------------------------------------- rank helpers


def set_threads():
    torch.set_num_threads(1)


def env_flag(name: str, default: str = "0") -> bool:
    return os.environ.get(name, default) not in ("", "0", "false", "False")


def test_device() -> str:
    """Device the rank side of the conformance cases runs on: ``MOONCAKE_TEST_DEVICE``
    (``cpu`` by default; ``cuda`` on a GPU machine, see tests/device/)."""
    dev = os.environ.get("MOONCAKE_TEST_DEVICE", "cpu") or "cpu"
    if dev not in ("cpu", "cuda"):
        raise ValueError(f"MOONCAKE_TEST_DEVICE must be cpu or cuda, got {dev!r}")
    if dev == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("MOONCAKE_TEST_DEVICE=cuda but torch.cuda.is_available() is False")
    return dev


def to_cpu(x):
    """``x`` with every tensor inside (lists, tuples, dicts) moved to the CPU."""
    if isinstance(x, torch.Tensor):
        return x.cpu()
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(to_cpu(v) for v in x))
    if isinstance(x, (list, tuple)):
        return type(x)(to_cpu(v) for v in x)
    if isinstance(x, dict):
        return {k: to_cpu(v) for k, v in x.items()}
    return x
