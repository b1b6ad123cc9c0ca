"""Tensor-parallel rules for torchao's float8 linear (`Float8Linear`, from
`convert_to_float8_training`): column- and row-parallel as for `nn.Linear`, with every float8
cast scaled exactly as one process scales it.

A float8 cast with tensorwise dynamic scaling divides a tensor by a scale taken from its
largest magnitude (amax). On a tp rank a sharded operand is only a slice, and its own amax
would give each rank a different scale than one process uses, so every element would round
differently. Here an operand the rank holds a slice of has its amax reduced (max) over tp
before the cast: the weight (both rules), the gradient of a column-parallel output (sharded on
its features) and a row-parallel input (sharded on its features). A replicated operand's amax
is already the whole tensor's. The casts themselves, the matmul and its emulation on CPU are
torchao's own (`hp_tensor_and_scale_to_float8`, `matmul_with_hp_or_float8_args`), so the
numbers are the ones torchao computes on one process.

Why not torchao's `Float8ColwiseParallel` / `Float8RowwiseParallel`: they are
`parallelize_module` styles over DTensor activations, and shardwise's rules compute on local
shards with one collective per column/row pair (see `sharding.py`).

Scaling per data-parallel replica: activations and their gradients are scaled by the amax of
the replica's own batch, as in every float8 recipe (a global max would cost a blocking
all-reduce per layer and pass); one process gets the same numbers running each replica's batch
as its own forward (gradient accumulation). Only tensorwise dynamic scaling is supported under
tp (axiswise "rowwise" recipes would reduce per row); anything else is a `PlanError`.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

from ...errors import PlanError
from ...tensors import shard_for_compute
from ..collectives import redistribute

if TYPE_CHECKING:
    from .sharding import ModuleLayout, TensorParallel


def float8_linear_class() -> type | None:
    """torchao's Float8Linear, if torchao is loaded (a model holding one has loaded it)."""
    module = sys.modules.get("torchao.float8.float8_linear")
    return getattr(module, "Float8Linear", None)


def is_float8_linear(module: nn.Module) -> bool:
    """A Float8Linear computing by its own forward (a subclass with another forward is not one)."""
    cls = float8_linear_class()
    return cls is not None and isinstance(module, cls) and type(module).forward is cls.forward


def check_float8_config(path: str, module: nn.Module) -> None:
    """Refuse the float8 configurations these rules cannot scale as one process does."""
    from torchao.float8.config import ScalingGranularity, ScalingType

    config = module.config
    casts = {name: getattr(config, name) for name in (
        "cast_config_input", "cast_config_weight", "cast_config_grad_output", "cast_config_input_for_grad_weight",
        "cast_config_weight_for_grad_input", "cast_config_grad_output_for_grad_weight")}
    for name, cast in casts.items():
        if cast.scaling_type is not ScalingType.DISABLED and (
                cast.scaling_type is not ScalingType.DYNAMIC or cast.scaling_granularity is not ScalingGranularity.TENSORWISE):
            raise PlanError(
                f"{path} (Float8Linear): {name} is {cast.short_str()}; under tensor parallelism shardwise scales float8 "
                "casts tensorwise and dynamically (torchao's default 'tensorwise' recipe). Use that recipe, or leave "
                "this layer's parameters replicated")
    for operand, first, second in (("weight", "cast_config_weight", "cast_config_weight_for_grad_input"),
                                   ("grad_output", "cast_config_grad_output", "cast_config_grad_output_for_grad_weight"),
                                   ("input", "cast_config_input", "cast_config_input_for_grad_weight")):
        if casts[first] != casts[second]:
            raise PlanError(
                f"{path} (Float8Linear): the {operand} is cast differently for its two matmuls ({first}="
                f"{casts[first].short_str()}, {second}={casts[second].short_str()}); shardwise casts a sharded operand "
                "once for both. Use one cast config per operand, or leave this layer's parameters replicated")


def _cast(t: torch.Tensor, module: nn.Module, operand: str, group: Any) -> torch.Tensor:
    """`t` cast to float8 as one process casts the whole tensor: its amax reduced over `group`
    (None: `t` is whole on this rank). A disabled cast leaves `t` in high precision."""
    from torchao.float8.config import ScalingType
    from torchao.float8.float8_training_tensor import GemmInputRole, hp_tensor_and_scale_to_float8
    from torchao.float8.float8_utils import amax_to_scale

    config = module.config
    cast = getattr(config, f"cast_config_{operand}")
    if cast.scaling_type is ScalingType.DISABLED:
        return t
    with torch.no_grad():
        amax = torch.max(torch.abs(t))
        if group is not None:
            amax = funcol.wait_tensor(funcol.all_reduce(amax, "max", group))
        scale = amax_to_scale(amax, cast.target_dtype, round_scales_to_power_of_2=config.round_scales_to_power_of_2)
    role = {"input": GemmInputRole.INPUT, "weight": GemmInputRole.WEIGHT, "grad_output": GemmInputRole.GRAD_OUTPUT}[operand]
    return hp_tensor_and_scale_to_float8(t, scale, cast.target_dtype, module.linear_mm_config, role)


class _GradientInFloat8(torch.autograd.Function):
    """Identity forward; backward casts the output's gradient to float8 with its amax reduced
    over tp (the gradient of a column-parallel output is sharded on its features)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, module: nn.Module, group: Any) -> torch.Tensor:
        ctx.module, ctx.group = module, group
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        from torchao.float8.distributed_utils import tensor_already_casted_to_fp8

        if tensor_already_casted_to_fp8(grad):
            return grad, None, None
        return _cast(grad, ctx.module, "grad_output", ctx.group), None, None


def _float8_matmul(module: nn.Module, x: torch.Tensor, group: Any, *, input_sharded: bool) -> torch.Tensor:
    """x @ weight.T in float8 as torchao computes it, the weight's amax reduced over the tp
    `group` (and the input's, if sharded). Autocast picks the input's dtype as Float8Linear does."""
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

    if torch.is_autocast_enabled():
        x = x.to(torch.get_autocast_gpu_dtype())
    x8 = _cast(x, module, "input", group if input_sharded else None)
    w8 = _cast(shard_for_compute(module.weight).t(), module, "weight", group)
    return matmul_with_hp_or_float8_args.apply(x8, w8, module.linear_mm_config, module.config)


def float8_column(module: nn.Module, x: torch.Tensor, *, tp: TensorParallel, layout: ModuleLayout) -> torch.Tensor:
    """Column-parallel Float8Linear: input whole, weight sharded on its output features, output
    sharded on the last dim (its gradient's amax reduced over tp)."""
    x = tp.parallel_input(x, tp.input_placement(layout, Replicate()))
    y = _float8_matmul(module, x, tp.group, input_sharded=False)
    y = _GradientInFloat8.apply(y, module, tp.group)
    if module.bias is not None:
        y = y + shard_for_compute(module.bias).to(y.dtype)
    return tp.module_output(y, layout, Shard(-1))


def float8_row(module: nn.Module, x: torch.Tensor, *, tp: TensorParallel, layout: ModuleLayout) -> torch.Tensor:
    """Row-parallel Float8Linear: input and weight sharded on the input features (their amax
    reduced over tp), the partial output reduced to the plan's placement, bias added after."""
    x = redistribute(x, tp.input_placement(layout, Shard(-1)), Shard(-1), tp.group)
    tp.computing_partial = True
    try:
        y = _float8_matmul(module, x, tp.group, input_sharded=True)
    finally:
        tp.computing_partial = False
    y = tp.module_output(y, layout, Partial())
    return y if module.bias is None else y + shard_for_compute(module.bias).to(y.dtype)
