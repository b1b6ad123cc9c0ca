"""Making a module's data-parallel replicas: they start identical (parameters and buffers
broadcast from the first replica), each parameter is reduced over its own group (the
replicas; with its tp peers for a gradient partial over tp; with the other pipeline ranks
for a tied one; with the ranks holding the same experts for an expert shard), and the
`GradientBuckets` that reduce them during backward are laid out (gradients.py)."""

from __future__ import annotations

import weakref

from torch import nn
from torch.nn.modules.module import (register_module_module_registration_hook,
                                     register_module_parameter_registration_hook)

from ...comm import broadcast_tensors
from ...config import ParallelConfig
from ...errors import ConfigError, ModelError
from ...global_hooks import hooks_while_alive
from ...tensors import local, name_parameters
from ...topology import Topology
from .buckets import ReduceGroup, ZeroStage
from .gradients import GradientBuckets, MiB


def apply_data_parallel(module: nn.Module, topology: Topology, config: ParallelConfig,
                        partial_over_tp: set[int] | None = None,
                        tied: dict[str, list[int]] | None = None,
                        units: dict[str, int] | None = None,
                        stages: dict[str, int] | None = None,
                        float8_gathered: set[int] | None = None,
                        experts: set[int] | None = None) -> GradientBuckets:
    """Make the replicas of `module` start identical and average their gradients.

    Parameters and buffers (local shards) are broadcast from the first data-parallel rank;
    gradients are averaged over the data-parallel (and context-parallel) ranks.

    Args:
        module: the model after tensor parallelism, on its device.
        topology: the groups; `config`: bucket size, ZeRO stage, reduce dtype.
        partial_over_tp: ids of replicated parameters whose gradients are partial over tp
            (summed over tp in the same collective).
        tied: parameter name -> the pipeline ranks holding it (summed over those ranks).
        units: ZeRO-3's gather units -> their gather; `stages`: this rank's module paths ->
            pipeline stage. A bucket never spans two gathers or two stages.
        float8_gathered: ids of weights ZeRO-3 gathers as float8 (float8_gather.py): in
            buckets of their own.
        experts: ids of expert shards (parallel/expert/): summed over the ranks holding the
            same experts, already weighted and scaled where their tokens came from.
    Returns:
        The gradient executor, its buckets laid out and hooked to the parameters.
    """
    params = [p for p in module.parameters() if p.requires_grad]
    name_parameters(module)  # for errors about a parameter (held_apart.py, released.py)
    experts = experts or set()
    dp, groups = _reduce_groups(module, topology, params, partial_over_tp or set(), tied or {}, experts)
    unit_of = _owner_labels(module, units or {})
    stage_of = _owner_labels(module, stages or {})
    float8_gathered = float8_gathered or set()
    apart = {id(p): (stage_of.get(id(p)), unit_of.get(id(p)), id(p) in float8_gathered) for p in params}
    bucket_bytes = int(config.bucket_mb * MiB)
    buckets = GradientBuckets(params, groups, bucket_bytes, replicas=dp, zero=ZeroStage(config.zero),
                              reduce_dtype=config.reduce_dtype or config.param_dtype, apart=apart)
    buckets.coordinator = topology.coordinator
    state = [local(t) for t in list(module.parameters()) + list(module.buffers()) if id(t) not in experts]
    broadcast_tensors([t.data for t in state], dp.group, bucket_bytes, buckets.stats)
    if experts:  # each ep group's shards came from its first rank: make every ep group the first one's
        expert_group = next(g for p, g in zip(params, groups) if id(p) in experts)
        broadcast_tensors([local(p).data for p in module.parameters() if id(p) in experts], expert_group.group,
                          bucket_bytes, buckets.stats)
    for group in dict.fromkeys(g for g in groups if not g.same_params_on_members):  # tied copies start equal
        broadcast_tensors([local(p).data for p, g in zip(params, groups) if g == group], group.group, bucket_bytes)
    return buckets


def _reduce_groups(module: nn.Module, topology: Topology, params: list[nn.Parameter], partial: set[int],
                   tied: dict[str, list[int]], experts: set[int]) -> tuple[ReduceGroup, list[ReduceGroup]]:
    """The replicas' group, and each parameter's: the replicas (mean); with tp too for a
    gradient partial over tp (sum over tp); with the other pipeline ranks for a tied one; the
    ranks holding the same experts for an expert shard (sum)."""
    dp_dims = ("dp", "cp")
    scale = 1.0 / topology.size(*dp_dims)
    dp = ReduceGroup(topology.group(*dp_dims), scale, "dp", includes_tp_peers=topology.sizes["tp"] == 1)
    tied_ids = {id(p): tied[name] for name, p in module.named_parameters(remove_duplicate=False) if name in tied}
    partial_experts = bool(experts & partial)  # experts on sequence shards: their gradients partial over tp too
    expert_group = ReduceGroup(topology.group_of(topology.expert_replica_ranks(with_tp=partial_experts)), 1.0,
                               "dp (and cp) ranks holding these experts" + (" and their tp peers" if partial_experts
                                                                             else ""),
                               includes_tp_peers=partial_experts or topology.sizes["tp"] == 1, weighted_at_origin=True,
                               spans_replicas=False) if experts else None

    def group_of(param: nn.Parameter) -> ReduceGroup:
        if id(param) in experts:
            return expert_group
        dims = dp_dims + (("tp",) if id(param) in partial else ())
        holders = tied_ids.get(id(param))
        if holders is None:
            return ReduceGroup(topology.group(*dims), scale, "dp+tp (partial over tp)", includes_tp_peers=True) \
                if "tp" in dims else dp
        ranks = [r for pp_rank in holders for r in topology.ranks_at(dims, pp=pp_rank)]
        return ReduceGroup(topology.group_of(ranks), scale, f"dp + pipeline ranks {holders} (tied)", same_params_on_members=False,
                           includes_tp_peers="tp" in dims or topology.sizes["tp"] == 1)

    return dp, [group_of(p) for p in params]


def _owner_labels(module: nn.Module, label_of_path: dict[str, int]) -> dict[int, int]:
    """Parameter id -> the label of the first listed module path holding it."""
    label: dict[int, int] = {}
    for path, value in label_of_path.items():
        for param in module.get_submodule(path).parameters():
            label.setdefault(id(param), value)
    return label


def refuse_unfreezing(module: nn.Module) -> None:
    """Make a parameter frozen (requires_grad=False) when the module was parallelized raise as
    soon as a backward gives it a gradient. Gradient buckets, ZeRO shards and the optimizer's
    parameters are laid out over the parameters trainable then, so an unfrozen one would train
    on one replica's gradient or not at all, without a word. At every world size alike, so a
    script behaves the same on one process as on many.

    torch registers no hook on a tensor that needs no gradient, so the hook is registered with
    requires_grad briefly on; a frozen parameter never runs it (costs nothing)."""
    for name, param in module.named_parameters():
        if param.requires_grad:
            continue

        def refuse(_: nn.Parameter, name: str = name) -> None:
            raise ConfigError(
                f"parameter {name!r} was frozen (requires_grad=False) when sw.parallelize ran and has a gradient "
                "now: gradient reduction, ZeRO shards and sw.build_optimizer cover the parameters trainable at "
                "parallelize, so it would be neither averaged over replicas nor updated. Set requires_grad before "
                "sw.parallelize; to unfreeze later, parallelize a fresh model loaded with pmodel.full_state_dict()")

        param.requires_grad_(True)
        param.register_post_accumulate_grad_hook(refuse)
        param.requires_grad_(False)


def refuse_replacing(owner: object, module: nn.Module) -> None:
    """Make assigning a new parameter or submodule anywhere in `module` (a new head, peft's
    adapters, resize_token_embeddings, `layer.weight = nn.Parameter(...)`) raise while `owner`
    (the ParallelModule) lives. Its parameters would be in no gradient bucket, ZeRO shard or
    optimizer: they would train on one replica's gradient or not at all, without a word.
    Raised before the assignment happens, so the module stays as it was.

    torch's global registration hooks see every module's registrations; these test membership
    in a weak set of the model's modules (nothing else is affected) and are retired with `owner`
    (global_hooks.py). Assigning a module or parameter its own slot already holds changes nothing
    and passes."""
    paths = weakref.WeakKeyDictionary({m: path for path, m in module.named_modules(remove_duplicate=False)})
    model = type(module).__name__

    def refuse(parent: nn.Module, name: str, value: object) -> None:
        if parent not in paths or getattr(parent, name, None) is value:
            return
        slot = f"{paths[parent]}.{name}".lstrip(".")
        raise ModelError(
            f"{model}.{slot} was assigned a new {type(value).__name__} after sw.parallelize: gradient buckets, "
            "ZeRO shards and the optimizer cover the parameters the model had then, so the new one would be "
            "neither averaged over replicas nor updated. Change the model (new heads, adapters, "
            "resize_token_embeddings) before sw.parallelize, or parallelize a fresh model loaded with "
            "pmodel.full_state_dict()")

    hooks_while_alive(owner, [register_module_parameter_registration_hook(refuse),
                              register_module_module_registration_hook(refuse)])
