"""Gradient buckets: flat storages a run of parameters' gradients (and, under ZeRO, the
parameters themselves) live in, each reduced by one collective over its `ReduceGroup`.
`GradientBuckets` (data.py) fills and launches them; ZeRO (zero.py, zero3.py) shards them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..tensors import local


@dataclass(frozen=True)
class ReduceGroup:
    """Where a parameter's gradient is summed, and the factor applied first.

    `uniform`: every member holds the same parameters in the same order (data- and
    tensor-parallel peers do; pipeline ranks sharing a tied parameter do not), so
    per-parameter flags can ride along in this group's buckets.
    """

    group: dist.ProcessGroup
    scale: float
    label: str
    uniform: bool = True
    spans_tp: bool = False  # its members include every tensor-parallel rank of a parameter

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)


def as_grad(param: nn.Parameter, view: torch.Tensor) -> torch.Tensor:
    """`view` as a gradient of `param`: a DTensor with the parameter's layout if it is one."""
    if isinstance(param, DTensor):
        return DTensor.from_local(view, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    return view


class Bucket:
    """A flat gradient buffer for a run of parameters, reduced by one collective.

    Under ZeRO (`sharded`) the buffer is padded to a multiple of the group size and this
    rank owns one contiguous shard of it: stage 1 reduce-scatters in place and keeps the
    buffer; stage 2+ reduce-scatters into a separate shard and frees the buffer until the
    next backward. `tail` spare slots (stage 0 only) carry the unused mask and the loss.

    Storages: `buffer` (gradients, flat; `views` are the parameters' slices of it), `shard`
    (ZeRO-2+: this rank's reduced gradients), and under ZeRO the parameters' own storage laid
    out like the gradients, so a gradient shard and its parameter shard cover the same range:
    `param_buffer` (every parameter, flat; ZeRO-3 frees it between uses) and `param_shard`
    (ZeRO-3: this rank's part, the only copy kept between uses).
    """

    def __init__(self, index: int, params: list[nn.Parameter], reduce: ReduceGroup, dtype: torch.dtype,
                 sharded: bool, keep_buffer: bool, tail: int = 0):
        self.index = index
        self.params = params
        self.reduce = reduce
        self.dtype = dtype
        self.device = local(params[0]).device
        self.shapes = [local(p).shape for p in params]
        self.sizes = [local(p).numel() for p in params]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(params))]
        numel = sum(self.sizes)
        ways = reduce.size if sharded else 1
        self.padded = -(-numel // ways) * ways
        self.shard_size = self.padded // ways
        self.shard_start = (dist.get_rank(reduce.group) if sharded else 0) * self.shard_size
        self.sharded = sharded
        self.tail_size = tail
        self.main_grad = any(local(p).dtype != dtype for p in params)  # grads cast into the buffer
        self.shard = torch.zeros(self.shard_size, dtype=dtype, device=self.device) if sharded and not keep_buffer else None
        self.buffer: torch.Tensor | None = None
        self.views: list[torch.Tensor] = []
        self.tail = torch.empty(0)
        self.param_buffer: torch.Tensor | None = None
        self.param_shard: torch.Tensor | None = None
        if keep_buffer:
            self.allocate()
        self.pending = len(params)
        self.work: dist.Work | None = None

    def allocate(self) -> None:
        if self.buffer is None:
            self.buffer = torch.zeros(self.padded + self.tail_size, dtype=self.dtype, device=self.device)
            self.views = [self.buffer[o:o + n].view(shape) for o, n, shape in zip(self.offsets, self.sizes, self.shapes)]
            self.tail = self.buffer[self.padded:]

    def release(self) -> None:
        self.buffer, self.views = None, []

    @property
    def grads(self) -> torch.Tensor:
        """The gradient region of the buffer (padding included, tail excluded)."""
        return self.buffer[: self.padded]

    @property
    def grad_shard(self) -> torch.Tensor:
        """This rank's reduced shard (ZeRO): in the buffer for stage 1, separate for 2+."""
        if self.shard is not None:
            return self.shard
        return self.buffer[self.shard_start: self.shard_start + self.shard_size]

    @property
    def nbytes(self) -> int:
        return (self.padded + self.tail_size) * torch.empty((), dtype=self.dtype).element_size()

    @torch.no_grad()
    def flatten_params(self) -> None:
        """Move the parameters into `param_buffer` (ZeRO): each becomes a view of it."""
        if self.param_buffer is not None:
            return
        self.param_buffer = torch.zeros(self.padded, dtype=local(self.params[0]).dtype, device=self.device)
        for param, offset, size, shape in zip(self.params, self.offsets, self.sizes, self.shapes):
            view = self.param_buffer[offset: offset + size].view(shape)
            view.copy_(local(param))
            local(param).data = view

    @torch.no_grad()
    def keep_param_shard(self) -> None:
        """ZeRO-3: copy this rank's part of `param_buffer` into `param_shard`, its lasting home
        (in place once it exists: the optimizer's tensors are views of it)."""
        mine = self.param_buffer[self.shard_start: self.shard_start + self.shard_size]
        if self.param_shard is None:
            self.param_shard = mine.clone()
        else:
            self.param_shard.copy_(mine)

    @property
    def own_params(self) -> torch.Tensor:
        """This rank's shard of the parameters: what an update writes and the all-gather sends."""
        if self.param_shard is not None:
            return self.param_shard
        return self.param_buffer[self.shard_start: self.shard_start + self.shard_size]

    def param_range(self, lo: int, hi: int) -> torch.Tensor:
        """The parameters' values at buffer positions [lo, hi), inside this rank's shard."""
        return self.own_params[lo - self.shard_start: hi - self.shard_start]
