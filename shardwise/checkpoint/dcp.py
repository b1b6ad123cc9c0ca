"""torch.distributed.checkpoint (DCP) both ways: `sw.dcp_state(pmodel, optimizer)` is the app
state DCP (and torchtitan) save and load, {"model": ..., "optim": ...}, each a `Stateful`.

Its keys are the original module's parameter names and its optimizer state has the form of
torch's `get_optimizer_state_dict` ({"state": {name: {...}}, "param_groups": [{..., "params":
[names]}]}), so a DCP checkpoint a plain module or an FSDP2 model wrote with those loads into
any shardwise layout, and one shardwise wrote loads into a plain module with DCP's own tools
(`dcp.load` then `set_optimizer_state_dict`).

The values are whole tensors on every rank (`full_state_dict`, `optimizer.full_state_dict`):
DCP writes a tensor every rank holds once, and reads any saved layout into them. ZeRO's shards
are flat ranges of buckets that cross parameter boundaries, which DCP cannot describe without
one collective per parameter, so sharded saves stay shardwise's own format (`save_checkpoint`:
each rank writes only its regions and never holds the whole model). Loading into an optimizer
that has taken no step yet: DCP fills tensors the app state presents, so with `checkpoint_id`
the optimizer's slots are made from the checkpoint's own metadata.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError


class ModelState:
    """The model's whole state dict, by its original keys (a DCP `Stateful`)."""

    def __init__(self, pmodel):
        self.pmodel = pmodel

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.pmodel.full_state_dict()

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.pmodel.load_full_state_dict(state_dict)


class OptimizerState:
    """The optimizer's whole state by parameter name (a DCP `Stateful`)."""

    def __init__(self, optimizer, checkpoint_id: str | Path | None = None, key: str = "optim"):
        self.optimizer, self.checkpoint_id, self.key = optimizer, checkpoint_id, key

    def state_dict(self) -> dict[str, Any]:
        state = self.optimizer.full_state_dict()
        if self.checkpoint_id is not None:
            for name, slots in _saved_slots(self.checkpoint_id, self.key).items():
                for slot, tensor in slots.items():
                    state["state"].setdefault(name, {}).setdefault(slot, tensor)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_full_state_dict(state_dict)


def dcp_state(pmodel, optimizer=None, checkpoint_id: str | Path | None = None) -> dict[str, Any]:
    """{"model": ..., "optim": ...} for `torch.distributed.checkpoint.save/load`; pass the
    checkpoint's path as `checkpoint_id` when loading into an optimizer that has no state yet."""
    state: dict[str, Any] = {"model": ModelState(pmodel)}
    if optimizer is not None:
        state["optim"] = OptimizerState(optimizer, checkpoint_id)
    return state


def _saved_slots(checkpoint_id: str | Path, key: str) -> dict[str, dict[str, torch.Tensor]]:
    """Zero tensors shaped as the optimizer state a DCP checkpoint holds under `key`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = FileSystemReader(str(checkpoint_id)).read_metadata()
    except (OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{str(checkpoint_id)!r} is not a readable DCP checkpoint: {exc}") from None
    slots: dict[str, dict[str, torch.Tensor]] = {}
    for flat, path in (metadata.planner_data or {}).items():
        item = metadata.state_dict_metadata.get(flat)
        if len(path) == 4 and path[0] == key and path[1] == "state" and isinstance(item, TensorStorageMetadata):
            slots.setdefault(path[2], {})[path[3]] = torch.zeros(tuple(item.size), dtype=item.properties.dtype)
    return slots
