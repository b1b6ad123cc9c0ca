"""Pipeline parallelism: stages that run only their own part of the model, on torch's schedules.

The forward is captured once per microbatch shape as a program of unit calls and glue
(`program.py`) and split between stages; each stage is a `StageModule` running its
units (the real modules of this rank) and its glue, so a Hugging Face decoder, our GPT or any
end2end module whose forward calls its layer list in order pipelines without placeholders.
The order of forwards and backwards is GPipe's, 1F1B's or torch's interleaved 1F1B order, run
by our own loop (`runner.py`, leaner per action than torch's executor); interleaved
zero-bubble, whose backward splits into input and weight halves, runs on torch's
`PipelineStage` and schedule class.

Shapes. The first time a microbatch shape is seen, one forward-only pass runs the stages in
order on one microbatch (random state and buffers restored afterwards): it gives every stage
the exact tensors crossing its boundaries, under tensor and sequence parallelism too, so the
PipelineStages run with static metadata.

Random numbers. One process draws a model's random numbers (dropout) in program order,
microbatch after microbatch; a pipeline rank runs only its stages, at other times. Before
each step every rank replays the random ops of every stage for every microbatch on scratch
tensors (recorded as recipes at capture; nothing when the model draws none), noting the
generator state at each of its own random steps; each stage sets that state before the
step and the step ends with the one-process state on every rank. So dropout masks under pp
are exactly those of one process running the same microbatches in order.

Gradients. Microbatch gradients accumulate in the gradient buckets; a stage's last backward
of the step (torch passes `last_backward`) runs as a synchronized backward, each bucket
launching its reduction as soon as it is full, overlapping the rest of that backward and of
the schedule, as DDP does in its last microbatch. Then the stage is marked done (the runner
after that backward, torch's `perform_reduce_grad` under zero-bubble), which settles
parameters that had no gradient. The loss is divided by the
microbatch count before backward (torch's own scaling of `.grad` after the last backward would
race with reductions already under way).

Inference. `infer_step` runs the schedule forward-only over the microbatches (pipelined)
and returns the last stage's outputs on every pipeline rank: tensors with a batch
dimension concatenated, scalars (a mean loss) averaged over the equal microbatches.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.utils._pytree import tree_flatten, tree_unflatten

from ...batch import batch_size, loss_of, map_tensors, split_batch, with_dicts
from ...config import SCHEDULES
from ...plan.stages import StageLayout
from ...random_state import rng_state, set_rng_state, without_trace
from ...tensors import tensor_leaves, whole
from ...topology import Topology
from ..data.step_gradients import GradientSync
from ..expert.router import recorded_router_logits
from .runner import OrderRunner, RunnerStage, single_stage_steps, stage_metas, steps_of
from .program import Program, Ref, StagePart, capture, draw, split
from .stage_module import StageModule

@dataclass
class PipelineStats:
    """Microbatch activations alive per stage (forward done, backward not yet)."""

    alive: dict[int, int] = field(default_factory=dict)
    peak_alive: dict[int, int] = field(default_factory=dict)
    waiting_s: float | None = None  # time blocked in our executor's receives (metrics.py: the bubble)

    def forward_done(self, stage: int) -> None:
        self.alive[stage] = self.alive.get(stage, 0) + 1
        self.peak_alive[stage] = max(self.peak_alive.get(stage, 0), self.alive[stage])

    def backward_done(self, stage: int) -> None:
        self.alive[stage] -= 1


class RandomSchedule:
    """The generator state one process would have at each random step of each microbatch."""

    def __init__(self, program: Program, parts: list[StagePart], mine: list[int], device: torch.device):
        self.device = device
        at = {}
        for part in parts:
            for index in part.steps:
                at.setdefault(index, part.stage)
        self.recipes = {}
        for index in sorted(at):
            drawing = [recipe for recipe in program.steps[index].random if self._draws(recipe)]
            if drawing:
                self.recipes[index] = drawing
        self.order = [(index, at[index]) for index in self.recipes]
        self.mine = set(mine)
        self.states: dict[tuple[int, int], tuple] = {}
        self.final: tuple | None = None

    @property
    def active(self) -> bool:
        return bool(self.order)

    def _draws(self, recipe) -> bool:
        """Whether the op advances the generator: ops that may draw (dropout, attention with a
        dropout argument) draw nothing at p = 0, and replaying those would cost a whole
        attention per layer and microbatch on every rank."""
        before = rng_state(self.device)
        draw([recipe], self.device)
        after = rng_state(self.device)
        set_rng_state(before, self.device)
        return not all(a is None and b is None or torch.equal(a, b) for a, b in zip(before, after))

    def plan(self, microbatches: int) -> None:
        """Replay every stage's random ops for every microbatch from the current state."""
        self.states.clear()
        for microbatch in range(microbatches):
            for index, stage in self.order:
                if stage in self.mine:
                    self.states[(index, microbatch)] = rng_state(self.device)
                draw(self.recipes[index], self.device)
        self.final = rng_state(self.device)

    def restore(self, index: int, microbatch: int) -> None:
        set_rng_state(self.states[(index, microbatch)], self.device)

    def finish(self) -> None:
        set_rng_state(self.final, self.device)


class ScheduledStage(StageModule):
    """A StageModule that knows which microbatch it runs (for the random schedule); `loss_only`
    on the last stage returns the loss. Under torch's executor (`counts_alive`) it also counts
    the microbatches alive for the statistics; our runner counts them itself."""

    def __init__(self, pipeline: "Pipeline", compiled: "Compiled", part: StagePart, loss_only: bool,
                 counts_alive: bool):
        last = part.stage == pipeline.layout.num_stages - 1
        super().__init__(pipeline.module, compiled.program, part, last, pipeline.device, pipeline.router_logits)
        self._pipeline = [pipeline]
        self.random = compiled.random if loss_only else None  # inference draws as it goes
        self.loss_only = loss_only
        self.counts_alive = counts_alive
        self.calls = 0

    def before_step(self, index: int) -> None:
        if self.random is not None and index in self.random.recipes:
            self.random.restore(index, self.calls)

    def forward(self, *received: torch.Tensor, batch: Any) -> Any:
        pipeline = self._pipeline[0]
        if pipeline.plain_forward:
            out = StageModule.forward(self, *received, batch=batch)
        else:
            with pipeline.forward_context():
                out = StageModule.forward(self, *received, batch=batch)
        self.calls += 1
        if self.last:
            out = loss_of(out) if self.loss_only else _leaves_for_merge(out)
        if self.counts_alive and torch.is_grad_enabled():
            first = next((t for t in tensor_leaves(out) if t.requires_grad), None)
            if first is not None:
                pipeline.stats.forward_done(self.part.stage)
                first.register_hook(lambda grad: pipeline.stats.backward_done(self.part.stage))
        return out


class ReducingStage(PipelineStage):
    """torch's PipelineStage whose last backward of the step reduces gradient buckets as they
    fill, and which reports afterwards (`perform_reduce_grad`) that the stage is done."""

    def __init__(self, *args, pipeline: "Pipeline", **kwargs):
        super().__init__(*args, **kwargs)
        self._pipeline = [pipeline]

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True,
                           last_backward: bool = False):
        with self._pipeline[0].backward_of(self.stage_index, last=last_backward and full_backward):
            return super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                              last_backward=last_backward)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False):
        with self._pipeline[0].backward_of(self.stage_index, last=last_backward):
            return super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        super().perform_reduce_grad(grad_scale_factor)
        self._pipeline[0].stage_done(self.stage_index)


@dataclass
class Compiled:
    """Everything that depends on the microbatch shape: the program, its split, the stages."""

    program: Program
    parts: list[StagePart]
    random: RandomSchedule | None
    schedules: dict[bool, Any] = field(default_factory=dict)  # training? -> schedule
    stages: dict[bool, list[PipelineStage]] = field(default_factory=dict)
    examples: dict[int, tuple] = field(default_factory=dict)  # stage -> (received, produced, full output)


class Pipeline:
    """The stages this pipeline rank runs, compiled per microbatch shape, and their schedules."""

    def __init__(self, module: nn.Module, shadow: nn.Module, fake_mode, topology: Topology, layout: StageLayout,
                 schedule: str, microbatches: int, units: list[str], sample: Any, program: Program,
                 forward_context: Callable[[], contextlib.AbstractContextManager] | None,
                 draws: Callable[[Any], Any] | None = None, router_rows: int = 1):
        self.module = module
        self.shadow = shadow
        self.fake_mode = fake_mode
        self.layout = layout
        self.topology = topology
        self.group = topology.group("pp")
        self.ranks = topology.group_ranks("pp")
        self.device = topology.device
        self.microbatches = microbatches
        self.schedule_name = schedule
        self.stages = layout.stages_of_rank(topology.pp_rank)
        self.units = units
        self.stats = PipelineStats()
        # around each stage forward (tensor parallel's checks, context parallel's attention); none: plain
        self.plain_forward = forward_context is None
        self.forward_context = forward_context or contextlib.nullcontext
        self.draws = draws  # the mode a capture runs in to record random ops as the stages draw them
        self.router_rows = router_rows  # ranks whose tokens a router's gathered logits hold (capture's shapes)
        self.router_logits = recorded_router_logits(module)  # units hand them to the stage adding the loss
        self._sync: GradientSync | None = None
        self._holders: Counter[nn.Parameter] = Counter()  # parameter -> this rank's stages yet to finish it
        self._stage_params: dict[int, list[nn.Parameter]] | None = None
        self._losses: list[torch.Tensor] = []  # the last stage's microbatch losses this step
        self._loss_scale, self._parts = 1.0, microbatches
        self._compiled: dict[tuple, Compiled] = {}
        self._captured = {(self._signature(sample), module.training): program}

    def owner(self, stage: int) -> int:
        """Global rank running `stage` in this rank's pipeline."""
        return self.ranks[stage % self.layout.pp]

    # compiling ---------------------------------------------------------------------------------
    @staticmethod
    def _signature(microbatch: Any) -> tuple:
        leaves, spec = tree_flatten(microbatch)
        return str(spec), tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else repr(x) for x in leaves)

    def _program(self, microbatch: Any) -> Program:
        self.shadow.train(self.module.training)
        key = (self._signature(microbatch), self.module.training)
        if key not in self._captured:
            self._captured[key] = capture(self.shadow, self.fake_mode, map_tensors(microbatch, lambda t: t.cpu()),
                                          self.units, self.draws, self.router_rows)
        return self._captured[key]

    def compiled(self, microbatch: Any) -> Compiled:
        key = (self._signature(microbatch), self.module.training)
        if key not in self._compiled:
            program = self._program(microbatch)
            parts = split(program, self.layout.stage_of, self.layout.num_stages)
            random = RandomSchedule(program, parts, self.stages, self.device)
            compiled = Compiled(program, parts, random if random.active else None)
            self._examples(compiled, microbatch)
            self._compiled[key] = compiled
        return self._compiled[key]

    def _examples(self, compiled: Compiled, microbatch: Any) -> None:
        """The tensors each stage receives and produces for `microbatch` (static metadata)."""
        with torch.enable_grad():
            compiled.examples = self._forward_pass(compiled.program, compiled.parts, microbatch)

    def _forward_pass(self, program: Program, parts: list[StagePart], microbatch: Any) -> dict[int, tuple]:
        """Run `microbatch` through this rank's stages in order, receiving from and sending to
        the neighbours; random state and buffers are left as they were."""
        examples = {}
        with without_trace(self.module, self.device):
            for stage in self.stages:
                received: list[torch.Tensor] = []
                if stage > 0:
                    received = self._recv(self.owner(stage - 1))
                module = self.stage_module(program, parts[stage])
                with self.forward_context():
                    out = module(*received, batch=microbatch)
                examples[stage] = (tuple(received), out)
                if stage + 1 < self.layout.num_stages:
                    self._send(list(out), self.owner(stage + 1))
        return examples

    def stage_module(self, program: Program, part: StagePart) -> StageModule:
        """A plain (unscheduled) module running `part` of `program` on this rank's units."""
        return StageModule(self.module, program, part, part.stage == self.layout.num_stages - 1, self.device,
                           self.router_logits)

    def _send(self, tensors: list[torch.Tensor], dst: int) -> None:
        meta = [(tuple(t.shape), t.dtype, t.requires_grad) for t in tensors]
        dist.send_object_list([meta], dst=dst, group=self.group)
        for t in tensors:
            dist.send(t.detach().contiguous(), dst=dst, group=self.group)

    def _recv(self, src: int) -> list[torch.Tensor]:
        received = [None]
        dist.recv_object_list(received, src=src, group=self.group)
        tensors = []
        for shape, dtype, requires_grad in received[0]:
            t = torch.empty(shape, dtype=dtype, device=self.device)
            dist.recv(t, src=src, group=self.group)
            tensors.append(t.requires_grad_(requires_grad))
        return tensors

    def _schedule(self, compiled: Compiled, training: bool):
        if training not in compiled.schedules:
            stages = []
            for stage in self.stages:
                received, produced = compiled.examples[stage]
                last = stage == self.layout.num_stages - 1
                if last:
                    produced = loss_of(produced) if training else _leaves_for_merge(produced)
                outputs = tuple(t.detach().requires_grad_(t.requires_grad) for t in tensor_leaves(produced))
                inputs = tuple(t.detach().requires_grad_(t.requires_grad) for t in received)
                module = ScheduledStage(self, compiled, compiled.parts[stage], loss_only=training,
                                        counts_alive=self.schedule_name == "zero-bubble")
                stages.append(ReducingStage(module, stage, self.layout.num_stages, self.device, input_args=inputs,
                                            output_args=outputs, group=self.group, pipeline=self))
            compiled.stages[training] = stages
            single = self.schedule_name in ("gpipe", "1f1b")  # orders we write ourselves
            schedule = None
            if not single:  # torch's class: the interleaved order, or zero-bubble's executor
                cls = SCHEDULES[self.schedule_name].torch_class
                schedule = cls(stages, self.microbatches, loss_fn=lambda loss, target: self._microbatch_loss(
                    loss, target[0]), scale_grads=False) if training else cls(stages, self.microbatches)
            if self.schedule_name != "zero-bubble":  # a whole backward: our runner (runner.py)
                orders = {rank: [step for step in (
                    single_stage_steps(self.schedule_name, rank, self.layout.pp, self.microbatches) if single
                    else steps_of(schedule.pipeline_order[rank])) if training or step.forward]
                    for rank in range(self.layout.pp)}
                schedule = OrderRunner(orders, self.topology.pp_rank, [RunnerStage(
                    st.stage_index, st.submod, *stage_metas(*compiled.examples[st.stage_index])) for st in stages],
                    self.layout.num_stages, self.owner, self.group, self.device)
            compiled.schedules[training] = schedule
        return compiled.schedules[training]

    def _microbatch_loss(self, loss: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The last stage's loss times its microbatch's weight, noted, and divided by the
        microbatch count for backward (under reduce="mean"): gradients accumulate to the mean
        over microbatches."""
        loss = loss * weight.to(loss.dtype)
        self._losses.append(loss.detach())
        scaled = loss.float() * self._loss_scale if self._loss_scale != 1.0 else loss
        return scaled / self._parts if self._parts > 1 else scaled

    def _begin(self, compiled: Compiled, training: bool) -> None:
        for stage in compiled.stages[training]:
            stage.submod.calls = 0
        if compiled.random is not None and training:
            compiled.random.plan(self.microbatches)

    def _params_by_stage(self) -> dict[int, list[nn.Parameter]]:
        """This rank's stages -> their parameters (read at the first step: after parallelize)."""
        if self._stage_params is None:
            self._stage_params = {
                stage: list(dict.fromkeys(p for path, owner in self.layout.stage_of.items() if owner == stage
                                          for p in self.module.get_submodule(path).parameters()))
                for stage in self.stages}
        return self._stage_params

    def stage_done(self, stage: int) -> None:
        """`stage`'s last backward of the step is done: its parameters held by no other
        stage of this rank still running backward have final gradients."""
        if self._sync is None:
            return
        final = []
        for param in self._params_by_stage()[stage]:
            self._holders[param] -= 1
            if self._holders[param] == 0:
                final.append(param)
        self._sync.final(final)

    def backward_of(self, stage: int, last: bool) -> contextlib.AbstractContextManager:
        """The context of one backward of `stage`: its last synchronizes as it goes, unless
        another stage of this rank shares a parameter with it and has backward still to run
        (then that parameter's bucket waits for `stage_done` of its last holder)."""
        if not last or self._sync is None or any(self._holders[p] > 1 for p in self._params_by_stage()[stage]):
            return contextlib.nullcontext()
        return self._sync.last_backward()

    # running -----------------------------------------------------------------------------------
    def train_step(self, batch: Any, sync: GradientSync | None = None,
                   loss_weights: list[float] | None = None, loss_scale: float = 1.0, reduce: str = "mean") -> torch.Tensor:
        """Run the schedule on `batch`; the mean microbatch loss on every pipeline rank.
        With `sync`, each stage's gradients are reduced from its last backward on;
        `loss_weights` scale each microbatch's loss (context parallelism's shares), and
        `loss_scale` the loss backward starts from (float16's loss scaler); `reduce="sum"`
        sums the microbatches' losses and gradients instead of averaging them."""
        self._loss_scale, self._parts = loss_scale, self.microbatches if reduce == "mean" else 1
        batch = with_dicts(batch)
        microbatches = split_batch(batch, self.microbatches)
        compiled = self.compiled(microbatches[0])
        schedule = self._schedule(compiled, training=True)
        self._begin(compiled, training=True)
        self._sync = sync
        self._holders = Counter(p for params in self._params_by_stage().values() for p in params)
        self._losses = []
        weights = torch.tensor(loss_weights or [1.0] * self.microbatches, device=self.device)
        target = weights.repeat_interleave(batch_size(batch) // self.microbatches)  # split like the batch
        try:
            if isinstance(schedule, OrderRunner):
                schedule.run(microbatches, lambda i, loss: self._microbatch_loss(loss, weights[i]),
                             self.backward_of, self.stage_done, self.stats)
            else:
                schedule.step(batch=batch, target=target, return_outputs=False)
        finally:
            self._sync = None
        if compiled.random is not None:
            compiled.random.finish()
        last_owner = self.owner(self.layout.num_stages - 1)
        stacked = torch.stack([l.float() for l in self._losses]) if self._losses else None
        mean = torch.zeros(1, device=self.device) if stacked is None else \
            (stacked.mean() if reduce == "mean" else stacked.sum()).reshape(1)
        self._losses = []
        dist.broadcast(mean, src=last_owner, group=self.group)
        return mean[0]

    def training_order(self, batch: Any) -> list | None:
        """This rank's actions (runner.Step) in a training step on `batch`, in order; None
        where torch's executor runs the schedule (zero-bubble)."""
        schedule = self._schedule(self.compiled(split_batch(with_dicts(batch), self.microbatches)[0]), training=True)
        return list(schedule.steps) if isinstance(schedule, OrderRunner) else None

    @torch.no_grad()
    def infer_step(self, batch: Any) -> Any:
        """The forward's outputs for `batch`, the microbatches pipelined; on every pipeline rank."""
        batch = with_dicts(batch)
        parts = self.microbatches if batch_size(batch) % self.microbatches == 0 else 1
        if parts != self.microbatches:
            return self._infer_sequentially(batch)
        microbatch = split_batch(batch, parts)[0]
        compiled = self.compiled(microbatch)
        schedule = self._schedule(compiled, training=False)
        self._begin(compiled, training=False)
        if isinstance(schedule, OrderRunner):
            chunks = schedule.run(split_batch(batch, parts), None, None, None)
            merged = tuple(torch.cat(leaves) for leaves in zip(*chunks)) if chunks[0] is not None else ()
        else:
            merged = schedule.eval(batch=batch)
        result = None
        last_owner = self.owner(self.layout.num_stages - 1)
        if self.topology.rank == last_owner:
            result = _rebuild(compiled.program, merged if isinstance(merged, (tuple, list)) else (merged,))
        received = [map_tensors(result, lambda t: t.cpu()) if result is not None else None]
        dist.broadcast_object_list(received, src=last_owner, group=self.group)
        return map_tensors(received[0], lambda t: t.to(self.device))

    def _infer_sequentially(self, batch: Any) -> Any:
        """A batch the microbatch count does not divide: one pass through the stages in order."""
        program = self._program(batch)
        examples = self._forward_pass(program, split(program, self.layout.stage_of, self.layout.num_stages), batch)
        last = self.layout.num_stages - 1
        last_owner = self.owner(last)
        result = _rebuild(program, _leaves_for_merge(examples[last][1])) if last in examples else None
        received = [map_tensors(result, lambda t: t.cpu()) if result is not None else None]
        dist.broadcast_object_list(received, src=last_owner, group=self.group)
        return map_tensors(received[0], lambda t: t.to(self.device))


def _leaves_for_merge(output: Any) -> tuple[torch.Tensor, ...]:
    """The forward output's tensors for torch's merge of microbatch outputs, which
    concatenates along dim 0: scalars become 1-element vectors (averaged in `_rebuild`)."""
    return tuple(t.reshape(1) if t.dim() == 0 else t for t in tensor_leaves(output))


def _rebuild(program: Program, merged: tuple) -> Any:
    """The forward's output from the merged microbatch tensors: scalars (a mean loss) as the
    mean over the equal microbatches, the rest concatenated along the batch."""
    refs = [leaf for leaf in tree_flatten(program.output)[0] if isinstance(leaf, Ref)]
    values = []
    for leaf, tensor in zip(refs, merged):
        tensor = whole(tensor)
        values.append(tensor.mean() if leaf.id in program.scalar_outputs else tensor)
    supply = iter(values)
    leaves, spec = tree_flatten(program.output)
    return tree_unflatten([next(supply) if isinstance(leaf, Ref) else leaf for leaf in leaves], spec)
