"""A mixture of experts' load-balancing loss over the whole batch, as one process takes it.

transformers' auxiliary loss (Switch Transformer's: num_experts · Σ_e f_e · P_e, f_e the share
of token slots routed to expert e, P_e the mean router probability of e) is a product of two
means over the batch, so a replica that takes it over its own tokens computes another loss:
no averaging of replicas' losses gives one process's. transformers computes it from every
router's logits, recorded by forward hooks on the routers. Here a hook that runs before
those replaces each router's recorded logits with the logits of every data-parallel replica,
concatenated in rank order (the router's routing itself is unchanged), so each rank's loss
holds the whole batch's auxiliary loss. Its backward sums the ranks' gradients into each
replica's own rows (divided by the replica's weight, which its gradient buckets apply again:
the replicas' losses are combined with those weights, which sum to one).

The cp ranks join the gather (each routes its part of every sequence; the loss weights cp
applies to each shard's loss average to one over them, so the sum of their gradients is the
one-process gradient too), and so do the tp ranks when a sequence-parallel plan routes each
its own shard. Those tp peers hold the same loss, whose gradient for a row each computes: the
sum over them is divided by tp (the router's gradients, partial over tp, are then summed over
tp by the buckets). Tensor-parallel ranks routing the same tokens gather over dp and cp alone.

transformers also weighs that loss by the call's `attention_mask`, which is this replica's
only: the gathered rows and one replica's mask do not describe the same tokens. So a call
guard (`LossCallGuard`) on the model that adds the loss drops a mask that counts every token
(the loss is then the unmasked one the gathered rows give; the causal attention is the same),
and refuses a padded one; it also refuses `output_router_logits=True` passed per call to a
model whose config had it off when it was parallelized (its loss would be each replica's).

Under pp the loss is glue on the last stage: `RecordedRouterLogits` makes each unit hand its
routers' (gathered) logits out as extra outputs, which travel down the pipeline (program.py).
Each microbatch's loss is over the rows every replica routes in that microbatch, as under
gradient accumulation.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ...compat import all_gather_single, reduce_scatter_single
from ...errors import ModelError
from ...topology import Topology
from .experts import grouped_experts


class _RowsOverReplicas(torch.autograd.Function):
    """Every rank's rows concatenated (ranks may hold different numbers); backward: the sum of
    every rank's gradient for this rank's rows, divided by `weight()`."""

    @staticmethod
    def forward(ctx, x, group, wait, weight):
        size = dist.get_world_size(group)
        counts = torch.tensor([x.shape[0]], device=x.device)
        every = counts.new_empty(size)
        wait(all_gather_single(every, counts, group=group, async_op=True), "all-gather of router logit rows", group)
        rows = every.tolist()
        most = max(rows)
        padded = x.new_zeros((most, *x.shape[1:]))
        padded[:x.shape[0]] = x
        gathered = x.new_empty((size * most, *x.shape[1:]))
        wait(all_gather_single(gathered, padded.contiguous(), group=group, async_op=True),
             "all-gather of router logits", group)
        ctx.args = (group, wait, weight, rows, dist.get_rank(group))
        return torch.cat([gathered[r * most:r * most + n] for r, n in enumerate(rows)])

    @staticmethod
    def backward(ctx, grad):
        group, wait, weight, rows, rank = ctx.args
        most = max(rows)
        padded = grad.new_zeros((len(rows) * most, *grad.shape[1:]))
        start = 0
        for r, n in enumerate(rows):
            padded[r * most:r * most + n] = grad[start:start + n]
            start += n
        mine = grad.new_empty((most, *grad.shape[1:]))
        wait(reduce_scatter_single(mine, padded, group=group, async_op=True),
             "reduce-scatter of router logit gradients", group)
        w = weight()
        out = mine[:rows[rank]]
        return (out if w == 1.0 else out / w), None, None, None


def routers(module: nn.Module) -> dict[str, nn.Module]:
    """Path -> router, for each mixture-of-experts block holding grouped experts and a `gate`."""
    experts = {id(m) for m in grouped_experts(module).values()}
    found = {}
    for path, block in module.named_modules():
        gate, held = getattr(block, "gate", None), getattr(block, "experts", None)
        if isinstance(gate, nn.Module) and id(held) in experts:
            found[f"{path}.gate" if path else "gate"] = gate
    return found


def records_router_logits(module: nn.Module) -> bool:
    """Whether a transformers model inside `module` adds the load-balancing loss."""
    return any(getattr(getattr(m, "config", None), "output_router_logits", False) for m in module.modules())


class RouterLogitsOverReplicas:
    """The hooks that make each router's recorded logits the whole data-parallel batch's."""

    def __init__(self, module: nn.Module, topology: Topology, over_tp: bool = False):
        self.group = topology.group("dp", "cp", *(("tp",) if over_tp else ()))
        self.wait = topology.wait
        self.share = topology.sizes["tp"] if over_tp else 1  # ranks holding the same loss for a row
        self.replica_weight: Callable[[], float] = lambda: 1.0  # set by build once the gradient buckets exist
        self.routers = routers(module)
        for path, router in self.routers.items():
            router.register_forward_hook(self._hook(path), prepend=True)

    def _hook(self, path: str):
        def whole_batch(router: nn.Module, args: Any, out: Any) -> Any:
            logits = _logits_of(router, out, f"router {path!r} ({type(router).__name__})", "over the whole batch")
            return (_rows_over_replicas(logits, self.group, self.wait, lambda: self.replica_weight() * self.share),
                    *out[1:])
        return whole_batch


def _logits_of(router: nn.Module, out: Any, what: str, how: str) -> torch.Tensor:
    """A router's logits [tokens, experts], the first of what transformers' routers return."""
    if not isinstance(out, tuple) or not isinstance(out[0], torch.Tensor) or out[0].dim() != 2:
        raise ModelError(f"{what} did not return (logits [tokens, experts], ...) as transformers' routers do, so its "
                         f"load-balancing loss cannot be taken {how}; set output_router_logits=False")
    return out[0]


@torch.compiler.disable  # replicas' row counts decide the gather's sizes on the host: eager inside a compiled block
def _rows_over_replicas(x: torch.Tensor, group, wait, weight) -> torch.Tensor:
    return _RowsOverReplicas.apply(x, group, wait, weight)


class RecordedRouterLogits:
    """Each router's logits as its forward hands them on (gathered over replicas where the hooks
    above run first), taken between `start()` and `stop()`. Under pp the load-balancing loss is glue on
    the last stage, while the routers run on every stage: a stage returns its routers' logits as
    extra outputs of their unit call (pipeline/program.py), sent down the pipeline like hidden
    states, and their gradients come back the same way. On a capture's fake shadow, `rows` > 1
    repeats each router's rows as the real gather will hold them, so the loss's glue, specialized
    to the captured shapes, divides by the whole batch's row count."""

    def __init__(self, module: nn.Module, rows: int = 1):
        self.rows = rows
        self.taken: list[torch.Tensor] | None = None
        self.handles = [router.register_forward_hook(self._take, prepend=True)
                        for router in routers(module).values()]

    def _take(self, router: nn.Module, args: Any, out: Any) -> Any:
        if self.taken is None:
            return None
        logits = _logits_of(router, out, f"router {type(router).__name__}", "under pp")
        if self.rows > 1:
            logits = logits.repeat(self.rows, 1)
            out = (logits, *out[1:])
        self.taken.append(logits)
        return out if self.rows > 1 else None

    def start(self) -> None:
        self.taken = []

    def stop(self) -> list[torch.Tensor]:
        """The logits taken since `start`, in call order."""
        taken, self.taken = self.taken or [], None
        return taken

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def recorded_router_logits(module: nn.Module, rows: int = 1) -> RecordedRouterLogits | None:
    """The recorder where a model inside `module` adds the load-balancing loss, else None."""
    return RecordedRouterLogits(module, rows) if records_router_logits(module) and routers(module) else None


class LossCallGuard:
    """A forward pre-hook on each model that adds transformers' load-balancing loss (it holds
    `router_aux_loss_coef`): what a call may pass when several ranks route their own tokens."""

    def __init__(self, module: nn.Module, gathering: bool):
        self.gathering = gathering  # router logits are gathered (the config had output_router_logits on)
        for model in module.modules():
            if hasattr(model, "router_aux_loss_coef") and hasattr(getattr(model, "config", None), "output_router_logits"):
                names = [a.name for a in inspect.signature(type(model).forward).parameters.values()
                         if a.kind in (a.POSITIONAL_ONLY, a.POSITIONAL_OR_KEYWORD)][1:]
                position = names.index("attention_mask") if "attention_mask" in names else None
                model.register_forward_pre_hook(self._hook(type(model).__name__, position), with_kwargs=True)

    def _hook(self, name: str, position: int | None):
        def guard(model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            asked = kwargs.get("output_router_logits")
            if asked is None:
                asked = model.config.output_router_logits
            if not asked:
                return None
            if not self.gathering:
                raise ModelError(f"{name} was called with output_router_logits=True but its config had it off when it "
                                 "was parallelized, so its load-balancing loss would be each replica's, not the whole "
                                 "batch's: set config.output_router_logits=True before sw.parallelize")
            positional = position is not None and len(args) > position
            mask = args[position] if positional else kwargs.get("attention_mask")
            if mask is None:
                return None
            if not bool(torch.as_tensor(mask).bool().all()):
                raise ModelError(f"{name} was called with a padded attention_mask and its load-balancing loss on: "
                                 "transformers weighs the router logits, which shardwise gathers over the ranks routing "
                                 "their own tokens, by this rank's mask alone, which is not one process's loss. Pack the "
                                 "batch without padding, or set output_router_logits=False")
            if positional:  # every token counted: the unmasked loss, and the same causal attention
                return (*args[:position], None, *args[position + 1:]), kwargs
            return args, {**kwargs, "attention_mask": None}
        return guard


def apply_router_logits_over_replicas(module: nn.Module, topology: Topology,
                                      partial_over_tp: set[int] = frozenset()) -> RouterLogitsOverReplicas | None:
    """The hooks, where a model records router logits for its load-balancing loss and more than
    one rank routes its own tokens (`partial_over_tp`: ids of parameters run on tp shards of the
    data, the routers' among them under sequence parallelism); the call guard wherever a model
    could add that loss and more than one rank routes."""
    found = routers(module)
    over_tp = any(id(p) in partial_over_tp for router in found.values() for p in router.parameters())
    if not found or topology.size("dp", "cp") * (topology.sizes["tp"] if over_tp else 1) == 1:
        return None
    gathering = records_router_logits(module)
    LossCallGuard(module, gathering)
    return RouterLogitsOverReplicas(module, topology, over_tp) if gathering else None
