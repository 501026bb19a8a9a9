"""Small models for distributed tests: an HF transformers Qwen3 built from a tiny config (no download)."""

import torch


def tiny_qwen3(hidden=256, intermediate=512, layers=2, heads=4, vocab=256, seed=0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, head_dim=hidden // heads,
        max_position_embeddings=256, tie_word_embeddings=False, attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config)


def batch(step, rank, batch_size=2, seq=64, vocab=256):
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, vocab, (batch_size, seq), generator=g)
    return ids, ids.clone()
