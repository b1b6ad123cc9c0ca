"""The optimizer's state whole, keyed by the original module's parameter names.

`full_optimizer_state(pmodel, optimizer)` gathers every element of the (tp-, pp- and
ZeRO-sharded) optimizer state once: each rank writes the regions it owns (the checkpoint's
ownership, `ParamPiece.owned`) into zero tensors of the whole shapes and one all-reduce per
dtype sums them, so every rank ends with the state a single-process optimizer over the whole
module would hold: {"state": {name: {"exp_avg": ..., "step": ...}}, "param_groups": [{...,
"params": [names]}]}, the form of torch.distributed.checkpoint's `get_optimizer_state_dict`.
It costs the whole state's memory on every rank, like `full_state_dict`.

`load_full_optimizer_state` takes that form, or torch's own (integer ids, as
`optimizer.state_dict()` of one process over `module.parameters()`, or the
`<merged>.optimizer.pt` that `shardwise merge --optimizer` writes), checks it against the
model and the optimizer's groups on every rank before changing anything, and gives each
piece its part.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..coordination import Fingerprint, fingerprint_of
from ..errors import CheckpointError
from ..tensors import content_lines, local


def _group_names(pmodel, optimizer) -> list[list[str]]:
    """Each parameter group's parameters by canonical name, over every pipeline rank, in
    the module's order (the order one process's optimizer numbers them in)."""
    from .regions import _group_names as rank_group_names

    mine = rank_group_names(pmodel, optimizer)
    every: list[Any] = [None] * pmodel.topology.world_size
    dist.all_gather_object(every, mine, group=pmodel.topology.group(*_ALL))
    order = {n: i for i, n in enumerate(pmodel.index.state_shapes)}
    return [sorted({n for names in every for n in names[g]}, key=order.get) for g in range(len(mine))]


_ALL = ("pp", "dp", "cp", "tp")


def full_optimizer_state(pmodel, optimizer) -> dict[str, Any]:
    """The whole optimizer state by parameter name, on every rank (collective)."""
    with pmodel.coordinator.operation("optimizer.full_state_dict"):
        return _gathered(pmodel, optimizer)


def _gathered(pmodel, optimizer) -> dict[str, Any]:
    from .regions import _part, _pieces, _regions

    owned: list[tuple[str, str, tuple, torch.Tensor, tuple]] = []  # name, key, whole shape, local part, global rect
    for name, piece in _pieces(pmodel):
        if not piece.owned:
            continue
        regions = _regions(pmodel, piece)
        origin = any(all(lo == 0 for lo, _ in g) for g, *_ in regions)  # one owner per parameter for its scalars
        for key, value in optimizer.state.get(piece.optimized, {}).items():
            value = local(value)
            if value.dim() == 0:
                if origin:
                    owned.append((name, key, (), value, ()))
                continue
            for g, a, b, rect, sub in regions:
                owned.append((name, key, tuple(piece.param.shape), _part(value.reshape(-1), a, b, rect, sub), g))
    entries = sorted({(n, k, s, str(v.dtype).removeprefix("torch.")) for n, k, s, v, _ in owned})
    every: list[Any] = [None] * pmodel.topology.world_size
    group = pmodel.topology.group(*_ALL)
    dist.all_gather_object(every, entries, group=group)
    entries = sorted({e for rank_entries in every for e in rank_entries})
    device = pmodel.topology.device
    whole = {(n, k): torch.zeros(s, dtype=getattr(torch, d), device=device) for n, k, s, d in entries}
    for name, key, _, value, g in owned:
        whole[(name, key)][tuple(slice(lo, hi) for lo, hi in g)] = value
    for dtype in sorted({d for *_, d in entries}):
        tensors = [whole[(n, k)] for n, k, _, d in entries if d == dtype]
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat, group=group)  # each element owned by one rank: a sum of it and zeros
        for tensor, part in zip(tensors, flat.split([t.numel() for t in tensors])):
            tensor.copy_(part.view_as(tensor))
    state: dict[str, dict[str, torch.Tensor]] = {}
    for (name, key), tensor in whole.items():
        state.setdefault(name, {})[key] = tensor.cpu()
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": names}
              for g, names in zip(optimizer.param_groups, _group_names(pmodel, optimizer))]
    return {"state": state, "param_groups": groups}


def _by_name(state_dict: dict[str, Any], names: list[list[str]]) -> dict[str, Any]:
    """torch's integer-id form as the name-keyed one (ids count the groups' parameters in order)."""
    groups = state_dict.get("param_groups", [])
    if not groups or not groups[0]["params"] or isinstance(groups[0]["params"][0], str):
        return state_dict
    if [len(g["params"]) for g in groups] != [len(n) for n in names]:
        raise CheckpointError(f"optimizer state has groups of {[len(g['params']) for g in groups]} parameters, this "
                              f"optimizer {[len(n) for n in names]}: build it with the same parameter groups")
    name_of = {i: n for g, group_names in zip(groups, names) for i, n in zip(g["params"], group_names)}
    unknown = [i for i in state_dict["state"] if i not in name_of]
    if unknown:
        raise CheckpointError(f"optimizer state for parameter ids {unknown[:4]} that no parameter group lists")
    return {"state": {name_of[i]: s for i, s in state_dict["state"].items()},
            "param_groups": [{**g, "params": n} for g, n in zip(groups, names)]}


def _checked(pmodel, state_dict: Any, names: list[list[str]]) -> dict[str, Any]:
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        raise CheckpointError("an optimizer state dict has 'state' and 'param_groups'; got "
                              f"{type(state_dict).__name__} {list(state_dict)[:4] if isinstance(state_dict, dict) else ''}")
    state_dict = _by_name(state_dict, names)
    given = [list(g["params"]) for g in state_dict["param_groups"]]
    if given != names:
        raise CheckpointError(f"optimizer state's parameter groups {[g[:3] for g in given]} differ from this "
                              f"optimizer's {[n[:3] for n in names]}: build it with the same groups, in module order")
    shapes = pmodel.index.state_shapes
    state = {}
    for name, entry in state_dict["state"].items():
        if name not in shapes or not isinstance(entry, dict):
            raise CheckpointError(f"optimizer state for {name!r}, which is not a parameter of this model "
                                  "(or whose state is not a dict of tensors)")
        entry = state[name] = {k: _as_tensor(name, k, v) for k, v in entry.items()}
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() and tuple(value.shape) != tuple(shapes[name]):
                raise CheckpointError(f"optimizer state {name}/{key} has shape {tuple(value.shape)}, the parameter "
                                      f"{tuple(shapes[name])}")
    return {**state_dict, "state": state}


def _as_tensor(name: str, key: str, value: Any) -> torch.Tensor:
    """A state value as a tensor: numbers (a `step` saved as a float) become float32 scalars,
    as torch's optimizers keep them."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.tensor(float(value), dtype=torch.float32)
    raise CheckpointError(f"optimizer state {name}/{key} is a {type(value).__name__}; shardwise loads tensor state "
                          "(and numbers, as torch's optimizers do)")


def load_full_optimizer_state(pmodel, optimizer, state_dict: Any) -> None:
    """Give every piece of `optimizer` its part of the whole state `state_dict` (collective)."""
    from . import _like
    from .regions import _part, _pieces, _regions, scalar_state_devices

    problem, checked, lines = None, None, ["(an optimizer state this rank refused)"]
    names = _group_names(pmodel, optimizer)  # collective: before anything that may raise on one rank
    try:
        checked = _checked(pmodel, state_dict, names)
        lines = content_lines({"state": checked["state"], "param_groups": dict(enumerate(checked["param_groups"]))})
    except CheckpointError as exc:
        problem = exc
    except (KeyError, TypeError, AttributeError, ValueError) as exc:  # malformed: refused on every rank alike
        problem = CheckpointError(f"the optimizer state dict is malformed ({type(exc).__name__}: {exc}); give "
                                  "optimizer.full_state_dict()'s form or torch's optimizer.state_dict()")
    pmodel.coordinator.agree("optimizer.load_full_state_dict", problem, fingerprints=[Fingerprint(
        fingerprint_of(lines), lambda: lines, CheckpointError,
        "every rank must load the same optimizer state: read the same file on every rank")])
    with pmodel.coordinator.body("optimizer.load_full_state_dict"), torch.no_grad():
        steps_on = scalar_state_devices(optimizer, checked["param_groups"], pmodel.topology.device)
        for name, piece in _pieces(pmodel):
            entry, mine = checked["state"].get(name, {}), {}
            for key, value in entry.items():
                if value.dim() == 0:
                    where = steps_on.get(id(piece.optimized), pmodel.topology.device) if key == "step" \
                        else pmodel.topology.device
                    mine[key] = value.clone().to(where)
                    continue
                flat = torch.empty(piece.end - piece.start, dtype=piece.optimized.dtype, device=pmodel.topology.device)
                for g, a, b, rect, sub in _regions(pmodel, piece):
                    _part(flat, a, b, rect, sub).copy_(value[tuple(slice(lo, hi) for lo, hi in g)])
                mine[key] = _like(piece.optimized, flat)
            if mine:
                optimizer.state[piece.optimized] = mine
        for group, saved in zip(optimizer.param_groups, checked["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
