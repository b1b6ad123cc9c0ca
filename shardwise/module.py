"""`parallelize` and `ParallelModule`: the one front door.

`parallelize` composes the executors in a fixed order, each reading only the Topology and
the Plan: config -> Topology -> Plan -> data parallel. `ParallelModule` is an ordinary
`nn.Module` around the user's module that adds `train_step`, `infer_step`, `no_sync`,
`summary` and full state dicts with the original module's keys.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import torch
from torch import nn

from .batch import loss_of, split_batch, to_device
from .config import ParallelConfig
from .errors import CheckpointError, ConfigError, ModelError
from .parallel.data import MiB, GradientBuckets, apply_data_parallel
from .plan import Plan, as_plan
from .topology import Topology, init_distributed

# Degrees this build's executors run; later layouts lift these limits.
_SUPPORTED = {"tp": 1, "pp": 1, "cp": 1, "zero": 0}


class ParallelModule(nn.Module):
    """A module trained across ranks: the user's module plus the executors applied to it."""

    def __init__(self, module: nn.Module, topology: Topology, plan: Plan, gradients: GradientBuckets):
        super().__init__()
        self.module = module
        self.topology = topology
        self.config = topology.config
        self.plan = plan
        self.gradients = gradients

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's forward; `loss.backward()` then synchronizes gradients."""
        return self.module(*args, **kwargs)

    def train_step(self, batch: Any) -> torch.Tensor:
        """Forward and backward over `config.microbatches` slices of `batch`.

        Gradients are the mean over microbatches and replicas (as for the whole global
        batch on one process); returns the mean loss, detached, the same on every rank.
        Inside `no_sync()` gradients are only accumulated and the loss is this replica's.
        """
        parts = self.config.microbatches
        microbatches = split_batch(to_device(batch, self.topology.device), parts)
        syncing = self.gradients.sync_enabled
        losses = []
        with self.gradients.manual_finish():
            for i, microbatch in enumerate(microbatches):
                last = i == parts - 1
                with contextlib.nullcontext() if last else self.gradients.no_sync():
                    loss = loss_of(self.module(microbatch))
                    losses.append(loss.detach())
                    local_mean = torch.stack(losses).float().mean()
                    if last and syncing:  # averaged over replicas along with the gradients
                        self.gradients.stage_scalars(local_mean)
                    (loss / parts if parts > 1 else loss).backward()
        if not syncing:
            return local_mean
        return self.gradients.finish()[0]

    @torch.no_grad()
    def infer_step(self, batch: Any) -> Any:
        """The module's outputs for `batch`, without gradients."""
        return self.module(to_device(batch, self.topology.device))

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first backward after the block synchronizes."""
        with self.gradients.no_sync():
            yield

    def finish_gradient_sync(self) -> None:
        """Complete any pending gradient synchronization (the optimizer calls this)."""
        self.gradients.finish()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset gradients (to None by default), keeping the gradient buckets consistent."""
        self.gradients.zero_grad(set_to_none)

    # state dicts ---------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """A plain state dict with the original module's keys and full tensors."""
        return self.module.state_dict()

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load a plain state dict (as `full_state_dict` returns) on every rank alike."""
        own = self.module.state_dict()
        missing = sorted(set(own) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(own))
        if strict and (missing or unexpected):
            raise CheckpointError(
                f"state dict does not match {type(self.module).__name__}: missing keys {missing[:8]}, "
                f"unexpected keys {unexpected[:8]}; pass a state dict of the same model or strict=False"
            )
        for key in own.keys() & state_dict.keys():
            if tuple(own[key].shape) != tuple(state_dict[key].shape):
                raise CheckpointError(
                    f"state dict entry {key!r} has shape {tuple(state_dict[key].shape)} "
                    f"but the model's is {tuple(own[key].shape)}"
                )
        self.module.load_state_dict(state_dict, strict=strict)

    # reporting -----------------------------------------------------------------------
    def summary(self) -> str:
        """Layout, per-rank parameter bytes and communication per step, as text."""
        params = list(self.module.parameters())
        numel = sum(p.numel() for p in params)
        nbytes = sum(p.numel() * p.element_size() for p in params)
        dtypes = ", ".join(sorted({str(p.dtype).replace("torch.", "") for p in params}))
        grads = self.gradients
        payload = sum(b.nbytes for b in grads.buckets)
        n = grads.world
        ring = 2 * (n - 1) / n * payload
        lines = [
            f"shardwise.ParallelModule({type(self.module).__name__})",
            f"  layout      {self.topology.describe()}",
            f"  config      {self.config.describe()}",
            f"  plan        {self.plan.name or ('custom' if self.plan.params else 'replicate everything')}",
            f"  parameters  {len(params)} tensors, {numel / 1e6:.3f} M elements, {nbytes / MiB:.2f} MiB on this rank ({dtypes})",
            f"  gradients   " + (f"{len(grads.buckets)} bucket(s) averaged over ranks {self.topology.group_ranks('dp', 'cp')}"
                                 if grads.buckets else "one replica: plain autograd gradients, nothing to average"),
        ]
        lines += [f"              {line}" for line in grads.describe()]
        lines.append(
            f"  comm/step   all-reduce {payload / MiB:.2f} MiB (gradients + unused-mask/loss tail); ring sends "
            f"≈ 2(n-1)/n × payload = {ring / MiB:.2f} MiB per rank" if n > 1 else "  comm/step   none"
        )
        return "\n".join(lines)


class DataParallelInfo(NamedTuple):
    """Which data-parallel replica this rank belongs to, and how many there are."""

    index: int
    count: int


def data_parallel_info(pmodel: ParallelModule) -> DataParallelInfo:
    """The replica index and count: feed replica `index` its own 1/`count` of the data."""
    return DataParallelInfo(pmodel.topology.dp_rank, pmodel.topology.sizes["dp"])


def parallelize(
    module: nn.Module,
    config: ParallelConfig | None = None,
    plan: Plan | dict | str | Path | None = None,
    sample: Any = None,
) -> ParallelModule:
    """Turn `module` into a `ParallelModule` laid out as `config` and `plan` say.

    Collective: every rank calls it with the same module architecture, config and plan.
    Replicas start from the first data-parallel rank's parameter values. `sample` (an
    example batch) is used by layouts that need shapes ahead of time.
    """
    if isinstance(module, ParallelModule):
        raise ModelError("module is already a ParallelModule; pass the original module to parallelize")
    if not isinstance(module, nn.Module):
        raise ModelError(f"parallelize needs a torch.nn.Module, got {type(module).__name__}")
    if not any(p.requires_grad for p in module.parameters()):
        raise ModelError(
            f"{type(module).__name__} has no trainable parameters (none, or all requires_grad=False); "
            "shardwise parallelizes training, so give the module at least one parameter that requires grad"
        )
    config = config if config is not None else ParallelConfig()
    if not isinstance(config, ParallelConfig):
        raise ConfigError(f"config must be a sw.ParallelConfig, got {type(config).__name__}")
    for name, limit in _SUPPORTED.items():
        if getattr(config, name) > limit:
            raise ConfigError(f"{name}={getattr(config, name)} is not supported by this version of shardwise; use {name}<={limit}")
    resolved_plan = as_plan(plan)
    init_distributed(timeout=timedelta(seconds=config.timeout_s))
    topology = Topology(config)
    module.to(topology.device)
    gradients = apply_data_parallel(module, topology, topology.config)
    return ParallelModule(module, topology, resolved_plan, gradients)
