"""Small models for the tests: an HF transformers Qwen3 built from a tiny config (no download), a residual MLP."""

import torch
from torch import nn


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


class ResidualMlp(nn.Module):
    """``x + down(silu(up(1.5 x)))``: two linears whose inputs are made inside the block (what a
    selective activation checkpointing policy recomputes or keeps)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return x + self.down(torch.nn.functional.silu(self.up(x * 1.5)))
