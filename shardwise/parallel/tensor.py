"""Tensor and sequence parallelism driven by a resolved Plan.

Parameters the plan shards become DTensors on the tp mesh (so state dicts, checkpoints,
optimizers and norms see their global shape and placement); a module holding one is a
tensor-parallel module and must be of a type with a rule here: `nn.Linear`, `nn.Embedding`
or Hugging Face's `Conv1D`. Its forward is replaced by a rule that computes on the local
shards and moves activations with explicit collectives (`collectives.py`):

- column-parallel (weight sharded on the output features): input made replicated with a
  partial gradient (`enter_parallel`), output stays sharded on the last dim;
- row-parallel (sharded on input features): output partial, reduced to the plan's output
  placement (all-reduce, or reduce-scatter along the sequence for sequence parallelism),
  bias added after the reduction;
- vocab-parallel embedding (rows sharded): out-of-range ids masked, output partial.

Why not DTensor dispatch for the compute (as torch's `parallelize_module` does): its
sharding propagation picks collectives by cost, so under sequence parallelism a linear may
all-gather its weight instead of its input, and the q, k and v projections of one block each
all-reduce their input gradient. Here every column-parallel module reading the same input
tensor in one forward shares a single `enter_parallel`, so a Megatron column->row pair costs
exactly one collective forward and one backward.

Activation keys: `X.input` declares the placement of the tensors arriving at X (default:
what X's rule needs); `X.output` asks for X's output to be redistributed to a placement. A
module whose declared input is sharded along a data dim (e.g. a norm under sequence
parallelism) runs on shards: its replicated parameters get partial gradients, summed over
tp in the gradient buckets, and a Dropout there draws the mask one process would draw.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from ..comm import broadcast_tensors
from ..deferred import is_deferred
from ..errors import PlanError
from ..plan.plan import Conversion, placement_str, shard_dim
from ..plan.resolve import ResolvedPlan
from ..tensors import is_sharded, local
from ..topology import Topology
from .collectives import enter_parallel, redistribute
from .tensor_check import checked_forward


def _shard(param: torch.Tensor | None) -> torch.Tensor | None:
    """A parameter's local shard for compute; gradients flow back to the DTensor parameter."""
    return param.to_local() if isinstance(param, DTensor) else param


def _is_conv1d(module: nn.Module) -> bool:  # transformers.pytorch_utils.Conv1D: y = x @ W + b, W (in, out)
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


class TensorParallel:
    """The tp executor's state for one model: group, mesh, resolved plan, per-forward cache."""

    def __init__(self, topology: Topology, resolved: ResolvedPlan):
        self.group = topology.group("tp")
        self.mesh = topology.mesh["tp"]
        self.size = topology.sizes["tp"]
        self.rank = topology.tp_rank
        self.resolved = resolved
        self.partial_grad_params: set[int] = set()  # ids of replicated params whose grads are partial over tp
        self.sharded_modules: dict[str, str] = {}  # module path -> rule name
        self.column_blocks: dict[str, int] = {}  # modules whose output features are sharded -> blocks (StridedShard)
        self.first_forward_checked = False
        self._entered: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self._gathered: dict[int, _GatheredInput] = {}  # storage of an all-gathered input -> its shard
        self._entered_storages: set[int] = set()  # inputs gathered by a conversion for column-parallel readers
        self._flow = None  # the first forward's FeatureFlow while it runs
        self._replaying: set[str] = set()  # recomputed modules whose inputs are already converted
        self.computing_partial = False  # inside a row-parallel matmul (its output is a partial sum)

    @property
    def loss_parallel(self) -> bool:
        return bool(self.resolved.loss_parallel)

    def check_first_forward(self, module: nn.Module) -> contextlib.AbstractContextManager:
        """Around forwards: the first one runs under `tensor_check.checked_forward`, which
        refuses a plan whose sharded features reach a module that cannot take them."""
        if self.first_forward_checked:
            return contextlib.nullcontext()
        return self._checked(module)

    @contextlib.contextmanager
    def _checked(self, module: nn.Module) -> Iterator[None]:
        reducing = {p for p, rule in self.sharded_modules.items() if rule in ("row", "vocab_embedding")}
        row = {p for p, rule in self.sharded_modules.items() if rule == "row"}
        with checked_forward(module, self.column_blocks, reducing, row, set(self.resolved.inputs)) as flow:
            self._flow = flow
            try:
                yield
            finally:
                self._flow = None
        self.first_forward_checked = True

    def input_placement(self, path: str, default: Placement) -> Placement:
        """The placement module `path` computes on (after its input conversion, if any)."""
        declared = self.resolved.inputs.get(path, ())
        placement = declared[0][0] if declared and declared[0] is not None else default
        return placement.dst if isinstance(placement, Conversion) else placement

    def output_placement(self, path: str, default: Placement) -> Placement:
        declared = self.resolved.outputs.get(path, ())
        return declared[0][0] if declared and declared[0] is not None else default

    @contextlib.contextmanager
    def replaying(self, path: str) -> Iterator[None]:
        """While recompute runs module `path` again on the inputs it kept: those went
        through the module's input conversions already."""
        self._replaying.add(path)
        try:
            yield
        finally:
            self._replaying.discard(path)

    def convert_input(self, x: torch.Tensor, conversion: Conversion, path: str) -> torch.Tensor:
        """An input conversion "A -> B" at module `path`. Shard -> Replicate gathers the
        tensor for the module's column-parallel projections (an attention block reading the
        full sequence): its gradient there is partial, so backward is one reduce-scatter and
        the projections do not all-reduce again. The first forward checks that only
        column-parallel modules read it. Any other conversion is a plain redistribution."""
        src, dst = conversion.src, conversion.dst
        if not (isinstance(src, Shard) and isinstance(dst, Replicate)):
            return redistribute(x, src, dst, self.group)
        y = self.enter(x, src)
        self._entered_storages.add(y.untyped_storage()._cdata)
        if self._flow is not None:
            self._flow.mark_gathered(y, path)
        return y

    def enter(self, x: torch.Tensor, src: Placement) -> torch.Tensor:
        """`enter_parallel`, shared by every module that reads `x` in this forward."""
        if isinstance(src, Replicate) and x.untyped_storage()._cdata in self._entered_storages:
            return x  # gathered by an input conversion, its backward already the reduce-scatter
        key = (id(x), str(src))
        hit = self._entered.get(key)
        if hit is None or hit[0] is not x:
            hit = self._entered[key] = (x, enter_parallel(x, src, self.group))
            if isinstance(src, Shard) and hit[1] is not x:
                gathered = _GatheredInput(x.detach(), src.dim % x.dim(), self.group)
                self._gathered[hit[1].untyped_storage()._cdata] = gathered
        return hit[1]

    def end_forward(self) -> None:
        self._entered.clear()
        self._gathered.clear()
        self._entered_storages.clear()

    @contextlib.contextmanager
    def forward(self, module: nn.Module) -> Iterator[None]:
        """Around one forward of `module` (or of a pipeline stage of it): the first is checked,
        and the per-forward state is dropped after each."""
        try:
            with self.check_first_forward(module):
                yield
        finally:
            self.end_forward()

    def is_replaying(self, path: str) -> bool:
        """Whether module `path` is being recomputed with inputs already converted."""
        return path in self._replaying

    def keeping_shards(self) -> contextlib.AbstractContextManager:
        """Around a column-parallel module's compute: an input all-gathered from sequence
        shards is saved for backward as this rank's shard and gathered again when backward
        needs it (as Megatron's sequence parallelism does), so activation memory is 1/tp.
        Not inside recompute, whose own hooks already keep nothing."""
        if not self._gathered or torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
            return contextlib.nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, tensor: torch.Tensor) -> Any:
        gathered = self._gathered.get(tensor.untyped_storage()._cdata) if type(tensor) is torch.Tensor else None
        if gathered is None:
            return tensor
        gathered.pending += 1
        return gathered, tuple(tensor.shape), tensor.stride(), tensor.storage_offset()

    def leave(self, y: torch.Tensor, path: str, natural: Placement) -> torch.Tensor:
        default = Replicate() if isinstance(natural, Partial) else natural
        dst = self.output_placement(path, default)
        y = redistribute(y, natural, dst, self.group)
        if path in self.resolved.loss_parallel:
            return DTensor.from_local(y, self.mesh, [dst], run_check=False)
        return y


class _GatheredInput:
    """A sequence shard whose all-gather a backward will need again."""

    def __init__(self, shard: torch.Tensor, dim: int, group):
        self.shard, self.dim, self.group = shard, dim, group
        self.pending = 0  # saved references not yet unpacked
        self.full: torch.Tensor | None = None  # gathered once per backward, for all of them

    def unpack(self, shape: tuple, stride: tuple, offset: int) -> torch.Tensor:
        if self.full is None:
            with torch.no_grad():
                self.full = redistribute(self.shard, Shard(self.dim), Replicate(), self.group)
        full = self.full
        self.pending -= 1
        if self.pending == 0:
            self.full = None
        return full.as_strided(shape, stride, offset)


def _unpack(packed: Any) -> torch.Tensor:
    return packed[0].unpack(*packed[1:]) if isinstance(packed, tuple) else packed


# -- rules: local compute of tensor-parallel modules -----------------------------------
def _column(module: nn.Module, x: torch.Tensor, *, tp: TensorParallel, path: str) -> torch.Tensor:
    x = tp.enter(x, tp.input_placement(path, Replicate()))
    weight, bias = _shard(module.weight), _shard(module.bias)
    with tp.keeping_shards():
        if _is_conv1d(module):
            flat = x.reshape(-1, x.shape[-1])
            y = torch.addmm(bias, flat, weight) if bias is not None else flat @ weight
            y = y.view(*x.shape[:-1], -1)
        else:
            y = F.linear(x, weight, bias)
    return tp.leave(y, path, Shard(-1))


def _row(module: nn.Module, x: torch.Tensor, *, tp: TensorParallel, path: str) -> torch.Tensor:
    x = redistribute(x, tp.input_placement(path, Shard(-1)), Shard(-1), tp.group)
    weight = _shard(module.weight)
    tp.computing_partial = True  # selective recompute keeps the reduced output, not this full-size partial one
    try:
        y = (x.reshape(-1, x.shape[-1]) @ weight).view(*x.shape[:-1], -1) if _is_conv1d(module) else F.linear(x, weight)
    finally:
        tp.computing_partial = False
    y = tp.leave(y, path, Partial())
    return y if module.bias is None else y + _shard(module.bias)


def _vocab_embedding(module: nn.Embedding, ids: torch.Tensor, *, tp: TensorParallel, path: str) -> torch.Tensor:
    ids = redistribute(ids, tp.input_placement(path, Replicate()), Replicate(), tp.group)
    weight = _shard(module.weight)
    start = tp.rank * weight.shape[0]
    outside = (ids < start) | (ids >= start + weight.shape[0])
    pad = module.padding_idx
    pad = pad - start if pad is not None and start <= pad < start + weight.shape[0] else None
    out = F.embedding((ids - start).masked_fill(outside, 0), weight, pad, None, 2.0, module.scale_grad_by_freq, module.sparse)
    return tp.leave(out.masked_fill(outside.unsqueeze(-1), 0.0), path, Partial())


def _feature_embedding(module: nn.Embedding, ids: torch.Tensor, *, tp: TensorParallel, path: str) -> torch.Tensor:
    ids = redistribute(ids, tp.input_placement(path, Replicate()), Replicate(), tp.group)
    out = F.embedding(ids, _shard(module.weight), module.padding_idx, None, 2.0, module.scale_grad_by_freq, module.sparse)
    return tp.leave(out, path, Shard(-1))


def _sharded_dropout(module: nn.Dropout, x: torch.Tensor, *, tp: TensorParallel, dim: int) -> torch.Tensor:
    """Dropout on a shard, with the mask one process draws for the whole tensor."""
    if not module.training or module.p == 0.0:
        return x
    full = list(x.shape)
    full[dim] *= tp.size
    mask = F.dropout(torch.ones(full, dtype=x.dtype, device=x.device), module.p, True)
    return x * mask.chunk(tp.size, dim)[tp.rank]


def _has_rule(module: nn.Module) -> bool:
    return isinstance(module, (nn.Linear, nn.Embedding)) or _is_conv1d(module)


def _rule(path: str, module: nn.Module, placements: dict[str, Placement]):
    """The rule for a module with sharded parameters, and its parameters' full placements."""
    weight = placements.get("weight", Replicate())
    bias = placements.get("bias")
    kind = type(module).__name__
    if isinstance(module, nn.Linear) or _is_conv1d(module):
        out_dim = 1 if _is_conv1d(module) else 0  # nn.Linear weight (out, in); Conv1D weight (in, out)
        strided = isinstance(weight, _StridedShard)
        if shard_dim(weight) == out_dim:
            rule, expected = _column, _StridedShard(0, split_factor=weight.split_factor) if strided else Shard(0)
        elif shard_dim(weight) == 1 - out_dim and not strided:
            rule, expected = _row, Replicate()
        else:
            raise PlanError(
                f"{path}.weight: a {kind} is tensor-parallel with its weight sharded on dim {out_dim} (column) or "
                f"{1 - out_dim} (row), got {placement_str(weight)}"
            )
        if module.bias is not None:
            if bias is not None and bias != expected:
                raise PlanError(
                    f"{path}.bias must be {placement_str(expected)} to match {path}.weight "
                    f"{placement_str(weight)} ({rule.__name__.strip('_')}-parallel), got {placement_str(bias)}"
                )
            placements["bias"] = expected
        return rule
    if isinstance(module, nn.Embedding):
        if module.max_norm is not None:
            raise PlanError(f"{path}: tensor-parallel nn.Embedding does not support max_norm")
        if weight == Shard(0):
            return _vocab_embedding
        if weight == Shard(1):
            return _feature_embedding
        raise PlanError(f"{path}.weight: an Embedding shards rows (Shard(0)) or columns (Shard(1)), got {placement_str(weight)}")
    raise PlanError(
        f"{path} ({kind}) has sharded parameters but shardwise has no tensor-parallel rule for {kind}; "
        "shard nn.Linear, nn.Embedding or transformers Conv1D modules, or leave its parameters replicated"
    )


def tensor_parallel_rules(module: nn.Module, resolved: ResolvedPlan) -> dict[str, tuple[Any, dict[str, Placement]]]:
    """Module path -> (rule, full placements of its parameters), for every module whose
    parameters the plan shards. Pure: raises `PlanError` before anything communicates."""
    modules = dict(module.named_modules())
    owned: dict[str, dict[str, Placement]] = {}
    for name, placement in resolved.params.items():
        path, _, leaf = name.rpartition(".")
        owned.setdefault(path, {})[leaf] = placement
    ruled = {path for path, placements in owned.items()
             if any(not isinstance(p, Replicate) for p in placements.values()) and _has_rule(modules[path])}
    computed_by_rule = {id(p) for path in ruled for p in modules[path].parameters(recurse=False)}
    rules = {}
    for path, placements in owned.items():
        mod = modules[path]
        sharded = {leaf for leaf, p in placements.items() if not isinstance(p, Replicate) and getattr(mod, leaf) is not None}
        if not sharded or (path not in ruled and all(id(getattr(mod, leaf)) in computed_by_rule for leaf in sharded)):
            continue  # replicated, or a tied copy of a parameter a rule module computes with
        placements = dict(placements)
        rules[path] = (_rule(path, mod, placements), placements)
    return rules


def apply_tensor_parallel(module: nn.Module, topology: Topology, resolved: ResolvedPlan,
                          materialize=None) -> TensorParallel:
    """Shard `module`'s parameters and install the rules and activation hooks of `resolved`.

    `materialize(name, placement)` gives the local tensor of a parameter that is still on
    the meta device (deferred init); otherwise shards are cut from rank tp 0's full values.
    """
    tp = TensorParallel(topology, resolved)
    modules = dict(module.named_modules())
    for path, attr in resolved.divide_by_tp:
        setattr(modules[path], attr, getattr(modules[path], attr) // tp.size)
    converted: dict[int, nn.Parameter] = {}
    for path, (rule, placements) in tensor_parallel_rules(module, resolved).items():
        mod = modules[path]
        if not any(True for _ in mod.parameters(recurse=False)):
            continue  # pruned: this pipeline rank never runs it
        tp.sharded_modules[path] = rule.__name__.strip("_")
        if rule in (_column, _feature_embedding):
            weight = placements.get("weight")
            tp.column_blocks[path] = weight.split_factor if isinstance(weight, _StridedShard) else 1
        for leaf, param in list(mod.named_parameters(recurse=False)):
            if id(param) not in converted:
                placement = placements.get(leaf, Replicate())
                if materialize is not None and is_deferred(param):
                    shard = materialize(f"{path}.{leaf}" if path else leaf, placement)
                    data = DTensor.from_local(shard, tp.mesh, [placement], run_check=False,
                                              shape=param.shape, stride=param.stride())
                else:
                    data = distribute_tensor(param.detach(), tp.mesh, [placement], src_data_rank=0)
                converted[id(param)] = nn.Parameter(data, requires_grad=param.requires_grad)
            setattr(mod, leaf, converted[id(param)])
        mod.forward = functools.partial(rule, mod, tp=tp, path=path)
        if rule is _row and isinstance(tp.output_placement(path, Replicate()), Shard) and mod.bias is not None:
            tp.partial_grad_params.add(id(mod.bias))
    for _, mod in module.named_modules():  # tied copies held by modules without a rule
        for leaf, param in list(mod.named_parameters(recurse=False)):
            if id(param) in converted and param is not converted[id(param)]:
                setattr(mod, leaf, converted[id(param)])

    for path, placements in resolved.inputs.items():
        if any(t is not None and isinstance(t[0], Conversion) for t in placements):
            modules[path].register_forward_pre_hook(
                functools.partial(_convert_inputs, tp=tp, path=path, signature=inspect.signature(modules[path].forward)),
                with_kwargs=True)
        first = tp.input_placement(path, Replicate())
        mod = modules[path]
        if path in tp.sharded_modules or not isinstance(first, Shard):
            continue
        data_dim = first.dim  # this module runs on shards of its data: replicated params get partial grads
        for param in mod.parameters(recurse=False):
            tp.partial_grad_params.add(id(param))
        if isinstance(mod, nn.Dropout):
            mod.forward = functools.partial(_sharded_dropout, mod, tp=tp, dim=data_dim)
    for path, placements in resolved.outputs.items():
        if path in tp.sharded_modules and isinstance(placements[0] and placements[0][0], Conversion):
            raise PlanError(
                f"activation {path}.output: {placement_str(placements[0][0])} converts the output of tensor-parallel "
                f"{path}, whose rule knows its own output placement; give only the target, e.g. "
                f"{placement_str(placements[0][0].dst)!r}")
        if path not in tp.sharded_modules:
            modules[path].register_forward_hook(functools.partial(_redistribute_output, tp=tp, path=path))

    if tp.size > 1:  # replicated parameters and buffers start identical on every tp rank
        replicated = [local(t) for t in list(module.parameters()) + list(module.buffers()) if not is_sharded(t)]
        broadcast_tensors([t.data for t in replicated], tp.group, 64 << 20)
    return tp


def _convert_inputs(mod: nn.Module, args: tuple, kwargs: dict, *, tp: TensorParallel, path: str,
                    signature: inspect.Signature) -> tuple[tuple, dict] | None:
    """Forward pre-hook: the plan's input conversions, applied to the module's tensor
    arguments in the order of its forward's signature (the i-th placement, the i-th tensor)."""
    if tp.is_replaying(path):
        return None
    bound = signature.bind_partial(*args, **kwargs)
    names = [name for name, value in bound.arguments.items() if isinstance(value, torch.Tensor)]
    for name, target in zip(names, tp.resolved.inputs[path]):
        if target is not None and isinstance(target[0], Conversion):
            bound.arguments[name] = tp.convert_input(bound.arguments[name], target[0], path)
    return bound.args, bound.kwargs


def _redistribute_output(mod: nn.Module, args: Any, output: Any, *, tp: TensorParallel, path: str) -> Any:
    """Forward hook: move a module's output tensors to the plan's placements (from what the
    module computed on, or from the source a conversion "A -> B" names)."""
    computed_on = tp.input_placement(path, Replicate())

    def move(tensor: torch.Tensor, target: tuple | None) -> torch.Tensor:
        if target is None:
            return tensor
        src, dst = (target[0].src, target[0].dst) if isinstance(target[0], Conversion) else (computed_on, target[0])
        return redistribute(tensor, src, dst, tp.group)

    targets = tp.resolved.outputs[path]
    if isinstance(output, torch.Tensor):
        return move(output, targets[0])
    if isinstance(output, tuple):
        items = list(output)
        tensors = [i for i, item in enumerate(items) if isinstance(item, torch.Tensor)]
        for index, target in zip(tensors, targets):
            items[index] = move(items[index], target)
        return type(output)(items) if not hasattr(output, "_fields") else type(output)(*items)
    return output
