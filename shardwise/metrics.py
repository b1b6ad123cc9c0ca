"""What a training step did and how fast: tokens/s, MFU, the time split, memory.

`pmodel.train_step(batch, metrics=True)` returns a `StepOutput` whose `metrics` is this
step's `StepMetrics`; `pmodel.metrics.log_to(logger, every=N)` measures every step and hands
each to the loggers (loggers.py) on the ranks it names. Off by default: a step measured costs
a few clock reads, and nothing at all is measured unless asked.

How each number is measured (no device synchronization unless `sync = True`, which makes the
step's times those of the device's work, not of its queueing):
- the step's time: from train_step's start to its end, plus the optimizer step that follows
  (`optimizer_s`, filled in when it ends: until then `optimizer_s` is None);
- exposed communication: the time this rank's host was blocked in the collective waits
  shardwise polls (agreements, gradient buckets, ZeRO gathers and scatters). Tensor-parallel
  collectives inside the forward run in line with compute and count as compute;
- pipeline bubble: the time the schedule's receives blocked (our executor's schedules);
  compute is the rest of train_step. On a GPU a collective's wait only orders the device's
  streams and returns at once, so there these three are None rather than a number that means
  something else (torch.profiler's trace shows them);
- FLOPs: what this rank executed in the step's forward and backward, counted by torch's
  `FlopCounterMode` on the second step of each batch shape (that step runs under the counter,
  slower; its FLOPs stand for every later step of that shape). The first step of a shape may
  do one-time work (a pipeline stage's capture runs its forward once more), so its FLOPs and
  MFU are None. With recompute the counted forward runs twice (hardware FLOPs, not model
  FLOPs); kernels torch's table does not know (CPU's fused attention) are not counted;
- MFU: FLOPs / (step time x the device's peak), the peak from `peak_flops` or the planner's
  device table for the CUDA device's name; None where neither knows the device;
- the slowest rank: on steps a logger takes, every rank's step time is all-gathered (one
  small collective on the control group) and the longest named;
- peak memory: the CUDA allocator's peak since the step began; on CPU the process's peak
  resident set so far (the operating system keeps no per-step peak).
"""

from __future__ import annotations

import contextlib
import math
import resource
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import torch

from .batch import leaves as batch_leaves
from .errors import ConfigError

if TYPE_CHECKING:
    from .loggers import MetricsLogger
    from .module import ParallelModule


@dataclass
class StepMetrics:
    """One training step, as `train_step(..., metrics=True).metrics` and the loggers see it."""

    step: int
    loss: Any  # the step's loss (a 0-dim tensor: read when logged, so no device sync in the step)
    samples: int  # this replica's
    tokens: int  # this replica's (count_tokens: the input ids the model reads)
    global_tokens: int  # every replica's
    ranks_per_replica: int
    train_step_s: float
    optimizer_s: float | None = None
    communication_s: float | None = None
    bubble_s: float | None = None
    flops: float | None = None  # this rank's, forward and backward
    peak_flops: float | None = None  # this rank's device
    peak_memory_bytes: int | None = None
    grad_norm: Any = None  # clip_grad_norm's result, when it ran (a 0-dim tensor)
    loss_scale: float | None = None
    slowest_rank: int | None = None  # on logged steps: the rank whose step took longest, and how long
    slowest_step_s: float | None = None

    @property
    def step_s(self) -> float:
        return self.train_step_s + (self.optimizer_s or 0.0)

    @property
    def compute_s(self) -> float | None:
        if self.communication_s is None:
            return None
        return max(0.0, self.train_step_s - self.communication_s - (self.bubble_s or 0.0))

    @property
    def tokens_per_s(self) -> float:
        """Per rank: the replica's tokens over its ranks (torchtitan's tokens/s per device)."""
        return self.tokens / self.ranks_per_replica / self.step_s

    @property
    def global_tokens_per_s(self) -> float:
        return self.global_tokens / self.step_s

    @property
    def mfu(self) -> float | None:
        if self.flops is None or not self.peak_flops:
            return None
        return self.flops / (self.step_s * self.peak_flops)

    def as_dict(self) -> dict[str, Any]:
        """Every field and derived number, for loggers (None where not measured)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}  # (asdict deep-copies: a tensor copy per step)
        for name in ("loss", "grad_norm"):
            out[name] = None if out[name] is None else float(out[name])
        for name in ("step_s", "compute_s", "tokens_per_s", "global_tokens_per_s", "mfu"):
            out[name] = getattr(self, name)
        return out


def count_tokens(module: Any, batch: Any) -> int:
    """A batch's tokens: what the module's own `count_tokens(batch)` says if it has one, else
    its `input_ids` elements, else those of its first integer tensor of two or more dims (token
    ids), else its sample count (one token per sample: non-sequence data)."""
    own = getattr(module, "count_tokens", None)
    if callable(own):
        return int(own(batch))
    if isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), torch.Tensor):
        return batch["input_ids"].numel()
    leaves = [t for _, t in batch_leaves(batch) if isinstance(t, torch.Tensor)]
    ids = next((t for t in leaves if not t.is_floating_point() and t.dim() >= 2), None)
    if ids is not None:
        return ids.numel()
    return int(leaves[0].shape[0]) if leaves and leaves[0].dim() else 0


def device_peak_flops(device: torch.device) -> float | None:
    """The planner's dense peak for this CUDA device (by name: H100, H200, A100, B200)."""
    if device.type != "cuda":
        return None
    from .planner.cluster import DEVICES

    name = torch.cuda.get_device_name(device).lower()
    return next((spec.peak_flops for key, spec in DEVICES.items() if key != "local" and key in name), None)


def _shape_key(batch: Any) -> tuple:
    return tuple((tuple(t.shape), t.dtype) for _, t in batch_leaves(batch) if isinstance(t, torch.Tensor))


def peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


@dataclass
class _Sink:
    logger: "MetricsLogger"
    every: int
    ranks: Sequence[int] | None


@dataclass
class MetricsRecorder:
    """`pmodel.metrics`: measures the steps asked for and hands them to the loggers."""

    pmodel: "ParallelModule"
    peak_flops: float | None = None
    sync: bool = False
    last: StepMetrics | None = None
    _sinks: list[_Sink] = field(default_factory=list)
    _flops: dict[tuple, float | None] = field(default_factory=dict)  # batch shapes -> this rank's FLOPs
    _open: StepMetrics | None = None  # the last step, until its optimizer step ends

    def log_to(self, logger: "MetricsLogger", every: int = 1, ranks: Sequence[int] | None = (0,)) -> None:
        """Measure every step from now on and give every `every`-th to `logger` on `ranks`
        (global ranks; None: every rank), which open it here. Collective: a logger that cannot
        open on one rank is the same error on every rank, and nothing changes."""
        problem, logging_here = None, False
        try:
            if not isinstance(every, int) or isinstance(every, bool) or every < 1:
                raise ConfigError(f"log_to(every={every!r}): a positive whole number of steps")
            if ranks is not None and (isinstance(ranks, (str, bytes)) or not all(
                    isinstance(r, int) and 0 <= r < self.pmodel.topology.world_size for r in ranks)):
                raise ConfigError(f"log_to(ranks={ranks!r}): global ranks below the world size "
                                  f"{self.pmodel.topology.world_size}, or None for every rank")
            logging_here = ranks is None or self.pmodel.topology.rank in ranks
            if logging_here and callable(getattr(logger, "open", None)):
                logger.open()
        except ConfigError as exc:
            problem = exc
        except Exception as exc:  # a user's logger: its own failure, named
            problem = ConfigError(f"log_to: {type(logger).__name__}.open() raised {type(exc).__name__}: {exc}")
            problem.__cause__ = exc
        try:
            if self.pmodel.topology.world_size > 1:
                self.pmodel.coordinator.agree("metrics.log_to", problem)
            elif problem is not None:
                raise problem
        except ConfigError:
            if logging_here and problem is None:  # opened here, refused elsewhere
                logger.close()
            raise
        self._sinks.append(_Sink(logger, every, None if ranks is None else list(ranks)))

    @property
    def wanted(self) -> bool:
        return bool(self._sinks)

    def close(self) -> None:
        """Write the step still open (without comparing ranks: close may run on one rank) and
        close the loggers."""
        self._publish(compare=False)
        for sink in self._sinks:
            sink.logger.close()

    # inside train_step -------------------------------------------------------------------
    @contextlib.contextmanager
    def measure(self, batch: Any) -> Iterator["_Measurement"]:
        """Around train_step's body: times it and counts its FLOPs on a new batch shape."""
        self._publish()
        if self.peak_flops is not None and not (isinstance(self.peak_flops, (int, float)) and 0 < self.peak_flops < math.inf):
            raise ConfigError(f"pmodel.metrics.peak_flops={self.peak_flops!r}: the device's peak FLOP/s, a positive "
                              "number (e.g. 989e12 for an H100's dense bf16), or None for the device table's")
        device = self.pmodel.topology.device
        host_waits = device.type == "cpu"  # a GPU collective's wait only orders streams
        if device.type == "cuda":
            if self.sync:
                torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        coordinator, pipeline = self.pmodel.coordinator, self.pmodel.pipeline
        stats = getattr(pipeline, "stats", None)
        waited, bubble = coordinator.waited_s, getattr(stats, "waiting_s", None)
        key = _shape_key(batch)
        counter = None
        if key in self._flops and self._flops[key] is None:  # the shape's second step
            from torch.utils.flop_counter import FlopCounterMode

            counter = FlopCounterMode(display=False)
        measurement = _Measurement()
        start = time.perf_counter()
        with counter if counter is not None else contextlib.nullcontext():
            yield measurement
        if self.sync and device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        self._flops[key] = float(counter.get_total_flops()) if counter is not None else self._flops.get(key)
        pm = self.pmodel
        samples = measurement.samples
        tokens = count_tokens(pm.module, batch)
        replicas = pm.topology.size("dp")
        total_samples = measurement.total_samples or samples * replicas
        global_tokens = round(tokens * total_samples / samples) if samples else tokens * replicas
        self._open = StepMetrics(
            step=pm.steps, loss=measurement.loss, samples=samples, tokens=tokens, global_tokens=global_tokens,
            ranks_per_replica=pm.topology.world_size // replicas, train_step_s=elapsed,
            communication_s=coordinator.waited_s - waited if host_waits else None,
            bubble_s=_since(getattr(stats, "waiting_s", None), bubble) if host_waits else None,
            flops=self._flops[key], peak_flops=self.peak_flops or device_peak_flops(device),
            peak_memory_bytes=peak_memory(device),
            loss_scale=pm.loss_scaler.scale if pm.loss_scaler is not None else None)
        self.last = self._open
        measurement.metrics = self._open

    # around the optimizer ----------------------------------------------------------------
    @contextlib.contextmanager
    def optimizer_step(self) -> Iterator[None]:
        """Around the optimizer step after a measured train_step: its time closes the step."""
        if self._open is None:
            yield
            return
        device = self.pmodel.topology.device
        start = time.perf_counter()
        yield
        if self.sync and device.type == "cuda":
            torch.cuda.synchronize(device)
        if self._open is not None:
            self._open.optimizer_s = time.perf_counter() - start
            self._publish()

    def grad_norm(self, norm: torch.Tensor) -> None:
        if self._open is not None and self._open.grad_norm is None:
            self._open.grad_norm = norm.detach()

    def _publish(self, compare: bool = True) -> None:
        step, self._open = self._open, None
        if step is None:
            return
        rank = self.pmodel.topology.rank
        logged = any(step.step % sink.every == 0 for sink in self._sinks)  # the same sinks on every rank
        if compare and logged and self.pmodel.topology.world_size > 1:
            self._compare_ranks(step)
        for sink in self._sinks:
            if step.step % sink.every == 0 and (sink.ranks is None or rank in sink.ranks):
                sink.logger.log(step.as_dict(), step.step)


    def _compare_ranks(self, step: StepMetrics) -> None:
        """The slowest rank's step time: one small all-gather on the control group, on logged
        steps only (every rank publishes a step at the same point: its optimizer step's end)."""
        from .compat import all_gather_single

        coordinator = self.pmodel.coordinator
        mine = torch.tensor([step.step_s], dtype=torch.float64)
        every = torch.empty(coordinator.size, dtype=torch.float64)
        coordinator.wait(all_gather_single(every, mine, group=coordinator.group, async_op=True),
                         f"metrics: comparing step {step.step}'s time", coordinator.group)
        slowest = int(every.argmax())
        step.slowest_rank, step.slowest_step_s = coordinator.ranks[slowest], float(every[slowest])


def _since(now: float | None, before: float | None) -> float | None:
    """A running total's growth (None while nothing measures it: torch's pipeline executor)."""
    return None if now is None else now - (before or 0.0)


@dataclass
class _Measurement:
    """What train_step tells the recorder about the step it ran."""

    samples: int = 0
    total_samples: int | None = None
    loss: torch.Tensor | None = None
    metrics: StepMetrics | None = None
