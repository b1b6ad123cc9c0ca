"""`resolve_plan`: a Plan's patterns expanded to the concrete names of one module, checked.

Glob patterns match one path segment per `*` (`layers.*.mlp.fc1.weight`); a key written
`re:...` is a full regular expression. Every pattern must match something: a typo is an
error that lists the closest real names, never a silently replicated layer. Placements are
checked against the tensors they shard and the tp degree before any rank communicates.
"""

from __future__ import annotations

import difflib
import inspect
import re
from dataclasses import dataclass, field

from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from ..errors import PlanError
from .plan import Plan, check_pattern, placement_str, shard_dim
from .stages import inside


@dataclass
class ResolvedPlan:
    """A plan applied to one module: concrete parameter names and module paths."""

    plan: Plan
    params: dict[str, Placement] = field(default_factory=dict)  # every name of a sharded or listed param
    inputs: dict[str, tuple[Placement | None, ...]] = field(default_factory=dict)  # module path -> per input
    outputs: dict[str, tuple[Placement | None, ...]] = field(default_factory=dict)
    loss_parallel: set[str] = field(default_factory=set)
    divide_by_tp: list[tuple[str, str]] = field(default_factory=list)  # (module path, attribute)
    recompute: list[str] = field(default_factory=list)


def _regex(pattern: str, root: str) -> re.Pattern:
    prefix = root + "." if root else ""
    if pattern.startswith("re:"):
        check_pattern(pattern)
        return re.compile(re.escape(prefix) + pattern[3:])
    parts = [r"[^.]+" if seg == "*" else re.escape(seg) for seg in pattern.split(".")]
    return re.compile(re.escape(prefix) + r"\.".join(parts))


def _roots(module: nn.Module, plan: Plan) -> list[str]:
    if plan.applies_to is None:
        return [""]
    # a subclass (a model whose forward a user changed, e.g. to return a token count) keeps its base's layout
    roots = [path for path, m in module.named_modules()
             if any(c.__name__ == plan.applies_to for c in type(m).__mro__)]
    if not roots:
        found = sorted({type(m).__name__ for _, m in module.named_modules()})
        raise PlanError(
            f"plan {plan.name or ''!r} applies to {plan.applies_to} modules, but {type(module).__name__} contains "
            f"none (it contains {', '.join(found[:12])}); pick the plan for your model class"
        )
    return roots


def _expand(pattern: str, names: list[str], roots: list[str], what: str, owner: str) -> list[str]:
    matched = [n for root in roots for n in names if _regex(pattern, root).fullmatch(n)]
    if not matched:
        probe = pattern[3:] if pattern.startswith("re:") else pattern.replace("*", "0")
        probe = f"{roots[0]}.{probe}" if roots[0] else probe
        close = difflib.get_close_matches(probe, names, n=4, cutoff=0.3)
        raise PlanError(
            f"plan {what} {pattern!r} matches no {what} of {owner}; closest names: {', '.join(close) or '(none)'}"
        )
    return matched


def _check_param(name: str, shape: tuple[int, ...], placements: tuple[Placement, ...], tp: int) -> Placement:
    if len(placements) != 1:
        raise PlanError(
            f"parameter {name!r} has {len(placements)} placements {[placement_str(p) for p in placements]} but "
            "parameters are sharded over one mesh dim (tp); give exactly one placement, e.g. [Shard(0)]"
        )
    placement = placements[0]
    if isinstance(placement, Partial):
        raise PlanError(f"parameter {name!r} cannot be Partial(); use Shard(d) or Replicate()")
    if shard_dim(placement) is not None:
        dim = placement.dim if placement.dim >= 0 else placement.dim + len(shape)
        if not 0 <= dim < len(shape):
            raise PlanError(
                f"{placement_str(placement)} on parameter {name!r} of shape {shape}: it has only {len(shape)} dims"
            )
        blocks = placement.split_factor if isinstance(placement, _StridedShard) else 1
        if shape[dim] % (tp * blocks):
            raise PlanError(
                f"parameter {name!r} of shape {shape} cannot be {placement_str(placement)} over tp={tp}: "
                f"dim {dim} has size {shape[dim]}, not divisible by {tp * blocks}; "
                "choose a tp that divides it or leave this parameter replicated"
            )
        placement = type(placement)(dim, split_factor=blocks) if blocks > 1 else Shard(dim)
    return placement


def _input_count(module: nn.Module) -> int | None:
    """How many tensor inputs forward can take, or None when unbounded (*args)."""
    params = list(inspect.signature(module.forward).parameters.values())
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return None
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in params)


def resolve_plan(plan: Plan, module: nn.Module, tp: int) -> ResolvedPlan:
    """Expand `plan` against `module` for `tp` ranks; `PlanError` on anything that does not fit."""
    modules = dict(module.named_modules())
    _check_parts(plan.parts, modules)
    roots = _roots(module, plan)
    if plan.applies_to is not None and plan.parts:
        roots = [r for r in roots if inside(r, plan.parts)]
        if not roots:
            raise PlanError(f"plan {plan.name or ''} applies to every {plan.applies_to}, and parts {plan.parts} hold "
                            "none; name the parts that contain it")
    resolved = ResolvedPlan(plan)
    _resolve_params(resolved, plan, module, roots, tp)
    _resolve_modules(resolved, plan, modules, roots, tp)
    if plan.parts:
        outside = [n for n, p in resolved.params.items() if not isinstance(p, Replicate) and not inside(n, plan.parts)]
        outside += [p for p in [*resolved.inputs, *resolved.outputs, *resolved.loss_parallel, *resolved.recompute,
                                *(path for path, _ in resolved.divide_by_tp)] if not inside(p, plan.parts)]
        if outside:
            raise PlanError(f"the plan parallelizes {sorted(set(outside))[:4]} outside parts {plan.parts}, which stay "
                            "replicated; add their module to parts or drop those entries")
    return resolved


def _resolve_params(resolved: ResolvedPlan, plan: Plan, module: nn.Module, roots: list[str], tp: int) -> None:
    """Each parameter's placement; tied parameters (one tensor) get one, whatever name the plan used."""
    owner = type(module).__name__
    params = dict(module.named_parameters(remove_duplicate=False))
    names = list(params)
    for pattern, placements in plan.params.items():
        for name in _expand(pattern, names, roots, "parameter", owner):
            placement = _check_param(name, tuple(params[name].shape), placements, tp)
            if resolved.params.get(name, placement) != placement:
                raise PlanError(
                    f"parameter {name!r} is given two placements: {placement_str(resolved.params[name])} "
                    f"and {placement_str(placement)}; keep one"
                )
            resolved.params[name] = placement
    by_tensor: dict[int, Placement] = {}
    for name, placement in resolved.params.items():
        previous = by_tensor.setdefault(id(params[name]), placement)
        if previous != placement:
            raise PlanError(f"tied parameter {name!r} is given two different placements; give both names the same")
    for name, param in params.items():
        if id(param) in by_tensor:
            resolved.params[name] = by_tensor[id(param)]


def _resolve_modules(resolved: ResolvedPlan, plan: Plan, modules: dict[str, nn.Module], roots: list[str],
                     tp: int) -> None:
    """What the plan says per module: activation placements, loss parallel, attributes
    divided by tp, recompute."""
    owner = type(modules[""]).__name__
    module_paths = [p for p in modules if p]
    for key, placements in plan.activations.items():
        path_pattern, kind = key.rsplit(".", 1)
        for path in _expand(path_pattern, module_paths, roots, "module", owner):
            if kind == "input":
                count = _input_count(modules[path])
                if count is not None and len(placements) > count:
                    raise PlanError(
                        f"activation {path + '.input'!r} gives {len(placements)} input placements but "
                        f"{type(modules[path]).__name__}.forward takes {count} input(s); give at most {count}"
                    )
            target = resolved.inputs if kind == "input" else resolved.outputs
            target[path] = placements
    for pattern in plan.loss_parallel:
        for path in _expand(pattern, module_paths, roots, "module", owner):
            resolved.loss_parallel.add(path)
    for pattern in plan.divide_by_tp:
        path_pattern, attr = pattern.rsplit(".", 1)
        for path in _expand(path_pattern, module_paths, roots, "module", owner):
            value = getattr(modules[path], attr, None)
            if not isinstance(value, int) or value % tp:
                raise PlanError(
                    f"attribute {path}.{attr} = {value!r} must be an integer divisible by tp={tp} to be divided by tp"
                )
            resolved.divide_by_tp.append((path, attr))
    for pattern in plan.recompute:
        resolved.recompute.extend(_expand(pattern, module_paths, roots, "module", owner))


def _check_parts(parts: list[str], modules: dict[str, nn.Module]) -> None:
    """Each part a submodule (not the root), none inside another."""
    for part in parts:
        if part not in modules or not part:
            close = difflib.get_close_matches(part, [m for m in modules if m], n=3)
            raise PlanError(f"parts: {part!r} is not a submodule of {type(modules['']).__name__}; "
                            f"closest: {', '.join(close) or '(none)'}")
    nested = [(a, b) for a in parts for b in parts if a != b and b.startswith(a + ".")]
    if nested or len(set(parts)) != len(parts):
        raise PlanError(f"parts {parts} repeat a module or name one inside another "
                        f"({nested[0][1]!r} in {nested[0][0]!r})" if nested else f"parts {parts} repeat a module")
