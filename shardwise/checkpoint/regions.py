"""Where a rank's values lie in the whole model: each piece of each parameter it holds (a tp
shard, a ZeRO range, or whole) as rectangles in global coordinates, shared by saving,
loading and the optimizer's whole state."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate

from ..tensors import local
from .geometry import flat_rects, local_to_global, rect_shape, shift


def _regions(pmodel, piece) -> list[tuple]:
    """(global rect, start, stop, local rect, sub-rect) for each part of a piece."""
    param = piece.param
    placement = param.placements[0] if isinstance(param, DTensor) else Replicate()
    mesh = param.device_mesh if isinstance(param, DTensor) else None  # tp's, or the ep group's (experts)
    rank, size = (mesh.get_local_rank(), mesh.size()) if mesh is not None else (0, 1)
    local_shape = tuple(local(param).shape)
    out = []
    for rect, a, b in flat_rects(local_shape, piece.start, piece.end):
        for g, sub in local_to_global(rect, placement, rank, size, tuple(param.shape)):
            out.append((g, a - piece.start, b - piece.start, rect, sub))
    return out


def _part(flat: torch.Tensor, start: int, stop: int, rect, sub) -> torch.Tensor:
    return flat[start:stop].view(rect_shape(rect))[shift(sub, rect)]


def _pieces(pmodel):
    """(canonical name, piece) for every piece of every parameter this rank holds."""
    for name, param in pmodel.module.named_parameters():
        for piece in pmodel.optimizer_params.pieces.get(id(param), []):
            yield pmodel.index.canonical(name), piece


def _buffers(pmodel) -> dict[str, torch.Tensor]:
    params = set(pmodel.index.aliases)
    return {k: v for k, v in pmodel.module.state_dict(keep_vars=True).items() if k not in params}


def _group_names(pmodel, optimizer) -> list[list[str]]:
    """Each optimizer parameter group's parameters, by canonical name."""
    if optimizer is None:
        return []
    return [[pmodel.index.canonical(n) for n, p in pmodel.module.named_parameters() if any(
        piece.optimized is m for piece in pmodel.optimizer_params.pieces.get(id(p), []) for m in g["params"])]
            for g in optimizer.param_groups]


def scalar_state_devices(optimizer, loaded_groups: list[dict], device: torch.device) -> dict[int, torch.device]:
    """id(parameter) -> where a loaded 0-dim `step` goes, as torch's `Optimizer.load_state_dict`
    decides from the groups being loaded: beside the parameter for a capturable or fused group,
    else on the CPU. A `step` on a GPU makes every other update read it back with `.item()`:
    a device sync per parameter per step."""
    out = {}
    for group, loaded in zip(optimizer.param_groups, loaded_groups):
        settings = {**group, **loaded}
        where = device if settings.get("capturable") or settings.get("fused") else torch.device("cpu")
        out.update({id(p): where for p in group["params"]})
    return out
