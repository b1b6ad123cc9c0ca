"""The torch API differences between the releases shardwise runs on (2.11 to the newest),
in one place: each name here is the newer spelling where torch has it, the older one
otherwise, so the rest of the package is written against one API.

- `all_gather_single(output, input, group=, async_op=)`: torch 2.13's name for
  `all_gather_into_tensor` (one flat output, the ranks' inputs concatenated on dim 0).
- `reduce_scatter_single(output, input, group=, async_op=)`: 2.13's name for
  `reduce_scatter_tensor`.
- `functional_all_gather(x, dim, group)`, `functional_reduce_scatter(x, op, dim, group)`: the
  functional collectives (traceable by compile), `*_single` from 2.13, `*_tensor` before.
- `COMPILES_DTENSOR_PARAMETERS`: whether compiled code gives DTensor parameters their gradients
  through `to_local()`. torch 2.11 does not (measured: every gradient of a compiled
  tensor-parallel block zero, silently), so there compiling such a block is refused.
- `COMPILES_DTENSOR_VIEWS`: whether Dynamo can trace a DTensor parameter whose local tensor
  lives at an offset in a larger storage (ZeRO's flat parameter buffers under tp). Through
  2.13 it fails ("Attempted to set the storage of a tensor on device cpu to a storage on
  different device meta", an InternalTorchDynamoError, reproduced with one Linear's DTensor
  weight moved into a flat buffer); 2.14 traces it, so tp with ZeRO compiles there.
- `group_name_salt()`: the count torch salts a locally synchronized group's hashed name with:
  the groups this process has registered through 2.13, its group-creation calls from 2.14.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
functional_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
functional_reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor

_RELEASE = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
COMPILES_DTENSOR_PARAMETERS = _RELEASE >= (2, 13)
COMPILES_DTENSOR_VIEWS = _RELEASE >= (2, 14)


def group_name_salt() -> int | None:
    """This rank's salt in torch's name for the next group made with
    `use_local_synchronization=True` (sha1 of its ranks and the salt); None when this torch
    names groups some other way. Found by asking torch's own hash which count it used."""
    from torch.distributed import distributed_c10d as c10d

    name_of = getattr(c10d, "_hash_ranks_to_str", None)
    world = getattr(c10d, "_world", None)
    if name_of is None or world is None:
        return None
    for salt in (len(world.pg_names), world.group_count):
        if name_of([0]) == hashlib.sha1(f"0_{salt}".encode()).hexdigest():
            return salt
    return None
