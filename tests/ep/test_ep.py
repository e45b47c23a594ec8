"""Expert parallelism (``mooncake_ep``) on real rank processes (the cached rank pool):
dispatch/combine and the low-latency pair against float64 references, fp8 dispatch,
autograd of every op (input and top-k weight gradients), header checks, and
``ExpertParallelMoE`` forward/backward against a single-process reference MoE.

Every rank builds every rank's inputs from seeds, so each computes the references on its
own (no communication in the reference path).
"""

from __future__ import annotations

import pytest
import torch

from tests import REPO_ROOT
from tests.ep import eputil

pytestmark = pytest.mark.timeout(180)


def times_e_plus_one(e):
    return float(e + 1)


# ========================================================== dispatch/combine values


def rank_roundtrip(rank, ws, dtype_name, T, H, E, K, masked, seed):
    import mooncake_ep

    dtype = getattr(torch, dtype_name)
    buf = mooncake_ep.Buffer()
    L = E // ws
    x, idx, w = eputil.make_inputs(rank, T + 3 * rank, H, E, K, dtype, seed, masked)
    r = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    y = eputil.scaled_experts_normal(
        r.recv_x, r.recv_topk_idx, r.recv_topk_weights, rank, L, times_e_plus_one
    )
    out = buf.combine(y, r.handle).combined_x
    # a cached dispatch of other data on the same handle moves the same rows
    r2 = buf.dispatch(x * 2, handle=r.handle)
    ll = buf.low_latency_dispatch(x, idx, T + 3 * ws, E)
    # DeepEP's unpacking: (combined_x, event, hook)
    out_ll, ll_event, ll_hook = buf.low_latency_combine(
        eputil.scaled_experts_ll(ll.recv_x, rank, L, times_e_plus_one), idx, w, ll.handle
    )
    # out= writes into the caller's tensor and hands it back as combined_x
    dst = torch.full((x.shape[0], H), 7.0, dtype=dtype)
    res_out = buf.low_latency_combine(
        eputil.scaled_experts_ll(ll.recv_x, rank, L, times_e_plus_one), idx, w, ll.handle, out=dst
    )
    llq = buf.low_latency_dispatch(x, idx, T + 3 * ws, E, use_fp8=True)
    q, s = llq.recv_x
    deq = mooncake_ep.fp8_dequantize(q, s, torch.float32)
    return {
        "out": out,
        "out_ll": out_ll,
        "recv_x": r.recv_x,
        "recv_idx": r.recv_topk_idx,
        "recv_w": r.recv_topk_weights,
        "cached": r2.recv_x,
        "counts": r.num_recv_tokens_per_expert_list,
        "ll_x": ll.recv_x,
        "ll_count": ll.recv_count,
        "fp8_shapes": (tuple(q.shape), tuple(s.shape), q.dtype, s.dtype),
        "fp8_deq": deq,
        "fp8_count": llq.recv_count,
        "ll_result": (type(res_out).__name__, res_out._fields, ll_event, ll_hook),
        "ll_out_is_dst": res_out.combined_x is dst,
        "ll_out": dst,
    }


def expected_receive(ws, rank, T, H, E, K, dtype, seed, masked):
    """What rank ``rank`` should receive: rows in source order, then token order."""
    L = E // ws
    rows, idxs, ws_, per_expert = [], [], [], [0] * L
    ll = [[] for _ in range(L)]
    for s in range(ws):
        x, idx, w = eputil.make_inputs(s, T + 3 * s, H, E, K, dtype, seed, masked)
        for t in range(x.shape[0]):
            loc = [int(e) - rank * L if rank * L <= int(e) < (rank + 1) * L else -1 for e in idx[t]]
            if any(l >= 0 for l in loc):
                rows.append(x[t])
                idxs.append(loc)
                ws_.append([float(w[t, k]) if loc[k] >= 0 else 0.0 for k in range(K)])
                for l in {l for l in loc if l >= 0}:
                    per_expert[l] += 1
                    ll[l].append(x[t])
    recv_x = torch.stack(rows) if rows else torch.zeros((0, H), dtype=dtype)
    return (
        recv_x,
        torch.tensor(idxs, dtype=torch.int64).reshape(-1, K),
        torch.tensor(ws_, dtype=torch.float32).reshape(-1, K),
        per_expert,
        ll,
    )


@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("dtype_name,masked", [("bfloat16", 0.0), ("float32", 0.3)])
def test_dispatch_combine_random_routing(pool_factory, ws, dtype_name, masked):
    """Random routing (rank-dependent tokens and ids, some -1 slots): recv_x/recv_topk_idx/
    recv_topk_weights/counts equal an independent computation of what each rank must
    receive; combine of the weighted expert outputs and the low-latency round trip equal
    the float64 reference; a cached dispatch moves the same rows; fp8 dispatch lands
    within e4m3 precision (one scale per 128 channels, H=200 leaves a short last block)."""
    T, H, E, K, seed = 9, 200, 4 * ws, 3, 5
    dtype = getattr(torch, dtype_name)
    res = pool_factory(ws).run(rank_roundtrip, dtype_name, T, H, E, K, masked, seed, timeout=60)
    L = E // ws
    for r in range(ws):
        o = res[r]
        x, idx, w = eputil.make_inputs(r, T + 3 * r, H, E, K, dtype, seed, masked)
        exp = eputil.ref_scaled_moe(x, idx, w, times_e_plus_one)
        tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(
            o["out"].double(), exp, **tol, msg=lambda m: f"rank {r} normal: {m}"
        )
        torch.testing.assert_close(
            o["out_ll"].double(), exp, **tol, msg=lambda m: f"rank {r} low latency: {m}"
        )
        assert o["ll_result"] == (
            "LowLatencyCombineResult",
            ("combined_x", "event", "hook"),
            None,
            None,
        ), o["ll_result"]
        assert o["ll_out_is_dst"] and torch.equal(o["ll_out"], o["out_ll"]), f"rank {r}: out="
        rx, ridx, rw, per_expert, ll_rows = expected_receive(ws, r, T, H, E, K, dtype, seed, masked)
        assert torch.equal(o["recv_x"], rx), f"rank {r}: recv_x differs"
        assert torch.equal(o["recv_idx"], ridx), (
            f"rank {r}: recv_topk_idx {o['recv_idx']} vs {ridx}"
        )
        assert torch.equal(o["recv_w"], rw), f"rank {r}: recv_topk_weights"
        assert torch.equal(o["cached"], rx * 2), f"rank {r}: cached dispatch"
        assert o["counts"] == per_expert and o["ll_count"].tolist() == per_expert, (
            o["counts"],
            per_expert,
        )
        assert o["ll_count"].dtype == torch.int32
        WT = ws * (T + 3 * ws)
        assert tuple(o["ll_x"].shape) == (L, WT, H)
        for l in range(L):
            n = per_expert[l]
            want = torch.stack(ll_rows[l]) if n else torch.zeros((0, H), dtype=dtype)
            assert torch.equal(o["ll_x"][l, :n], want), f"rank {r} expert {l}: packed rows differ"
        nb = (H + 127) // 128
        assert o["fp8_shapes"] == ((L, WT, H), (L, WT, nb), torch.float8_e4m3fn, torch.float32), o[
            "fp8_shapes"
        ]
        assert torch.equal(o["fp8_count"], o["ll_count"])
        for l in range(L):
            n = per_expert[l]
            if n:
                want = torch.stack(ll_rows[l]).float()
                # e4m3: 3 mantissa bits -> relative error <= 2^-4 of the block's values
                amax = want.abs().max()
                torch.testing.assert_close(
                    o["fp8_deq"][l, :n], want, rtol=0.0625, atol=float(amax) * 2**-9 + 1e-6
                )


# ===================================================================== autograd


def rank_autograd(rank, ws, T, H, E, K, seed):
    import mooncake_ep

    buf = mooncake_ep.Buffer()
    L = E // ws
    out = {}
    for mode in ("normal", "low_latency"):
        x, idx, w = eputil.make_inputs(rank, T + rank, H, E, K, torch.float64, seed, 0.25)
        x = x.requires_grad_()
        w = w.requires_grad_()
        G = eputil.make_inputs(rank + 50, T + rank, H, E, K, torch.float64, seed)[0]
        if mode == "normal":
            r = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
            y = eputil.scaled_experts_normal(
                r.recv_x, r.recv_topk_idx, r.recv_topk_weights, rank, L, times_e_plus_one
            )
            o = buf.combine(y, r.handle).combined_x
        else:
            ll = buf.low_latency_dispatch(x, idx, T + ws, E)
            y = eputil.scaled_experts_ll(ll.recv_x, rank, L, times_e_plus_one)
            o = buf.low_latency_combine(y, idx, w.float(), ll.handle).combined_x
        (o.double() * G).sum().backward()
        out[mode] = {"gx": x.grad, "gw": w.grad}
    # combine's own topk_weights path: d combined_topk_weights / d recv weights
    x, idx, w = eputil.make_inputs(rank, T, H, E, K, torch.float32, seed, 0.25)
    w = w.requires_grad_()
    r = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    c = buf.combine(r.recv_x, r.handle, topk_weights=r.recv_topk_weights)
    (c.combined_topk_weights * torch.arange(K, dtype=torch.float32)).sum().backward()
    out["combine_w"] = {
        "gw": w.grad,
        "combined_w": c.combined_topk_weights.detach(),
        "w": w.detach(),
        "idx": idx,
    }
    return out


@pytest.mark.parametrize("ws", [2, 4])
def test_autograd_matches_reference(pool_factory, ws):
    """Gradients of x and topk_weights through dispatch -> caller-weighted experts ->
    combine, and through low_latency_dispatch -> experts -> low_latency_combine (weights
    applied there), equal autograd of the float64 reference; combine's topk_weights
    round trip returns each slot's weight (0 for -1 slots) and its gradient."""
    T, H, E, K, seed = 7, 24, 2 * ws, 3, 11
    res = pool_factory(ws).run(rank_autograd, T, H, E, K, seed, timeout=60)
    for r in range(ws):
        x, idx, w = eputil.make_inputs(r, T + r, H, E, K, torch.float64, seed, 0.25)
        x.requires_grad_()
        w64 = w.double().requires_grad_()
        G = eputil.make_inputs(r + 50, T + r, H, E, K, torch.float64, seed)[0]
        ref = torch.zeros_like(x)
        for k in range(K):
            e = idx[:, k]
            f = torch.where(e >= 0, (e + 1).double(), torch.zeros_like(e, dtype=torch.float64))
            ref = ref + (w64[:, k] * f).unsqueeze(1) * x
        (ref * G).sum().backward()
        for mode in ("normal", "low_latency"):
            got = res[r][mode]
            torch.testing.assert_close(
                got["gx"], x.grad, rtol=1e-5, atol=1e-5, msg=lambda m: f"rank {r} {mode} dx: {m}"
            )
            torch.testing.assert_close(
                got["gw"].double(),
                w64.grad,
                rtol=1e-5,
                atol=1e-4,
                msg=lambda m: f"rank {r} {mode} dw: {m}",
            )
        cw = res[r]["combine_w"]
        mask = (cw["idx"] >= 0).float()
        assert torch.equal(cw["combined_w"], cw["w"] * mask), (cw["combined_w"], cw["w"])
        exp_g = torch.arange(K, dtype=torch.float32).expand_as(mask) * mask
        assert torch.equal(cw["gw"], exp_g), (cw["gw"], exp_g)


# ================================================================ header checks


def rank_mismatch(rank, ws, what):
    import mooncake_ep

    buf = mooncake_ep.Buffer()
    E, H = 2 * ws, 8
    x, idx, w = eputil.make_inputs(rank, 4, H, E, 2)
    try:
        if what == "num_experts":
            buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E if rank == 0 else 4 * ws)
        elif what == "dtype":
            buf.dispatch(
                x if rank == 0 else x.double(), topk_idx=idx, topk_weights=w, num_experts=E
            )
        elif what == "weights_dtype":
            buf.dispatch(
                x, topk_idx=idx, topk_weights=w if rank == 0 else w.double(), num_experts=E
            )
        elif what == "t_max":
            buf.low_latency_dispatch(x, idx, 4 if rank == 0 else 8, E)
        elif what == "too_many_tokens":
            buf.low_latency_dispatch(x, idx, 4 if rank == 0 else 3, E)
        elif what == "combine_shape":
            r = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
            y = r.recv_x if rank == 0 else r.recv_x[:, :4]
            buf.combine(y, r.handle)
        return None
    except ValueError as e:
        return str(e)


@pytest.mark.parametrize(
    "what", ["num_experts", "dtype", "weights_dtype", "t_max", "too_many_tokens", "combine_shape"]
)
def test_bad_or_disagreeing_arguments_raise_everywhere(pool_factory, what):
    """A rank's bad argument or ranks that disagree (E, dtype, T_max, shapes) make every
    rank raise ValueError naming the op and the offending rank; the pool's health check
    afterwards shows the group still works."""
    ws = 2
    res = pool_factory(ws).run(rank_mismatch, what, timeout=60)
    for r in range(ws):
        assert res[r] is not None and f"(rank {r})" in res[r] and "mooncake_ep" in res[r], (
            r,
            res[r],
        )
        if r == 0:
            assert "1" in res[r], res[r]
        if what == "dtype":  # dtype names, not the header's codes
            assert (
                "dtype=float32" in res[r] and "rank 1: " in res[r] and "dtype=float64" in res[r]
            ), res[r]


def rank_ll_dtypes(rank, ws):
    import mooncake_ep

    E, K, H, T = 2 * ws, 2, 136, 5
    L = E // ws
    buf = mooncake_ep.Buffer()
    out = {}
    for name in ("float16", "float64", "bfloat16", "float32"):
        x, idx, w = eputil.make_inputs(rank, T, H, E, K, getattr(torch, name), 17, 0.2)
        ll = buf.low_latency_dispatch(x, idx, T, E)
        y = eputil.scaled_experts_ll(ll.recv_x, rank, L, times_e_plus_one)
        q = buf.low_latency_dispatch(x, idx, T, E, use_fp8=True)
        deq = mooncake_ep.fp8_dequantize(*q.recv_x, dtype=torch.float32)
        out[name] = {
            "out": buf.low_latency_combine(y, idx, w, ll.handle).combined_x,
            "fp8_rows": sum(ll.recv_count.tolist()),
            "close": [
                bool(torch.allclose(ll.recv_x[l, :n].float(), deq[l, :n], rtol=0.0625, atol=1e-3))
                for l, n in enumerate(ll.recv_count.tolist())
            ],
        }
    return out


def test_low_latency_dtypes(pool_factory):
    """The low-latency pair takes every dtype its docstring lists (float32, bfloat16,
    float16, float64) and returns combined_x in it, equal to the float64 reference; fp8
    dispatch works from each (dequantized rows within e4m3 precision of the packed rows)."""
    ws = 2
    res = pool_factory(ws).run(rank_ll_dtypes, timeout=60)
    for r in range(ws):
        for name, o in res[r].items():
            x, idx, w = eputil.make_inputs(r, 5, 136, 2 * ws, 2, getattr(torch, name), 17, 0.2)
            exp = eputil.ref_scaled_moe(x, idx, w, times_e_plus_one)
            assert o["out"].dtype == getattr(torch, name)
            tol = (
                dict(rtol=1e-6, atol=1e-6)
                if name in ("float32", "float64")
                else dict(rtol=1e-2, atol=1e-2)
            )
            torch.testing.assert_close(
                o["out"].double(), exp, **tol, msg=lambda m: f"rank {r} {name}: {m}"
            )
            assert o["fp8_rows"] > 0 and all(o["close"]), (r, name, o)


def test_fp8_quantize_rejects_non_2d():
    """fp8_quantize takes [N, H]; a 1-D (or 3-D, or integer) input gets a ValueError that
    says so, instead of a tuple-unpacking error."""
    import mooncake_ep

    for bad in (torch.ones(256), torch.ones(2, 3, 128), torch.ones(4, 128, dtype=torch.int32)):
        with pytest.raises(
            ValueError, match=r"fp8_quantize: x must be a 2-D floating-point tensor \[N, H\]"
        ):
            mooncake_ep.fp8_quantize(bad)
    q, s = mooncake_ep.fp8_quantize(torch.ones(3, 130))
    assert q.shape == (3, 130) and s.shape == (3, 2)
    assert torch.equal(mooncake_ep.fp8_dequantize(q, s, torch.float32), torch.ones(3, 130))


def test_ep_bench_help():
    """``benchmarks/ep_bench.py --help`` prints its one-line description once (the rest of
    the module docstring as the epilog), without issue numbers."""
    import os
    import subprocess
    import sys

    root = REPO_ROOT
    p = subprocess.run(
        [sys.executable, os.path.join(root, "benchmarks", "ep_bench.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("MoE dispatch + combine round trip on CPU") == 1, p.stdout
    assert "issue" not in p.stdout and "--smoke" in p.stdout and "Output:" in p.stdout, p.stdout


# ====================================================================== the MoE

MOE_MODES = ["logits", "topk", "skew", "masked", "dup"]


def rank_moe(rank, ws, H, E, K, F, T, dtype_name):
    import torch.distributed as dist

    import mooncake_ep

    dtype = getattr(torch, dtype_name)
    out = {}
    for mode in MOE_MODES:
        gate, experts = eputil.build_model(H, E, K, F, mode, seed=3)
        gate, experts = gate.to(dtype), [e.to(dtype) for e in experts]
        moe = mooncake_ep.ExpertParallelMoE(gate, experts, top_k=K if mode == "logits" else None)
        L = E // ws
        x = eputil.make_inputs(rank, T + 2 * rank, H, E, K, dtype, seed=9)[0].requires_grad_()
        G = eputil.make_inputs(rank + 77, T + 2 * rank, H, E, K, dtype, seed=9)[0]
        y = moe(x)
        (y.float() * G.float()).sum().backward()
        gate_grad = gate.proj.weight.grad.clone()
        dist.all_reduce(gate_grad)  # data-parallel gate: sum over ranks
        out[mode] = {
            "y": y.detach(),
            "gx": x.grad,
            "expert_grads": {
                rank * L + l: [
                    p.grad.clone() if p.grad is not None else None for p in ex.parameters()
                ]
                for l, ex in enumerate(moe.experts)
            },
            "gate_grad": gate_grad,
        }
        # inference: no_grad gives the same output
        with torch.no_grad():
            out[mode]["y_eval"] = moe(x.detach())
    return out


@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("dtype_name", ["float32"])
def test_moe_matches_single_process_reference(pool_factory, ws, dtype_name):
    """ExpertParallelMoE at W=2 and W=4, routing modes logits (the wrapper routes: softmax
    + top-k), topk (random), skew (every token to expert 1), masked (-1 slots), dup (an
    expert named twice): forward output, input
    gradient, every expert's parameter gradients (on its owner) and the gate gradient
    (summed over ranks) equal a single-process MoE with the same weights over all ranks'
    tokens; no_grad inference gives the same output."""
    H, E, K, F, T = 16, 2 * ws, 2, 24, 6
    dtype = getattr(torch, dtype_name)
    res = pool_factory(ws).run(rank_moe, H, E, K, F, T, dtype_name, timeout=90)
    tol = dict(rtol=1e-4, atol=1e-5)
    for mode in MOE_MODES:
        gate, experts = eputil.build_model(H, E, K, F, mode, seed=3)
        xs = [
            eputil.make_inputs(r, T + 2 * r, H, E, K, dtype, seed=9)[0].requires_grad_()
            for r in range(ws)
        ]
        Gs = [eputil.make_inputs(r + 77, T + 2 * r, H, E, K, dtype, seed=9)[0] for r in range(ws)]
        ys = [eputil.ref_moe(gate, experts, x) for x in xs]
        sum((y * G).sum() for y, G in zip(ys, Gs)).backward()
        for r in range(ws):
            o = res[r][mode]
            torch.testing.assert_close(
                o["y"], ys[r].detach(), **tol, msg=lambda m: f"{mode} rank {r} forward: {m}"
            )
            torch.testing.assert_close(
                o["y_eval"], ys[r].detach(), **tol, msg=lambda m: f"{mode} rank {r} eval: {m}"
            )
            torch.testing.assert_close(
                o["gx"], xs[r].grad, **tol, msg=lambda m: f"{mode} rank {r} dx: {m}"
            )
            torch.testing.assert_close(
                o["gate_grad"],
                gate.proj.weight.grad,
                **tol,
                msg=lambda m: f"{mode} rank {r} gate grad: {m}",
            )
            for e, grads in o["expert_grads"].items():
                for p, g in zip(experts[e].parameters(), grads):
                    if p.grad is None:
                        assert g is None or not g.any(), (
                            f"{mode}: expert {e} got a gradient it should not have"
                        )
                        continue
                    torch.testing.assert_close(
                        g, p.grad, **tol, msg=lambda m: f"{mode} expert {e} grad: {m}"
                    )
        if mode == "skew":
            # the skewed case really puts every token on one expert
            assert all(experts[e].up.weight.grad is None for e in range(E) if e != 1)


def rank_moe_validation(rank, ws):
    from torch import nn

    import mooncake_ep

    H, E, K, F, T = 8, 2 * ws, 2, 8, 5
    gate, experts = eputil.build_model(H, E, K, F, "logits", seed=6)
    errs = {}

    def expect(name, build, forward=False):
        try:
            moe = build()
            if forward:
                moe(torch.zeros(T, H))
            errs[name] = None
        except ValueError as e:
            errs[name] = str(e)

    Moe = mooncake_ep.ExpertParallelMoE
    # construction: a Linear gate's width is known at once
    expect("linear_width", lambda: Moe(nn.Linear(H, E - 1, bias=False), experts, top_k=K))
    expect(
        "linear_all_with_2E",
        lambda: Moe(nn.Linear(H, E, bias=False), experts, num_experts=2 * E, top_k=K),
    )
    for k in (0, -1, E + 1):
        expect(f"top_k={k}", lambda: Moe(gate, experts, top_k=k))
    # first forward: widths of other gates, K of a tuple-returning gate
    expect(
        "logits_width",
        lambda: Moe(eputil.Gate(H, E + 1, K, "logits"), experts, top_k=K),
        forward=True,
    )
    expect(
        "logits_all_with_2E", lambda: Moe(gate, experts, num_experts=2 * E, top_k=K), forward=True
    )
    expect("tuple_k", lambda: Moe(eputil.Gate(H, E, K, "topk"), experts, top_k=K + 1), forward=True)
    # the group is untouched by all that: valid layers give the reference values, also
    # with this rank's experts only (num_experts= given, Linear gate of width E)
    L = E // ws
    x = eputil.make_inputs(rank, T + rank, H, E, K, torch.float32, seed=13)[0]
    with torch.no_grad():
        y_all = Moe(gate, experts, top_k=K)(x)
        y_local = Moe(gate.proj, experts[rank * L : (rank + 1) * L], num_experts=E, top_k=K)(x)
        tuple_gate = eputil.Gate(H, E, K, "topk")
        tuple_gate.proj = gate.proj  # the same router, returning (topk_idx, topk_weights)
        y_tuple = Moe(tuple_gate, experts, top_k=K)(x)
    return {"errs": errs, "y_all": y_all, "y_local": y_local, "y_tuple": y_tuple}


def test_moe_validation(pool_factory):
    """ExpertParallelMoE rejects with ValueError: a Linear gate whose out_features is not
    num_experts (at construction, naming the gate), all E experts with num_experts=2E
    (ambiguous, at construction for a Linear gate, at the first forward for another
    logits gate), top_k outside [1, E] (construction), logits of the wrong width and a
    tuple gate whose K differs from top_k (first forward, on every rank before anything
    is sent). Valid layers afterwards, the local-experts form included, equal the
    reference MoE."""
    ws = 2
    H, E, K, F, T = 8, 2 * ws, 2, 8, 5
    res = pool_factory(ws).run(rank_moe_validation, timeout=60)
    gate, experts = eputil.build_model(H, E, K, F, "logits", seed=6)
    for r in range(ws):
        e = res[r]["errs"]
        assert all(v is not None for v in e.values()), e
        assert (
            "Linear(in_features=8, out_features=3" in e["linear_width"]
            and "num_experts is 4" in e["linear_width"]
        )
        for key in ("linear_all_with_2E", "logits_all_with_2E"):
            assert "ambiguous" in e[key] and "num_experts is 8" in e[key], (key, e[key])
        for k in (0, -1, E + 1):
            assert f"top_k must be an int in [1, num_experts={E}], got {k}" in e[f"top_k={k}"], e[
                f"top_k={k}"
            ]
        assert "Gate" in e["logits_width"] and "5 logits" in e["logits_width"], e["logits_width"]
        assert "top-2" in e["tuple_k"] and "top_k=3" in e["tuple_k"], e["tuple_k"]
        x = eputil.make_inputs(r, T + r, H, E, K, torch.float32, seed=13)[0]
        with torch.no_grad():
            exp = eputil.ref_moe(gate, experts, x)
            gt = eputil.Gate(H, E, K, "topk")
            gt.proj = gate.proj
            exp_tuple = eputil.ref_moe(gt, experts, x)
        for key in ("y_all", "y_local"):
            torch.testing.assert_close(
                res[r][key], exp, rtol=1e-4, atol=1e-5, msg=lambda m: f"rank {r} {key}: {m}"
            )
        torch.testing.assert_close(res[r]["y_tuple"], exp_tuple, rtol=1e-4, atol=1e-5)


# ===================================================== options and other backends


def test_fp8_dequantize_checks_its_inputs():
    """fp8_dequantize refuses a q that is not float8 and scales of the wrong dtype or shape
    (a float32 q was dequantized silently)."""
    import mooncake_ep

    x = torch.randn(3, 130)
    q, sc = mooncake_ep.fp8_quantize(x)
    with pytest.raises(ValueError, match="q must be float8"):
        mooncake_ep.fp8_dequantize(x, sc)
    with pytest.raises(ValueError, match=r"scales must be float32 of shape \(3, 2\)"):
        mooncake_ep.fp8_dequantize(q, sc[:, :1])
    with pytest.raises(ValueError, match="scales must be float32"):
        mooncake_ep.fp8_dequantize(q, sc.double())


@pytest.mark.parametrize("bad", [1.5, "3", True, -1, [2]])
def test_ep_config_max_membership_retries_must_be_an_int(bad):
    """EPConfig(max_membership_retries=...) takes an int >= 0 (or None); a float, a string,
    a bool, a negative number or another type raises ValueError naming the field."""
    import mooncake_ep

    with pytest.raises(
        ValueError, match=r"^EPConfig: max_membership_retries must be an int >= 0 or None"
    ):
        mooncake_ep.EPConfig(max_membership_retries=bad)
    assert mooncake_ep.EPConfig(max_membership_retries=0).max_membership_retries == 0
    assert mooncake_ep.EPConfig(max_membership_retries=None).max_membership_retries is None


@pytest.mark.parametrize("group", [{}, "default", 0])
def test_buffer_group_of_the_wrong_type(group):
    """Buffer(group) with something that is not a process group raises TypeError naming
    the expected type, before torch.distributed looks at it."""
    import mooncake_ep

    with pytest.raises(
        TypeError,
        match=rf"^mooncake_ep.Buffer: group must be a torch.distributed.ProcessGroup or None "
        rf"\(the default group\), got {type(group).__name__}$",
    ):
        mooncake_ep.Buffer(group)


def rank_options(rank, ws):
    import torch.distributed as dist

    import mooncake_ep

    E, K, H = 2 * ws, 3, 40
    x, idx, w = eputil.make_inputs(rank, 11, H, E, K, torch.bfloat16, 3, 0.2)
    out = {}
    for name, buf in (
        ("fp32", mooncake_ep.Buffer(config=mooncake_ep.EPConfig(fp32_accumulate=True))),
        ("bf16", mooncake_ep.Buffer(config=mooncake_ep.EPConfig(fp32_accumulate=False))),
        ("gloo", mooncake_ep.Buffer(dist.new_group(list(range(ws)), backend="gloo"))),
    ):
        r = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
        y = eputil.scaled_experts_normal(
            r.recv_x, r.recv_topk_idx, r.recv_topk_weights, rank, E // ws, times_e_plus_one
        )
        out[name] = buf.combine(y, r.handle).combined_x
        out[name + "_active"] = buf.get_active_ranks().tolist()
    # fp8 low-latency rows over a gloo group (gloo has no float8 all_to_all): the same bytes
    # as over the mooncake group
    ll = {}
    for name, buf in (
        ("mooncake", mooncake_ep.Buffer()),
        ("gloo", mooncake_ep.Buffer(dist.new_group(list(range(ws)), backend="gloo"))),
    ):
        q = buf.low_latency_dispatch(x, idx, x.shape[0], E, use_fp8=True)
        y = mooncake_ep.fp8_dequantize(*q.recv_x)  # identity experts
        ll[name] = (q.recv_count, buf.low_latency_combine(y, idx, w, q.handle).combined_x)
    out["ll_fp8_same"] = all(torch.equal(a, b) for a, b in zip(ll["mooncake"], ll["gloo"]))
    out["ll_fp8_close"] = ll["gloo"][1]
    bad_args = []  # counts given as floats: refused by name on every rank
    b = mooncake_ep.Buffer()
    for call in (
        lambda: b.get_dispatch_layout(idx, float(E)),
        lambda: b.low_latency_dispatch(x, idx, float(x.shape[0]), E),
    ):
        try:
            call()
            bad_args.append("accepted")
        except ValueError as e:
            bad_args.append(str(e))
    out["bad_args"] = bad_args
    errs = []
    for bad in ({"kernels": "cuda"}, {"max_membership_retries": -1}):
        try:
            mooncake_ep.EPConfig(**bad)
        except ValueError as e:
            errs.append(str(e))
    try:
        mooncake_ep.Buffer().dispatch(x.to("meta"), topk_idx=idx, topk_weights=w, num_experts=E)
    except ValueError as e:
        errs.append(str(e))
    out["errs"] = errs
    return out


@pytest.mark.parametrize("ws", [2, 4])
def test_options_and_gloo_group(pool_factory, ws):
    """EPConfig(fp32_accumulate=False) sums in bf16 (identical to the float32 path at W=2,
    where a token has at most two rows; within bf16 rounding at W=4); a Buffer over a gloo
    group gives the same result with every rank active; bad options and non-CPU tensors
    raise ValueError."""
    res = pool_factory(ws).run(rank_options, timeout=60)
    for r in range(ws):
        o = res[r]
        x, idx, w = eputil.make_inputs(r, 11, 40, 2 * ws, 3, torch.bfloat16, 3, 0.2)
        exp = eputil.ref_scaled_moe(x, idx, w, times_e_plus_one)
        for name in ("fp32", "bf16", "gloo"):
            torch.testing.assert_close(o[name].double(), exp, rtol=2e-2, atol=2e-2)
        assert torch.equal(o["gloo"], o["fp32"])
        if ws == 2:
            assert torch.equal(o["bf16"], o["fp32"])
        assert o["gloo_active"] == [1] * ws
        assert o["ll_fp8_same"]
        assert "num_experts must be an int, got " in o["bad_args"][0], o["bad_args"]
        assert "num_max_dispatch_tokens_per_rank must be an int" in o["bad_args"][1], o["bad_args"]
        # identity experts: each token comes back as the weighted sum of its fp8 copies
        kept = (idx >= 0).to(w.dtype)
        torch.testing.assert_close(
            o["ll_fp8_close"].double(),
            (x.double() * (w * kept).sum(1, keepdim=True).double()),
            rtol=0.15,
            atol=0.15,
        )
        assert len(o["errs"]) == 3 and "kernels" in o["errs"][0] and "meta" in o["errs"][2], o[
            "errs"
        ]


def rank_warnings_are_errors(rank, ws):
    import warnings

    import mooncake_ep

    E, K, H = 2 * ws, 2, 16
    x, idx, w = eputil.make_inputs(rank, 6, H, E, K, torch.float32, 21, 0.2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # -W error (FutureWarning included)
        buf = mooncake_ep.Buffer()
        r = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
        y = eputil.scaled_experts_normal(
            r.recv_x, r.recv_topk_idx, r.recv_topk_weights, rank, E // ws, times_e_plus_one
        )
        out = buf.combine(y, r.handle).combined_x
        ll = buf.low_latency_dispatch(x, idx, 6, E)
        out_ll = buf.low_latency_combine(
            eputil.scaled_experts_ll(ll.recv_x, rank, E // ws, times_e_plus_one), idx, w, ll.handle
        ).combined_x
        gate, experts = eputil.build_model(H, E, K, 8, "topk", seed=2)
        moe = mooncake_ep.ExpertParallelMoE(gate, experts)
        moe.snapshot_experts()
        moe.restore_experts()  # nothing to restore: the all_gather of the table still runs
        xm = x.clone().requires_grad_()
        ym = moe(xm)
        ym.sum().backward()
    return {"out": out, "out_ll": out_ll, "moe_y": ym.detach(), "moe_gx": xm.grad}


def test_no_warnings(pool_factory):
    """Under ``warnings.simplefilter("error")`` (as ``-W error::FutureWarning``) dispatch,
    combine, the low-latency pair, snapshot/restore and an ExpertParallelMoE step run
    without a warning (torch 2.13 deprecates all_gather_into_tensor with FutureWarning)
    and give the reference values."""
    ws = 2
    res = pool_factory(ws).run(rank_warnings_are_errors, timeout=60)
    gate, experts = eputil.build_model(16, 2 * ws, 2, 8, "topk", seed=2)
    for r in range(ws):
        x, idx, w = eputil.make_inputs(r, 6, 16, 2 * ws, 2, torch.float32, 21, 0.2)
        exp = eputil.ref_scaled_moe(x, idx, w, times_e_plus_one).float()
        torch.testing.assert_close(res[r]["out"], exp, rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(res[r]["out_ll"], exp, rtol=1e-6, atol=1e-5)
        xm = x.clone().requires_grad_()
        ym = eputil.ref_moe(gate, experts, xm)
        ym.sum().backward()
        torch.testing.assert_close(res[r]["moe_y"], ym.detach(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(res[r]["moe_gx"], xm.grad, rtol=1e-4, atol=1e-5)


def rank_cached_bad(rank, ws):
    import mooncake_ep

    buf = mooncake_ep.Buffer()
    E = 2 * ws
    x, idx, w = eputil.make_inputs(rank, 5, 8, E, 2)
    r = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    try:
        buf.dispatch(x if rank == 0 else x[:3], handle=r.handle)
        err = None
    except ValueError as e:
        err = str(e)
    again = buf.dispatch(x * 3, handle=r.handle).recv_x  # the group goes on
    return {"err": err, "ok": torch.equal(again, r.recv_x * 3)}


def test_cached_dispatch_bad_input_raises_everywhere(pool_factory):
    """A cached dispatch (handle=) with a wrong x shape on rank 1 raises ValueError on
    every rank (header exchange, no token moved) instead of leaving rank 0 waiting."""
    res = pool_factory(2).run(rank_cached_bad, timeout=60)
    assert "rank(s) [1]" in res[0]["err"] and "(rank 0)" in res[0]["err"], res[0]
    assert "x must have shape (5, 8)" in res[1]["err"], res[1]
    assert res[0]["ok"] and res[1]["ok"]


ONE_RANK_BAD = {
    # case: (rank 0's bad arguments, what its error says)
    "num_experts_str": ({"num_experts": "4"}, "num_experts must be an int, got '4'"),
    "num_experts_float": ({"num_experts": 4.0}, "num_experts must be an int, got 4.0"),
    "expert_alignment": ({"expert_alignment": 2.5}, "expert_alignment must be an int, got 2.5"),
    "layout_list": (
        {"num_tokens_per_rank": [1, 2]},
        "num_tokens_per_rank must be a tensor of shape (2,), got list",
    ),
    "cached_handle": ({"handle": "h"}, "handle must be a DispatchHandle, got str"),
    "combine_x_list": ({"x": "list"}, "x must be a tensor, got list"),
    "ll_t_max_negative": (
        {"num_max_dispatch_tokens_per_rank": -1},
        "num_max_dispatch_tokens_per_rank must be >= 1, got -1",
    ),
    "ll_t_max_float": (
        {"num_max_dispatch_tokens_per_rank": 4.0},
        "num_max_dispatch_tokens_per_rank must be an int, got 4.0",
    ),
}


def rank_one_rank_bad(rank, ws, case):
    import mooncake_ep

    buf = mooncake_ep.Buffer()
    E, H, K = 2 * ws, 8, 2
    x, idx, w = eputil.make_inputs(rank, 4, H, E, K)
    bad = ONE_RANK_BAD[case][0] if rank == 0 else {}
    try:
        if case == "cached_handle":
            r = buf.dispatch(x, topk_idx=idx, num_experts=E)
            buf.dispatch(x, handle=bad.get("handle", r.handle))
        elif case == "combine_x_list":
            r = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
            buf.combine(r.recv_x.tolist() if bad else r.recv_x, r.handle)
        elif case.startswith("ll_"):
            buf.low_latency_dispatch(
                x, idx, bad.get("num_max_dispatch_tokens_per_rank", x.shape[0]), E
            )
        else:
            buf.dispatch(x, topk_idx=idx, topk_weights=w, **{"num_experts": E, **bad})
        err = None
    except ValueError as e:
        err = str(e)
    # the ranks stay in step: a good dispatch + combine right after is right
    r = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    y = eputil.scaled_experts_normal(
        r.recv_x, r.recv_topk_idx, r.recv_topk_weights, rank, E // ws, times_e_plus_one
    )
    return {"err": err, "out": buf.combine(y, r.handle).combined_x}


@pytest.mark.parametrize("case", sorted(ONE_RANK_BAD))
def test_one_rank_bad_argument_raises_everywhere(pool_factory, case):
    """Only rank 0 passes a bad argument (a non-int count, a layout argument that is not a
    tensor, a wrong handle or x, a T_max below 1): rank 0 raises ValueError naming it,
    rank 1 raises ValueError naming rank 0, both before anything is sent, and the next
    dispatch + combine on both ranks equals the float64 reference."""
    ws = 2
    res = pool_factory(ws).run(rank_one_rank_bad, case, timeout=60)
    op = {"combine": "combine", "ll": "low_latency_dispatch"}.get(case.split("_")[0], "dispatch")
    e0, e1 = res[0]["err"], res[1]["err"]
    assert e0 is not None and f"mooncake_ep {op} (rank 0): {ONE_RANK_BAD[case][1]}" in e0, e0
    assert e1 is not None and f"mooncake_ep {op} (rank 1): rank(s) [0] passed invalid" in e1, e1
    assert "nothing was sent" in e0 and "nothing was sent" in e1
    for r in range(ws):
        x, idx, w = eputil.make_inputs(r, 4, 8, 2 * ws, 2)
        exp = eputil.ref_scaled_moe(x, idx, w, times_e_plus_one)
        torch.testing.assert_close(res[r]["out"].double(), exp, rtol=1e-6, atol=1e-5)


def rank_buffers_not_reused_while_held(rank, ws):
    import mooncake_ep

    buf = mooncake_ep.Buffer()
    E, T, H = 2 * ws, 600, 1024  # receive buffers above the 1 MiB recycling threshold
    keep = []
    for i in range(4):
        x, idx, w = eputil.make_inputs(rank, T, H, E, 2, torch.bfloat16, seed=40 + i)
        r = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
        ll = buf.low_latency_dispatch(x, idx, T, E)
        keep.append(
            (r.recv_x, r.recv_x.clone(), ll.recv_x, ll.recv_x.clone(), ll.recv_count.clone())
        )
    ok = all(torch.equal(a, b) for a, b, _, _, _ in keep)
    ok_ll = all(
        torch.equal(p[l, : int(c[l])], q[l, : int(c[l])])
        for _, _, p, q, c in keep
        for l in range(c.numel())
    )
    # once dropped, buffers are recycled (the cache does not grow without bound)
    del keep
    for i in range(6):
        x, idx, w = eputil.make_inputs(rank, T, H, E, 2, torch.bfloat16, seed=50 + i)
        buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    cached = sum(len(v) for v in buf._recycler._cache.values())
    return {"ok": ok, "ok_ll": ok_ll, "cached": cached}


def test_recycler_keeps_big_buffers_for_big_requests():
    """A small request never takes a cached buffer more than twice its size: a round trip
    whose pieces are small and whose result is big reuses the same few buffers every
    call instead of handing the big one to a piece and allocating another big one."""
    from mooncake_ep._transport import _Recycler

    rec = _Recycler()
    for i in range(20):
        # 3 or 4 pieces of 1 MiB, then an 8 MiB result, all alive at once
        pieces = [rec.empty((8, 1 << 16), torch.bfloat16) for _ in range(3 + i % 2)]
        big = rec.empty((64, 1 << 16), torch.bfloat16)
        del big, pieces
    cached = rec._cache[(torch.bfloat16, torch.device("cpu"))]
    # 4 pieces and one result (a piece taking a free result would make it 3 + 2 x 8 MiB)
    assert sum(f.numel() * 2 for f, _ in cached) == (4 + 8) << 20


def test_results_are_not_overwritten_while_held(pool_factory):
    """Receive buffers are recycled only when nothing refers to them: results of earlier
    dispatches that the caller still holds keep their values."""
    res = pool_factory(2).run(rank_buffers_not_reused_while_held, timeout=60)
    for r in range(2):
        assert res[r]["ok"] and res[r]["ok_ll"], res[r]
        assert res[r]["cached"] <= 3 * 4, res[r]


def rank_subgroup(rank, ws):
    import torch.distributed as dist

    import mooncake_ep

    g = dist.new_group([1, 3])  # every rank creates it; ranks 1 and 3 use it
    if rank not in (1, 3):
        try:
            mooncake_ep.Buffer(g)
            return {"err": None}
        except ValueError as e:
            return {"err": str(e)}
    buf = mooncake_ep.Buffer(g)
    gr = buf.rank
    E = 4
    x, idx, w = eputil.make_inputs(rank, 7, 24, E, 2, torch.float32, 12, 0.2)
    r = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    y = eputil.scaled_experts_normal(
        r.recv_x, r.recv_topk_idx, r.recv_topk_weights, gr, E // 2, times_e_plus_one
    )
    out = buf.combine(y, r.handle).combined_x
    try:  # group rank 1 (global rank 3) alone passes a bad argument
        buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts="4" if gr == 1 else E)
        err = None
    except ValueError as e:
        err = str(e)
    return {"group_rank": gr, "size": buf.group_size, "out": out, "err": err}


def test_subgroup(pool_factory):
    """A Buffer over a subgroup (global ranks 1 and 3 of 4) uses group ranks (rank 3 holds
    experts 2-3), and its errors say that the ranks they name are group ranks; a process
    outside the group gets ValueError."""
    res = pool_factory(4).run(rank_subgroup, timeout=60)
    for r in (0, 2):
        assert res[r]["err"] and "not a member" in res[r]["err"], res[r]
    for r, gr in ((1, 0), (3, 1)):
        o = res[r]
        assert o["group_rank"] == gr and o["size"] == 2
        x, idx, w = eputil.make_inputs(r, 7, 24, 4, 2, torch.float32, 12, 0.2)
        exp = eputil.ref_scaled_moe(x, idx, w, times_e_plus_one).float()
        torch.testing.assert_close(o["out"], exp, rtol=1e-6, atol=1e-5)
        # errors name group ranks and say so, with the group's global ranks
        want = "ranks named here are ranks of the EP group, whose global ranks are [1, 3]"
        assert f"mooncake_ep dispatch (group rank {gr}; {want})" in o["err"], o["err"]
    assert "rank(s) [1] passed invalid arguments" in res[1]["err"], res[1]["err"]
