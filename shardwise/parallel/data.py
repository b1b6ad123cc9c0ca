"""Data parallelism: gradients averaged over replicas in flat buckets, overlapped with backward.

Each parameter's `.grad` is a view into a flat bucket buffer, so autograd accumulates
straight into the buffers. Buckets hold parameters in reverse registration order (roughly
the order backward produces gradients); a post-accumulate-grad hook counts a bucket down,
and the bucket's all-reduce is launched asynchronously as soon as it is full, so
communication overlaps the rest of backward. Buckets launch strictly in order, so every
rank issues the same collectives in the same order even when ranks see different
parameters unused. One wait at the end of backward finishes the step.

A small side collective carries, per parameter, whether any replica produced a gradient:
a parameter no replica used ends the step with `grad = None`, exactly as it would on one
process (an optimizer then skips it), while one used by some replicas gets the correct
average. The same collective carries scalars such as the step's loss, so the mean loss
over replicas costs no extra round trip.

Why not torch's DistributedDataParallel: later layouts need this same pass to
reduce-scatter (ZeRO-1/2) and to sum tensor-parallel partial gradients, and DDP owns its
buckets; DDP also makes unused parameters a mode (find_unused_parameters) with its own
cost, where here they are always handled.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from ..comm import CommStats, broadcast_tensors, coalesce, wait
from ..config import ParallelConfig
from ..errors import ShardwiseError
from ..topology import Topology

MiB = 1 << 20


class Bucket:
    """A flat gradient buffer for a run of parameters, synchronized by one collective."""

    def __init__(self, index: int, params: list[nn.Parameter]):
        self.index = index
        self.params = params
        self.buffer = torch.zeros(
            sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device
        )
        self.views = [piece.view_as(p) for p, piece in zip(params, self.buffer.split([p.numel() for p in params]))]
        self.pending = len(params)
        self.work: dist.Work | None = None

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


class GradientBuckets:
    """Bucketed, overlapped gradient averaging over one process group.

    `no_sync()` accumulates without communicating; the next synchronized backward (or
    `finish()`) reduces everything accumulated since the last synchronization.
    """

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup, bucket_bytes: int):
        if not params:
            raise ShardwiseError("no trainable parameters to synchronize")
        self.group = group
        self.world = dist.get_world_size(group)
        self.params = params
        self.stats = CommStats()
        self.buckets = [Bucket(i, run) for i, run in enumerate(coalesce(reversed(params), bucket_bytes))]
        self._index = {p: i for i, p in enumerate(params)}
        self._slot = {p: (b, view) for b in self.buckets for p, view in zip(b.params, b.views)}
        self.sync_enabled = True
        self.auto_finish = True  # finish at the end of each synchronized backward
        self._reset_window()
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in params]

    def _reset_window(self) -> None:
        self._used = [False] * len(self.params)  # any local gradient since the last sync
        self._ready = [False] * len(self.params)  # gradient final in this synced backward
        self._next = 0  # first bucket not yet launched
        self._dirty = False  # gradients accumulated since the last sync
        self._callback_queued = False
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
            bucket.work = None

    # backward ----------------------------------------------------------------------
    def _grad_ready(self, param: nn.Parameter) -> None:
        index = self._index[param]
        bucket, view = self._slot[param]
        if param.grad.data_ptr() != view.data_ptr():  # grad was reset (set_to_none) or replaced
            view.copy_(param.grad)
            param.grad = view
        self._used[index] = self._dirty = True
        if not self.sync_enabled:
            return
        if self._ready[index]:
            raise ShardwiseError(
                "a parameter received a second gradient before its bucket was synchronized; "
                "accumulate gradients inside `pmodel.no_sync()` or use config.microbatches"
            )
        self._ready[index] = True
        bucket.pending -= 1
        if self.auto_finish and not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_after_backward)
            self._callback_queued = True
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._launch(self.buckets[self._next])

    def _finish_after_backward(self) -> None:
        self.finish()

    def _launch(self, bucket: Bucket) -> None:
        if bucket.pending:  # parameters with no gradient in this backward
            for param, view in zip(bucket.params, bucket.views):
                if param.grad is None:
                    view.zero_()  # a peer's gradient may still arrive; finish() decides
                elif param.grad.data_ptr() != view.data_ptr():
                    view.copy_(param.grad)
                param.grad = view
        if self.world > 1:
            bucket.buffer.mul_(1.0 / self.world)
            self.stats.record("all_reduce", bucket.buffer)
            bucket.work = dist.all_reduce(bucket.buffer, group=self.group, async_op=True)
        self._next = bucket.index + 1

    def finish(self, scalars: torch.Tensor | None = None) -> torch.Tensor | None:
        """Complete synchronization: launch what is left, wait once, settle unused params.

        `scalars` (a 1-d float tensor, e.g. the local mean loss) are averaged over the
        group in the same side collective; the averages are returned.
        """
        if not self._dirty and scalars is None:
            return None
        for bucket in self.buckets[self._next:]:
            self._launch(bucket)
        n = len(self.params)
        if scalars is not None:
            scalars = scalars.detach().to(self.buckets[0].buffer.device, torch.float32).reshape(-1)
        side, side_work = None, None
        if self.world > 1:
            side = torch.tensor(self._used, dtype=torch.float32, device=self.buckets[0].buffer.device)
            if scalars is not None:
                side = torch.cat([side, scalars])
            self.stats.record("all_reduce", side)
            side_work = dist.all_reduce(side, group=self.group, async_op=True)
        for bucket in self.buckets:
            wait(bucket.work, f"all-reduce of gradient bucket {bucket.index} ({bucket.nbytes} bytes)", self.group)
        wait(side_work, "all-reduce of the unused-parameter mask and step scalars", self.group)
        if not all(self._used):  # a locally unused parameter keeps its grad only if a peer used it
            used_anywhere = self._used if side is None else side[:n].tolist()
            for param, used in zip(self.params, used_anywhere):
                if not used:  # as on one process: no gradient at all, so optimizers skip it
                    param.grad = None
        self._reset_window()
        if scalars is None or side is None:
            return scalars
        return side[n:] / self.world

    # controls ----------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        previous, self.sync_enabled = self.sync_enabled, False
        try:
            yield
        finally:
            self.sync_enabled = previous

    @contextlib.contextmanager
    def manual_finish(self) -> Iterator[None]:
        """Within this block the caller calls `finish()` itself (train_step does)."""
        previous, self.auto_finish = self.auto_finish, False
        try:
            yield
        finally:
            self.auto_finish = previous

    @torch.no_grad()
    def zero_grad(self) -> None:
        """Zero every bucket and point each `.grad` back at its bucket view."""
        for bucket in self.buckets:
            bucket.buffer.zero_()
            for param, view in zip(bucket.params, bucket.views):
                param.grad = view

    def remove(self) -> None:
        for handle in self._hooks:
            handle.remove()

    def describe(self) -> list[str]:
        lines = []
        for b in self.buckets:
            lines.append(f"bucket {b.index}: {len(b.params)} tensors, {b.nbytes / MiB:.2f} MiB {b.buffer.dtype}")
        return lines


def apply_data_parallel(module: nn.Module, topology: Topology, config: ParallelConfig) -> GradientBuckets:
    """Make the replicas of `module` start identical and average their gradients.

    Parameters and buffers are broadcast from the group's first rank; gradients are
    averaged over the data-parallel (and context-parallel) ranks.
    """
    group = topology.group("dp", "cp")
    bucket_bytes = int(config.bucket_mb * MiB)
    buckets = GradientBuckets([p for p in module.parameters() if p.requires_grad], group, bucket_bytes)
    state = list(module.parameters()) + list(module.buffers())
    broadcast_tensors([t.data for t in state], group, bucket_bytes, buckets.stats)
    return buckets
