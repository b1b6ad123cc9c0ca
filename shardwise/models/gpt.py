"""A small GPT used by the demo, the tests and the benchmarks.

End2end: `forward(batch)` returns the mean next-token cross-entropy, where `batch` is a
LongTensor of shape (B, T + 1) (inputs are the first T tokens, targets the last T) or a
dict with "input_ids" and pre-shifted "labels" of shape (B, T) (labels -100 are ignored),
and optionally "position_ids" (context parallelism adds them: a rank holds tokens from two
places in the sequence). Attention reshapes with -1 heads and
takes the sequence length from its projections, so a tensor-parallel shard (fewer local
heads) or a sequence shard runs the same code; the output head shares the token
embedding's weight by default. `attn_dropout` drops attention probabilities inside SDPA;
`dropout` applies to embeddings and residual branches.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    vocab_size: int = 64
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64
    dropout: float = 0.0
    attn_dropout: float = 0.0
    tie_embeddings: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.d_model % cfg.n_head:
            raise ValueError(f"d_model={cfg.d_model} is not divisible by n_head={cfg.n_head}")
        self.head_dim = cfg.d_model // cfg.n_head
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model)
        # No key bias: it shifts every score of a query equally, softmax ignores it, and its
        # gradient is zero up to rounding noise (which Adam would blow up to full-size steps).
        self.k_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.o_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.attn_dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        b, t = q.shape[:2]  # from the projections: under sequence parallelism x is a sequence shard
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.fc2 = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig | None = None):
        super().__init__()
        self.cfg = cfg = cfg or GPTConfig()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.block_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith(("o_proj.weight", "fc2.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:  # (given ones past block_size fail in the embedding lookup)
            t = input_ids.shape[1]
            if t > self.cfg.block_size:
                raise ValueError(f"sequence length {t} exceeds block_size={self.cfg.block_size}")
            position_ids = torch.arange(t, device=input_ids.device)
        x = self.drop(self.wte(input_ids) + self.wpe(position_ids))
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.ln_f(x))

    def forward(self, batch: Any) -> torch.Tensor:
        positions = None
        if isinstance(batch, Mapping):
            input_ids, labels, positions = batch["input_ids"], batch["labels"], batch.get("position_ids")
        else:
            input_ids, labels = batch[:, :-1], batch[:, 1:]
        logits = self.logits(input_ids, positions)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())

    @staticmethod
    def count_tokens(batch: Any) -> int:
        """The tokens `forward` reads from `batch` (a tensor batch's last column is labels only;
        step metrics use this, metrics.py)."""
        return batch["input_ids"].numel() if isinstance(batch, Mapping) else batch[:, :-1].numel()
