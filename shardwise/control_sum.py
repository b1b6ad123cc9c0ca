"""The sum of a few integers over a CPU (gloo) group in about log2(n) message steps.

The per-step agreement (coordination.py) needs one small all-reduce. gloo runs its own
all-reduce as a ring of 2(n-1) dependent steps and its all-gather as n-1: at thousands of
ranks that is thousands of network latencies every step. Recursive doubling takes
ceil(log2 n) exchanges (two more when n is not a power of two), so it is written here over
gloo's point-to-point send and receive.

gloo cannot wait for a point-to-point transfer with a timeout without closing the
connection, and the caller must poll (to name a stalled peer). So a daemon thread runs the
exchanges and the caller waits on a `SumWork`, which times out like a collective's work.
"""

from __future__ import annotations

import queue
import threading
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist

TAG = 0x53570000  # point-to-point tags of these exchanges, apart from a user's (which start at 0)


class SumWork:
    """A sum in progress; `wait(timeout)` raises RuntimeError("Operation timed out!") when it
    is not done within `timeout`, as a gloo collective's work does, and the exchange's own
    error (a peer's connection closed) when it failed."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.result: torch.Tensor | None = None
        self.error: BaseException | None = None

    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self.done.wait(None if timeout is None else timeout.total_seconds()):
            raise RuntimeError("Operation timed out!")
        if self.error is not None:
            raise self.error
        return True


def doubling_steps(world: int) -> int:
    """Dependent message steps of `RecursiveDoublingSum` at `world` ranks."""
    p = 1 << (world.bit_length() - 1)
    return (p.bit_length() - 1) + 2 * (world != p)


class RecursiveDoublingSum:
    """Element-wise sums of int64 vectors over `ranks` (global ranks of `group`, this rank
    among them), one at a time, by a helper thread started on first use."""

    def __init__(self, group: dist.ProcessGroup, ranks: Sequence[int]):
        self.group = group
        self.ranks = list(ranks)
        self.index = self.ranks.index(dist.get_rank())
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self, vector: torch.Tensor) -> SumWork:
        """Begin summing `vector` (int64, the same length on every rank)."""
        work = SumWork()
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="shardwise-control-sum", daemon=True)
            self._thread.start()
        self._jobs.put((vector, work))
        return work

    def _serve(self) -> None:
        while True:
            vector, work = self._jobs.get()
            try:
                work.result = self._sum(vector)
            except BaseException as exc:  # handed to the waiting caller
                work.error = exc
            work.done.set()

    def _sum(self, vector: torch.Tensor) -> torch.Tensor:
        n, i = len(self.ranks), self.index
        p = 1 << (n.bit_length() - 1)  # the largest power of two <= n
        total, incoming = vector.clone(), torch.empty_like(vector)
        if i >= p:  # a rank beyond the power of two: its partner sums for it
            self._send(total, i - p, 0)
            self._recv(total, i - p, 1)
            return total
        if i + p < n:
            self._recv(incoming, i + p, 0)
            total += incoming
        step, round_ = 1, 2
        while step < p:
            peer = self.ranks[i ^ step]
            works = [dist.isend(total, peer, group=self.group, tag=TAG + round_),
                     dist.irecv(incoming, peer, group=self.group, tag=TAG + round_)]
            for w in works:
                w.wait()
            total += incoming
            step, round_ = step << 1, round_ + 1
        if i + p < n:
            self._send(total, i + p, 1)
        return total

    def _send(self, tensor: torch.Tensor, index: int, round_: int) -> None:
        dist.isend(tensor, self.ranks[index], group=self.group, tag=TAG + round_).wait()

    def _recv(self, tensor: torch.Tensor, index: int, round_: int) -> None:
        dist.irecv(tensor, self.ranks[index], group=self.group, tag=TAG + round_).wait()
