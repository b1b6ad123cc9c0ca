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
- Memory: the gathered K and V, O(s · h_kv · d), exist only while one layer's attention
  runs (forward, and again in its backward, which gathers them anew rather than keeping
  them: see `_WholeSequenceAttention`); what a layer keeps for backward is 1/cp of one
  rank's. Ring attention would avoid even the transient gather at the price of cp
  dependent steps with online-softmax merging per layer. torch's `context_parallel` (ring,
  in `torch.distributed.tensor.experimental`) rewrites SDPA through DTensor dispatch and
  is experimental; the gather keeps one exact code path on every backend.

`ContextParallel` applies this to a module: it splits each batch (every tensor with a
sequence dimension; `position_ids` added with the global positions), weights each shard's
loss by its share of the counted label tokens, and, around the module's forward and its
recomputation, routes `F.scaled_dot_product_attention` to `context_parallel_attention`.
Attention computed any other way (an eager softmax over the shard's own keys) and labels the
model shifts itself (Hugging Face's `labels=` path) would be silently wrong across shards:
both are refused. Random numbers drawn for a shard's activations (dropout, a router's input
jitter) are drawn for the whole sequence and cut like it, so every rank applies the masks
one process applies to its tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from torch.overrides import TorchFunctionMode

from ...batch import leaves, map_tensors, split_batch
from ...errors import BatchError, ModelError
from ...tensors import op_name
from ...comm import trace_range
from ..collectives import all_gather_along, reduce_scatter_along

IGNORE_INDEX = -100  # labels equal to it count no token (torch's and Hugging Face's default)


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
        return self.split_for(tensor, dim, self.rank)

    def split_for(self, tensor: torch.Tensor, dim: int, rank: int) -> torch.Tensor:
        """Rank `rank`'s tokens of a whole-sequence tensor."""
        return tensor.index_select(dim, self.positions(tensor.shape[dim], rank, device=tensor.device))


@dataclass(frozen=True)
class SequenceDraws:
    """Random numbers for one rank's tokens (`local_len` of them along `dim`) drawn as one
    process draws them for the whole sequence: dropout's mask, in-place random fills
    (`uniform_`, `normal_`, ...; a router's input jitter) and `rand_like` / `randn_like` of an
    activation (batch, tokens, features...) are drawn for the whole sequence and cut as
    `shards` cuts it. Every cp rank draws from the same generator state, so each applies one
    process's numbers to its tokens."""

    shards: SequenceShards
    dim: int
    local_len: int

    def intercepts(self, func: Any, args: tuple) -> bool:
        if func is not F.dropout and func not in _RANDOM_FILLS and func not in _RANDOM_LIKE:
            return False
        x = args[0] if args else None
        return (isinstance(x, torch.Tensor) and x.dim() >= 3 and x.dim() > self.dim
                and x.shape[self.dim] == self.local_len)

    def run(self, func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
        x, *rest = args
        shape = list(x.shape)
        shape[self.dim] *= self.shards.size
        if func is F.dropout:
            return self._dropout(x, shape, *rest, **kwargs)
        if func in _RANDOM_LIKE:
            return self.shards.split(func(x.new_empty(shape), *rest, **kwargs), self.dim)
        whole = x.new_empty(shape)
        func(whole, *rest, **kwargs)
        return x.copy_(self.shards.split(whole, self.dim))

    def _dropout(self, x: torch.Tensor, shape: list[int], p: float = 0.5, training: bool = True,
                 inplace: bool = False) -> torch.Tensor:
        if not training or p == 0.0:
            return x
        mask = self.shards.split(F.dropout(x.new_ones(shape), p, True), self.dim)
        return x.mul_(mask) if inplace else x * mask


class WholeSequenceDraws(TorchFunctionMode):
    """`SequenceDraws` for every op run inside it (a pipeline's capture of a cp shard: it
    records the random ops as the stages will run them)."""

    def __init__(self, draws: SequenceDraws):
        super().__init__()
        self.draws = draws

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.draws.intercepts(func, args):
            return self.draws.run(func, args, kwargs)
        return func(*args, **kwargs)


def whole_sequence_draws(size: int, dim: int) -> Callable[[Any], WholeSequenceDraws]:
    """For a cp shard of a batch (a microbatch of it): the mode drawing its random numbers as
    the cp ranks do."""
    return lambda part: WholeSequenceDraws(SequenceDraws(SequenceShards(size, 0), dim, part["labels"].shape[dim]))


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
    seq_len = query.shape[-2] * shards.size
    if attn_mask is not None and tuple(attn_mask.shape[-2:]) != (seq_len, seq_len):
        raise ModelError(
            f"under context parallelism attn_mask must cover the whole sequence ({seq_len} x {seq_len}), got "
            f"shape {tuple(attn_mask.shape)}: the model built a mask for its own part of the sequence. Pass no "
            "attention_mask and let attention be causal (Hugging Face builds a mask from attention_mask=, or "
            "from position_ids when use_cache=False: keep the default use_cache)")
    if attn_mask is not None and attn_mask.requires_grad:
        raise ModelError("under context parallelism attn_mask cannot require grad (a learned attention bias): "
                         "its gradient is not computed across sequence shards; detach it or use cp=1")
    options = _AttentionOptions(group, shards, is_causal, scale, enable_gqa)
    return _WholeSequenceAttention.apply(query, key, value, attn_mask, options)


@dataclass(frozen=True)
class _AttentionOptions:
    group: dist.ProcessGroup
    shards: SequenceShards
    is_causal: bool
    scale: float | None
    enable_gqa: bool

    def attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               attn_mask: torch.Tensor | None) -> torch.Tensor:
        """SDPA of this rank's queries over the gathered keys, masks in global positions."""
        seq_len = keys.shape[-2]
        query_pos = self.shards.positions(seq_len, device=query.device)
        key_pos = self.shards.gathered_positions(seq_len, device=query.device)
        mask = None
        if attn_mask is not None:
            mask = attn_mask.index_select(-2, query_pos).index_select(-1, key_pos)
        if self.is_causal:
            causal = key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)
            if mask is None:
                mask = causal
            elif mask.dtype == torch.bool:
                mask = mask & causal
            else:
                mask = mask.masked_fill(~causal, float("-inf"))
        return torch.ops.aten.scaled_dot_product_attention.default(  # the op, which _ShardedAttention passes on
            query, keys, values, mask, 0.0, False, scale=self.scale, enable_gqa=self.enable_gqa)


class _WholeSequenceAttention(torch.autograd.Function):
    """Attention over gathered K/V that saves only this rank's q, k, v for backward.

    Autograd through SDPA would keep the gathered K and V (the whole sequence's, per layer)
    and the s/cp x s mask in global positions, which SDPA expands to floats: together more
    than the rest of a layer's activations at long sequence, so cp would not divide memory
    by cp. Backward gathers K and V again and recomputes this one attention (as Megatron's
    selective recompute does for the attention core): one more attention forward and one
    more all-gather per layer in backward, for memory that falls as 1/cp."""

    @staticmethod
    def forward(ctx, query, key, value, attn_mask, options: _AttentionOptions):
        ctx.save_for_backward(query, key, value, attn_mask)
        ctx.options = options
        dim = key.dim() - 2
        with torch.no_grad(), trace_range("cp all-gather of keys and values"):
            keys, values = (all_gather_along(t, options.group, dim) for t in (key, value))
            return options.attend(query, keys, values, attn_mask)

    @staticmethod
    def backward(ctx, grad):
        query, key, value, attn_mask = ctx.saved_tensors
        options, dim = ctx.options, key.dim() - 2
        with trace_range("cp all-gather of keys and values (backward)"):
            keys, values = (all_gather_along(t.detach(), options.group, dim) for t in (key, value))
        _, attention_backward = torch.func.vjp(lambda q, k, v: options.attend(q, k, v, attn_mask), query.detach(), keys, values)
        dq, dk, dv = attention_backward(grad)
        # each key's gradient sums every rank's queries: reduce-scatter back to the keys' owners
        return dq, reduce_scatter_along(dk, options.group, dim), reduce_scatter_along(dv, options.group, dim), None, None


def sequence_length(batch: Any, size: int, dim: int) -> int:
    """The sequence length of a batch for cp = `size`, after checking what context parallelism
    needs of it: a dict with pre-shifted `labels`, every tensor with a dimension `dim` of that
    length, no padding mask, and a length 2·cp divides."""
    if not isinstance(batch, Mapping) or not isinstance(batch.get("labels"), torch.Tensor):
        raise BatchError(
            f"under context parallelism (cp={size}) the batch must be a dict holding 'labels' (with the inputs, e.g. "
            "'input_ids'): each rank computes the loss of its part of the sequence, and shardwise weights the parts "
            "by their counted labels. Labels must be pre-shifted: labels[:, t] is the target of position t")
    labels = batch["labels"]
    if labels.dim() <= dim:
        raise BatchError(f"batch['labels'] of shape {tuple(labels.shape)} has no sequence dimension {dim}; set "
                         "ParallelConfig(sequence_dim=...) to the dimension that indexes tokens")
    if "attention_mask" in batch:
        raise BatchError(
            "under context parallelism the batch cannot carry an 'attention_mask': a model builds its mask for its "
            "own part of the sequence. Pad sequences on the right and give padded positions the label "
            f"{IGNORE_INDEX}: under a causal mask no real token attends to later padding, so the result is exact")
    seq_len = labels.shape[dim]
    for path, leaf in leaves(batch):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > dim and leaf.shape[dim] != seq_len:
            raise BatchError(
                f"{path} has {leaf.shape[dim]} entries along the sequence dimension {dim}, batch['labels'] has "
                f"{seq_len}: under cp every batch tensor with a sequence dimension is split along it, so they must "
                "agree (set ParallelConfig(sequence_dim=...) if tokens are indexed by another dimension)")
    SequenceShards(size, 0).check(seq_len)
    return seq_len


def shard_batch(batch: Mapping, shards: SequenceShards, dim: int) -> dict:
    """Cp rank `shards.rank`'s part of a whole-sequence batch (checked by `sequence_length`),
    with `position_ids` holding its tokens' global positions when the batch has none."""
    seq_len = sequence_length(batch, shards.size, dim)
    batch = dict(batch)
    if "position_ids" not in batch:
        labels = batch["labels"]
        positions = torch.arange(seq_len, device=labels.device).view(*([1] * dim), seq_len)
        batch["position_ids"] = positions.expand(*labels.shape[:dim + 1])
    return map_tensors(batch, lambda t: shards.split(t, dim) if t.dim() > dim else t)


def check_attention(module: torch.nn.Module) -> None:
    """Refuse, before any rank communicates, a Hugging Face model configured to compute
    attention other than through SDPA (which is what context parallelism routes)."""
    for name, sub in module.named_modules():
        implementation = getattr(getattr(sub, "config", None), "_attn_implementation", None)
        if implementation is not None and implementation != "sdpa":
            raise ModelError(
                f"{name or type(module).__name__} computes attention with {implementation!r}; context parallelism "
                "computes torch.nn.functional.scaled_dot_product_attention over the whole sequence, so load the "
                "model with attn_implementation='sdpa'")


def refuse_shifted_labels(steps: list) -> None:
    """Under pp, the loss is glue code replayed as aten ops, out of the routing mode's sight:
    refuse a captured program that pads an integer tensor with the ignore index (Hugging
    Face's label shift) or sums a loss over the shard's tokens, the way the mode refuses them
    in a forward."""
    for step in steps:
        if step.func is None:
            continue
        name = op_name(step.func)
        if name == "constant_pad_nd" and len(step.args) > 2 and step.args[2] == IGNORE_INDEX:
            raise ModelError(_SHIFTED_LABELS)
        if name in ("nll_loss_forward", "nll_loss2d_forward") and len(step.args) > 3 and step.args[3] == _ATEN_SUM:
            raise ModelError(_SUMMED_LOSS)


class ContextParallel:
    """cp > 1 for one module: batch shards, loss weights, attention across shards (see the
    module docstring). `gathered_bytes` / `gathers` count the K/V all-gathers of the current
    step (their backward reduce-scatters move the same bytes)."""

    def __init__(self, group: dist.ProcessGroup, sequence_dim: int):
        self.group = group
        self.shards = sequence_shards(group)
        self.sequence_dim = sequence_dim
        self.local_len = 0  # tokens per rank in the batch being run
        self.draws = SequenceDraws(self.shards, sequence_dim, 0)  # random numbers for them (set per batch)
        self._counted = [0, 0]  # this step's K/V all-gathers and bytes received, eager
        self._traffic = torch.zeros(2, dtype=torch.int64)  # the same, counted inside compiled code
        self._routing = False  # one routing mode at a time: a second would gather K/V twice

    def shard(self, batch: Any) -> dict:
        """This rank's part of `batch` (see `shard_batch`)."""
        local = shard_batch(batch, self.shards, self.sequence_dim)
        self.local_len = local["labels"].shape[self.sequence_dim]
        self.draws = SequenceDraws(self.shards, self.sequence_dim, self.local_len)
        return local

    def loss_weights(self, batch: Mapping, parts: int) -> list[float]:
        """Per microbatch, the factor for this rank's mean loss so that the mean over the cp
        ranks (the gradient reducer averages over dp × cp) is the mean over every counted
        token of the microbatch: cp · n_rank / n_all. Checks every rank's share, so each
        raises the same error for a shard with no counted label (its mean would be 0/0)."""
        weights = []
        size, dim = self.shards.size, self.sequence_dim
        parts_labels = [part["labels"] for part in split_batch(batch, parts)]
        counts = torch.stack([torch.stack([(self.shards.split_for(labels, dim, rank) != IGNORE_INDEX).sum()
                                           for rank in range(size)]) for labels in parts_labels]).tolist()  # one sync
        for index, (labels, counted) in enumerate(zip(parts_labels, counts)):
            total = sum(counted)
            empty = [rank for rank, n in enumerate(counted) if n == 0]
            if total and empty:
                raise BatchError(
                    f"microbatch {index}: the part of the sequence cp rank {empty[0]} holds (positions "
                    f"{self.shards.positions(labels.shape[dim], empty[0]).tolist()[:4]}...) has only ignored labels "
                    f"({IGNORE_INDEX}), so its mean loss is 0/0; spread ignored tokens (padding) differently, or use "
                    "a shorter padded length")
            weights.append(size * counted[self.shards.rank] / total if total else 1.0)
        return weights

    @contextlib.contextmanager
    def attention(self) -> Iterator[None]:
        """Around a forward (or recomputation) of the module: SDPA over the whole sequence."""
        if self._routing:
            yield
            return
        self._routing = True
        try:
            with _ShardedAttention(self):
                yield
        finally:
            self._routing = False

    def whole_outputs(self, output: Any, weight: float) -> Any:
        """A forward's outputs on this rank's part of the sequence made whole, as one process
        returns them: a scalar (a mean loss, weighted by `weight` from `loss_weights`) is
        combined over the cp ranks, tensors with a sequence dimension are gathered into
        global token order, others are returned as they are."""
        dim, size = self.sequence_dim, self.shards.size

        def whole(t: torch.Tensor) -> torch.Tensor:
            if t.dim() == 0 and t.is_floating_point():
                total = t.float() * (weight / size)
                dist.all_reduce(total, group=self.group)
                return total.to(t.dtype)
            if t.dim() > dim and t.shape[dim] == self.local_len:
                parts = [torch.empty_like(t) for _ in range(size)]
                dist.all_gather(parts, t.contiguous(), group=self.group)
                order = self.shards.gathered_positions(self.local_len * size, device=t.device).argsort()
                return torch.cat(parts, dim).index_select(dim, order)
            return t

        return map_tensors(output, whole)

    def reset_traffic(self) -> None:
        self._counted = [0, 0]
        self._traffic.zero_()

    @property
    def gathers(self) -> int:
        return self._counted[0] + int(self._traffic[0])

    @property
    def gathered_bytes(self) -> int:
        return self._counted[1] + int(self._traffic[1])

    def gathered(self, *tensors: torch.Tensor) -> None:
        """Record the all-gather of `tensors` (K and V of one attention call): in Python ints
        eagerly, in a host tensor inside compiled code (Dynamo would guard on a Python counter's
        value and compile every block anew)."""
        share = (self.shards.size - 1) / self.shards.size
        received = sum(int(t.numel() * t.element_size() * self.shards.size * share) for t in tensors)
        if torch.compiler.is_compiling():
            self._traffic.add_(torch.tensor([len(tensors), received]))
        else:
            self._counted[0] += len(tensors)
            self._counted[1] += received


class _ShardedAttention(TorchFunctionMode):
    """Routes SDPA to `context_parallel_attention`; refuses the two silent mistakes of the
    module docstring (an eager softmax over the shard's own keys, labels shifted by the model)."""

    def __init__(self, cp: ContextParallel):
        super().__init__()
        self.cp = cp

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            query, key, value, *rest = args
            kwargs.update(zip(("attn_mask", "dropout_p", "is_causal", "scale"), rest))
            self.cp.gathered(key, value)
            return context_parallel_attention(query, key, value, self.cp.group, **kwargs)
        if func in _SOFTMAX and _attention_shaped(args[0], self.cp.local_len):
            raise ModelError(
                f"under context parallelism a softmax over a {tuple(args[0].shape)} tensor looks like attention "
                "computed by hand over this rank's keys only; call torch.nn.functional.scaled_dot_product_attention "
                "(Hugging Face: attn_implementation='sdpa'), which shardwise computes over the whole sequence")
        if self.cp.draws.intercepts(func, args):
            return self.cp.draws.run(func, args, kwargs)
        if func is F.pad and _shifts_labels(args, kwargs):
            raise ModelError(_SHIFTED_LABELS)
        if func in _LOSSES and kwargs.get("reduction", args[_LOSSES[func]] if len(args) > _LOSSES[func] else None) == "sum":
            raise ModelError(_SUMMED_LOSS)
        return func(*args, **kwargs)


_SHIFTED_LABELS = (
    f"under context parallelism the model shifts its labels itself (padding them with {IGNORE_INDEX}, as Hugging "
    "Face does for labels=): across sequence shards that pairs tokens with the wrong targets. Pass pre-shifted "
    "labels as shift_labels= (Hugging Face: model(..., labels=labels, shift_labels=labels)) or compute the loss "
    "from labels[:, t] as the target of position t")


_SUMMED_LOSS = (
    "under context parallelism the loss must be a mean over each shard's counted label tokens (shardwise weights "
    "the shards' losses by their token counts to make one process's mean); a loss with reduction='sum' would be "
    "scaled down by that weighting. Use reduction='mean' (the default), or train_step(reduce='tokens') without cp")

_LOSSES = {F.cross_entropy: 6, F.nll_loss: 6}  # position of `reduction` among the positional arguments
_ATEN_SUM = 2  # aten's Reduction::Sum

_SOFTMAX = (F.softmax, torch.softmax, torch.Tensor.softmax)
_RANDOM_FILLS = (torch.Tensor.uniform_, torch.Tensor.normal_, torch.Tensor.bernoulli_, torch.Tensor.exponential_)
_RANDOM_LIKE = (torch.rand_like, torch.randn_like)


def _attention_shaped(x: Any, local_len: int) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() >= 3 and x.shape[-1] == x.shape[-2] == local_len


def _shifts_labels(args: tuple, kwargs: dict) -> bool:
    value = kwargs.get("value", args[3] if len(args) > 3 else None)
    return isinstance(args[0], torch.Tensor) and not args[0].is_floating_point() and value == IGNORE_INDEX
