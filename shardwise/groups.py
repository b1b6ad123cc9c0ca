"""The running topology and collectives on its named groups, for parallel code inside a model.

A layer that needs the tp group (a hand-written parallel layer, an MoE dispatch) calls
`sw.current_topology()` in its forward, or `sw.reduce / sw.gather / sw.split` with a
group name. The topology is the one of the `ParallelModule` whose step (train_step,
infer_step, a forward, or `parallelize` itself) is running: a context variable set for that
call's duration, not a process-wide "last parallelized" global, so two parallel modules in
one program each see their own. Outside such a call pass the topology explicitly; on a single
process running no parallel step (the model's own forward) the helpers are the identity, so
the same model code runs unparallelized.

The helpers are differentiable with DTensor's semantics: `reduce` sums partial values into
a replicated one (its gradient is passed through), `gather` joins shards into a replicated
tensor (its gradient is this rank's slice), `split` takes this rank's shard of a replicated
tensor (its gradient is all-gathered). So a row-parallel product is
`sw.reduce(sw.split(x, "tp", -1) @ sw.split(w, "tp", 1).T, "tp")`, with x's and w's
gradients whole on every rank.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial, Replicate, Shard

from .errors import ConfigError
from .parallel.collectives import redistribute
from .topology import Topology

_RUNNING: contextvars.ContextVar[Topology | None] = contextvars.ContextVar("shardwise_topology", default=None)


@contextlib.contextmanager
def running(topology: Topology) -> Iterator[None]:
    """Make `topology` the current one for the body (a ParallelModule's step)."""
    token = _RUNNING.set(topology)
    try:
        yield
    finally:
        _RUNNING.reset(token)


def current_topology(topology: Topology | None = None) -> Topology:
    """The topology of the parallel module whose step is running (or `topology`, if given)."""
    found = topology if topology is not None else _RUNNING.get()
    if found is None:
        raise ConfigError("sw.current_topology(): no parallel step is running (it is set during parallelize, "
                          "train_step, infer_step and a pmodel(...) forward); outside one, pass pmodel.topology "
                          "explicitly")
    return found


def _group(name: str, topology: Topology | None):
    """The named group of the running (or given) topology; None on a single process that runs
    no parallel step (the model's plain forward: every helper is then the identity)."""
    if topology is None and _RUNNING.get() is None and (not dist.is_initialized() or dist.get_world_size() == 1):
        return None
    dims = tuple(name.split("+"))  # "dp+cp": the group spanning both
    return current_topology(topology).group(*dims)


def reduce(tensor: torch.Tensor, group: str, op: str = "sum", topology: Topology | None = None) -> torch.Tensor:
    """The sum (op="sum") or mean (op="mean") of `tensor` over the named group, on every rank."""
    if op not in ("sum", "mean"):
        raise ConfigError(f"reduce(op={op!r}): use 'sum' or 'mean' (the differentiable reductions)")
    process_group = _group(group, topology)
    if process_group is None:
        return tensor
    total = redistribute(tensor, Partial(), Replicate(), process_group)
    return total / process_group.size() if op == "mean" else total


def gather(tensor: torch.Tensor, group: str, dim: int = -1, topology: Topology | None = None) -> torch.Tensor:
    """Every rank's `tensor` of the named group concatenated along `dim`, in rank order."""
    process_group = _group(group, topology)
    return tensor if process_group is None else redistribute(tensor, Shard(dim), Replicate(), process_group)


def split(tensor: torch.Tensor, group: str, dim: int = -1, topology: Topology | None = None) -> torch.Tensor:
    """This rank's equal slice of `tensor` along `dim` within the named group."""
    process_group = _group(group, topology)
    return tensor if process_group is None else redistribute(tensor, Replicate(), Shard(dim), process_group)
