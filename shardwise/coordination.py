"""Agreement between ranks before they communicate: one decision on every rank, in seconds.

Every shardwise operation that communicates (parallelize, train_step, full_state_dict,
checkpoints, ...) starts with `Coordinator.agree`, on a CPU (gloo) control group, over a
fixed-size record per rank: which operation this rank is in and its sequence number, whether
this rank met a problem before communicating (a bad file, a bad batch, a plan that does not
resolve), a number to combine (a batch's sample count), and fingerprints that peers must
share (the model's parameter shapes, the batch tensors' shapes and contents).

From 7 ranks its fast path is one sum of eight integers by recursive doubling (control_sum.py:
log2(n) message steps, where gloo's all-gather of the records is a ring of n-1): the count of
problems, the values' sum, and for each thing ranks must share two check sums. A check sum
is, over each group of ranks that must agree, the sum of w_r * h(x_r) with h a 28-bit hash
and weights summing to zero in the group (-(k-1) on its first rank, 1 on the others): zero
when every rank of every group holds the same x, and otherwise nonzero but for a chance
cancellation (two independent 28-bit hashes: about 2^-56). Only when a sum says something
is wrong do the ranks all-gather their records (every rank sees the same sums, so all take
that path; below 7 ranks they always do: the ring is as short), and from the gathered table every rank takes the same decision:
- a problem on any rank becomes the same `ShardwiseError` on every rank, naming the rank
  that found it, and nobody is left waiting in a collective the failing rank never joins;
- ranks in different operations (`if rank == 0: pm.full_state_dict()`) pair up in this
  one same-shaped collective, so both see the mismatch at once (a mismatched gloo
  collective would abort the process; an NCCL one would hang);
- fingerprints that differ between ranks that must agree are named, with the first
  difference, before any data-dependent collective runs.

Waiting in collectives (beacons, polled waits, ranks out of step) is peer_watch.py's.

"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from . import errors
from .compat import all_gather_single
from .control_sum import RecursiveDoublingSum, doubling_steps
from .errors import CommunicationError, ShardwiseError
from .peer_watch import BEACON_EVERY_S, PeerWatch, _peer_lost, _short
from .shared_groups import shared_group

OPERATIONS = ("parallelize", "train_step", "infer_step", "forward", "full_state_dict", "full_grad_dict",
              "load_full_state_dict", "save_checkpoint", "load_checkpoint", "optimizer.step", "clip_grad_norm",
              "scale_grads", "finish_gradient_sync", "agree", "optimizer.full_state_dict",
              "optimizer.load_full_state_dict", "activation_memory", "activation_memory(fake=True)", "state_dict",
              "train_step(reduce='sum')", "train_step(reduce='tokens')", "load_pretrained",
              "save_pretrained", "metrics.log_to", "timeline", "optimizer.load_state_dict")
FINGERPRINTS = 2  # fingerprint slots in a record
FIELDS = ("op", "seq", "problem", "value") + tuple(f"fingerprint{i}" for i in range(FINGERPRINTS))
SUM_SAVES_STEPS = 2  # the sum replaces the all-gather where it saves this many latency steps (from 7 ranks):
# it costs a hand-off to its thread and back, and at 4 local ranks measured slower than the 3-step ring
HASH_BITS = 28
def code(text: str) -> int:
    """A stable 56-bit code for a string (operation names, fingerprints)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")


_NAMES = {code(op): op for op in OPERATIONS}


class AgreedError(ShardwiseError):
    """Marker mixed into errors raised by an agreement: every rank raised the same one."""


@functools.lru_cache(maxsize=None)
def _agreed_class(cls: type[ShardwiseError]) -> type[ShardwiseError]:
    # ShardwiseError itself: (ShardwiseError, AgreedError) has no consistent order, AgreedError alone is one
    bases = (AgreedError,) if issubclass(AgreedError, cls) else (cls, AgreedError)
    return type(cls.__name__, bases, {"__module__": cls.__module__, "__qualname__": cls.__qualname__})


def _agreed(cls: type[ShardwiseError], message: str) -> ShardwiseError:
    """An instance of `cls` that also says it was raised on every rank alike."""
    return _agreed_class(cls)(message)


def error_class(name: str) -> type[ShardwiseError]:
    found = getattr(errors, name, None)
    return found if isinstance(found, type) and issubclass(found, ShardwiseError) else ShardwiseError


@dataclass
class Fingerprint:
    """Something ranks must share, as a code; on a mismatch, `describe()` gives the lines
    compared to name the first difference, raised as `error` with `hint` (the fix)."""

    value: int
    describe: Callable[[], list[str]]
    error: type[ShardwiseError]
    hint: str
    peers: Sequence[Sequence[int]] | None = None  # groups of global ranks that must agree; None: all


def fingerprint_of(lines: list[str]) -> int:
    return code("\n".join(lines))


@dataclass
class Agreement:
    """What every rank learned: one row of `FIELDS` per rank of the control group, and the
    sum of the ranks' `value`s."""

    total: int
    table: torch.Tensor | None  # (ranks, len(FIELDS)) int64; None when the fast path agreed

    def values(self) -> list[int]:
        if self.table is None:
            raise RuntimeError("this agreement kept only the values' sum: agree(..., every_value=True) keeps each rank's")
        return self.table[:, FIELDS.index("value")].tolist()


@dataclass
class PendingAgreement:
    """An agreement whose records are still being gathered (`Coordinator.begin`)."""

    coordinator: "Coordinator"
    op: str
    problem: BaseException | None
    fingerprints: Sequence[Fingerprint]
    record: torch.Tensor
    table: torch.Tensor | None  # the gathered records; None while the fast path's sum runs
    work: Any
    settled: Agreement | None = None

    def result(self) -> Agreement:
        """Wait for every rank's record and decide (raising the agreed error, if any)."""
        if self.settled is None:
            self.settled = self.coordinator.settle(self)
        return self.settled


class Coordinator(PeerWatch):
    """Agreements over one control group (every rank of a world or topology), on top of the
    beacons and polled waits of `PeerWatch`."""

    def __init__(self, group: dist.ProcessGroup, timeout_s: float, store: Any | None = None,
                 fast_path: bool | None = None, retires_shared_groups: bool = False):
        super().__init__(group, timeout_s, store, retires_shared_groups)
        self._weights: dict[int, tuple[Any, int]] = {}  # id(peer groups) -> (them, this rank's weight)
        if fast_path is None:  # not in torch's fake world (one process, no messages)
            fast_path = (self.size - 1 - doubling_steps(self.size) >= SUM_SAVES_STEPS
                         and str(dist.get_backend(group)) != "fake")
        self.summing = RecursiveDoublingSum(group, self.ranks) if fast_path and self.size > 1 else None


    # agreement -------------------------------------------------------------------------
    def agree(self, op: str, problem: BaseException | None = None, *, value: int = 0,
              fingerprints: Sequence[Fingerprint] = (), every_value: bool = False) -> Agreement:
        """Every rank calls this at the same point of the same operation `op`.

        Raises the same error on every rank if any rank passes a `problem`, if ranks are in
        different operations, or if a fingerprint differs between ranks that must share it.
        Returns the sum of the ranks' `value`s, and with `every_value` each rank's (which
        takes the all-gather instead of the fast path).
        """
        return self.begin(op, problem, value=value, fingerprints=fingerprints, every_value=every_value).result()

    def begin(self, op: str, problem: BaseException | None = None, *, value: int = 0,
              fingerprints: Sequence[Fingerprint] = (), every_value: bool = False) -> "PendingAgreement":
        """`agree` in two halves: the records are combined while the caller does local work;
        `result()` must come before the operation's first collective."""
        if self.out_of_step is not None:
            raise CommunicationError(
                f"rank {self.rank} cannot start {op}: an earlier operation did not finish on every rank "
                f"({self.out_of_step}), so the ranks are out of step. Restart every process"
            )
        self.settle_deferred()
        if len(fingerprints) > FINGERPRINTS:
            raise ValueError(f"at most {FINGERPRINTS} fingerprints per agreement")
        if self.size == 1 and problem is not None:
            raise problem
        self.seq += 1
        self._beacon(f"last entered {op} #{self.seq}", every_s=BEACON_EVERY_S)
        codes = [f.value for f in fingerprints] + [0] * (FINGERPRINTS - len(fingerprints))
        record = torch.tensor([code(op), self.seq, 1 if problem is not None else 0, int(value), *codes],
                              dtype=torch.int64)
        if self.size == 1:
            return PendingAgreement(self, op, problem, fingerprints, record, record.view(1, -1), None)
        if self.summing is not None and not every_value:
            work = self.summing.start(self._summary(op, problem, value, fingerprints))
            return PendingAgreement(self, op, problem, fingerprints, record, None, work)
        return PendingAgreement(self, op, problem, fingerprints, record, *self._gather(record))

    def _summary(self, op: str, problem: BaseException | None, value: int,
                 fingerprints: Sequence[Fingerprint]) -> torch.Tensor:
        """This rank's terms of the fast path's sums: problems, value, then two check sums each
        for the operation and every fingerprint slot (the module docstring)."""
        terms = [1 if problem is not None else 0, int(value), *self._check_terms(code(f"{op}#{self.seq}"), None)]
        for slot in range(FINGERPRINTS):
            terms += self._check_terms(fingerprints[slot].value, fingerprints[slot].peers) \
                if slot < len(fingerprints) else [0, 0]
        return torch.tensor(terms, dtype=torch.int64)

    def _check_terms(self, value: int, peers: Sequence[Sequence[int]] | None) -> list[int]:
        weight = self._weight(peers)
        mask = (1 << HASH_BITS) - 1
        return [weight * (value & mask), weight * ((value >> HASH_BITS) & mask)]

    def _weight(self, peers: Sequence[Sequence[int]] | None) -> int:
        """This rank's weight in a check sum over `peers` (-(k-1) first in its group of k, else 1)."""
        if peers is None:
            return 1 - self.size if self.index == 0 else 1
        known = self._weights.get(id(peers))
        if known is None or known[0] is not peers:  # the same list each step (Topology.peer_groups): looked up once
            group = next((g for g in peers if self.rank in g), [self.rank])
            known = (peers, 1 - len(group) if group[0] == self.rank else 1)
            self._weights = {**(self._weights if len(self._weights) < 16 else {}), id(peers): known}
        return known[1]

    def _gather(self, record: torch.Tensor) -> tuple[torch.Tensor, Any]:
        table = torch.empty(self.size * len(FIELDS), dtype=torch.int64)
        return table, all_gather_single(table, record, group=self.group, async_op=True)

    def settle(self, pending: "PendingAgreement") -> Agreement:
        """Wait for a pending agreement's sums or records and decide (`PendingAgreement.result`)."""
        op, table, work = pending.op, pending.table, pending.work
        what = f"{op} #{self.seq} (its opening agreement)"
        if table is None:
            self.wait(work, what, self.group)
            sums = work.result
            if sums[0] == 0 and not sums[2:].any():
                return Agreement(int(sums[1]), None)
            table, work = self._gather(pending.record)  # something differs: every rank's record names it
        if work is not None:
            self.wait(work, what, self.group)
        table = table.view(self.size, len(FIELDS))
        self._check_same_operation(op, table)
        flagged = table[:, FIELDS.index("problem")].nonzero().flatten().tolist()
        if flagged:
            self._raise_problem(op, pending.problem, flagged)
        for slot, fingerprint in enumerate(pending.fingerprints):
            self._check_fingerprint(op, table[:, FIELDS.index(f"fingerprint{slot}")].tolist(), fingerprint)
        return Agreement(int(table[:, FIELDS.index("value")].sum()), table)

    @contextlib.contextmanager
    def body(self, op: str) -> Iterator[None]:
        """The part of an operation after its agreement: an exception that escapes it on this
        rank (other than an agreed one, raised everywhere) puts this rank out of step."""
        try:
            yield
        except AgreedError:
            self._retire()  # raised mid-operation, it may leave collectives in flight
            raise
        except BaseException as exc:
            if self.size > 1:
                self._leave_step(f"{op} #{self.seq} raised {type(exc).__name__}: {_short(exc)}")
                if isinstance(exc, RuntimeError) and not isinstance(exc, ShardwiseError) and _peer_lost(exc):
                    raise CommunicationError(  # a collective inside the operation (tp, pp, cp, ...) lost a peer
                        f"rank {self.rank}: {op} #{self.seq} failed in a collective: {_short(exc)}. Last reports of "
                        f"the other ranks: {self._diagnosis(self.ranks)}") from exc
            raise

    @contextlib.contextmanager
    def operation(self, op: str, problem: BaseException | None = None, **checks: Any) -> Iterator[Agreement]:
        """`agree`, then `body`."""
        agreement = self.agree(op, problem, **checks)
        with self.body(op):
            yield agreement

    def _check_same_operation(self, op: str, table: torch.Tensor) -> None:
        ops = table[:, FIELDS.index("op")].tolist()
        seqs = table[:, FIELDS.index("seq")].tolist()
        if len(set(ops)) == 1 and len(set(seqs)) == 1:
            return
        self._leave_step(f"ranks called different operations at {op} #{self.seq}")
        calls = {}
        for rank, c, s in zip(self.ranks, ops, seqs):
            calls.setdefault(f"{_NAMES.get(c, hex(c))} (call #{s})", []).append(rank)
        listed = "; ".join(f"ranks {r} called {what}" for what, r in calls.items())
        names = " and ".join(sorted({_NAMES.get(c, hex(c)) for c in ops}))
        raise _agreed(CommunicationError,
                      f"collective operations must be called on every rank in the same order, but {listed}. "
                      f"{names} communicate: call each on every rank (e.g. not under `if rank == 0`)")

    def _raise_problem(self, op: str, problem: BaseException | None, flagged: list[int]) -> None:
        first = self.ranks[flagged[0]]
        box = [None]
        if self.rank == first:
            box = [(_base_class_name(problem), str(problem)) if isinstance(problem, ShardwiseError)
                   else ("ShardwiseError", f"{type(problem).__name__}: {problem}")]
        self._broadcast_object(box, first, op)
        name, text = box[0]
        where = f"rank {first}" if len(flagged) == 1 else f"ranks {[self.ranks[i] for i in flagged]}, first {first}"
        error = _agreed(error_class(name), f"{text} (found on {where}, raised on every rank)")
        if problem is not None:
            raise error from problem
        raise error

    def _check_fingerprint(self, op: str, codes: list[int], fingerprint: Fingerprint) -> None:
        column = dict(zip(self.ranks, codes))
        groups = fingerprint.peers if fingerprint.peers is not None else [self.ranks]
        bad = next((list(g) for g in groups if len({column[r] for r in g}) > 1), None)
        if bad is None:
            return
        gathered: list[Any] = [None] * self.size
        self._gather_object(gathered, fingerprint.describe(), op)
        by_rank = dict(zip(self.ranks, gathered))
        reference = bad[0]
        differing = [r for r in bad if column[r] != column[reference]]
        ours, theirs = by_rank[reference], by_rank[differing[0]]
        at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        first = ours[at] if at < len(ours) else "(nothing more)"
        second = theirs[at] if at < len(theirs) else "(nothing more)"
        raise _agreed(fingerprint.error,
                      f"ranks {bad} must agree at {op}, but rank {differing[0]} differs from rank {reference}"
                      + (f" (so do ranks {differing[1:]})" if len(differing) > 1 else "")
                      + f": rank {reference} has {first}, rank {differing[0]} has {second}. {fingerprint.hint}")

    # object collectives on the control group, with the same timeout handling ------------------
    def _broadcast_object(self, box: list, src: int, op: str) -> None:
        try:
            dist.broadcast_object_list(box, src=src, group=self.group)
        except RuntimeError as exc:
            self._leave_step(f"{op}: broadcast failed")
            raise CommunicationError(f"rank {self.rank}: {op}: sharing rank {src}'s error failed: {_short(exc)}") from exc

    def gather_objects(self, obj: Any, op: str) -> list:
        """Every rank's picklable `obj`, in rank order (a collective of this control group)."""
        out: list[Any] = [None] * self.size
        self._gather_object(out, obj, op)
        return out

    def _gather_object(self, out: list, obj: Any, op: str) -> None:
        try:
            dist.all_gather_object(out, obj, group=self.group)
        except RuntimeError as exc:
            self._leave_step(f"{op}: gather failed")
            raise CommunicationError(f"rank {self.rank}: {op}: comparing ranks failed: {_short(exc)}") from exc


def _base_class_name(error: ShardwiseError) -> str:
    """The public error class of `error` (agreed errors are dynamic subclasses)."""
    for cls in type(error).__mro__:
        if cls.__module__ == errors.__name__ and cls is not AgreedError:
            return cls.__name__
    return "ShardwiseError"





def world_coordinator(timeout_s: float) -> Coordinator:
    """A coordinator over the default group (which must carry CPU tensors: gloo, or a
    "cpu:gloo,cuda:nccl" default group as `init_distributed` makes)."""
    return Coordinator(control_group(dist.group.WORLD, timeout_s), timeout_s,
                       retires_shared_groups=control_backend() != "fake")


def control_group(group: dist.ProcessGroup, timeout_s: float) -> dist.ProcessGroup:
    """`group` itself when it carries CPU tensors, else a CPU group of the same ranks (made once
    per process and timeout: `shared_groups`)."""
    backend = str(dist.get_backend(group))
    if "gloo" in backend or backend == "fake":
        return group
    return shared_group(dist.get_process_group_ranks(group), "control", timedelta(seconds=timeout_s),
                        control_backend())


def control_backend() -> str:
    """The backend of the CPU groups ranks agree over: gloo, or in torch's fake world (one
    process standing for every rank, to plan and measure memory) the fake backend itself."""
    return "fake" if dist.get_backend() == "fake" else "gloo"
