"""Pipeline stages as real modules: the forward captured once as a program of unit calls and
glue, then split so each stage runs only its own part.

Capture. The user's `forward(batch)` is arbitrary Python, so it is run once, on a *shadow*
of the model (a copy whose parameters are fake tensors: no memory), under a dispatch mode
that records it at the granularity of units (the modules a stage boundary may fall between,
see plan/stages.py): every unit call, with its arguments as references to earlier values,
and every aten op of the glue code between units (position ids, masks, residual sums, the
loss), with non-tensor arguments as constants. Control flow is specialized to the captured
batch shapes, as torch.export would; a new shape is captured again.

Split. Each value has an origin: a batch tensor is available on every stage; a unit's
outputs on that unit's stage; a glue op's on the latest origin of its inputs. A stage runs
its own unit calls, and the glue they or later stages need: glue that depends on the batch
alone (an arange, a mask built from the ids) is recomputed wherever it is needed; any other
value is computed once, on its origin stage, and sent down the pipeline to the stages that
use it (a hidden state, Llama's rotary cos/sin). Random glue ops run on one stage only.

Execution (`stage_module.py`). `StageModule` is an nn.Module for torch's PipelineStage: `forward(*received,
batch=microbatch)` binds the batch and the received values, replays its glue ops (calling
the recorded aten overloads, so autograd, DTensor and loss-parallel dispatch work as in the
original forward) and calls its units as the real modules (tensor-parallel rules, ZeRO-3
gathers and recompute wrappers apply). It returns the values the next stage needs, or on
the last stage what the user's forward returned.

Why not torch.export and torch's pipeline tracer: export inlines module calls into aten
ops, so shardwise's tensor-parallel modules, ZeRO-3 hooks and recompute wrappers, which act
at module calls, would no longer run; and exporting a Hugging Face model takes tens of
seconds per shape. This capture keeps modules whole and costs one fake forward.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from ...batch import loss_of
from ...errors import ModelError
from ...tensors import is_kv_cache, op_name, tensor_leaves
from ..expert.experts import grouped_experts
from ..expert.router import recorded_router_logits


@dataclass(frozen=True)
class Ref:
    """A value of the program: a tensor produced by the batch, a unit, or a glue op."""

    id: int


@dataclass(frozen=True)
class Named:
    """A parameter or buffer of the model used directly by glue code, by its name."""

    name: str


@dataclass
class Step:
    """One recorded call: a glue op (`func`) or a unit (`unit`, a module path)."""

    index: int
    func: Any | None
    unit: str | None
    args: Any  # pytree with Ref/Named leaves for tensors, constants otherwise
    kwargs: Any
    outputs: list[int]  # value ids of the tensor leaves of the result
    tensor_slots: list[int]  # positions of the result's tensor leaves (in pytree flatten order)
    grad: bool  # grad mode it ran in
    random: list  # recipes of the random ops it runs (for the one-process RNG schedule)
    side: tuple = ()  # a unit's: shapes of the router logits it hands out (its result is (out, logits))


@dataclass
class Program:
    """A captured forward: batch inputs, steps in order, and what forward returned."""

    inputs: list[int]  # value ids of the batch's tensor leaves, in flatten order
    steps: list[Step]
    output: Any  # pytree with Ref leaves for tensors
    unit_flops: dict[str, float]
    unit_order: list[str]  # units by first call
    scalar_outputs: set[int] = field(default_factory=set)  # output values that are 0-dim (a loss)
    producer: dict[int, int] = field(default_factory=dict)  # value id -> step index (absent: batch)

    def __post_init__(self) -> None:
        for step in self.steps:
            for value in step.outputs:
                self.producer[value] = step.index


def fake_shadow(module: nn.Module, fake_mode: FakeTensorMode | None,
                dtype: torch.dtype | None = None) -> tuple[nn.Module, FakeTensorMode]:
    """A copy of `module` whose parameters and buffers are fake tensors (no memory), and the
    fake mode to run it in. A module already built by deferred_init keeps its fake tensors.
    `dtype`: the floating-point dtype the module will run in (ParallelConfig.param_dtype), which
    the shadow takes too: a capture must see the dtypes the stages will, or a cast the forward
    makes (Hugging Face's loss upcasting bf16 logits to float32) is a no-op on float32 values,
    goes unrecorded, and the stages would compute the loss in bf16."""
    tensors = list(module.parameters()) + list(module.buffers())
    own_mode = fake_mode is None
    if own_mode:
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    memo: dict[int, Any] = {}
    for t in tensors:
        value = fake_mode.from_tensor(t.detach()) if own_mode else t
        if dtype is not None and value.is_floating_point() and value.dtype != dtype:
            with fake_mode:
                value = value.detach().to(dtype)
        if value is t:
            memo[id(t)] = t
        else:
            memo[id(t)] = nn.Parameter(value, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else value
    shadow = copy.deepcopy(module, memo)
    for experts in grouped_experts(shadow).values():  # their token grouping has data-dependent shapes, which
        experts.forward = _same_shape  # fake tensors cannot run; a capture needs only the output's shape
    return shadow, fake_mode


def _same_shape(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """A mixture-of-experts layer's output as far as the capture sees it: its input's shape."""
    return torch.zeros_like(hidden_states)


class _Recorder(TorchDispatchMode):
    """Records glue ops (outside any unit) and, at any depth, whether random ops ran."""

    def __init__(self, program: "_Builder"):
        super().__init__()
        self.builder = program

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.builder.random_ops.append((func, tree_map(_recipe, args), tree_map(_recipe, kwargs)))
        self.builder.on_op(func, args, kwargs, out)
        return out


@dataclass(frozen=True)
class Scratch:
    """A tensor argument of a random op, by shape: enough to replay what it draws."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


def _recipe(leaf: Any) -> Any:
    return Scratch(tuple(leaf.shape), tuple(leaf.stride()), leaf.dtype) if isinstance(leaf, torch.Tensor) else leaf


def draw(recipes: list, device: torch.device) -> None:
    """Run random ops on scratch tensors: the generator advances as the real ops advance it."""
    def make(leaf: Any) -> Any:
        if isinstance(leaf, Scratch):
            return torch.empty_strided(leaf.shape, leaf.stride, dtype=leaf.dtype, device=device)
        if isinstance(leaf, torch.device):
            return device
        return leaf

    with torch.no_grad():
        for func, args, kwargs in recipes:
            func(*tree_map(make, args), **tree_map(make, kwargs))


class _Builder:
    def __init__(self, module: nn.Module, units: list[str]):
        self.values: dict[int, int] = {}  # id(tensor) -> value id
        self.alive: list[torch.Tensor] = []
        self.counter = itertools.count()
        self.steps: list[Step] = []
        self.depth = 0
        self.units = {path: module.get_submodule(path) for path in units}
        self.named = {id(t): n for n, t in itertools.chain(module.named_parameters(remove_duplicate=False),
                                                             module.named_buffers(remove_duplicate=False))}
        self.flops: dict[str, float] = {u: 0.0 for u in units}
        self.order: list[str] = []
        self.random_ops: list = []  # random ops since the current top-level step began
        self.empty_caches: set[int] = set()  # key/value caches first seen empty (replayed as None)

    def note_caches(self, args: Any, kwargs: Any, unit: str) -> None:
        """A key/value cache object (Hugging Face's `past_key_values`) handed to a unit is
        Python state the stages cannot share. One that is empty when first seen, as when a
        model builds a fresh cache in a training forward, changes nothing the unit computes
        and is replayed as None; a cache holding earlier keys is refused."""
        for leaf in tree_flatten((args, kwargs))[0]:
            if not is_kv_cache(leaf) or id(leaf) in self.empty_caches:
                continue
            if leaf.get_seq_length() != 0:
                raise ModelError(f"the forward passes a {type(leaf).__name__} holding earlier keys and values to "
                                 f"{unit}; pipeline stages cannot share it. Call the model with use_cache=False "
                                 "and no past_key_values when training")
            self.empty_caches.add(id(leaf))

    def bind(self, tensor: torch.Tensor) -> int:
        value = next(self.counter)
        self.values[id(tensor)] = value
        self.alive.append(tensor)
        return value

    def ref(self, leaf: Any) -> Any:
        if id(leaf) in self.empty_caches:
            return None
        if not isinstance(leaf, torch.Tensor):
            return leaf
        if id(leaf) in self.values:
            return Ref(self.values[id(leaf)])
        if id(leaf) in self.named:
            return Named(self.named[id(leaf)])
        if leaf.numel() <= 64 and not _is_fake(leaf):  # a small constant tensor of the code
            return leaf.detach().clone()
        raise ModelError(
            f"the forward uses a tensor of shape {tuple(leaf.shape)} that comes neither from the batch, nor from a "
            "module's parameters or buffers, nor from a computation in the forward; pipeline stages cannot "
            "reproduce it. Register it as a buffer of a module"
        )

    def record(self, func, unit, args, kwargs, out, side: tuple = ()) -> None:
        leaves = tree_flatten(out)[0]
        slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        refs = tree_map(self.ref, args), tree_map(self.ref, kwargs)
        outputs = [self.bind(leaves[i]) for i in slots]
        self.steps.append(Step(len(self.steps), func, unit, refs[0], refs[1], outputs, slots,
                               torch.is_grad_enabled(), self.random_ops, side))
        self.random_ops = []

    def on_op(self, func, args, kwargs, out) -> None:
        if self.depth:
            return
        if op_name(func) == "_local_scalar_dense":
            raise ModelError("the forward reads a tensor's value into Python (.item(), a data-dependent branch); "
                             "pipeline stages replay the forward's operations and cannot follow that")
        self.record(func, None, args, kwargs, out)


def capture_module(module: nn.Module, microbatch: Any, fake_mode: FakeTensorMode | None = None,
                   parts: list[str] | tuple[str, ...] = (), draws: Callable[[Any], Any] | None = None,
                   router_rows: int = 1, dtype: torch.dtype | None = None,
                   ) -> tuple[Program, nn.Module, FakeTensorMode, list[str]]:
    """Capture `module`'s forward on `microbatch` at the units of plan/stages.py: the program,
    the fake shadow it ran on (kept to capture other shapes later; in `dtype`, as `fake_shadow`),
    its fake mode and the units."""
    from ...plan.stages import candidate_units

    units = candidate_units(module, parts)
    shadow, fake_mode = fake_shadow(module, fake_mode, dtype)
    return capture(shadow, fake_mode, microbatch, units, draws, router_rows), shadow, fake_mode, units


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def capture(shadow: nn.Module, fake_mode: FakeTensorMode, microbatch: Any, units: list[str],
            draws: Callable[[Any], Any] | None = None, router_rows: int = 1) -> Program:
    """Run `shadow`'s forward on a fake copy of `microbatch`, recording the unit program.
    `draws(microbatch)`: a mode to run it in that draws random numbers as the real forward
    does (context parallelism's whole-sequence draws), so the recorded random ops replay them.
    `router_rows`: the ranks whose tokens a router's logits hold when a load-balancing loss
    gathers them (expert/router.py); a unit hands its routers' logits out as extra outputs."""
    from torch.utils.flop_counter import FlopCounterMode

    builder = _Builder(shadow, units)
    counter = FlopCounterMode(display=False)
    handles = []
    started: dict[str, float] = {}
    recorder = recorded_router_logits(shadow, router_rows)
    for path, unit in builder.units.items():
        def before(m, args, kwargs, path=path):
            if builder.depth == 0:
                if path not in builder.order:
                    builder.order.append(path)
                started[path] = counter.get_total_flops()
                builder.note_caches(args, kwargs, path)
                builder.pending = (args, kwargs)
                builder.random_ops = []
                if recorder is not None:
                    recorder.start()
            builder.depth += 1

        def after(m, args, kwargs, out, path=path):
            builder.depth -= 1
            if builder.depth == 0:
                builder.flops[path] += counter.get_total_flops() - started.pop(path)
                call_args, call_kwargs = builder.pending
                side = recorder.stop() if recorder is not None else []
                if side:
                    out = (out, tuple(side))
                builder.record(None, path, call_args, call_kwargs, out, tuple(tuple(t.shape) for t in side))

        handles.append(unit.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(unit.register_forward_hook(after, with_kwargs=True))
    try:
        with fake_mode:
            batch = tree_map(lambda t: fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, microbatch)
            inputs = [builder.bind(t) for t in tensor_leaves(batch)]
            with torch.enable_grad(), counter, _Recorder(builder), \
                    draws(microbatch) if draws is not None else contextlib.nullcontext():
                out = shadow(batch)
    finally:
        for handle in handles:
            handle.remove()
        if recorder is not None:
            recorder.remove()
    loss_of(out, needs_grad=False)  # a pipeline's last stage hands the loss to the schedule
    output = tree_map(builder.ref, out)
    scalars = {builder.values[id(t)] for t in tensor_leaves(out) if t.dim() == 0}
    return Program(inputs, builder.steps, output, builder.flops, builder.order, scalars)


# -- splitting ----------------------------------------------------------------------------
@dataclass
class StagePart:
    """What one stage runs and exchanges."""

    stage: int
    steps: list[int]  # step indices, in program order
    receives: list[int]  # value ids arriving from the previous stage, in order
    sends: list[int]  # value ids going to the next stage, in order


def split(program: Program, stage_of_unit: dict[str, int], num_stages: int) -> list[StagePart]:
    """Assign each step to the stages that run it and list the values crossing each boundary.

    A step's home: a unit's stage; a glue op's, the latest home of its inputs (a random glue
    op's, also at least the stage of the next unit, where one process would draw it). Glue
    depending on the batch alone (home -1) is recomputed on every stage that needs it; every
    other value is made once, at home, and passed down the pipeline to the stages using it.
    """
    steps = program.steps
    home = _step_homes(program, stage_of_unit, num_stages)
    runs_at: dict[int, set[int]] = {step.index: set() for step in steps}
    needed_at: dict[int, set[int]] = {}

    def run(index: int, stage: int) -> None:
        if stage in runs_at[index]:
            return
        runs_at[index].add(stage)
        for value in _input_values(steps[index]):
            need(value, stage)

    def need(value: int, stage: int) -> None:
        needed_at.setdefault(value, set()).add(stage)
        producer = program.producer.get(value)
        if producer is None:
            return  # a batch tensor: every stage has the microbatch
        where = home[producer]
        if where > stage:
            step = steps[producer]
            raise ModelError(f"pipeline stage {stage} uses a value computed by "
                             f"{step.unit or op_name(step.func)!r} on stage {where}: stages must follow the forward's "
                             "order; move the stage boundary")
        run(producer, stage if where == -1 else where)

    for step in steps:
        if step.unit is not None:
            run(step.index, stage_of_unit[step.unit])
    for leaf in tree_flatten(program.output)[0]:
        if isinstance(leaf, Ref):
            need(leaf.id, num_stages - 1)
    parts = [StagePart(s, [st.index for st in steps if s in runs_at[st.index]], [], []) for s in range(num_stages)]
    for value, stages in needed_at.items():
        producer = program.producer.get(value)
        if producer is None or home[producer] == -1:
            continue  # batch tensors and batch-only glue are at hand everywhere
        for boundary in range(home[producer], max(stages)):
            parts[boundary].sends.append(value)
            parts[boundary + 1].receives.append(value)
    for part in parts:
        part.sends.sort()
        part.receives.sort()
    return parts


def _step_homes(program: Program, stage_of_unit: dict[str, int], num_stages: int) -> dict[int, int]:
    """Step index -> its home stage (-1: glue depending on the batch alone); see `split`."""
    home_of_value: dict[int, int] = {v: -1 for v in program.inputs}
    home: dict[int, int] = {}
    next_unit = num_stages - 1
    for step in reversed(program.steps):
        if step.unit is not None:
            next_unit = stage_of_unit[step.unit]
        home[step.index] = next_unit  # provisional: only random glue keeps it
    for step in program.steps:
        if step.unit is not None:
            where = stage_of_unit[step.unit]
        else:
            where = max([home_of_value[v] for v in _input_values(step)], default=-1)
            if step.random:
                where = max(where, home[step.index])
        home[step.index] = where
        for value in step.outputs:
            home_of_value[value] = where
    return home


def _input_values(step: Step) -> list[int]:
    return [leaf.id for leaf in tree_flatten((step.args, step.kwargs))[0] if isinstance(leaf, Ref)]
