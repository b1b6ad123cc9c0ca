"""`parallelize(model, "auto", sample=batch)`: the planner's best layout for this world.

The sample batch is one data-parallel replica's batch (the data contract): the search fixes
each replica's batch at its size, ranks layouts of this job's ranks (`job_cluster`: the
accelerators' table entry and their own memory, or this CPU machine's) by predicted time
per token, and the best one's config and plan are used. Every rank runs
the same deterministic search on the same inputs; `parallelize` then checks that all ranks
chose the same config and plan, as for any user's config.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from ..batch import batch_size, leaves
from ..config import ParallelConfig
from ..errors import ConfigError
from ..topology import backend_device
from .cluster import Cluster, device_kind
from .model import model_spec
from .search import plan_for, search


def _sequence_length(sample: Any) -> int:
    tokens = sample.get("input_ids") if isinstance(sample, dict) else None
    tokens = tokens if tokens is not None else next((t for t in leaves(sample) if t.dim() >= 2), None)
    if tokens is None:
        raise ConfigError("plan 'auto' needs sample= with (batch, sequence) token tensors to size activations")
    return int(tokens.shape[1])


def job_cluster(world: int, device: torch.device) -> Cluster:
    """The machines `world` ranks on `device`s run on. On CPU: this machine, its memory shared
    by the ranks (`Cluster.local`). On accelerators: the table's entry for their name (one it
    does not know: the H100's rates) with each device's own memory, a node holding torchrun's
    LOCAL_WORLD_SIZE ranks (else the devices this process sees)."""
    if device.type == "cpu":
        return Cluster.local(world)
    module = getattr(torch, device.type, None)
    try:
        name = module.get_device_name(device)
        memory = float(module.get_device_properties(device).total_memory)
    except (AttributeError, AssertionError, RuntimeError) as exc:
        raise ConfigError(f"config='auto' cannot read the name and memory of {device} ({exc}); "
                          "pass a sw.ParallelConfig (sw.plan.search(spec, sw.plan.Cluster(...)) ranks them)") from exc
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE") or module.device_count())
    return Cluster(world, gpus_per_node=max(1, min(per_node, world)), device=device_kind(name) or "h100",
                   memory_bytes=memory)


def auto_layout(module: nn.Module, config: Any, plan: Any, sample: Any, world: int):
    """(config, plan) for `parallelize`: with config="auto" the best layout the planner
    finds for `world` ranks; with a config and plan="auto", the model's zoo plan for it."""
    spec = model_spec(module)
    if config != "auto":
        if not isinstance(config, ParallelConfig):
            raise ConfigError(f"config must be a sw.ParallelConfig or 'auto', got {config!r}")
        return config, plan_for(spec, config)
    if plan not in (None, "auto"):
        raise ConfigError("config='auto' chooses the plan too; pass plan=None (or 'auto')")
    if sample is None:
        raise ConfigError("config='auto' needs sample=<one replica's batch> to size the layouts")
    cluster = job_cluster(world, backend_device())
    # the module's own precision: "auto" changes the layout, never the numerics (float32's bytes;
    # a bf16 module is sized over, never under)
    result = search(spec, cluster, replica_batch=batch_size(sample), seq_len=_sequence_length(sample),
                    top=1, context_parallel=isinstance(sample, dict), dtypes=(4,))
    if not result:
        raise ConfigError(f"no layout of {spec.name} on {world} ranks of {cluster.device} is predicted to fit in memory "
                          f"({result.evaluated} evaluated); use a smaller batch or more ranks")
    best = result[0]
    return best.config, best.plan
