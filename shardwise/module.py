"""`parallelize` and `ParallelModule`: the one front door.

`parallelize` composes the executors in a fixed order, each reading only the Topology and
the Plan: config -> Topology -> Plan (resolved against the module) -> tensor parallel ->
data parallel. `ParallelModule` is an ordinary `nn.Module` around the user's module that
adds `train_step`, `infer_step`, `no_sync`, `summary` and full state dicts with the
original module's keys.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from .batch import loss_of, map_tensors, split_batch, to_device
from .comm import broadcast_rng_state
from .config import ParallelConfig
from .deferred import materializer
from .errors import CheckpointError, ConfigError, ModelError, PlanError
from .parallel.collectives import all_gather_single
from .parallel.data import MiB, GradientBuckets, apply_data_parallel
from .parallel.tensor import (TensorParallel, apply_tensor_parallel, is_sharded, local, shard_of,
                              tensor_parallel_rules)
from .plan import Plan, ResolvedPlan, as_plan, resolve_plan
from .topology import Topology, init_distributed

# Degrees this build's executors run; later layouts lift these limits.
_SUPPORTED = {"pp": 1, "cp": 1, "zero": 0}


class ParallelModule(nn.Module):
    """A module trained across ranks: the user's module plus the executors applied to it."""

    def __init__(self, module: nn.Module, topology: Topology, plan: Plan, resolved: ResolvedPlan,
                 tensor_parallel: TensorParallel | None, gradients: GradientBuckets):
        super().__init__()
        self.module = module
        self.topology = topology
        self.config = topology.config
        self.plan = plan
        self.resolved_plan = resolved
        self.tensor_parallel = tensor_parallel
        self.gradients = gradients
        self._replicated_grads_checked = tensor_parallel is None

    # running -------------------------------------------------------------------------
    @contextlib.contextmanager
    def _compute(self) -> Iterator[None]:
        """Around a forward (and its backward): vocab-parallel loss when the plan asks for it."""
        tp = self.tensor_parallel
        with loss_parallel() if tp is not None and tp.loss_parallel else contextlib.nullcontext():
            yield

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.module(*args, **kwargs)
        finally:
            if self.tensor_parallel is not None:
                self.tensor_parallel.end_forward()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's forward; `loss.backward()` then synchronizes gradients.

        With a loss-parallel plan, run the backward inside `pmodel.loss_parallel()` too (train_step does).
        """
        with self._compute():
            return self._run(*args, **kwargs)

    def loss_parallel(self) -> contextlib.AbstractContextManager:
        """The context forward and backward of a loss-parallel plan run in (a no-op otherwise)."""
        return self._compute()

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
                with contextlib.nullcontext() if last else self.gradients.no_sync(), self._compute():
                    loss = loss_of(self._run(microbatch))
                    losses.append(loss.detach())
                    local_mean = torch.stack(losses).float().mean()
                    if last and syncing:  # averaged over replicas along with the gradients
                        self.gradients.stage_scalars(local_mean)
                    (loss / parts if parts > 1 else loss).backward()
        if not syncing:
            return local_mean
        mean = self.gradients.finish()[0]
        self._check_replicated_grads()
        return mean

    @torch.no_grad()
    def infer_step(self, batch: Any) -> Any:
        """The module's outputs for `batch`, without gradients; sharded outputs gathered whole."""
        with self._compute():
            out = self._run(to_device(batch, self.topology.device))
        return map_tensors(out, lambda t: t.full_tensor() if isinstance(t, DTensor) else t)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first backward after the block synchronizes."""
        with self.gradients.no_sync():
            yield

    def finish_gradient_sync(self) -> None:
        """Complete any pending gradient synchronization (the optimizer calls this)."""
        self.gradients.finish()
        self._check_replicated_grads()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset gradients (to None by default), keeping the gradient buckets consistent."""
        self.gradients.zero_grad(set_to_none)

    def _check_replicated_grads(self) -> None:
        """Once, after the first synchronized step: replicated parameters must have the same
        gradient on every tp rank. One that does not runs on sharded activations without the
        plan saying so, and would silently drift apart; name it instead."""
        if self._replicated_grads_checked:
            return
        self._replicated_grads_checked = True
        tp = self.tensor_parallel
        named = [(n, p) for n, p in self.module.named_parameters()
                 if p.grad is not None and not is_sharded(p) and id(p) not in tp.partial_grad_params]
        if not named:
            return
        mine = torch.stack([local(p.grad).detach().float().abs().sum() for _, p in named])
        gathered = funcol.wait_tensor(all_gather_single(mine, 0, tp.group)).view(tp.size, len(named))
        spread = (gathered.max(0).values - gathered.min(0).values) / gathered.abs().max(0).values.clamp_min(1e-30)
        bad = [name for (name, _), s in zip(named, spread.tolist()) if s > 1e-3]
        if bad:
            raise PlanError(
                f"replicated parameters {bad[:6]} have different gradients on different tp ranks: their modules run "
                "on sharded activations. Declare that in the plan (e.g. '<module>.input': [[Shard(1)]] for a norm "
                "under sequence parallelism) so their partial gradients are summed over tp"
            )

    # state dicts ---------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """A plain state dict with the original module's keys and full tensors.

        Collective when parameters are sharded: every rank must call it.
        """
        return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in self.module.state_dict().items()}

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load a plain state dict (as `full_state_dict` returns): each rank keeps its shards."""
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
        for key in own.keys() & state_dict.keys():
            target, value = own[key], state_dict[key]
            if isinstance(target, DTensor):
                mesh = target.device_mesh
                value = shard_of(value, target.placements[0], mesh.get_local_rank(), mesh.size())
            local(target).copy_(value)

    # reporting -----------------------------------------------------------------------
    def summary(self) -> str:
        """Layout, per-rank parameter bytes and communication per step, as text."""
        params = list(self.module.parameters())
        shards = [local(p) for p in params]
        numel = sum(t.numel() for t in shards)
        nbytes = sum(t.numel() * t.element_size() for t in shards)
        full = sum(p.numel() * p.element_size() for p in params)
        dtypes = ", ".join(sorted({str(p.dtype).replace("torch.", "") for p in params}))
        grads = self.gradients
        lines = [
            f"shardwise.ParallelModule({type(self.module).__name__})",
            f"  layout      {self.topology.describe()}",
            f"  config      {self.config.describe()}",
            f"  plan        {self.plan.name or ('custom' if self.plan.params else 'replicate everything')}",
            f"  parameters  {len(params)} tensors, {numel / 1e6:.3f} M elements, {nbytes / MiB:.2f} MiB on this rank "
            f"of {full / MiB:.2f} MiB ({dtypes})",
        ]
        tp = self.tensor_parallel
        if tp is not None:
            kinds: dict[str, int] = {}
            for rule in tp.sharded_modules.values():
                kinds[rule] = kinds.get(rule, 0) + 1
            lines.append(
                f"  tensor par. {len(tp.sharded_modules)} modules over tp ranks {self.topology.group_ranks('tp')}: "
                + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
                + (f"; {len(tp.partial_grad_params)} replicated params with partial grads (summed over tp)"
                   if tp.partial_grad_params else "")
                + ("; loss-parallel head" if tp.loss_parallel else "")
            )
        if grads.buckets:
            payload = sum(b.nbytes for b in grads.buckets)
            lines.append(f"  gradients   {len(grads.buckets)} bucket(s), all-reduced {payload / MiB:.2f} MiB per step")
            lines += [f"              {line}" for line in grads.describe()]
        else:
            lines.append("  gradients   one replica: plain autograd gradients, nothing to average")
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
    Replicas start from the first data-parallel rank's parameter values. `plan` is a
    `Plan`, a dict (also veScale's form), a zoo name (`sw.plan.zoo`), a .json path, or
    None (replicate everything). `sample` (an example batch) is used by layouts that need
    shapes ahead of time.
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
    chosen = as_plan(plan, config)
    resolved = resolve_plan(chosen, module, config.tp)  # all plan errors before any collective
    if config.tp > 1:
        tensor_parallel_rules(module, resolved)
    init_distributed(timeout=timedelta(seconds=config.timeout_s))
    topology = Topology(config)

    materialize = materializer(module, resolved, topology)  # deferred init: each rank's shards only
    tensor_parallel = None
    if topology.sizes["tp"] > 1:
        broadcast_rng_state(topology.group("tp"), topology.device)  # random ops agree inside a replica
        tensor_parallel = apply_tensor_parallel(module, topology, resolved, materialize)
    module.to(topology.device)
    gradients = apply_data_parallel(module, topology, topology.config, tensor_parallel)
    return ParallelModule(module, topology, chosen, resolved, tensor_parallel, gradients)
