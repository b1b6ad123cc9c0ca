"""Our executor of torch's pipeline orders for schedules whose backward is whole (GPipe,
1F1B, interleaved 1F1B), in training and inference.

torch's interleaved schedule class decides the order of forwards and backwards on each
rank; we take that order (`pipeline_order`; GPipe's and 1F1B's we write, `single_stage_steps`)
and run it ourselves, because torch's executor runs only torch's PipelineStage: this loop
does per action only what the action needs (wait for its receive, run the stage, start its
sends, count the microbatches alive). On bench/pp.py at p=4, m=8 (4 ranks on a 16-core
machine) it is as close to theory as torch's executor running hand-split stages: 1F1B
0.286 vs torch 0.283 (theory 0.273), interleaved 0.201 vs 0.194 (theory 0.158).

Communication order. Each action posts its receives just before it runs and its sends just
after, in the order of the action list, as torch's executor does: NCCL matches a pair's
messages by order alone (and a receive posted early would hold up later sends on the same
stream), so the order is the contract; gloo runs with the same single tag, so the tests
exercise it.

Sent tensors are released as soon as the order proves their peer received them: a send
lives until this rank receives a message the peer sent after consuming it
(`send_releases`, from every rank's order). Waiting for all sends at the end of the step, as
torch's executors do, keeps every microbatch's activation and input gradient alive across
the step: m of each per boundary, 4 GB a rank on Llama 3 405B's layout (16 microbatches,
4 stages a rank, 8K tokens of a 16,384-wide model over tp8, bf16).

Zero-bubble schedules split the backward into input and weight halves with torch's own
stage machinery and stay on torch's executor (`stages.py`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ...comm import trace_range
from ...tensors import tensor_leaves

Meta = tuple[torch.Size, torch.dtype, bool]  # shape, dtype, requires_grad


@dataclass
class RunnerStage:
    """One stage of this rank: its module and the tensors crossing its boundaries."""

    index: int
    module: nn.Module
    receives: list[Meta]  # activations from the stage before (none on the first)
    sends: list[Meta]  # activations to the stage after (none on the last)


@dataclass(frozen=True)
class Step:
    """One action of the order: forward or (whole) backward of `stage` on `microbatch`."""

    forward: bool
    stage: int
    microbatch: int


def single_stage_steps(schedule: str, rank: int, pp: int, microbatches: int) -> list[Step]:
    """GPipe (every forward, then every backward) or 1F1B (p - 1 - rank forwards to warm up,
    then a forward and a backward alternately, then the remaining backwards) on one stage."""
    m = microbatches
    if schedule == "gpipe":
        return [Step(True, rank, i) for i in range(m)] + [Step(False, rank, i) for i in range(m)]
    warmup = min(pp - 1 - rank, m)
    steps = [Step(True, rank, i) for i in range(warmup)]
    for i in range(m - warmup):
        steps += [Step(True, rank, warmup + i), Step(False, rank, i)]
    return steps + [Step(False, rank, i) for i in range(m - warmup, m)]


def _message(step: Step, num_stages: int) -> Step | None:
    """The step of the order that consumes what `step` sends: a forward's activation the next
    stage's forward, a backward's input gradient the previous stage's backward."""
    if step.forward:
        return Step(True, step.stage + 1, step.microbatch) if step.stage < num_stages - 1 else None
    return Step(False, step.stage - 1, step.microbatch) if step.stage > 0 else None


def send_releases(orders: dict[int, list[Step]], rank: int, num_stages: int) -> dict[int, list[int]]:
    """{position c in pipeline rank `rank`'s steps: positions whose sends are surely received
    once step c's own receive is}: a send consumed at the peer's step k is done when this rank
    receives something the peer sends from a step after k (the first such; none: the end of the
    step). `orders` holds every pipeline rank's steps; stage s runs on rank s mod p."""
    def owner(stage: int) -> int:
        return stage % len(orders)

    where = {r: {step: i for i, step in enumerate(steps)} for r, steps in orders.items()}
    next_to_me = {}  # peer -> [position of its first step at or after i that sends to `rank`]
    for peer, steps in orders.items():
        first, upcoming = [len(steps)] * (len(steps) + 1), len(steps)
        for i in range(len(steps) - 1, -1, -1):
            consumer = _message(steps[i], num_stages)
            if consumer is not None and owner(consumer.stage) == rank:
                upcoming = i
            first[i] = upcoming
        next_to_me[peer] = first
    releases: dict[int, list[int]] = {}
    for a, step in enumerate(orders[rank]):
        consumer = _message(step, num_stages)
        if consumer is None:
            continue
        peer = owner(consumer.stage)
        reply = next_to_me[peer][where[peer][consumer] + 1]
        if reply < len(orders[peer]):
            c = where[rank][_message(orders[peer][reply], num_stages)]
            releases.setdefault(c, []).append(a)
    return releases


def steps_of(order: list[Any]) -> list[Step]:
    """torch's action list for one rank of a multi-stage schedule (None for idle slots)."""
    steps = []
    for action in order:
        kind = action.computation_type.value if action is not None else None
        if kind in (None, "REDUCE_GRAD"):  # idle; gradients reduce from each stage's last backward on
            continue
        if kind not in ("F", "B"):
            raise ValueError(f"pipeline action {action} is neither a forward nor a whole backward")
        steps.append(Step(kind == "F", action.stage_index, action.microbatch_index))
    return steps


class OrderRunner:
    """Runs one rank's steps of a pipeline schedule with its own point-to-point messages."""

    def __init__(self, orders: dict[int, list[Step]], rank: int, stages: list[RunnerStage], num_stages: int,
                 owner: Callable[[int], int], group: dist.ProcessGroup, device: torch.device):
        """`orders`: every pipeline rank's steps (this rank's runs; the others' tell when a send
        has been received)."""
        self.steps = orders[rank]
        self.releases = send_releases(orders, rank, num_stages)
        self.stages = {stage.index: stage for stage in stages}
        self.num_stages = num_stages
        self.owner = owner
        self.group = group
        self.device = device
        self.last_backward = {}  # stage -> index in steps of its last backward
        for position, step in enumerate(self.steps):
            if not step.forward:
                self.last_backward[step.stage] = position

    def _receive(self, metas: list[Meta], src: int, stats: Any = None) -> list[torch.Tensor]:
        tensors, works = [], []
        for shape, dtype, _ in metas:
            buffer = torch.empty(shape, dtype=dtype, device=self.device)
            works.append(dist.irecv(buffer, src=src, group=self.group))
            tensors.append(buffer)
        start = time.perf_counter()
        with trace_range(f"pp receive from rank {src}"):
            for work in works:
                work.wait()
        if stats is not None:
            stats.waiting_s = (stats.waiting_s or 0.0) + time.perf_counter() - start
        return tensors

    def _send(self, tensors: list[torch.Tensor], dst: int, pending: list) -> None:
        with trace_range(f"pp send to rank {dst}"):
            for tensor in tensors:
                pending.append(dist.isend(tensor.detach().contiguous(), dst=dst, group=self.group))

    def _release(self, position: int, pending: dict[int, list]) -> None:
        """Wait for (done: the peer has received them) and drop the sends step `position`'s
        receive proves delivered, so their tensors are freed."""
        for earlier in self.releases.get(position, ()):
            for work in pending.pop(earlier, ()):
                work.wait()

    def run(self, microbatches: list[Any], loss: Callable[[int, Any], torch.Tensor] | None,
            backward_context: Callable[[int, bool], Any], stage_done: Callable[[int], None], stats: Any = None
            ) -> list[Any]:
        """Run the steps on `microbatches` (each stage's `batch=`). Training (`loss` given):
        the last stage's outputs go through `loss(microbatch, output)` and backward runs under
        `backward_context(stage, is_last_backward)`, `stage_done(stage)` after each stage's last;
        `stats.forward_done(stage)` / `backward_done(stage)` count the microbatches alive.
        Returns the last stage's outputs per microbatch in inference (else an empty list)."""
        training = loss is not None
        last_stage = self.num_stages - 1
        saved: dict[tuple[int, int], tuple] = {}
        outputs: list[Any] = [None] * len(microbatches)
        pending: dict[int, list] = {}  # position of the sending step -> its send works
        for position, step in enumerate(self.steps):
            stage = self.stages[step.stage]
            key = (step.stage, step.microbatch)
            if step.forward:
                inputs: list[torch.Tensor] = []
                if step.stage > 0:
                    inputs = self._receive(stage.receives, self.owner(step.stage - 1), stats)
                    inputs = [t.requires_grad_(meta[2] and training) for t, meta in zip(inputs, stage.receives)]
                    self._release(position, pending)
                with trace_range(f"pp forward stage {step.stage} microbatch {step.microbatch}"):
                    out = stage.module(*inputs, batch=microbatches[step.microbatch])
                if step.stage == last_stage:
                    if training:
                        saved[key] = ((loss(step.microbatch, out),), inputs)
                    else:
                        outputs[step.microbatch] = out
                else:
                    self._send(list(out), self.owner(step.stage + 1), pending.setdefault(position, []))
                    if training:
                        saved[key] = (tuple(out), inputs)
                if training and stats is not None:
                    stats.forward_done(step.stage)
                continue
            produced, inputs = saved.pop(key)
            grads = None
            if step.stage < last_stage:
                grads = self._receive([meta for meta in stage.sends if meta[2]], self.owner(step.stage + 1), stats)
                self._release(position, pending)
                produced = tuple(t for t, meta in zip(produced, stage.sends) if meta[2])
            last = self.last_backward[step.stage] == position
            with backward_context(step.stage, last), \
                    trace_range(f"pp backward stage {step.stage} microbatch {step.microbatch}"):
                torch.autograd.backward(produced, grads)
            if stats is not None:
                stats.backward_done(step.stage)
            if step.stage > 0:
                self._send([t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs
                            if t.requires_grad], self.owner(step.stage - 1), pending.setdefault(position, []))
            if last:
                stage_done(step.stage)
        for works in pending.values():  # not on an exception: the peer may never receive
            for work in works:
                work.wait()
        return outputs if not training else []


def stage_metas(received: tuple, produced: Any) -> tuple[list[Meta], list[Meta]]:
    """The boundary metadata of a stage from one example forward of it."""
    def meta(t: torch.Tensor) -> Meta:
        return t.shape, t.dtype, t.requires_grad
    return [meta(t) for t in received], [meta(t) for t in tensor_leaves(produced)]
