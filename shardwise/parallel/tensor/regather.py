"""Sequence parallelism's column-parallel inputs, kept for backward as this rank's shard.

Under sequence parallelism a column-parallel module reads its input all-gathered from the
sequence shards, and autograd would keep that whole input for the weight gradient. Here the
module's matmul keeps the shard instead and its backward gathers the input again, as
Megatron-LM's does: the block's activation memory stays 1/tp of the sequence. The gather is
launched first and the input gradient (which needs only the weight) computed while it runs; the
weight gradient waits for it. Modules reading the same input (q, k and v; gate and up) share one
gather, launched by the first of their backwards, freed after the last.

The gather is a c10d all-gather waited through the topology's polled wait (a peer that never
joins is named, not waited for forever). It was a functional collective, launched here and waited
after the matmul. The suite's three native crashes under gloo (a corrupt heap; the two with a
native trace inside gloo's coalesced all-gather, which the functional one runs on) all came in
sequence-parallel tests, two of them in this wait: a lead, not a proven cause.

torch's `parallelize_module` keeps the gathered input whole (tp times the bytes). A saved-tensor
hook around `F.linear` could keep the shard too, but autograd unpacks a node's saved tensors before
it computes anything, so that gather would have nothing to run beside.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ..collectives import all_gather_started


@dataclass
class RegatherCounts:
    """Backward's gathers of kept shards: `beside` (launched before the input gradient's
    matmul) and `exposed` (waited for at once: a module whose input gradient is not needed)."""

    beside: int = 0
    exposed: int = 0


class GatheredInput:
    """A sequence shard whose all-gather backward needs again, once for every column-parallel
    matmul that kept it (`pending`). The matmuls save the shard as autograd saves any input, so
    it is freed with their backward (kept by a retained graph); this object holds it only until
    the block's forward ends (`forget_shard`). Held here as a matmul's attribute instead, it lived
    as long as the graph did: under a pipeline every finished microbatch's shards until the step
    ended (an in-step peak 11-13% over the planner's at pp 2 x tp 2 with sp)."""

    def __init__(self, shard: torch.Tensor, dim: int, group: dist.ProcessGroup, counts: RegatherCounts,
                 waiter: Callable[[dist.Work, str, dist.ProcessGroup], None]):
        self.shard: torch.Tensor | None = shard
        self.dim, self.group, self.counts, self.waiter = dim, group, counts, waiter
        self.pending = 0  # matmuls whose backward has not taken the whole input yet
        self.full: torch.Tensor | None = None  # gathered once per backward, for all of them
        self._arriving: Callable[[], torch.Tensor] | None = None  # the launched gather's wait

    def forget_shard(self) -> None:
        self.shard = None

    def launch(self, shard: torch.Tensor) -> None:
        if self.full is None and self._arriving is None:
            self._arriving = all_gather_started(shard, self.group, self.dim, self.waiter,
                                                "sequence parallelism's gather of a kept input shard")

    def take(self, shard: torch.Tensor, shape: tuple, stride: tuple, offset: int, beside: bool) -> torch.Tensor:
        """The whole input as the matmul read it (waiting for the launched gather)."""
        if self.full is None:
            self.launch(shard)
            self.full, self._arriving = self._arriving(), None
            if beside:
                self.counts.beside += 1
            else:
                self.counts.exposed += 1
        full = self.full.as_strided(shape, stride, offset)
        self.drop()
        return full

    def drop(self) -> None:
        """One matmul's backward is done with the input; after the last, it is freed (a backward
        again through a retained graph gathers it again)."""
        self.pending -= 1
        if self.pending <= 0:
            self.full = None


def column_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv1d: bool) -> torch.Tensor:
    """`nn.Linear`'s x W^T + b, or transformers' `Conv1D`'s x W + b (W stored (in, out))."""
    if not conv1d:
        return torch.nn.functional.linear(x, weight, bias)
    flat = x.reshape(-1, x.shape[-1])
    y = torch.addmm(bias, flat, weight) if bias is not None else flat @ weight
    return y.view(*x.shape[:-1], -1)


class _ColumnMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, gathered: GatheredInput, conv1d: bool):
        ctx.gathered, ctx.conv1d = gathered, conv1d
        ctx.view, ctx.dtypes = (tuple(x.shape), x.stride(), x.storage_offset()), (x.dtype, weight.dtype)
        ctx.bias_dtype = None if bias is None else bias.dtype
        gathered.pending += 1
        ctx.save_for_backward(weight, gathered.shard)
        return column_matmul(x, weight, bias, conv1d)

    @staticmethod
    def backward(ctx, grad):
        weight, shard = ctx.saved_tensors
        needs_x, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        gathered = ctx.gathered
        x_dtype, weight_dtype = ctx.dtypes
        flat = grad.reshape(-1, grad.shape[-1])
        if needs_weight:
            gathered.launch(shard)
        grad_x = grad_weight = grad_bias = None
        if needs_x:  # beside the gather (in the gradient's dtype: autocast's forward computed in it)
            weight = weight.to(grad.dtype)
            grad_x = (flat @ (weight.t() if ctx.conv1d else weight)).view(*grad.shape[:-1], -1).to(x_dtype)
        if needs_weight:
            x = gathered.take(shard, *ctx.view, beside=needs_x)
            x = x.reshape(-1, x.shape[-1]).to(grad.dtype)
            grad_weight = (x.t() @ flat if ctx.conv1d else flat.t() @ x).to(weight_dtype)
        else:  # a frozen weight: nothing to gather for
            gathered.drop()
        if ctx.bias_dtype is not None and needs_bias:
            grad_bias = flat.sum(0).to(ctx.bias_dtype)
        return grad_x, grad_weight, grad_bias, None, None


def column_matmul_keeping_shard(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                gathered: GatheredInput, conv1d: bool) -> torch.Tensor:
    """A column-parallel module's matmul on `x`, all-gathered from `gathered`'s shard, keeping
    only the shard for backward."""
    return _ColumnMatmul.apply(x, weight, bias, gathered, conv1d)
