"""Data parallelism: gradients averaged over replicas in flat buckets, overlapped with backward.

Each parameter's gradient lives in a flat bucket buffer: the first gradient of a step is
copied in once by a post-accumulate-grad hook and `.grad` becomes a view of the bucket, so
later microbatches accumulate straight into it. Buckets hold parameters in reverse registration order (roughly
the order backward produces gradients); the same hook counts a bucket down,
and the bucket's all-reduce is launched asynchronously as soon as it is full, so
communication overlaps the rest of backward. Buckets launch strictly in order, so every
rank issues the same collectives in the same order even when ranks see different
parameters unused. One wait at the end of backward finishes the step.

The last bucket to launch carries a tail: one slot per parameter saying whether this
replica produced a gradient for it, and the step's scalars (the loss). Averaged with the
gradients, the tail tells every rank which parameters no replica used — those end the step
with `grad = None`, exactly as on one process, so optimizers skip them — and gives the mean
loss over replicas, at no extra collective. (When the last bucket is not float32 the tail
travels in a small collective of its own.)

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
SCALAR_SLOTS = 1  # step scalars carried in the tail (the loss)


class Bucket:
    """A flat gradient buffer for a run of parameters (plus `tail` spare slots)."""

    def __init__(self, index: int, params: list[nn.Parameter], tail: int = 0):
        self.index = index
        self.params = params
        sizes = [p.numel() for p in params]
        self.buffer = torch.zeros(sum(sizes) + tail, dtype=params[0].dtype, device=params[0].device)
        self.views = [piece.view_as(p) for p, piece in zip(params, self.buffer.split(sizes + [tail]))]
        self.tail = self.buffer[sum(sizes):]
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
        # One replica has nothing to average: no buckets, no hooks, plain autograd gradients.
        runs = list(coalesce(reversed(params), bucket_bytes)) if self.world > 1 else []
        tail = len(params) + SCALAR_SLOTS
        self._tail_in_bucket = bool(runs) and runs[-1][0].dtype == torch.float32
        self.buckets = [
            Bucket(i, run, tail if self._tail_in_bucket and i == len(runs) - 1 else 0) for i, run in enumerate(runs)
        ]
        self._index = {p: i for i, p in enumerate(params)}
        self._slot = {p: (b, view) for b in self.buckets for p, view in zip(b.params, b.views)}
        self.sync_enabled = True
        self.auto_finish = True  # finish at the end of each synchronized backward
        self._reset_window()
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in self._slot]

    def _reset_window(self) -> None:
        self._used = [False] * len(self.params)  # any local gradient since the last sync
        self._ready = [False] * len(self.params)  # gradient final in this synced backward
        self._next = 0  # first bucket not yet launched
        self._dirty = False  # gradients accumulated since the last sync
        self._callback_queued = False
        self._scalars: torch.Tensor | None = None
        self._side: torch.Tensor | None = None
        self._side_work: dist.Work | None = None
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
            bucket.work = None

    # backward ----------------------------------------------------------------------
    def _grad_ready(self, param: nn.Parameter) -> None:
        index = self._index[param]
        bucket, view = self._slot[param]
        if param.grad.data_ptr() != view.data_ptr():  # first gradient since zero_grad: move it in
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

    def stage_scalars(self, scalars: torch.Tensor) -> None:
        """Scalars (at most SCALAR_SLOTS) to average with this step's gradients.

        Call before the step's last backward; `finish()` returns their mean over replicas.
        """
        scalars = scalars.detach().reshape(-1).float()
        if scalars.numel() > SCALAR_SLOTS:
            raise ShardwiseError(f"at most {SCALAR_SLOTS} step scalars can be averaged, got {scalars.numel()}")
        self._scalars = scalars

    def _side_values(self) -> torch.Tensor:
        device = self.buckets[-1].buffer.device
        side = torch.zeros(len(self.params) + SCALAR_SLOTS, device=device)
        side[: len(self.params)] = torch.tensor(self._used, dtype=torch.float32)
        if self._scalars is not None:
            side[len(self.params): len(self.params) + self._scalars.numel()] = self._scalars
        return side

    def _launch(self, bucket: Bucket) -> None:
        if bucket.pending:  # parameters with no gradient in this backward
            for param, view in zip(bucket.params, bucket.views):
                if param.grad is None:
                    view.zero_()  # a peer's gradient may still arrive; finish() decides
                elif param.grad.data_ptr() != view.data_ptr():
                    view.copy_(param.grad)
                param.grad = view
        if self.world > 1:
            if bucket.tail.numel():  # the last bucket: mask and scalars ride along
                bucket.tail.copy_(self._side_values())
            bucket.buffer.mul_(1.0 / self.world)
            self.stats.record("all_reduce", bucket.buffer)
            bucket.work = dist.all_reduce(bucket.buffer, group=self.group, async_op=True)
            if bucket is self.buckets[-1] and not self._tail_in_bucket:
                self._side = self._side_values().mul_(1.0 / self.world)
                self.stats.record("all_reduce", self._side)
                self._side_work = dist.all_reduce(self._side, group=self.group, async_op=True)
        self._next = bucket.index + 1

    def finish(self) -> torch.Tensor | None:
        """Complete synchronization: launch what is left, wait once, settle unused params.

        Returns the mean over replicas of the scalars staged with `stage_scalars`, if any.
        """
        if not self._dirty and self._scalars is None:
            return None
        if not self.buckets:  # one replica: gradients are already final
            scalars = self._scalars
            self._reset_window()
            return scalars
        for bucket in self.buckets[self._next:]:
            self._launch(bucket)
        for bucket in self.buckets:
            wait(bucket.work, f"all-reduce of gradient bucket {bucket.index} ({bucket.nbytes} bytes)", self.group)
        wait(self._side_work, "all-reduce of the unused-parameter mask and step scalars", self.group)
        n = len(self.params)
        side = self.buckets[-1].tail if self._tail_in_bucket else self._side
        if not all(self._used):  # a locally unused parameter keeps its grad only if a peer used it
            used_anywhere = self._used if side is None else side[:n].tolist()
            for param, used in zip(self.params, used_anywhere):
                if not used:  # as on one process: no gradient at all, so optimizers skip it
                    param.grad = None
        scalars = self._scalars
        if scalars is not None and side is not None:
            scalars = side[n: n + scalars.numel()].clone()
        self._reset_window()
        return scalars

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
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset gradients as `torch.optim.Optimizer.zero_grad` does.

        With `set_to_none` (the default) each `.grad` becomes None and the next backward's
        gradient is moved into its bucket once; otherwise buckets are zeroed in place.
        """
        for param in self.params:
            if set_to_none:
                param.grad = None
            elif param not in self._slot:
                if param.grad is not None:
                    param.grad.zero_()
        if not set_to_none:
            for bucket in self.buckets:
                bucket.buffer.zero_()
                for param, view in zip(bucket.params, bucket.views):
                    param.grad = view

    def remove(self) -> None:
        for handle in self._hooks:
            handle.remove()

    def describe(self) -> list[str]:
        return [
            f"bucket {b.index}: {len(b.params)} tensors, {b.nbytes / MiB:.2f} MiB {str(b.buffer.dtype).replace('torch.', '')}"
            + (f" (incl. {b.tail.numel()}-slot mask/loss tail)" if b.tail.numel() else "")
            for b in self.buckets
        ]


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
