"""A tiny generated text corpus and character-level batches for the demo and tests.

The corpus is generated from a small grammar with a seeded generator, so it needs no
download and is identical everywhere; `token_batches` yields the same global batches on
every rank, and each data-parallel replica takes its own slice.
"""

from __future__ import annotations

import random
from typing import Iterator

import torch

_SUBJECTS = ["the cat", "a dog", "my friend", "the old man", "a small bird", "the teacher", "our team", "the river"]
_VERBS = ["sees", "finds", "likes", "follows", "carries", "paints", "answers", "remembers"]
_OBJECTS = ["the moon", "a red ball", "the last train", "an open door", "the quiet garden", "a long letter", "the map"]
_ENDINGS = ["today", "at night", "in the rain", "after lunch", "with care", "again", "once more"]


def tiny_corpus(sentences: int = 2000, seed: int = 0) -> str:
    """Deterministic English-like text: `sentences` short sentences."""
    rng = random.Random(seed)
    out = []
    for _ in range(sentences):
        words = [rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)]
        if rng.random() < 0.6:
            words.append(rng.choice(_ENDINGS))
        out.append(" ".join(words).capitalize() + rng.choice([".", ".", "!", "?"]))
    return " ".join(out)


class CharTokenizer:
    """Characters to ids over a fixed alphabet."""

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self._ids = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self._ids[c] for c in text], dtype=torch.long)

    def decode(self, ids: torch.Tensor) -> str:
        return "".join(self.chars[i] for i in ids.tolist())


def token_batches(tokens: torch.Tensor, batch_size: int, seq_len: int, steps: int, seed: int = 0) -> Iterator[torch.Tensor]:
    """`steps` batches of shape (batch_size, seq_len + 1) cut at random offsets of `tokens`."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(tokens) - seq_len - 1, (batch_size,), generator=gen)
        yield torch.stack([tokens[s:s + seq_len + 1] for s in starts.tolist()])
