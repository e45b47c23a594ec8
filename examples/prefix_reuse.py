"""Prefix reuse with ``KVCacheStore`` and a ``transformers`` model on the CPU.

A tiny Llama (built from a config with a fixed seed: nothing is downloaded) serves agents
that share a long system prompt; each turn's prefill reuses the K/V of the longest stored
prefix and computes only the rest, and each prompt is stored with a breakpoint at its end,
so the agent's next turn hits to the exact token where this one ended.

    python examples/prefix_reuse.py [--agents 10 --turns 20 --system-tokens 1024 --chunk 128]

Prints TTFT (time to first token: prefill plus the first logits) p50/p99 with and without
reuse, prefill tokens saved, the token hit rate, and checks that the logits with reuse
equal the logits of a full prefill (max abs difference: float32 rounding only).

The store is embedded (master in this process); ``--master HOST:PORT`` uses a running one.
"""

from __future__ import annotations

import argparse
import time

import torch


def tiny_llama(seed: int = 0, layers: int = 2, vocab: int = 512):
    """A small ``LlamaForCausalLM`` with random weights (``seed``), in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16384,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return LlamaForCausalLM(cfg).eval()


@torch.no_grad()
def prefill(model, kvstore, tokens: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Logits of the last token of ``tokens`` and how many tokens were computed.

    Reuses the stored prefix (leaving at least one token to compute), then stores the
    prompt's K/V with a breakpoint at its end.
    """
    n = 0
    cache = None
    if kvstore is not None:
        n = min(kvstore.match_prefix(tokens), len(tokens) - 1)
        hit = kvstore.get(tokens, n)
        n = hit.tokens
        cache = hit.to_dynamic_cache()
    out = model(tokens[n:].unsqueeze(0), cache=cache, use_cache=True)
    if kvstore is not None:
        kvstore.put(tokens, out.cache, breakpoints=[len(tokens)])
    return out.logits[0, -1], len(tokens) - n


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

    torch.set_num_threads(1)
    model = tiny_llama()
    g = torch.Generator().manual_seed(1)
    system = torch.randint(3, 512, (a.system_tokens,), generator=g)
    store = MooncakeStore(master=a.master, segment_size=512 << 20, serve_tcp=False)
    kvs = KVCacheStore(
        store, tenant="demo", config=KVCacheConfig(chunk_tokens=a.chunk, model="tiny-llama")
    )
    histories = [system.clone() for _ in range(a.agents)]
    ttft_reuse, ttft_full, computed, total, maxdiff = [], [], 0, 0, 0.0
    for _turn in range(a.turns):
        for ag in range(a.agents):
            msg = torch.randint(3, 512, (a.turn_tokens,), generator=g)
            histories[ag] = torch.cat([histories[ag], msg])
            toks = histories[ag]
            t0 = time.perf_counter()
            logits, n = prefill(model, kvs, toks)
            ttft_reuse.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            full, _ = prefill(model, None, toks)
            ttft_full.append(time.perf_counter() - t0)
            maxdiff = max(maxdiff, (full - logits).abs().max().item())
            computed += n
            total += len(toks)
            reply = torch.randint(3, 512, (a.turn_tokens // 2,), generator=g)  # the agent's answer
            histories[ag] = torch.cat([toks, reply])

    def pct(xs, p):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))] * 1000

    print(
        f"requests: {len(ttft_reuse)} ({a.agents} agents x {a.turns} turns), system prompt "
        f"{a.system_tokens} tokens, chunk {a.chunk}"
    )
    print(f"TTFT with reuse:    p50 {pct(ttft_reuse, 50):.2f} ms  p99 {pct(ttft_reuse, 99):.2f} ms")
    print(f"TTFT full prefill:  p50 {pct(ttft_full, 50):.2f} ms  p99 {pct(ttft_full, 99):.2f} ms")
    print(
        f"prefill tokens: {computed} of {total} computed ({100 * (1 - computed / total):.1f}% saved)"
    )
    print(f"hit rate (tokens): {100 * kvs.stats.hit_rate:.1f}%  {kvs.stats}")
    print(f"logits max |reuse - full|: {maxdiff:.2e}")
    store.close()
    ok = maxdiff < 1e-4
    print("logits equal (within float32 rounding):", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
