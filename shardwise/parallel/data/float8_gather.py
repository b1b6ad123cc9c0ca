"""ZeRO-3 with float8 all-gather: torchao Float8Linear weights gathered as float8 bytes.

A Float8Linear casts its weight to float8 before every matmul, with a scale from the whole
weight's largest magnitude (tensorwise dynamic scaling). Under ZeRO-3 the whole weight exists
only to be cast, so each rank can cast its own shard instead and the ranks all-gather one byte
per element, not four. The scale must still be the whole weight's: each rank's shard amax is
reduced (max) over the ZeRO group first, so the gathered bytes are exactly the ones one
process casts from the whole weight (the cast is element-wise given the scale). The matmul,
its backward and the emulation on CPU stay torchao's (`matmul_with_hp_or_float8_args`), fed
a weight that is already float8; its gradient flows, in high precision, to the parameter.

Switched on as torchao switches it on for FSDP2: `Float8LinearConfig(
enable_fsdp_float8_all_gather=True)`, whose weight wrapper (`WeightWithDynamicFloat8CastTensor`,
an FSDP2 extension) is unwrapped at parallelize. Under zero < 3 nothing gathers parameters and
the flag has nothing to change, as under torchao without FSDP2; under tensor parallelism with
zero=3 it is refused (the tp rules already cast the weight shard by the tp-wide amax).

Why not torchao's own path: it is written against FSDP2's `fsdp_pre_all_gather` hooks, and
shardwise's ZeRO-3 gathers its own flat buffers (zero3.py says why).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...compat import all_gather_single
from ...errors import ConfigError
from ..tensor.float8 import is_float8_linear
from .buckets import Bucket


def _flagged(module: nn.Module):
    """(path, Float8Linear) for those asking torchao for float8 all-gather."""
    return [(path, m) for path, m in module.named_modules()
            if is_float8_linear(m) and m.config.enable_fsdp_float8_all_gather]


def check_float8_gather(module: nn.Module, zero: int, tp: int) -> None:
    """Refuse float8 all-gather where shardwise cannot give it (before any collective)."""
    flagged = _flagged(module)
    if flagged and zero == 3 and tp > 1:
        raise ConfigError(
            f"{flagged[0][0]} (Float8Linear) has enable_fsdp_float8_all_gather=True under tp={tp} with zero=3: "
            "shardwise gathers float8 weights under ZeRO-3 without tensor parallelism only; set it False (the tp "
            "rules already cast each weight shard with the whole weight's scale)")


def float8_gathered_weights(module: nn.Module, zero: int) -> dict[int, nn.Module]:
    """Parameter id -> its Float8Linear, for the weights to all-gather as float8 (empty unless
    zero=3). Unwraps torchao's FSDP2 weight wrapper in place (it means nothing outside FSDP2)."""
    chosen = {}
    for _, m in _flagged(module):
        inner = getattr(m.weight, "_tensor", None)
        if inner is not None:  # WeightWithDynamicFloat8CastTensor
            m.weight = nn.Parameter(inner.detach(), requires_grad=m.weight.requires_grad)
        if zero == 3 and m.weight.requires_grad:
            chosen[id(m.weight)] = m
    return chosen


class Float8Gather:
    """One ZeRO-3 bucket of Float8Linear weights: cast this rank's shard with the whole
    weights' scales, all-gather the bytes, and view them as torchao float8 weights."""

    def __init__(self, bucket: Bucket, modules: list[nn.Module]):
        self.bucket = bucket
        self.modules = modules  # one per parameter of the bucket, in its order
        configs = {(m.config.cast_config_weight.target_dtype, m.config.round_scales_to_power_of_2) for m in modules}
        self.dtype = modules[0].config.cast_config_weight.target_dtype
        self.scales = torch.ones(len(modules), dtype=torch.float32, device=bucket.device)
        self.shard = torch.zeros(bucket.shard_size, dtype=torch.uint8, device=bucket.device)
        self.full = torch.zeros(bucket.padded, dtype=torch.uint8, device=bucket.device)
        self.version = -1
        if len(configs) > 1:
            raise ConfigError(f"Float8Linear weights {[type(m).__name__ for m in modules]} in one ZeRO-3 unit use "
                              f"different weight casts {sorted(map(str, configs))}; use one float8 config per model")
        self.weights = [self._weight(i, m) for i, m in enumerate(modules)]  # views, made while `full` has storage
        self.release()

    def _ranges(self):
        """(index, this rank's slice of the parameter as positions in its shard, in the weight)."""
        b = self.bucket
        lo, hi = b.shard_start, b.shard_start + b.shard_size
        for i, (offset, size) in enumerate(zip(b.offsets, b.sizes)):
            start, end = max(lo, offset), min(hi, offset + size)
            if start < end:
                yield i, slice(start - lo, end - lo)

    @torch.no_grad()
    def launch(self, waiter) -> Any:
        """Scales from the whole weights (an all-reduce of shard amaxes), this shard cast, and
        the async all-gather of the bytes into `full` (returned work)."""
        from torchao.float8.float8_training_tensor import GemmInputRole, hp_tensor_and_scale_to_float8
        from torchao.float8.float8_utils import amax_to_scale

        b = self.bucket
        values = b.gather_source  # in the parameters' dtype, as the module would cast its own weight
        amax = torch.zeros(len(self.modules), dtype=torch.float32, device=b.device)
        ranges = list(self._ranges())
        for i, where in ranges:
            amax[i] = values[where].abs().max().float()
        group = b.reduce.group
        waiter(dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group, async_op=True),
               f"all-reduce of float8 weight amaxes of parameter bucket {b.index}", group)
        config = self.modules[0].config
        for i in range(len(self.modules)):
            self.scales[i] = amax_to_scale(amax[i], self.dtype,
                                           round_scales_to_power_of_2=config.round_scales_to_power_of_2)
        for i, where in ranges:
            cast = hp_tensor_and_scale_to_float8(values[where], self.scales[i], self.dtype,
                                                 self.modules[i].linear_mm_config, GemmInputRole.WEIGHT)
            self.shard[where].copy_(cast._data.view(torch.uint8))
        self.full.untyped_storage().resize_(self.full.numel())
        self.version = b.param_shard._version
        return all_gather_single(self.full, self.shard, group=group, async_op=True)

    def stale(self) -> bool:
        """The shard changed (an update) since its bytes were gathered."""
        return self.bucket.param_shard._version != self.version

    def lend(self) -> None:
        """The gathered weights to their modules (their forward computes with them)."""
        for module, weight in zip(self.modules, self.weights):
            setattr(module, GATHERED, weight)

    def release(self) -> None:
        """Free the gathered bytes; the modules go back to casting their own weight."""
        self.full.untyped_storage().resize_(0)
        for module in self.modules:
            setattr(module, GATHERED, None)

    def _weight(self, i: int, module: nn.Module) -> torch.Tensor:
        """Parameter i as a torchao float8 weight over `full` (valid while gathered)."""
        from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

        b = self.bucket
        data = self.full[b.offsets[i]: b.offsets[i] + b.sizes[i]].view(self.dtype).view(b.shapes[i])
        return Float8TrainingTensor(data, self.scales[i], b.params[i].dtype, module.linear_mm_config,
                                    GemmInputRole.WEIGHT)


class _Float8Weight(torch.autograd.Function):
    """The gathered float8 weight in the parameter's place: its gradient goes to the parameter."""

    @staticmethod
    def forward(ctx, param: torch.Tensor, weight8: torch.Tensor) -> torch.Tensor:
        return weight8

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


GATHERED = "_shardwise_float8_weight"  # the module attribute holding its gathered float8 weight, or None


def _gathered_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Float8Linear's forward with the gathered float8 weight; torchao's own while the weight
    is not gathered as float8 (inside `whole()` it is whole in high precision)."""
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

    w8 = getattr(self, GATHERED)
    if w8 is None:
        return super(type(self), self).forward(x)
    if torch.is_autocast_enabled():
        x = x.to(torch.get_autocast_gpu_dtype())
    weight = _Float8Weight.apply(self.weight, w8)
    y = matmul_with_hp_or_float8_args.apply(x, weight.t(), self.linear_mm_config, self.config)
    return y if self.bias is None else y + self.bias.to(y.dtype)


def use_gathered_weight(module: nn.Module, classes: dict[type, type]) -> None:
    """Make `module` (a Float8Linear) compute with the weight in its GATHERED attribute when
    set: its class becomes a subclass (one per class, kept in `classes`, so equal blocks
    compile to one graph), the object and its state stay."""
    cls = type(module)
    if cls not in classes:
        classes[cls] = type(f"Float8Gathered{cls.__name__}", (cls,), {"forward": _gathered_forward,
                                                                       "__module__": cls.__module__})
    setattr(module, GATHERED, None)
    module.__class__ = classes[cls]
