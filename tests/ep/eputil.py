"""Helpers of the expert-parallel tests: rank-dependent inputs, independent references
(plain loops over tokens and slots in float64, no mooncake_ep code), a reference MoE.

Imported both by the test process and by the rank processes (keep it light).
"""

from __future__ import annotations

import torch
from torch import nn


def make_inputs(rank, T, H, E, K, dtype=torch.float32, seed=0, masked=0.0):
    """Rank-dependent tokens, top-k ids (distinct per token unless ``masked``) and weights.
    Values are multiples of 1/8 in [-2, 2] and weights multiples of 1/16, so that bf16
    products with small integers are exact."""
    g = torch.Generator().manual_seed(1000 * seed + 17 * rank + 1)
    x = (torch.randint(-16, 17, (T, H), generator=g).to(torch.float64) / 8).to(dtype)
    idx = (
        torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
        if T
        else torch.zeros((0, K), dtype=torch.int64)
    )
    if masked:
        drop = torch.rand((T, K), generator=g) < masked
        idx = torch.where(drop, torch.full_like(idx, -1), idx)
    w = torch.randint(1, 16, (T, K), generator=g).to(torch.float32) / 16
    return x, idx.to(torch.int64), w


def ref_scaled_moe(x, idx, w, scale, excluded=()):
    """``out[t] = sum_k w[t,k] * scale(e) * x[t]`` over slots with ``e = idx[t,k] >= 0`` and
    ``e`` not in ``excluded``; float64 loops. ``scale(e)`` is the expert's factor."""
    T, H = x.shape
    out = torch.zeros((T, H), dtype=torch.float64)
    xd = x.to(torch.float64)
    for t in range(T):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if e >= 0 and e not in excluded:
                out[t] += float(w[t, k]) * scale(e) * xd[t]
    return out


def scaled_experts_normal(recv_x, recv_idx, recv_w, rank, L, scale):
    """Caller-side expert step of normal mode, as a DeepEP user writes it: for each
    received row, ``sum_k recv_w[k] * scale(rank*L + recv_idx[k]) * row`` (float32)."""
    y = torch.zeros(recv_x.shape, dtype=torch.float32)
    xf = recv_x.float()
    for k in range(recv_idx.shape[1]):
        loc = recv_idx[:, k]
        f = torch.tensor(
            [scale(rank * L + int(l)) if int(l) >= 0 else 0.0 for l in loc], dtype=torch.float32
        )
        y += (recv_w[:, k] * f).unsqueeze(1) * xf
    return y.to(recv_x.dtype)


def scaled_experts_ll(packed, rank, L, scale):
    """Low-latency expert step: local expert l multiplies its rows by ``scale(rank*L + l)``."""
    f = torch.tensor([scale(rank * L + l) for l in range(L)], dtype=torch.float32).view(L, 1, 1)
    return (packed.float() * f).to(packed.dtype)


# ----------------------------------------------------------------- reference MoE


class Expert(nn.Module):
    """A small two-layer MLP expert."""

    def __init__(self, H, F):
        super().__init__()
        self.up = nn.Linear(H, F)
        self.down = nn.Linear(F, H)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


class Gate(nn.Module):
    """Linear router with routing modes: ``"logits"`` (returns the logits), ``"topk"``
    (softmax + top-k), ``"skew"`` (every
    token to expert ``skew_to``, weight = its probability, other slots -1), ``"masked"``
    (top-k with some slots set to -1, deterministic per token), ``"dup"`` (top-k where
    slot 1 repeats slot 0's expert)."""

    def __init__(self, H, E, K, mode="topk", skew_to=1):
        super().__init__()
        self.proj = nn.Linear(H, E, bias=False)
        self.K, self.mode, self.skew_to = K, mode, skew_to

    def forward(self, x):
        if self.mode == "logits":  # a plain router: the wrapper does softmax + top-k
            return self.proj(x)
        probs = torch.softmax(self.proj(x).float(), dim=-1)
        T = x.shape[0]
        if self.mode == "skew":
            idx = torch.full((T, self.K), -1, dtype=torch.int64)
            idx[:, 0] = self.skew_to
            w = probs[:, self.skew_to : self.skew_to + 1].expand(T, self.K) * (idx >= 0)
            return idx, w
        w, idx = torch.topk(probs, self.K, dim=-1)
        if self.mode == "masked":
            t = torch.arange(T).unsqueeze(1)
            k = torch.arange(self.K).unsqueeze(0)
            drop = ((t * 7 + k * 3) % 5 == 0) | (t % 4 == 3)
            idx = torch.where(drop, torch.full_like(idx, -1), idx)
        elif self.mode == "dup" and self.K > 1:
            idx = idx.clone()
            idx[:, 1] = idx[:, 0]
        return idx, w


def ref_moe(gate, experts, x, excluded=()):
    """Single-process reference: ``out[t] = sum_k w[t,k] * experts[idx[t,k]](x[t])``.
    A gate returning logits is routed here by softmax (float32) and top-``gate.K``."""
    g = gate(x)
    if isinstance(g, torch.Tensor):
        w, idx = torch.topk(torch.softmax(g.float(), dim=-1), gate.K, dim=-1)
    else:
        idx, w = g
    out = torch.zeros_like(x, dtype=torch.float32)
    for e, ex in enumerate(experts):
        if e in excluded:
            continue
        hit = idx == e
        rows = hit.any(1).nonzero().squeeze(1)
        if rows.numel():
            we = (w * hit).sum(1)[rows]
            out = out.index_add(0, rows, ex(x[rows]).float() * we.unsqueeze(1))
    return out.to(x.dtype)


def build_model(H, E, K, F, mode, seed=0):
    torch.manual_seed(seed)
    gate = Gate(H, E, K, mode)
    experts = [Expert(H, F) for _ in range(E)]
    return gate, experts


def gpu_missing():
    """Why the GPU tests cannot run here (a reason for ``skipif``), or None."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    try:
        import mooncake_pg
    except ImportError as e:
        return f"mooncake_pg does not import: {e}"
    if not mooncake_pg.WITH_CUDA:
        return "mooncake_pg was built without CUDA (mooncake_pg.WITH_CUDA is False)"
    return None
