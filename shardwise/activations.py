"""Activation memory: the bytes one microbatch's forward keeps alive for its backward, on this rank.

Measured, not estimated. A dispatch mode notes the storage of every tensor the forward
creates (a DTensor's local shard) with a weak reference, and the unit that was running (a
module around the model's layer list, or one of its blocks). After the forward, holding
only what a training step holds until backward (the loss; a pipeline stage's outputs), the
storages still alive are exactly what autograd saved: activations, the inputs full
recompute keeps, the outputs selective recompute keeps. Parameters, gradients and the
batch existed before and are not counted. Random state and buffers are restored after, so
measuring changes nothing about training.
"""

from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from .batch import loss_of
from .errors import ConfigError
from .plan.stages import candidate_units, layer_list
from .random_state import without_trace
from .tensors import local, storage_id, tensor_leaves

OUTSIDE = "(outside any unit)"


@dataclass
class ActivationMemory:
    """Bytes saved for backward by one microbatch on this rank, in all and by unit."""

    total: int
    by_unit: dict[str, int] = field(default_factory=dict)  # unit path -> bytes it created and autograd kept
    layers: list[str] = field(default_factory=list)  # the layer-list blocks this rank ran

    @property
    def per_layer(self) -> float:
        """Mean bytes over the blocks of the layer list this rank ran (0 when it ran none)."""
        return sum(self.by_unit.get(p, 0) for p in self.layers) / len(self.layers) if self.layers else 0.0

    def describe(self) -> str:
        mib = 2.0 ** 20
        return (f"{self.total / mib:.2f} MiB saved for backward per microbatch"
                + (f", {self.per_layer / mib:.3f} MiB per layer over {len(self.layers)} layers" if self.layers else ""))


def _storage(tensor: torch.Tensor) -> torch.UntypedStorage | None:
    """The storage holding `tensor`'s data on this rank (a DTensor's local shard)."""
    while True:
        if isinstance(tensor, DTensor):
            tensor = local(tensor)
        elif hasattr(tensor, "elem") and isinstance(tensor.elem, torch.Tensor):  # an async collective's result
            tensor = tensor.elem
        else:
            break
    if tensor.device.type == "meta" or type(tensor) not in (torch.Tensor, FakeTensor) \
            and not isinstance(tensor, torch.nn.Parameter):
        return None
    return tensor.untyped_storage()


class _Creations(TorchDispatchMode):
    """Notes every new storage an op returns, charged to the running unit."""

    def __init__(self, existing: set[int], fake_mode: FakeTensorMode | None):
        super().__init__()
        self.existing = existing
        self.fake_mode = fake_mode
        self.twins: dict[int, torch.Tensor] = {}  # id of a real tensor -> its fake twin
        self.created: dict[int, tuple[StorageWeakRef, int, str]] = {}
        self.units: list[str] = []

    def _fake(self, x: Any) -> Any:
        """A real tensor's fake twin; the twin of one that existed before exists too (a view
        of a parameter is no activation)."""
        if type(x) not in (torch.Tensor, torch.nn.Parameter):  # fake already, or no tensor
            return x
        twin = self.twins.get(id(x))
        if twin is None:  # kept alive while measuring: a freed twin's storage id would be reused
            twin = self.twins[id(x)] = self.fake_mode.from_tensor(x)
            if storage_id(x.untyped_storage()) in self.existing:
                self.existing.add(storage_id(twin.untyped_storage()))
        return twin

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.fake_mode is not None:
            args, kwargs = tree_map(self._fake, (args, kwargs or {}))
        out = func(*args, **(kwargs or {}))
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, torch.Tensor):
                storage = _storage(leaf)
                if storage is None or storage_id(storage) in self.existing:
                    continue
                known = self.created.get(storage_id(storage))
                if known is None or known[0].expired():  # the id of a freed storage is reused for new ones
                    unit = self.units[-1] if self.units else OUTSIDE
                    self.created[storage_id(storage)] = (StorageWeakRef(storage), storage.nbytes(), unit)
        return out

    def alive(self) -> dict[str, int]:
        """Bytes still alive per unit, once stable. A gloo collective's worker thread drops its
        reference to the tensors a moment after their wait returns (ProcessGroupGloo resets its
        work in progress after completing it), so a count taken at once can include a tensor
        nothing else holds (seen once in six suite runs: 8 KiB more outside any unit, the size
        of loss parallel's per-token float32 all-reduce there). Re-read until two counts agree,
        for at most ~0.1 s."""
        counts = [self._count()]
        for _ in range(100):
            time.sleep(0.001)
            counts.append(self._count())
            if counts[-1] == counts[-2]:
                break
        return counts[-1]

    def _count(self) -> dict[str, int]:
        by_unit: dict[str, int] = {}
        for ref, nbytes, unit in self.created.values():
            if not ref.expired():
                by_unit[unit] = by_unit.get(unit, 0) + nbytes
        return by_unit


def activation_memory(pmodel, batch: Any, fake: bool = False) -> ActivationMemory:
    """Bytes one microbatch of `batch` keeps for backward on this rank (see the module
    docstring). Collective, like train_step: every rank calls it with its own batch.

    `fake=True` runs the forward under torch's FakeTensorMode: tensors have shapes and no
    data, so nothing is computed or allocated, and the count equals the real one (tested
    for dp, tp, pp, cp, ZeRO 1-3 and recompute; refused under sequence parallelism, where
    it is not yet checked). The ranks still agree on the batch for real, and under a
    pipeline a new microbatch shape is compiled for real first (one forward of the stages).
    With torch's fake process group, one process can measure a rank of a world it does not
    have (bench/planner.py does, for a 1B Llama at world 64)."""
    parts = pmodel.config.microbatches
    if fake and pmodel.config.sequence_parallel:
        raise ConfigError("activation_memory(fake=True) under sequence parallelism: its count under fake tensors is "
                          "not yet checked against the real one; measure with fake=False")
    # the op names fake= too: ranks measuring differently disagree before any stage communicates
    op = "activation_memory(fake=True)" if fake else "activation_memory"
    step = pmodel.agree_on_batch(op, batch, parts, check=True)
    batch, microbatches = step.batch, step.microbatches
    if fake and pmodel.pipeline is not None:
        pmodel.pipeline.compiled(microbatches[0])  # a new shape is captured and its stages' boundaries found for real
    module = pmodel.module
    units = candidate_units(module)
    blocks = layer_list(module)
    params, grads = pmodel.held_tensors()
    gathered = [b.param_buffer for b in pmodel.gradients.buckets]  # ZeRO-3's whole buffers
    held = [t for t in [*params, *grads, *gathered, *module.buffers(), *tensor_leaves(batch)] if t is not None]
    existing = {storage_id(s) for t in held if (s := _storage(t)) is not None}
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else None
    creations = _Creations(existing, fake_mode)
    ran: list[str] = []

    def enter(path: str) -> None:
        creations.units.append(path)
        ran.append(path)

    def leave() -> None:
        creations.units.pop()

    handles = []
    for path in units:
        unit = module.get_submodule(path)
        handles.append(unit.register_forward_pre_hook(lambda m, a, path=path: enter(path)))
        handles.append(unit.register_forward_hook(lambda m, a, o: leave()))
    try:
        with pmodel.in_step("activation_memory"), without_trace(module, pmodel.topology.device), \
                torch.enable_grad(), pmodel.loss_parallel(), fake_mode or contextlib.nullcontext():
            kept = _forward(pmodel, microbatches[0], creations)
            gc.collect()
            by_unit = creations.alive()
            del kept
    finally:
        for handle in handles:
            handle.remove()
        if pmodel.param_shards is not None:
            pmodel.param_shards.release_all()
    layers = [p for p in dict.fromkeys(ran) if blocks is not None and p.startswith(blocks + ".")]
    return ActivationMemory(sum(by_unit.values()), by_unit, layers)


def _forward(pmodel, microbatch: Any, creations: _Creations) -> list[torch.Tensor]:
    """One training forward of this rank's part, under `creations`: what a step keeps until backward."""
    pipeline = pmodel.pipeline
    if pipeline is None:
        with creations:
            return [loss_of(pmodel.run_module(microbatch))]
    compiled = pipeline.compiled(microbatch)
    kept = []
    for stage in pipeline.stages:
        received, _ = compiled.examples[stage]
        inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in received]
        part = pipeline.stage_module(compiled.program, compiled.parts[stage])
        with creations, pipeline.forward_context():
            out = part(*inputs, batch=microbatch)
        kept += [loss_of(out)] if part.last else tensor_leaves(out)
    return kept
