"""Triton kernels of ``mooncake_ep`` (permute, unpermute, weighted combine, fp8 cast).

Each kernel runs on CPU tensors under ``TRITON_INTERPRET=1`` in a child process (the
variable must be set before triton is imported) and is compared bit for bit with an
independent torch computation; then every kernel is compiled ahead of time for
``GPUTarget("cuda", 90, 32)`` (sm_90; needs no GPU). The whole module skips when triton
is not importable. The kernels are written for Triton 3.6 and 3.9; this runs against the
installed one (``MOONCAKE_TEST_TRITON_PATH`` prepends another triton to the child's
``sys.path``, e.g. a ``pip install --target`` of 3.6).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests import REPO_ROOT

pytestmark = pytest.mark.timeout(180)

try:
    import triton  # noqa: F401
except ImportError:
    pytest.skip("triton is not importable", allow_module_level=True)

REPO = REPO_ROOT

INTERPRET_CHECKS = r'''
import json, sys, torch
import triton
from mooncake_ep import triton_kernels as tk
out = {"triton": triton.__version__}
g = torch.Generator().manual_seed(7)

def bits(t):
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t

# permute: rows of x in send order, bf16 and fp32, H not a multiple of the block
for dt in (torch.bfloat16, torch.float32):
    x = torch.randn(9, 200, generator=g).to(dt)
    src = torch.tensor([8, 0, 3, 3, 5, 1, 8], dtype=torch.int64)
    out[f"permute_{dt}"] = torch.equal(tk.permute(x, src), torch.stack([x[i] for i in src.tolist()]))
out["permute_empty"] = tuple(tk.permute(torch.randn(3, 8), torch.zeros(0, dtype=torch.int64)).shape) == (0, 8)

# unpermute and weighted combine: pos tables with -1 holes, a token with no rows
rows = (torch.randint(-64, 65, (6, 300), generator=g).float() / 16).to(torch.bfloat16)
pos = torch.tensor([[0, -1, 2], [5, 5, -1], [-1, -1, -1], [1, 3, 4]])
w = torch.randint(1, 16, (4, 3), generator=g).float() / 16

def ref(weighted):
    acc = torch.zeros(4, 300, dtype=torch.float64)
    for t in range(4):
        for j in range(3):
            p = int(pos[t, j])
            if p >= 0:
                acc[t] += (float(w[t, j]) if weighted else 1.0) * rows[p].double()
    return acc

r0, r1 = ref(False), ref(True)
out["unpermute_f32"] = torch.equal(tk.unpermute(rows, pos, torch.float32).double(), r0)
out["unpermute_bf16"] = torch.equal(tk.unpermute(rows, pos), r0.float().to(torch.bfloat16))
out["weighted_f32"] = float((tk.weighted_combine(rows, pos, w, torch.float32).double() - r1).abs().max())
# rounding to bf16 is to nearest, ties to even (torch's cast), not truncation
ties = torch.tensor([[1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 2.55859375, -2.55859375]], dtype=torch.float32)
tie_out = tk.unpermute(ties, torch.tensor([[0]]), torch.bfloat16)
out["bf16_rtne"] = torch.equal(tie_out, ties.to(torch.bfloat16))
out["weighted_bf16"] = torch.equal(tk.weighted_combine(rows, pos, w),
                                   tk.weighted_combine(rows, pos, w, torch.float32).to(torch.bfloat16))

# fp8 cast: one scale per 128 channels (H=300: blocks of 128, 128, 44), ties and carries
x = torch.randn(16, 300, generator=g).to(torch.bfloat16) * 5
x[3, :128] = 0                          # an all-zero block: scale 1e-4 / 448
x[4, 0] = 448.0                          # scale 1: values that carry into the next exponent
x[4, 1:8] = torch.tensor([124.33, 127.0, 100.0, -124.33, 0.0009, -0.0009, 250.0])
q, s = tk.fp8_cast(x)
xf = x.float()
scales = torch.stack([xf[:, b * 128:(b + 1) * 128].abs().amax(1).clamp(min=1e-4) / 448 for b in range(3)], 1)
qr = torch.cat([(xf[:, b * 128:(b + 1) * 128] / scales[:, b:b + 1]).clamp(-448, 448) for b in range(3)], 1)
out["fp8_shapes"] = [list(q.shape), list(s.shape), str(q.dtype), str(s.dtype)]
out["fp8_scales"] = torch.equal(s, scales)
out["fp8_bits"] = torch.equal(bits(q), bits(qr.to(torch.float8_e4m3fn)))
print("RESULT " + json.dumps(out))
'''

AOT_CHECK = r'''
import json
import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from mooncake_ep import triton_kernels as tk
res = {"triton": triton.__version__}
for name, (fn, sig, cx) in tk.AOT_SIGNATURES.items():
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cx), target=GPUTarget("cuda", 90, 32))
    res[name] = {"cubin": len(k.asm.get("cubin", b"")), "sm_90": ".target sm_90" in k.asm["ptx"]}
print("RESULT " + json.dumps(res))
'''


def _run_child(code, interpret):
    env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_DEFAULT_FP_FUSION="0")
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    extra = os.environ.get("MOONCAKE_TEST_TRITON_PATH")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (extra, REPO, env.get("PYTHONPATH")) if p)
    p = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=150
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])


def test_kernels_under_interpreter():
    """permute / unpermute / weighted_combine / fp8_cast on CPU tensors (TRITON_INTERPRET=1)
    equal independent torch computations bit for bit (weighted float32 sums to 1e-6)."""
    r = _run_child(INTERPRET_CHECKS, interpret=True)
    print("triton", r.pop("triton"))
    assert r.pop("weighted_f32") < 1e-5
    assert r.pop("fp8_shapes") == [[16, 300], [16, 3], "torch.float8_e4m3fn", "torch.float32"]
    bad = {k: v for k, v in r.items() if v is not True}
    assert not bad, f"kernels differ from the reference: {bad}"


def test_kernels_compile_for_sm90():
    """Every kernel compiles ahead of time for GPUTarget('cuda', 90, 32) to a cubin."""
    r = _run_child(AOT_CHECK, interpret=False)
    print("triton", r.pop("triton"))
    assert set(r) == {"permute", "unpermute", "weighted_combine", "fp8_cast"}
    for name, v in r.items():
        assert v["cubin"] > 0 and v["sm_90"], (name, v)
