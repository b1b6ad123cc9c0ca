"""Differentiable collectives over the tensor-parallel group, on local tensors.

Activations between tensor-parallel modules stay plain tensors; their placement on the tp
mesh is known from the plan, and moving between placements is one of the functions here.
Each is an autograd function whose backward is the matching collective (all-gather <->
reduce-scatter or split, all-reduce <-> identity), written with torch's functional
collectives so `CommDebugMode` counts them exactly as it counts native DTensor traffic.

Two families:
- `redistribute(x, src, dst)`: DTensor semantics; the gradient of a replicated tensor is
  replicated (backward of an all-gather is a split).
- `enter_parallel(x, src)`: the input of a column-parallel or vocab-parallel module, whose
  input gradient is partial on every rank (Megatron's `f`/`g`): identity or all-gather
  forward, all-reduce or reduce-scatter backward.
- `across_losses(x, kind)`: over ranks that compute different losses whose gradients are
  then combined (data-parallel replicas, context-parallel shards). The backward must make
  the ranks' gradients sum to the gradient of the losses' sum, so a gradient that reaches a
  collective's output on any rank flows to every input it came from: sum <-> sum, gather <->
  reduce-scatter, split <-> this rank's slice, zeros elsewhere (no communication).

Both take `ops`, the three collectives they are made of: the functional ones (traceable,
their waits block), or `polled_ops`, c10d twins for eager code whose waits go through a
waiter that polls (the coordinator's), so the public helpers (`sw.reduce`, ...) called on one
rank only fail within seconds, naming the collective each rank waits in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from ..compat import all_gather_single, functional_all_gather, functional_reduce_scatter, reduce_scatter_single
from ..errors import PlanError

def _dim(placement: Shard, x: torch.Tensor) -> int:
    return placement.dim % x.dim()


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    return funcol.wait_tensor(funcol.all_reduce(x.contiguous(), "sum", group))


def _all_gather(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    return _joined(funcol.wait_tensor(functional_all_gather(x.contiguous(), 0, group)), group, dim)


def _joined(gathered: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    if dim == 0:
        return gathered
    # the ranks' parts come stacked on dim 0; funcol's own re-concatenation along `dim` is a
    # function torch 2.11's Dynamo refuses to trace inside an autograd.Function (cp attention)
    return torch.cat(gathered.chunk(dist.get_world_size(group), 0), dim)


def all_gather_started(x: torch.Tensor, group: dist.ProcessGroup, dim: int,
                       waiter: Callable[[dist.Work, str, dist.ProcessGroup], None], what: str
                       ) -> Callable[[], torch.Tensor]:
    """Launch the all-gather of `x` along `dim` now (eager code, c10d); the returned function
    waits for it through `waiter(work, what, group)` (a coordinator's polled wait, which names
    a peer that never joins) and gives every rank's `x` concatenated in rank order (not
    differentiable)."""
    x, size = x.contiguous(), dist.get_world_size(group)
    out = x.new_empty((size * x.shape[0], *x.shape[1:]) if x.dim() else (size,))
    work = all_gather_single(out, x, group=group, async_op=True)

    def arrive() -> torch.Tensor:
        waiter(work, what, group)
        return _joined(out, group, dim)

    return arrive


def all_gather_along(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """Every rank's `x` concatenated along `dim`, in rank order (not differentiable)."""
    return _all_gather(x, group, dim)


def reduce_scatter_along(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """The sum over ranks of `x`, this rank's 1/size of it along `dim` (not differentiable)."""
    return _reduce_scatter(x, group, dim)


def _divisible(x: torch.Tensor, dim: int, size: int) -> None:
    if x.shape[dim] % size:
        raise PlanError(
            f"cannot shard a tensor of shape {tuple(x.shape)} along dim {dim} over tp={size}: "
            f"{x.shape[dim]} is not divisible by {size} (for sequence parallelism the sequence length must be)"
        )


def _reduce_scatter(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    _divisible(x, dim, dist.get_world_size(group))
    return funcol.wait_tensor(functional_reduce_scatter(x.contiguous(), "sum", dim, group))


def _split(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    size = dist.get_world_size(group)
    _divisible(x, dim, size)
    return x.chunk(size, dim)[dist.get_rank(group)].contiguous()


def _identity(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    return x.view_as(x)


def _zero_padded(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """`x` as this rank's slice along `dim` of a tensor `size` times longer, zeros elsewhere."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    shape = list(x.shape)
    shape[dim] *= size
    out = x.new_zeros(shape)
    out.narrow(dim, rank * x.shape[dim], x.shape[dim]).copy_(x)
    return out


@dataclass(frozen=True)
class CollectiveOps:
    """The collectives the differentiable moves are made of, each `(x, group, dim) -> tensor`."""

    all_reduce: Callable
    all_gather: Callable
    reduce_scatter: Callable


FUNCTIONAL = CollectiveOps(_all_reduce, _all_gather, _reduce_scatter)


def polled_ops(waiter: Callable[[dist.Work, str, dist.ProcessGroup], None], what: str) -> CollectiveOps:
    """Eager c10d twins of the functional collectives; each waits through `waiter(work,
    description, group)` (a coordinator's `wait`: it polls, and names peers waiting elsewhere)."""
    def all_reduce(x, group, dim):
        out = x.contiguous().clone()
        waiter(dist.all_reduce(out, group=group, async_op=True), f"{what}: all-reduce", group)
        return out

    def all_gather(x, group, dim):
        return all_gather_started(x, group, dim, waiter, f"{what}: all-gather")()

    def reduce_scatter(x, group, dim):
        size = dist.get_world_size(group)
        _divisible(x, dim, size)
        moved = x.movedim(dim, 0).contiguous()
        out = moved.new_empty((moved.shape[0] // size, *moved.shape[1:]))
        waiter(reduce_scatter_single(out, moved, group=group, async_op=True), f"{what}: reduce-scatter", group)
        return out.movedim(0, dim)

    return CollectiveOps(all_reduce, all_gather, reduce_scatter)


class _Collective(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, forward_op, backward_op, group, dim):
        ctx.backward_op, ctx.group, ctx.dim = backward_op, group, dim
        return forward_op(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_op(grad, ctx.group, ctx.dim), None, None, None, None


def _apply(x: torch.Tensor, forward_op, backward_op, group, dim: int = 0) -> torch.Tensor:
    if dist.get_world_size(group) == 1:
        return x
    return _Collective.apply(x, forward_op, backward_op, group, dim)


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum of `x` over `group`, differentiable: its gradient is the sum of the ranks' gradients."""
    return _apply(x, _all_reduce, _all_reduce, group)


def across_losses(x: torch.Tensor, kind: str, group: dist.ProcessGroup, dim: int = 0,
                  ops: CollectiveOps = FUNCTIONAL) -> torch.Tensor:
    """`kind` ("sum", "gather" or "split" along `dim`) over ranks whose losses differ."""
    pairs = {"sum": (ops.all_reduce, ops.all_reduce), "gather": (ops.all_gather, ops.reduce_scatter),
             "split": (_split, _zero_padded)}
    forward_op, backward_op = pairs[kind]
    return _apply(x, forward_op, backward_op, group, dim % x.dim() if x.dim() else 0)


def redistribute(x: torch.Tensor, src: Placement, dst: Placement, group: dist.ProcessGroup,
                 ops: CollectiveOps = FUNCTIONAL) -> torch.Tensor:
    """Move a local tensor from placement `src` to `dst` on the tp group."""
    if src == dst:
        return x
    if isinstance(dst, Partial):
        raise PlanError(f"cannot redistribute an activation to Partial() (from {src}); use Replicate() or Shard(d)")
    if isinstance(src, Partial):
        if isinstance(dst, Replicate):
            return _apply(x, ops.all_reduce, _identity, group)
        return _apply(x, ops.reduce_scatter, ops.all_gather, group, _dim(dst, x))
    if isinstance(src, Shard) and isinstance(dst, Replicate):
        return _apply(x, ops.all_gather, _split, group, _dim(src, x))
    if isinstance(src, Replicate) and isinstance(dst, Shard):
        return _apply(x, _split, ops.all_gather, group, _dim(dst, x))
    gathered = redistribute(x, src, Replicate(), group, ops)  # Shard(a) -> Shard(b)
    return redistribute(gathered, Replicate(), dst, group, ops)


def enter_parallel(x: torch.Tensor, src: Placement, group: dist.ProcessGroup) -> torch.Tensor:
    """A replicated view of `x` for modules whose input gradient is partial on every rank."""
    if isinstance(src, Replicate):
        return _apply(x, _identity, _all_reduce, group)
    if isinstance(src, Shard):
        return _apply(x, _all_gather, _reduce_scatter, group, _dim(src, x))
    return _apply(x, _all_reduce, _all_reduce, group)  # Partial input
