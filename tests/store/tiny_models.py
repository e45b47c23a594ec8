"""Tiny ``transformers`` models for the KV cache tests and benchmarks: built from a config
with a fixed seed (random weights, nothing downloaded), in eval mode, on the CPU."""

from __future__ import annotations

import torch


def tiny_llama(seed: int = 0, *, layers: int = 2, vocab: int = 512, hidden: int = 64):
    """A ``LlamaForCausalLM`` with grouped-query attention (4 heads, 2 kv heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16384,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return LlamaForCausalLM(cfg).eval()


def tiny_gpt2(seed: int = 0, *, layers: int = 2, vocab: int = 512, hidden: int = 64):
    """A ``GPT2LMHeadModel`` (learned positions, 4 heads)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(
        vocab_size=vocab,
        n_embd=hidden,
        n_layer=layers,
        n_head=4,
        n_positions=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return GPT2LMHeadModel(cfg).eval()


MODELS = {"llama": tiny_llama, "gpt2": tiny_gpt2}
