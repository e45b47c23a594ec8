"""Prefix reuse with ``KVCacheStore``: a small decoder-only transformer on the CPU serves
10 agents x 20 turns that share a long system prompt; each turn's prefill reuses the
K/V of the longest stored prefix (whole chunks) and computes only the rest.

    python examples/prefix_reuse.py [--agents 10 --turns 20 --system-tokens 1024 --chunk 128]

Prints TTFT (time to first token: prefill plus the first logits) p50/p99 with and without
reuse, prefill tokens saved, the hit rate, and checks that the logits with reuse equal
the logits of a full prefill (max abs difference, float32 rounding only).

The store is embedded (master in this process); ``--master HOST:PORT`` uses a running one.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn as nn


class TinyDecoder(nn.Module):
    """A decoder-only transformer whose forward takes and returns K/V explicitly:
    ``forward(tokens[T], past=None) -> (logits[T, vocab], kv[layers, 2, heads, P+T, head_dim])``."""

    def __init__(self, vocab=512, d_model=64, heads=4, layers=2, max_len=8192):
        super().__init__()
        self.h, self.dh = heads, d_model // heads
        self.emb = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.qkv = nn.ModuleList(nn.Linear(d_model, 3 * d_model) for _ in range(layers))
        self.proj = nn.ModuleList(nn.Linear(d_model, d_model) for _ in range(layers))
        self.mlp = nn.ModuleList(
            nn.Sequential(
                nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
            )
            for _ in range(layers)
        )
        self.ln1 = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(layers))
        self.ln2 = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(layers))
        self.out = nn.Linear(d_model, vocab)

    @torch.no_grad()
    def forward(self, tokens, past=None):
        P = 0 if past is None else past.shape[3]
        T = tokens.shape[0]
        x = self.emb(tokens) + self.pos(torch.arange(P, P + T))
        kvs = []
        mask = torch.ones(T, P + T, dtype=torch.bool).tril(diagonal=P)
        for i in range(len(self.qkv)):
            q, k, v = self.qkv[i](self.ln1[i](x)).split(self.h * self.dh, dim=-1)
            q, k, v = (t.reshape(T, self.h, self.dh).transpose(0, 1) for t in (q, k, v))
            if past is not None:
                k = torch.cat([past[i, 0], k], dim=1)
                v = torch.cat([past[i, 1], v], dim=1)
            kvs.append(torch.stack([k, v]))
            att = (q @ k.transpose(1, 2)) / math.sqrt(self.dh)
            att = att.masked_fill(~mask, float("-inf")).softmax(-1)
            x = x + self.proj[i]((att @ v).transpose(0, 1).reshape(T, -1))
            x = x + self.mlp[i](self.ln2[i](x))
        return self.out(x), torch.stack(kvs)


def prefill(model, kvstore, tokens):
    """Logits of the last token of ``tokens`` and the tokens computed, reusing stored K/V."""
    hit = kvstore.get(tokens, kvstore.match_prefix(tokens)) if kvstore is not None else None
    n = hit.tokens if hit is not None else 0
    if n == len(tokens):  # keep at least one token to compute logits from
        n -= kvstore.cfg.chunk_tokens
        hit = hit._replace(tokens=n, kv=hit.kv[:, :, :, :n] if n else None)
    logits, kv = model(tokens[n:], hit.kv if n else None)
    if kvstore is not None:
        kvstore.put(tokens, kv)
    return logits[-1], len(tokens) - n


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", type=int, default=10)
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--system-tokens", type=int, default=1024)
    ap.add_argument("--turn-tokens", type=int, default=48)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--master", default=None)
    a = ap.parse_args(argv)
    from mooncake_store import KVCacheConfig, KVCacheStore, MooncakeStore

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = TinyDecoder().eval()
    g = torch.Generator().manual_seed(1)
    system = torch.randint(0, 512, (a.system_tokens,), generator=g)
    store = MooncakeStore(master=a.master, segment_size=512 << 20, serve_tcp=False)
    kvs = KVCacheStore(store, tenant="demo", config=KVCacheConfig(chunk_tokens=a.chunk))
    histories = [system.clone() for _ in range(a.agents)]
    ttft_reuse, ttft_full, computed, total, maxdiff = [], [], 0, 0, 0.0
    for _turn in range(a.turns):
        for ag in range(a.agents):
            msg = torch.randint(0, 512, (a.turn_tokens,), generator=g)
            histories[ag] = torch.cat([histories[ag], msg])
            toks = histories[ag]
            t0 = time.perf_counter()
            logits, n = prefill(model, kvs, toks)
            ttft_reuse.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            full, _ = model(toks)
            ttft_full.append(time.perf_counter() - t0)
            maxdiff = max(maxdiff, (full[-1] - logits).abs().max().item())
            computed += n
            total += len(toks)
            reply = torch.randint(0, 512, (a.turn_tokens // 2,), generator=g)  # the agent's answer
            histories[ag] = torch.cat([toks, reply])

    def pct(xs, p):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))] * 1000

    print(
        f"requests: {len(ttft_reuse)} ({a.agents} agents x {a.turns} turns), system prompt {a.system_tokens} tokens, "
        f"chunk {a.chunk}"
    )
    print(f"TTFT with reuse:    p50 {pct(ttft_reuse, 50):.2f} ms  p99 {pct(ttft_reuse, 99):.2f} ms")
    print(f"TTFT full prefill:  p50 {pct(ttft_full, 50):.2f} ms  p99 {pct(ttft_full, 99):.2f} ms")
    print(
        f"prefill tokens: {computed} of {total} computed ({100 * (1 - computed / total):.1f}% saved)"
    )
    print(f"hit rate (chunks): {100 * kvs.stats.hit_rate:.1f}%  {kvs.stats}")
    print(f"logits max |reuse - full|: {maxdiff:.2e}")
    store.close()
    ok = maxdiff < 1e-4
    print("logits equal (within float32 rounding):", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
