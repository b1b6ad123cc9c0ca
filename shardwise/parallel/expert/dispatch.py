"""Dropless token dispatch and combine by all-to-all, differentiable.

Each token slot (a token and one of its top-k experts) travels to the rank holding that
expert, is computed there, and comes back; nothing is dropped, so the result is what one
process computes. The moves are autograd functions whose backward is the reverse all-to-all.

Gradients of a replica's loss are weighted by its share of the batch (`GradientBuckets`
multiplies a bucket by it before reducing). An expert's gradient mixes token slots from
every rank of its ep group, so the weight is applied where those slots come from instead:
the gradient sent back to an expert is multiplied by the sender's weight, and the gradient
returned to the sender divided by it again (the expert buckets then apply no weight).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

Waiter = Callable[[dist.Work, str, dist.ProcessGroup], None]


def all_to_all(x: torch.Tensor, send: list[int], receive: list[int], group: dist.ProcessGroup, waiter: Waiter,
               what: str) -> torch.Tensor:
    """Rows of `x` in blocks `send[i]` to rank i of `group`; returns the blocks received, in rank order."""
    x = x.contiguous()
    out = x.new_empty((sum(receive), *x.shape[1:]))
    waiter(dist.all_to_all_single(out, x, receive, send, group=group, async_op=True), what, group)
    return out


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send, receive, group, waiter, what):
        ctx.args = (send, receive, group, waiter, what)
        return all_to_all(x, send, receive, group, waiter, what)

    @staticmethod
    def backward(ctx, grad):
        send, receive, group, waiter, what = ctx.args
        return all_to_all(grad, receive, send, group, waiter, f"backward of {what}"), None, None, None, None, None


class _OriginWeight(torch.autograd.Function):
    """Identity forward; the backward multiplies (or divides) by the replica weight, read then."""

    @staticmethod
    def forward(ctx, x, weight, divide):
        ctx.weight, ctx.divide = weight, divide
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        w = ctx.weight()
        if w == 1.0:
            return grad, None, None
        return (grad / w if ctx.divide else grad * w), None, None


def exchange(x: torch.Tensor, send: list[int], receive: list[int], group: dist.ProcessGroup, waiter: Waiter,
             what: str) -> torch.Tensor:
    """`all_to_all`, differentiable: the gradient goes back the way the rows came."""
    return _Exchange.apply(x, send, receive, group, waiter, what)


def weighted_at_origin(x: torch.Tensor, weight: Callable[[], float], divide: bool = False) -> torch.Tensor:
    return _OriginWeight.apply(x, weight, divide)


class Routing:
    """Where this rank's token slots go: sorted by expert, counted per rank of the ep group,
    and what each rank sends here (one small all-to-all of per-expert counts)."""

    def __init__(self, index: torch.Tensor, num_experts: int, group: dist.ProcessGroup, waiter: Waiter, what: str):
        size = dist.get_world_size(group)
        local = num_experts // size
        flat = index.reshape(-1)
        # a slot whose index is not an expert (transformers marks "no expert" as num_experts) computes nothing
        slots = torch.nonzero((flat >= 0) & (flat < num_experts)).squeeze(1)
        expert = flat[slots]
        order = torch.argsort(expert, stable=True)  # by expert, then token: one process's summation order
        self.slots, expert = slots[order], expert[order]
        self.token = self.slots // index.shape[-1]
        counts = torch.bincount(expert, minlength=num_experts)
        received = all_to_all(counts, [local] * size, [local] * size, group, waiter, f"{what}: token counts")
        self.send = counts.view(size, local).sum(1).tolist()
        self.receive = received.view(size, local).sum(1).tolist()
        self.received_per_expert = received.view(size, local).sum(0)  # tokens each local expert computes
        # each received row's local expert: blocks per source rank, sorted by expert inside
        self.local_expert = torch.repeat_interleave(torch.arange(local, device=index.device).repeat(size), received)
