"""One training step without a pipeline, between `ParallelModule.train_step`'s agreement and
its gradient synchronization: the batch checked, split and agreed (`agree_on_batch`), then
each microbatch's forward and backward with its loss combined as `reduce` says over
microbatches, tensor-parallel shards and replicas (`MicrobatchLosses`).

Loss reductions (step_output.py says what the user sees):
- "mean": microbatch losses averaged, replicas weighted by their sample counts;
- "sum": summed over microbatches;
- "tokens": each microbatch's mean loss weighted by the tokens it counts, over every replica;
- a loss the tp ranks compute on activations the plan leaves sharded is the mean of the shards'.
"""

from __future__ import annotations

import functools
import gc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.tensor import DTensor

from .batch import batch_signature, batch_size, loss_of, split_batch
from .compat import functional_all_gather
from .coordination import Fingerprint, _agreed, fingerprint_of
from .errors import BatchError, ConfigError, ModelError, PlanError, ShardwiseError
from .step_output import detached, tokens_of
from .parallel.data.held_apart import GradientHeldApart
from .tensors import is_sharded, local, tensor_leaves

if TYPE_CHECKING:
    from .module import ParallelModule


@dataclass
class StepBatch:
    """A batch agreed for one step: `batch` on this rank's device (under cp, this rank's part
    of each sequence), its `microbatches`, this replica's weight relative to an equal share
    (n_replica * dp / n_global), and under cp the factor of each microbatch's loss (see
    `ContextParallel.loss_weights`; None without cp).

    `pending`: the agreement (or sample count sum) still running while the forward computes
    (`overlaps_forward`); `weight()` settles it, raising an agreed error if any rank found one."""

    batch: Any
    microbatches: list[Any]
    replica_weight: float | None
    loss_weights: list[float] | None
    samples: int = 0  # this replica's
    total_samples: int = 0  # every replica's
    pending: Callable[[], int] | None = None  # -> the sample total
    replicas: int = 1

    def weight(self) -> float:
        if self.pending is not None:
            settle, self.pending = self.pending, None
            self.total_samples = settle()
            self.replica_weight = self.samples * self.replicas / self.total_samples
        return self.replica_weight


def overlaps_forward(pmodel: "ParallelModule", op: str) -> bool:
    """Whether a step's agreement can run while its forward computes: nothing in that forward
    communicates (no tp, cp, pp, ep, ZeRO-3 gathers or synchronized batch norm), after the first
    step (which also checks the model), reducing by mean or sum. The step settles it before its
    first collective (the gradients' weight, the loss) and a group helper before its own."""
    topology, config = pmodel.topology, pmodel.config
    return (pmodel.steps > 1 and op in ("train_step", "train_step(reduce='sum')") and config.zero < 3
            and topology.size("tp", "cp", "pp") == 1 and config.ep == 1 and pmodel.router_logits is None
            and not config.sync_batchnorm
            and pmodel.gradients.sync_enabled)


def refuse_autocast_under_pp(pmodel: "ParallelModule", op: str) -> None:
    """Pipeline stages replay the code between the model's modules (the loss, residual sums) as
    it was captured, without autocast: a cast autocast would add, or one it turns into a no-op,
    is not replayed as one process under autocast runs it (Hugging Face's loss ran in bf16 where
    one process runs it in float32). Refused, naming the cast the stages do replay exactly."""
    device = pmodel.topology.device.type
    if pmodel.pipeline is not None and torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        raise ConfigError(f"{op} under torch.autocast({device!r}, dtype={dtype}) with pp={pmodel.config.pp}: the "
                          "stages replay the forward's code between modules as captured without autocast, so they "
                          "would not compute what autocast computes in one process. Cast the model instead: "
                          f"ParallelConfig(param_dtype={dtype}) keeps float32 masters and runs as the model cast to "
                          f"{dtype} does in one process")


def agree_on_batch(pmodel: "ParallelModule", op: str, batch: Any, parts: int, check: bool) -> StepBatch:
    """Validate and split `batch`, agree with every rank, and return it (on this rank's
    device; under cp this rank's part of the sequence), its microbatches and the weights of
    this replica and of this rank's microbatch losses.

    On check steps every rank agrees on the operation, any problem and the sample total, and
    peers that must hold the same batch (tp, cp, pp) compare its fingerprint; on other steps
    only the data-parallel ranks combine their sample counts."""
    problem, whole, microbatches, samples, loss_weights = None, batch, [], 0, None
    try:
        refuse_autocast_under_pp(pmodel, op)
        whole = batch = pmodel.prepare(batch)
        samples = batch_size(batch)
        if pmodel.context_parallel is not None:
            batch = pmodel.context_parallel.shard(whole)
            loss_weights = pmodel.context_parallel.loss_weights(whole, parts)
        microbatches = split_batch(batch, parts)
    except ShardwiseError as exc:
        problem = exc
    topology = pmodel.topology
    if topology.world_size == 1:
        if problem is not None:
            raise problem
        return StepBatch(batch, microbatches, 1.0, loss_weights, samples, samples)
    replicas = topology.size("dp")
    overlap = overlaps_forward(pmodel, op)
    if check:
        lines = batch_signature(whole) if problem is None else ["(a batch this rank refused)"]
        leader = all(topology.coordinates[d] == 0 for d in ("pp", "cp", "tp"))  # counts its replica's samples once
        pending = pmodel.coordinator.begin(op, problem, value=samples if leader else 0, fingerprints=[Fingerprint(
            fingerprint_of(lines), lambda: lines, BatchError,
            "Ranks of one replica (its tp, cp and pp ranks) must be given the same batch: slice the data by "
            "sw.data_parallel_info(pmodel), not by global rank", peers=topology.peer_groups("pp", "cp", "tp"))])
        settle = lambda: pending.result().total  # noqa: E731
        if problem is not None:
            settle()  # raises the agreed error, here as on every rank
    else:
        if problem is not None:
            raise problem
        settle = lambda: samples * replicas  # noqa: E731
        if replicas > 1:
            counted = torch.tensor([samples], dtype=torch.float64, device=topology.device)
            dp = topology.group("dp")
            work = dist.all_reduce(counted, group=dp, async_op=True)

            def settle() -> int:
                pmodel.coordinator.wait(work, f"{op}: sample counts", dp)
                return int(counted.item())
    step = StepBatch(batch, microbatches, None, loss_weights, samples, pending=settle, replicas=replicas)
    if overlap:
        pmodel.coordinator.deferred = step.weight  # settled before the next collective on any rank
    else:
        step.weight()  # exactly 1.0 when replicas are equal
    return step


def check_forward(pmodel: "ParallelModule", args: tuple, kwargs: dict) -> None:
    """Before a plain forward: the first refuses inputs computed from trainable parameters
    outside the module at dp > 1 (their gradients would never be synchronized); the first and
    every `check_every`-th agree that a replica's ranks were given the same inputs."""
    topology, problem = pmodel.topology, None
    if pmodel._forwards == 1 and topology.size("dp") > 1:
        upstream = [t for t in tensor_leaves((args, kwargs)) if t.requires_grad and t.grad_fn is not None]
        if upstream:  # agreed below: the first forward always agrees, so every rank raises it
            problem = ModelError(
                f"{type(pmodel.module).__name__}'s ParallelModule was called on a tensor computed from trainable "
                f"parameters outside it ({tuple(upstream[0].shape)}, from {type(upstream[0].grad_fn).__name__}): "
                "shardwise cannot synchronize those parameters' gradients across replicas, so they would drift "
                "apart. Parallelize the whole model once (sw.parallelize(outer_model, ..., parts=[...]) keeps "
                "the plan to a submodule)")
        refuse_gradients_outside(pmodel)
    if topology.world_size > 1 and (pmodel._forwards - 1) % pmodel.config.check_every == 0:
        lines = batch_signature((args, kwargs))
        pmodel.coordinator.agree("forward", problem, fingerprints=[Fingerprint(
            fingerprint_of(lines), lambda: lines, BatchError,
            "Ranks of one replica (its tp, cp and pp ranks) must call the module with the same inputs",
            peers=topology.peer_groups("pp", "cp", "tp"))])


def modules_holding(module: nn.Module) -> list[nn.Module]:
    """Every module whose tree holds `module` (torch keeps no parent links, so they are found
    by reference: a parent's `_modules` dict refers to its children)."""
    found: dict[int, nn.Module] = {}
    frontier = [module]
    while frontier:
        child = frontier.pop()
        for children in gc.get_referrers(child):
            if not isinstance(children, dict):
                continue
            for owner in _owners_of(children):
                if id(owner) not in found:
                    found[id(owner)] = owner
                    frontier.append(owner)
    return list(found.values())


def _owners_of(children: dict) -> list[nn.Module]:
    """The modules whose `_modules` is `children`: referring to it directly (Python >= 3.12's
    inline attributes) or through their `__dict__`."""
    owners = []
    for holder in gc.get_referrers(children):
        if isinstance(holder, nn.Module):
            owners.append(holder)
        elif isinstance(holder, dict) and holder.get("_modules") is children:
            owners += [o for o in gc.get_referrers(holder) if isinstance(o, nn.Module) and o.__dict__ is holder]
    return [o for o in owners if o.__dict__.get("_modules") is children]


def refuse_gradients_outside(pmodel: "ParallelModule") -> None:
    """At dp > 1, trainable parameters of the modules holding `pmodel` (a head applied to its
    outputs, say) would get this replica's gradient alone and drift apart: the first gradient
    one of them receives raises a ModelError on every rank (the same model, the same place)."""
    holders = modules_holding(pmodel)
    synchronizing = (nn.parallel.DistributedDataParallel, FSDPModule, FullyShardedDataParallel)
    if any(isinstance(h, synchronizing) for h in holders):
        return  # DDP or FSDP synchronizes every parameter under it
    own = {id(p) for p in pmodel.parameters()}
    synced = {id(p) for h in holders for m in h.modules() if isinstance(m, synchronizing) for p in m.parameters()}
    for holder in holders:
        for name, param in holder.named_parameters():
            if param.requires_grad and id(param) not in own | synced and not isinstance(param, DTensor):
                own.add(id(param))
                param.register_post_accumulate_grad_hook(functools.partial(
                    _unsynchronized, name=f"{type(holder).__name__}.{name}", module=type(pmodel.module).__name__))


def _unsynchronized(param: torch.Tensor, *, name: str, module: str) -> None:
    raise ModelError(
        f"{name} is trained together with {module}'s ParallelModule, which it holds, but outside it: at dp > 1 "
        "each replica would keep its own gradient for it and the replicas would drift apart. Parallelize the whole "
        "model once (sw.parallelize(outer_model, ..., parts=[...]) keeps the plan to a submodule), or freeze it")


class MicrobatchLosses:
    """The microbatch loop of a step without a pipeline, and what it learns once per model: whether
    its loss is computed on tp-sharded activations, and that replicated parameters get the same
    gradient on every tp rank (checked after the first synchronized step)."""

    def __init__(self, pmodel: "ParallelModule"):
        self.pmodel = pmodel
        self.loss_sharded: bool | None = None  # decided on the first forward (tp_loss_share)
        self.replicated_grads_checked = False

    def accumulate(self, step: StepBatch, gradients, reduce: str, keep: bool):
        """Forward and backward of each microbatch; returns this replica's loss as `reduce`
        combines it, the kept outputs, and under "tokens" (Σ loss·n, Σ n) over every replica,
        which also sets the replicas' gradient weight before the last backward."""
        pmodel = self.pmodel
        losses, kept, counts, tokens = [], [], [], None
        parts = len(step.microbatches)
        for i, microbatch in enumerate(step.microbatches):
            with gradients.microbatch(last=i == parts - 1):
                out = pmodel.run_module(microbatch)
                loss = loss_of(out)
                if pmodel.tensor_parallel is not None and self.tp_loss_share(loss) != 1.0:
                    loss = loss * self.tp_loss_share(loss)  # this shard's share of the whole loss
                if step.loss_weights is not None:
                    loss = loss * step.loss_weights[i]
                if reduce == "tokens":
                    counts.append(tokens_of(out).to(loss.device))
                    loss = loss * counts[-1]  # its gradient is 0 where the count is (a mean over no tokens is NaN)
                if keep:
                    kept.append(detached(out))
                losses.append(loss.detach() if reduce != "tokens" else torch.where(counts[-1] > 0, loss.detach(), 0.0))
                if i == parts - 1:  # averaged over replicas along with the gradients
                    if parts == 1:  # its own mean or sum, as a copy the caller may keep: one kernel, not two
                        replica_loss = losses[0].to(torch.float32, copy=True)
                    else:
                        stacked = torch.stack(losses).float()
                        replica_loss = stacked.mean() if reduce == "mean" else stacked.sum()
                    if self.loss_sharded:  # the shards' shares summed: the whole loss on every tp rank
                        replica_loss = self._sum_over_tp(replica_loss)
                    if reduce == "tokens":
                        tokens = self.token_totals(replica_loss, torch.stack(counts))
                    gradients.loss(replica_loss)
                scaler = pmodel.loss_scaler
                scaled = loss.float() * scaler.scale if scaler is not None else loss
                (scaled / parts if reduce == "mean" and parts > 1 else scaled).backward()
        return replica_loss, kept, tokens

    def tp_loss_share(self, loss: torch.Tensor) -> float:
        """1 for a loss every tp rank computes whole; 1/tp for one computed on activations the
        plan leaves sharded (each rank's is a mean over its shard): decided on the first
        forward by comparing the ranks' values. Replicated computations on identical inputs
        agree to rounding (a kernel's reduction order: ~1e-6 of the value in float32, far less
        with deterministic kernels); means over disjoint shards differ by far more than the
        1e-4 threshold. The whole loss is then the mean of the shards' (equal shards, as
        sequence parallelism makes them)."""
        tp = self.pmodel.tensor_parallel
        if self.loss_sharded is None:
            values = funcol.wait_tensor(functional_all_gather(local(loss.detach()).float().reshape(1), 0, tp.group))
            spread = float(values.max() - values.min())
            self.loss_sharded = spread > 1e-4 * max(float(values.abs().max()), 1e-30)
        return 1.0 / tp.size if self.loss_sharded else 1.0

    def _sum_over_tp(self, value: torch.Tensor) -> torch.Tensor:
        total = value.detach().clone().to(self.pmodel.topology.device)
        tp = self.pmodel.tensor_parallel.group
        self.pmodel.coordinator.wait(dist.all_reduce(total, group=tp, async_op=True), "train_step: sharded loss over tp",
                                     tp)
        return total

    def token_totals(self, weighted: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(Σ loss·n, Σ n) over every replica; the gradients, which hold Σ n·∇loss, are
        weighted replicas/Σn so that their mean over replicas is ∇(Σ loss·n / Σ n)."""
        topology, coordinator = self.pmodel.topology, self.pmodel.coordinator
        bad = (~torch.isfinite(counts) | (counts < 0)).sum()
        totals = torch.stack([weighted.float(), counts.sum().float(), bad.float()]).to(topology.device)
        replicas = topology.size("dp")
        if replicas > 1:
            dp = topology.group("dp")
            coordinator.wait(dist.all_reduce(totals, group=dp, async_op=True), "train_step: token counts", dp)
        if topology.size("tp") > 1:  # peers must weigh alike, or replicated parameters drift apart
            spread = torch.stack([totals[1], -totals[1]])
            tp = topology.group("tp")
            coordinator.wait(dist.all_reduce(spread, op=dist.ReduceOp.MAX, group=tp, async_op=True),
                             "train_step: token counts over tp", tp)
            if float(spread[0]) != -float(spread[1]):
                raise _agreed(ModelError, f"train_step(reduce='tokens'): tensor-parallel peers counted different "
                                          f"token totals ({-float(spread[1]):g} to {float(spread[0]):g}); count tokens "
                                          "from the batch (e.g. labels != -100), not from sharded activations")
        if float(totals[2]) > 0:
            raise _agreed(ModelError, f"train_step(reduce='tokens'): {int(totals[2])} microbatch(es) returned a negative "
                                      "or non-finite num_tokens; return the count of tokens the loss averages over")
        if float(totals[1]) <= 0:
            raise _agreed(ModelError, f"train_step(reduce='tokens'): the step's batches hold {float(totals[1]):g} tokens "
                                      "in all; the loss is a mean over tokens, so there must be some")
        self.pmodel.gradients.replica_weight = replicas / float(totals[1])
        return totals[0], totals[1]

    def check_replicated_grads(self) -> None:
        """Once, after the first synchronized step: replicated parameters must have the same
        gradient on every tp rank. One that does not runs on sharded activations without the
        plan saying so, and would silently drift apart; name it instead."""
        tp = self.pmodel.tensor_parallel
        if self.replicated_grads_checked or tp is None:
            return
        self.replicated_grads_checked = True
        named = [(n, p) for n, p in self.pmodel.module.named_parameters()
                 if p.grad is not None and not isinstance(p.grad, GradientHeldApart) and not is_sharded(p)
                 and id(p) not in tp.partial_grad_params]
        if not named:
            return
        mine = torch.stack([local(p.grad).detach().float().abs().sum() for _, p in named])
        gathered = funcol.wait_tensor(functional_all_gather(mine, 0, tp.group)).view(tp.size, len(named))
        spread = (gathered.max(0).values - gathered.min(0).values) / gathered.abs().max(0).values.clamp_min(1e-30)
        bad = [name for (name, _), s in zip(named, spread.tolist()) if s > 1e-3]
        if bad:
            raise PlanError(
                f"replicated parameters {bad[:6]} have different gradients on different tp ranks: their modules run "
                "on sharded activations. Declare that in the plan (e.g. '<module>.input': [[Shard(1)]] for a norm "
                "under sequence parallelism) so their partial gradients are summed over tp"
            )
