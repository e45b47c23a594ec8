"""``mooncake_ep`` on any device: the Triton data path and device checks of ``Buffer``.

* ``kernels="triton"`` (and ``MOONCAKE_EP_KERNELS=triton``) runs the Triton kernels on CPU
  tensors under ``TRITON_INTERPRET=1``: dispatch/combine (normal, cached, low-latency, fp8
  low-latency, backward) on 2 and 4 real rank processes, and ``ExpertParallelMoE``, equal
  ``kernels="torch"`` bit for bit.
* Inputs on a device the group cannot serve (``meta``; CUDA tensors on a CPU-only build,
  made as fake tensors here) or on mixed devices raise ``ValueError`` on every rank,
  naming op, rank, and expected vs got device, before anything is sent; the group still
  works afterwards.
* On a machine with CUDA and a CUDA build of ``mooncake_pg`` (``WITH_CUDA``), the same ops
  on CUDA tensors equal the CPU results; skipped otherwise.
"""

from __future__ import annotations

import pytest
import torch

from tests.ep import eputil

pytestmark = pytest.mark.timeout(300)

INTERP_ENV = {"TRITON_INTERPRET": "1", "TRITON_DEFAULT_FP_FUSION": "0"}


def _triton_importable():
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _scale(e):
    return float(e + 1)


def _ops(buf, rank, ws, dtype, seed, device="cpu"):
    """Every data-moving op of ``buf`` once; results moved to CPU, LL rows past
    ``recv_count`` (uninitialised by contract) left out."""
    E, K, H, T = 2 * ws, 3, 200, 9
    L = E // ws
    _, idx, w = eputil.make_inputs(rank, T + rank, H, E, K, dtype, seed, 0.2)
    # random values (not eputil's exact ones): sums round, so their order shows
    g = torch.Generator().manual_seed(100 * seed + rank)
    x = (torch.randn((T + rank, H), generator=g) * 3).to(dtype)
    w = torch.rand(w.shape, generator=g)
    x, idx, w = x.to(device), idx.to(device), w.to(device)
    xg = x.clone().requires_grad_(True)
    r = buf.dispatch(xg, topk_idx=idx, topk_weights=w, num_experts=E)
    y = eputil.scaled_experts_normal(
        r.recv_x.detach().cpu(),
        r.recv_topk_idx.cpu(),
        r.recv_topk_weights.detach().cpu(),
        rank,
        L,
        _scale,
    ).to(device)
    yg = y.clone().requires_grad_(True)
    c = buf.combine(yg, r.handle)
    (c.combined_x.float() * torch.arange(H, device=device).float()).sum().backward()
    loss = (r.recv_x.float() * 0.5).sum()
    loss.backward()
    cached = buf.dispatch(x * 2, handle=r.handle).recv_x
    Tm = T + ws
    ll = buf.low_latency_dispatch(x, idx, Tm, E)
    counts = ll.recv_count.cpu().tolist()
    y_ll = eputil.scaled_experts_ll(ll.recv_x.cpu(), rank, L, _scale).to(device)
    out_ll = buf.low_latency_combine(y_ll, idx, w, ll.handle).combined_x
    q = buf.low_latency_dispatch(x, idx, Tm, E, use_fp8=True)
    qx, qs = q.recv_x
    res = {
        "recv_x": r.recv_x,
        "recv_idx": r.recv_topk_idx,
        "recv_w": r.recv_topk_weights,
        "combined": c.combined_x,
        "grad_x": xg.grad,
        "grad_y": yg.grad,
        "cached": cached,
        "ll_count": ll.recv_count,
        "out_ll": out_ll,
        "fp8_count": q.recv_count,
    }
    for l, n in enumerate(counts):
        res[f"ll_x{l}"] = ll.recv_x[l, :n]
        res[f"fp8_q{l}"] = qx[l, :n].contiguous().view(torch.uint8)
        res[f"fp8_s{l}"] = qs[l, :n]
    assert all(v is not None for v in res.values()), [k for k, v in res.items() if v is None]
    devices = {k: str(v.device) for k, v in res.items()}
    return {k: v.detach().cpu() for k, v in res.items()}, devices


def rank_triton_vs_torch(rank, ws):
    import os
    import sys

    import mooncake_ep
    from mooncake_ep import kernels as K_

    out = {"loaded_before": "mooncake_ep.triton_kernels" in sys.modules}
    b_torch = mooncake_ep.Buffer(config=mooncake_ep.EPConfig(kernels="torch"))
    b_triton = mooncake_ep.Buffer(config=mooncake_ep.EPConfig(kernels="triton"))
    os.environ["MOONCAKE_EP_KERNELS"] = "triton"
    try:
        b_env = mooncake_ep.Buffer()
    finally:
        del os.environ["MOONCAKE_EP_KERNELS"]
    for name in ("bfloat16", "float32"):
        dt = getattr(torch, name)
        ref, _ = _ops(b_torch, rank, ws, dt, 5)
        out.setdefault("loaded_after_torch", "mooncake_ep.triton_kernels" in sys.modules)
        got, devs = _ops(b_triton, rank, ws, dt, 5)
        env_got, _ = _ops(b_env, rank, ws, dt, 5)
        out[name] = {"ref": ref, "got": got, "env": env_got, "devices": devs}
    # nothing routed anywhere (every slot -1): empty rows, combine gives zeros on both paths
    none_idx = torch.full((5, 2), -1, dtype=torch.int64)
    xz = torch.randn(5, 16)
    for name, b in (("torch", b_torch), ("triton", b_triton)):
        r = b.dispatch(xz, topk_idx=none_idx, num_experts=2 * ws)
        out[f"empty_{name}"] = (tuple(r.recv_x.shape), b.combine(r.recv_x, r.handle).combined_x)
        ll = b.low_latency_dispatch(xz, none_idx, 5, 2 * ws)
        out[f"empty_ll_{name}"] = b.low_latency_combine(
            ll.recv_x, none_idx, torch.ones(5, 2), ll.handle
        ).combined_x
    out["loaded_after_triton"] = "mooncake_ep.triton_kernels" in sys.modules
    probe = torch.zeros(2, 2)
    out["use"] = {k: K_._use_triton(probe, k) for k in ("auto", "torch", "triton")}
    # the normal combine's Triton path applies to these inputs (not a silent fallback)
    out["combine_triton"] = (
        K_.sum_rows_by_table(probe, torch.tensor([[0, 1]]), kernels="triton") is not None
    )
    return out


def _bits(t):
    return (
        t.contiguous().view(torch.uint8) if t.is_floating_point() and t.element_size() == 1 else t
    )


@pytest.mark.skipif(not _triton_importable(), reason="triton is not importable")
@pytest.mark.parametrize("ws", [2, 4])
def test_triton_kernels_match_torch_under_interpreter(pool_factory, ws):
    """kernels="triton" (EPConfig or MOONCAKE_EP_KERNELS) on CPU tensors with
    TRITON_INTERPRET=1: dispatch + combine (with backward), cached dispatch, low-latency
    dispatch + combine and fp8 low-latency dispatch equal kernels="torch" bit for bit
    (bf16 and float32, 2 and 4 ranks: up to 4 rows per token in the normal combine);
    "auto" keeps CPU tensors on torch ops."""
    res = pool_factory(ws, env=INTERP_ENV).run(rank_triton_vs_torch, timeout=240)
    for r in range(ws):
        o = res[r]
        assert o["use"] == {"auto": False, "torch": False, "triton": True}, o["use"]
        assert o["combine_triton"]
        for name in ("torch", "triton"):
            shape, comb = o[f"empty_{name}"]
            assert shape == (0, 16) and torch.equal(comb, torch.zeros(5, 16)), (r, name)
            assert torch.equal(o[f"empty_ll_{name}"], torch.zeros(5, 16)), (r, name)
        assert not o["loaded_before"] and not o["loaded_after_torch"], (
            "torch kernels imported Triton's"
        )
        assert o["loaded_after_triton"], "the Triton kernels were never imported"
        for name in ("bfloat16", "float32"):
            ref, got, env_got = o[name]["ref"], o[name]["got"], o[name]["env"]
            assert set(ref) == set(got) == set(env_got)
            assert set(o[name]["devices"].values()) == {"cpu"}
            assert any(k.startswith("fp8_q") and v.numel() for k, v in ref.items()), (
                "no fp8 rows moved"
            )
            for k in ref:
                for label, g in (("triton", got[k]), ("env", env_got[k])):
                    assert g.dtype == ref[k].dtype and g.shape == ref[k].shape, (r, name, k, label)
                    assert torch.equal(_bits(g), _bits(ref[k])), (
                        f"rank {r} {name} {k} ({label}) differs"
                    )


def rank_moe_triton_vs_torch(rank, ws):
    import mooncake_ep

    H, E, K, F, T = 40, 2 * ws, 2, 24, 7
    out = {}
    for kern in ("torch", "triton"):
        gate, experts = eputil.build_model(H, E, K, F, "masked", seed=4)
        buf = mooncake_ep.Buffer(config=mooncake_ep.EPConfig(kernels=kern))
        moe = mooncake_ep.ExpertParallelMoE(gate, experts, buffer=buf)
        g = torch.Generator().manual_seed(rank)
        x = torch.randn((T + rank, H), generator=g).requires_grad_()
        y = moe(x)
        (y * torch.arange(H).float()).sum().backward()
        out[kern] = {
            "y": y.detach(),
            "gx": x.grad,
            "grads": [p.grad for ex in moe.experts for p in ex.parameters()],
        }
    return out


@pytest.mark.skipif(not _triton_importable(), reason="triton is not importable")
def test_moe_triton_matches_torch_under_interpreter(pool_factory):
    """ExpertParallelMoE forward and backward with a Buffer of kernels="triton" (CPU
    tensors, TRITON_INTERPRET=1) equal kernels="torch" bit for bit: output, input gradient
    and the local experts' gradients (2 ranks, a router with -1 slots)."""
    ws = 2
    res = pool_factory(ws, env=INTERP_ENV).run(rank_moe_triton_vs_torch, timeout=240)
    for r in range(ws):
        a, b = res[r]["torch"], res[r]["triton"]
        assert torch.equal(a["y"], b["y"]) and torch.equal(a["gx"], b["gx"]), r
        assert len(a["grads"]) == len(b["grads"]) > 0
        for ga, gb in zip(a["grads"], b["grads"]):
            assert (ga is None and gb is None) or torch.equal(ga, gb), r


def rank_device_errors(rank, ws):
    from torch._subclasses.fake_tensor import FakeTensorMode

    import mooncake_ep
    import mooncake_pg

    buf = mooncake_ep.Buffer()
    E, K, H = 2 * ws, 2, 16
    x, idx, w = eputil.make_inputs(rank, 4, H, E, K)
    r = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    ll = buf.low_latency_dispatch(x, idx, 4, E)
    meta = torch.device("meta")
    cases = {
        "x_meta": lambda: buf.dispatch(x.to(meta), topk_idx=idx.to(meta), num_experts=E),
        "x_meta_rank1": lambda: buf.dispatch(
            x.to(meta) if rank == 1 else x, topk_idx=idx, num_experts=E
        ),
        "idx_mixed": lambda: buf.dispatch(x, topk_idx=idx.to(meta), topk_weights=w, num_experts=E),
        "w_mixed": lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w.to(meta), num_experts=E),
        "combine_meta": lambda: buf.combine(r.recv_x.to(meta), r.handle),
        "cached_meta": lambda: buf.dispatch(x.to(meta), handle=r.handle),
        "ll_idx_mixed": lambda: buf.low_latency_dispatch(x, idx.to(meta), 4, E),
        "ll_combine_w_mixed": lambda: buf.low_latency_combine(
            ll.recv_x, idx, w.to(meta), ll.handle
        ),
        "ll_combine_out_mixed": lambda: buf.low_latency_combine(
            ll.recv_x, idx, w, ll.handle, out=torch.empty((4, H), device=meta)
        ),
    }
    if not mooncake_pg.WITH_CUDA:
        # CUDA tensors on a CPU-only build: fake CUDA tensors (no GPU needed); the check
        # looks at the device before touching any data.
        with FakeTensorMode():
            xc = torch.empty((4, H), device="cuda")
            ic = torch.zeros((4, K), dtype=torch.int64, device="cuda")
        cases["cuda_on_cpu_build"] = lambda: buf.dispatch(xc, topk_idx=ic, num_experts=E)
        cases["ll_cuda_on_cpu_build"] = lambda: buf.low_latency_dispatch(xc, ic, 4, E)
    out = {}
    for name, fn in cases.items():
        try:
            fn()
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    # the group still works: a normal round trip afterwards
    r2 = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    out["after"] = buf.combine(r2.recv_x, r2.handle).combined_x
    out["with_cuda"] = mooncake_pg.WITH_CUDA
    return out


def test_device_errors_raise_everywhere(pool_factory):
    """Tensors on a device the group's backend does not serve (meta; CUDA on a CPU-only
    build) or inputs on mixed devices raise ValueError on every rank before anything is
    sent; the message names the op, the rank and the expected vs actual device; a round
    trip afterwards works."""
    ws = 2
    res = pool_factory(ws).run(rank_device_errors, timeout=90)
    for r in range(ws):
        o = res[r]
        x, idx, _w = eputil.make_inputs(r, 4, 16, 2 * ws, 2)
        # identity experts: each token comes back once per rank it went to
        in_rank = torch.zeros((4, ws), dtype=torch.bool)
        for t in range(4):
            for e in idx[t].tolist():
                in_rank[t, e // 2] = True
        exp = x * in_rank.sum(1, keepdim=True)
        assert torch.equal(o["after"], exp), r
        for name, msg in o.items():
            if name in ("after", "with_cuda"):
                continue
            assert msg is not None, f"rank {r}: {name} did not raise"
            op = "low_latency_" if name.startswith("ll_") else ""
            op += "combine" if "combine" in name else "dispatch"
            assert f"mooncake_ep {op} (rank {r})" in msg and "nothing was sent" in msg, (name, msg)
        assert (
            "x is on meta, expected a device the group's backend" in o["x_meta"]
            and "cpu" in o["x_meta"]
        )
        if r == 1:
            assert "x is on meta" in o["x_meta_rank1"]
        else:
            assert "rank(s) [1] passed invalid arguments" in o["x_meta_rank1"], o["x_meta_rank1"]
        assert "topk_idx is on meta, expected cpu (x's device)" in o["idx_mixed"], o["idx_mixed"]
        assert "topk_weights is on meta, expected cpu" in o["w_mixed"], o["w_mixed"]
        assert "x is on meta" in o["combine_meta"] and "x is on meta" in o["cached_meta"]
        assert "topk_idx is on meta, expected cpu" in o["ll_idx_mixed"]
        assert "topk_weights is on meta, expected cpu" in o["ll_combine_w_mixed"]
        assert "out is on meta, expected cpu" in o["ll_combine_out_mixed"]
        if not o["with_cuda"]:
            for name in ("cuda_on_cpu_build", "ll_cuda_on_cpu_build"):
                assert "x is on cuda:0, expected a device the group's backend" in o[name], o[name]
                assert "mooncake_pg.WITH_CUDA is False" in o[name], o[name]


# ------------------------------------------------------------------ on a GPU


def _gpu_ready():
    return eputil.gpu_missing()


def rank_cuda_vs_cpu(rank, ws, kernels):
    import mooncake_ep

    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    cfg = mooncake_ep.EPConfig(kernels=kernels)
    cpu, _ = _ops(
        mooncake_ep.Buffer(config=mooncake_ep.EPConfig(kernels="torch")),
        rank,
        ws,
        torch.bfloat16,
        9,
    )
    gpu, devs = _ops(mooncake_ep.Buffer(config=cfg), rank, ws, torch.bfloat16, 9, device=dev)
    return {"cpu": cpu, "gpu": gpu, "devices": devs, "dev": str(dev)}


@pytest.mark.skipif(_gpu_ready() is not None, reason=str(_gpu_ready()))
@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_cuda_tensors_match_cpu(pool_factory, kernels):
    """On a GPU with a CUDA build: every op on CUDA tensors (torch ops or the compiled
    Triton kernels) returns CUDA tensors equal to the CPU path bit for bit (2 ranks: a
    token has at most two rows to sum in normal mode), the low-latency combine within one
    bf16 rounding (CUDA's index_add_ sums a token's K weighted rows in no fixed order)."""
    ws = 2
    res = pool_factory(ws).run(rank_cuda_vs_cpu, kernels, timeout=240)
    for r in range(ws):
        o = res[r]
        assert set(o["devices"].values()) == {o["dev"]}, o["devices"]
        for k in o["cpu"]:
            if (
                k == "out_ll"
            ):  # up to K weighted rows per token: CUDA's index_add_ adds them in any order
                torch.testing.assert_close(
                    o["gpu"][k].float(), o["cpu"][k].float(), rtol=2**-7, atol=1e-6
                )
                continue
            assert torch.equal(_bits(o["gpu"][k]), _bits(o["cpu"][k])), (
                f"rank {r} {k} differs on CUDA"
            )
