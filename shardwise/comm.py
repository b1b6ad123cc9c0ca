"""Small helpers around torch.distributed collectives.

Every wait on a collective goes through `wait`, so a failure or timeout surfaces as a
`CommunicationError` naming the rank, the operation and the group's ranks instead of a bare
backend message. `CommStats` counts what the executors send, for summaries and benchmarks.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable

import torch
import torch.distributed as dist

from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from .errors import CommunicationError
from .tensors import op_name



def trace_range(name: str) -> contextlib.AbstractContextManager:
    """A range named "shardwise/<name>" in torch.profiler's traces (a Chrome / Perfetto trace
    reads as the step's schedule); nothing inside compiled code, and nothing while no profiler
    runs (a range costs about 6 us; the check 0.4)."""
    if torch.compiler.is_compiling() or not torch.autograd._profiler_enabled():
        return contextlib.nullcontext()
    return torch.profiler.record_function(f"shardwise/{name}")


def describe_group(group: dist.ProcessGroup) -> str:
    return f"ranks {dist.get_process_group_ranks(group)}"


def wait(work: dist.Work | None, what: str, group: dist.ProcessGroup, coordinator=None) -> None:
    """Wait for an async collective; re-raise a failure as `CommunicationError`.

    With a `coordinator` (see coordination.py) the wait also names what the other ranks
    last reported and ends as soon as one of them is known to have failed."""
    if coordinator is not None:
        coordinator.wait(work, what, group)
        return
    if work is None:
        return
    try:
        work.wait()
    except RuntimeError as exc:
        raise CommunicationError(
            f"rank {dist.get_rank()}: {what} over {describe_group(group)} failed: {exc}"
        ) from exc


@dataclass
class CommStats:
    """Collectives issued and payload bytes, by operation name."""

    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def record(self, op: str, tensor: torch.Tensor) -> None:
        self.calls[op] += 1
        self.bytes[op] += tensor.numel() * tensor.element_size()

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()


class CollectiveCounter(TorchDispatchMode):
    """Counts functional collectives (ours and DTensor's) and their input bytes while active;
    with `c10d=True` also the process-group calls (`dist.all_reduce`, FSDP2's, DDP's, and
    point-to-point sends; receives, their mirror, are not counted).

    `with CollectiveCounter() as c: step()` then `c.calls["all_reduce"]`, `c.bytes[...]`.
    torch's CommDebugMode does the same but its module tracker fails on a module called
    twice in one forward (a shared dropout), so shardwise counts with this instead.
    """

    def __init__(self, c10d: bool = False) -> None:
        super().__init__()
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)
        self.c10d = c10d

    # process-group ops: name, and which argument holds the input tensors
    _C10D = {"allreduce_": ("all_reduce", 0), "allreduce_coalesced_": ("all_reduce", 0),
             "_allgather_base_": ("all_gather", 1), "allgather_": ("all_gather", 1),
             "allgather_into_tensor_coalesced_": ("all_gather", 1), "_reduce_scatter_base_": ("reduce_scatter", 1),
             "reduce_scatter_": ("reduce_scatter", 1), "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
             "broadcast_": ("broadcast", 0), "alltoall_base_": ("all_to_all", 1), "send": ("send", 0)}

    _NAMES = {"all_reduce": "all_reduce", "all_reduce_": "all_reduce", "all_gather_into_tensor": "all_gather",
              "reduce_scatter_tensor": "reduce_scatter", "all_to_all_single": "all_to_all", "broadcast": "broadcast",
              "broadcast_": "broadcast", "all_reduce_coalesced": "all_reduce", "all_gather_into_tensor_coalesced": "all_gather"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor turn the op into collectives, which come back here
        name, slot = None, 0
        if func.namespace in ("_c10d_functional", "c10d_functional"):
            name = self._NAMES.get(op_name(func))
        elif self.c10d and func.namespace == "c10d":
            name, slot = self._C10D.get(op_name(func), (None, 0))
        if name is not None:
            tensors = args[slot]
            while isinstance(tensors, (list, tuple)) and tensors and isinstance(tensors[0], (list, tuple)):
                tensors = [t for inner in tensors for t in inner]
            tensors = tensors if isinstance(tensors, (list, tuple)) else [tensors]
            self.calls[name] += 1
            self.bytes[name] += sum(t.numel() * t.element_size() for t in tensors)
        return func(*args, **(kwargs or {}))


def coalesce(items: Iterable, cap_bytes: int, key=None, nbytes=None) -> list[list]:
    """Runs of items with one key (default: a tensor's dtype and device), each at most
    `cap_bytes` (or a single item), in the order they complete: by the position of their last
    item. (A key's last run is complete at its last item, not at the end of the list: a ZeRO-3
    unit's first parameters, which backward reaches last in the unit, are bucketed right after
    the unit, not after every other unit.)"""
    key = key or (lambda t: (t.dtype, t.device))
    nbytes = nbytes or (lambda t: t.numel() * t.element_size())
    runs: dict = {}
    sizes: dict = {}
    done: list[tuple[int, list]] = []  # (position of the last item, run)
    last: dict = {}
    for position, item in enumerate(items):
        k, size = key(item), nbytes(item)
        if k in runs and sizes[k] + size > cap_bytes:
            done.append((last[k], runs.pop(k)))
        if k in runs:
            runs[k].append(item)
            sizes[k] += size
        else:
            runs[k], sizes[k] = [item], size
        last[k] = position
    done += [(last[k], run) for k, run in runs.items()]
    return [run for _, run in sorted(done, key=lambda entry: entry[0])]


@torch.no_grad()
def broadcast_tensors(tensors: list[torch.Tensor], group: dist.ProcessGroup, cap_bytes: int,
                      stats: CommStats | None = None, src: int | None = None) -> None:
    """Overwrite `tensors` in place with the values held by global rank `src` (default: the
    group's first rank).

    Tensors are flattened into runs of at most `cap_bytes` so a model costs a few
    broadcasts, not one per parameter.
    """
    if dist.get_world_size(group) == 1:
        return
    src = dist.get_global_rank(group, 0) if src is None else src
    for run in coalesce(tensors, cap_bytes):
        flat = torch.cat([t.reshape(-1) for t in run])
        if stats is not None:
            stats.record("broadcast", flat)
        wait(dist.broadcast(flat, src=src, group=group, async_op=True), "parameter broadcast", group)
        for tensor, piece in zip(run, flat.split([t.numel() for t in run])):
            tensor.copy_(piece.view_as(tensor))


def broadcast_rng_state(group: dist.ProcessGroup, device: torch.device) -> None:
    """Give every rank of `group` the first rank's random state (CPU, and the accelerator's)."""
    if dist.get_world_size(group) == 1:
        return
    state = torch.get_rng_state().to(device)
    wait(dist.broadcast(state, src=dist.get_global_rank(group, 0), group=group, async_op=True), "rng broadcast", group)
    torch.set_rng_state(state.cpu())
    if device.type == "cuda":
        cuda = torch.cuda.get_rng_state().to(device)
        wait(dist.broadcast(cuda, src=dist.get_global_rank(group, 0), group=group, async_op=True), "rng broadcast", group)
        torch.cuda.set_rng_state(cuda.cpu())
