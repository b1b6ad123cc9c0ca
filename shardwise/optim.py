"""`build_optimizer`: any torch optimizer, made aware of the ParallelModule it updates.

The returned object is an instance of the requested optimizer class (constructed as a
subclass of it with `ParallelOptimizer` mixed in), so learning-rate schedulers,
`state_dict()` and user code that checks types keep working. `step()` first completes any pending gradient synchronization; `zero_grad()`
zeroes the gradient buckets in place; `clip_grad_norm()` clips by the global norm.

`refuse_plain_optimizers`: a torch optimizer built without `build_optimizer` over parameters
whose gradients shardwise keeps outside `.grad` would read None and update nothing; it is
refused at its first step instead.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .comm import trace_range
from .errors import CheckpointError, ConfigError, ShardwiseError
from .global_hooks import hooks_while_alive
from .loss_scale import LossScaler
from .module import ParallelModule
from .tensors import is_sharded

PART_KEY = "shardwise part"  # in ParallelOptimizer.state_dict(): which part of the state it holds

# Optimizers whose update of an element reads only that element's gradient and state: exact
# on any shard of a parameter. Others (Adafactor's row/column statistics, Muon's
# orthogonalization, LBFGS) need the whole parameter.
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.Adagrad,
               torch.optim.Adadelta, torch.optim.RMSprop, torch.optim.Rprop, torch.optim.NAdam, torch.optim.RAdam,
               torch.optim.ASGD)


class ParallelOptimizer:
    """Mixed in before the user's optimizer class; `_pmodel` is the module it updates.

    The optimizer's tensors are `pmodel.optimizer_params` pieces: the parameters themselves, this
    rank's shard of them (ZeRO), or float32 master copies (mixed precision).
    """

    def __init__(self, params: Any, *args: Any, pmodel: ParallelModule, loss_scaler: LossScaler | None = None,
                 **kwargs: Any) -> None:
        self._pmodel = pmodel
        self.loss_scaler = loss_scaler
        self._found_inf: bool | None = None  # this step's verdict once its gradients are unscaled
        super().__init__(params, *args, **kwargs)  # type: ignore[call-arg]

    def _unscale(self, ready: Callable[[], None]) -> bool:
        """With a loss scaler: check every rank's gradients for inf/NaN and, if clean, divide
        them by the scale (once per step). Returns whether the step must be skipped."""
        if self.loss_scaler is None:
            return False
        if self._found_inf is None:
            params = self._pmodel.optimizer_params
            self._found_inf = params.nonfinite(before_collectives=ready)
            if not self._found_inf:
                inverse = 1.0 / self.loss_scaler.scale  # a power of two: exact
                for grad in params.grads():
                    grad.mul_(inverse)
        return self._found_inf

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        pmodel = self._pmodel
        pending = pmodel.gradients.pending
        communicates = pending or pmodel.config.zero > 0 or self.loss_scaler is not None
        with pmodel.metrics.optimizer_step(), trace_range("optimizer.step"), \
                pmodel.collective("optimizer.step", communicates=communicates) as ready:
            if pending:
                ready()
                pmodel.gradients.finish()
                pmodel.after_sync()
            pmodel.optimizer_params.load_grads()
            skip = self._unscale(ready)
            result = None
            if not skip:
                result = self._base_step(closure)
                pmodel.optimizer_params.write_back(before_collectives=ready)
            if self.loss_scaler is not None:
                self.loss_scaler.update(skip)
                self._found_inf = None
            return result

    def _base_step(self, closure: Callable[[], Any] | None) -> Any:
        """The user's optimizer's own step, without torch's hook wrapper: torch wraps `step` of
        every optimizer class it instantiates, so once a plain instance of the same class exists
        the base's step is wrapped too, and the wrapper around this class's step has already run
        the step hooks and opened the profiler range (a second pass ran each hook twice)."""
        step = super().step.__func__  # type: ignore[misc]
        if getattr(step, "hooked", False):
            step = step.__wrapped__
        if self._pmodel.tensor_parallel is None:
            return step(self, closure)
        # tp's sharded parameters are DTensors, its replicated ones plain tensors: a foreach or fused
        # step (torch's default on CUDA) takes them in one list, which DTensor refuses as mixed
        # unless the plain ones count as replicated
        with implicit_replication():
            return step(self, closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._found_inf = None
        self._pmodel.zero_grad(set_to_none)

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """torch.amp.GradScaler reads this in `scaler.step(optimizer)` before it checks and
        unscales the optimizer's gradients one rank at a time. That is right where every optimizer
        tensor is a whole parameter with the same reduced `.grad` on every rank; elsewhere ranks
        would skip steps apart or never see a gradient (an AssertionError or a DTensor error deep in
        GradScaler), so it is refused here, naming shardwise's scaler. The value is torch's own
        (fused optimizers set it True)."""
        problem = self._grad_scaler_problem()
        if problem is not None:
            raise ConfigError(
                f"torch.amp.GradScaler steps this {type(self).__name__}, but {problem}. Use shardwise's scaler, "
                "which checks every rank's gradients in one all-reduce: sw.build_optimizer(pmodel, ..., "
                "loss_scaler=sw.LossScaler()) and no GradScaler (train_step scales the loss; with a plain "
                "backward multiply it by optimizer.loss_scaler.scale)")
        return self.__dict__.get("_amp_scaling_in_step", False)

    @_step_supports_amp_scaling.setter
    def _step_supports_amp_scaling(self, value: bool) -> None:
        self.__dict__["_amp_scaling_in_step"] = value

    def _grad_scaler_problem(self) -> str | None:
        pmodel = self._pmodel
        if self.loss_scaler is not None:
            return "it already scales the loss with its own sw.LossScaler (float16 attaches one)"
        if not pmodel.optimizer_params.in_place:
            held = (f"this rank's shards of the parameters (zero={pmodel.config.zero})" if pmodel.config.zero
                    else "float32 master copies of the parameters")
            return f"it updates {held}, whose gradients GradScaler never sees"
        if pmodel.pipeline is not None or pmodel.expert_parallel is not None:
            return "each rank holds the gradients of its own pipeline stages or experts, so ranks would skip steps apart"
        if any(isinstance(p, DTensor) for p in pmodel.parameters()):
            return "its tensor-parallel parameters are DTensors, which GradScaler cannot unscale"
        return None

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale gradients so their global `norm_type`-norm is at most `max_norm`; return the norm.

        The norm is that of all gradients as one vector, every shard and stage counted once:
        what `torch.nn.utils.clip_grad_norm_` returns on one process.
        """
        pmodel = self._pmodel
        with pmodel.collective("clip_grad_norm") as ready:
            if pmodel.gradients.pending:
                ready()
                pmodel.gradients.finish()
                pmodel.after_sync()
            if self._unscale(ready):  # inf/NaN: the step will be skipped; the norm says so, as torch's does
                return torch.tensor(float("inf"), device=pmodel.topology.device)
            total = pmodel.optimizer_params.gradient_norm(norm_type, before_collectives=ready)
            pmodel.metrics.grad_norm(total)
            coefficient = (max_norm / (total + 1e-6)).clamp(max=1.0)  # as torch.nn.utils.clip_grad_norm_
            for grad in self._pmodel.optimizer_params.grads():
                grad.mul_(coefficient.to(grad.dtype))
            return total

    def scale_grads(self, factor: float) -> None:
        """Multiply every (synchronized) gradient by `factor`."""
        self._pmodel.finish_gradient_sync()
        for grad in self._pmodel.optimizer_params.grads():
            grad.mul_(factor)

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict of this rank's part of the state (its ZeRO or tensor-parallel
        shards, pipeline stages or experts), marked with which part (`OptimizerParams.part`)."""
        state = super().state_dict()
        state[PART_KEY] = self._pmodel.optimizer_params.part()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, where `state_dict` holds this rank's part of the state. Rank 0's file
        loaded on every rank (a DDP habit) gave tp rank 1 rank 0's moments for the other half of
        each sharded weight, without a word; now any rank given another part (or one that does
        not say, where parts differ) refuses, and every rank raises the same error."""
        mine = self._pmodel.optimizer_params.part()
        theirs = state_dict.get(PART_KEY) if isinstance(state_dict, dict) else None
        problem = None
        if theirs != mine and (theirs is not None or mine != "whole parameters"):
            problem = CheckpointError(
                f"optimizer.load_state_dict: the state holds {theirs or 'a part it does not name'}, this rank "
                f"holds {mine}; state_dict() is each rank's own part. Save every rank's (one file each) and "
                "load each on its rank, or save optimizer.full_state_dict() (whole, keyed by names) and load it "
                "with optimizer.load_full_state_dict() into any layout (sw.save_checkpoint does it for you)")
        with self._pmodel.coordinator.operation("optimizer.load_state_dict", problem):
            super().load_state_dict({k: v for k, v in state_dict.items() if k != PART_KEY})

    def full_state_dict(self) -> dict[str, Any]:
        """The whole optimizer state keyed by the original module's parameter names, on every
        rank: {"state": {name: {...}}, "param_groups": [{..., "params": [names]}]}. Collective."""
        from .checkpoint.optimizer_state import full_optimizer_state

        return full_optimizer_state(self._pmodel, self)

    def load_full_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a whole optimizer state: `full_state_dict()`'s form, or torch's own (integer ids,
        a one-process `optimizer.state_dict()` or `shardwise merge --optimizer`'s file) from an
        optimizer with the same parameter groups. Collective; checked on every rank first."""
        from .checkpoint.optimizer_state import load_full_optimizer_state

        load_full_optimizer_state(self._pmodel, self, state_dict)

    def register_reduce_hook(self, pre: Callable[[torch.Tensor], None] | None = None,
                             post: Callable[[torch.Tensor], None] | None = None) -> None:
        """Call `pre(grads)` on each gradient bucket before its collective and `post(grads)` on
        the reduced result after it (the whole bucket, or this rank's shard under ZeRO); both
        may modify the tensor in place, e.g. scale down before and back up after. Under ZeRO-2/3
        a step of several microbatches reduces each (`pre` on each), `post` sees their sum."""
        if pre is not None:
            self._pmodel.gradients.pre_hooks.append(pre)
        if post is not None:
            self._pmodel.gradients.post_hooks.append(post)


def build_optimizer(pmodel: ParallelModule, optimizer_class: Callable[..., torch.optim.Optimizer],
                    **kwargs: Any) -> torch.optim.Optimizer:
    """An optimizer over `pmodel`'s parameters, e.g. `build_optimizer(pm, torch.optim.AdamW, lr=3e-4)`.

    `optimizer_class` is a `torch.optim.Optimizer` subclass, or `functools.partial` of one
    (its bound arguments are kept). Pass `params=[{"params": [...], "lr": ...}, ...]` for parameter groups; they must be
    parameters of `pmodel`. `loss_scaler`: a `sw.LossScaler` (default: one when param_dtype is
    float16, else None), whose scale train_step multiplies the loss by; steps with inf/NaN
    gradients are then skipped (loss_scale.py).

    Where the optimizer sees parts of parameters (ZeRO shards, tensor-parallel shards), only
    element-wise optimizers compute what they compute on one process: torch's SGD, Adam(W),
    Adamax, Adagrad, Adadelta, RMSprop, Rprop, NAdam, RAdam, ASGD and their subclasses. Others
    (Adafactor, Muon, LBFGS) are refused there; `elementwise=True` vouches for one of your own.
    """
    if not isinstance(pmodel, ParallelModule):
        raise ShardwiseError(
            f"build_optimizer needs the ParallelModule returned by sw.parallelize, got {type(pmodel).__name__}; "
            "call sw.build_optimizer(pmodel, ...) with the parallelized module"
        )
    loss_scaler = kwargs.pop("loss_scaler", LossScaler() if pmodel.config.param_dtype == torch.float16 else None)
    if loss_scaler is not None and not isinstance(loss_scaler, LossScaler):
        raise ShardwiseError(f"build_optimizer(loss_scaler={loss_scaler!r}): give a sw.LossScaler(...) or None")
    if loss_scaler is not None and pmodel.loss_scaler is not None:
        raise ShardwiseError("build_optimizer: this ParallelModule already has an optimizer with a loss scaler; "
                             "one loss scale drives train_step, so build one optimizer with parameter groups")
    elementwise = kwargs.pop("elementwise", None)
    params = kwargs.pop("params", None)
    if params is None:
        params = [p for p in pmodel.parameters() if p.requires_grad]
    else:
        params = list(params)
        _check_params_belong(pmodel, params)
    groups = [g if isinstance(g, dict) else {"params": [g]} for g in params] if params and isinstance(params[0], dict) \
        else [{"params": list(params)}]
    base, bound_args, bound_kwargs = optimizer_class, (), {}
    if isinstance(optimizer_class, functools.partial):
        base, bound_args, bound_kwargs = optimizer_class.func, optimizer_class.args, optimizer_class.keywords
    if not (isinstance(base, type) and issubclass(base, torch.optim.Optimizer)):
        raise ShardwiseError(
            f"build_optimizer: {getattr(base, '__name__', base)!r} is not a torch.optim.Optimizer subclass; pass the "
            "optimizer class and its arguments (sw.build_optimizer(pm, torch.optim.AdamW, lr=3e-4)), or "
            "functools.partial(OptimizerClass, ...) for bound arguments"
        )
    _check_shards_fit(pmodel, base, elementwise)
    parallel_class = type(base.__name__, (ParallelOptimizer, base), {"__module__": base.__module__})
    optimizer = parallel_class(pmodel.optimizer_params.param_groups(groups), *bound_args, pmodel=pmodel,
                               loss_scaler=loss_scaler, **{**bound_kwargs, **kwargs})
    pmodel.optimizers.append(optimizer)
    pmodel.loss_scaler = loss_scaler if loss_scaler is not None else pmodel.loss_scaler
    return optimizer


def _check_shards_fit(pmodel: ParallelModule, base: type, elementwise: bool | None) -> None:
    """Refuse an optimizer that needs whole parameters where it would get parts of them."""
    if elementwise if elementwise is not None else issubclass(base, ELEMENTWISE):
        return
    tp_sharded = [name for name, param in pmodel.named_parameters() if is_sharded(param)]
    zero = pmodel.optimizer_params.zero.stage  # after parallelize's downgrade: 0 with one replica
    if zero or tp_sharded:
        c = pmodel.config
        parts = ([f"ZeRO-{zero} shards over {pmodel.topology.size('dp')} replicas"] if zero else []) + \
                ([f"tensor parallelism shards {len(tp_sharded)} parameters, e.g. {tp_sharded[:3]}"] if tp_sharded else [])
        raise ConfigError(
            f"build_optimizer: {base.__name__} is not an element-wise optimizer (its update reads a whole parameter: "
            f"row/column statistics, orthogonalization), but in this layout (zero={c.zero}, tp={c.tp}) it would get "
            f"parts of parameters ({'; '.join(parts)}) and compute something else than on one process. Use zero=0 "
            "and no tensor-parallel sharding with it (dp, pp and cp keep parameters whole), an element-wise "
            "optimizer (AdamW, SGD, ...), or pass elementwise=True if yours is one")


def _check_params_belong(pmodel: nn.Module, params: list[Any]) -> None:
    own = {id(p) for p in pmodel.parameters()}
    for group in params:
        tensors = group["params"] if isinstance(group, dict) else [group]
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        for tensor in tensors:
            if id(tensor) not in own:
                raise ShardwiseError(
                    f"a parameter of shape {tuple(tensor.shape)} passed to build_optimizer is not a parameter of "
                    "the ParallelModule; build parameter groups from pmodel.named_parameters()"
                )


def refuse_plain_optimizers(pmodel: ParallelModule) -> None:
    """Make a torch optimizer not built with `build_optimizer` raise at `step()` if it holds a
    parameter of `pmodel` whose gradient lives outside `.grad`: ZeRO's shards, or the float32
    buckets of low-precision parameters reduced in float32. Such an optimizer would find
    `.grad` None and silently update nothing.

    torch calls global step pre-hooks for every optimizer; this one costs one set test over
    the optimizer's parameters a step, is registered only where such gradients exist, and is
    retired when `pmodel` is collected (it holds no reference to it; global_hooks.py)."""
    held = {id(p) for p in pmodel.gradients.outside_grad()}
    if not held:
        return
    where = pmodel.gradients.apart()
    names = {id(p): name for name, p in pmodel.module.named_parameters() if id(p) in held}

    def refuse(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if isinstance(optimizer, ParallelOptimizer):
            return
        for group in optimizer.param_groups:
            if not held.isdisjoint(map(id, group["params"])):
                name = next(names[id(p)] for p in group["params"] if id(p) in held)
                raise ConfigError(
                    f"{type(optimizer).__name__} (a plain torch optimizer) steps parameters of a ParallelModule, "
                    f"e.g. {name!r}, whose gradients it cannot see (they live {where}), so it would update nothing. Build it "
                    f"with sw.build_optimizer(pmodel, torch.optim.{type(optimizer).__name__}, ...) instead")

    hooks_while_alive(pmodel, [register_optimizer_step_pre_hook(refuse)])
