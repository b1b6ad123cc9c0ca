"""A picture of one real training step: every rank's lane, as it ran and as theory has it.

`pmodel.timeline(batch, "step.svg")` runs one `train_step(batch)` under torch.profiler on
every rank (collective), keeps shardwise's own ranges (comm.trace_range: pipeline forwards,
backwards, receives and sends, polled waits, bucket launches), gathers them to rank 0 and
draws an SVG: one lane per rank, time from the step's start (each rank's clock, the ranks
leaving a barrier together), forwards blue, backwards green, time blocked receiving (the
bubble) or waiting on a collective grey. Under a pipeline our executor runs, a second panel
draws the same schedule from theory: each rank's actions in its order, a forward one unit, a
backward two, a message free, so the gap between the two panels is what the machine added.
With `trace_dir`, each rank's whole Chrome trace (Perfetto opens it) is written there too.
Plain SVG, written here: a picture of rectangles needs no plotting library.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .errors import ConfigError

if TYPE_CHECKING:
    from .module import ParallelModule

COLOURS = {"forward": "#4C78A8", "backward": "#54A24B", "waiting": "#BBBBBB", "launch": "#F58518"}
LANE, GAP, LEFT, WIDTH = 22, 6, 70, 1100


def _kind(name: str) -> str | None:
    if name.startswith("pp forward"):
        return "forward"
    if name.startswith("pp backward"):
        return "backward"
    if name.startswith(("pp receive", "wait:")):
        return "waiting"
    if name.startswith("launch"):
        return "launch"
    return None


def record_step(pmodel: "ParallelModule", batch: Any, trace_dir: str | Path | None) -> list[tuple[str, float, float]]:
    """This rank's shardwise ranges of one train_step: (name, start, end) in seconds from the step's start."""
    pmodel.coordinator.agree("timeline")  # every rank leaves it together: the lanes' common start
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        pmodel.train_step(batch)
    if trace_dir is not None:
        prof.export_chrome_trace(str(Path(trace_dir) / f"trace-rank{pmodel.topology.rank}.json"))
    ranges = [(e.name.removeprefix("shardwise/"), e.time_range.start / 1e6, e.time_range.end / 1e6)
              for e in prof.events() if e.name.startswith("shardwise/")]
    start = min((s for name, s, _ in ranges if name == "train_step"), default=0.0)
    return [(name, s - start, e - start) for name, s, e in ranges if name != "train_step"]


def theoretical(orders: dict[int, list]) -> dict[int, list[tuple[str, float, float]]]:
    """Each rank's actions placed as early as their order and their inputs allow: a forward
    takes one unit after the previous stage's forward of that microbatch, a backward two after
    the next stage's backward (or this stage's forward, on the last stage)."""
    last_stage = max(step.stage for steps in orders.values() for step in steps)
    done: dict[tuple[bool, int, int], float] = {}
    free = {rank: 0.0 for rank in orders}
    position = {rank: 0 for rank in orders}
    placed: dict[int, list[tuple[str, float, float]]] = {rank: [] for rank in orders}
    while any(position[r] < len(orders[r]) for r in orders):
        progressed = False
        for rank, steps in orders.items():
            while position[rank] < len(steps):
                step = steps[position[rank]]
                if step.forward:
                    needs = [(True, step.stage - 1, step.microbatch)] if step.stage > 0 else []
                else:
                    needs = [(True, step.stage, step.microbatch)]
                    if step.stage < last_stage:
                        needs.append((False, step.stage + 1, step.microbatch))
                if any(n not in done for n in needs):
                    break
                begin = max([free[rank]] + [done[n] for n in needs])
                end = begin + (1.0 if step.forward else 2.0)
                done[(step.forward, step.stage, step.microbatch)] = free[rank] = end
                kind = "forward" if step.forward else "backward"
                placed[rank].append((f"pp {kind} stage {step.stage} microbatch {step.microbatch}", begin, end))
                position[rank] += 1
                progressed = True
        if not progressed:
            raise ConfigError("the pipeline's action order waits on itself: no action can run")
    return placed


def _panel(title: str, lanes: dict[int, list[tuple[str, float, float]]], top: float, unit: str) -> tuple[list[str], float]:
    span = max((e for ranges in lanes.values() for _, _, e in ranges), default=1.0) or 1.0
    scale = (WIDTH - LEFT - 10) / span
    out = [f'<text x="{LEFT}" y="{top + 14}" font-size="13" font-weight="bold">{html.escape(title)}</text>']
    y = top + 22
    for rank in sorted(lanes):
        out.append(f'<text x="4" y="{y + LANE * 0.7}" font-size="12">rank {rank}</text>')
        for name, start, end in sorted(lanes[rank], key=lambda r: _kind(r[0]) != "waiting"):  # waits underneath
            kind = _kind(name)
            if kind is None:
                continue
            x, w = LEFT + start * scale, max(0.5, (end - start) * scale)
            h, dy = (LANE * 0.35, LANE * 0.65) if kind == "launch" else (LANE, 0)
            out.append(f'<rect x="{x:.2f}" y="{y + dy:.2f}" width="{w:.2f}" height="{h:.2f}" fill="{COLOURS[kind]}" '
                       f'stroke="white" stroke-width="0.3"><title>{html.escape(name)} '
                       f'({(end - start) * (1e3 if unit == "ms" else 1):.3g} {unit})</title></rect>')
            if kind in ("forward", "backward") and w > 14:
                out.append(f'<text x="{x + w / 2:.2f}" y="{y + LANE * 0.7}" font-size="10" fill="white" '
                           f'text-anchor="middle">{name.rsplit(" ", 1)[-1]}</text>')
        y += LANE + GAP
    axis = f"{span * 1e3:.1f} ms" if unit == "ms" else f"{span:g} units"
    out.append(f'<text x="{WIDTH - 10}" y="{y + 10}" font-size="11" text-anchor="end">{axis}</text>')
    return out, y + 20


def draw(measured: dict[int, list], ideal: dict[int, list] | None, title: str) -> str:
    """The SVG text of the measured lanes (seconds) and, if given, the theoretical ones (units)."""
    parts, y = _panel(f"{title}: measured", measured, 24, "ms")
    if ideal is not None:
        more, y = _panel("theory: forward 1 unit, backward 2, messages free", ideal, y + 10, "units")
        parts += more
    legend = " ".join(f'<rect x="{LEFT + i * 150}" y="6" width="12" height="12" fill="{c}"/>'
                      f'<text x="{LEFT + i * 150 + 16}" y="16" font-size="12">{k}</text>'
                      for i, (k, c) in enumerate(COLOURS.items()))
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{y:.0f}" '
            f'font-family="sans-serif"><rect width="100%" height="100%" fill="white"/>{legend}{"".join(parts)}</svg>\n')


def timeline(pmodel: "ParallelModule", batch: Any, path: str | Path, trace_dir: str | Path | None = None) -> Path | None:
    """Run one train_step on `batch`, write its picture to `path` (SVG) on rank 0, and return
    the path there (None elsewhere). Collective. Gradients are left as after any train_step."""
    path = Path(path)
    if path.suffix != ".svg":
        raise ConfigError(f"timeline({str(path)!r}): the picture is an SVG; give a path ending in .svg")
    ranges = record_step(pmodel, batch, trace_dir)
    order = pmodel.pipeline.training_order(batch) if pmodel.pipeline is not None else None
    gathered = pmodel.coordinator.gather_objects((ranges, order), "timeline")
    if pmodel.topology.rank != 0:
        return None
    measured = {rank: r for rank, (r, _) in enumerate(gathered)}
    orders = {rank: o for rank, (_, o) in enumerate(gathered) if o is not None}
    ideal = theoretical(orders) if orders and len(orders) == len(gathered) else None
    config = pmodel.config
    title = (f"one train_step, world {pmodel.topology.world_size} (pp {config.pp}, dp {config.dp}, tp {config.tp}, "
             f"cp {config.cp}), {config.microbatches} microbatches" +
             (f", {config.schedule}" if config.pp > 1 else ""))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(draw(measured, ideal, title))
    return path
