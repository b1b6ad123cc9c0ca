"""`ParallelConfig`: how many ways to split the work along each parallel dimension.

A config is checked twice: its own fields when it is built (types and ranges), and against
the world size when a `Topology` resolves it (`resolve`). Both checks are pure functions of
the config and the world size, so every rank raises the same `ConfigError` before any
collective is issued.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch.distributed.pipelining import (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble)

from .errors import ConfigError


@dataclass(frozen=True)
class PipelineSchedule:
    """A pipeline schedule by name: torch's class that orders it, and whether each rank runs
    several (virtual) stages."""

    name: str
    torch_class: type
    interleaved: bool


# The one list of schedules: config validation, stage layout, the pipeline and the CLI read it.
SCHEDULES = {s.name: s for s in (PipelineSchedule("gpipe", ScheduleGPipe, False),
                                 PipelineSchedule("1f1b", Schedule1F1B, False),
                                 PipelineSchedule("interleaved-1f1b", ScheduleInterleaved1F1B, True),
                                 PipelineSchedule("zero-bubble", ScheduleInterleavedZeroBubble, True))}
ZERO_STAGES = (0, 1, 2, 3)
RECOMPUTE = (None, "full", "selective", "selective-alternate")
# Compute dtypes with float32 master weights, and dtypes gradients are reduced in.
PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
REDUCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_TIMEOUT_S = 24 * 3600.0


def divisors(n: int) -> list[int]:
    """The positive divisors of `n`, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def _finite_positive(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


# why recompute and torch's zero-bubble schedule are refused together (config and plan recompute alike)
ZERO_BUBBLE_RECOMPUTE = ("torch's zero-bubble schedule runs a stage's backward as two passes (input gradients, then "
                         "weight gradients), and torch's activation checkpoint can recompute a block for one pass "
                         "only (the second dies inside torch); use schedule='interleaved-1f1b' with recompute, or "
                         "zero-bubble without it")


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} is not a positive integer; set {name} to 1 or more")


@dataclass(frozen=True)
class ParallelConfig:
    """Degrees of each parallel dimension plus the knobs of the executors.

    dp: data-parallel replicas; None means world_size // (tp * pp * cp).
    tp, pp, cp: tensor, pipeline and context parallel degrees.
    ep: expert parallel degree: each mixture-of-experts layer's experts split over `ep`
        data-parallel ranks (taken from dp, which it must divide), tokens sent to them by
        all-to-all (parallel/expert/).
    zero: 0 none, 1 shard optimizer state, 2 + gradients, 3 + parameters.
    microbatches: per `train_step` (gradient accumulation / pipeline microbatches).
    schedule: pipeline schedule name, one of SCHEDULES.
    sequence_parallel: shard norms and dropout along the sequence inside tp groups.
    bucket_mb: capacity of one gradient-synchronization bucket in MiB.
    timeout_s: seconds after which a collective fails instead of waiting on a dead peer.
    check_every: `train_step` checks, every this many steps (and on the first), that every
        rank is in the same operation and that peers given the same batch (tp, cp, pp) were;
        other steps only combine the replicas' sample counts.
    param_dtype: compute and parameter dtype (e.g. torch.bfloat16); the optimizer then keeps
        float32 master weights. None: leave the module as it is.
    reduce_dtype: dtype gradients are accumulated and reduced in; None: param_dtype.
    recompute: None, "full", "selective" or "selective-alternate": activations of each block
        of the model's layer list (or of the plan's `recompute` modules) rebuilt in backward
        instead of kept (parallel/recompute.py says which each keeps).
    sequence_dim: the dimension of the batch tensors that indexes tokens, along which
        context parallelism (cp > 1) splits them.
    broadcast_buffers: after each train_step (and training-mode infer_step; before each plain
        forward, as DDP), every replica's buffers (BatchNorm running statistics) become
        data-parallel rank 0's.
    sync_batchnorm: BatchNorm layers take their training statistics over the whole
        data-parallel batch (torch.nn.SyncBatchNorm's semantics, on any device).
    """

    dp: int | None = None
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    microbatches: int = 1
    schedule: str = "1f1b"
    sequence_parallel: bool = False
    bucket_mb: float = 25.0
    timeout_s: float = 180.0
    check_every: int = 1
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    recompute: str | None = None
    sequence_dim: int = 1
    broadcast_buffers: bool = True
    sync_batchnorm: bool = False

    def __post_init__(self) -> None:
        if self.dp is not None:
            _check_positive_int("dp", self.dp)
        for name in ("tp", "pp", "cp", "ep", "microbatches", "check_every"):
            _check_positive_int(name, getattr(self, name))
        if isinstance(self.zero, bool) or not isinstance(self.zero, int) or self.zero not in ZERO_STAGES:
            raise ConfigError(f"zero={self.zero!r} is not a ZeRO stage; use one of the integers {ZERO_STAGES}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(
                f"schedule={self.schedule!r} is unknown; use one of {', '.join(map(repr, SCHEDULES))}"
            )
        if self.recompute not in RECOMPUTE:
            raise ConfigError(f"recompute={self.recompute!r} is not a recompute mode; use None, 'full' (keep only "
                              "each block's input), 'selective' (keep matmul and attention outputs) or "
                              "'selective-alternate' (those but every second weight matmul's, torchtitan's op-level "
                              "policy)")
        if isinstance(self.sequence_dim, bool) or not isinstance(self.sequence_dim, int) or self.sequence_dim < 1:
            raise ConfigError(f"sequence_dim={self.sequence_dim!r} must be the batch tensors' token dimension, an "
                              "integer >= 1 (dim 0 is the batch)")
        for name in ("sequence_parallel", "broadcast_buffers", "sync_batchnorm"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r} must be True or False")
        if self.sync_batchnorm and self.cp > 1:
            raise ConfigError("sync_batchnorm=True takes BatchNorm statistics over the data-parallel batch, and cp > 1 "
                              "splits each sample's tokens over ranks too: use cp=1 with BatchNorm models")
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("sequence_parallel=True shards activations over tensor-parallel ranks, and tp=1 has "
                              "none to shard over: set tp > 1 or sequence_parallel=False")
        if self.recompute is not None and self.splits_backward:
            raise ConfigError(f"recompute={self.recompute!r} with schedule='zero-bubble' and pp > 1: "
                              + ZERO_BUBBLE_RECOMPUTE)
        if self.zero == 3 and self.splits_backward:
            raise ConfigError("zero=3 with schedule='zero-bubble' and pp > 1: the zero-bubble schedule computes a "
                              "stage's weight gradients after its input gradients, when ZeRO-3 has released the "
                              "whole parameters their backward reads; use zero=2 (gradients and optimizer states "
                              "sharded, parameters whole) or schedule='interleaved-1f1b'")
        if not _finite_positive(self.bucket_mb):
            raise ConfigError(f"bucket_mb={self.bucket_mb!r} must be a positive number of MiB, finite, e.g. 25")
        if not _finite_positive(self.timeout_s) or self.timeout_s > MAX_TIMEOUT_S:
            raise ConfigError(f"timeout_s={self.timeout_s!r} must be a positive number of seconds up to "
                              f"{MAX_TIMEOUT_S:g} (a day), e.g. 180")
        for name, allowed in (("param_dtype", PARAM_DTYPES), ("reduce_dtype", REDUCE_DTYPES)):
            value = getattr(self, name)
            if value is not None and value not in allowed:
                names = ", ".join(str(d) for d in allowed)
                raise ConfigError(f"{name}={value!r} is not supported; use one of {names} or None "
                                  "(optimizer master weights are float32)")

    @property
    def splits_backward(self) -> bool:
        """Whether a stage's backward runs as two passes, input gradients then weight gradients:
        torch's zero-bubble schedule over more than one pipeline rank."""
        return self.pp > 1 and self.schedule == "zero-bubble"

    @property
    def model_parallel_size(self) -> int:
        """Ranks that hold one replica of the model: tp * cp * pp."""
        return self.tp * self.cp * self.pp

    def resolve(self, world_size: int) -> "ParallelConfig":
        """This config with `dp` filled in, after checking every degree against `world_size`."""
        _check_positive_int("world_size", world_size)
        valid = ", ".join(map(str, divisors(world_size)))
        for name in ("tp", "cp", "pp"):
            value = getattr(self, name)
            if world_size % value:
                raise ConfigError(
                    f"{name}={value} does not divide world size {world_size}; "
                    f"valid {name} values: {valid}"
                )
        mp = self.model_parallel_size
        if world_size % mp:
            raise ConfigError(
                f"tp*cp*pp = {self.tp}*{self.cp}*{self.pp} = {mp} does not divide world size "
                f"{world_size}; choose degrees whose product divides {world_size}"
            )
        dp = world_size // mp
        if self.dp is not None and self.dp != dp:
            raise ConfigError(
                f"dp={self.dp} with tp={self.tp}, cp={self.cp}, pp={self.pp} needs "
                f"{self.dp * mp} ranks but world size is {world_size}; "
                f"set dp={dp} or dp=None to derive it"
            )
        if dp % self.ep:
            raise ConfigError(f"ep={self.ep} does not divide dp={dp}: experts are split over data-parallel ranks "
                              f"(ep of them hold one copy of every expert); use an ep dividing {dp}")
        return dataclasses.replace(self, dp=dp)

    def describe(self) -> str:
        """One line: the degrees and the knobs that differ from their defaults."""
        dp = "auto" if self.dp is None else self.dp
        parts = [f"dp={dp}", f"tp={self.tp}", f"pp={self.pp}", f"cp={self.cp}"] + ([f"ep={self.ep}"] if self.ep > 1 else [])
        defaults = ParallelConfig()
        for field in dataclasses.fields(self):
            if field.name in ("dp", "tp", "pp", "cp", "ep"):
                continue
            value = getattr(self, field.name)
            if value != getattr(defaults, field.name):
                parts.append(f"{field.name}={value!r}")
        return " ".join(parts)
