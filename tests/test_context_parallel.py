"""Context parallelism's attention: each rank's shard of the queries over the whole sequence's
keys, against one process's attention on the whole sequence (outputs and gradients)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import shardwise as sw
from shardwise.errors import BatchError, ModelError
from shardwise.parallel.context import SequenceShards, context_parallel_attention

# (batch, query heads, key/value heads, head dim, sequence): GQA (4 query heads per kv head)
# and plain multi-head, sequences divisible by 2*cp for cp = 2 and 4.
SHAPES = [(2, 8, 2, 16, 64), (1, 4, 4, 8, 32)]


def _attention_cases(group_sizes: tuple[int, ...]) -> list[dict]:
    """On every rank: for each cp group size and shape and mask kind, the largest difference
    between this rank's result and its rows of one process's result, relative to that
    quantity's largest magnitude (outputs, and gradients of q, k, v)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for size in group_sizes:
        groups = [dist.new_group(list(range(start, start + size))) for start in range(0, world, size)]
        group = groups[rank // size]
        shards = SequenceShards(size, rank % size)
        for shape_index, (b, h, h_kv, d, s) in enumerate(SHAPES):
            for kind_index, kind in enumerate(("causal", "additive mask", "bool mask and causal")):
                generator = torch.Generator().manual_seed(10 * shape_index + kind_index)  # the same on every rank
                q, k, v = (torch.randn(b, heads, s, d, generator=generator, dtype=torch.float64)
                           for heads in (h, h_kv, h_kv))
                weight = torch.randn(b, h, s, d, generator=generator, dtype=torch.float64)
                mask, causal = None, kind != "additive mask"
                if kind == "additive mask":
                    mask = torch.randn(s, s, generator=generator, dtype=torch.float64)
                elif kind == "bool mask and causal":
                    mask = torch.rand(b, 1, s, s, generator=generator) > 0.3
                    mask |= torch.eye(s, dtype=torch.bool)  # every query keeps itself: no empty row
                whole = [t.clone().requires_grad_() for t in (q, k, v)]
                full_mask = mask if not (causal and mask is not None) else mask & torch.ones(s, s).tril().bool()
                out = F.scaled_dot_product_attention(*whole, attn_mask=full_mask, is_causal=causal and mask is None,
                                                     enable_gqa=h != h_kv)
                (out * weight).sum().backward()
                mine = [shards.split(t, 2).detach().requires_grad_() for t in (q, k, v)]
                local = context_parallel_attention(*mine, group, attn_mask=mask, is_causal=causal, enable_gqa=h != h_kv)
                (local * shards.split(weight, 2)).sum().backward()
                pairs = {"out": (local, out), "dq": (mine[0].grad, whole[0].grad), "dk": (mine[1].grad, whole[1].grad),
                         "dv": (mine[2].grad, whole[2].grad)}
                results.append({"case": f"cp={size} {(b, h, h_kv, d, s)} {kind}",
                                **{name: float((got.detach() - shards.split(want, 2)).abs().max() / want.abs().max())
                                   for name, (got, want) in pairs.items()}})
    return results


def test_attention_over_shards_matches_whole_sequence():
    """cp=4 and cp=2 (two groups of two) in one world of 4.

    Tolerance: float64 throughout, so a result differs from one process's only by the order
    of its sums: the gathered keys come in another order than the whole sequence's, and the
    reduce-scatter adds the ranks' key gradients in its own order. Each value is a sum of at
    most s = 64 products over keys (and, for dk/dv, over b*h/h_kv*s query terms, 4*64 = 256),
    so reordering changes it by at most ~256 * 2^-53 ~ 3e-14 of the terms' largest magnitude;
    softmax's exp and normalisation add a few ulps. 1e-11 relative to the quantity's largest
    magnitude leaves two orders of margin for any BLAS or thread count, while a wrong mask,
    a missing reduction or a mis-ordered shard is off by O(1)."""
    for rank_results in sw.testing.run_on_ranks(_attention_cases, 4, (4, 2)):
        assert len(rank_results) == 2 * len(SHAPES) * 3
        for result in rank_results:
            for name in ("out", "dq", "dk", "dv"):
                assert result[name] < 1e-11, f"{result['case']}: {name} differs by {result[name]:.2e} (relative)"


def test_load_balanced_split():
    shards = [SequenceShards(2, r) for r in range(2)]
    assert shards[0].positions(8).tolist() == [0, 1, 6, 7]
    assert shards[1].positions(8).tolist() == [2, 3, 4, 5]
    assert shards[0].gathered_positions(8).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    sequence = torch.arange(16).view(1, 16)
    four = [SequenceShards(4, r).split(sequence, 1).tolist()[0] for r in range(4)]
    assert four == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    # causal work is balanced: the number of (query, key) pairs each rank computes is equal
    work = [sum(p + 1 for p in SequenceShards(4, r).positions(64).tolist()) for r in range(4)]
    assert len(set(work)) == 1
    with pytest.raises(BatchError, match="pad the sequence to a multiple of 8"):
        SequenceShards(4, 0).positions(20)


def _dropout_refused() -> str:
    q = torch.randn(1, 2, 4, 8)
    try:
        context_parallel_attention(q, q, q, dist.group.WORLD, dropout_p=0.1, is_causal=True)
    except ModelError as exc:
        return str(exc)
    return "no error"


def test_attention_dropout_is_refused():
    for message in sw.testing.run_on_ranks(_dropout_refused, 2):
        assert "set the attention dropout to 0 for cp > 1" in message
