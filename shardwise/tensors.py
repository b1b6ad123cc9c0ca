"""Small helpers on tensors and trees of them, shared by the executors."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.placement_types import Placement, _StridedShard
from torch.distributed.tensor import Shard
from torch.utils._pytree import tree_flatten


def tensor_leaves(tree: Any) -> list[torch.Tensor]:
    """The tensors of a nested structure (dicts, lists, tuples, dataclass outputs), in order."""
    return [leaf for leaf in tree_flatten(tree)[0] if isinstance(leaf, torch.Tensor)]


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard, or the tensor itself (no autograd)."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def storage_id(storage: torch.UntypedStorage) -> int:
    """An identity for a storage, equal for every tensor viewing it (torch has no public one:
    `data_ptr()` repeats for empty and fake storages)."""
    return storage._cdata


def op_name(func: Any) -> str:
    """An aten operator's name without namespace or overload ("add" for aten.add.Tensor)."""
    return func.overloadpacket.__name__.split(".")[-1]


def is_sharded(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, DTensor) and any(not isinstance(p, Replicate) for p in tensor.placements)


def shard_of(full: torch.Tensor, placement: Placement, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s piece of `full` under `placement` (a view; no communication)."""
    if isinstance(placement, _StridedShard):  # each of split_factor blocks sharded
        blocks = full.chunk(placement.split_factor, placement.dim)
        return torch.cat([b.chunk(size, placement.dim)[rank] for b in blocks], placement.dim)
    if isinstance(placement, Shard):
        return full.chunk(size, placement.dim)[rank]
    return full


def is_kv_cache(value: Any) -> bool:
    """Whether `value` is a key/value cache object (Hugging Face's `past_key_values`)."""
    return not isinstance(value, torch.Tensor) and callable(getattr(value, "get_seq_length", None)) \
        and hasattr(value, "update")
