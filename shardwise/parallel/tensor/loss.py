"""The loss a model computes from a loss-parallel head's logits, as a plain tensor.

Under a loss-parallel plan the head returns its logits sharded over the vocabulary (a DTensor)
and torch's `loss_parallel` computes the cross-entropy from the shards, returning the loss as a
replicated DTensor. A model that adds a term of its own to that loss (transformers' mixture of
experts adds its load-balancing loss, computed from plain router logits) would mix a DTensor
with plain tensors, which the forward tolerates for a scalar and the backward refuses. From
the head's output to the end of the forward, `PlainLoss` hands the cross-entropy back as a
plain tensor (each rank holds its whole value), whose gradient re-enters the loss-parallel
backward as the replicated DTensor it came from. A pipeline's last stage replays the loss as
the aten ops it was recorded as (pipeline/program.py): the same for `nll_loss_forward`.

That backward needs torch's `loss_parallel` context. `train_step` runs it inside; a plain
`loss = pmodel(batch); loss.backward()` would not (torch then fails in `nll_loss_backward`), so the
loss's gradient hook enters it when it is not active and leaves it when that backward ends.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import loss as torch_loss
from torch.distributed.tensor.parallel import loss_parallel
from torch.overrides import TorchFunctionMode

_LOSSES = (F.cross_entropy, F.nll_loss)
# what a pipeline stage replays of them (program.py records the forward's aten ops): (loss, weight)
_ATEN_LOSSES = (torch.ops.aten.nll_loss_forward.default, torch.ops.aten.nll_loss2d_forward.default)


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
        if func in _LOSSES and torch.is_inference_mode_enabled():
            # inference tensors skip the autograd keys where cross_entropy decomposes into the ops
            # torch's loss parallel handles (DTensor then meets cross_entropy_loss whole and refuses):
            # computed on copies made outside inference_mode, under no_grad, it decomposes
            copy = lambda a: a.clone() if isinstance(a, torch.Tensor) and a.is_inference() else a  # noqa: E731
            with torch.inference_mode(False), torch.no_grad():
                return _plain(func(*map(copy, args), **{k: copy(v) for k, v in (kwargs or {}).items()}))
        out = func(*args, **(kwargs or {}))
        if func in _LOSSES:
            return _plain(out)
        if func in _ATEN_LOSSES:
            return (_plain(out[0]), *out[1:])
        return out


def _plain(loss):
    if isinstance(loss, DTensor) and all(isinstance(p, Replicate) for p in loss.placements):
        plain = loss.to_local(grad_placements=loss.placements).clone()  # a view of it would refuse `loss += ...`
        if plain.requires_grad:
            plain.register_hook(_backward_in_loss_parallel)
        return plain
    return loss


def _loss_ops_enabled() -> bool | None:
    """Whether torch's loss-parallel ops are on (None: this torch keeps them elsewhere)."""
    handlers = getattr(getattr(DTensor, "_op_dispatcher", None), "_custom_op_handlers", None)
    ops = getattr(torch_loss, "customized_loss_ops", None)
    return None if handlers is None or ops is None else all(op in handlers for op in ops)


def _backward_in_loss_parallel(grad: torch.Tensor) -> None:
    if _loss_ops_enabled() is False:  # not inside pmodel.loss_parallel() (train_step's)
        context = loss_parallel()
        context.__enter__()
        torch.autograd.Variable._execution_engine.queue_callback(lambda: context.__exit__(None, None, None))
