"""Small helpers around torch.distributed collectives.

Every wait on a collective goes through `wait`, so a failure or timeout surfaces as a
`CommunicationError` naming the rank, the operation and the group's ranks instead of a bare
backend message. `CommStats` counts what the executors send, for summaries and benchmarks.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

from .errors import CommunicationError


def describe_group(group: dist.ProcessGroup) -> str:
    return f"ranks {dist.get_process_group_ranks(group)}"


def wait(work: dist.Work | None, what: str, group: dist.ProcessGroup) -> None:
    """Wait for an async collective; re-raise a failure as `CommunicationError`."""
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

    def total_bytes(self) -> int:
        return sum(self.bytes.values())


def coalesce(tensors: Iterable[torch.Tensor], cap_bytes: int) -> Iterator[list[torch.Tensor]]:
    """Runs of tensors of one dtype and device, each run at most `cap_bytes` (or one tensor)."""
    runs: dict[tuple, list[torch.Tensor]] = {}
    sizes: dict[tuple, int] = {}
    for tensor in tensors:
        key = (tensor.dtype, tensor.device)
        nbytes = tensor.numel() * tensor.element_size()
        if key in runs and sizes[key] + nbytes > cap_bytes:
            yield runs.pop(key)
        if key in runs:
            runs[key].append(tensor)
            sizes[key] += nbytes
        else:
            runs[key], sizes[key] = [tensor], nbytes
    yield from runs.values()


@torch.no_grad()
def broadcast_tensors(tensors: list[torch.Tensor], group: dist.ProcessGroup, cap_bytes: int,
                      stats: CommStats | None = None) -> None:
    """Overwrite `tensors` in place with the values held by the group's first rank.

    Tensors are flattened into runs of at most `cap_bytes` so a model costs a few
    broadcasts, not one per parameter.
    """
    if dist.get_world_size(group) == 1:
        return
    src = dist.get_global_rank(group, 0)
    for run in coalesce(tensors, cap_bytes):
        flat = torch.cat([t.reshape(-1) for t in run])
        if stats is not None:
            stats.record("broadcast", flat)
        wait(dist.broadcast(flat, src=src, group=group, async_op=True), "parameter broadcast", group)
        for tensor, piece in zip(run, flat.split([t.numel() for t in run])):
            tensor.copy_(piece.view_as(tensor))
