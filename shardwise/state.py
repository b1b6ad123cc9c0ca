"""Whole-model state of a `ParallelModule`: plain state dicts and gradients gathered from every
rank's shards and pipeline stages, and plain state dicts loaded back into the shards.

Every function here is collective over the module's ranks and starts with an agreement, so
a dict that does not fit is the same `CheckpointError` on every rank before anything moves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .comm import broadcast_tensors
from .coordination import Fingerprint, fingerprint_of
from .errors import CheckpointError
from .tensors import content_lines, local, shard_of, whole

if TYPE_CHECKING:
    from .module import ParallelModule


@dataclass
class ModelIndex:
    """The whole model's names and shapes, as one process holds it (a pipeline rank keeps
    only its stages' tensors; this says what the others hold)."""

    param_names: list[str]  # every parameter, first name of each tied one
    aliases: dict[str, str]  # every parameter name (tied ones included) -> its first name
    state_shapes: dict[str, tuple[int, ...]]  # state dict key -> shape
    stage_of_key: dict[str, int] | None = None  # state dict key -> pipeline stage (pp > 1)
    tied: dict[str, list[int]] | None = None  # parameter -> pipeline ranks holding it (pp > 1)

    @classmethod
    def of(cls, module: nn.Module) -> "ModelIndex":
        first: dict[int, str] = {}
        for name, param in module.named_parameters(remove_duplicate=False):
            first.setdefault(id(param), name)
        return cls([n for n, _ in module.named_parameters()],
                   {name: first[id(p)] for name, p in module.named_parameters(remove_duplicate=False)},
                   {k: tuple(v.shape) for k, v in module.state_dict(keep_vars=True).items()})

    def canonical(self, name: str) -> str:
        return self.aliases.get(name, name)


def full_state_dict(pmodel: "ParallelModule") -> dict[str, torch.Tensor]:
    with pmodel.coordinator.operation("full_state_dict"):
        with pmodel.whole_parameters():
            own = {k: whole(v).clone()
                   for k, v in pmodel.module.state_dict().items()}
        return _gather_stages(pmodel, own, list(pmodel.index.stage_of_key or own))


def full_grad_dict(pmodel: "ParallelModule") -> dict[str, torch.Tensor]:
    with pmodel.coordinator.operation("full_grad_dict"):
        reduced = pmodel.gradients.full_grads()  # what the buckets hold: whole (all-gathered under ZeRO)
        own = {}
        for name, param in pmodel.module.named_parameters():
            grad = reduced.get(id(param), None if param.grad is None else local(param.grad))
            if grad is not None:
                if isinstance(param, DTensor):
                    grad = whole(DTensor.from_local(grad, param.device_mesh, param.placements, run_check=False))
                own[name] = grad.detach().clone()
        return _gather_stages(pmodel, own, [n for n in pmodel.index.param_names
                                            if n in own or pmodel.pipeline is not None])


def _gather_stages(pmodel: "ParallelModule", own: dict[str, torch.Tensor], keys: list[str]) -> dict[str, torch.Tensor]:
    """`own` (this rank's entries) completed with every pipeline stage's, in `keys` order."""
    pipeline, topology = pmodel.pipeline, pmodel.topology
    if pipeline is None:
        return {k: own[k] for k in keys}
    found: dict[str, torch.Tensor] = {}
    for stage in range(pipeline.layout.num_stages):  # each stage's owner sends what it has
        owner = pipeline.owner(stage)
        mine = [k for k in keys if pmodel.index.stage_of_key[k] == stage and k in own]
        received = [[(k, tuple(own[k].shape), own[k].dtype) for k in mine]] if owner == topology.rank else [None]
        dist.broadcast_object_list(received, src=owner, group=pipeline.group)
        tensors = [own[k] if owner == topology.rank else torch.empty(shape, dtype=dtype, device=topology.device)
                   for k, shape, dtype in received[0]]
        broadcast_tensors(tensors, pipeline.group, 64 << 20, src=owner)
        found.update(zip((k for k, _, _ in received[0]), tensors))
    return {k: found[k] for k in keys if k in found}


def module_state_dict(pmodel: "ParallelModule", module_state_dict: Callable[..., dict], *args: Any,
                      **kwargs: Any) -> dict[str, Any]:
    """`pmodel.state_dict()`: nn.Module's (`module_state_dict`), except under ZeRO-3, where the
    parameters are gathered whole and copied first (collective there, as FSDP's full state dict)."""
    keep_vars = kwargs.get("keep_vars", args[2] if len(args) > 2 else False)
    if pmodel.param_shards is None or keep_vars:
        return module_state_dict(*args, **kwargs)
    with pmodel.coordinator.operation("state_dict"), pmodel.whole_parameters():
        out = module_state_dict(*args, **kwargs)
        prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "")
        for key, value in out.items():
            if key.startswith(prefix) and isinstance(value, torch.Tensor):
                out[key] = value.clone()
    return out


def load_module_state_dict(pmodel: "ParallelModule", state_dict: Any, strict: bool, assign: bool) -> Any:
    """`pmodel.load_state_dict()`: what `state_dict()` returned (keys under `module.`), loaded
    through `load_full_state_dict` so ZeRO's shards and master copies follow."""
    if assign:
        raise CheckpointError("load_state_dict(assign=True) would replace parameters that shardwise's buckets "
                              "and shards view; load with assign=False")
    if not isinstance(state_dict, dict):
        raise CheckpointError(f"a state dict maps names to tensors; got {type(state_dict).__name__}")
    plain = {k.removeprefix("module."): v for k, v in state_dict.items()}
    own = set(pmodel.module.state_dict(keep_vars=True))
    missing, unexpected = sorted(own - set(plain)), sorted(set(plain) - set(pmodel.index.state_shapes))
    problem = None
    if strict and (missing or unexpected):
        problem = CheckpointError(f"state dict does not match this rank's part of {type(pmodel.module).__name__}: "
                                  f"missing keys {missing[:8]}, unexpected keys {unexpected[:8]}; pass this "
                                  "model's state_dict() or strict=False")
    load_full_state_dict(pmodel, plain, strict=False, problem=problem)
    return nn.modules.module._IncompatibleKeys([f"module.{k}" for k in missing], [f"module.{k}" for k in unexpected])


@torch.no_grad()
def load_full_state_dict(pmodel: "ParallelModule", state_dict: dict[str, torch.Tensor], strict: bool,
                         problem: CheckpointError | None = None) -> None:
    """Each rank copies its shards of `state_dict` (whole tensors, or DTensors placed as the
    model's); `problem` is a refusal the caller found already."""
    own = pmodel.module.state_dict(keep_vars=True)  # read inside whole_parameters() below
    whole, shards = ["(a state dict this rank refused)"], []
    try:
        if problem is None:
            check_state_dict(pmodel, state_dict, strict)
            loaded = own.keys() & state_dict.keys()
            whole = content_lines({k: state_dict[k] for k in loaded if not isinstance(state_dict[k], DTensor)})
            shards = content_lines({k: state_dict[k] for k in loaded if isinstance(state_dict[k], DTensor)})
    except CheckpointError as exc:
        problem = exc
    hint = ("every rank must load the same state dict (ranks holding the same {} were given different values): "
            "read the same file on every rank")
    same = [Fingerprint(fingerprint_of(whole), lambda: whole, CheckpointError, hint.format("pipeline stage"),
                        peers=pmodel.topology.peer_groups("dp", "cp", "tp")),
            Fingerprint(fingerprint_of(shards), lambda: shards, CheckpointError, hint.format("tensor-parallel shard"),
                        peers=pmodel.topology.peer_groups("dp", "cp"))]
    with pmodel.coordinator.operation("load_full_state_dict", problem, fingerprints=same):
        with pmodel.whole_parameters():
            for key in own.keys() & state_dict.keys():  # entries of this rank's stages
                target, value = own[key], state_dict[key]
                if isinstance(value, DTensor):  # this rank's shard, placed as the target's (checked)
                    value = local(value)
                elif isinstance(target, DTensor):
                    mesh = target.device_mesh
                    value = shard_of(value, target.placements[0], mesh.get_local_rank(), mesh.size())
                local(target).copy_(value)
        pmodel.optimizer_params.reload()


def check_state_dict(pmodel: "ParallelModule", state_dict: Any, strict: bool) -> None:
    if not isinstance(state_dict, dict) or not all(isinstance(v, torch.Tensor) for v in state_dict.values()):
        raise CheckpointError(f"a state dict maps names to tensors; got {type(state_dict).__name__}")
    expected = pmodel.index.state_shapes
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"state dict does not match {type(pmodel.module).__name__}: missing keys {missing[:8]}, "
            f"unexpected keys {unexpected[:8]}; pass a state dict of the same model or strict=False"
        )
    own = pmodel.module.state_dict(keep_vars=True)
    for key in expected.keys() & state_dict.keys():
        value = state_dict[key]
        if isinstance(value, DTensor) and key in own:
            target = own[key]
            placements = target.placements if isinstance(target, DTensor) else None
            if placements != value.placements or target.device_mesh.mesh.tolist() != value.device_mesh.mesh.tolist():
                raise CheckpointError(f"state dict entry {key!r} is a DTensor placed {value.placements}, the model's "
                                      f"is {'a plain tensor' if placements is None else placements}: pass whole "
                                      "tensors (pmodel.full_state_dict()) or this model's own state_dict()")
        if expected[key] != tuple(state_dict[key].shape):
            raise CheckpointError(
                f"state dict entry {key!r} has shape {tuple(state_dict[key].shape)} "
                f"but the model's is {expected[key]}"
            )
