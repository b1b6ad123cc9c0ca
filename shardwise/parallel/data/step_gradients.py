"""One training step's view of the `GradientBuckets` (gradients.py): which microbatch
reduces, where a pipeline's stages report their last backwards, and the step's mean loss."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

import torch
from torch import nn

from ...errors import ConfigError
from ...tensors import local

if TYPE_CHECKING:
    from .gradients import GradientBuckets


@dataclass
class GradientSync:
    """How a pipeline tells the gradient reduction where it is: `last_backward()` wraps a
    stage's last backward of the step, `final(params)` reports parameters whose gradients are
    final (the stage is done)."""

    last_backward: Callable[[], contextlib.AbstractContextManager]
    final: Callable[[list[nn.Parameter]], None]


class HeldGradients:
    """Gradients a step finds in `.grad` from earlier steps (no zero_grad since), set aside
    while it runs and added back when it ends. A token-weighted step weighs every bucket at
    launch by 1 / the step's token total (gradients.py), so gradients left in the buckets would
    be weighed with it, where one process's `.grad` just adds the step's gradient to them.
    Nothing is copied: the held tensors (views of the old bucket buffers) are kept as they are and
    the step's buckets start new ones, so memory holds one gradient more until the step ends."""

    def __init__(self, buckets: GradientBuckets, zero_grad: Callable[[], None]):
        self.held: dict[nn.Parameter, torch.Tensor] = {}
        if buckets.cleared:  # zero_grad since the last forward: nothing, or zeros, to keep
            return
        self.refuse_unkeepable(buckets)
        self.held = {p: p.grad for p in buckets.params if p.grad is not None}
        if self.held:
            for bucket in buckets.buckets:  # the held `.grad`s view its buffer: the step gets a new one
                bucket.release()
            zero_grad()

    @staticmethod
    def refuse_unkeepable(buckets: GradientBuckets) -> None:
        """Before the step's agreement: earlier gradients that cannot be set aside. Every rank
        alike (their state is), before anything is launched."""
        if buckets.cleared:
            return
        if buckets.pending:
            raise ConfigError(
                "train_step(reduce='tokens') after a backward under no_sync(): those gradients are not reduced "
                "yet, and the step's token weights would fall on them too. Accumulate token-weighted microbatches "
                "with config.microbatches, or reduce the earlier backwards first (their last one outside no_sync)")
        if any(bucket.holds_reduced for bucket in buckets.buckets):
            buckets.refuse_accumulating_over_syncs()

    def add_back(self) -> None:
        for param, grad in self.held.items():
            if param.grad is None:  # unused in this step
                param.grad = grad
            else:
                local(param.grad).add_(local(grad))
        self.held = {}


class StepGradients:
    """One training step of a `GradientBuckets`: microbatches accumulate, the last backward
    reduces (or, in a pipeline, each stage's last backward), and `finish` returns the mean
    loss over replicas, which rides with the gradients. Outside a synchronized step
    (`no_sync`) nothing is reduced and `finish` returns this replica's loss."""

    def __init__(self, buckets: GradientBuckets, held: HeldGradients | None = None):
        self.buckets = buckets
        self.syncing = buckets.sync_enabled
        self.held = held
        buckets.cleared = False

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
        mean = self.buckets.finish()
        if self.held is not None:
            self.held.add_back()
        return mean
