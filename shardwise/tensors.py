"""Small helpers on tensors and trees of them, shared by the executors."""

from __future__ import annotations

import zlib
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


def crc32(data: bytes | torch.Tensor) -> int:
    """CRC-32 of bytes or of a tensor's raw bytes."""
    if isinstance(data, torch.Tensor):
        data = data.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return zlib.crc32(data)


def content_lines(entries: dict[str, Any]) -> list[str]:
    """One line per entry: key, shape, dtype and the CRC-32 of its bytes (others by repr),
    sorted; ranks compare these to prove they were given the same values."""
    lines = []
    for key in sorted(entries, key=str):
        value = local(entries[key]) if isinstance(entries[key], torch.Tensor) else entries[key]
        if isinstance(value, torch.Tensor):
            lines.append(f"{key}: {tuple(value.shape)} {str(value.dtype).removeprefix('torch.')} crc {crc32(value):08x}")
        elif isinstance(value, dict):
            lines += [f"{key}/{line}" for line in content_lines(value)]
        else:
            lines.append(f"{key}: {value!r}")
    return lines


def is_kv_cache(value: Any) -> bool:
    """Whether `value` is a key/value cache object (Hugging Face's `past_key_values`)."""
    return not isinstance(value, torch.Tensor) and callable(getattr(value, "get_seq_length", None)) \
        and hasattr(value, "update")
