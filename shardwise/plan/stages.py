"""Pipeline stage layout: which modules each pipeline stage owns, by hand or by balanced cost.

Units are the modules a stage boundary may fall between: the siblings along the path from
the root to the model's main layer list (its largest ModuleList/Sequential) plus that
list's entries, e.g. `wte, wpe, drop, layers.0 .. layers.N, ln_f, lm_head`. One forward of a
sample microbatch records their execution order, forward FLOPs and parameter counts. A
plan's `stages` either names the units that begin each stage (`["layers.4"]`) or lists
the units of every stage; otherwise a dynamic program over the units in execution order
cuts `pp * virtual_stages` contiguous stages minimizing the largest stage cost (FLOP share
plus parameter share). Stage s runs on pipeline rank s % pp (loop placement, as the
interleaved schedules expect).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

import numpy as np
from torch import nn
from ..config import SCHEDULES, ParallelConfig
from ..errors import ModelError, PlanError
from .plan import Plan

@dataclass
class Unit:
    path: str
    params: int  # parameter elements (tied parameters count in each unit holding them)
    flops: float  # forward FLOPs for one sample microbatch


@dataclass
class StageLayout:
    """Units in execution order and the stage each belongs to."""

    units: list[Unit]
    stage_of: dict[str, int]
    num_stages: int
    pp: int

    @property
    def virtual(self) -> int:
        return self.num_stages // self.pp

    def units_of(self, stage: int) -> list[str]:
        return [u.path for u in self.units if self.stage_of[u.path] == stage]

    def first_unit(self, stage: int) -> str:
        return self.units_of(stage)[0]

    def stages_of_rank(self, pp_rank: int) -> list[int]:
        return [s for s in range(self.num_stages) if s % self.pp == pp_rank]

    def cost(self, stage: int) -> float:
        return sum(c for u, c in zip(self.units, unit_costs(self.units)) if self.stage_of[u.path] == stage)

    def describe(self) -> list[str]:
        return [
            f"stage {s} (pp rank {s % self.pp}): {_span(self.units_of(s))}, cost {self.cost(s):.3f}"
            for s in range(self.num_stages)
        ]


def _span(paths: list[str]) -> str:
    return paths[0] if len(paths) == 1 else f"{paths[0]} .. {paths[-1]} ({len(paths)} modules)"


def inside(path: str, parts: list[str] | tuple[str, ...]) -> bool:
    """Whether module `path` is one of `parts` or inside one (always, without parts)."""
    return not parts or any(path == p or path.startswith(p + ".") for p in parts)


def layer_list(module: nn.Module, parts: list[str] | tuple[str, ...] = ()) -> str | None:
    """Path of the model's main layer list: its ModuleList or Sequential holding the most
    parameters (a transformer's blocks), inside `parts` if given, or None when it has none."""
    lists = [(sum(p.numel() for p in m.parameters()), path) for path, m in module.named_modules()
             if isinstance(m, (nn.ModuleList, nn.Sequential)) and path and inside(path, parts)]
    return max(lists)[1] if lists else None


def candidate_units(module: nn.Module, parts: list[str] | tuple[str, ...] = ()) -> list[str]:
    """Unit paths (not yet ordered): siblings along the path to the main layer list, and its entries."""
    target = layer_list(module, parts) or ""
    units, prefix = [], ""
    parts = target.split(".") if target else []
    for depth in range(len(parts) + 1):
        node = module.get_submodule(prefix) if prefix else module
        on_path = ".".join(parts[: depth + 1]) if depth < len(parts) else None
        for name, _ in node.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if path != on_path:
                units.append(path)
        if on_path is None:
            break
        prefix = on_path
    return units


def units_of_program(module: nn.Module, program) -> tuple[list[Unit], list[str]]:
    """Units in the order the captured forward (parallel/pipeline/program.py) first calls them,
    with their forward FLOPs on the sample microbatch and parameter counts, and the calls of
    units holding parameters, in order."""
    held = {path: sum(p.numel() for p in module.get_submodule(path).parameters()) for path in program.unit_flops}
    never = [p for p, n in held.items() if n and p not in program.unit_order]
    if never:
        raise ModelError(f"modules {never[:4]} hold parameters but did not run in the forward of the sample batch; "
                         "pipeline stages are laid out from that forward")
    units = [Unit(p, held[p], program.unit_flops[p]) for p in program.unit_order]
    calls = [step.unit for step in program.steps if step.unit is not None and held[step.unit]]
    return units, calls


def unit_costs(units: list[Unit]) -> list[float]:
    """Each unit's cost for balancing: its share of the forward FLOPs plus its share of the
    parameters (the planner predicts the split with the same costs)."""
    total_flops = sum(u.flops for u in units) or 1.0
    total_params = sum(u.params for u in units) or 1.0
    return [u.flops / total_flops + u.params / total_params for u in units]


def balance(costs: list[float], holds: list[bool], stages: int) -> list[int]:
    """Start index of each stage: contiguous pieces, each holding parameters, minimizing the
    max cost (a dynamic program over stages; for each stage count and prefix end, the
    earliest cut achieving the minimum)."""
    n = len(costs)
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(costs, dtype=np.float64))])
    held = np.concatenate([[0], np.cumsum(np.asarray(holds, dtype=np.int64))])
    index = np.arange(n + 1)
    # a stage [j, i) must hold parameters and begin with a module that does (or at the start)
    allowed = (index[None, :] < index[:, None]) & (held[:, None] != held[None, :]) \
        & np.concatenate([[True], np.asarray(holds[1:], dtype=bool), [False]])[None, :]
    spans = prefix[:, None] - prefix[None, :]  # [i, j]: cost of units j..i-1
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    cut = np.zeros((stages + 1, n + 1), dtype=np.int64)
    for k in range(1, stages + 1):
        value = np.where(allowed & (index[None, :] >= k - 1) & np.isfinite(best)[None, :],
                         np.maximum(best[None, :], spans), np.inf)
        cut[k] = np.argmin(value, axis=1)  # the first of equal minima, as a scan in order keeps
        best = value[index, cut[k]]
        cut[k][~np.isfinite(best)] = 0
    starts, i = [], n
    for k in range(stages, 0, -1):
        i = int(cut[k][i])
        starts.append(i)
    return starts[::-1]


def _resolve_path(path: str, units: list[Unit]) -> str:
    known = [u.path for u in units]
    if path in known:
        return path
    inside = [u for u in known if path.startswith(u + ".")]
    if inside:
        raise PlanError(f"stage boundary {path!r} is inside module {inside[0]!r}; stages split between: {', '.join(known)}")
    close = difflib.get_close_matches(path, known, n=4, cutoff=0.3)
    raise PlanError(f"stage boundary {path!r} is not a module of this model's forward; closest: {', '.join(close) or '(none)'}")


def layout_stages(module: nn.Module, plan: Plan, config: ParallelConfig, program) -> StageLayout:
    """The stage layout for `config.pp` pipeline ranks from the forward captured on the sample
    (`pipeline.program.capture`); `PlanError` on a split that cannot run."""
    interleaved = SCHEDULES[config.schedule].interleaved
    virtual = plan.virtual_stages or (2 if interleaved else 1)
    if interleaved and virtual < 2:
        raise PlanError(f"schedule {config.schedule!r} needs virtual_stages >= 2 in the plan, got {virtual}")
    if not interleaved and virtual != 1:
        raise PlanError(
            f"schedule {config.schedule!r} runs one stage per rank; use schedule='interleaved-1f1b' or "
            f"'zero-bubble' for virtual_stages={virtual}"
        )
    num_stages = config.pp * virtual
    units, calls = units_of_program(module, program)
    outside = [n for n, p in module.named_parameters()  # those held by the root itself included
               if not any(n.startswith(u.path + ".") for u in units)]
    if outside:
        raise ModelError(
            f"parameters {outside[:4]} belong to no pipeline unit; pipeline parallelism assigns "
            "parameters by submodule, so keep them inside submodules of the layer list's siblings"
        )
    holds = [u.params > 0 for u in units]
    if sum(holds) < num_stages:
        raise PlanError(
            f"{num_stages} pipeline stages (pp={config.pp} x virtual_stages={virtual}) but the model has only "
            f"{sum(holds)} modules with parameters to split between ({', '.join(u.path for u in units if u.params)}); "
            "use fewer stages"
        )
    if plan.stages is None:
        starts = balance(unit_costs(units), holds, num_stages)
    else:
        starts = _manual_starts(plan.stages, units, num_stages)
    stage_of = {}
    for s, start in enumerate(starts):
        end = starts[s + 1] if s + 1 < len(starts) else len(units)
        if not any(holds[start:end]):
            raise PlanError(f"pipeline stage {s} ({_span([u.path for u in units[start:end]])}) holds no parameters")
        for u in units[start:end]:
            stage_of[u.path] = s
    layout = StageLayout(units, stage_of, num_stages, config.pp)
    order = [layout.stage_of[c] for c in calls]
    for prev, nxt, path in zip(order, order[1:], calls[1:]):
        if nxt < prev:
            raise PlanError(
                f"module {path!r} of pipeline stage {nxt} runs after a module of stage {prev}; stages must follow "
                "the forward's order (a module called at two places cannot be split across stages)"
            )
    return layout


def _manual_starts(stages: list, units: list[Unit], num_stages: int) -> list[int]:
    index = {u.path: i for i, u in enumerate(units)}
    if stages and all(isinstance(s, (list, tuple)) for s in stages):  # every stage's units, listed
        if len(stages) != num_stages:
            raise PlanError(f"plan lists {len(stages)} stages but pp x virtual_stages = {num_stages}")
        listed: dict[str, int] = {}
        repeated = []
        for s, group in enumerate(stages):
            for path in map(lambda p: _resolve_path(p, units), group):
                if path in listed:
                    repeated.append(path)
                listed[path] = s
        skipped = [u.path for u in units if u.params and u.path not in listed]
        if repeated or skipped:
            problems = ([f"repeat {sorted(set(repeated))}"] if repeated else []) + ([f"skip {skipped}"] if skipped else [])
            raise PlanError(f"plan stages {' and '.join(problems)}; list every module with parameters in exactly one stage")
        assigned, previous = [], 0
        for u in units:  # an unlisted module without parameters goes with the one before it
            stage = listed.get(u.path, previous)
            if stage < previous:
                raise PlanError(f"plan stages are not in the forward's order: {u.path!r} (stage {stage}) runs after "
                                f"a module of stage {previous}")
            assigned.append(stage)
            previous = stage
        starts = [assigned.index(s) if s in assigned else len(units) for s in range(num_stages)]
        for s, start in enumerate(starts[1:], 1):
            if start < len(units) and not units[start].params:
                raise PlanError(f"plan stage {s} begins with {units[start].path!r}, which has no parameters; "
                                "begin each stage at a module that has some")
        return starts
    points = [_resolve_path(p, units) for p in stages]  # the units that begin stages 1..n-1
    if len(points) != num_stages - 1:
        raise PlanError(
            f"plan stages {stages} give {len(points) + 1} stages but pp x virtual_stages = {num_stages}; "
            f"name {num_stages - 1} modules that begin a stage"
        )
    starts = [0] + [index[p] for p in points]
    empty = [p for p in points if not units[index[p]].params]
    if empty:
        raise PlanError(f"stage boundary {empty[0]!r} has no parameters; begin each stage at a module that has some")
    if any(b <= a for a, b in zip(starts, starts[1:])):
        raise PlanError(f"plan stage boundaries {stages} must be distinct and in the forward's order")
    return starts
