"""`parallelize` and `ParallelModule`: the one front door.

`parallelize` composes the executors in a fixed order, each reading only the Topology and
the Plan: config -> Plan (resolved against the module) -> pipeline stage layout ->
Topology -> prune to this rank's stages -> materialize (deferred init) -> tensor parallel
-> pipeline schedule -> mixed precision -> data parallel / ZeRO -> master weights.
`ParallelModule` is an ordinary `nn.Module` around the user's module that adds
`train_step`, `infer_step`, `no_sync`, `summary` and full state dicts with the original
module's keys.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from .activations import activation_memory
from .batch import batch_signature, batch_size, loss_of, map_tensors, split_batch, to_device
from .comm import broadcast_rng_state, broadcast_tensors
from .config import ParallelConfig
from .coordination import Fingerprint, fingerprint_of, world_coordinator
from .deferred import check_materializable, is_deferred, materializer
from .errors import BatchError, CheckpointError, ConfigError, ModelError, PlanError, ShardwiseError
from .parallel.collectives import all_gather_single
from .parallel.data import MiB, GradientBuckets, apply_data_parallel
from .parallel.fsdp import ParameterShards
from .parallel.zero import MasterWeights
from .parallel.tensor import TensorParallel, apply_tensor_parallel, tensor_parallel_rules
from .tensors import is_sharded, local, shard_of
from .parallel.pipeline import GradientSync, Pipeline, prune_to_stages, tied_across_ranks
from .parallel.recompute import apply_recompute, recompute_targets
from .parallel.stage_program import capture_module, split
from .plan import Plan, ResolvedPlan, as_plan, resolve_plan
from .plan.stages import INTERLEAVED, StageLayout, candidate_units, layout_stages
from .topology import Topology, init_distributed

# Degrees this build's executors run; later layouts lift these limits.
_SUPPORTED = {"cp": 1}


class ParallelModule(nn.Module):
    """A module trained across ranks: the user's module plus the executors applied to it."""

    def __init__(self, module: nn.Module, topology: Topology, plan: Plan, resolved: ResolvedPlan):
        super().__init__()
        self.module = module
        self.topology = topology
        self.config = topology.config
        self.plan = plan
        self.resolved_plan = resolved
        # the executors, attached by parallelize in its order
        self.tensor_parallel: TensorParallel | None = None
        self.pipeline: Pipeline | None = None
        self.gradients: GradientBuckets | None = None
        self.param_shards: ParameterShards | None = None  # ZeRO-3
        self.masters: MasterWeights | None = None
        self.recomputed: list[str] = []  # modules whose activations are rebuilt in backward
        self._optimizers: list = []  # those built by sw.build_optimizer, for memory reports
        self.steps = 0  # train_step calls, saved in checkpoints
        self._forwards = 0  # plain forward calls (checked like train_step every config.check_every)
        self._calls: dict[str, int] = {}  # calls of other per-step collective methods, for the same
        # the whole model, as one process would hold it (pipeline ranks prune theirs):
        self._param_names = [n for n, _ in module.named_parameters()]
        self._aliases: dict[str, str] = {n: n for n in self._param_names}  # tied names -> first name
        self._state_shapes: dict[str, tuple[int, ...]] = {}
        self._state_layout: dict[str, tuple] | None = None  # key -> (shape, dtype, pipeline stage)
        self._tied: dict[str, list[int]] = {}  # parameter -> pipeline ranks holding it
        self._replicated_grads_checked = False

    # running -------------------------------------------------------------------------
    @contextlib.contextmanager
    def _compute(self) -> Iterator[None]:
        """Around a forward (and its backward): vocab-parallel loss when the plan asks for it."""
        tp = self.tensor_parallel
        with loss_parallel() if tp is not None and tp.loss_parallel else contextlib.nullcontext():
            yield

    def _prepare(self, batch: Any) -> Any:
        """The batch on this rank's device; floating tensors in `param_dtype` under mixed precision."""
        batch = to_device(batch, self.topology.device)
        dtype = self.config.param_dtype
        return batch if dtype is None else map_tensors(batch, lambda t: t.to(dtype) if t.is_floating_point() else t)

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward_pass(lambda: self.module(*args, **kwargs))

    def _forward_pass(self, forward: Callable[[], Any]) -> Any:
        """One forward of the module (or of a pipeline stage): the tensor-parallel executor
        checks the first one and forgets its per-forward state after each."""
        tp = self.tensor_parallel
        try:
            with tp.check_first_forward(self.module) if tp is not None else contextlib.nullcontext():
                return forward()
        finally:
            if tp is not None:
                tp.end_forward()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's forward; `loss.backward()` then synchronizes gradients.

        With a loss-parallel plan, run the backward inside `pmodel.loss_parallel()` too (train_step does).
        With pipeline parallelism use train_step and infer_step: one rank holds only its stages.
        """
        if self.pipeline is not None:
            raise ModelError("with pp > 1 a forward spans ranks: use pmodel.train_step(batch) or pmodel.infer_step(batch)")
        self._forwards += 1
        if self.topology.world_size > 1 and (self._forwards - 1) % self.config.check_every == 0:
            lines = batch_signature((args, kwargs))
            self.coordinator.agree("forward", fingerprints=[Fingerprint(
                fingerprint_of(lines), lambda: lines, BatchError,
                "Ranks of one replica (its tp, cp and pp ranks) must call the module with the same inputs",
                peers=self.topology.peer_groups("pp", "cp", "tp"))])
        with self._in_step("forward"), self._compute():
            return self._run(*args, **kwargs)

    def loss_parallel(self) -> contextlib.AbstractContextManager:
        """The context forward and backward of a loss-parallel plan run in (a no-op otherwise)."""
        return self._compute()

    @property
    def coordinator(self):
        """Agreement between this topology's ranks before each collective operation."""
        return self.topology.coordinator

    def _agree_on_batch(self, op: str, batch: Any, parts: int, check: bool) -> tuple[Any, list[Any], float]:
        """Validate and split `batch`, agree with every rank, and return it (on this rank's
        device), its microbatches and this replica's weight relative to an equal share
        (n_replica * dp / n_global).

        On check steps every rank gathers every rank's operation, problem and sample count,
        and peers that must hold the same batch (tp, cp, pp) compare its fingerprint; on
        other steps only the data-parallel ranks combine their sample counts."""
        problem, microbatches, samples = None, [], 0
        try:
            batch = self._prepare(batch)
            microbatches = split_batch(batch, parts)
            samples = batch_size(batch)
        except ShardwiseError as exc:
            problem = exc
        topology = self.topology
        if topology.world_size == 1:
            if problem is not None:
                raise problem
            return batch, microbatches, 1.0
        replicas = topology.ranks_at(["dp"], pp=0, cp=0, tp=0)  # one rank per replica
        if check:
            lines = batch_signature(batch) if problem is None else ["(a batch this rank refused)"]
            agreement = self.coordinator.agree(op, problem, value=samples, fingerprints=[Fingerprint(
                fingerprint_of(lines), lambda: lines, BatchError,
                "Ranks of one replica (its tp, cp and pp ranks) must be given the same batch: slice the data by "
                "sw.data_parallel_info(pmodel), not by global rank", peers=topology.peer_groups("pp", "cp", "tp"))])
            total = sum(agreement.values()[r] for r in replicas)
        else:
            if problem is not None:
                raise problem
            total = samples * len(replicas)
            if len(replicas) > 1:
                counted = torch.tensor([samples], dtype=torch.float64, device=topology.device)
                dp = topology.group("dp")
                self.coordinator.wait(dist.all_reduce(counted, group=dp, async_op=True), f"{op}: sample counts", dp)
                total = int(counted.item())
        return batch, microbatches, samples * len(replicas) / total  # exactly 1.0 when replicas are equal

    def _checking(self) -> bool:
        return (self.steps - 1) % self.config.check_every == 0

    @contextlib.contextmanager
    def collective(self, op: str, communicates: bool = True) -> Iterator[Callable[[], None]]:
        """Around a method called once per step that may communicate (optimizer.step,
        clip_grad_norm): agreed on the first call and every `config.check_every` calls, as
        train_step is. Yields `ready()`, to call before the method's first collective: the
        ranks' records are gathered while it does its local work."""
        calls = self._calls[op] = self._calls.get(op, 0) + 1
        pending = None
        if communicates and self.topology.world_size > 1 and (calls - 1) % self.config.check_every == 0:
            pending = self.coordinator.begin(op)
        ready = pending.result if pending is not None else (lambda: None)
        with self._in_step(op):
            yield ready
            ready()

    def train_step(self, batch: Any) -> torch.Tensor:
        """Forward and backward over `config.microbatches` slices of `batch`.

        Gradients are the mean over microbatches and replicas weighted by their sample
        counts (exactly as one process computes them on the replicas' batches concatenated);
        returns the mean loss, detached, the same on every rank. Inside `no_sync()`
        gradients are only accumulated and the loss is this replica's.
        """
        self.steps += 1
        if self.config.zero and not self._optimizers and self.steps == 1:
            warnings.warn(f"zero={self.config.zero}: gradients live in the optimizer's shards, so only an optimizer built "
                          "with sw.build_optimizer(pmodel, ...) sees them; a plain torch optimizer would not update "
                          "anything", stacklevel=2)
        parts = self.config.microbatches
        batch, microbatches, weight = self._agree_on_batch("train_step", batch, parts, self._checking())
        with self._in_step("train_step"):
            if self.pipeline is not None:
                return self._pipeline_train_step(batch, weight)
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
                            self.gradients.replica_weight = weight
                            self.gradients.stage_scalars(local_mean * weight)
                        (loss / parts if parts > 1 else loss).backward()
            if not syncing:
                return local_mean
            mean = self.gradients.finish()[0]
            self._after_sync()
            return mean

    @contextlib.contextmanager
    def _in_step(self, op: str) -> Iterator[None]:
        """The body of an agreed operation: an exception escaping it on this rank alone puts
        this rank out of step (see coordination.py)."""
        with self.coordinator.body(op):
            yield

    def _after_sync(self) -> None:
        if self.param_shards is not None:
            self.param_shards.release_all()
        self._check_replicated_grads()

    def _pipeline_train_step(self, batch: Any, weight: float) -> torch.Tensor:
        syncing = self.gradients.sync_enabled
        self.gradients.replica_weight = weight
        # accumulated over the microbatches; each stage's last backward reduces as it goes
        with self.gradients.no_sync(), self._compute():
            sync = GradientSync(self.gradients.final_backward, self.gradients.grads_final) if syncing else None
            loss = self.pipeline.train_step(batch, sync)
        if not syncing:
            return loss
        self.gradients.stage_scalars(loss * weight)
        mean = self.gradients.finish()[0]
        self._after_sync()
        return mean

    @torch.no_grad()
    def infer_step(self, batch: Any) -> Any:
        """The module's outputs for `batch`, without gradients, on every rank; sharded outputs
        gathered whole. With pp > 1: the last stage's outputs."""
        batch, _, _ = self._agree_on_batch("infer_step", batch, 1, check=True)
        with self._in_step("infer_step"), self._compute():
            if self.pipeline is not None:
                return self.pipeline.infer_step(batch)
            out = self._run(batch)
            return map_tensors(out, lambda t: t.full_tensor() if isinstance(t, DTensor) else t)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first backward after the block synchronizes."""
        with self.gradients.no_sync():
            yield

    def finish_gradient_sync(self) -> None:
        """Complete any pending gradient synchronization (the optimizer calls this)."""
        with self.collective("finish_gradient_sync", communicates=self.gradients.pending) as ready:
            ready()
            self.gradients.finish()
            self._after_sync()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset gradients (to None by default), keeping the gradient buckets consistent."""
        self.gradients.zero_grad(set_to_none)

    def _check_replicated_grads(self) -> None:
        """Once, after the first synchronized step: replicated parameters must have the same
        gradient on every tp rank. One that does not runs on sharded activations without the
        plan saying so, and would silently drift apart; name it instead."""
        if self._replicated_grads_checked or self.tensor_parallel is None:
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
        """A plain state dict with the original module's keys and full tensors, on every rank.

        Collective: every rank must call it (ranks that do not are named in the error).
        """
        with self.coordinator.operation("full_state_dict"):
            with self._whole():
                own = {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone()
                       for k, v in self.module.state_dict().items()}
            return self._gather_stages(own, list(self._state_layout or own))

    def _whole(self) -> contextlib.AbstractContextManager:
        """Parameters whole inside the block (ZeRO-3 gathers them; otherwise nothing to do)."""
        return self.param_shards.whole() if self.param_shards is not None else contextlib.nullcontext()

    def full_grad_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter's gradient, whole, under its original name, as one process would
        hold it (copies: later steps do not change them); parameters without a gradient are
        absent. Collective, like `full_state_dict`."""
        with self.coordinator.operation("full_grad_dict"):
            reduced = self.gradients.full_grads()  # what the buckets hold: whole (all-gathered under ZeRO)
            own = {}
            for name, param in self.module.named_parameters():
                grad = reduced.get(id(param), None if param.grad is None else local(param.grad))
                if grad is not None:
                    if isinstance(param, DTensor):
                        grad = DTensor.from_local(grad, param.device_mesh, param.placements, run_check=False).full_tensor()
                    own[name] = grad.detach().clone()
            return self._gather_stages(own, [n for n in self._param_names if n in own or self.pipeline is not None])

    def _gather_stages(self, own: dict[str, torch.Tensor], keys: list[str]) -> dict[str, torch.Tensor]:
        """`own` (this rank's entries) completed with every pipeline stage's, in `keys` order."""
        if self.pipeline is None:
            return {k: own[k] for k in keys}
        found: dict[str, torch.Tensor] = {}
        for stage in range(self.pipeline.layout.num_stages):  # each stage's owner sends what it has
            owner = self.pipeline.owner(stage)
            mine = [k for k in keys if self._state_layout[k][2] == stage and k in own]
            box = [[(k, tuple(own[k].shape), own[k].dtype) for k in mine]] if owner == self.topology.rank else [None]
            dist.broadcast_object_list(box, src=owner, group=self.pipeline.group)
            tensors = [own[k] if owner == self.topology.rank else torch.empty(shape, dtype=dtype, device=self.topology.device)
                       for k, shape, dtype in box[0]]
            broadcast_tensors(tensors, self.pipeline.group, 64 << 20, src=owner)
            found.update(zip((k for k, _, _ in box[0]), tensors))
        return {k: found[k] for k in keys if k in found}

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load a plain state dict (as `full_state_dict` returns): each rank keeps its shards.

        Collective; every rank checks the dict it was given before anything changes, so a
        dict that does not fit on one rank is the same `CheckpointError` on every rank."""
        own = self.module.state_dict()
        problem = None
        try:
            self._check_state_dict(state_dict, strict)
        except CheckpointError as exc:
            problem = exc
        with self.coordinator.operation("load_full_state_dict", problem):
            self._load_own(own, state_dict)

    def _check_state_dict(self, state_dict: Any, strict: bool) -> None:
        if not isinstance(state_dict, dict) or not all(isinstance(v, torch.Tensor) for v in state_dict.values()):
            raise CheckpointError(f"a state dict maps names to tensors; got {type(state_dict).__name__}")
        expected = self._state_layout or {k: (tuple(v.shape),) for k, v in self.module.state_dict().items()}
        missing = sorted(set(expected) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(expected))
        if strict and (missing or unexpected):
            raise CheckpointError(
                f"state dict does not match {type(self.module).__name__}: missing keys {missing[:8]}, "
                f"unexpected keys {unexpected[:8]}; pass a state dict of the same model or strict=False"
            )
        for key in expected.keys() & state_dict.keys():
            if expected[key][0] != tuple(state_dict[key].shape):
                raise CheckpointError(
                    f"state dict entry {key!r} has shape {tuple(state_dict[key].shape)} "
                    f"but the model's is {expected[key][0]}"
                )

    @torch.no_grad()
    def _load_own(self, own: dict[str, torch.Tensor], state_dict: dict[str, torch.Tensor]) -> None:
        with self._whole():
            for key in own.keys() & state_dict.keys():  # entries of this rank's stages
                target, value = own[key], state_dict[key]
                if isinstance(target, DTensor):
                    mesh = target.device_mesh
                    value = shard_of(value, target.placements[0], mesh.get_local_rank(), mesh.size())
                local(target).copy_(value)
        self.masters.reload()

    # reporting -----------------------------------------------------------------------
    def held_tensors(self) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """This rank's parameter tensors (local shards, ZeRO shards) and gradient tensors
        (local gradients, bucket buffers and shards); None where a bucket has none."""
        buckets = self.gradients.buckets
        params = [local(p) for p in self.module.parameters()] + [getattr(b, "param_shard", None) for b in buckets]
        grads = [local(p.grad) for p in self.module.parameters() if p.grad is not None]
        return params, grads + [b.buffer for b in buckets] + [b.shard for b in buckets]

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds now: parameters, gradients, and the optimizer state (of the
        optimizers built with `sw.build_optimizer`, master weights included)."""
        def storage_bytes(tensors) -> int:
            seen = {}
            for t in tensors:
                if t is not None and t.numel():
                    storage = local(t).untyped_storage()
                    seen[storage.data_ptr()] = storage.nbytes()
            return sum(seen.values())

        params, grads = self.held_tensors()
        state = [v for opt in self._optimizers for s in opt.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor)]
        return {"parameters": storage_bytes(params), "gradients": storage_bytes(grads),
                "optimizer": storage_bytes(state) + self.masters.state_bytes()}

    def summary(self, batch: Any = None) -> str:
        """Layout, per-rank parameter bytes and communication per step, as text; given a
        `batch`, also the activation bytes one microbatch saves for backward (collective then:
        every rank calls it, as sw.activation_memory)."""
        activations = activation_memory(self, batch) if batch is not None else None
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
        if self.pipeline is not None:
            pipe = self.pipeline
            lines.append(f"  pipeline    {pipe.layout.num_stages} stages, schedule {pipe.schedule_name}, "
                         f"{self.config.microbatches} microbatches; this rank runs stage(s) {pipe.stages}")
            lines += [f"              {line}" for line in pipe.layout.describe()]
            if self._tied:
                lines.append(f"              tied across pipeline ranks (gradients summed): {sorted(self._tied)}")
        if grads.buckets:
            payload = sum(b.nbytes for b in grads.buckets)
            lines.append(f"  gradients   {len(grads.buckets)} bucket(s), all-reduced {payload / MiB:.2f} MiB per step")
            lines += [f"              {line}" for line in grads.describe()]
        else:
            lines.append("  gradients   one replica: plain autograd gradients, nothing to average")
        memory = self.memory()
        lines.append("  memory      " + ", ".join(f"{k} {v / MiB:.2f} MiB" for k, v in memory.items())
                     + (f" (ZeRO-{self.config.zero})" if self.config.zero else ""))
        recompute = f"; {len(self.recomputed)} module(s) recomputed ({self.config.recompute or 'full'})" \
            if self.recomputed else ""
        lines.append("  activations " + (activations.describe() if activations is not None
                                         else "summary(batch) measures them") + recompute)
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

    Everything that can be wrong is checked on each rank first; then the ranks agree, so a
    problem found on any rank (a plan file missing on one machine, a different model on
    one rank) is the same error on every rank before any group is created.
    """
    config = config if config is not None else ParallelConfig()
    timeout_s = config.timeout_s if isinstance(config, ParallelConfig) else ParallelConfig.timeout_s
    init_distributed(timeout=timedelta(seconds=timeout_s))
    problem, checked = None, None
    try:
        checked = _check_locally(module, config, plan, sample)
    except ShardwiseError as exc:
        problem = exc
    except Exception as exc:  # noqa: BLE001 - agreed like any problem, so no rank is left waiting
        problem = ShardwiseError(f"parallelize failed before communicating: {type(exc).__name__}: {exc}")
        problem.__cause__ = exc
    lines = _model_signature(module, checked[0], checked[1]) if problem is None else []
    coordinator = world_coordinator(timeout_s)
    coordinator.agree("parallelize", problem, fingerprints=[Fingerprint(
        fingerprint_of(lines), lambda: lines, ModelError,
        "Every rank must build the same model with the same config and plan (same seed-independent "
        "architecture and shapes); check rank-dependent code before sw.parallelize")])
    config, chosen, resolved, pipelined = checked
    if config.zero and dist.get_world_size() // (config.tp * config.pp) == 1:
        config = _without_zero(config)  # dp * cp == 1
    topology = Topology(config)
    with coordinator.body("parallelize"):
        return _build(module, topology, chosen, resolved, pipelined)


def _check_locally(module: nn.Module, config: ParallelConfig, plan: Any, sample: Any):
    """Every check `parallelize` can make without communicating: (config with the plan's ZeRO
    stage, plan, resolved plan, stage layout)."""
    if isinstance(module, ParallelModule):
        raise ModelError("module is already a ParallelModule; pass the original module to parallelize")
    if not isinstance(module, nn.Module):
        raise ModelError(f"parallelize needs a torch.nn.Module, got {type(module).__name__}")
    if not any(p.requires_grad for p in module.parameters()):
        raise ModelError(
            f"{type(module).__name__} has no trainable parameters (none, or all requires_grad=False); "
            "shardwise parallelizes training, so give the module at least one parameter that requires grad"
        )
    if not isinstance(config, ParallelConfig):
        raise ConfigError(f"config must be a sw.ParallelConfig, got {type(config).__name__}")
    for name, limit in _SUPPORTED.items():
        if getattr(config, name) > limit:
            raise ConfigError(f"{name}={getattr(config, name)} is not supported by this version of shardwise; use {name}<={limit}")
    check_materializable(module)
    chosen = as_plan(plan, config)
    config = _with_plan_zero(config, chosen)
    resolved = resolve_plan(chosen, module, config.tp)
    if config.tp > 1:
        tensor_parallel_rules(module, resolved)
    config.resolve(dist.get_world_size())
    layout = _pipeline_layout(module, chosen, config, sample) if config.pp > 1 else None
    recompute_targets(module, config, resolved)
    return config, chosen, resolved, layout


def _with_plan_zero(config: ParallelConfig, plan: Plan) -> ParallelConfig:
    """The config with the plan's ZeRO stage, when the plan gives one."""
    if plan.zero is None or plan.zero == config.zero:
        return config
    if config.zero:
        raise ConfigError(f"the config asks for zero={config.zero} and plan {plan.name or 'given'} for zero={plan.zero}; "
                          "set one of them (or both the same)")
    return dataclasses.replace(config, zero=plan.zero)


def _model_signature(module: nn.Module, config: ParallelConfig, plan: Plan | None) -> list[str]:
    """What every rank must share: the module's class, every parameter's and buffer's name,
    shape and dtype, the config and the plan (one line each, compared across ranks)."""
    lines = [f"module {type(module).__qualname__}", f"config {config.describe()}",
             f"plan {plan.to_json() if plan is not None else None}"]
    for name, param in module.named_parameters(remove_duplicate=False):
        lines.append(f"parameter {name} of shape {tuple(param.shape)} {param.dtype}"
                     + ("" if param.requires_grad else " (frozen)"))
    for name, buffer in module.named_buffers(remove_duplicate=False):
        lines.append(f"buffer {name} of shape {tuple(buffer.shape)} {buffer.dtype}")
    return lines


def _build(module: nn.Module, topology: Topology, chosen: Plan, resolved: ResolvedPlan,
           pipelined: PipelineCapture | None) -> ParallelModule:
    """Apply the executors in order; every rank runs the same steps (agreed by parallelize)."""
    config = topology.config
    pmodel = ParallelModule(module, topology, chosen, resolved)
    first_name: dict[int, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        first_name.setdefault(id(param), name)
    pmodel._aliases = {name: first_name[id(param)] for name, param in module.named_parameters(remove_duplicate=False)}
    pmodel._state_shapes = {k: tuple(v.shape) for k, v in module.state_dict(keep_vars=True).items()}

    layout = pipelined.layout if pipelined is not None else None
    if layout is not None:
        pmodel._tied = tied_across_ranks(module, layout)
        pmodel._state_layout = prune_to_stages(module, layout, topology.pp_rank)  # this rank keeps its stages
    materialize = materializer(module, resolved, topology)  # deferred init: each rank's shards only
    if topology.size("pp", "cp", "tp") > 1:  # random ops agree inside a replica
        broadcast_rng_state(topology.group("pp", "cp", "tp"), topology.device)
    if topology.sizes["tp"] > 1:
        pmodel.tensor_parallel = apply_tensor_parallel(module, topology, resolved, materialize)
    module.to(topology.device)
    pmodel.recomputed = apply_recompute(module, config, resolved, pmodel.tensor_parallel)
    if pipelined is not None:
        pmodel.pipeline = Pipeline(module, pipelined.shadow, pipelined.fake_mode, topology, layout, config.schedule,
                                   config.microbatches, pipelined.units, pipelined.microbatch, pipelined.program,
                                   pmodel._forward_pass)
    fp32_values = {}
    if config.param_dtype not in (None, torch.float32):  # float32 masters, from the values before casting
        fp32_values = {id(p): local(p).detach().float().clone() for p in module.parameters() if p.requires_grad}
        module.to(config.param_dtype)
    units = None
    if config.zero == 3:
        units = [u for u in candidate_units(module) if any(True for _ in module.get_submodule(u).parameters())]
    stages = None
    if layout is not None:  # this rank's pipeline units by stage: each stage reduces its own buckets
        mine = set(layout.stages_of_rank(topology.pp_rank))
        stages = {path: stage for path, stage in layout.stage_of.items() if stage in mine}
    pmodel.gradients = apply_data_parallel(module, topology, config, pmodel.tensor_parallel, pmodel._tied, units,
                                           stages)
    if config.zero == 3:
        pmodel.param_shards = ParameterShards(module, pmodel.gradients, units)
    first_holder = {name: ranks[0] == topology.pp_rank for name, ranks in pmodel._tied.items()}
    tied_first = {id(p): first_holder[n] for n, p in module.named_parameters(remove_duplicate=False) if n in first_holder}
    pmodel.masters = MasterWeights(module, pmodel.gradients, topology, config.zero, fp32_values, tied_first)
    return pmodel


def _without_zero(config: ParallelConfig) -> ParallelConfig:
    """ZeRO shards over data-parallel replicas; with one replica there is nothing to shard."""
    warnings.warn(f"zero={config.zero} with one data-parallel replica has nothing to shard; running as zero=0",
                  stacklevel=3)
    return dataclasses.replace(config, zero=0)


@dataclass
class PipelineCapture:
    """The forward captured on a sample microbatch (on a fake shadow of the model) and the
    stage layout drawn from it: what the pipeline executor is built from."""

    shadow: nn.Module
    fake_mode: Any
    units: list[str]
    microbatch: Any
    program: Any
    layout: StageLayout


def _pipeline_layout(module: nn.Module, plan: Plan, config: ParallelConfig, sample: Any) -> PipelineCapture:
    """Stages for pp > 1, checked before any rank communicates (same result on every rank)."""
    if sample is None:
        raise ConfigError(f"pp={config.pp} needs sample=<a batch like the training batches> to lay out the stages")
    if config.microbatches < config.pp:
        raise ConfigError(
            f"microbatches={config.microbatches} < pp={config.pp}: a pipeline of {config.pp} stages needs at least "
            f"{config.pp} microbatches per step to keep every stage busy; set microbatches >= {config.pp}"
        )
    if config.schedule in INTERLEAVED and config.microbatches % config.pp:
        raise ConfigError(
            f"schedule {config.schedule!r} needs microbatches divisible by pp={config.pp}, got {config.microbatches}"
        )
    microbatch = split_batch(sample, config.microbatches)[0]
    try:
        program, shadow, fake_mode, units = capture_module(module, microbatch, _fake_mode_of(module))
    except ShardwiseError:
        raise
    except Exception as exc:  # noqa: BLE001 - the module's own forward failed on the sample
        raise ModelError(f"{type(module).__name__}'s forward raised {type(exc).__name__} on the sample batch "
                         f"(pipeline stages are laid out from one forward of it): {exc}") from exc
    layout = layout_stages(module, plan, config, program)
    split(program, layout.stage_of, layout.num_stages)  # values flowing against the stage order are refused now
    return PipelineCapture(shadow, fake_mode, units, microbatch, program, layout)


def _fake_mode_of(module: nn.Module) -> Any:
    """The fake-tensor mode a deferred module was recorded in (so its forward runs without data)."""
    for tensor in module.parameters():
        if is_deferred(tensor):
            return tensor.fake_mode
    return None
