"""The running topology and collectives on its named groups, for parallel code inside a model.

A layer that needs the tp group (a hand-written parallel layer, an MoE dispatch) calls
`sw.current_topology()` in its forward, or `sw.reduce / sw.gather / sw.split` with a
group name. The topology is the one of the `ParallelModule` whose step (train_step,
infer_step, a forward, or `parallelize` itself) is running: a context variable set for that
call's duration, not a process-wide "last parallelized" global, so two parallel modules in
one program each see their own. Outside such a call pass the topology explicitly; on a single
process running no parallel step (the model's own forward) the helpers are the identity, so
the same model code runs unparallelized.

Their gradients follow from what the group's ranks compute after the collective:
- over tensor-parallel ranks ("tp"), the same loss: DTensor's semantics. `reduce` sums
  partial values into a replicated one (its gradient is passed through), `gather` joins
  shards (its gradient is this rank's slice), `split` takes this rank's shard of a replicated
  tensor (its gradient is all-gathered). So a row-parallel product is
  `sw.reduce(sw.split(x, "tp", -1) @ sw.split(w, "tp", 1).T, "tp")`, with x's and w's
  gradients whole on every rank.
- over data-parallel replicas or context-parallel shards ("dp", "cp", "dp+cp"), different
  losses, whose gradients shardwise then combines: a gradient reaching the output on any rank
  flows back to every rank's input (`reduce`'s backward sums, `gather`'s reduce-scatters), so
  batch statistics or in-batch negatives over the dp group get one process's gradient on the
  concatenated batch.
A group mixing the two kinds ("dp+tp") is refused: no single rule is right for it.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial, Replicate, Shard

from .errors import ConfigError
from .parallel.collectives import FUNCTIONAL, CollectiveOps, across_losses, polled_ops, redistribute
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


LOSS_DIMS = frozenset({"dp", "cp"})  # ranks computing different losses


def _group(name: str, topology: Topology | None, helper: str) -> tuple[Any, bool, CollectiveOps]:
    """(the named group of the running (or given) topology, whether its ranks compute
    different losses, the collectives to use); group None on a single process that runs no
    parallel step (the model's plain forward: every helper is then the identity).

    Eager, the collectives wait through the topology's coordinator, which polls: a helper
    called on some ranks only fails within seconds on each, naming where every rank waits
    (coordination.py), instead of at timeout_s. Compiled code gets the functional ones."""
    if topology is None and _RUNNING.get() is None and (not dist.is_initialized() or dist.get_world_size() == 1):
        return None, False, FUNCTIONAL
    dims = tuple(name.split("+"))  # "dp+cp": the group spanning both
    found = current_topology(topology)
    group = found.group(*dims)
    across = {d in LOSS_DIMS for d in dims}
    if len(across) > 1:
        raise ConfigError(f"group {name!r} mixes ranks that compute different losses (dp, cp) with ranks that compute "
                          "the same one (tp, pp): no one gradient rule fits both; call the helper once per kind, "
                          "e.g. sw.reduce(sw.reduce(x, 'tp'), 'dp')")
    if torch.compiler.is_compiling():
        ops = FUNCTIONAL
    else:
        found.coordinator.settle_deferred()  # the step's agreement, if it runs during the forward: first
        ops = polled_ops(found.wait, f"sw.{helper}(group={name!r})")
    return group, across == {True}, ops


def reduce(tensor: torch.Tensor, group: str, op: str = "sum", topology: Topology | None = None) -> torch.Tensor:
    """The sum (op="sum") or mean (op="mean") of `tensor` over the named group, on every rank."""
    if op not in ("sum", "mean"):
        raise ConfigError(f"reduce(op={op!r}): use 'sum' or 'mean' (the differentiable reductions)")
    process_group, across, ops = _group(group, topology, "reduce")
    if process_group is None:
        return tensor
    if across:
        total = across_losses(tensor, "sum", process_group, ops=ops)
    else:
        total = redistribute(tensor, Partial(), Replicate(), process_group, ops)
    return total / process_group.size() if op == "mean" else total


def gather(tensor: torch.Tensor, group: str, dim: int = -1, topology: Topology | None = None) -> torch.Tensor:
    """Every rank's `tensor` of the named group concatenated along `dim`, in rank order."""
    process_group, across, ops = _group(group, topology, "gather")
    if process_group is None:
        return tensor
    if across:
        return across_losses(tensor, "gather", process_group, dim, ops)
    return redistribute(tensor, Shard(dim), Replicate(), process_group, ops)


def split(tensor: torch.Tensor, group: str, dim: int = -1, topology: Topology | None = None) -> torch.Tensor:
    """This rank's equal slice of `tensor` along `dim` within the named group."""
    process_group, across, ops = _group(group, topology, "split")
    if process_group is None:
        return tensor
    if across:
        return across_losses(tensor, "split", process_group, dim, ops)
    return redistribute(tensor, Replicate(), Shard(dim), process_group, ops)
