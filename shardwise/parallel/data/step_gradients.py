"""One training step's view of the `GradientBuckets` (gradients.py): which microbatch
reduces, where a pipeline's stages report their last backwards, and the step's mean loss."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

import torch
from torch import nn

if TYPE_CHECKING:
    from .gradients import GradientBuckets


@dataclass
class GradientSync:
    """How a pipeline tells the gradient reduction where it is: `last_backward()` wraps a
    stage's last backward of the step, `final(params)` reports parameters whose gradients are
    final (the stage is done)."""

    last_backward: Callable[[], contextlib.AbstractContextManager]
    final: Callable[[list[nn.Parameter]], None]


class StepGradients:
    """One training step of a `GradientBuckets`: microbatches accumulate, the last backward
    reduces (or, in a pipeline, each stage's last backward), and `finish` returns the mean
    loss over replicas, which rides with the gradients. Outside a synchronized step
    (`no_sync`) nothing is reduced and `finish` returns this replica's loss."""

    def __init__(self, buckets: GradientBuckets):
        self.buckets = buckets
        self.syncing = buckets.sync_enabled

    def microbatch(self, last: bool) -> contextlib.AbstractContextManager:
        """Around a microbatch's forward and backward: the last one reduces; under ZeRO-2/3
        each one reduces into the gradient shards (`reduce_into_shards`), others accumulate."""
        if last:
            return contextlib.nullcontext()
        if self.syncing and not self.buckets.zero.grad_buffer_kept:
            return self.buckets.reduce_into_shards()
        return self.buckets.no_sync()

    def loss(self, local_mean: torch.Tensor) -> None:
        """This replica's mean loss; call before the backward that reduces."""
        if self.syncing:
            self.buckets.stage_loss(local_mean * self.buckets.replica_weight)

    @contextlib.contextmanager
    def pipelined(self) -> Iterator[GradientSync | None]:
        """Around a pipeline schedule: yields how its stages report their last backwards, or
        None outside a synchronized step."""
        with self.buckets.no_sync():
            yield GradientSync(self.buckets.final_backward, self.buckets.grads_final) if self.syncing else None

    def finish(self, local_mean: torch.Tensor) -> torch.Tensor:
        """Complete the reduction; the mean loss over replicas (this replica's without sync)."""
        if not self.syncing:
            return local_mean
        return self.buckets.finish()
