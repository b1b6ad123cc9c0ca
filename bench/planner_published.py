"""The planner against published training runs that nobody here made.

Each run (bench/published_runs.py) is a model, a cluster and the layout its authors used,
with the step time they published (or what their tables give it from: FLOP/s per GPU with
their FLOP count, tokens per second) and memory where they published it. For each the planner
predicts the step time and memory of that exact layout (`sw.plan.evaluate`), and ranks it among
every layout the search would consider at the same degrees (dp, tp, pp, cp), and among its own
software's choices there (its recompute, sp and ZeRO stage held; microbatch size, 1F1B or
interleaved stages left to choose). Where the authors
published the same work in two layouts (`alternatives`), the predicted ratio of their step times
is set against the published one: the only direct test of the planner's choices. Then, per model,
the search's own best pick is checked against the best MFU anyone published for that model and
device, and its hardware FLOP rate (HFU: recomputation counted) against the best any run of that
size reached there. A pick more than 5 points above gets two more lines: the FLOP rate it needs
against the best a published run reached on the device with weight matrices no larger per GPU,
and a walk from the published layout to the pick, one group of choices at a time (`walk`), with
the points each step gains and the time terms it moves.

The calibration part (`calibrate=True`: every other row of Megatron-LM's weak-scaling table,
every other MPT size of llm-foundry's tables on A100 and H100, Llama 3's two 8K layouts: 16
runs; and Korthikanti's Table 4, five times of one 22B layer) fixes the planner's fitted numbers
(shardwise/planner/cluster.py: each device's `gemm_efficiency`, the shared `matmul_overhead` and
`elementwise`) and Megatron-LM's own elementwise traffic (`MEGATRON_EXECUTOR`); the other 46 runs
are held out and show how the model generalises to other sizes, layouts and executors. `--fit`
prints the numbers that fit the calibration part best. The fitted eager figure is also set
against what Hugging Face's eager Llama and GPT-2 blocks move, counted op by op
(bench/elementwise_count.py), which also counts what their compiled blocks move: the share of
eager's traffic that compiled blocks are charged (`Cluster(compiled=True)`; not fitted). Megatron-LM's runs (2021-2022) wrote attention's scores to memory
(`ModelSpec(attention="megatron")`); the search's own picks run as shardwise does, with torch's
SDPA.

Run: python bench/planner_published.py [--fit] [--no-search]
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace
from typing import NamedTuple

import numpy as np
import torch

import shardwise as sw
from shardwise.planner import Cluster
from shardwise.planner.cost import OPTIMIZER_CODES, RECOMPUTE_CODES, SCHEDULE_CODES
from shardwise.planner.cost import evaluate as evaluate_layouts
from shardwise.planner.format import TIME_LABELS
from shardwise.planner.model import ModelSpec
from shardwise.planner.search import Candidate, _factorizations, _inner_grid, recompute_codes, search

from elementwise_count import print_counts
from published_runs import GIB, KORTHIKANTI_LAYER_MS, MEGATRON_EXECUTOR, Run, corpus, predict

SIZE_BAND = 2.5  # "a model of its size": parameters within this factor


class Reached(NamedTuple):
    """What a published run reached: its MFU and HFU on its device, its model's parameters and
    its largest weight matrix per GPU."""

    name: str
    device: str
    params: float
    mfu: float
    hfu: float
    matmul: float


def hardware_share(spec: ModelSpec, cluster: Cluster, seq: int, recompute: str | None, tp: int,
                   model_flops_per_token: float) -> float:
    """The FLOPs a device runs per model FLOP (HFU / MFU), as the time model charges them on
    `cluster`'s executor: full recompute runs every block's forward again (2 FLOPs per block
    parameter and token, 2 s h for causal attention; shardwise's but the down projection);
    selective Megatron-LM's attention core (2 s h, where attention writes its scores) and,
    under tp, shardwise's row-parallel partial sums but the last (the attention output
    projection); selective-alternate those and every second weight matmul but the last."""
    runs = cluster.runs
    active = spec.layer_params[0] + spec.active_expert_params
    matmuls = spec.weight_matmuls
    last = 0.0 if runs.full_reruns_last or not matmuls else 2 * matmuls[-1][1] * matmuls[-1][2]
    partial = tp > 1 and runs.selective_reruns_partials
    core = 2 * spec.hidden * seq if spec.attention == "megatron" else 0.0
    rerun = [2 * out * inp for _, out, inp, rows in matmuls[:-1] if rows and partial]
    alternate = [2 * out * inp for i, (_, out, inp, rows) in enumerate(matmuls[:-1]) if i % 2 == 1 or (rows and partial)]
    extra = {"full": 2 * active + 2 * spec.hidden * seq - last, "selective": core + sum(rerun),
             "selective-alternate": core + sum(alternate)}.get(recompute, 0.0)
    return 1 + spec.layers * extra / model_flops_per_token


def alternatives(runs: list[Run]) -> list[tuple[Run, Run]]:
    """Pairs of runs their authors published for the same work (model, GPUs, sequence length and
    batch) in different layouts or options: Korthikanti's full recompute against sequence
    parallelism with selective recompute, Megatron's ZeRO-3 against PTD-P, torchtitan's Llama 2
    13B without recompute against its op-level selective checkpointing, its Llama 3.1 8B eager
    against compiled blocks (`Run.executor`'s elementwise traffic)."""
    pairs = []
    for i, a in enumerate(runs):
        for b in runs[i + 1:]:
            same_work = (a.spec.name, a.cluster, a.seq, a.global_batch) == (b.spec.name, b.cluster, b.seq, b.global_batch)
            if same_work and (a.config != b.config or a.executor != b.executor):
                pairs.append((a, b))
    return pairs


def print_alternatives(runs: list[Run], times: dict[str, tuple[float, float]]) -> None:
    """How the planner weighs one published choice against another: for each pair of
    `alternatives`, the published and predicted step-time ratios. The corpus's only direct
    test of the rankings the search makes."""
    pairs = alternatives(runs)
    print(f"published alternatives for the same work ({len(pairs)} pairs), step time of the first over the second:")
    agree, misses = 0, []
    for a, b in pairs:
        published, predicted = times[a.name][0] / times[b.name][0], times[a.name][1] / times[b.name][1]
        agree += (published > 1) == (predicted > 1)
        misses.append(abs(predicted / published - 1))
        print(f"  {a.name} / {b.name}: published {published:.3f}, predicted {predicted:.3f} "
              f"({predicted / published - 1:+.1%})")
    print(f"  the planner orders {agree} of {len(pairs)} as published; the ratio is off by a median "
          f"{statistics.median(misses):.1%}, at most {max(misses):.1%}")


LAYER_RUN = "korthikanti 22B full recompute"  # Table 4's layout


def layer_times(base: Run, cluster: Cluster | None = None) -> list[tuple[str | None, bool, float, float]]:
    """Korthikanti's Table 4 (one 22B layer, forward + backward, by recompute and sp) against the
    planner: (recompute, sp, published ms, predicted ms). A layer's predicted time is the step's
    growth per added layer, less the optimizer step's (the head and the loss cancel)."""
    rows, half = [], base.spec.layers // 2
    for (recompute, sp), published in KORTHIKANTI_LAYER_MS.items():
        config = dict(base.config, recompute=recompute, sequence_parallel=sp)
        terms = [predict(replace(base, spec=replace(base.spec, layers=layers), config=config), cluster).time_terms
                 for layers in (half, base.spec.layers)]
        steps = [sum(t.values()) - t["optimizer_step"] for t in terms]
        rows.append((recompute, sp, published, (steps[1] - steps[0]) / (base.spec.layers - half) * 1e3))
    return rows


def print_layer_times(runs: list[Run]) -> None:
    """`layer_times` beside Table 4, each row's error, and their median and largest."""
    print("one layer of Korthikanti's 22B (tp8, a microbatch of 4 x 2048; Table 4), forward + backward:")
    errors = []
    for recompute, sp, published, predicted in layer_times(next(r for r in runs if r.name == LAYER_RUN)):
        errors.append(predicted / published - 1)
        print(f"  recompute {recompute or 'none':<9} sp {'yes' if sp else 'no ':<3}  published {published:5.1f} ms, "
              f"predicted {predicted:5.1f} ms ({errors[-1]:+.1%})")
    print(f"  median |error| {statistics.median(abs(e) for e in errors):.1%}, max {max(abs(e) for e in errors):.1%}")


def largest_matmul(spec: ModelSpec, tp: int) -> float:
    """Elements of a block's largest weight matrix on one GPU: hidden x ffn / tp."""
    return spec.hidden * spec.ffn / tp


def _per_token(spec: ModelSpec, cluster: Cluster, seq: int, grid) -> np.ndarray:
    """Predicted seconds per sequence of every layout in `grid` that fits (inf where not)."""
    cost = evaluate_layouts(spec, cluster, grid, seq)
    return np.where(cost.memory <= cluster.usable_bytes, cost.step_seconds / (grid.dp * grid.micro_batch
                                                                               * grid.microbatches), np.inf)


def _bf16_grids(spec: ModelSpec, groups, global_batch: int):
    """The search's bf16 layout grid of each (dp, tp, pp, cp) in `groups` whose dp splits the batch."""
    for dp, tp, pp, cp in groups:
        grid = _inner_grid(dp, tp, pp, cp, global_batch // dp, spec.layers, (2,), recomputes=recompute_codes(spec)) \
            if global_batch % dp == 0 else None
        if grid is not None:
            yield grid


# schedules every published run's software had (Megatron-LM since SC21, torchtitan, torch's pipelining)
SCHEDULES_EVERY_STACK_HAD = (SCHEDULE_CODES["1f1b"], SCHEDULE_CODES["interleaved-1f1b"])


def own_choices(grid, config: sw.ParallelConfig) -> np.ndarray:
    """The grid's layouts with the published config's recompute and sequence parallelism."""
    return (grid.recompute == RECOMPUTE_CODES[config.recompute]) & (grid.sp == int(config.sequence_parallel))


def software_choices(grid, config: sw.ParallelConfig) -> np.ndarray:
    """The grid's layouts the published run's software could have chosen: its recompute, sp and
    ZeRO stage, and (pipelined) a schedule every stack had."""
    return own_choices(grid, config) & (grid.zero == config.zero) & (
        (grid.pp == 1) | np.isin(grid.schedule, SCHEDULES_EVERY_STACK_HAD))


def ranks(run: Run, mine: float) -> list[tuple[int, int, float]]:
    """Where the run's predicted seconds per sequence stand among the bf16 layouts the search
    considers for its batch, as (position, fitting layouts, the fastest one's seconds over the
    run's), 1 = the fastest: at its degrees dp, tp, pp, cp with its own recompute and sequence
    parallelism; at its degrees; over every factorization of its GPUs; and at its degrees with
    its own recompute, sp and ZeRO stage, over what is left to choose there with the schedules
    every stack had (microbatch size, 1F1B or interleaved, virtual stages): its software's choices."""
    c = sw.ParallelConfig(**run.config).resolve(run.cluster.gpus)
    mine = mine / run.global_batch * (1 - 1e-9)
    degrees = [(c.dp, c.tp, c.pp, c.cp)]

    out = []
    for groups, keep in ((degrees, own_choices), (degrees, None),
                         (_factorizations(run.spec, run.executed_on, run.seq, True), None), (degrees, software_choices)):
        times = []
        for grid in _bf16_grids(run.spec, groups, run.global_batch):
            grid.reduce_bytes = 4 if c.reduce_dtype == torch.float32 else 0
            grid.optimizer = OPTIMIZER_CODES[run.optimizer]  # the run's software's, as predict() has it
            per_token = _per_token(run.spec, run.executed_on, run.seq, grid)
            times.append(per_token if keep is None else np.where(keep(grid, c), per_token, np.inf))
        times = np.concatenate(times) if times else np.array([])
        fitting = times[np.isfinite(times)]
        out.append((int((fitting < mine).sum()) + 1, int(fitting.size),
                    float(fitting.min() / mine) if fitting.size else 1.0))
    return out


def best_without_new_features(spec: ModelSpec, cluster: Cluster, seq: int, global_batch: int) -> float:
    """The best MFU among the fitting bf16 layouts that use no zero-bubble schedule (no run in
    the corpus did) and no context parallelism (only Llama 3's 131K-token run did): how much of
    a pick's promise rests on them."""
    best = 0.0
    for grid in _bf16_grids(spec, _factorizations(spec, cluster, seq, False), global_batch):
        cost = evaluate_layouts(spec, cluster, grid, seq)
        mfu = cost.model_flops / (cost.step_seconds * cluster.gpus * cluster.spec.peak_flops)
        allowed = (cost.memory <= cluster.usable_bytes) & (grid.schedule != SCHEDULE_CODES["zero-bubble"])
        best = max(best, float(np.max(np.where(allowed, mfu, 0.0))))
    return best


# From a published layout to the search's pick, one group of choices at a time (the software first: the
# run's attention, kernels and collectives give way to shardwise's on the hardware, the layout unchanged).
WALK = (("recompute", ("recompute",)), ("sharding", ("zero", "reduce_dtype", "bucket_mb")),
        ("degrees", ("dp", "tp", "pp", "cp", "sequence_parallel", "microbatches")), ("schedule", ("schedule",)))


# what changes where a run's executor gives way to shardwise's (planner/cluster.py's EXECUTORS)
OWN_EXECUTION = {"megatron": "shardwise's recompute, sp, tp backward and ZeRO-2/3 gradients freed between steps",
                 "megatron-2021": "shardwise's recompute, sp and ZeRO-2/3 gradients freed between steps",
                 "torch-1.13": "shardwise's recompute, sp and ZeRO-0/1 gradient buffers",
                 "fsdp2": "shardwise's ZeRO-0/1 gradient buffers and its gathers without copies"}


class WalkStep(NamedTuple):
    """One step of a walk: the group of choices it takes from the pick ("software" or a WALK
    group; None for the published layout), what it changes, and the prediction after it."""

    group: str | None
    label: str
    candidate: Candidate


def walk(run: Run, pick: Candidate) -> list[WalkStep]:
    """The predictions from the run's own layout on its own software to the search's `pick`:
    then on the pick's software, then taking the pick's recompute, its ZeRO stage and gradient
    buckets, its degrees and microbatches (under 1F1B), its schedule: where the pick's gain over
    the published layout comes from, step by step. Steps that change nothing are left out."""
    def cost(spec, cluster, config, virtual):
        return sw.plan.evaluate(spec, cluster, config, seq_len=run.seq, global_batch=run.global_batch, virtual=virtual,
                                optimizer=pick.optimizer)

    config, virtual = predict(run).config, run.virtual
    steps = [WalkStep(None, "published layout", predict(run))]
    software = [("flash attention", run.spec.attention != pick.spec.attention),
                ("torch's cross-entropy", run.spec.fused_loss != pick.spec.fused_loss),
                ("torch's kernels", any((run.executor or {}).get(k) for k in ("elementwise", "compiled"))),
                ("collectives on every NIC", "nics_per_node" in (run.executor or {})),
                (OWN_EXECUTION.get((run.executor or {}).get("executor")), "executor" in (run.executor or {})),
                (f"torch's {pick.optimizer} Adam", pick.optimizer != run.optimizer)]
    if any(changed for _, changed in software):
        steps.append(WalkStep("software", ", ".join(name for name, changed in software if changed),
                              cost(pick.spec, run.cluster, config, virtual)))
    c = pick.config
    for group, fields in WALK:
        changed = replace(config, **{f: getattr(c, f) for f in fields})
        if group == "degrees":
            changed, virtual = replace(changed, schedule="1f1b"), 1
            label = (f"dp{c.dp} tp{c.tp}{'+sp' if c.sequence_parallel else ''} pp{c.pp} cp{c.cp} "
                     f"mb{pick.micro_batch}x{c.microbatches}" + (" 1f1b" if c.pp > 1 else ""))
        elif group == "schedule":
            virtual = pick.virtual
            label = c.schedule + (f"/v{virtual}" if virtual > 1 else "")
        elif group == "recompute":
            label = f"recompute {c.recompute or 'none'}"
        else:
            label = f"zero{c.zero}" + "".join(
                text for field, text in (("reduce_dtype", f", gradients in {str(c.reduce_dtype or c.param_dtype)[6:]}"),
                                         ("bucket_mb", f", {c.bucket_mb:g} MiB buckets"))
                if getattr(c, field) != getattr(config, field))
        if changed != config or virtual != steps[-1].candidate.virtual:
            config = changed
            steps.append(WalkStep(group, label, cost(pick.spec, run.cluster, config, virtual)))
    return steps


def walk_groups(steps: list[WalkStep]) -> list[tuple[str, float]]:
    """(group, MFU points) of each step after the published layout."""
    return [(after.group, (after.candidate.mfu - before.candidate.mfu) * 100) for before, after in zip(steps, steps[1:])]


def _walk_line(steps: list[WalkStep]) -> str:
    """Each step's MFU points and the time terms it moved most."""
    parts = [f"{steps[0].candidate.mfu:.1%} predicted for the published layout"]
    for (_, _, before), (_, label, after) in zip(steps, steps[1:]):
        moved = sorted(((after.time_terms[k] - before.time_terms[k], k) for k in after.time_terms), key=lambda m: -abs(m[0]))
        terms = ", ".join(f"{TIME_LABELS[k]} {d:+.2f} s" for d, k in moved[:2] if abs(d) > 5e-3 * before.step_seconds)
        parts.append(f"{label} {(after.mfu - before.mfu) * 100:+.1f}" + (f" ({terms})" if terms else "")
                     + ("" if after.fits else " [does not fit]"))
    return "; ".join(parts)


def _calibration_error(runs: list[Run], fused: float, layer_base: Run | None = None, **device) -> float:
    """Root-mean-square log error of the runs' predicted step times with `device` overrides
    (`fused`: the elementwise traffic of runs whose executor sets its own, Megatron-LM's), and of
    Table 4's layer times on `layer_base` (a Megatron-LM run) where given."""
    logs = []
    for r in runs:
        overrides = dict(device, elementwise=fused) if "elementwise" in (r.executor or {}) else device
        got = predict(r, replace(r.executed_on, **overrides))
        logs.append(np.log(got.step_seconds / r.step_seconds(got.model_flops)) ** 2)
    if layer_base is not None:
        logs.extend(np.log(predicted / published) ** 2 for *_, published, predicted
                    in layer_times(layer_base, replace(layer_base.executed_on, **dict(device, elementwise=fused))))
    return float(np.sqrt(np.mean(logs)))


def _best_efficiency(runs: list[Run], fused: float, layer_base: Run | None = None, **device) -> tuple[float, float]:
    """(gemm_efficiency, rms log error) that fit `runs` (and Table 4's layers on `layer_base`)
    best with the other `device` overrides: a golden-section search."""
    lo, hi = 0.3, 1.0
    for _ in range(25):
        a, b = lo + 0.382 * (hi - lo), lo + 0.618 * (hi - lo)
        if (_calibration_error(runs, fused, layer_base, gemm_efficiency=a, **device)
                < _calibration_error(runs, fused, layer_base, gemm_efficiency=b, **device)):
            hi = b
        else:
            lo = a
    efficiency = (lo + hi) / 2
    return efficiency, _calibration_error(runs, fused, layer_base, gemm_efficiency=efficiency, **device)


def fit(runs: list[Run]) -> tuple[float, float, float, dict[str, float], float]:
    """(elementwise, Megatron-LM's elementwise, matmul_overhead, gemm_efficiency per device, rms
    log error) that fit the calibration part best: a grid over the three shared numbers, each
    device's efficiency its best. Korthikanti's Table 4 (five layer times of Megatron-LM on
    A100s) calibrates with the A100's runs: it alone separates sp's and recompute's terms."""
    devices = sorted({r.cluster.device for r in runs if r.calibrate})
    layer_base = next(r for r in runs if r.name == LAYER_RUN)
    points = sum(r.calibrate for r in runs) + len(KORTHIKANTI_LAYER_MS)
    best = None
    for elementwise in (16.0, 32.0, 48.0, 64.0):
        for fused in (12.0, 16.0, 24.0, 32.0, 48.0):  # at least the 11 outside the tp regions (Executor)
            for overhead in (0.0, 40e-6, 80e-6, 160e-6, 240e-6, 320e-6):
                efficiencies, squares = {}, 0.0
                for device in devices:
                    chosen = [r for r in runs if r.calibrate and r.cluster.device == device]
                    layers = layer_base if device == layer_base.cluster.device else None
                    efficiencies[device], error = _best_efficiency(chosen, fused, layers, elementwise=elementwise,
                                                                   matmul_overhead=overhead)
                    squares += error ** 2 * (len(chosen) + (len(KORTHIKANTI_LAYER_MS) if layers else 0))
                error = float(np.sqrt(squares / points))
                if best is None or error < best[-1]:
                    best = (elementwise, fused, overhead, efficiencies, error)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fit", action="store_true", help="print the calibration part's best gemm_efficiency")
    parser.add_argument("--no-search", action="store_true", help="skip the per-model search (MFU ceiling)")
    args = parser.parse_args()
    runs = corpus()
    if args.fit:
        elementwise, fused, overhead, efficiencies, error = fit(runs)
        print(f"fitted on the calibration part: elementwise {elementwise:.0f} (Megatron-LM's {fused:.0f}), "
              f"matmul_overhead {overhead * 1e6:.0f} us, "
              + ", ".join(f"{d} gemm_efficiency {e:.3f}" for d, e in efficiencies.items())
              + f" (rms log error {error:.3f}); the table has elementwise {sw.planner.DEVICES['a100'].elementwise:.0f} "
              f"(Megatron-LM's {MEGATRON_EXECUTOR['elementwise']:.0f}), "
              f"matmul_overhead {sw.planner.DEVICES['a100'].matmul_overhead * 1e6:.0f} us, "
              + ", ".join(f"{d} {sw.planner.DEVICES[d].gemm_efficiency:.3f}" for d in efficiencies))
    print(f"{'run':<42} {'part':<5} {'pub s':>8} {'pred s':>8} {'err':>7} {'pub MFU':>7} {'fits':>4} "
          f"{'mem GiB':>8} {'pub':>6} {'own':>9} {'gap':>5} {'degree':>6} {'all':>6}")
    errors: dict[str, list[float]] = {"calibration": [], "held out": []}
    times: dict[str, tuple[float, float]] = {}  # run: (published, predicted) seconds
    memory_errors, published_mfu, faster, own_gaps, software_gaps = [], [], ([], [], [], []), [], []
    for r in runs:
        got = predict(r)
        published = r.step_seconds(got.model_flops)
        error = got.step_seconds / published - 1
        times[r.name] = (published, got.step_seconds)
        errors["calibration" if r.calibrate else "held out"].append(error)
        mfu = got.model_flops / (published * r.cluster.gpus * r.cluster.spec.peak_flops)
        share = hardware_share(r.spec, r.executed_on, r.seq, got.config.recompute, got.config.tp,
                               got.model_flops / (r.global_batch * r.seq))
        published_mfu.append(Reached(r.name, r.cluster.device, r.spec.params, mfu, mfu * share,
                                     largest_matmul(r.spec, got.config.tp)))
        placed = ranks(r, got.step_seconds)
        # the share of the fitting layouts predicted faster than the published one: 0% = the fastest
        shares = [(position - 1) / fitting if fitting else float("nan") for position, fitting, _ in placed]
        for scope, share in zip(faster, shares):
            scope.extend([share] if got.fits and share == share else [])
        own_gaps.append(max(1 - placed[0][2], 0.0))  # 0 where nothing that fits beats it
        if got.fits:
            software_gaps.append(max(1 - placed[3][2], 0.0))
        memory = f"{r.memory_gib:>6.1f}" if r.memory_gib else f"{'':>6}"
        if r.memory_gib:
            memory_errors.append(got.memory / GIB / r.memory_gib - 1)
        print(f"{r.name:<42} {'cal' if r.calibrate else 'held':<5} {published:>8.3f} {got.step_seconds:>8.3f} "
              f"{error:>+7.1%} {mfu:>7.1%} {'yes' if got.fits else 'NO':>4} {got.memory / GIB:>8.1f} {memory} "
              f"{placed[0][0]:>4}/{placed[0][1]:<4} {own_gaps[-1]:>5.1%} {shares[1]:>6.1%} {shares[2]:>6.1%}")
    for part, values in (*errors.items(), ("all", errors["calibration"] + errors["held out"])):
        magnitudes = [abs(e) for e in values]
        print(f"step time, {part}: median |error| {statistics.median(magnitudes):.1%}, max {max(magnitudes):.1%} "
              f"over {len(values)} runs (signed median {statistics.median(values):+.1%})")
    for note in dict.fromkeys(r.notes for r in runs if r.notes):
        print(f"assumed where the source does not say ({', '.join(r.name for r in runs if r.notes == note)}): {note}")
    if memory_errors:
        print(f"memory where published: errors {', '.join(f'{e:+.1%}' for e in memory_errors)}")
    print_alternatives(runs, times)
    print_layer_times(runs)
    print_counts(compiled=True)
    print("share of the fitting layouts predicted faster than a published layout that fits (0% = the fastest):")
    for scope, shares in zip(("at its degrees with its own recompute and sp", "at its degrees", "over all degrees",
                              "among its software's choices (its degrees, recompute, sp and ZeRO stage; microbatch "
                              "size, 1F1B or interleaved)"), faster):
        print(f"  {scope}: median {statistics.median(shares):.1%}, worst {max(shares):.1%}; top 5% for "
              f"{sum(x <= 0.05 for x in shares)} of {len(shares)}")
    print(f"the fastest layout at a published layout's degrees with its own recompute and sp is faster by (gap): "
          f"median {statistics.median(own_gaps):.1%}, max {max(own_gaps):.1%}; within 5% for "
          f"{sum(g <= 0.05 for g in own_gaps)} of {len(own_gaps)}")
    print(f"the fastest among its software's choices is faster than a published layout that fits by: median "
          f"{statistics.median(software_gaps):.1%}, max {max(software_gaps):.1%}; within 5% for "
          f"{sum(g <= 0.05 for g in software_gaps)} of {len(software_gaps)}")
    if args.no_search:
        return
    print(f"\nthe search's best pick per run against the best MFU published on its device for a model of "
          f"1/{SIZE_BAND:g}x to {SIZE_BAND:g}x its size:")
    over, over_hardware, without_new, on_own_software, beyond_shown = [], [], [], [], []
    gains: dict[str, list[float]] = {}  # walk group: the MFU points of its steps over the picks above
    for r in runs:
        # the pick as shardwise runs it: torch's SDPA (flash attention) and eager cross-entropy, on the hardware itself
        best = search(replace(r.spec, attention="flash", fused_loss=False), r.cluster, global_batch=r.global_batch,
                      seq_len=r.seq, top=1, dtypes=(2,))
        if not best:
            print(f"  {r.name:<42} nothing fits")
            continue
        band = [p for p in published_mfu
                if p.device == r.cluster.device and 1 / SIZE_BAND <= p.params / r.spec.params <= SIZE_BAND]
        published, hardware = max(p.mfu for p in band), max(p.hfu for p in band)
        pick = best[0]
        pick_hardware = pick.mfu * hardware_share(pick.spec, r.cluster, r.seq, pick.config.recompute, pick.config.tp,
                                                  pick.model_flops / pick.tokens_per_step)
        gap, hardware_gap = (pick.mfu - published) * 100, (pick_hardware - hardware) * 100
        over += [r.name] if gap > 5 else []
        over_hardware += [r.name] if hardware_gap > 5 else []
        older = ""
        if gap > 5:
            without = best_without_new_features(replace(r.spec, attention="flash", fused_loss=False), r.cluster, r.seq,
                                                r.global_batch)
            # and as the run's own software would run it: its attention (Megatron's wrote the scores) and kernels
            own_software = best_without_new_features(r.spec, r.executed_on, r.seq, r.global_batch)
            older = f"; without zero-bubble and cp {without:6.1%}, on its own software {own_software:6.1%}"
            without_new.append(without - published)
            on_own_software.append(own_software - published)
        print(f"  {r.name:<42} {pick.layout():<66} MFU {pick.mfu:6.1%} vs published {published:6.1%} "
              f"({gap:+.1f} points); HFU {pick_hardware:6.1%} vs {hardware:6.1%} ({hardware_gap:+.1f}){older}")
        if gap > 5:
            # the FLOP rate the pick needs against the best a published run reached on the device with
            # weight matrices no larger per GPU than the pick's (larger matmuls run nearer the peak)
            shown, by = max((p.hfu, p.name) for p in published_mfu
                            if p.device == r.cluster.device and p.matmul <= largest_matmul(r.spec, pick.config.tp))
            beyond_shown += [r.name] if pick_hardware > shown else []
            steps = walk(r, pick)
            for group, points in walk_groups(steps):
                gains.setdefault(group, []).append(points)
            print(f"      needs HFU {pick_hardware:.1%}, the device ran {shown:.1%} ({by}); from " + _walk_line(steps))
    print(f"{len(over)} of {len(runs)} picks more than 5 MFU points above: {', '.join(over) or 'none'}")
    if without_new:
        print(f"  without zero-bubble schedules and context parallelism they stay {min(without_new) * 100:+.1f} to "
              f"{max(without_new) * 100:+.1f} points above: their promise rests on the rest of the layout; "
              f"run also with the attention and kernels of the run's own software, {min(on_own_software) * 100:+.1f} "
              f"to {max(on_own_software) * 100:+.1f}")
    if gains:
        print("  their walks' median gain by group, over the steps that change something (points, steps): "
              + ", ".join(f"{group} {statistics.median(points):+.1f} ({len(points)})" for group, points in gains.items()))
    if over:
        print(f"  of those, {len(over) - len(beyond_shown)} need no more of the peak (HFU) than a published run "
              f"reached on the same device with weight matrices no larger per GPU"
              + (f"; the rest: {', '.join(beyond_shown)}" if beyond_shown else ""))
    print(f"{len(over_hardware)} of {len(runs)} picks would run more than 5 points of the peak above the FLOP rate "
          f"(HFU: recomputation counted) any published run of their size reached on their device: "
          f"{', '.join(over_hardware) or 'none'}")


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
