"""Buffers across data-parallel replicas: broadcast from the first replica, and BatchNorm
statistics over the whole data-parallel batch.

`BufferBroadcast` makes every replica's buffers (BatchNorm running statistics, counters)
those of data-parallel rank 0, as DDP's `broadcast_buffers=True` does: one broadcast per
dtype of all of this rank's buffers flattened together.

`SyncedBatchNorm` replaces each BatchNorm layer (same parameters and buffers, same state-dict
names) with one whose training statistics are taken over every replica's samples: the
per-channel sum and count, then the sum of squared deviations from the global mean (two
passes, so a large mean does not cancel the variance away), each all-reduced over the
data-parallel group by a differentiable all-reduce whose backward all-reduces the gradient.
So the forward, the running statistics and the gradients are those of one process on the
replicas' batches concatenated. torch's `nn.SyncBatchNorm` computes the same, but only on
CUDA-like devices (it refuses CPU tensors), so it cannot serve gloo ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.modules.batchnorm import _BatchNorm

from ...coordination import _agreed
from ...errors import BatchError
from ..collectives import all_reduce_sum


class BufferBroadcast:
    """Copies data-parallel rank 0's buffers to every replica (all dtypes, few messages)."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup, src: int):
        self.module = module
        self.group = group
        self.src = src  # global rank

    def __call__(self) -> None:
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for buffer in self.module.buffers():
            local = buffer.to_local() if isinstance(buffer, DTensor) else buffer
            by_dtype.setdefault(local.dtype, []).append(local)
        for tensors in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in tensors])
            dist.broadcast(flat, src=self.src, group=self.group)
            for tensor, value in zip(tensors, flat.split([t.numel() for t in tensors])):
                tensor.copy_(value.view_as(tensor))


class SyncedBatchNorm(_BatchNorm):
    """A BatchNorm layer whose training statistics span the data-parallel group."""

    def __init__(self, source: _BatchNorm, group: dist.ProcessGroup):
        super().__init__(source.num_features, source.eps, source.momentum, source.affine,
                         source.track_running_stats, device="meta")
        self.weight, self.bias = source.weight, source.bias
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            setattr(self, name, getattr(source, name))
        self.training = source.training
        self.group = group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        if not self.training:
            return super().forward(x)  # running statistics (or this sample's, as BatchNorm does)
        work = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x  # statistics in float32 at least
        dims = [0] + list(range(2, x.dim()))
        shape = [1, -1] + [1] * (x.dim() - 2)
        count = x.numel() // x.shape[1]
        counts = torch.tensor([count, count * count], dtype=torch.float64, device=x.device)  # exact in float64
        totals = all_reduce_sum(torch.cat([work.sum(dims).double(), counts]), self.group)
        n, squares = float(totals[-2].detach()), float(totals[-1].detach())
        if squares * dist.get_world_size(self.group) != n * n:  # the same verdict on every rank
            raise _agreed(BatchError, f"sync_batchnorm: the data-parallel replicas' batches differ in size (one "
                          f"holds {count} values per channel, the mean is {n / dist.get_world_size(self.group):g}); "
                          "BatchNorm's gradient over the whole batch needs equal replica batches: give every "
                          "replica the same number of samples")
        mean = (totals[:-2] / n).to(work.dtype)
        centered = work - mean.view(shape)
        var = all_reduce_sum(centered.pow(2).sum(dims), self.group) / n
        y = centered * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
                self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
                unbiased = var.detach() * (n / max(n - 1, 1.0))
                self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)
        return y.to(x.dtype)


def sync_batchnorm(module: nn.Module, group: dist.ProcessGroup) -> list[str]:
    """Replace every BatchNorm layer of `module` in place; returns their names."""
    replaced = []
    for name, child in list(module.named_modules()):
        for attr, sub in list(child.named_children()):
            if isinstance(sub, _BatchNorm) and not isinstance(sub, SyncedBatchNorm):
                setattr(child, attr, SyncedBatchNorm(sub, group))
                replaced.append(f"{name}.{attr}" if name else attr)
    return replaced

