"""Waiting for peers without hanging: beacons, polled waits, and ranks out of step.

Every collective shardwise waits on goes through `PeerWatch.wait` (the `Coordinator` of
coordination.py is one, and adds the agreements that open each operation).

While a rank waits for the others it polls: a wait that outlasts a poll says which
collective it waits in (a second key per rank, cleared when the wait ends), and every second it reads the other ranks'
beacons, small keys in the rendezvous store (one set per coordinator) saying which operation
each rank entered last and its number, so a wait that cannot finish is named precisely (the
rank that is behind, the operation it is in, a rank whose operation failed) and fails within
the config's `timeout_s` at most. A peer that already entered a later operation skipped the
collective this rank waits in: that fails within about three seconds, with one message on every rank.
Peers blocked in different collectives of the same group (`sw.reduce` called under
`if rank == 0`, while the other rank waits in its gradient all-reduce) fail within about
five seconds, each naming both collectives.
This is what lets a step's optimizer.step go without an agreement of its own (module.py).

An exception that escapes an operation on one rank alone (a user's forward raising on one
rank) leaves the others waiting inside that operation's collectives: this rank is then out
of step, refuses further collective operations with that reason, and publishes it in its
beacon so peers that poll can name it.
"""

from __future__ import annotations

import re
import time
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch.distributed as dist

from .comm import trace_range
from .errors import CommunicationError
from .shared_groups import retire_shared_groups

POLL_S = 1.0
MOVED_ON_GRACE_S = 2.0  # a peer past this rank's operation for this long skipped the collective it waits in
# Two ranks of one group blocked in two different collectives of it, both for this long after
# saying so, will never finish: collectives of a group complete in the order they were issued,
# so a rank waiting in a later one than a peer's sees the peer's finish within one transfer.
APART_GRACE_S = 3.0
BEACON_EVERY_S = 1.0  # entering an operation republishes the beacon at most this often (a store round trip)
SKIPPED = "collective operations must be called on every rank in the same order:"


def default_store() -> Any | None:
    """The rendezvous store of the default process group, for beacons (None if unreachable)."""
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError, ValueError):
        return None


class PeerWatch:
    """Beacons and polled waits over one group of ranks: what each rank last entered, where it
    waits, and the error that names a peer that cannot join."""

    def __init__(self, group: dist.ProcessGroup, timeout_s: float, store: Any | None = None,
                 retires_shared_groups: bool = False):
        self.group = group
        # out of step, this group's collectives may have left shared groups unusable
        self.retires_shared_groups = retires_shared_groups
        self.ranks = dist.get_process_group_ranks(group)
        self.rank = dist.get_rank()
        self.index = self.ranks.index(self.rank)
        self.timeout_s = timeout_s
        self.seq = 0  # the number of this rank's last operation (its agreements count them)
        self.out_of_step: str | None = None  # why this rank can no longer take part in collectives
        self.current = "idle"
        self.waited_s = 0.0  # time blocked in `wait` (metrics.py: exposed communication)
        self._published = (None, float("-inf"))  # the beacon last written, and when
        self._waiting_said = False  # a wait-key says this rank is blocked in a collective
        # an agreement left running while local work goes on (a step's forward, step.py):
        # settled before this rank's next collective of any kind
        self.deferred: Callable[[], Any] | None = None
        base = store if store is not None else default_store()
        # keyed by the group: each coordinator numbers its own operations
        prefix = f"shardwise/beacon/{getattr(group, 'group_name', '') or 'world'}/"
        self.store = dist.PrefixStore(prefix, base) if base is not None else None

    @property
    def size(self) -> int:
        return len(self.ranks)

    # beacons ---------------------------------------------------------------------------
    def _beacon(self, state: str, every_s: float = 0.0) -> None:
        """Publish `state`; with `every_s`, only if the last publication is that old (peers
        read beacons only once a wait has lasted a poll, and a wait republishes first)."""
        self.current = state
        now = time.monotonic()
        if self.store is None or self.size == 1 or now - self._published[1] < every_s:
            return
        try:
            self.store.set(str(self.rank), f"{self.seq}\t{state} ({time.strftime('%H:%M:%S')})")
            self._published = (state, now)
        except RuntimeError:
            pass  # the store is gone (the world is ending): diagnosis only

    def beacons(self, ranks: Sequence[int] | None = None) -> dict[int, str]:
        """Rank -> what it last reported (ranks that never reported are absent)."""
        return {rank: state for rank, (_, state) in self._reports(ranks).items()}

    def _reports(self, ranks: Sequence[int] | None) -> dict[int, tuple[int, str]]:
        """Rank -> (the number of its last agreement, what it last reported)."""
        if self.store is None:
            return {}
        found = {}
        for rank in ranks if ranks is not None else self.ranks:
            try:
                if self.store.check([str(rank)]):
                    seq, state = self.store.get(str(rank)).decode().split("\t", 1)
                    found[rank] = (int(seq), state)
            except RuntimeError:
                break
        return found

    def _diagnosis(self, ranks: Sequence[int]) -> str:
        others = {r: s for r, s in self.beacons(ranks).items() if r != self.rank}
        silent = [r for r in ranks if r != self.rank and r not in others]
        parts = [f"rank {r}: {s}" for r, s in sorted(others.items())]
        if silent:
            parts.append(f"ranks {silent}: no report")
        return "; ".join(parts) if parts else "no other rank reported"

    def failed_peers(self, ranks: Sequence[int]) -> dict[int, str]:
        return {r: s for r, s in self.beacons(ranks).items() if r != self.rank and s.startswith("out of step")}

    # waiting ---------------------------------------------------------------------------
    def wait(self, work: dist.Work | None, what: str, group: dist.ProcessGroup, deadline_s: float | None = None) -> None:
        """Wait for an async collective; fail with a `CommunicationError` that names the
        operation and what the other ranks reported, as soon as a peer is known to have
        failed, and at the latest after `deadline_s` (default: the timeout)."""
        self.settle_deferred()
        if work is None:
            return
        start = time.perf_counter()
        try:
            with trace_range(f"wait: {what}"):
                self._wait(work, what, group, deadline_s)
        finally:
            self.waited_s += time.perf_counter() - start

    def settle_deferred(self) -> None:
        """Finish a deferred agreement (raising its agreed error, if any) before communicating."""
        if self.deferred is not None:
            settle, self.deferred = self.deferred, None
            settle()

    def _wait(self, work: Any, what: str, group: dist.ProcessGroup, deadline_s: float | None) -> None:
        ranks = dist.get_process_group_ranks(group)
        try:
            self._poll(work, what, group, ranks, deadline_s, lambda: self._say_waiting(what, ranks))
        finally:
            if self._waiting_said:
                self._say_waiting(None, ranks)

    def _say_waiting(self, what: str | None, ranks: list[int]) -> None:
        """Publish the collective this rank is blocked in (None: no longer blocked)."""
        self._waiting_said = what is not None
        if self.store is None or self.size == 1:
            return
        try:
            self.store.set(f"wait/{self.rank}", "" if what is None else f"{self.seq}\t{ranks}\t{what}")
        except RuntimeError:
            pass  # the store is gone (the world is ending): diagnosis only

    def _raise_if_waiting_apart(self, what: str, ranks: list[int], since: float | None) -> float | None:
        """Peers blocked in another collective of the same group (same ranks, same operation)
        for APART_GRACE_S: a collective some ranks skipped or issued in another order. Returns
        when that was first seen (None: not seen)."""
        if self.store is None:
            return None
        apart = {}
        for rank in ranks:
            if rank == self.rank:
                continue
            try:
                if not self.store.check([f"wait/{rank}"]):
                    continue
                seen = self.store.get(f"wait/{rank}").decode()
            except RuntimeError:
                return since
            if seen:
                seq, their_ranks, theirs = seen.split("\t", 2)
                if int(seq) == self.seq and their_ranks == str(ranks) and theirs != what:
                    apart[rank] = theirs
        now = time.monotonic()
        if not apart or since is None or now - since < APART_GRACE_S:
            return (since if since is not None else now) if apart else None
        apart[self.rank] = what  # in rank order: the same message whichever rank sees it first
        names = "; ".join(f"rank {r} waits in {w}" for r, w in sorted(apart.items()))
        message = (f"{SKIPPED} over ranks {ranks}, {names}: a collective that some ranks skipped or called in another "
                   "order (e.g. sw.reduce under `if rank == 0`, or in a branch taken on some ranks only); call it on "
                   "every rank of its group")
        self._leave_step(message)
        raise CommunicationError(message)

    def _poll(self, work: Any, what: str, group: dist.ProcessGroup, ranks: list[int], deadline_s: float | None,
              say_waiting: Callable[[], None]) -> None:
        deadline = time.monotonic() + (self.timeout_s if deadline_s is None else deadline_s)
        moved_since = None  # when a peer was first seen past this rank's operation
        apart_since = None  # when a peer was first seen blocked in another collective of this group
        while True:
            try:
                work.wait(timeout=timedelta(seconds=max(0.01, min(POLL_S, deadline - time.monotonic()))))
                return
            except RuntimeError as exc:
                polled = "Operation timed out!" in str(exc)
                if not polled:
                    self._raise_skipped(self.failed_peers(ranks))
                    self._leave_step(f"{what} failed")
                    cause = (f"not every rank joined within timeout_s={self.timeout_s:g}s"
                             if "Timed out waiting" in str(exc) else _short(exc))
                    raise CommunicationError(
                        f"rank {self.rank}: {what} over ranks {ranks} failed: {cause}. "
                        f"Last reports of the other ranks: {self._diagnosis(ranks)}"
                    ) from exc
            if self._published[0] != self.current:  # peers must see where this rank waits
                self._beacon(self.current)
            if not self._waiting_said:
                say_waiting()
            reports = self._reports(ranks)  # one read of the peers' beacons per poll
            moved_since = self._raise_if_skipped_here(reports, what, ranks, moved_since)
            apart_since = self._raise_if_waiting_apart(what, ranks, apart_since)
            failed = {r: state for r, (_, state) in reports.items() if r != self.rank and state.startswith("out of step")}
            self._raise_skipped(failed)
            if failed or time.monotonic() >= deadline:
                self._leave_step(f"{what} did not complete")
                cause = ("a peer failed" if failed else
                         f"not every rank joined within timeout_s={self.timeout_s:g}s")
                raise CommunicationError(
                    f"rank {self.rank}: {what} over ranks {ranks} cannot complete: {cause}. "
                    f"Last reports of the other ranks: {self._diagnosis(ranks)}"
                )

    def _raise_if_skipped_here(self, reports: dict[int, tuple[int, str]], what: str, ranks: list[int],
                               since: float | None) -> float | None:
        """Peers that entered a later operation of this coordinator than this rank's will never
        join the collective it waits in. Raise once they have been seen there for
        MOVED_ON_GRACE_S (a peer may finish a collective a moment before this rank's wait
        does); return when they were first seen, None if none is."""
        moved_on = {r: state for r, (seq, state) in reports.items() if r != self.rank and seq > self.seq}
        now = time.monotonic()
        if not moved_on or since is None or now - since < MOVED_ON_GRACE_S:
            return (since if since is not None else now) if moved_on else None
        names = "; ".join(f"rank {r}: {state}" for r, state in sorted(moved_on.items()))
        message = (f"{SKIPPED} rank {self.rank} waited in {what} over ranks {ranks}, which ranks "
                   f"{sorted(moved_on)} skipped: they went on to a later operation ({names}); call each on "
                   "every rank (e.g. not under `if rank == 0`)")
        self._leave_step(message)
        raise CommunicationError(message)

    def _raise_skipped(self, failed: dict[int, str]) -> None:
        """A failed peer's diagnosis that a rank skipped an operation, word for word (one
        message on every rank)."""
        for state in failed.values():
            reason = re.sub(r" \(\d\d:\d\d:\d\d\)$", "", state.removeprefix("out of step: "))
            if reason.startswith(SKIPPED):
                self._leave_step(reason)
                raise CommunicationError(reason)

    def _leave_step(self, reason: str) -> None:
        """Out of step for `reason`; the first reason stays (what follows is its consequence)."""
        if self.out_of_step is None:
            self.out_of_step = reason
            self._retire()  # before the beacon: a peer that reads it finds them retired
            self._beacon(f"out of step: {reason}")

    def _retire(self) -> None:
        """After a failure inside an operation: collectives it left in flight or unmatched would
        pair with the next ones on the same groups, so later topologies make their own."""
        if self.retires_shared_groups and self.size > 1:
            retire_shared_groups(default_store())


def _peer_lost(exc: BaseException) -> bool:
    """Whether a backend error says a peer went away or stopped answering."""
    text = str(exc)
    return any(sign in text for sign in ("Connection closed by peer", "Connection reset by peer", "Timed out waiting",
                                         "Broken pipe", "NCCL communicator was aborted", "Connection refused"))


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "Connection closed by peer" in text or "Connection reset by peer" in text:
        return "a peer closed its connection (its process ended or crashed)"
    if "Timed out waiting" in text:
        return "a peer did not answer within the group's timeout"
    return text[:400]
