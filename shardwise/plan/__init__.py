"""Plans: placements by module-path pattern, stages, ZeRO stage and recompute, as data.

`sw.plan.search` and `sw.plan.evaluate` (the planner, shardwise/planner/), `sw.plan.register_rule` /
`RuleContext` (tensor parallelism's rules, parallel/tensor/rules.py) and `sw.plan.register_experts`
(expert parallelism's experts modules, parallel/expert/experts.py) are part of this
namespace for users, but live in the layers above plans, which import this package: the
top-level package puts them here (shardwise/__init__.py), so no import runs upward."""

from __future__ import annotations

from pathlib import Path

from ..config import ParallelConfig
from ..errors import PlanError
from .named import zoo
from .plan import Conversion, Plan, parse_placement, placement_str, shard_dim
from .resolve import ResolvedPlan, resolve_plan

__all__ = ["Conversion", "Plan", "ResolvedPlan", "RuleContext", "as_plan", "parse_placement", "placement_str",
           "register_experts", "register_rule", "resolve_plan", "search", "evaluate", "shard_dim", "zoo"]


def as_plan(plan: "Plan | dict | str | Path | None", config: ParallelConfig) -> Plan:
    """What a user passes as `plan=`: a Plan, a dict, a zoo name, a .json path/text, or None."""
    if plan is None:
        return Plan()
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, dict):
        return Plan.from_dict(plan)
    if isinstance(plan, (str, Path)):
        text = str(plan)
        if text in zoo:
            return zoo[text](config)
        if text.endswith(".json") or text.lstrip().startswith("{"):
            return Plan.from_json(text)
        raise PlanError(f"plan {text!r} is neither a zoo plan ({', '.join(zoo)}) nor a .json file or JSON text")
    raise PlanError(f"plan={plan!r} must be a Plan, a dict, a zoo name, a .json path or None")
