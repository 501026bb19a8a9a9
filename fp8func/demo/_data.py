"""The demo's corpus and tokenizer: the bytes of a public-domain book (``data/README.md``), vocab 256."""

from __future__ import annotations

from importlib import resources

import torch

__all__ = ["CORPUS", "load_tokens", "Batches"]

CORPUS = "alice.txt"
VOCAB = 256  # byte-level: token = byte value, nothing to download


def load_tokens(name: str = CORPUS) -> torch.Tensor:
    """The corpus as a 1-D int64 tensor of byte values."""
    raw = resources.files("fp8func.demo").joinpath("data", name).read_bytes()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()


class Batches:
    """Random windows of the training split in a fixed order (one seed: the same for every run),
    and fixed held-out windows from the tail of the corpus.

    Example:
        >>> data = Batches(load_tokens(), steps=10, batch=8, seq=128)
        >>> data[0].shape
        torch.Size([8, 128])
    """

    def __init__(self, tokens: torch.Tensor, *, steps: int, batch: int, seq: int, held_out: float = 0.1,
                 seed: int = 0):
        n_val = int(len(tokens) * held_out)
        self.train, self.val, self.seq = tokens[:-n_val], tokens[-n_val:], seq
        if len(self.val) < seq or len(self.train) <= seq:
            raise ValueError(f"Batches: seq={seq} does not fit the corpus ({len(tokens)} tokens, {n_val} held "
                             f"out); use --seq {len(self.val)} or less.")
        g = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, len(self.train) - seq, (steps, batch), generator=g)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, step: int) -> torch.Tensor:
        return torch.stack([self.train[s:s + self.seq] for s in self.starts[step].tolist()])

    def held_out(self, batch: int, max_batches: int = 8) -> list[torch.Tensor]:
        """Whole ``seq`` windows from the start of the held-out split: ``max_batches`` batches at most."""
        n = min(len(self.val) // self.seq, batch * max_batches)
        return list(self.val[:n * self.seq].view(n, self.seq).split(batch))
