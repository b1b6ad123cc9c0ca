"""Tensor-parallel modules: the rules by which a module whose parameters the plan shards
computes on the local shards of its DTensor parameters, moving activations with explicit
collectives (`collectives.py`):

- column-parallel (weight sharded on the output features): input made replicated with a
  partial gradient (`TensorParallel.parallel_input`), output stays sharded on the last dim;
- row-parallel (sharded on input features): output partial, reduced to the plan's output
  placement (all-reduce, or reduce-scatter along the sequence for sequence parallelism),
  bias added after the reduction;
- vocab-parallel embedding (rows sharded): out-of-range ids masked, output partial;
  feature-parallel embedding (columns sharded): output sharded on the last dim.

A rule is `rule(path, module, placements) -> forward`: it checks (and may complete) the
placements the plan gives the module's parameters, raising `PlanError` for layouts it cannot
compute, and returns the forward that computes on the local shards. The built-in rules
(`nn.Linear`, `nn.Embedding`, Hugging Face's `Conv1D`) are written so. `register_rule(ModuleClass,
rule)` adds one for any other class; its forward is called as `forward(module, *args,
tp=RuleContext)`. Both are installed by `install_rule`: the module object stays (parameters,
state-dict keys, tying, optimizers and the user's hooks unchanged; hooks see local shards)
and its class becomes one whose forward is the rule's. `tensor_parallel_rules` is pure: it refuses a plan before
anything communicates.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from ...errors import PlanError
from ...plan.plan import placement_str, shard_dim
from ...plan.resolve import ResolvedPlan
from ...tensors import shard_for_compute
from ..collectives import redistribute
from .float8 import check_float8_config, float8_column, float8_row, is_float8_linear
from .regather import column_matmul, column_matmul_keeping_shard

if TYPE_CHECKING:
    from .sharding import ModuleLayout, TensorParallel


def _is_conv1d(module: nn.Module) -> bool:  # transformers.pytorch_utils.Conv1D: y = x @ W + b, W (in, out)
    cls = getattr(module, "tensor_parallel_base", type(module))  # its class before install_rule
    return cls.__name__ == "Conv1D" and hasattr(module, "nf")


def column(module: nn.Module, x: torch.Tensor, *, tp: TensorParallel, layout: ModuleLayout) -> torch.Tensor:
    x = tp.parallel_input(x, tp.input_placement(layout, Replicate()))
    weight, bias = shard_for_compute(module.weight), shard_for_compute(module.bias)
    kept = tp.kept_shard(x)
    if kept is not None:
        y = column_matmul_keeping_shard(x, weight, bias, kept, _is_conv1d(module))
    else:
        y = column_matmul(x, weight, bias, _is_conv1d(module))
    return tp.module_output(y, layout, Shard(-1))


def row(module: nn.Module, x: torch.Tensor, *, tp: TensorParallel, layout: ModuleLayout) -> torch.Tensor:
    x = redistribute(x, tp.input_placement(layout, Shard(-1)), Shard(-1), tp.group)
    weight = shard_for_compute(module.weight)
    tp.computing_partial = True  # selective recompute keeps the reduced output, not this full-size partial one
    try:
        y = column_matmul(x, weight, None, _is_conv1d(module))
    finally:
        tp.computing_partial = False
    y = tp.module_output(y, layout, Partial())
    return y if module.bias is None else y + shard_for_compute(module.bias)


def vocab_embedding(module: nn.Module, ids: torch.Tensor, *, tp: TensorParallel, layout: ModuleLayout) -> torch.Tensor:
    ids = redistribute(ids, tp.input_placement(layout, Replicate()), Replicate(), tp.group)
    weight = shard_for_compute(module.weight)
    start = tp.rank * weight.shape[0]
    outside = (ids < start) | (ids >= start + weight.shape[0])
    pad = module.padding_idx
    pad = pad - start if pad is not None and start <= pad < start + weight.shape[0] else None
    out = F.embedding((ids - start).masked_fill(outside, 0), weight, pad, None, 2.0, module.scale_grad_by_freq, module.sparse)
    return tp.module_output(out.masked_fill(outside.unsqueeze(-1), 0.0), layout, Partial())


def feature_embedding(module: nn.Module, ids: torch.Tensor, *, tp: TensorParallel, layout: ModuleLayout) -> torch.Tensor:
    ids = redistribute(ids, tp.input_placement(layout, Replicate()), Replicate(), tp.group)
    out = F.embedding(ids, shard_for_compute(module.weight), module.padding_idx, None, 2.0, module.scale_grad_by_freq, module.sparse)
    return tp.module_output(out, layout, Shard(-1))


class RuleContext:
    """What a registered rule's forward computes with, for the modules of one layout:
    `rank`, `size` and `group` of tp; `local(param)`, a parameter's shard (gradients flow to
    the sharded parameter); `replicated_input(x)`, x whole on every rank with its gradient
    summed over tp (the input of column-parallel compute); `sharded_input(x, dim)`, this
    rank's slice of x along dim (the input of row-parallel compute); `output(y, placement)`,
    y as computed (`Shard(d)` or `Partial()`) moved to the plan's output placement for the
    module (default: Partial is summed to Replicate, a shard stays a shard). The plan's input
    conversions for the module apply first, as for the built-in rules."""

    def __init__(self, tp: TensorParallel, layout: ModuleLayout):
        self._tp, self._layout = tp, layout
        self.rank, self.size, self.group = tp.rank, tp.size, tp.group

    def local(self, param: torch.Tensor | None) -> torch.Tensor | None:
        return shard_for_compute(param)

    def replicated_input(self, x: torch.Tensor) -> torch.Tensor:
        return self._tp.parallel_input(x, self._tp.input_placement(self._layout, Replicate()))

    def sharded_input(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return redistribute(x, self._tp.input_placement(self._layout, Shard(dim)), Shard(dim), self._tp.group)

    def output(self, y: torch.Tensor, placement: Placement) -> torch.Tensor:
        return self._tp.module_output(y, self._layout, placement)


_RULE = "__shardwise_tensor_rule__"


def register_rule(module_class: type, rule: Any = None) -> Any:
    """Give `module_class` a tensor-parallel rule (see the module docstring); also a decorator,
    `@register_rule(FusedQKV)`. The rule belongs to that class only: a subclass, whose forward
    may differ, needs its own."""
    if not (isinstance(module_class, type) and issubclass(module_class, nn.Module)):
        raise PlanError(f"register_rule: {module_class!r} is not an nn.Module class")
    if module_class in (nn.Linear, nn.Embedding) or module_class.__name__ == "Conv1D":
        raise PlanError(f"register_rule({module_class.__name__}): shardwise has a built-in rule for it (column/row "
                        "or vocabulary/feature parallel, as the plan places the weight), and a rule on this class "
                        "would change every such layer in the process, other libraries' included. Register the rule "
                        f"on a subclass of {module_class.__name__} and build the layers you mean with it")

    def attach(fn: Any) -> Any:
        if not callable(fn):
            raise PlanError(f"register_rule({module_class.__name__}, {fn!r}): a rule is a function "
                            "rule(path, module, placements) returning forward(module, *args, tp)")
        setattr(module_class, _RULE, fn)
        return fn

    return attach(rule) if rule is not None else attach


def install_rule(module: nn.Module, forward: Any, classes: dict[type, type]) -> None:
    """From now on `module` computes by `forward(module, *args, **kwargs)`: its class becomes a
    subclass (one per class, kept in `classes`) whose forward calls it. The object stays, so
    its parameters, attributes, state-dict keys and hooks do too; built-in and registered
    rules are installed alike."""
    cls = type(module)
    if cls not in classes:
        def ruled_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return self.tensor_parallel_forward(self, *args, **kwargs)

        def ruled_repr(self: nn.Module) -> str:
            rule = getattr(self.tensor_parallel_forward, "func", self.tensor_parallel_forward)
            return f"{cls.extra_repr(self)}, {getattr(rule, '__name__', 'registered')}-parallel".lstrip(", ")

        classes[cls] = type(f"TensorParallel{cls.__name__}", (cls,), {
            "forward": ruled_forward, "extra_repr": ruled_repr, "__module__": cls.__module__,
            "tensor_parallel_base": cls})
    module.__class__ = classes[cls]
    module.tensor_parallel_forward = forward


class ShardedDropout(nn.Dropout):
    """Dropout on a tp shard of the data (dim `dim`), with the mask one process draws for the
    whole tensor (every tp rank draws it with the same generator state)."""

    def __init__(self, original: nn.Dropout, tp: TensorParallel, dim: int):
        super().__init__(original.p, original.inplace)
        self.tp, self.dim = tp, dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        full = list(x.shape)
        full[self.dim] *= self.tp.size
        mask = F.dropout(torch.ones(full, dtype=x.dtype, device=x.device), self.p, True)
        return x * mask.chunk(self.tp.size, self.dim)[self.tp.rank]


class ShardedJitter:
    """Forward hooks for a mixture-of-experts block that multiplies its input by uniform noise
    in training (Mixtral's `jitter_noise`) and takes a tp shard of the data (dim `dim`): the
    noise one process draws for the whole input, this rank's shard of it (every tp rank draws
    from the same generator state); the block's own draw is switched off around its forward."""

    def __init__(self, tp: TensorParallel, dim: int):
        self.tp, self.dim = tp, dim

    def install(self, module: nn.Module) -> None:
        module.register_forward_pre_hook(self.before, with_kwargs=True)
        module.register_forward_hook(self.after, always_call=True)

    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        noise = module.jitter_noise
        if not module.training or not noise:
            return None
        x = args[0] if args else kwargs["hidden_states"]
        full = list(x.shape)
        full[self.dim] *= self.tp.size
        drawn = torch.empty(full, dtype=x.dtype, device=x.device).uniform_(1.0 - noise, 1.0 + noise)
        x = x * drawn.chunk(self.tp.size, self.dim)[self.tp.rank]
        module._sharded_jitter, module.jitter_noise = noise, 0.0
        return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})

    @staticmethod
    def after(module: nn.Module, args: tuple, output: Any) -> None:
        if getattr(module, "_sharded_jitter", None) is not None:
            module.jitter_noise, module._sharded_jitter = module._sharded_jitter, None


def replace_module(root: nn.Module, original: nn.Module, replacement: nn.Module) -> None:
    """Put `replacement` wherever `original` is a child in `root`'s tree."""
    for path, mod in list(root.named_modules(remove_duplicate=False)):
        if mod is original:
            parent, _, leaf = path.rpartition(".")
            setattr(root.get_submodule(parent), leaf, replacement)


def _builtin_linear(module: nn.Module) -> bool:
    """An nn.Linear (or a subclass keeping its forward) or a Conv1D: a subclass with its own
    forward computes something the rule would not."""
    return (isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward) or _is_conv1d(module)


def _builtin_embedding(module: nn.Module) -> bool:
    return isinstance(module, nn.Embedding) and type(module).forward is nn.Embedding.forward


def rule_for(module: nn.Module) -> Any:
    """The module's tensor-parallel rule: its class's registered one, else a built-in one, else None."""
    own = type(module).__dict__.get(_RULE)
    if own is not None:
        return own
    if _builtin_linear(module) or is_float8_linear(module):
        return linear_rule
    return embedding_rule if _builtin_embedding(module) else None


RULE_KIND = {column: "column", row: "row", vocab_embedding: "vocab_embedding", feature_embedding: "feature_embedding",
             float8_column: "column", float8_row: "row"}  # the built-in forwards, by how their outputs are placed
BUILTIN_FORWARDS = tuple(RULE_KIND)


def _rule(path: str, module: nn.Module, placements: dict[str, Placement]):
    """The forward for a module with sharded parameters (its placements completed)."""
    kind = type(module).__name__
    rule = rule_for(module)
    if rule is None:
        raise PlanError(
            f"{path} ({kind}) has sharded parameters but shardwise has no tensor-parallel rule for {kind}; "
            "shard nn.Linear, nn.Embedding or transformers Conv1D modules (subclasses only if they keep their "
            f"forward), register one with sw.plan.register_rule({kind}, rule), or leave its parameters replicated")
    forward = rule(path, module, placements)
    if not callable(forward):
        raise PlanError(f"the tensor-parallel rule for {kind} returned {forward!r}, not a forward function")
    return forward


def linear_rule(path: str, module: nn.Module, placements: dict[str, Placement]):
    """nn.Linear / Conv1D / torchao's Float8Linear: column-parallel (weight sharded on the
    output features, also as StridedShard for fused weights) or row-parallel (on the input features)."""
    kind = type(module).__name__
    weight = placements.get("weight", Replicate())
    bias = placements.get("bias")
    out_dim = 1 if _is_conv1d(module) else 0  # nn.Linear weight (out, in); Conv1D weight (in, out)
    strided = isinstance(weight, _StridedShard)
    if shard_dim(weight) == out_dim:
        rule, expected = column, _StridedShard(0, split_factor=weight.split_factor) if strided else Shard(0)
    elif shard_dim(weight) == 1 - out_dim and not strided:
        rule, expected = row, Replicate()
    else:
        raise PlanError(
            f"{path}.weight: a {kind} is tensor-parallel with its weight sharded on dim {out_dim} (column) or "
            f"{1 - out_dim} (row), got {placement_str(weight)}"
        )
    if module.bias is not None:
        if bias is not None and bias != expected:
            raise PlanError(
                f"{path}.bias must be {placement_str(expected)} to match {path}.weight "
                f"{placement_str(weight)} ({rule.__name__}-parallel), got {placement_str(bias)}"
            )
        placements["bias"] = expected
    if is_float8_linear(module):
        check_float8_config(path, module)
        return float8_column if rule is column else float8_row
    return rule


def embedding_rule(path: str, module: nn.Module, placements: dict[str, Placement]):
    """nn.Embedding: vocab-parallel (rows sharded) or feature-parallel (columns)."""
    weight = placements.get("weight", Replicate())
    if module.max_norm is not None:
        raise PlanError(f"{path}: tensor-parallel nn.Embedding does not support max_norm")
    if weight == Shard(0):
        return vocab_embedding
    if weight == Shard(1):
        return feature_embedding
    raise PlanError(f"{path}.weight: an Embedding shards rows (Shard(0)) or columns (Shard(1)), got {placement_str(weight)}")


def tensor_parallel_rules(module: nn.Module, resolved: ResolvedPlan) -> dict[str, tuple[Any, dict[str, Placement]]]:
    """Module path -> (rule, full placements of its parameters), for every module whose
    parameters the plan shards. Pure: raises `PlanError` before anything communicates."""
    modules = dict(module.named_modules())
    owned: dict[str, dict[str, Placement]] = {}
    for name, placement in resolved.params.items():
        path, _, leaf = name.rpartition(".")
        owned.setdefault(path, {})[leaf] = placement
    paths_of: dict[int, list[str]] = {}
    for path, sub in module.named_modules(remove_duplicate=False):
        paths_of.setdefault(id(sub), []).append(path)
    for path, placements in owned.items():
        shared = paths_of.get(id(modules.get(path)), [])
        if len(shared) > 1 and any(not isinstance(p, Replicate) for p in placements.values()):
            raise PlanError(f"{type(modules[path]).__name__} {shared[0]!r} is one module used at {shared}: a "
                            "tensor-parallel module computes with the plan of one path. Give each "
                            "place its own module (sharing the parameters, if they are meant to be shared), or "
                            "leave it replicated")
    ruled = {path for path, placements in owned.items()
             if any(not isinstance(p, Replicate) for p in placements.values()) and rule_for(modules[path])}
    computed_by_rule = {id(p) for path in ruled for p in modules[path].parameters(recurse=False)}
    rules = {}
    for path, placements in owned.items():
        mod = modules[path]
        sharded = {leaf for leaf, p in placements.items() if not isinstance(p, Replicate) and getattr(mod, leaf) is not None}
        if not sharded or (path not in ruled and all(id(getattr(mod, leaf)) in computed_by_rule for leaf in sharded)):
            continue  # replicated, or a tied copy of a parameter a rule module computes with
        placements = dict(placements)
        rules[path] = (_rule(path, mod, placements), placements)
        if not path:
            raise PlanError(f"the root module ({type(mod).__name__}) itself is tensor-parallel; its outputs "
                            "would reach the caller as this rank's shards, so parallelize a module containing it")
    return rules
