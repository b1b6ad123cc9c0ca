"""Gradient buckets: flat storages a run of parameters' gradients (and, under ZeRO, the
parameters themselves) live in, each reduced by one collective over its `ReduceGroup`.
`GradientBuckets` (gradients.py) fills and launches them; ZeRO (zero.py, zero3.py) shards them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ...tensors import local


@dataclass(frozen=True)
class ReduceGroup:
    """Where a parameter's gradient is summed, and the factor applied first.

    `same_params_on_members`: every member holds the same parameters in the same order (data- and
    tensor-parallel peers do; pipeline ranks sharing a tied parameter do not), so
    per-parameter flags can ride along in this group's buckets.
    """

    group: dist.ProcessGroup
    scale: float
    label: str
    same_params_on_members: bool = True
    includes_tp_peers: bool = False  # its members include every tensor-parallel rank of a parameter
    weighted_at_origin: bool = False  # the replica weight is already in the gradient (experts: dispatch.py)
    spans_replicas: bool = True  # every data-parallel replica is a member (so the ReplicaSummary can ride along)

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)


@dataclass(frozen=True)
class ZeroStage:
    """What ZeRO stage `stage` shards over the replicas, as the storages a `Bucket` keeps.

    0: nothing; gradients all-reduced in a kept buffer.
    1: optimizer state: gradients reduce-scattered in place, the buffer kept, and the
       parameters moved into a flat `param_buffer` laid out like the gradients.
    2: + gradients: reduced into a separate shard; the buffer lives only during backward.
    3: + parameters: only `param_shard` is kept; `param_buffer` is gathered for each use.
    """

    stage: int = 0

    @property
    def grads_sharded(self) -> bool:
        return self.stage >= 1

    @property
    def params_flat(self) -> bool:
        return self.stage >= 1

    @property
    def grad_buffer_kept(self) -> bool:
        return self.stage < 2

    @property
    def params_sharded(self) -> bool:
        return self.stage == 3


def as_grad(param: nn.Parameter, view: torch.Tensor) -> torch.Tensor:
    """`view` as a gradient of `param`: a DTensor with the parameter's layout if it is one."""
    if isinstance(param, DTensor):
        return DTensor.from_local(view, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    return view


class Bucket:
    """A flat gradient buffer for a run of parameters, reduced by one collective.

    Under ZeRO (`zero.grads_sharded`) the buffer is padded to a multiple of the group size
    and this rank owns one contiguous shard of it; which storages exist is `zero`'s to say.

    Storages: `buffer` = [gradients | padding | summary slots]: `views` are the parameters'
    slices of it, `summary` the `summary_slots` values (a `ReplicaSummary`) that ride in
    the last bucket's collective; `shard` (ZeRO-2+: this rank's reduced gradients, from the
    step's first reduction until zero_grad(set_to_none=True)); and
    under ZeRO the parameters' own storage laid out like the gradients, so a gradient shard
    and its parameter shard cover the same range: `param_buffer` (every parameter, flat;
    ZeRO-3 frees it between uses) and `param_shard` (ZeRO-3: this rank's part, the only
    copy kept between uses; float32 under mixed precision, where it is the master).
    """

    def __init__(self, index: int, params: list[nn.Parameter], reduce: ReduceGroup, dtype: torch.dtype,
                 zero: ZeroStage, summary_slots: int = 0):
        self.index = index
        self.params = params
        self.reduce = reduce
        self.dtype = dtype
        self.device = local(params[0]).device
        self.shapes = [local(p).shape for p in params]
        self.sizes = [local(p).numel() for p in params]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(params))]
        numel = sum(self.sizes)
        self.sharded = zero.grads_sharded
        ways = reduce.size if self.sharded else 1
        self.padded = -(-numel // ways) * ways
        self.shard_size = self.padded // ways
        self.shard_start = (dist.get_rank(reduce.group) if self.sharded else 0) * self.shard_size
        self.summary_slots = summary_slots
        self.casts_grads = any(local(p).dtype != dtype for p in params)  # grads cast into the buffer
        self.separate_shard = not zero.grad_buffer_kept
        self.shard: torch.Tensor | None = None  # made by the first reduction after the gradients were dropped
        self.buffer: torch.Tensor | None = None
        self.views: list[torch.Tensor] = []
        self.summary = torch.empty(0)
        self.param_buffer: torch.Tensor | None = None
        self.param_shard: torch.Tensor | None = None
        if zero.grad_buffer_kept:
            self.allocate()
        self.pending = len(params)
        self.work: dist.Work | None = None
        # ZeRO-2/3 reducing every microbatch of a step: the factor the shard's partial sum was
        # scaled by (None: it holds nothing of this step yet), the factor of the reduction under
        # way, and where that reduction lands until it is added in
        self.shard_factor: float | None = None
        self.launch_factor = 1.0
        self.incoming: torch.Tensor | None = None
        # gradients live apart from `.grad` (reduce-scattered into a shard, or cast into this
        # buffer): whether `.grad` was cleared since a synchronization cannot be seen here
        self.grads_apart = self.sharded or self.casts_grads
        self.holds_reduced = False  # a synchronization's gradients, not zeroed since

    def allocate(self) -> None:
        if self.buffer is None:
            self.buffer = torch.zeros(self.padded + self.summary_slots, dtype=self.dtype, device=self.device)
            self.views = [self.buffer[o:o + n].view(shape) for o, n, shape in zip(self.offsets, self.sizes, self.shapes)]
            self.summary = self.buffer[self.padded:]

    def release(self) -> None:
        """Free the gradient buffer (ZeRO-2+, after the reduce-scatter), and the parameters'
        `.grad` views of it, which would keep it alive (the gradients live in the shard)."""
        self.buffer, self.views, self.summary = None, [], torch.empty(0)
        with torch._C.DisableTorchFunctionSubclass():  # ZeRO-3's released parameters: straight to torch
            for param in self.params:
                param.grad = None

    def drop_grads(self) -> None:
        """zero_grad(set_to_none=True): forget this step's gradients and, where the shard is separate
        (ZeRO-2/3), free it and the whole-gradient buffer, as FSDP frees its sharded gradients: the
        next step's first reduction makes a new shard, so neither is held while the forward and the
        loss's backward run."""
        if self.separate_shard:
            self.release()
            self.shard = None
        self.shard_factor, self.incoming = None, None
        self.holds_reduced = False

    def reduced_into(self) -> torch.Tensor:
        """Where this reduction's shard goes: the shard itself, or beside it when the shard
        already holds an earlier microbatch's (`settle` adds it in once it has arrived)."""
        if self.shard_factor is None:
            if self.separate_shard and self.shard is None:  # the reduction writes all of it
                self.shard = torch.empty(self.shard_size, dtype=self.dtype, device=self.device)
            return self.grad_shard
        self.incoming = torch.empty_like(self.grad_shard)
        return self.incoming

    @torch.no_grad()
    def settle(self) -> None:
        """After the reduction arrived: add it to the shard's partial sum. The replica weight
        may have changed since that sum was reduced (reduce="tokens" learns it at the last
        microbatch, the same on every replica): the sum is rescaled to it first."""
        if self.incoming is not None:
            if self.shard_factor != self.launch_factor:
                self.grad_shard.mul_(self.launch_factor / self.shard_factor if self.shard_factor else 0.0)
            self.grad_shard.add_(self.incoming)
            self.incoming = None
        self.shard_factor = self.launch_factor

    @property
    def grads(self) -> torch.Tensor:
        """The gradient region of the buffer (padding included, summary slots excluded)."""
        return self.buffer[: self.padded]

    @property
    def grad_shard(self) -> torch.Tensor:
        """This rank's reduced shard (ZeRO): in the buffer for stage 1, separate for 2+ (zeros
        until a reduction lands in it)."""
        if not self.separate_shard:
            return self.buffer[self.shard_start: self.shard_start + self.shard_size]
        if self.shard is None:
            self.shard = torch.zeros(self.shard_size, dtype=self.dtype, device=self.device)
        return self.shard

    @property
    def nbytes(self) -> int:
        return (self.padded + self.summary_slots) * torch.empty((), dtype=self.dtype).element_size()

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
    def keep_param_shard(self, before: torch.Tensor | None = None) -> None:
        """ZeRO-3: copy this rank's part of `param_buffer` into `param_shard`, its lasting home
        (in place once it exists: the optimizer's tensors are views of it). With `before` (the
        part as it was gathered), only if something wrote to it since: a float32 shard (the
        master weights under mixed precision, `hold_master_shard`) must not be rounded to the
        buffer's precision by a read."""
        mine = self.buffer_part
        if self.param_shard is None:
            self.param_shard = mine.clone()
        elif before is None or not torch.equal(mine, before):
            self.param_shard.copy_(mine)

    def hold_master_shard(self, master: torch.Tensor) -> None:
        """ZeRO-3 under mixed precision: this rank's part in float32 (`master`) becomes the only
        copy kept, updated in place by the optimizer and cast as it is gathered (FSDP2's
        way): 4 bytes an element where a low-precision shard beside a float32 master took 6."""
        self.param_shard = master

    @property
    def gather_source(self) -> torch.Tensor:
        """What an all-gather of the parameters sends: this rank's shard in the buffer's dtype
        (a cast copy of a float32 master shard)."""
        shard = self.own_params
        return shard if shard.dtype == self.param_buffer.dtype else shard.to(self.param_buffer.dtype)

    @property
    def own_params(self) -> torch.Tensor:
        """This rank's shard of the parameters: what an update writes and the all-gather sends."""
        if self.param_shard is not None:
            return self.param_shard
        return self.buffer_part

    @property
    def buffer_part(self) -> torch.Tensor:
        """This rank's range of `param_buffer`, in the parameters' dtype."""
        return self.param_buffer[self.shard_start: self.shard_start + self.shard_size]

    def param_range(self, lo: int, hi: int) -> torch.Tensor:
        """The parameters' values at buffer positions [lo, hi), inside this rank's shard."""
        return self.own_params[lo - self.shard_start: hi - self.shard_start]


class ReplicaSummary:
    """What the replicas average alongside one step's gradients: per parameter, whether this
    replica produced a gradient (the mean is zero only where no replica did: those end the
    step with `grad = None`, as on one process, so optimizers skip them), and the step's loss.

    `slots` values, packed pre-divided by the group size so the collective's sum is the
    mean. They ride in the last bucket's `summary` slots when that bucket is float32,
    all-reduced (not ZeRO) and over ranks that hold the same parameters (replicas, and their
    tp peers, whose flags and loss are equal); otherwise in an all-reduce of their own.
    """

    def __init__(self, num_params: int):
        self.num_params = num_params
        self.slots = num_params + 1
        self.loss: torch.Tensor | None = None  # this replica's, staged for the step

    def pack(self, used: list[bool], group_size: int, device: torch.device) -> torch.Tensor:
        values = torch.zeros(self.slots, device=device)
        values[: self.num_params] = torch.tensor(used, dtype=torch.float32)
        if self.loss is not None:
            values[self.num_params] = self.loss
        return values.div_(group_size)

    def used_anywhere(self, reduced: torch.Tensor) -> list[bool]:
        return [value != 0 for value in reduced[: self.num_params].tolist()]

    def mean_loss(self, reduced: torch.Tensor) -> torch.Tensor:
        return reduced[self.num_params].clone()

