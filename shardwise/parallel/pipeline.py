"""Pipeline parallelism: an end2end module cut into stages by layer, run by torch's schedules.

How one stage runs an arbitrary `forward(batch)`: every pipeline rank runs the user's own
forward for each microbatch, with each unit (see `plan/stages.py`) wrapped:
- a unit of an earlier stage that holds parameters is skipped and returns a placeholder
  of the shape it would have produced, filled with NaN;
- at the stage's first unit, the tensors it is called with are replaced by the ones the
  previous stage sent;
- at the next stage's first unit the forward stops (a BaseException, so a user's
  `except Exception` cannot swallow it), and that unit's input tensors are this stage's
  output, sent on.
The last stage runs to the end and returns the loss. Glue code and modules without
parameters run on every stage, so values that later stages need and can compute (masks,
rotary embeddings, the batch's labels) are real there; anything that reaches a stage from
an earlier one other than through the stage boundary is NaN, and the first training step
checks for it. Each stage gets the whole microbatch, so it takes from the batch what it
needs.

Why torch.distributed.pipelining: its PipelineStage and schedules (GPipe, 1F1B,
interleaved 1F1B, interleaved zero-bubble) do the send/receive ordering and the split of
backward into input and weight gradients; shardwise supplies each stage as a module
(`StageRunner`). The forward-only passes (the one-time setup on `sample`, and
`infer_step`) are our own: along with activations they carry the shapes of the
placeholders the next stage needs, so any batch shape works for inference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble)
from torch.utils._pytree import tree_flatten, tree_unflatten, treespec_dumps, treespec_loads

from ..batch import batch_size, loss_of, map_tensors, split_batch
from ..errors import BatchError, ModelError, PlanError
from ..plan.stages import StageLayout
from ..topology import Topology

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B,
             "zero-bubble": ScheduleInterleavedZeroBubble}


class _StageExit(BaseException):
    def __init__(self, tensors: list[torch.Tensor]):
        super().__init__()
        self.tensors = tensors


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_flatten(tree)[0] if isinstance(leaf, torch.Tensor)]


def _replace_tensors(tree: Any, tensors: list[torch.Tensor]) -> Any:
    leaves, spec = tree_flatten(tree)
    supply = iter(tensors)
    return tree_unflatten([next(supply) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves], spec)


def _spec(output: Any) -> tuple:
    """What a unit returned, without its values: to build a placeholder elsewhere."""
    leaves, spec = tree_flatten(output)  # the structure as text: it travels between stages
    return treespec_dumps(spec), [("tensor", tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else ("value", x)
                                  for x in leaves]


def _placeholder(spec: tuple, device: torch.device) -> Any:
    tree_spec, leaves = spec
    made = []
    for kind, *rest in leaves:
        if kind == "value":
            made.append(rest[0])
        else:
            shape, dtype = rest
            fill = float("nan") if dtype.is_floating_point else 0
            made.append(torch.full(shape, fill, dtype=dtype, device=device))
    return tree_unflatten(made, treespec_loads(tree_spec))


@dataclass
class _Run:
    stage: int
    first: str
    stop_at: str | None
    received: list[torch.Tensor] | None
    table: dict[str, tuple]
    record: bool


@dataclass
class PipelineStats:
    """Microbatch activations alive per stage (forward done, backward not yet)."""

    alive: dict[int, int] = field(default_factory=dict)
    peak_alive: dict[int, int] = field(default_factory=dict)

    def enter(self, stage: int) -> None:
        self.alive[stage] = self.alive.get(stage, 0) + 1
        self.peak_alive[stage] = max(self.peak_alive.get(stage, 0), self.alive[stage])

    def leave(self, stage: int) -> None:
        self.alive[stage] -= 1


class StageRunner(nn.Module):
    """One pipeline stage as a module for torch's PipelineStage: forward(*received, batch=...)."""

    def __init__(self, pipeline: "Pipeline", stage: int):
        super().__init__()
        self.stage = stage
        self.units = nn.ModuleList(pipeline.unit(p) for p in pipeline.layout.units_of(stage) if pipeline.holds(p))
        self._pipeline = [pipeline]  # a list, so the pipeline is not registered as a submodule

    def forward(self, *received: torch.Tensor, batch: Any) -> Any:
        pipeline = self._pipeline[0]
        out = pipeline.run_stage(self.stage, list(received) if received else None, batch, pipeline.table)
        if self.stage == pipeline.layout.num_stages - 1:
            out = loss_of(out)
        if not isinstance(out, torch.Tensor):  # torch's zero-bubble backward detaches outputs in place
            out = tuple(t.clone() if t._is_view() else t for t in out)
        first = next((t for t in _tensors(out) if t.requires_grad), None)
        if first is not None and torch.is_grad_enabled():
            pipeline.stats.enter(self.stage)
            first.register_hook(lambda grad: pipeline.stats.leave(self.stage))
        return out


class Pipeline:
    """The stages this pipeline rank runs, their schedule and the forward-only passes."""

    def __init__(self, module: nn.Module, topology: Topology, layout: StageLayout, schedule: str,
                 microbatches: int, forward: Callable[[Any], Any]):
        self.module = module
        self.layout = layout
        self.topology = topology
        self.group = topology.group("pp")
        self.ranks = topology.group_ranks("pp")
        self.device = topology.device
        self.microbatches = microbatches
        self.schedule_name = schedule
        self.stages = layout.stages_of_rank(topology.pp_rank)
        self.stats = PipelineStats()
        self.table: dict[str, tuple] = {}
        self._forward = forward
        self._run: _Run | None = None
        self._holds = {u.path: u.params > 0 for u in layout.units}
        self._checked = False
        self.schedule = None
        for path in layout.stage_of:
            unit = module.get_submodule(path)
            original = unit.forward
            unit.forward = lambda *a, _p=path, _o=original, **k: self._unit_forward(_p, _o, *a, **k)

    def unit(self, path: str) -> nn.Module:
        return self.module.get_submodule(path)

    def holds(self, path: str) -> bool:
        return self._holds[path]

    def owner(self, stage: int) -> int:
        """Global rank running `stage` in this rank's pipeline."""
        return self.ranks[stage % self.layout.pp]

    # one stage's forward -------------------------------------------------------------
    def _unit_forward(self, path: str, original: Callable, *args: Any, **kwargs: Any) -> Any:
        run = self._run
        if run is None:
            return original(*args, **kwargs)
        if path == run.stop_at:
            raise _StageExit(_tensors((args, kwargs)))
        stage = self.layout.stage_of[path]
        if path == run.first and run.received is not None:
            args, kwargs = _replace_tensors((args, kwargs), run.received)
        if stage < run.stage and self._holds[path]:
            return _placeholder(run.table[path], self.device)
        out = original(*args, **kwargs)
        if run.record and stage == run.stage and self._holds[path]:
            run.table[path] = _spec(out)
        return out

    def run_stage(self, stage: int, received: list[torch.Tensor] | None, batch: Any,
                  table: dict[str, tuple], record: bool = False) -> Any:
        last = stage == self.layout.num_stages - 1
        stop_at = None if last else self.layout.first_unit(stage + 1)
        self._run = _Run(stage, self.layout.first_unit(stage), stop_at, received, table, record)
        try:
            out = self._forward(batch)
        except _StageExit as done:
            out = tuple(done.tensors)
            if not self._checked:
                self._check_finite(stage, out)
            return out
        finally:
            self._run = None
        if not last:
            raise ModelError(
                f"pipeline stage {stage}'s forward ended without reaching {stop_at!r}, the first module of stage "
                f"{stage + 1}; the forward must call every stage's modules for every batch"
            )
        if not self._checked:
            self._check_finite(stage, _tensors(out))
        return out

    def _check_finite(self, stage: int, tensors: list[torch.Tensor]) -> None:
        bad = [t for t in tensors if t.is_floating_point() and not bool(torch.isfinite(t.detach()).all())]
        if bad:
            raise PlanError(
                f"pipeline stage {stage} computed NaN from placeholder values: one of its modules uses an output "
                "of a module on an earlier stage other than through the stage boundary (the inputs of its first "
                "module). Move the stage boundary, or keep such modules on one stage (or the model itself "
                "produced NaN on this batch)"
            )

    # forward-only passes: setup on `sample`, and inference -------------------------------
    def _send(self, header: Any, tensors: list[torch.Tensor], dst: int) -> None:
        meta = [(tuple(t.shape), t.dtype, t.requires_grad) for t in tensors]
        dist.send_object_list([(header, meta)], dst=dst, group=self.group)
        for t in tensors:
            dist.send(t.detach().contiguous(), dst=dst, group=self.group)

    def _recv(self, src: int) -> tuple[Any, list[torch.Tensor]]:
        box = [None]
        dist.recv_object_list(box, src=src, group=self.group)
        header, meta = box[0]
        tensors = []
        for shape, dtype, requires_grad in meta:
            t = torch.empty(shape, dtype=dtype, device=self.device)
            dist.recv(t, src=src, group=self.group)
            tensors.append(t.requires_grad_(requires_grad and torch.is_grad_enabled()))
        return header, tensors

    def forward_pass(self, batch: Any, grad: bool = False) -> tuple[Any, dict[int, tuple]]:
        """Run every stage in order on `batch`: the last stage's output (on every pipeline
        rank) and, for this rank's stages, (received, produced) example tensors."""
        table: dict[str, tuple] = {}
        examples: dict[int, tuple] = {}
        result = None
        with torch.set_grad_enabled(grad):
            for stage in self.stages:
                received = None
                if stage > 0:
                    table, received = self._recv(self.owner(stage - 1))
                out = self.run_stage(stage, received, batch, table, record=True)
                examples[stage] = (received or [], out)
                if stage + 1 < self.layout.num_stages:
                    self._send(table, list(out), self.owner(stage + 1))
                else:
                    result = map_tensors(out, lambda t: (t.full_tensor() if isinstance(t, DTensor) else t).detach())
        last_owner = self.owner(self.layout.num_stages - 1)
        box = [(table, map_tensors(result, lambda t: t.cpu()))] if self.topology.rank == last_owner else [None]
        dist.broadcast_object_list(box, src=last_owner, group=self.group)
        self.table, result = box[0]
        return map_tensors(result, lambda t: t.to(self.device)), examples

    # training ----------------------------------------------------------------------------
    def setup(self, sample: Any) -> None:
        """Learn boundary and placeholder shapes from one microbatch of `sample`; build the schedule."""
        first = split_batch(sample, self.microbatches)[0]
        self.microbatch_shapes = [tuple(t.shape) for t in _tensors(first)]
        _, examples = self.forward_pass(first, grad=True)
        stages = []
        for stage in self.stages:
            received, produced = examples[stage]
            if stage == self.layout.num_stages - 1:
                produced = loss_of(produced)
            outputs = tuple(t.detach().requires_grad_(t.requires_grad) for t in _tensors(produced))
            inputs = tuple(t.detach().requires_grad_(t.requires_grad) for t in received)  # () for stage 0
            stages.append(PipelineStage(StageRunner(self, stage), stage, self.layout.num_stages, self.device,
                                        input_args=inputs, output_args=outputs, group=self.group))
        self.runners = [s.submod for s in stages]
        schedule_class = SCHEDULES[self.schedule_name]
        target = stages if self.layout.virtual > 1 else stages[0]
        self.schedule = schedule_class(target, self.microbatches, loss_fn=lambda output, target: output)

    def train_step(self, batch: Any) -> torch.Tensor:
        """Run the schedule on `batch`; the mean microbatch loss on every pipeline rank."""
        shapes = [tuple(t.shape) for t in _tensors(split_batch(batch, self.microbatches)[0])]
        if shapes != self.microbatch_shapes:
            raise BatchError(
                f"pipeline stages were set up for microbatches of shapes {self.microbatch_shapes} (from sample); "
                f"this batch gives {shapes}. Pass batches shaped like the sample, or parallelize with a matching sample"
            )
        losses: list[torch.Tensor] = []
        target = torch.zeros(batch_size(batch), device=self.device)
        self.schedule.step(batch=batch, target=target, losses=losses, return_outputs=False)
        self._checked = True
        last_owner = self.owner(self.layout.num_stages - 1)
        mean = torch.stack([l.detach().float() for l in losses]).mean().reshape(1) if losses else \
            torch.zeros(1, device=self.device)
        dist.broadcast(mean, src=last_owner, group=self.group)
        return mean[0]


def prune_to_stages(module: nn.Module, layout: StageLayout, pp_rank: int) -> dict[str, tuple]:
    """Drop the parameters and buffers of modules this pipeline rank never runs.

    Returns the full state dict's layout, key -> (shape, dtype, stage), for gathering it.
    """
    mine = set(layout.stages_of_rank(pp_rank))
    unit_of = {}
    for path in layout.stage_of:
        for sub, _ in module.get_submodule(path).named_modules():
            unit_of[f"{path}.{sub}" if sub else path] = path
    state_layout = {}
    for key, value in module.state_dict(keep_vars=True).items():
        owner_path = key.rpartition(".")[0]
        state_layout[key] = (tuple(value.shape), value.dtype, layout.stage_of[unit_of[owner_path]])
    kept = {id(p) for path in layout.stage_of if layout.stage_of[path] in mine
            for p in module.get_submodule(path).parameters()}
    for path, stage in layout.stage_of.items():
        if stage in mine:
            continue
        for mod in module.get_submodule(path).modules():
            for name, param in list(mod._parameters.items()):
                if param is not None and id(param) not in kept:
                    mod._parameters[name] = None
            for name in list(mod._buffers):
                mod._buffers[name] = None
    return state_layout


def tied_across_ranks(module: nn.Module, layout: StageLayout) -> dict[str, list[int]]:
    """Parameter name -> the pipeline ranks holding it, for parameters held on more than one
    (an input embedding tied to the output head). Call before pruning."""
    holders: dict[int, set[int]] = {}
    for path, stage in layout.stage_of.items():
        for param in module.get_submodule(path).parameters():
            holders.setdefault(id(param), set()).add(stage % layout.pp)
    return {name: sorted(holders[id(p)]) for name, p in module.named_parameters(remove_duplicate=False)
            if len(holders.get(id(p), ())) > 1}
