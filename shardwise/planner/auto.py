"""`parallelize(model, "auto", sample=batch)`: the planner's best layout for this world.

The sample batch is one data-parallel replica's batch (the data contract): the search fixes
each replica's batch at its size, ranks layouts of this machine's ranks (`Cluster.local`)
by predicted time per token, and the best one's config and plan are used. Every rank runs
the same deterministic search on the same inputs; `parallelize` then checks that all ranks
chose the same config and plan, as for any user's config.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..batch import batch_size, leaves
from ..config import ParallelConfig
from ..errors import ConfigError
from .cluster import Cluster
from .model import model_spec
from .search import plan_for, search


def _sequence_length(sample: Any) -> int:
    tokens = sample.get("input_ids") if isinstance(sample, dict) else None
    tokens = tokens if tokens is not None else next((t for t in leaves(sample) if t.dim() >= 2), None)
    if tokens is None:
        raise ConfigError("plan 'auto' needs sample= with (batch, sequence) token tensors to size activations")
    return int(tokens.shape[1])


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
    result = search(spec, Cluster.local(world), replica_batch=batch_size(sample), seq_len=_sequence_length(sample),
                    top=1, context_parallel=isinstance(sample, dict))
    if not result:
        raise ConfigError(f"no layout of {spec.name} on {world} local ranks is predicted to fit in memory "
                          f"({result.evaluated} evaluated); use a smaller batch or more ranks")
    best = result[0]
    return best.config, best.plan
