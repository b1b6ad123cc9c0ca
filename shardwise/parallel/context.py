"""Context parallelism's building blocks: the load-balanced sequence split and attention over
the whole sequence from one shard of the queries.

A cp group shares one batch and splits its sequence into 2·cp chunks; rank i keeps chunks i
and 2·cp−1−i (as Megatron and torch's context parallel do), so under a causal mask every
rank has the same amount of attention work: early chunks attend to few keys, late ones to
many.

Attention algorithm: all-gather of K and V along the sequence (as Llama 3's long-context
training did), not ring attention or all-to-all over heads.
- Exact and simple: each rank's queries run one ordinary `scaled_dot_product_attention` over
  every key, with the causal mask written in global positions; the backward of the gather
  is a reduce-scatter, which sums every rank's contribution to each key's gradient.
- GQA costs nothing extra: K and V travel with their own (fewer) heads and are not repeated
  before the gather (`enable_gqa`).
- Memory is O(s · h_kv · d) per layer for the gathered K and V, the same order as one
  layer's activations at sequence s; ring attention would save that at the price of cp
  dependent steps with online-softmax merging per layer. torch's `context_parallel` (ring,
  in `torch.distributed.tensor.experimental`) rewrites SDPA through DTensor dispatch and
  is experimental; the gather keeps one exact code path on every backend.

This module does not yet make `cp > 1` runnable (the config still refuses it): the batch
split, the loss weighting and the hook into a module's forward come next (issue 12).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import Shard

from ..errors import BatchError, ModelError
from .collectives import enter_parallel


@dataclass(frozen=True)
class SequenceShards:
    """Which tokens of a sequence each of `size` cp ranks holds (two chunks each)."""

    size: int
    rank: int

    def check(self, seq_len: int) -> None:
        if seq_len % (2 * self.size):
            raise BatchError(
                f"a sequence of {seq_len} tokens cannot be split over cp={self.size}: context parallelism cuts it "
                f"into 2*cp = {2 * self.size} equal chunks; pad the sequence to a multiple of {2 * self.size}")

    def positions(self, seq_len: int, rank: int | None = None, device: torch.device | None = None) -> torch.Tensor:
        """The global positions of rank `rank`'s tokens (this rank's by default), in the order it holds them."""
        self.check(seq_len)
        rank = self.rank if rank is None else rank
        chunk = seq_len // (2 * self.size)
        first, second = rank, 2 * self.size - 1 - rank
        return torch.cat([torch.arange(first * chunk, (first + 1) * chunk, device=device),
                          torch.arange(second * chunk, (second + 1) * chunk, device=device)])

    def gathered_positions(self, seq_len: int, device: torch.device | None = None) -> torch.Tensor:
        """Global positions of the tokens in the order an all-gather over the cp ranks lays them out."""
        return torch.cat([self.positions(seq_len, r, device) for r in range(self.size)])

    def split(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's tokens of a whole-sequence tensor (its two chunks along `dim`, concatenated)."""
        return tensor.index_select(dim, self.positions(tensor.shape[dim], device=tensor.device))


def sequence_shards(group: dist.ProcessGroup) -> SequenceShards:
    return SequenceShards(dist.get_world_size(group), dist.get_rank(group))


def context_parallel_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               group: dist.ProcessGroup, *, attn_mask: torch.Tensor | None = None,
                               dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                               enable_gqa: bool = False) -> torch.Tensor:
    """`F.scaled_dot_product_attention` for this rank's shard of the sequence (dim -2 of each
    argument, split by `SequenceShards`), over the keys and values of the whole sequence.

    `attn_mask`, if given, is the whole sequence's mask (..., s, s), as one process would
    pass it; it is cut to this rank's query rows and laid out like the gathered keys.
    """
    if dropout_p:
        raise ModelError(
            f"attention dropout (dropout_p={dropout_p}) under context parallelism would draw other masks than one "
            "process draws; set the attention dropout to 0 for cp > 1")
    shards = sequence_shards(group)
    local_len = query.shape[-2]
    seq_len = local_len * shards.size
    device = query.device
    keys = enter_parallel(key, Shard(key.dim() - 2), group)  # backward: reduce-scatter, summing every rank's queries
    values = enter_parallel(value, Shard(value.dim() - 2), group)
    query_pos = shards.positions(seq_len, device=device)
    key_pos = shards.gathered_positions(seq_len, device=device)
    mask = None
    if attn_mask is not None:
        if tuple(attn_mask.shape[-2:]) != (seq_len, seq_len):
            raise ModelError(f"under context parallelism attn_mask must cover the whole sequence ({seq_len} x "
                             f"{seq_len}), got shape {tuple(attn_mask.shape)}")
        mask = attn_mask.index_select(-2, query_pos).index_select(-1, key_pos)
    if is_causal:
        causal = key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)
        if mask is None:
            mask = causal
        elif mask.dtype == torch.bool:
            mask = mask & causal
        else:
            mask = mask.masked_fill(~causal, float("-inf"))
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
