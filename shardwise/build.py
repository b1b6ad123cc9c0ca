"""`parallelize`: check everything, agree, then apply the executors to the module in order.

The steps (`_build`), each reading only the Topology and the Plan: index the whole model ->
prune to this rank's pipeline stages -> materialize (deferred init) -> tensor parallel ->
recompute -> pipeline schedule -> mixed precision -> data parallel / ZeRO buckets -> ZeRO-3
parameter shards -> the optimizer's parameters. Each is an `apply_*` function or an
executor's constructor taking the module; `ParallelModule` receives what they return.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .batch import split_batch, with_dicts
from .comm import broadcast_rng_state
from .config import SCHEDULES, ParallelConfig
from .checkpoint.pretrained import guard_hugging_face_saves
from .compat import group_name_salt
from .coordination import Fingerprint, fingerprint_of, world_coordinator
from .deferred import check_materializable, is_deferred, materialize
from .errors import ConfigError, ModelError, ShardwiseError
from .module import ParallelModule, forward_context
from .optim import refuse_plain_optimizers
from .parallel.context.sequence import (ContextParallel, SequenceShards, check_attention, refuse_shifted_labels,
                                        shard_batch, whole_sequence_draws)
from .groups import running
from .parallel.data.buffers import BufferBroadcast, sync_batchnorm
from .parallel.data.replicas import apply_data_parallel, refuse_replacing, refuse_unfreezing
from .parallel.pipeline.placement import prune_to_stages, tied_across_ranks
from .parallel.pipeline.stages import Pipeline
from .parallel.recompute import apply_recompute, recompute_targets
from .parallel.pipeline.program import capture_module, split
from .parallel.tensor.sharding import apply_tensor_parallel
from .parallel.tensor.rules import tensor_parallel_rules
from .parallel.data.zero import OptimizerParams
from .parallel.data.float8_gather import check_float8_gather, float8_gathered_weights
from .parallel.data.zero3 import ParameterShards
from .parallel.expert import (apply_expert_parallel, apply_router_logits_over_replicas, check_expert_parallel,
                              grouped_experts)
from .plan import Plan, ResolvedPlan, as_plan, resolve_plan
from .plan.stages import StageLayout, candidate_units, layer_list, layout_stages
from .state import ModelIndex
from .tensors import local
from .topology import Topology, even_group_names, init_distributed

def parallelize(
    module: nn.Module,
    config: ParallelConfig | str | None = None,
    plan: Plan | dict | str | Path | None = None,
    sample: Any = None,
    parts: list[str] | str | None = None,
) -> ParallelModule:
    """Turn `module` into a `ParallelModule` laid out as `config` and `plan` say.

    Collective: every rank calls it with the same module architecture, config and plan.
    Replicas start from the first data-parallel rank's parameter values. `plan` is a
    `Plan`, a dict (also veScale's form), a zoo name (`sw.plan.zoo`), a .json path, or
    None (replicate everything). `sample` (an example batch) is used by layouts that need
    shapes ahead of time. config="auto" lets the planner choose the layout for this world
    (`sample` is then one replica's batch); plan="auto" with a config takes the model's zoo plan.
    `parts` (submodule paths, e.g. ["llm"]) limits the plan to those submodules: the rest of
    the model stays replicated and data-parallel, in the same gradient buckets and optimizer.

    Everything that can be wrong is checked on each rank first; then the ranks agree, so a
    problem found on any rank (a plan file missing on one machine, a different model on
    one rank) is the same error on every rank before any group is created.
    """
    config = config if config is not None else ParallelConfig()
    timeout_s = config.timeout_s if isinstance(config, ParallelConfig) else ParallelConfig.timeout_s
    init_distributed(timeout=timedelta(seconds=timeout_s))
    problem, checked = None, None
    try:
        checked = _check_locally(module, config, plan, sample, parts)
    except ShardwiseError as exc:
        problem = exc
    except Exception as exc:  # noqa: BLE001 - agreed like any problem, so no rank is left waiting
        problem = ShardwiseError(f"parallelize failed before communicating: {type(exc).__name__}: {exc}")
        problem.__cause__ = exc
    lines = []
    if problem is None:
        try:
            lines = _model_signature(module, *checked[:3])
        except ShardwiseError as exc:
            problem = exc
    coordinator = world_coordinator(timeout_s)
    # groups made before this call (the user's) may differ between ranks
    _agree_evening_group_names(coordinator, "parallelize", problem, [Fingerprint(
        fingerprint_of(lines), lambda: lines, ModelError,
        "Every rank must build the same model with the same config and plan (same seed-independent "
        "architecture and shapes); check rank-dependent code before sw.parallelize")])
    config, chosen, resolved, pipelined = checked
    if config.zero and dist.get_world_size() // (config.tp * config.pp) == 1:
        config = _without_zero(config)  # dp * cp == 1
    with coordinator.body("parallelize"):
        topology = Topology(config)
        with running(topology):
            pmodel = _build(module, topology, chosen, resolved, pipelined)
        # tied parameters' groups exist on some pipeline ranks only
        _agree_evening_group_names(coordinator, "parallelize: groups made")
        return pmodel


def _agree_evening_group_names(coordinator, op: str, problem: BaseException | None = None,
                               fingerprints: list[Fingerprint] | None = None) -> None:
    """Agree on `op`, and on the ranks' group-name salts, then even them (`even_group_names`)."""
    salt = group_name_salt()
    agreed = coordinator.agree(op, problem, value=-1 if salt is None else salt, every_value=True,
                               fingerprints=fingerprints or ())
    even_group_names(agreed.values(), salt)


def _check_locally(module: nn.Module, config: ParallelConfig, plan: Any, sample: Any, parts: Any = None):
    """Every check `parallelize` can make without communicating: (config with the plan's ZeRO
    stage, plan, resolved plan, stage layout)."""
    if isinstance(module, ParallelModule):
        raise ModelError("module is already a ParallelModule; pass the original module to parallelize")
    if not isinstance(module, nn.Module):
        raise ModelError(f"parallelize needs a torch.nn.Module, got {type(module).__name__}")
    for path, sub in module.named_modules():
        if hasattr(sub, "_orig_mod") and type(sub).__name__ == "OptimizedModule":  # torch.compile's wrapper
            where = f"its submodule {path!r} is" if path else "it is"
            raise ModelError(
                f"{type(module).__name__}: {where} torch.compile's wrapper, which adds '_orig_mod.' to every "
                "state-dict key and compiles the module before shardwise changes it. Parallelize the plain module, "
                "then compile in place: block.compile() on each block of pmodel.module (keys unchanged)")
    for path, sub in module.named_modules():
        if isinstance(sub, ParallelModule) or getattr(sub, PARALLELIZED, False):
            where = f"its submodule {path!r}" if path else "it"
            raise ModelError(
                f"{type(module).__name__}: {where} was parallelized already; parallelizing again would reduce its "
                "gradients twice (halving them) and leave the outer parameters unsynchronized. Call sw.parallelize "
                "once, on the whole model (parts=[...] keeps the plan to submodules), with a freshly built module")
    if not any(p.requires_grad for p in module.parameters()):
        raise ModelError(
            f"{type(module).__name__} has no trainable parameters (none, or all requires_grad=False); "
            "shardwise parallelizes training, so give the module at least one parameter that requires grad"
        )
    if config == "auto" or plan == "auto":
        from .planner.auto import auto_layout

        config, plan = auto_layout(module, config, plan, sample, dist.get_world_size())
    if not isinstance(config, ParallelConfig):
        raise ConfigError(f"config must be a sw.ParallelConfig or 'auto', got {type(config).__name__}")
    check_materializable(module)
    if config.cp > 1:
        check_attention(module)
    chosen = _with_parts(as_plan(plan, config), parts, config)
    config = _with_plan_zero(config, chosen)
    resolved = resolve_plan(chosen, module, config.tp)
    if config.tp > 1:
        tensor_parallel_rules(module, resolved)
    config.resolve(dist.get_world_size())
    check_expert_parallel(module, config)
    if config.cp > 1 and config.pp > 1 and sample is not None:  # stages are captured on one rank's part
        sample = shard_batch(sample, SequenceShards(config.cp, 0), config.sequence_dim)
    layout = _pipeline_layout(module, chosen, config, sample) if config.pp > 1 else None
    recompute_targets(module, config, resolved)
    check_float8_gather(module, config.zero, config.tp)
    return config, chosen, resolved, layout


def _with_parts(plan: Plan, parts: Any, config: ParallelConfig) -> Plan:
    """The plan limited to `parts` (parallelize's argument), which the plan may also name."""
    if parts is None:
        chosen = plan
    else:
        parts = [parts] if isinstance(parts, str) else parts
        if not isinstance(parts, (list, tuple)) or not parts:
            raise ConfigError(f"parts={parts!r} must be a submodule path or a non-empty list of them, e.g. ['llm']")
        if plan.parts and list(plan.parts) != list(parts):
            raise ConfigError(f"parts={list(parts)} but the plan names parts {plan.parts}; give them once")
        chosen = plan.replace(parts=list(parts))
    if chosen.parts and config.cp > 1:
        raise ConfigError("parts with cp > 1: context parallelism splits the sequence for the whole model, parts "
                          "outside the plan included; use cp=1 with parts")
    return chosen


def _with_plan_zero(config: ParallelConfig, plan: Plan) -> ParallelConfig:
    """The config with the plan's ZeRO stage, when the plan gives one."""
    if plan.zero is None or plan.zero == config.zero:
        return config
    if config.zero:
        raise ConfigError(f"the config asks for zero={config.zero} and plan {plan.name or 'given'} for zero={plan.zero}; "
                          "set one of them (or both the same)")
    return dataclasses.replace(config, zero=plan.zero)


def _model_signature(module: nn.Module, config: ParallelConfig, plan: Plan | None,
                     resolved: ResolvedPlan | None = None) -> list[str]:
    """What every rank must share: the module's class, every parameter's and buffer's name,
    shape and dtype, the config, the plan and the placements tensor-parallel rules complete
    it with (a rule may decide differently per rank) — one line each, compared across ranks."""
    lines = [f"module {type(module).__qualname__}", f"config {config.describe()}",
             f"plan {plan.to_json() if plan is not None else None}"]
    if resolved is not None and config.tp > 1:
        lines += [f"rule for {path}: {sorted((k, str(v)) for k, v in placements.items())}"
                  for path, (_, placements) in sorted(tensor_parallel_rules(module, resolved).items())]
    for name, param in module.named_parameters(remove_duplicate=False):
        lines.append(f"parameter {name} of shape {tuple(param.shape)} {param.dtype}"
                     + ("" if param.requires_grad else " (frozen)"))
    for name, buffer in module.named_buffers(remove_duplicate=False):
        lines.append(f"buffer {name} of shape {tuple(buffer.shape)} {buffer.dtype}")
    return lines


PARALLELIZED = "_shardwise_parallelized"  # set on a module parallelize has changed: it is not a plain module any more


def _build(module: nn.Module, topology: Topology, plan: Plan, resolved: ResolvedPlan,
           pipelined: PipelineCapture | None) -> ParallelModule:
    """The executors, in order; every rank runs the same steps (agreed by parallelize)."""
    config = topology.config
    object.__setattr__(module, PARALLELIZED, True)
    float8_gathered = float8_gathered_weights(module, config.zero)
    index = ModelIndex.of(module)
    layout = pipelined.layout if pipelined is not None else None
    if layout is not None:
        index.tied = tied_across_ranks(module, layout)
        index.stage_of_key = prune_to_stages(module, layout, topology.pp_rank)  # this rank keeps its stages
    experts = grouped_experts(module) if config.ep > 1 else {}  # found on whole shapes (before deferred init cuts them)
    sharded_values = materialize(module, resolved, topology, experts)  # deferred init: each rank's shards only
    if topology.size("pp", "cp", "tp") > 1:  # random ops agree inside a replica
        broadcast_rng_state(topology.group("pp", "cp", "tp"), topology.device)
    tensor_parallel = apply_tensor_parallel(module, topology, resolved, sharded_values) if topology.sizes["tp"] > 1 \
        else None
    module.to(topology.device)
    expert_parallel = apply_expert_parallel(module, topology, experts)
    experts = expert_parallel.params if expert_parallel is not None else set()
    if expert_parallel is not None and tensor_parallel is not None:  # experts on sequence shards: still partial
        partial = tensor_parallel.partial_grad_params
        partial |= {id(new) for old, new in expert_parallel.replaced.items() if old in partial}
    context_parallel = ContextParallel(topology.group("cp"), config.sequence_dim) if config.cp > 1 else None
    recomputed = apply_recompute(module, config, resolved, tensor_parallel, context_parallel)
    pipeline = None
    if pipelined is not None:
        pipeline = Pipeline(module, pipelined.shadow, pipelined.fake_mode, topology, layout, config.schedule,
                            config.microbatches, pipelined.units, pipelined.microbatch, pipelined.program,
                            functools.partial(forward_context, tensor_parallel, context_parallel, module)
                            if tensor_parallel is not None or context_parallel is not None else None,
                            pipelined.draws, pipelined.router_rows)
    if config.sync_batchnorm and topology.sizes["dp"] > 1:
        sync_batchnorm(module, topology.group("dp"))
    fp32_values = apply_mixed_precision(module, config)
    units = zero3_units(module, plan.parts) if config.zero == 3 else None
    partial_over_tp = tensor_parallel.partial_grad_params if tensor_parallel is not None else set()
    gradients = apply_data_parallel(module, topology, config, partial_over_tp, index.tied, units,
                                    _stages_of_rank(layout, topology.pp_rank), set(float8_gathered), experts)
    if expert_parallel is not None:  # a replica's share of the batch, over the replicas (and cp shards, each
        # of whose losses is weighted by its share of the tokens) an expert's tokens come from: the mean's scale
        expert_parallel.replica_weight = lambda: gradients.replica_weight / topology.size("dp", "cp")
    router_logits = apply_router_logits_over_replicas(module, topology, partial_over_tp)
    if router_logits is not None:
        router_logits.replica_weight = lambda: gradients.replica_weight
    param_shards = ParameterShards(module, gradients, units, float8_gathered) if config.zero == 3 else None
    optimizer_params = OptimizerParams(module, gradients, topology, fp32_values,
                                       _first_holders(module, index.tied or {}, topology.pp_rank), experts)
    buffers = None
    if config.broadcast_buffers and topology.size("dp", "cp") > 1 and any(True for _ in module.buffers()):
        buffers = BufferBroadcast(module, topology.group("dp", "cp"), topology.group_ranks("dp", "cp")[0])
    pmodel = ParallelModule(module, topology, plan, resolved, index, tensor_parallel=tensor_parallel,
                            pipeline=pipeline, gradients=gradients, param_shards=param_shards,
                            optimizer_params=optimizer_params, recomputed=recomputed,
                            context_parallel=context_parallel, buffers=buffers, expert_parallel=expert_parallel,
                            router_logits=router_logits)
    refuse_plain_optimizers(pmodel)
    refuse_unfreezing(module)
    refuse_replacing(pmodel, module)
    guard_hugging_face_saves(module, _weights_held_in_part(topology, config))
    return pmodel


def _weights_held_in_part(topology: Topology, config: ParallelConfig) -> str | None:
    """How this rank holds only part of the model's weights, for messages; None if it holds all."""
    if topology.size("pp") > 1:
        return f"rank {topology.rank} holds only the layers of pipeline rank {topology.pp_rank} of {topology.size('pp')}"
    if config.tp > 1:
        return f"its sharded weights are DTensors of which this rank holds 1/{config.tp}"
    if config.ep > 1:
        return f"this rank holds 1/{config.ep} of the experts"
    if config.zero == 3 and topology.size("dp", "cp") > 1:
        return "ZeRO-3 keeps this rank's shard of each parameter only"
    return None


def cast_dtype(config: ParallelConfig) -> torch.dtype | None:
    """The dtype `apply_mixed_precision` casts the module to, or None where it leaves it as it is."""
    return None if config.param_dtype in (None, torch.float32) else config.param_dtype


def apply_mixed_precision(module: nn.Module, config: ParallelConfig) -> dict[int, torch.Tensor]:
    """Cast `module` to `config.param_dtype`; returns the float32 values from before the cast
    (parameter id -> local tensor), from which the optimizer's master copies start.

    Args:
        module: the module, materialized and on its device.
        config: `param_dtype` None or float32 leaves the module as it is (returns {}).
    """
    if cast_dtype(config) is None:
        return {}
    fp32_values = {id(p): local(p).detach().float().clone() for p in module.parameters() if p.requires_grad}
    module.to(config.param_dtype)
    return fp32_values


def zero3_units(module: nn.Module, parts: list[str] | tuple[str, ...] = ()) -> dict[str, int]:
    """The modules ZeRO-3 gathers one at a time (the pipeline's candidate units that hold
    parameters) -> the gather they belong to. The units around the main layer list (embeddings,
    final norm, head) share one gather when together they hold no more than the largest block:
    one collective instead of one each, at no more memory than a block's gather."""
    units = [u for u in candidate_units(module, parts) if any(True for _ in module.get_submodule(u).parameters())]
    blocks = layer_list(module, parts)
    inside_blocks = [u for u in units if blocks is not None and u.startswith(blocks + ".")]
    ends = [u for u in units if u not in inside_blocks]
    size = {u: sum(p.numel() for p in module.get_submodule(u).parameters()) for u in units}
    merged = bool(inside_blocks) and sum(size[u] for u in ends) <= max(size[u] for u in inside_blocks)
    label = {u: i for i, u in enumerate(units)}
    return {u: (-1 if merged and u in ends else label[u]) for u in units}


def _stages_of_rank(layout: StageLayout | None, pp_rank: int) -> dict[str, int] | None:
    """This rank's pipeline units -> their stage (each stage reduces its own buckets)."""
    if layout is None:
        return None
    mine = set(layout.stages_of_rank(pp_rank))
    return {path: stage for path, stage in layout.stage_of.items() if stage in mine}


def _first_holders(module: nn.Module, tied: dict[str, list[int]], pp_rank: int) -> dict[int, bool]:
    """Tied parameter id -> whether this pipeline rank is the first holding it (which counts it)."""
    first = {name: ranks[0] == pp_rank for name, ranks in tied.items()}
    return {id(p): first[n] for n, p in module.named_parameters(remove_duplicate=False) if n in first}


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
    draws: Any = None  # under cp: the mode drawing a shard's random numbers as the stages will
    router_rows: int = 1  # ranks whose tokens a load-balancing loss's gathered router logits hold


def _pipeline_layout(module: nn.Module, plan: Plan, config: ParallelConfig, sample: Any) -> PipelineCapture:
    """Stages for pp > 1, checked before any rank communicates (same result on every rank)."""
    if sample is None:
        raise ConfigError(f"pp={config.pp} needs sample=<a batch like the training batches> to lay out the stages")
    if config.microbatches < config.pp:
        raise ConfigError(
            f"microbatches={config.microbatches} < pp={config.pp}: a pipeline of {config.pp} stages needs at least "
            f"{config.pp} microbatches per step to keep every stage busy; set microbatches >= {config.pp}"
        )
    if SCHEDULES[config.schedule].interleaved and config.microbatches % config.pp:
        raise ConfigError(
            f"schedule {config.schedule!r} needs microbatches divisible by pp={config.pp}, got {config.microbatches}"
        )
    microbatch = split_batch(with_dicts(sample), config.microbatches)[0]
    draws = whole_sequence_draws(config.cp, config.sequence_dim) if config.cp > 1 else None
    router_rows = config.resolve(dist.get_world_size()).dp * config.cp  # a capture routes one rank's tokens
    try:
        program, shadow, fake_mode, units = capture_module(module, microbatch, _fake_mode_of(module), plan.parts,
                                                           draws, router_rows, cast_dtype(config))
    except ShardwiseError:
        raise
    except Exception as exc:  # noqa: BLE001 - the module's own forward failed on the sample
        as_dict = " (pipeline stages get a mapping batch as a dict: read it by key, batch['input_ids'])" \
            if isinstance(sample, Mapping) and type(sample) is not dict else ""
        raise ModelError(f"{type(module).__name__}'s forward raised {type(exc).__name__} on the sample batch "
                         f"(pipeline stages are laid out from one forward of it): {exc}{as_dict}") from exc
    if config.cp > 1:
        refuse_shifted_labels(program.steps)
    layout = layout_stages(module, plan, config, program)
    split(program, layout.stage_of, layout.num_stages)  # values flowing against the stage order are refused now
    return PipelineCapture(shadow, fake_mode, units, microbatch, program, layout, draws, router_rows)


def _fake_mode_of(module: nn.Module) -> Any:
    """The fake-tensor mode a deferred module was recorded in (so its forward runs without data)."""
    for tensor in module.parameters():
        if is_deferred(tensor):
            return tensor.fake_mode
    return None
