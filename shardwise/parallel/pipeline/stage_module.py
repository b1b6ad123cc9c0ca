"""One pipeline stage as a real module: torch's PipelineStage calls it with what the stage
receives and the microbatch; it replays its part of the captured program (program.py), its glue
as the recorded aten calls and its units as the user's own modules, so tensor-parallel rules,
ZeRO-3 gathers and recompute wrappers act as in the original forward."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ...errors import ModelError
from ...tensors import tensor_leaves
from ..expert.router import RecordedRouterLogits
from .program import Named, Program, Ref, StagePart, Step


class StageModule(nn.Module):
    """One pipeline stage: runs its part of the captured program on the real units."""

    def __init__(self, root: nn.Module, program: Program, part: StagePart, last: bool, device: torch.device,
                 router_logits: RecordedRouterLogits | None = None):
        super().__init__()
        self._root = [root]  # not registered: the units stay the user's module's children
        self._router_logits = [router_logits]  # units' router logits for a load-balancing loss (program.capture)
        self.program = program
        self.part = part
        self.last = last
        self.device = device
        self._calls: list | None = None  # per step: spec, fixed leaves, slots (built at the first call)
        self._done_after: list[list[int]] = []  # per step: values no later step reads, nor the stage returns
        self._reads_batch = True
        self.units = nn.ModuleDict()  # for PipelineStage's parameter bookkeeping only
        for index in part.steps:
            unit = program.steps[index].unit
            if unit is not None and unit.replace(".", "/") not in self.units:
                self.units[unit.replace(".", "/")] = root.get_submodule(unit)

    def _resolved(self, step: Step) -> tuple[Any, list, list[tuple[int, int]], list[tuple[int, str]], bool]:
        """A step's arguments flattened once: their spec, the leaves fixed for every call
        (constants, constant tensors on this device), the slots filled per call, and whether
        the leaves are the positional arguments themselves (no unflattening per call)."""
        leaves, spec = tree_flatten((step.args, step.kwargs))
        refs, named = [], []
        for slot, leaf in enumerate(leaves):
            if isinstance(leaf, Ref):
                refs.append((slot, leaf.id))
            elif isinstance(leaf, Named):
                named.append((slot, leaf.name))
            elif isinstance(leaf, torch.Tensor):
                leaves[slot] = leaf.to(self.device)
            elif isinstance(leaf, torch.device):
                leaves[slot] = self.device if leaf.type != self.device.type else leaf
        slots = list(range(len(leaves)))
        positional = tree_unflatten(slots, spec) == (tuple(slots), {})
        return spec, leaves, refs, named, positional

    def _prepare(self) -> None:
        """The per-step call records, and whether any of them reads the batch (a stage that
        only transforms what it receives need not flatten the microbatch each call)."""
        self._calls = [(self.program.steps[index], *self._resolved(self.program.steps[index]))
                       for index in self.part.steps]
        read = {value for _, _, _, refs, _, _ in self._calls for _, value in refs}
        if self.last:
            read |= {leaf.id for leaf in tree_flatten(self.program.output)[0] if isinstance(leaf, Ref)}
        read |= set(self.part.sends)
        self._reads_batch = bool(read & set(self.program.inputs))
        # a value is let go after the last step reading it: the replay's environment held every
        # value to the stage's end, so glue outputs outlived their use (a sequence-parallel stage
        # kept its whole embedding output beside the shards the blocks read)
        returned = set(self.part.sends) | ({leaf.id for leaf in tree_flatten(self.program.output)[0]
                                            if isinstance(leaf, Ref)} if self.last else set())
        last_read: dict[int, int] = {}
        for position, (step, _, _, refs, _, _) in enumerate(self._calls):
            for value in list(step.outputs) + [value for _, value in refs]:
                last_read[value] = position
        self._done_after = [[] for _ in self._calls]
        for value, position in last_read.items():
            if value not in returned:
                self._done_after[position].append(value)

    def forward(self, *received: torch.Tensor, batch: Any) -> Any:
        root = self._root[0]
        if self._calls is None:
            self._prepare()
        env: dict[int, Any] = dict(zip(self.part.receives, received))
        if self._reads_batch:
            env.update(zip(self.program.inputs, tensor_leaves(batch)))
        for (step, spec, fixed, refs, named, positional), done in zip(self._calls, self._done_after):
            self.before_step(step.index)
            leaves = list(fixed)
            for slot, value in refs:
                leaves[slot] = env[value]
            for slot, name in named:  # read per call: parameters may be swapped (ZeRO-3, checkpoints)
                leaves[slot] = _named(root, name)
            call = root.get_submodule(step.unit) if step.unit is not None else step.func
            if positional:
                args, kwargs = leaves, {}
            else:
                args, kwargs = tree_unflatten(leaves, spec)
            if step.side:
                out = self._with_router_logits(step, call, args, kwargs)
            elif step.grad or not torch.is_grad_enabled():  # the grad mode it was captured in holds already
                out = call(*args, **kwargs)
            else:
                with torch.no_grad():
                    out = call(*args, **kwargs)
            if isinstance(out, torch.Tensor) and step.tensor_slots == [0]:
                env[step.outputs[0]] = out
            else:
                leaves = tree_flatten(out)[0]
                env.update(zip(step.outputs, (leaves[i] for i in step.tensor_slots)))
            del args, kwargs, leaves, out
            for value in done:
                env.pop(value, None)
        if self.last:
            return tree_map(lambda leaf: env[leaf.id] if isinstance(leaf, Ref) else leaf, self.program.output)
        sent = tuple(env[v] for v in self.part.sends)
        # torch's zero-bubble backward detaches outputs in place: send views as their own tensors
        return tuple(t.clone() if isinstance(t, torch.Tensor) and t._is_view() else t for t in sent)

    def before_step(self, index: int) -> None:
        """Called before each step runs (the random schedule sets the generator here)."""

    def _with_router_logits(self, step: Step, unit: nn.Module, args: Any, kwargs: Any) -> tuple:
        """A unit's output and the logits of its routers, as the capture recorded the call."""
        recorder = self._router_logits[0]
        recorder.start()
        try:
            with contextlib.nullcontext() if step.grad or not torch.is_grad_enabled() else torch.no_grad():
                out = unit(*args, **kwargs)
        finally:
            taken = recorder.stop()
        shapes = tuple(tuple(t.shape) for t in taken)
        if shapes != step.side:
            raise ModelError(
                f"{step.unit}'s routers gave logits of shapes {list(shapes)} where the pipeline captured "
                f"{list(step.side)}: the load-balancing loss, taken over every replica's tokens, was laid out for "
                "microbatches of the same shape on every data-parallel and context-parallel rank. Give every rank "
                "batches of one shape (drop_last=True), or set output_router_logits=False")
        return out, tuple(taken)


def _named(root: nn.Module, name: str) -> torch.Tensor:
    path, _, leaf = name.rpartition(".")
    owner = root.get_submodule(path) if path else root
    tensor = getattr(owner, leaf, None)
    if tensor is None:
        raise ModelError(f"the forward's glue code uses {name!r}, which this pipeline rank does not hold "
                         "(it belongs to another stage's module)")
    return tensor
