"""What `.grad` holds for a parameter whose reduced gradient lives apart from it.

Under ZeRO (1-3) a synchronized gradient lives in this rank's shard, and a lower-precision
parameter's in a float32 bucket; `.grad` was None there, so torch's own
`clip_grad_norm_(model.parameters(), ...)` (HF Trainer's, every hand-written loop's) found no
gradients and clipped nothing, a norm of 0 and no word, and a loop logging `p.grad.norm()`
logged nothing. From the synchronization to `zero_grad` such a parameter's `.grad` is a
`GradientHeldApart`: the gradient's shape, dtype and device, no storage, and every operation on
it a `ModelError` naming the parameter and the calls that see the gradient whole
(`optimizer.clip_grad_norm`, `pmodel.full_grad_dict()`). `p.grad is None` tells a used parameter
from an unused one, as on one process. A backward that would accumulate into it without a
`zero_grad` is the refusal shardwise gives for that (gradients.py). One is made per parameter
and kept: a step re-assigns it.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch.utils._pytree import tree_leaves

from ...errors import ModelError
from ...tensors import PARAMETER_NAME

_ACCUMULATING = {torch.ops.aten.add_.Tensor, torch.ops.aten.add.Tensor}


class GradientHeldApart(torch.Tensor):
    """`.grad` of a parameter whose gradient lives in shardwise's buckets or shards: refuses use."""

    @staticmethod
    def __new__(cls, param: torch.Tensor, where: Callable[[], str], accumulating: Callable[[], None]):
        apart = torch.Tensor._make_wrapper_subclass(cls, param.shape, dtype=param.dtype, device=param.device)
        apart.param_name = getattr(param, PARAMETER_NAME, "a parameter")
        apart.lives, apart.accumulating = where, accumulating
        return apart

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        # the first stand-in among the arguments (a foreach op's are in lists: clip's default on CUDA)
        held = next(a for a in tree_leaves((args, kwargs)) if isinstance(a, GradientHeldApart))
        if func in _ACCUMULATING:  # autograd adding a backward's gradient to it
            held.accumulating()
        raise ModelError(
            f"{func} used the .grad of {held.param_name}, whose reduced gradient lives {held.lives()}: .grad stands "
            "for it and holds nothing. Clip with the optimizer's clip_grad_norm (sw.build_optimizer's; torch's "
            "clip_grad_norm_ over .grad would clip by none of the norm), read gradients whole with "
            "pmodel.full_grad_dict(), and clear them with optimizer.zero_grad() or pmodel.zero_grad()")

    def __repr__(self) -> str:  # repr reaches no dispatch when it fails inside one
        return f"GradientHeldApart({self.param_name}, shape={tuple(self.shape)})"


class StandIns:
    """The stand-in `.grad` of each parameter, made once and assigned after each synchronization."""

    def __init__(self, lives: Callable[[], str], accumulating: Callable[[], None]):
        self._lives, self._accumulating = lives, accumulating
        self._made: dict[int, GradientHeldApart] = {}

    def assign(self, params: Iterable[torch.Tensor]) -> None:
        # past the __torch_function__ of ZeRO-3's released parameters, which would let the store through slowly
        with torch._C.DisableTorchFunctionSubclass():
            for param in params:
                stand_in = self._made.get(id(param))
                if stand_in is None:
                    stand_in = self._made[id(param)] = GradientHeldApart(param, self._lives, self._accumulating)
                param.grad = stand_in
