"""The plan's activation keys as forward hooks on the modules they name: `X.input` conversions
("A -> B") applied to X's tensor arguments, declared input shards checked on the first forward
(an input declared `Shard(d)` that arrives whole would have its parameters' gradients summed
over tp), and `X.output` placements for modules without a rule (a rule places its own output).
A module declared to take data shards gets partial gradients for its parameters, and a Dropout
there draws one process's mask (`ShardedDropout`)."""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.utils._mode_utils import no_dispatch

from ...compat import all_gather_single
from ...errors import PlanError
from ...plan.plan import Conversion, placement_str
from ..collectives import redistribute
from .rules import ShardedDropout, ShardedJitter, replace_module

if TYPE_CHECKING:
    from .sharding import ModuleLayout, TensorParallel


def install_activation_conversions(module: nn.Module, tp: TensorParallel) -> None:
    """The plan's `X.input` / `X.output` keys as forward hooks; a module declared to take
    data shards gets partial gradients for its parameters (and a Dropout, the whole mask)."""
    for path, placements in tp.resolved.inputs.items():
        mod = module.get_submodule(path)
        first = tp.input_placement(path, Replicate())
        if path not in tp.sharded_modules and isinstance(first, Shard):
            tp.partial_grad_params.update(id(param) for param in mod.parameters(recurse=False))
            if isinstance(mod, nn.Dropout) and type(mod).forward is nn.Dropout.forward:
                replace_module(module, mod, mod := ShardedDropout(mod, tp, first.dim))
            if isinstance(getattr(mod, "jitter_noise", None), (int, float)) and tp.size > 1:
                ShardedJitter(tp, first.dim).install(mod)
        signature = tp._signatures.setdefault(type(mod), ForwardArguments(mod.forward))
        if any(t is not None and isinstance(t[0], Conversion) for t in placements):
            mod.register_forward_pre_hook(functools.partial(
                _convert_inputs, tp=tp, path=path, layout=tp.layout(path), signature=signature), with_kwargs=True)
        declared = [i for i, t in enumerate(placements) if t is not None and isinstance(t[0], Shard)]
        if declared and tp.size > 1:
            mod.register_forward_pre_hook(functools.partial(
                _check_declared_shards, tp=tp, path=path, positions=declared, signature=signature), with_kwargs=True)
    for path, placements in tp.resolved.outputs.items():
        if path in tp.sharded_modules and isinstance(placements[0] and placements[0][0], Conversion):
            raise PlanError(
                f"activation {path}.output: {placement_str(placements[0][0])} converts the output of tensor-parallel "
                f"{path}, whose rule knows its own output placement; give only the target, e.g. "
                f"{placement_str(placements[0][0].dst)!r}")
        if path not in tp.sharded_modules:
            module.get_submodule(path).register_forward_hook(
                functools.partial(_redistribute_output, tp=tp, layout=tp.layout(path)))


class ForwardArguments:
    """Where a forward's tensor arguments are in a call, in the order of its signature, read
    from the signature once: `inspect`'s binding at call time breaks Dynamo's graph (its
    mapping proxies) in a compiled block's hooks."""

    def __init__(self, forward: Callable):
        kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        params = list(inspect.signature(forward).parameters.values())
        self.positional = len([p for p in params if p.kind in kinds])
        named = [p.name for p in params if p.kind in kinds or p.kind is inspect.Parameter.KEYWORD_ONLY]
        self.order = {name: i for i, name in enumerate(named)}

    def tensor_slots(self, args: tuple, kwargs: dict) -> list[int | str]:
        """The tensor arguments' places, in signature order: an int indexes `args`, a str names
        a keyword (arguments caught by *args or **kwargs are not the forward's named inputs)."""
        found = [(i, i) for i, arg in enumerate(args[:self.positional]) if isinstance(arg, torch.Tensor)]
        found += [(self.order[k], k) for k, v in kwargs.items() if k in self.order and isinstance(v, torch.Tensor)]
        found.sort(key=lambda item: item[0])
        return [slot for _, slot in found]


def _convert_inputs(mod: nn.Module, args: tuple, kwargs: dict, *, tp: TensorParallel, path: str,
                    layout: ModuleLayout, signature: ForwardArguments) -> tuple[tuple, dict] | None:
    """Forward pre-hook: the plan's input conversions, applied to the module's tensor
    arguments in the order of its forward's signature (the i-th placement, the i-th tensor)."""
    if tp.is_replaying(path):
        return None
    args, kwargs = list(args), dict(kwargs)
    for slot, target in zip(signature.tensor_slots(args, kwargs), layout.inputs):
        if target is not None and isinstance(target[0], Conversion):
            holder = args if isinstance(slot, int) else kwargs
            holder[slot] = tp.convert_input(holder[slot], target[0], path)
    return tuple(args), kwargs


def _check_declared_shards(mod: nn.Module, args: tuple, kwargs: dict, *, tp: TensorParallel, path: str,
                           positions: list[int], signature: ForwardArguments) -> None:
    """Forward pre-hook, the first forward only: an input the plan declares to arrive as
    `Shard(d)` (this rank's slice) that is the same on every tp rank arrived whole, and
    computing on it as a slice would sum its parameters' gradients over tp (tp x too large);
    the first forward ends in that PlanError.
    veScale's `[[Shard(1)]]` means "split to"; here that is written "Replicate() -> Shard(1)"."""
    if tp.first_forward_checked or tp.is_replaying(path):
        return
    tensors = [args[slot] if isinstance(slot, int) else kwargs[slot] for slot in signature.tensor_slots(args, kwargs)]
    for i in positions:
        if i >= len(tensors) or not tensors[i].is_floating_point() or tensors[i].numel() == 0:
            continue
        with no_dispatch():  # not a read of the model's: first-forward checks do not see it
            flat = tensors[i].detach().float().flatten()
            summary = torch.stack([flat.sum(), flat.square().sum(), flat.max(), flat.min()])
            gathered = summary.new_empty(tp.size, 4)
            all_gather_single(gathered.view(-1), summary, group=tp.group)
        if bool((gathered == gathered[0]).all()) and float(summary[2]) > float(summary[3]):
            shard = placement_str(tp.resolved.inputs[path][i][0])
            tp.arrived_whole.append(PlanError(
                f"activation {path}.input: the plan declares input {i} arrives as {shard} (each tp rank holding its "
                f"slice), but it is the same on every tp rank: it arrives whole, and its parameters' gradients would "
                f"be summed over tp. To split it there, write 'Replicate() -> {shard}'"))


def _redistribute_output(mod: nn.Module, args: Any, output: Any, *, tp: TensorParallel, layout: ModuleLayout) -> Any:
    """Forward hook: move a module's output tensors to the plan's placements (from what the
    module computed on, or from the source a conversion "A -> B" names)."""
    computed_on = tp.input_placement(layout, Replicate())

    def move(tensor: torch.Tensor, target: tuple | None) -> torch.Tensor:
        if target is None:
            return tensor
        src, dst = (target[0].src, target[0].dst) if isinstance(target[0], Conversion) else (computed_on, target[0])
        return redistribute(tensor, src, dst, tp.group)

    targets = layout.outputs
    if isinstance(output, torch.Tensor):
        return move(output, targets[0])
    if isinstance(output, tuple):
        items = list(output)
        tensors = [i for i, item in enumerate(items) if isinstance(item, torch.Tensor)]
        for index, target in zip(tensors, targets):
            items[index] = move(items[index], target)
        return type(output)(items) if not hasattr(output, "_fields") else type(output)(*items)
    return output
