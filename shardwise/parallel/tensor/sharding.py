"""Tensor and sequence parallelism driven by a resolved Plan: the executor.

Parameters the plan shards become DTensors on the tp mesh (so state dicts, checkpoints,
optimizers and norms see their global shape and placement); a module holding one must
have a rule in `rules.py`, installed in place (`install_rule`) to compute on the local
shards. `TensorParallel` holds what the rules share within one forward.

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
tp in the gradient buckets, and a Dropout there becomes a `ShardedDropout`, drawing the
mask one process would draw (a router's input jitter, `ShardedJitter`, the same noise).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from ...comm import broadcast_tensors
from ...deferred import is_deferred
from ...errors import ConfigError, PlanError
from ...plan.plan import Conversion
from ...plan.resolve import ResolvedPlan
from ...plan.stages import layer_list
from ...tensors import is_sharded, local, storage_id
from ...topology import Topology
from ...compat import COMPILES_DTENSOR_PARAMETERS, COMPILES_DTENSOR_VIEWS
from ..collectives import enter_parallel, redistribute
from .check import checked_forward
from .conversions import install_activation_conversions
from .loss import PlainLoss
from .regather import GatheredInput, RegatherCounts
from .rules import BUILTIN_FORWARDS, RULE_KIND, RuleContext, install_rule, tensor_parallel_rules


class TensorParallel:
    """The tp executor's state for one model: group, mesh, resolved plan, per-forward cache."""

    def __init__(self, topology: Topology, resolved: ResolvedPlan):
        self.group = topology.group("tp")
        self.wait = topology.wait  # polled waits for eager collectives (regather.py)
        self.mesh = topology.mesh["tp"]
        self.size = topology.sizes["tp"]
        self.rank = topology.tp_rank
        self.resolved = resolved
        self.partial_grad_params: set[int] = set()  # ids of replicated params whose grads are partial over tp
        self.plain_loss = PlainLoss()  # from a loss-parallel head's output to the forward's end
        self.forwards_open = 0  # pmodel's forwards running (a loss-parallel head called outside one gives whole logits)
        self.sharded_modules: dict[str, str] = {}  # module path -> rule name
        self.rule_classes: dict[type, type] = {}  # a module class -> its class computing by a rule (install_rule)
        self.column_blocks: dict[str, int] = {}  # modules whose output features are sharded -> blocks (StridedShard)
        self.first_forward_checked = False
        self.arrived_whole: list[PlanError] = []  # inputs declared sharded that came whole (first forward)
        # a tensor read by column-parallel modules -> {placement: entered}, this forward's (a plain dict keyed
        # by the tensor itself: Dynamo traces it inside a compiled block; cleared when the forward ends)
        self._entered: dict[torch.Tensor, dict[tuple, torch.Tensor]] = {}
        self._gathered: dict[int, GatheredInput] = {}  # storage of an all-gathered input -> its shard
        self.regathers = RegatherCounts()  # how backward gathered the kept shards again (regather.py)
        self._entered_storages: dict[int, str] = {}  # inputs gathered by a conversion -> the converting module
        self._converted: dict[torch.Tensor, bool] = {}  # the same inputs themselves (what compiled code sees)
        self._layouts: dict[tuple, ModuleLayout] = {}  # interned by value (layout)
        self._contexts: dict[int, RuleContext] = {}  # per layout (rule_context)
        self._signatures: dict[type, Any] = {}  # a module class's forward signature (conversions.py), shared
        self.views_of_gathered: str | None = None  # a module whose gathered input is read as a view (eager saw it)
        # the tensors whose storage ids key _gathered and _entered_storages, held until the forward ends so
        # that no new storage takes one of those ids (a stale hit would add a collective on one rank only)
        self._keyed_by_storage: list[torch.Tensor] = []
        self._flow = None  # the first forward's FeatureFlow while it runs
        self._replaying: set[str] = set()  # recomputed modules whose inputs are already converted
        self.computing_partial = False  # inside a row-parallel matmul (its output is a partial sum)
        self._shards_in_buffers: bool | None = None
        self.watched: list[tuple[str, nn.Module]] = []  # the model and its blocks, for compiled_blocks

    def refuse_compiling(self, module: nn.Module, blocks: list[str]) -> None:
        """A `ConfigError` if `blocks` of `module` are (to be) compiled where the compiled code
        would be wrong or crash: on torch < 2.13, or with tp shards inside ZeRO's flat buffers
        before torch 2.14."""
        if not blocks or not self.sharded_modules:
            return
        if not COMPILES_DTENSOR_PARAMETERS:
            raise ConfigError(
                f"{blocks[:3]} are compiled, and torch {torch.__version__} loses the gradients of tensor-parallel "
                "parameters inside compiled code (every one zero, without a word); compile them on torch >= 2.13, "
                "or train them eager here")
        if not COMPILES_DTENSOR_VIEWS and self.shards_in_buffers(module):
            raise ConfigError(
                f"{blocks[:3]} are compiled under tensor parallelism with ZeRO: torch {torch.__version__}'s compiler "
                "cannot trace a DTensor parameter whose shard lives inside ZeRO's flat parameter buffer (Dynamo fails on "
                "a DTensor whose local tensor has a storage offset; torch >= 2.14 traces it). Upgrade torch, compile tp "
                "with zero=0 (ZeRO alone compiles), or train these blocks eager")

    def shards_in_buffers(self, module: nn.Module) -> bool:
        """Whether a tp shard is a view into a larger buffer (ZeRO's flat parameters), once per model."""
        if self._shards_in_buffers is None:
            self._shards_in_buffers = any(p._local_tensor.storage_offset() != 0 for p in module.parameters()
                                          if isinstance(p, DTensor))
        return self._shards_in_buffers

    def compiled_blocks(self) -> list[str]:
        """The watched modules (the model and its main layer list's blocks) compiled in place:
        a few attribute reads, cheap enough for every forward."""
        return [path for path, block in self.watched if getattr(block, "_compiled_call_impl", None) is not None]

    @property
    def loss_parallel(self) -> bool:
        return bool(self.resolved.loss_parallel)

    def check_first_forward(self, module: nn.Module) -> contextlib.AbstractContextManager:
        """Around forwards: the first one runs under `check.checked_forward`, which
        refuses a plan whose sharded features reach a module that cannot take them."""
        if self.first_forward_checked:
            return contextlib.nullcontext()
        return self._checked(module)

    @contextlib.contextmanager
    def _checked(self, module: nn.Module) -> Iterator[None]:
        reducing = {p for p, rule in self.sharded_modules.items() if rule in ("row", "vocab_embedding")}
        row = {p for p, rule in self.sharded_modules.items() if rule == "row"}
        self.arrived_whole = []
        # eager, without compiling: Dynamo would see the check's dispatch mode and skip compiled blocks for good
        with torch.compiler.set_stance("force_eager"), \
                checked_forward(module, self.column_blocks, reducing, row, set(self.resolved.inputs),
                                self.size) as flow:
            self._flow = flow
            try:
                yield
            finally:
                self._flow = None
        if self.arrived_whole:  # after the flow check, whose diagnosis of the same plan says more
            raise self.arrived_whole[0]
        self.first_forward_checked = True

    def rule_context(self, path: str) -> RuleContext:
        """The `tp` a registered rule computes with, one per distinct layout (as `layout`)."""
        layout = self.layout(path)
        if id(layout) not in self._contexts:
            self._contexts[id(layout)] = RuleContext(self, layout)
        return self._contexts[id(layout)]

    def layout(self, path: str) -> ModuleLayout:
        """What the plan says of module `path`'s activations, one object per distinct layout
        (every block of a transformer shares one), so a compiled block reads nothing that
        differs by path and compiles once for all blocks."""
        inputs, outputs = self.resolved.inputs.get(path, ()), self.resolved.outputs.get(path, ())
        key = (repr(inputs), repr(outputs), path in self.resolved.loss_parallel)
        if key not in self._layouts:
            self._layouts[key] = ModuleLayout(tuple(inputs), tuple(outputs), key[2])
        return self._layouts[key]

    def input_placement(self, where: str | ModuleLayout, default: Placement) -> Placement:
        """The placement a module (its path or layout) computes on (after its input conversion, if any)."""
        declared = (self.layout(where) if isinstance(where, str) else where).inputs
        placement = declared[0][0] if declared and declared[0] is not None else default
        return placement.dst if isinstance(placement, Conversion) else placement

    def output_placement(self, where: str | ModuleLayout, default: Placement) -> Placement:
        declared = (self.layout(where) if isinstance(where, str) else where).outputs
        return declared[0][0] if declared and declared[0] is not None else default

    @contextlib.contextmanager
    def replaying(self, path: str) -> Iterator[None]:
        """While recompute runs module `path` again on the inputs it kept: those went
        through the module's input conversions already. What the recomputation's modules
        shared is dropped after it, as after a forward: torch's checkpoint stops a recomputation
        once it has what backward needs, before the block's end clears it, and the entries
        (recomputed tensors, and through their graphs all the block recomputed) outlived backward
        until the next forward: every block's under full recompute (a GPT's in-step peak at tp 2
        was 32-42% over the planner's)."""
        self._replaying.add(path)
        try:
            yield
        finally:
            self._replaying.discard(path)
            if not self._replaying:
                self._drop_shared()

    def convert_input(self, x: torch.Tensor, conversion: Conversion, path: str) -> torch.Tensor:
        """An input conversion "A -> B" at module `path`. Shard -> Replicate gathers the
        tensor for the module's column-parallel projections (an attention block reading the
        full sequence): its gradient there is partial, so backward is one reduce-scatter and
        the projections do not all-reduce again. The first forward checks that only
        column-parallel modules read it. Any other conversion is a plain redistribution."""
        src, dst = conversion.src, conversion.dst
        if not (isinstance(src, Shard) and isinstance(dst, Replicate)):
            return redistribute(x, src, dst, self.group)
        y = self.parallel_input(x, src)
        self._converted[y] = True
        if not torch.compiler.is_compiling():  # storages (views included) and paths only where Dynamo does not trace
            self._entered_storages[storage_id(y.untyped_storage())] = path
            self._keyed_by_storage.append(y)
            if self._flow is not None:
                self._flow.mark_gathered(y, path)
        return y

    def parallel_input(self, x: torch.Tensor, src: Placement) -> torch.Tensor:
        """`enter_parallel`, shared by every module that reads `x` in this forward."""
        if isinstance(src, Replicate) and self._converted and self._gathered_by_conversion(x):
            return x  # gathered by an input conversion, its backward already the reduce-scatter
        by_placement = self._entered.setdefault(x, {})
        key = _placement_key(src)
        entered = by_placement.get(key)
        if entered is None:
            entered = by_placement[key] = enter_parallel(x, src, self.group)
            if isinstance(src, Shard) and entered is not x and not torch.compiler.is_compiling():
                gathered = GatheredInput(x.detach(), src.dim % x.dim(), self.group, self.regathers, self.wait)
                self._gathered[storage_id(entered.untyped_storage())] = gathered
                self._keyed_by_storage.append(entered)
        return entered

    def _gathered_by_conversion(self, x: torch.Tensor) -> bool:
        """Whether `x` is an input a conversion gathered, or (eager only: storages) a view of one.
        Compiled code sees the tensors themselves, so a plan whose column-parallel modules read
        views of a gathered input is refused there (the eager forwards before say whether)."""
        if x in self._converted:
            return True
        if torch.compiler.is_compiling():
            if self.views_of_gathered:
                raise PlanError(
                    f"a compiled block reads a view of the input {self.views_of_gathered!r} gathers for its "
                    "column-parallel modules; shardwise finds such views by storage, which Dynamo cannot trace. Give "
                    "the conversion to the column-parallel modules themselves, or leave this block uncompiled")
            return False
        if self._entered_storages and storage_id(x.untyped_storage()) in self._entered_storages:
            self.views_of_gathered = self._entered_storages[storage_id(x.untyped_storage())]
            return True
        return False

    def end_block(self) -> None:
        """After each block of the main layer list: what its modules shared is dead, and a
        compiled block must find these dicts empty (Dynamo guards on their keys, tensors
        that are gone next step: it recompiled every step). Its gathered inputs go too: held
        to the forward's end, they kept every block's whole (all-gathered) inputs alive through
        it, which sequence parallelism and recompute exist to free."""
        self._drop_shared()

    @torch.compiler.disable
    def end_block_hook(self, *_: Any) -> None:
        """`end_block` as a block's forward hook, kept out of compiled code: compiled, it would
        guard on the dicts' keys it clears (the block's tensors) and recompile every call."""
        self.end_block()

    def end_forward(self) -> None:
        self.plain_loss.leave()
        self._drop_shared()

    def _drop_shared(self) -> None:
        """Forget what a forward's (or a recomputation's) modules shared; the shards kept for
        backward stay with the matmuls that saved them."""
        for gathered in self._gathered.values():
            gathered.forget_shard()
        self._converted.clear()
        self._entered.clear()
        self._gathered.clear()
        self._entered_storages.clear()
        self._keyed_by_storage.clear()

    @contextlib.contextmanager
    def forward(self, module: nn.Module) -> Iterator[None]:
        """Around one forward of `module` (or of a pipeline stage of it): the first is checked,
        and the per-forward state is dropped after each."""
        self.refuse_compiling(module, self.compiled_blocks())
        self.forwards_open += 1
        try:
            with self.check_first_forward(module):
                yield
        finally:
            self.forwards_open -= 1
            self.end_forward()

    def is_replaying(self, path: str) -> bool:
        """Whether module `path` is being recomputed with inputs already converted."""
        return bool(self._replaying) and path in self._replaying  # path unread when empty (compiled code)

    def kept_shard(self, x: torch.Tensor) -> GatheredInput | None:
        """Where `x` was all-gathered from sequence shards, the shard a column-parallel matmul keeps
        for backward instead of it (regather.py), so activation memory is 1/tp. Not inside
        recompute, whose own hooks already keep nothing, nor in compiled code, whose partitioner
        chooses what backward keeps."""
        if torch.compiler.is_compiling() or not self._gathered or not torch.is_grad_enabled() \
                or torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
            return None
        return self._gathered.get(storage_id(x.untyped_storage()))

    def module_output(self, y: torch.Tensor, layout: ModuleLayout, natural: Placement) -> torch.Tensor:
        default = Replicate() if isinstance(natural, Partial) else natural
        dst = self.output_placement(layout, default)
        y = redistribute(y, natural, dst, self.group)
        if layout.loss_parallel:
            if not self.forwards_open and not torch.is_grad_enabled():
                # the model called for inference outside pmodel (transformers' generate): its
                # sampling reads the logits whole (torch's DTensor argmax over the shards fails)
                return redistribute(y, dst, Replicate(), self.group)
            self.plain_loss.enter()
            return DTensor.from_local(y, self.mesh, [dst], run_check=False)
        return y


def _placement_key(placement: Placement) -> tuple:
    """A dict key for a placement built from plain values: torch 2.14's Dynamo cannot trace
    `str()` of a placement object inside a compiled block."""
    return ("shard", placement.dim) if isinstance(placement, Shard) else (type(placement).__name__,)


class ModuleLayout:
    """A module's activation placements from the plan: `inputs` and `outputs` (per tensor
    argument / output, None or a tuple of placements, a `Conversion` first where one is
    declared) and whether its output is loss-parallel. Interned by `TensorParallel.layout`."""

    __slots__ = ("inputs", "outputs", "loss_parallel")

    def __init__(self, inputs: tuple, outputs: tuple, loss_parallel: bool):
        self.inputs, self.outputs, self.loss_parallel = inputs, outputs, loss_parallel


def apply_tensor_parallel(module: nn.Module, topology: Topology, resolved: ResolvedPlan,
                          materialize: Callable[[str, Placement], torch.Tensor] | None = None) -> TensorParallel:
    """Shard `module`'s parameters, install the rule of each module the plan shards, and install the plan's activation conversions.

    Args:
        module: the model (this rank's pipeline stages), materialized or deferred.
        topology: gives the tp group, mesh and rank.
        resolved: the plan resolved on `module`: parameter placements, activation keys,
            attributes to divide by tp.
        materialize: `materialize(name, placement)` is the local shard of a parameter still on
            the meta device (deferred init); otherwise shards are cut from tp rank 0's values.
    Returns:
        The executor: per-forward state, and the replicated parameters whose gradients are
        partial over tp (the gradient buckets sum them).
    """
    tp = TensorParallel(topology, resolved)
    for path, attr in resolved.divide_by_tp:
        owner = module.get_submodule(path)
        setattr(owner, attr, getattr(owner, attr) // tp.size)
    _install_rules(module, tp, materialize)
    install_activation_conversions(module, tp)
    blocks = layer_list(module)
    tp.watched = [("", module)]
    for name, block in module.get_submodule(blocks).named_children() if blocks is not None else ():
        block.register_forward_hook(tp.end_block_hook)
        tp.watched.append((f"{blocks}.{name}", block))
    if tp.size > 1:  # replicated parameters and buffers start identical on every tp rank
        replicated = [local(t) for t in list(module.parameters()) + list(module.buffers()) if not is_sharded(t)]
        broadcast_tensors([t.data for t in replicated], tp.group, 64 << 20)
    return tp


def _install_rules(module: nn.Module, tp: TensorParallel, materialize: Any) -> None:
    """Sharded parameters become DTensors (one per tensor, shared by tied holders) and their
    modules compute by their rules."""
    converted: dict[int, nn.Parameter] = {}
    for path, (rule, placements) in tensor_parallel_rules(module, tp.resolved).items():
        mod = module.get_submodule(path)
        if not any(True for _ in mod.parameters(recurse=False)):
            continue  # pruned: this pipeline rank never runs it
        tp.sharded_modules[path] = kind = RULE_KIND.get(rule, rule.__name__)
        if kind in ("column", "feature_embedding"):
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
        install_rule(mod, functools.partial(rule, tp=tp, layout=tp.layout(path)) if rule in BUILTIN_FORWARDS
                     else functools.partial(rule, tp=tp.rule_context(path)), tp.rule_classes)
        if kind == "row" and isinstance(tp.output_placement(path, Replicate()), Shard) and mod.bias is not None:
            tp.partial_grad_params.add(id(mod.bias))
    for _, mod in module.named_modules():  # tied copies held by modules without a rule
        for leaf, param in list(mod.named_parameters(recurse=False)):
            if id(param) in converted and param is not converted[id(param)]:
                setattr(mod, leaf, converted[id(param)])
