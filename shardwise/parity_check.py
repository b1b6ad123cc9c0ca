"""`sw.check` / `shardwise check`: the user's model trained on one process and in a layout.

Our own proof of correctness, offered for the user's model, plan and layout: the model (built
from a factory under the same seed everywhere) trains `steps` SGD steps on this process on
the whole batches, and on `ranks` local processes (`testing.run_on_ranks`, real collectives)
with `parallelize(model, config, plan)`, each replica on its slice. Compared per module
(parameter group): the first step's gradients, relative to the group's largest gradient
element; the final parameters, relative to how far the group's parameters moved on one
process; and every step's loss. The verdict holds when every difference is within the
tolerance.

Tolerance. What differs between the runs is the order of floating-point sums; in float32
that moves a gradient by ~1e-6..1e-4 of its scale (tests/parity.py derives 2e-3 as a hard
bound for small models), while every fault we know of (a missing reduction, a sum taken for
a mean, a lost microbatch, a wrong sharding) moves it by 1e-1 or more. The default, 1e-2,
sits between; under bf16/fp16 compute rounding itself is ~1e-2, so the default is 5e-2.
Plain SGD without momentum judges the parameters: it moves them linearly in the gradients,
so no rounding is amplified (Adam would divide by a gradient's own magnitude).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from .batch import batch_size, loss_of, split_batch
from .config import ParallelConfig
from .errors import ConfigError
from .tensors import tensor_leaves, whole
from .progress import progress

FLOAT_TOLERANCE = 1e-2
HALF_TOLERANCE = 5e-2


@dataclass
class GroupDifference:
    """One module's parameters: worst relative gradient and parameter differences."""

    name: str
    grad: float
    param: float


@dataclass
class CheckReport:
    """What `check` measured; `ok` is the verdict."""

    tolerance: float
    losses: list[tuple[float, float]]  # (one process, layout) per step
    groups: list[GroupDifference] = field(default_factory=list)

    @property
    def worst_loss(self) -> float:
        return max((abs(got - want) / max(abs(want), 1e-12) for want, got in self.losses), default=0.0)

    @property
    def ok(self) -> bool:
        return self.worst_loss <= self.tolerance and all(
            g.grad <= self.tolerance and g.param <= self.tolerance for g in self.groups)

    def table(self, rows: int = 15) -> str:
        """The losses, the worst `rows` groups and the verdict, as text."""
        lines = ["step  one process      layout         rel diff"]
        for step, (want, got) in enumerate(self.losses):
            lines.append(f"{step:>4}  {want:<14.7g} {got:<14.7g} {abs(got - want) / max(abs(want), 1e-12):.2e}")
        worst = sorted(self.groups, key=lambda g: -max(g.grad, g.param))[:rows]
        lines.append(f"{'parameter group':<48} {'grad diff':>10} {'param diff':>10}   (relative; worst {len(worst)} "
                     f"of {len(self.groups)})")
        for g in worst:
            flag = "" if max(g.grad, g.param) <= self.tolerance else "   <-- differs"
            lines.append(f"{g.name:<48} {g.grad:>10.2e} {g.param:>10.2e}{flag}")
        verdict = "agree" if self.ok else "DISAGREE"
        lines.append(f"verdict: {verdict} (tolerance {self.tolerance:g}; loss worst {self.worst_loss:.2e})")
        return "\n".join(lines)


def resolve(spec: Callable | str) -> Callable:
    """A callable, or `package.module:name` imported."""
    if callable(spec):
        return spec
    module_name, _, attr = str(spec).partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"cannot import {spec!r} ({exc}); give package.module:name importable from here") from None


def _build(model: Callable, seed: int) -> nn.Module:
    torch.manual_seed(seed)  # the same initial values on every process
    factory = resolve(model)
    try:
        built = factory()
    except Exception as exc:  # noqa: BLE001 - the user's factory: any failure is theirs, named
        raise ConfigError(f"check: the model factory {getattr(factory, '__name__', factory)!r} raised "
                          f"{type(exc).__name__}: {exc}; give a function that builds the model with no "
                          "arguments") from exc
    if not isinstance(built, nn.Module):
        raise ConfigError(f"check: the model factory {getattr(factory, '__name__', factory)!r} returned a "
                          f"{type(built).__name__}, not a torch.nn.Module")
    return built


def _checked_batches(data: Any) -> list:
    """The batches as a list of tensors or containers of tensors, or a ConfigError naming the first bad one."""
    if not isinstance(data, (list, tuple)):
        raise ConfigError(f"check: batches must be a list of batches (or a factory returning one), got "
                          f"{type(data).__name__}")
    for i, batch in enumerate(data):
        if not tensor_leaves(batch):
            raise ConfigError(f"check: batch {i} is a {type(batch).__name__} holding no tensor; each batch is what "
                              "the model's forward takes: a tensor, or a dict/tuple of tensors")
    return list(data)


def _whole(t: torch.Tensor) -> torch.Tensor:
    return whole(t).detach().cpu().double()


def _one_process(model, batches: list, lr: float, seed: int):
    module = _build(model, seed)
    initial = {k: v.detach().double().clone() for k, v in module.state_dict().items()}
    opt = torch.optim.SGD(module.parameters(), lr=lr)
    losses, grads = [], None
    for batch in progress(batches, "check: one process", unit="step"):
        loss = loss_of(module(batch))
        loss.backward()
        if grads is None:
            grads = {n: p.grad.detach().double().clone() for n, p in module.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, grads, initial, {k: v.detach().double() for k, v in module.state_dict().items()}


def _in_layout(model, batches: list, config: ParallelConfig, plan: Any, lr: float, seed: int):
    import torch.distributed as dist

    from .build import parallelize
    from .module import data_parallel_info
    from .optim import build_optimizer

    pm = parallelize(_build(model, seed), config, plan=plan, sample=None)
    opt = build_optimizer(pm, torch.optim.SGD, lr=lr)
    index, count = data_parallel_info(pm)
    losses, grads = [], None
    for batch in progress(batches, f"check: {dist.get_world_size()} ranks", unit="step"):
        losses.append(float(pm.train_step(split_batch(batch, count)[index])))
        if grads is None:
            grads = {k: _whole(v) for k, v in pm.full_grad_dict().items()}
        opt.step()
        opt.zero_grad()
    final = {k: _whole(v) for k, v in pm.full_state_dict().items()}
    return (losses, grads, final) if dist.get_rank() == 0 else None


def _relative(diff: float, scale: float) -> float:
    return diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))


def check(model: Callable | str, batches: Callable | str | list, config: ParallelConfig, *, ranks: int,
          plan: Any = None, steps: int = 3, lr: float = 1e-2, tolerance: float | None = None,
          seed: int = 0) -> CheckReport:
    """Train `model()` (a factory, or "pkg.module:factory") on one process and on `ranks`
    local processes laid out by `config` and `plan`, on the first `steps` global batches of
    `batches` (a list, or a factory returning one), and compare. See the module docstring."""
    from .testing import run_on_ranks

    if tolerance is None:
        tolerance = HALF_TOLERANCE if config.param_dtype in (torch.bfloat16, torch.float16) else FLOAT_TOLERANCE
    data = _checked_batches(resolve(batches)() if not isinstance(batches, list) else batches)
    if len(data) < steps:
        raise ConfigError(f"check: {steps} steps need {steps} batches, the batches give {len(data)}")
    data = data[:steps]
    replicas = config.resolve(ranks).dp
    for i, batch in enumerate(data):
        if batch_size(batch) % replicas:
            raise ConfigError(f"check: batch {i} has {batch_size(batch)} samples, which the {replicas} data-parallel "
                              f"replicas of this layout on {ranks} ranks cannot share equally; give batches whose size "
                              f"is a multiple of {replicas}")
    want_losses, want_grads, initial, want_final = _one_process(model, data, lr, seed)
    got_losses, got_grads, got_final = run_on_ranks(_in_layout, ranks, model, data, config, plan, lr, seed)[0]
    report = CheckReport(tolerance, list(zip(want_losses, got_losses)))
    groups: dict[str, list[str]] = {}
    for name in want_grads:
        groups.setdefault(name.rpartition(".")[0] or "(root)", []).append(name)
    for group, names in groups.items():
        grad_scale = max(float(want_grads[n].abs().max()) for n in names)
        grad_diff = max(float((got_grads[n] - want_grads[n]).abs().max()) if n in got_grads else float("inf")
                        for n in names)
        moved = max(float((want_final[n] - initial[n]).abs().max()) for n in names)
        param_diff = max(float((got_final[n] - want_final[n]).abs().max()) for n in names)
        report.groups.append(GroupDifference(group, _relative(grad_diff, grad_scale), _relative(param_diff, moved)))
    return report
