"""Expert-parallel cases EP-1, EP-2 and EP-4 of shared/cases/CASES.md, on real rank
processes (the cached rank pool), normal and low-latency mode.

Experts here are "multiply by a factor": expert ``e`` computes ``(e + 1) * x`` (EP-1, EP-2)
or ``x`` (EP-4). Expected values come from :func:`eputil.ref_scaled_moe` (float64 loops).
Inputs are multiples of 1/8 and weights of 1/16, so bf16 results are exact and compared
bit for bit.

Environment: ``MOONCAKE_TEST_EP4_REPS`` (repetitions of EP-4, default 100; the slow run
uses 1000).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.ep import eputil

pytestmark = pytest.mark.timeout(180)

EP4_REPS = int(os.environ.get("MOONCAKE_TEST_EP4_REPS", "100"))


def plus_one(e):
    return float(e + 1)


def _ops(g=None):
    import mooncake_pg

    try:
        return int(mooncake_pg.backend_of(g).ops_issued)
    except (ValueError, AttributeError):
        return None


# ============================================================================ EP-1

EP1_H, EP1_E, EP1_K = 128, 16, 2


def ep1_inputs(rank, variant):
    """rank 0: 3 tokens (unless "all_empty"); other ranks: (0, 128) and (0, 2)."""
    H, _E, K = EP1_H, EP1_E, EP1_K
    T = 3 if (rank == 0 and variant != "all_empty") else 0
    x = ((torch.arange(T * H, dtype=torch.float64).reshape(T, H) % 13) / 8 - 0.75).to(
        torch.bfloat16
    )
    if variant == "no_rank3":
        idx = torch.tensor([[0, 5], [11, 4], [8, 9]], dtype=torch.int64)[
            :T
        ]  # experts 12..15 unused
    else:
        idx = torch.tensor([[0, 15], [7, 12], [3, 9]], dtype=torch.int64)[:T]
    w = torch.tensor([[0.5, 0.25], [0.75, 0.125], [0.0625, 1.0]], dtype=torch.float32)[:T]
    return x, idx.reshape(T, K), w.reshape(T, K)


def rank_ep1(rank, ws, variant):
    import mooncake_ep

    buf = mooncake_ep.Buffer()
    x, idx, w = ep1_inputs(rank, variant)
    L = EP1_E // ws
    layout = buf.get_dispatch_layout(idx, EP1_E)
    r = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=EP1_E)
    y = eputil.scaled_experts_normal(
        r.recv_x, r.recv_topk_idx, r.recv_topk_weights, rank, L, plus_one
    )
    out = buf.combine(y, r.handle).combined_x
    ll = buf.low_latency_dispatch(x, idx, 4, EP1_E)
    out_ll = buf.low_latency_combine(
        eputil.scaled_experts_ll(ll.recv_x, rank, L, plus_one), idx, w, ll.handle
    ).combined_x
    return {
        "x": x,
        "idx": idx,
        "w": w,
        "out": out,
        "out_ll": out_ll,
        "recv_rows": int(r.recv_x.shape[0]),
        "recv_shape": tuple(r.recv_x.shape),
        "layout_rank": layout.num_tokens_per_rank,
        "counts": r.num_recv_tokens_per_expert_list,
        "ll_count": ll.recv_count.tolist(),
    }


@pytest.mark.parametrize("variant", ["rank0_only", "all_empty", "no_rank3"])
def test_ep1_ranks_with_zero_tokens(pool_factory, variant):
    """EP-1: W=4, H=128, 16 experts, top-2, bf16; rank 0 has 3 tokens, ranks 1-3 none.
    Empty ranks get (0, 128); rank 0 gets sum_k w_k (e_k + 1) x. Variants: all ranks
    empty; no token routed to rank 3 (it receives nothing, its experts see no rows)."""
    ws = 4
    res = pool_factory(ws).run(rank_ep1, variant, timeout=60)
    for r in range(ws):
        o = res[r]
        exp = eputil.ref_scaled_moe(o["x"], o["idx"], o["w"], plus_one).to(torch.bfloat16)
        for key in ("out", "out_ll"):
            assert o[key].dtype == torch.bfloat16 and tuple(o[key].shape) == tuple(exp.shape), (
                r,
                key,
                o[key].shape,
            )
            assert torch.equal(o[key], exp), f"rank {r} {key}: got {o[key]}\nexpected {exp}"
        if r != 0 or variant == "all_empty":
            assert tuple(o["out"].shape) == (0, EP1_H)
    # who received what: a token goes once to each rank holding one of its experts
    tokens_per_rank = [0] * ws
    for e_row in res[0]["idx"].tolist():
        for dst in {e // (EP1_E // ws) for e in e_row}:
            tokens_per_rank[dst] += 1
    assert res[0]["layout_rank"].tolist() == tokens_per_rank
    for r in range(ws):
        assert res[r]["recv_rows"] == tokens_per_rank[r], (r, res[r]["recv_rows"], tokens_per_rank)
        assert res[r]["recv_shape"][1] == EP1_H
    if variant == "no_rank3":
        assert (
            res[3]["recv_rows"] == 0
            and res[3]["counts"] == [0] * 4
            and res[3]["ll_count"] == [0] * 4
        )
    if variant == "all_empty":
        assert all(res[r]["recv_rows"] == 0 for r in range(ws))


# ============================================================================ EP-2

EP2_E, EP2_K, EP2_H = 8, 3, 16
EP2_IDX = [[1, -1, 6], [-1, -1, -1]]  # token A, token B
EP2_W = [[0.5, 100.0, 0.25], [3.0, 5.0, 7.0]]  # masked slots carry large weights: must be ignored


def ep2_x(rank):
    return (torch.arange(2 * EP2_H, dtype=torch.float32).reshape(2, EP2_H) + 100 * rank) / 4


def rank_ep2(rank, ws):
    import mooncake_ep

    buf = mooncake_ep.Buffer()
    x = ep2_x(rank)
    idx = torch.tensor(EP2_IDX, dtype=torch.int64)
    w = torch.tensor(EP2_W, dtype=torch.float32)
    L = EP2_E // ws
    r = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=EP2_E)
    y = eputil.scaled_experts_normal(
        r.recv_x, r.recv_topk_idx, r.recv_topk_weights, rank, L, plus_one
    )
    c = buf.combine(y, r.handle, topk_weights=r.recv_topk_weights)
    ll = buf.low_latency_dispatch(x, idx, 2, EP2_E)
    out_ll = buf.low_latency_combine(
        eputil.scaled_experts_ll(ll.recv_x, rank, L, plus_one), idx, w, ll.handle
    ).combined_x
    return {
        "out": c.combined_x,
        "combined_w": c.combined_topk_weights,
        "out_ll": out_ll,
        "recv_x": r.recv_x,
        "recv_idx": r.recv_topk_idx,
        "recv_w": r.recv_topk_weights,
        "counts": r.num_recv_tokens_per_expert_list,
        "ll_count": ll.recv_count.tolist(),
        "layout": tuple(
            None if t is None else t.tolist() for t in buf.get_dispatch_layout(idx, EP2_E)
        ),
    }


def test_ep2_masked_slots(pool_factory):
    """EP-2: W=2, 8 experts, top-3; token A = [1, -1, 6] combines from experts 1 and 6 only
    (the masked slot's weight 100 is ignored); token B = [-1, -1, -1] is never sent and
    combines to exactly 0; receive counts exclude masked slots."""
    ws = 2
    res = pool_factory(ws).run(rank_ep2, timeout=60)
    for r in range(ws):
        o = res[r]
        x = ep2_x(r)
        exp = torch.stack([0.5 * 2 * x[0] + 0.25 * 7 * x[0], torch.zeros(EP2_H)])
        assert torch.equal(o["out"], exp), f"rank {r}: {o['out']} vs {exp}"
        assert torch.equal(o["out_ll"], exp), f"rank {r} (low latency): {o['out_ll']} vs {exp}"
        assert torch.equal(o["out"][1], torch.zeros(EP2_H)) and torch.equal(
            o["out_ll"][1], torch.zeros(EP2_H)
        )
        # combined weights: each slot's weight comes back from the rank owning its expert, masked slots 0
        assert torch.equal(o["combined_w"], torch.tensor([[0.5, 0.0, 0.25], [0.0, 0.0, 0.0]])), o[
            "combined_w"
        ]
        # only token A travels, once to each rank (expert 1 on rank 0, expert 6 on rank 1)
        assert o["recv_x"].shape == (2, EP2_H), o["recv_x"].shape
        assert torch.equal(o["recv_x"], torch.stack([ep2_x(0)[0], ep2_x(1)[0]])), o["recv_x"]
        # one host: no per-host counts (None, as DeepEP inside a node)
        assert o["layout"] == (
            [1, 1],
            None,
            [0, 1, 0, 0, 0, 0, 1, 0],
            [[True, True], [False, False]],
        ), o["layout"]
    assert res[0]["recv_idx"].tolist() == [[1, -1, -1], [1, -1, -1]]
    assert res[1]["recv_idx"].tolist() == [[-1, -1, 2], [-1, -1, 2]]
    assert (
        res[0]["recv_w"].tolist() == [[0.5, 0.0, 0.0]] * 2
        and res[1]["recv_w"].tolist() == [[0.0, 0.0, 0.25]] * 2
    )
    assert res[0]["counts"] == [0, 2, 0, 0] and res[1]["counts"] == [0, 0, 2, 0]
    assert res[0]["ll_count"] == [0, 2, 0, 0] and res[1]["ll_count"] == [0, 0, 2, 0]


def rank_ep2_reject(rank, ws, bad_rank, bad_value, mode):
    import mooncake_ep

    buf = mooncake_ep.Buffer()
    x = ep2_x(rank)
    idx = torch.tensor(EP2_IDX, dtype=torch.int64)
    w = torch.tensor(EP2_W, dtype=torch.float32)
    if rank == bad_rank:
        idx = idx.clone()
        idx[1, 2] = bad_value
    ops0 = _ops()
    try:
        if mode == "normal":
            buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=EP2_E)
        else:
            buf.low_latency_dispatch(x, idx, 2, EP2_E)
        err = None
    except ValueError as e:
        err = str(e)
    ops1 = _ops()
    # the group goes on: a good dispatch + combine right after is right
    good = torch.tensor(EP2_IDX, dtype=torch.int64)
    r = buf.dispatch(x, topk_idx=good, topk_weights=w, num_experts=EP2_E)
    y = eputil.scaled_experts_normal(
        r.recv_x, r.recv_topk_idx, r.recv_topk_weights, rank, EP2_E // ws, plus_one
    )
    out = buf.combine(y, r.handle).combined_x
    return {"err": err, "ops": None if ops0 is None else ops1 - ops0, "out": out}


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
@pytest.mark.parametrize("bad_value", [-2, 8, 1000])
def test_ep2_rejected_ids(pool_factory, mode, bad_value):
    """EP-2: ids below -1 and ids >= num_experts are rejected (the choice: other negatives
    are errors, not "no expert"). Only rank 1 passes the bad id; every rank raises
    ValueError after one small header exchange and before any token moves (one op
    issued on the group, no all_to_all); rank 1's message names the op, the rank, the
    position, the value and the valid range; rank 0's names rank 1. The group goes on."""
    ws = 2
    res = pool_factory(ws).run(rank_ep2_reject, 1, bad_value, mode, timeout=60)
    op = "dispatch" if mode == "normal" else "low_latency_dispatch"
    e1 = res[1]["err"]
    assert (
        e1 is not None
        and f"mooncake_ep {op} (rank 1)" in e1
        and f"topk_idx[1, 2] = {bad_value}" in e1
        and "[0, 8)" in e1
        and "nothing was sent" in e1
    ), e1
    e0 = res[0]["err"]
    assert e0 is not None and f"mooncake_ep {op} (rank 0)" in e0 and "rank(s) [1]" in e0, e0
    for r in range(ws):
        if res[r]["ops"] is not None:
            assert res[r]["ops"] == 1, (
                f"rank {r}: {res[r]['ops']} ops issued by the rejected call (expected the header only)"
            )
        x = ep2_x(r)
        exp = torch.stack([0.5 * 2 * x[0] + 0.25 * 7 * x[0], torch.zeros(EP2_H)])
        assert torch.equal(res[r]["out"], exp)


# ============================================================================ EP-4

EP4_T, EP4_H, EP4_K = 256, 1024, 8


def rank_ep4(rank, ws, reps):
    import mooncake_ep

    E = 8 * ws
    E // ws
    buf = mooncake_ep.Buffer()
    g = torch.Generator().manual_seed(4000 + rank)
    x = torch.randint(0, 2, (EP4_T, EP4_H), generator=g).to(torch.bfloat16)
    idx = torch.arange(8, dtype=torch.int64).repeat(EP4_T, 1)
    w = torch.ones((EP4_T, EP4_K), dtype=torch.float32)
    exp = 8 * x
    bad = {"normal": [], "low_latency": []}
    for i in range(reps):
        r = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
        # identity experts: each row times the sum of its local weights
        y = (r.recv_x.float() * r.recv_topk_weights.sum(1, keepdim=True)).to(torch.bfloat16)
        out = buf.combine(y, r.handle).combined_x
        if not torch.equal(out, exp):
            bad["normal"].append(i)
        ll = buf.low_latency_dispatch(x, idx, EP4_T, E)
        out_ll = buf.low_latency_combine(ll.recv_x, idx, w, ll.handle).combined_x
        if not torch.equal(out_ll, exp):
            bad["low_latency"].append(i)
    return bad


@pytest.mark.parametrize("ws", [2, 3, 4])
def test_ep4_repeatability(pool_factory, ws):
    """EP-4: num_experts = 8 W, T=256, H=1024, top-8, every token to experts 0..7 with
    weight 1, x random 0/1 (bf16, rank-dependent), identity experts; MOONCAKE_TEST_EP4_REPS
    repetitions (default 100) on one buffer, normal and low-latency mode: every output is
    exactly 8 x."""
    res = pool_factory(ws).run(rank_ep4, EP4_REPS, timeout=60 + 2.0 * EP4_REPS * ws)
    for r in range(ws):
        assert res[r] == {"normal": [], "low_latency": []}, (
            f"rank {r}: repetitions with wrong output: {res[r]}"
        )
