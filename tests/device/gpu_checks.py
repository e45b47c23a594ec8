"""GPU checks of the CUDA paths, for a machine with one GPU (an H200: torch 2.11 + CUDA 13,
Python 3.12, Triton 3.6, no network). Run through ``tests/device/run_gpu_checks.sh``.

Steps (each in a child process with its own time limit; the whole run stays under 6 min):

1. ``env``: GPU, torch/CUDA/Triton versions, nvcc, build tools.
2. ``build``: ``MOONCAKE_WITH_CUDA=1 TORCH_CUDA_ARCH_LIST=<the GPU's> setup.py build_ext
   --inplace`` against the installed torch (nothing downloaded); ``WITH_CUDA`` checked.
3. ``kernels``: the CUDA reduction kernels (``_C._cuda_reduce``) against torch for every
   dtype and op of docs/design.md; a reduction from a peer process's tensor through CUDA IPC.
4. ``conformance``: tests/pg/test_conformance.py with ``MOONCAKE_TEST_DEVICE=cuda`` (world
   sizes up to 4, every rank on the one GPU).
5. ``ep``: the Triton kernels of mooncake_ep on CUDA tensors against the references of
   tests/ep/test_ep_triton.py; their latency; ``Buffer`` on CUDA tensors end to end (2 ranks):
   low-latency round trip (against the reference and the CPU-staged path), normal
   dispatch + combine, fp8 low-latency dispatch; CUDA vs CPU-staged round-trip latency.
   ``ep_nvshmem``: only where ``nvshmem.core`` (``pip install nvshmem4py-cu13``) imports,
   else recorded as skipped with the reason: ``Buffer`` with
   ``low_latency_backend="nvshmem"`` against ``"group"`` on CUDA tensors, 1 rank and 2
   ranks sharing the GPU (dispatch rows, counts and fp8 bit for bit, combine and backward
   within one bf16 rounding, round-trip latency of both).
6. ``allreduce_bw``: all_reduce of ``mooncake`` on CUDA tensors (2 and 4 ranks sharing the
   GPU) through CUDA IPC against references (dtypes, ops, two pieces, a non-contiguous view,
   an async op on a side stream; broadcast, all_gather_into_tensor and
   reduce_scatter_tensor too;
   ``mooncake_pg.cuda_path`` must say
   ``ipc``), then bus
   bandwidth of both paths (IPC, and pinned host staging forced with
   ``MooncakeOptions(cuda_ipc=False)``) against gloo on CUDA tensors (NCCL refuses two ranks
   on one GPU) and against the device-to-device copy ceiling of the GPU.

Writes one JSON (``--json``, default ``bench_out/gpu_checks.json``): per step ``ok``,
``seconds`` and its results. ``--dry-run`` runs nothing: it checks that every step can be
planned here (arguments, repository files, tools, imports), prints the plan and writes
the JSON with ``"dry_run": true``; it exits 0 on a machine without a GPU.
Exit status: 0 when every step that ran passed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = ["env", "build", "kernels", "conformance", "ep", "ep_nvshmem", "allreduce_bw"]
# seconds per step; the whole run has DEADLINE_S (the shell wrapper kills it at 360 s)
LIMITS = {
    "env": 20,
    "build": 150,
    "kernels": 30,
    "conformance": 100,
    "ep": 55,
    "ep_nvshmem": 45,
    "allreduce_bw": 80,
}
DEADLINE_S = 340


def _left(ctx, want: float) -> float:
    """A step's time limit: `want`, or less when the run's deadline is nearer."""
    return max(5.0, min(want, ctx["deadline"] - time.monotonic()))


def _run(cmd, limit: float, env=None):
    """Runs `cmd` in its own session; on timeout the whole session (rank processes too) is
    killed. Returns (returncode or None on timeout, stdout, stderr)."""
    p = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = p.communicate(timeout=limit)
        return p.returncode, out, err
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = p.communicate()
        return None, out, err


def _child(code: str, limit: float, env=None, args=()):
    """Runs ``code`` in a fresh Python; returns (ok, last RESULT json or None, tail of output)."""
    e = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p),
        OMP_NUM_THREADS="1",
    )
    e.update(env or {})
    # from a file, not -c: multiprocessing's spawn re-imports the main module by path
    with tempfile.TemporaryDirectory(prefix="mc_gpu_check_") as d:
        path = os.path.join(d, "check.py")
        with open(path, "w") as f:
            f.write(code)
        rc, out, err = _run([sys.executable, path, *args], limit, e)
    res = None
    for line in out.splitlines():
        if line.startswith("RESULT "):
            res = json.loads(line[len("RESULT ") :])
    tail = (
        ("" if rc is not None else f"timed out after {limit:.0f} s\n") + out[-3000:] + err[-4000:]
    )
    return rc == 0 and res is not None, res, tail


# ------------------------------------------------------------------------- the steps
ENV_CODE = r'''
import json, torch
r = {"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
if r["cuda_available"]:
    p = torch.cuda.get_device_properties(0)
    r.update(gpu=p.name, capability=list(torch.cuda.get_device_capability(0)), memory_gib=round(p.total_memory / 2**30, 1),
             device_count=torch.cuda.device_count())
try:
    import triton; r["triton"] = triton.__version__
except Exception as e:
    r["triton"] = None
print("RESULT " + json.dumps(r))
assert r["cuda_available"], "torch.cuda.is_available() is False"
'''

KERNEL_CODE = r'''
import json, os, sys, subprocess, torch
import mooncake_pg
from mooncake_pg import _C
assert _C.WITH_CUDA, "the extension was built without CUDA"
ops = {"SUM": 0, "AVG": 1, "PRODUCT": 2, "MIN": 3, "MAX": 4, "BAND": 5, "BOR": 6, "BXOR": 7}
floats = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
ints = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]
res, bad = {}, []
g = torch.Generator(device="cuda").manual_seed(1)
def ref(op, xs):
    if op == "SUM": return sum(xs[1:], xs[0].clone())
    if op == "PRODUCT":
        out = xs[0].clone()
        for x in xs[1:]: out = out * x
        return out
    if op == "MIN": return torch.stack(xs).amin(0)
    if op == "MAX": return torch.stack(xs).amax(0)
    if op == "AVG":
        s = sum(xs[1:], xs[0].clone())
        return s / len(xs) if s.is_floating_point() else torch.div(s, len(xs), rounding_mode="trunc")
    if op == "BAND":
        out = xs[0].clone()
        for x in xs[1:]: out &= x
        return out
    if op == "BOR":
        out = xs[0].clone()
        for x in xs[1:]: out |= x
        return out
    out = xs[0].clone()
    for x in xs[1:]: out ^= x
    return out
n = 100003
for dt in floats + ints:
    for op, code in ops.items():
        if dt.is_floating_point and op in ("BAND", "BOR", "BXOR"): continue
        xs = [(torch.randint(-4, 5, (n,), device="cuda", generator=g) * (0.5 if dt.is_floating_point else 1)).to(dt)
              if dt != torch.uint8 else torch.randint(0, 5, (n,), device="cuda", generator=g).to(dt) for _ in range(3)]
        dst = xs[0].clone()
        _C._cuda_reduce(dst, xs[1:], code)
        exp = ref(op, [x.double() if dt in (torch.float16, torch.bfloat16) else x for x in xs]).to(dt)
        ok = torch.equal(dst, exp) if not dt.is_floating_point else bool(torch.allclose(dst.double(), exp.double(), rtol=1e-2, atol=1e-2))
        res[f"{dt}/{op}"] = ok
        if not ok: bad.append(f"{dt}/{op}")
# bool: SUM/MAX = OR, PRODUCT/MIN = AND
b = [torch.rand(n, device="cuda", generator=g) > 0.5 for _ in range(3)]
for op, code, exp in (("SUM", 0, b[0] | b[1] | b[2]), ("MIN", 3, b[0] & b[1] & b[2])):
    d = b[0].clone(); _C._cuda_reduce(d, b[1:], code)
    res[f"bool/{op}"] = torch.equal(d, exp)
    if not res[f"bool/{op}"]: bad.append(f"bool/{op}")
# CUDA IPC: a child process exports a tensor, this one adds it into its own
child = r"""
import sys, torch
from mooncake_pg import _C
t = torch.arange(1000, device="cuda", dtype=torch.float32)[10:]   # an offset inside the allocation
h, off = _C._cuda_ipc_export(t)
sys.stdout.write(h.hex() + " " + str(off) + "\n"); sys.stdout.flush()
sys.stdin.readline()
"""
p = subprocess.Popen([sys.executable, "-c", child], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
h, off = p.stdout.readline().split()
dst = torch.ones(990, device="cuda", dtype=torch.float32)
_C._cuda_ipc_reduce_from(dst, bytes.fromhex(h), int(off), 0)
p.stdin.write("\n"); p.stdin.flush(); p.wait(10)
res["ipc_sum"] = torch.equal(dst, torch.arange(10, 1000, device="cuda", dtype=torch.float32) + 1)
if not res["ipc_sum"]: bad.append("ipc_sum")
res["failed"] = bad
print("RESULT " + json.dumps(res))
assert not bad, bad
'''

EP_CODE = r'''
import json, os, sys, time, torch
from tests.ep import test_ep_triton as T
from mooncake_ep import triton_kernels as real
class _OnCuda:
    """triton_kernels with inputs moved to the GPU and results back (the reference code is CPU code)."""
    def __getattr__(self, name):
        f = getattr(real, name)
        def call(*a, **k):
            mv = lambda v: v.cuda() if isinstance(v, torch.Tensor) else v
            out = f(*[mv(v) for v in a], **{kk: mv(v) for kk, v in k.items()})
            if isinstance(out, tuple): return tuple(o.cpu() for o in out)
            return out.cpu()
        return call
code = T.INTERPRET_CHECKS.replace("from mooncake_ep import triton_kernels as tk", "tk = _OnCuda()")
code = code.replace('print("RESULT " + json.dumps(out))', "")
ns = {"_OnCuda": _OnCuda}
exec(code, ns)
out = ns["out"]
res = {"triton": out.pop("triton")}
werr = out.pop("weighted_f32"); shapes = out.pop("fp8_shapes")
bad = [k for k, v in out.items() if v is not True]
if werr >= 1e-5: bad.append("weighted_f32")
res["checks"] = len(out) + 1; res["failed"] = bad
# latency of one permute + weighted combine (T=512 tokens, top-8, H=4096, bf16)
Tn, K, H = 512, 8, 4096
x = torch.randn(Tn, H, device="cuda").to(torch.bfloat16)
src = torch.randint(0, Tn, (Tn * K,), device="cuda")
pos = torch.arange(Tn * K, device="cuda").reshape(Tn, K)
w = torch.rand(Tn, K, device="cuda")
for _ in range(3): real.weighted_combine(real.permute(x, src), pos, w)
torch.cuda.synchronize()
a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
a.record()
for _ in range(20): real.weighted_combine(real.permute(x, src), pos, w)
b.record(); torch.cuda.synchronize()
res["kernel_round_trip_us"] = round(a.elapsed_time(b) / 20 * 1000, 1)
print("RESULT " + json.dumps(res))
assert not bad, bad
'''

RANKS_CODE = r'''
import json, os, sys, time, torch, torch.distributed as dist, torch.multiprocessing as mp

def ipc_reference_checks(rank, ws, grp):
    """all_reduce (and broadcast, all_gather_into_tensor, reduce_scatter_tensor) of CUDA
    tensors on the IPC path against references computed
    here from every rank's (seeded) input: dtypes, ops, a tensor of two pieces (above the
    64 MiB size class), a non-contiguous view, an async op on a side stream after a kernel
    queued there."""
    res, bad = {}, []
    R = dist.ReduceOp
    cases = [("f32_sum", torch.float32, R.SUM, (4099,)), ("bf16_sum", torch.bfloat16, R.SUM, (1 << 20,)),
             ("f16_max", torch.float16, R.MAX, (3001,)), ("i64_min", torch.int64, R.MIN, (777,)),
             ("i32_bxor", torch.int32, R.BXOR, (1000,)), ("u8_sum", torch.uint8, R.SUM, (513,)),
             ("f64_product", torch.float64, R.PRODUCT, (100,)), ("f32_avg", torch.float32, R.AVG, (5000,)),
             ("c64_sum", torch.complex64, R.SUM, (300,)), ("bool_max", torch.bool, R.MAX, (999,)),
             ("f32_two_pieces", torch.float32, R.SUM, ((64 << 20) // 4 + 12345,)),
             ("f32_noncontig", torch.float32, R.SUM, (65, 33)), ("empty", torch.float32, R.SUM, (0,))]
    def inputs(i, shape, dt):
        xs = []
        for r in range(ws):
            g = torch.Generator().manual_seed(1000 * i + r)
            v = torch.randint(0, 4, shape, generator=g) if dt in (torch.uint8, torch.bool) else torch.randint(-8, 9, shape, generator=g)
            xs.append(v.to(dt) if dt != torch.complex64 else torch.complex(v.float(), -v.float()))
        return xs
    def reference(xs, op):
        acc = xs[0].clone()
        for x in xs[1:]:
            if op == R.SUM: acc = (acc | x) if acc.dtype == torch.bool else acc + x
            elif op == R.PRODUCT: acc = acc * x
            elif op == R.MIN: acc = torch.minimum(acc, x)
            elif op == R.MAX: acc = torch.maximum(acc, x)
            elif op == R.BXOR: acc = acc ^ x
            elif op == R.AVG: acc = acc + x
        return acc / len(xs) if op == R.AVG else acc
    for i, (name, dt, op, shape) in enumerate(cases):
        xs = inputs(i, shape, dt)
        if name == "f32_noncontig":
            x = xs[rank].cuda().t()          # a transposed view: not contiguous
            ref = reference(xs, op).t()
        else:
            x = xs[rank].cuda()
            ref = reference(xs, op)
        dist.all_reduce(x, op=op, group=grp)
        got = x.cpu()
        ok = torch.equal(got, ref.to(dt)) if op != R.AVG else bool(torch.allclose(got, ref.to(dt)))
        res[name] = ok
        if not ok: bad.append(name)
    # broadcast through CUDA IPC: from the last rank, two pieces, and a non-contiguous view
    for name, shape in (("broadcast_two_pieces", ((64 << 20) // 4 + 777,)), ("broadcast_noncontig", (40, 31))):
        root = ws - 1
        xs = inputs(len(cases), shape, torch.float32)
        x = xs[rank].cuda()
        if name == "broadcast_noncontig": x = x.t()
        dist.broadcast(x, src=root, group=grp)
        want = xs[root].t() if name == "broadcast_noncontig" else xs[root]
        res[name] = bool(torch.equal(x.cpu(), want))
        if not res[name]: bad.append(name)
    # all_gather_into_tensor through CUDA IPC: one piece, and two pieces per rank
    for k, (name, n) in enumerate((("all_gather_small", 1000), ("all_gather_two_pieces", (64 << 20) // 4 + 99))):
        xs = inputs(len(cases) + 1 + k, (n,), torch.float32)
        out_t = torch.empty(ws * n, device="cuda")
        dist.all_gather_into_tensor(out_t, xs[rank].cuda(), group=grp)
        res[name] = bool(torch.equal(out_t.cpu(), torch.cat(xs)))
        if not res[name]: bad.append(name)
    # reduce_scatter_tensor through CUDA IPC: SUM and AVG, one piece and two pieces per seat
    for k, (name, op, n) in enumerate((("reduce_scatter_sum", R.SUM, 1000), ("reduce_scatter_avg", R.AVG, 4096),
                                       ("reduce_scatter_two_pieces", R.SUM, (64 << 20) // 4 // ws + 55))):
        xs = inputs(len(cases) + 3 + k, (ws * n,), torch.float32)
        out_t = torch.empty(n, device="cuda")
        dist.reduce_scatter_tensor(out_t, xs[rank].cuda(), op=op, group=grp)
        ref = reference(xs, op)[rank * n:(rank + 1) * n]
        res[name] = bool(torch.equal(out_t.cpu(), ref) if op != R.AVG else torch.allclose(out_t.cpu(), ref))
        if not res[name]: bad.append(name)
    # stream semantics: a kernel queued on a side stream right before an async all_reduce
    # issued there; Work.wait() orders the current (side) stream after the result
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        y = torch.zeros(1 << 22, device="cuda")
        y.add_(rank + 1)
        w = dist.all_reduce(y, async_op=True, group=grp)
        w.wait()
        z = y * 2
    s.synchronize()
    res["async_side_stream"] = bool(torch.all(z == ws * (ws + 1)))
    if not res["async_side_stream"]: bad.append("async_side_stream")
    res["failed"] = bad
    return res


def rank_main(rank, ws, port, q, cfg):
    torch.set_num_threads(1)
    torch.cuda.set_device(0)
    import mooncake_pg  # registers "mooncake" for cpu and cuda
    dist.init_process_group("mooncake", rank=rank, world_size=ws, init_method=f"tcp://127.0.0.1:{port}")
    out = {}
    if cfg["what"] == "allreduce":
        # "mooncake": CUDA IPC (every rank on this host); "mooncake_staged": the same backend
        # forced to pinned host staging (MooncakeOptions(cuda_ipc=False) = MOONCAKE_CUDA_IPC=0)
        groups = {"mooncake": None,
                  "mooncake_staged": dist.new_group(list(range(ws)),
                                                    pg_options=mooncake_pg.MooncakeOptions(cuda_ipc=False)),
                  "gloo": dist.new_group(list(range(ws)), backend="gloo")}
        out["ipc_checks"] = ipc_reference_checks(rank, ws, None)
        for name, grp in groups.items():
            r = out[name] = {}
            if name != "gloo":
                r["path"] = mooncake_pg.cuda_path(grp)
            for nbytes in cfg["sizes"]:
                x = torch.ones(nbytes // 4, device="cuda")
                for _ in range(2): dist.all_reduce(x, group=grp)
                torch.cuda.synchronize(); dist.barrier()
                t0 = time.perf_counter()
                for _ in range(cfg["iters"]): dist.all_reduce(x, group=grp)
                torch.cuda.synchronize()
                dt = (time.perf_counter() - t0) / cfg["iters"]
                r[str(nbytes)] = {"seconds": dt, "busbw_GBps": nbytes * 2 * (ws - 1) / ws / dt / 1e9}
            y = torch.full((1024,), float(rank + 1), device="cuda"); dist.all_reduce(y, group=grp)
            r["correct"] = bool(torch.all(y == ws * (ws + 1) / 2))
    else:  # EP on CUDA tensors end to end (Triton kernels, all_to_all of CUDA tensors), and staged through the CPU
        import mooncake_ep
        buf = mooncake_ep.Buffer()                      # kernels="auto": Triton for CUDA tensors
        Tn, H, E, K = 128, 4096, 32, 8
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(Tn, H, generator=g).to(torch.bfloat16).cuda()
        idx = torch.argsort(torch.rand(Tn, E, generator=g), dim=1)[:, :K].contiguous()
        w = torch.rand(Tn, K, generator=g)
        idx_c, w_c = idx.cuda(), w.cuda()
        ref = x.double().cpu() * w.double().sum(1, keepdim=True)
        tol = float(ref.abs().max()) * 2 ** -7 + 1e-6
        def trip_cuda():
            ll = buf.low_latency_dispatch(x, idx_c, Tn, E)
            return buf.low_latency_combine(ll.recv_x, idx_c, w_c, ll.handle).combined_x
        def trip_staged():
            ll = buf.low_latency_dispatch(x.cpu(), idx, Tn, E)
            return buf.low_latency_combine(ll.recv_x, idx, w, ll.handle).combined_x.cuda()
        # identity experts: each token comes back as x * sum of its weights (ep_bench's check)
        got = trip_cuda()
        out["ll_on_cuda"] = got.is_cuda
        out["ll_max_err"] = float((got.double().cpu() - ref).abs().max()); out["ll_correct"] = out["ll_max_err"] <= tol
        # the weighted sums of up to K rows: CUDA's index_add_ adds in no fixed order, so within one bf16 rounding
        out["ll_cuda_close_to_staged"] = bool(torch.allclose(got.float(), trip_staged().float(), rtol=2 ** -7, atol=1e-6))
        # normal mode on CUDA: identity experts, combine sums each token's copies (one per rank it went to)
        r = buf.dispatch(x, topk_idx=idx_c, topk_weights=w_c, num_experts=E)
        c = buf.combine(r.recv_x, r.handle).combined_x
        nr = (torch.zeros(Tn, ws, dtype=torch.bool).scatter_(1, idx // (E // ws), True)).sum(1, keepdim=True)
        out["normal_on_cuda"] = r.recv_x.is_cuda and c.is_cuda and r.recv_topk_idx.is_cuda
        out["normal_correct"] = bool(torch.equal(c.cpu(), (x.float().cpu() * nr).to(torch.bfloat16)))
        # fp8 low-latency dispatch on CUDA (Triton fp8 cast): dequantized rows within e4m3 precision
        llq = buf.low_latency_dispatch(x, idx_c, Tn, E, use_fp8=True)
        ll = buf.low_latency_dispatch(x, idx_c, Tn, E)
        deq = mooncake_ep.fp8_dequantize(*llq.recv_x, dtype=torch.float32)
        out["fp8_on_cuda"] = llq.recv_x[0].is_cuda
        out["fp8_close"] = all(bool(torch.allclose(ll.recv_x[l, :n].float(), deq[l, :n], rtol=0.0625, atol=1e-2))
                               for l, n in enumerate(ll.recv_count.tolist()))
        for name, fn in (("cuda", trip_cuda), ("staged", trip_staged)):
            for _ in range(3): fn()
            times = []
            for _ in range(10):
                dist.barrier(); torch.cuda.synchronize(); t0 = time.perf_counter(); fn(); torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            times.sort()
            out[f"ll_round_trip_us_median_{name}"] = round(times[len(times) // 2] * 1e6, 1)
    q.put((rank, out))
    dist.destroy_process_group()

if __name__ == "__main__":
    cfg = json.loads(sys.argv[1])
    import socket
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    ctx = mp.get_context("spawn"); q = ctx.Queue()
    ps = [ctx.Process(target=rank_main, args=(r, cfg["ws"], port, q, cfg)) for r in range(cfg["ws"])]
    for p in ps: p.start()
    res = dict(q.get(timeout=cfg["timeout"]) for _ in ps)
    for p in ps: p.join(10)
    print("RESULT " + json.dumps(res[0]))
'''

CEILING_CODE = r'''
import json, torch
n = 256 << 20
a = torch.empty(n, dtype=torch.uint8, device="cuda"); b = torch.empty_like(a)
for _ in range(3): b.copy_(a)
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
torch.cuda.synchronize(); s.record()
for _ in range(20): b.copy_(a)
e.record(); torch.cuda.synchronize()
print("RESULT " + json.dumps({"d2d_copy_GBps": n * 20 / (s.elapsed_time(e) / 1000) / 1e9}))
'''


def step_env(ctx):
    ok, res, tail = _child(ENV_CODE, _left(ctx, LIMITS["env"]))
    res = res or {}
    res["nvidia_smi"] = shutil.which("nvidia-smi")
    res["nvcc"] = shutil.which("nvcc") or next(
        (p for p in ("/usr/local/cuda/bin/nvcc",) if os.path.exists(p)), None
    )
    res["ninja"] = (
        shutil.which("ninja") is not None or importlib.util.find_spec("ninja") is not None
    )
    res["python"] = platform.python_version()
    ctx["arch"] = ".".join(map(str, res.get("capability", [9, 0])))
    return ok, res, tail


def build_cmd(ctx):
    env = {
        "MOONCAKE_WITH_CUDA": "1",
        "TORCH_CUDA_ARCH_LIST": ctx.get("arch", "9.0"),
        "MAX_JOBS": str(max(1, min(16, os.cpu_count() or 1))),
    }
    return [sys.executable, "setup.py", "-q", "build_ext", "--inplace"], env


def step_build(ctx):
    cmd, env = build_cmd(ctx)
    e = dict(os.environ, **env)
    t0 = time.perf_counter()
    rc, out, err = _run(cmd, _left(ctx, LIMITS["build"]), e)
    if rc != 0:
        why = "build timed out" if rc is None else f"build failed (exit {rc})"
        return False, {"cmd": " ".join(cmd)}, why + "\n" + out[-3000:] + err[-6000:]
    build_s = round(time.perf_counter() - t0, 1)
    ok, res, tail = _child(
        "import json, mooncake_pg as m; print('RESULT ' + json.dumps({'WITH_CUDA': m.WITH_CUDA, "
        "'WITH_RDMA': m.WITH_RDMA, 'rdma_devices': [d.name for d in m.rdma_devices()]})); "
        "assert m.WITH_CUDA",
        60,
    )
    return ok, dict(res or {}, cmd=" ".join(cmd), env=env, build_seconds=build_s), tail


def step_kernels(ctx):
    return _child(KERNEL_CODE, _left(ctx, LIMITS["kernels"]))


def conformance_cmd():
    return (
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "--maxfail=10",
            "-p",
            "no:cacheprovider",
            "tests/pg/test_conformance.py",
        ],
        {"MOONCAKE_TEST_DEVICE": "cuda"},
    )


def step_conformance(ctx):
    cmd, env = conformance_cmd()
    e = dict(os.environ, **env)
    # leave the last two steps their time
    limit = _left(ctx, min(LIMITS["conformance"], ctx["deadline"] - time.monotonic() - 110))
    rc, out, err = _run(cmd, limit, e)
    summary = [
        ln for ln in out.splitlines() if " passed" in ln or " failed" in ln or " error" in ln
    ][-1:]
    res = {
        "cmd": " ".join(cmd),
        "summary": summary,
        "timed_out": rc is None,
        "limit_s": round(limit),
    }
    return rc == 0, res, out[-4000:] + err[-2000:]


def step_ep(ctx):
    ok, res, tail = _child(
        EP_CODE, _left(ctx, 25), env={"MC_REPO": REPO, "TRITON_DEFAULT_FP_FUSION": "0"}
    )
    res = res or {}
    # the group path here (step ep_nvshmem covers NVSHMEM, where nvshmem4py is installed)
    ok2, r2, t2 = _child(
        RANKS_CODE,
        _left(ctx, 40),
        args=(json.dumps({"what": "ep", "ws": 2, "timeout": 35}),),
        env={"MOONCAKE_EP_LOW_LATENCY_BACKEND": "group"},
    )
    res["ep_ws2"] = r2
    passed = bool(r2) and all(
        r2.get(k)
        for k in (
            "ll_on_cuda",
            "ll_correct",
            "ll_cuda_close_to_staged",
            "normal_on_cuda",
            "normal_correct",
            "fp8_on_cuda",
            "fp8_close",
        )
    )
    return ok and ok2 and passed, res, tail + t2


NVSHMEM_CODE = r'''
import json, os, sys, time, traceback, torch, torch.distributed as dist, torch.multiprocessing as mp

def rank_main(rank, ws, port, q):
    out = {}
    nv = None
    try:
        torch.set_num_threads(1)
        torch.cuda.set_device(0)
        import mooncake_pg  # registers "mooncake" for cpu and cuda
        dist.init_process_group("mooncake", rank=rank, world_size=ws, init_method=f"tcp://127.0.0.1:{port}")
        import mooncake_ep
        nv = mooncake_ep.Buffer(config=mooncake_ep.EPConfig(low_latency_backend="nvshmem"))
        grp = mooncake_ep.Buffer(config=mooncake_ep.EPConfig(low_latency_backend="group"))
        Tn, H, E, K = 128, 4096, 8 * ws, 4
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(Tn, H, generator=g).to(torch.bfloat16).cuda()
        idx = torch.argsort(torch.rand(Tn, E, generator=g), dim=1)[:, :K].contiguous().cuda()
        w = torch.rand(Tn, K, generator=g).cuda()
        def trip(buf, grad=False):
            xg = x.clone().requires_grad_(grad)
            ll = buf.low_latency_dispatch(xg, idx, Tn, E)
            c = buf.low_latency_combine(ll.recv_x, idx, w, ll.handle).combined_x
            if grad:
                (c.float() * torch.arange(H, device="cuda").float()).sum().backward()
            return ll, c, xg.grad
        ll_n, c_n, gx_n = trip(nv, True)
        ll_g, c_g, gx_g = trip(grp, True)
        out["backend"] = nv.low_latency_backend
        out["on_cuda"] = ll_n.recv_x.is_cuda and c_n.is_cuda
        counts = ll_g.recv_count.tolist()
        out["counts_equal"] = bool(torch.equal(ll_n.recv_count, ll_g.recv_count))
        out["rows_equal"] = all(bool(torch.equal(ll_n.recv_x[l, :n], ll_g.recv_x[l, :n])) for l, n in enumerate(counts))
        # both sum up to K weighted rows per token with CUDA's index_add_ (no fixed order)
        out["combine_close"] = bool(torch.allclose(c_n.float(), c_g.float(), rtol=2 ** -7, atol=1e-6))
        out["grad_close"] = bool(torch.allclose(gx_n.float(), gx_g.float(), rtol=2 ** -7, atol=1e-3))
        ref = x.double().cpu() * w.double().cpu().sum(1, keepdim=True)   # identity experts
        out["combine_max_err"] = float((c_n.double().cpu() - ref).abs().max())
        out["combine_correct"] = out["combine_max_err"] <= float(ref.abs().max()) * 2 ** -7 + 1e-6
        qn = nv.low_latency_dispatch(x, idx, Tn, E, use_fp8=True)
        qg = grp.low_latency_dispatch(x, idx, Tn, E, use_fp8=True)
        out["fp8_equal"] = all(bool(torch.equal(qn.recv_x[0][l, :n].view(torch.uint8), qg.recv_x[0][l, :n].view(torch.uint8)))
                               and bool(torch.equal(qn.recv_x[1][l, :n], qg.recv_x[1][l, :n]))
                               for l, n in enumerate(qg.recv_count.tolist()))
        for name, buf in (("nvshmem", nv), ("group", grp)):
            for _ in range(3): trip(buf)
            ts = []
            for _ in range(10):
                dist.barrier(); torch.cuda.synchronize(); t0 = time.perf_counter(); trip(buf); torch.cuda.synchronize()
                ts.append(time.perf_counter() - t0)
            ts.sort()
            out[f"ll_round_trip_us_median_{name}"] = round(ts[len(ts) // 2] * 1e6, 1)
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()[-2000:]
    q.put((rank, out))
    if "error" not in out and nv is not None and nv.low_latency_backend == "nvshmem":
        torch.cuda.synchronize()
        import nvshmem.core
        nvshmem.core.finalize()   # collective; frees the symmetric buffers
    if dist.is_initialized():
        dist.destroy_process_group()

if __name__ == "__main__":
    cfg = json.loads(sys.argv[1])
    import socket
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    ctx = mp.get_context("spawn"); q = ctx.Queue()
    ps = [ctx.Process(target=rank_main, args=(r, cfg["ws"], port, q)) for r in range(cfg["ws"])]
    for p in ps: p.start()
    res = dict(q.get(timeout=cfg["timeout"]) for _ in ps)
    for p in ps: p.join(10)
    print("RESULT " + json.dumps({str(r): res[r] for r in sorted(res)}))
'''

NVSHMEM_KEYS = (
    "on_cuda",
    "counts_equal",
    "rows_equal",
    "combine_close",
    "grad_close",
    "combine_correct",
    "fp8_equal",
)


def step_ep_nvshmem(ctx):
    """NVSHMEM low-latency path against the group path (1 rank, then 2 sharing the GPU);
    skipped, with the reason in the JSON, where nvshmem.core does not import."""
    ok, probe, tail = _child(
        "import json\ntry:\n    import nvshmem.core as n\n    r = {'version': str(n.get_version())}\n"
        "except Exception as e:\n    r = {'skipped': f'nvshmem.core does not import ({type(e).__name__}: {e}); "
        "pip install nvshmem4py-cu13 to run this step'}\nprint('RESULT ' + json.dumps(r))\n",
        20,
    )
    if not ok or "skipped" in (probe or {}):
        return True, probe or {"skipped": "the import probe failed: " + tail[-500:]}, tail
    res = {"nvshmem": probe.get("version"), "runs": {}}
    good = True
    for ws in (1, 2):
        ok2, r, t = _child(
            NVSHMEM_CODE, _left(ctx, 22), args=(json.dumps({"ws": ws, "timeout": 20}),)
        )
        res["runs"][f"ws{ws}"] = r
        tail += t
        for rank_out in (r or {}).values():
            ok2 = (
                ok2
                and rank_out.get("backend") == "nvshmem"
                and all(rank_out.get(k) for k in NVSHMEM_KEYS)
            )
        good = good and ok2 and bool(r)
    return good, res, tail


def step_allreduce_bw(ctx):
    sizes = [1 << 20, 16 << 20, 64 << 20]
    ok, ceil, tail = _child(CEILING_CODE, 20)
    res = {"ceiling": ceil, "runs": {}}
    for ws in (2, 4):
        cfg = {"what": "allreduce", "ws": ws, "sizes": sizes, "iters": 5, "timeout": 50}
        ok2, r, t = _child(RANKS_CODE, _left(ctx, 60), args=(json.dumps(cfg),))
        for backend in ("mooncake", "mooncake_staged", "gloo"):
            rb = (r or {}).get(backend)
            res["runs"][f"{backend}/ws{ws}"] = rb
            ok = ok and ok2 and bool(rb and rb.get("correct"))
        # the IPC path was taken (and the forced one staged), and matched the references
        ipc = (r or {}).get("ipc_checks")
        res[f"ipc_checks/ws{ws}"] = ipc
        paths = (
            (r or {}).get("mooncake", {}).get("path"),
            (r or {}).get("mooncake_staged", {}).get("path"),
        )
        res[f"paths/ws{ws}"] = paths
        ok = (
            ok
            and bool(ipc)
            and not ipc.get("failed")
            and paths[0] == "ipc"
            and str(paths[1]).startswith("staging")
        )
        tail += t
    if ceil:
        for _name, r in res["runs"].items():
            if r:
                big = r.get(str(sizes[-1]), {})
                r["fraction_of_d2d_ceiling"] = big.get("busbw_GBps", 0) / ceil["d2d_copy_GBps"]
    mc, gl = res["runs"].get("mooncake/ws2"), res["runs"].get("gloo/ws2")
    if mc and gl:
        res["mooncake_over_gloo_ws2_64MiB"] = (
            mc[str(sizes[-1])]["busbw_GBps"] / gl[str(sizes[-1])]["busbw_GBps"]
        )
    st = res["runs"].get("mooncake_staged/ws2")
    if mc and st:
        res["ipc_over_staged_ws2_64MiB"] = (
            mc[str(sizes[-1])]["busbw_GBps"] / st[str(sizes[-1])]["busbw_GBps"]
        )
    return ok, res, tail


RUN = {
    "env": step_env,
    "build": step_build,
    "kernels": step_kernels,
    "conformance": step_conformance,
    "ep": step_ep,
    "ep_nvshmem": step_ep_nvshmem,
    "allreduce_bw": step_allreduce_bw,
}


def _torch_cuda_version():
    """``torch.version.cuda`` read in a child (importing torch here would slow every run),
    or None (a CPU build of torch, or no torch)."""
    try:
        r = subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.version.cuda)"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    v = r.stdout.strip().splitlines()[-1:] if r.returncode == 0 else []
    return v[0] if v and v[0] != "None" else None


def plan(ctx):
    """What each step would run, and whether this machine has what it needs."""
    cmd_b, env_b = build_cmd(ctx)
    cmd_c, env_c = conformance_cmd()
    tools = {
        "python": sys.executable,
        "torch": importlib.util.find_spec("torch") is not None,
        "triton": importlib.util.find_spec("triton") is not None,
        "pytest": importlib.util.find_spec("pytest") is not None,
        "setuptools": importlib.util.find_spec("setuptools") is not None,
        "ninja": shutil.which("ninja") is not None or importlib.util.find_spec("ninja") is not None,
        "nvcc": shutil.which("nvcc")
        or (os.path.exists("/usr/local/cuda/bin/nvcc") and "/usr/local/cuda/bin/nvcc")
        or None,
        "nvidia-smi": shutil.which("nvidia-smi"),
        "nvshmem4py": importlib.util.find_spec("nvshmem") is not None,  # optional: step ep_nvshmem
        "torch_cuda": _torch_cuda_version(),  # the CUDA version torch was built for (None: a CPU build)
    }
    files = [
        "setup.py",
        "tests/pg/test_conformance.py",
        "tests/ep/test_ep_triton.py",
        "csrc/transport/cuda/kernels.cu",
        "mooncake_ep/triton_kernels.py",
    ]
    missing_files = [f for f in files if not os.path.exists(os.path.join(REPO, f))]
    # the code the children run must at least compile
    for name, code in (
        ("ENV_CODE", ENV_CODE),
        ("KERNEL_CODE", KERNEL_CODE),
        ("EP_CODE", EP_CODE),
        ("RANKS_CODE", RANKS_CODE),
        ("CEILING_CODE", CEILING_CODE),
        ("NVSHMEM_CODE", NVSHMEM_CODE),
    ):
        compile(code, name, "exec")
    steps = [
        {
            "step": "env",
            "limit_s": LIMITS["env"],
            "runs": "torch/CUDA/Triton versions, GPU properties",
        },
        {"step": "build", "limit_s": LIMITS["build"], "runs": " ".join(cmd_b), "env": env_b},
        {
            "step": "kernels",
            "limit_s": LIMITS["kernels"],
            "runs": "_C._cuda_reduce vs torch; CUDA IPC reduction",
        },
        {
            "step": "conformance",
            "limit_s": LIMITS["conformance"],
            "runs": " ".join(cmd_c),
            "env": env_c,
        },
        {
            "step": "ep",
            "limit_s": LIMITS["ep"],
            "runs": "Triton kernels on CUDA vs test_ep_triton references; "
            "kernel latency; Buffer on CUDA tensors (LL, normal, fp8) vs CPU-staged, 2 ranks",
        },
        {
            "step": "ep_nvshmem",
            "limit_s": LIMITS["ep_nvshmem"],
            "runs": "Buffer low_latency_backend='nvshmem' vs 'group' on CUDA tensors, 1 and 2 ranks; "
            + (
                "nvshmem4py found"
                if tools["nvshmem4py"]
                else "skipped here: nvshmem4py-cu13 not installed"
            ),
        },
        {
            "step": "allreduce_bw",
            "limit_s": LIMITS["allreduce_bw"],
            "runs": "d2d copy ceiling; IPC all_reduce vs references; all_reduce busbw mooncake (IPC and staged) "
            "vs gloo on CUDA tensors, 2 and 4 ranks",
        },
    ]
    return {
        "steps": steps,
        "tools": tools,
        "missing_files": missing_files,
        "needs_on_gpu_machine": [
            k
            for k in (
                "torch",
                "torch_cuda",
                "nvcc",
                "nvidia-smi",
                "triton",
                "pytest",
                "setuptools",
                "ninja",
            )
            if not tools[k]
        ],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description="GPU checks of the CUDA paths (see the module docstring)."
    )
    ap.add_argument(
        "--dry-run", action="store_true", help="plan only: check tools and imports, run nothing"
    )
    ap.add_argument("--json", default=os.path.join(REPO, "bench_out", "gpu_checks.json"))
    ap.add_argument("--steps", default=",".join(STEPS), help=f"comma list out of {','.join(STEPS)}")
    ap.add_argument(
        "--skip-build", action="store_true", help="use the extension already built in place"
    )
    args = ap.parse_args(argv)
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        ap.error(f"unknown step(s) {unknown}; choose from {STEPS}")
    if args.skip_build and "build" in steps:
        steps.remove("build")
    if not steps:
        ap.error(
            f"no step to run (--steps {args.steps!r}{' with --skip-build' if args.skip_build else ''}); "
            f"choose from {STEPS}"
        )
    json_dir = os.path.dirname(os.path.abspath(args.json))
    try:  # a bad --json must fail now, not after six minutes of steps
        os.makedirs(json_dir, exist_ok=True)
        with open(args.json, "a"):
            pass
    except OSError as e:
        ap.error(f"--json {args.json!r} cannot be written: {e}")
    ctx = {"arch": "9.0", "deadline": time.monotonic() + DEADLINE_S}
    out = {
        "dry_run": args.dry_run,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": platform.node(),
        "steps": {},
    }
    t_all = time.perf_counter()
    if args.dry_run:
        p = plan(ctx)
        out["plan"] = p
        for s in p["steps"]:
            if s["step"] in steps:
                print(f"[gpu-checks] plan {s['step']:13s} (<= {s['limit_s']:4d} s): {s['runs']}")
        print(f"[gpu-checks] tools: {json.dumps(p['tools'])}")
        if p["needs_on_gpu_machine"]:
            print(
                f"[gpu-checks] not here (needed on the GPU machine): {', '.join(p['needs_on_gpu_machine'])}"
            )
        ok = not p["missing_files"] and p["tools"]["torch"]
        if p["missing_files"]:
            print(f"[gpu-checks] MISSING files: {p['missing_files']}")
    else:
        ok = True
        for s in steps:
            t0 = time.perf_counter()
            print(f"[gpu-checks] {s} ...", flush=True)
            try:
                good, res, tail = RUN[s](ctx)
            except Exception as e:  # a broken step is reported, the others still run
                good, res, tail = False, None, f"{type(e).__name__}: {e}"
            dt = time.perf_counter() - t0
            out["steps"][s] = {"ok": bool(good), "seconds": round(dt, 1), "result": res}
            if not good:
                out["steps"][s]["output_tail"] = tail[-6000:]
            print(
                f"[gpu-checks] {s}: {'ok' if good else 'FAILED'} in {dt:.1f} s {json.dumps(res)[:600]}",
                flush=True,
            )
            if not good:  # the reason, here too (the whole tail is in the JSON)
                why = [ln for ln in (tail or "").strip().splitlines() if ln.strip()][-3:]
                print("[gpu-checks]   " + "\n[gpu-checks]   ".join(why), flush=True)
            ok = ok and good
            if s in ("env", "build") and not good:
                print("[gpu-checks] later steps need this one: stopping", flush=True)
                break
    out["ok"] = bool(ok)
    out["seconds"] = round(time.perf_counter() - t_all, 1)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    print(f"[gpu-checks] {'ok' if ok else 'FAILED'} in {out['seconds']} s; wrote {args.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
