"""Small helpers on tensors and trees of them, shared by the executors."""

from __future__ import annotations

import zlib
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.placement_types import Placement, _StridedShard
from torch.distributed.tensor import Shard
from torch.utils._pytree import tree_flatten

from .compat import all_gather_single


def tensor_leaves(tree: Any) -> list[torch.Tensor]:
    """The tensors of a nested structure (dicts, lists, tuples, dataclass outputs), in order."""
    return [leaf for leaf in tree_flatten(tree)[0] if isinstance(leaf, torch.Tensor)]


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard, or the tensor itself (no autograd)."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


PARAMETER_NAME = "_shardwise_name"  # the attribute naming a parameter in errors about it


def name_parameters(module: torch.nn.Module) -> None:
    """Mark each parameter with its name in `module` (a tied one with its first), for errors
    raised from code that holds only the tensor."""
    for name, param in reversed(list(module.named_parameters(remove_duplicate=False))):
        setattr(param, PARAMETER_NAME, name)


def shard_for_compute(param: torch.Tensor | None) -> torch.Tensor | None:
    """A parameter's local shard to compute with; gradients flow back to the DTensor parameter."""
    return param.to_local() if isinstance(param, DTensor) else param


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


def whole(tensor: Any) -> Any:
    """A DTensor's full value on every rank (collective over its mesh); anything else as it is.
    torch before 2.13 cannot gather a `_StridedShard` (its `full_tensor` raises), so a
    strided tensor on one mesh dim is gathered here and its blocks put back in order (the
    inverse of `shard_of`); it is not differentiable, as no caller needs that."""
    if not isinstance(tensor, DTensor):
        return tensor
    placement = tensor.placements[0]
    if len(tensor.placements) > 1 or not isinstance(placement, _StridedShard):
        return tensor.full_tensor()
    mine, size = tensor.to_local().detach().contiguous(), tensor.device_mesh.size()
    gathered = torch.empty((size,) + tuple(mine.shape), dtype=mine.dtype, device=mine.device)
    all_gather_single(gathered.view(-1), mine.view(-1), group=tensor.device_mesh.get_group())
    dim = placement.dim % mine.dim()
    pieces = [piece.chunk(placement.split_factor, dim) for piece in gathered.unbind(0)]  # [rank][block]
    return torch.cat([pieces[r][b] for b in range(placement.split_factor) for r in range(size)], dim)


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
