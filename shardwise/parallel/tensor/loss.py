"""The loss a model computes from a loss-parallel head's logits, as a plain tensor.

Under a loss-parallel plan the head returns its logits sharded over the vocabulary (a DTensor)
and torch's `loss_parallel` computes the cross-entropy from the shards, returning the loss as a
replicated DTensor. A model that adds a term of its own to that loss (transformers' mixture of
experts adds its load-balancing loss, computed from plain router logits) would mix a DTensor
with plain tensors, which the forward tolerates for a scalar and the backward refuses. From
the head's output to the end of the forward, `PlainLoss` hands the cross-entropy back as a
plain tensor (each rank holds its whole value), whose gradient re-enters the loss-parallel
backward as the replicated DTensor it came from.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate
from torch.overrides import TorchFunctionMode

_LOSSES = (F.cross_entropy, F.nll_loss)


class PlainLoss(TorchFunctionMode):
    """Entered when the head returns its sharded logits, left when the forward ends."""

    def __init__(self):
        super().__init__()
        self.active = False

    def enter(self) -> None:
        if not self.active and not torch.compiler.is_compiling():
            self.__enter__()
            self.active = True

    def leave(self) -> None:
        if self.active:
            self.active = False
            self.__exit__(None, None, None)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _LOSSES and isinstance(out, DTensor) and all(isinstance(p, Replicate) for p in out.placements):
            return out.to_local(grad_placements=out.placements).clone()  # a view of it would refuse `loss += ...`
        return out
