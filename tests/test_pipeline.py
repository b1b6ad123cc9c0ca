"""Pipeline parallel parity (every schedule, composed with dp and tp), stage layout and errors."""

from __future__ import annotations

import functools

import pytest
import torch

import shardwise as sw
from parity import Case, compare_cases, gpt_batches, make_gpt, run_and_compare, torch_pipeline_order
from shardwise.parallel.pipeline.program import capture_module
from shardwise.plan.stages import balance, layout_stages

STEPS = 5
SCHEDULES = list(sw.config.SCHEDULES)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("pp", [2, 4])
def test_pipeline_parity_gpt_with_tied_embeddings(pp, schedule):
    factory = functools.partial(make_gpt, 0, n_layer=8)  # wte tied to lm_head: first and last stage
    # three steps: each compares whole gradients, and parameters after two updates
    run_and_compare(pp, {"pp": pp, "microbatches": 8, "schedule": schedule}, factory, gpt_batches(3, 8))


@pytest.mark.parametrize("world, config", [
    (4, {"pp": 2, "microbatches": 4}),                                  # pp x dp
    (4, {"pp": 2, "tp": 2, "microbatches": 4}),                         # pp x tp
    (8, {"pp": 2, "tp": 2, "microbatches": 2, "schedule": "gpipe"}),   # pp x tp x dp
])
def test_pipeline_composes_with_data_and_tensor_parallel(world, config):
    plan = "gpt" if config.get("tp", 1) > 1 else None
    run_and_compare(world, config, functools.partial(make_gpt, 0, n_layer=4), gpt_batches(STEPS, 8), plan=plan, clip=0.5)


@pytest.mark.parametrize("stages", [
    ["layers.1"],                                                            # where stage 1 begins
    [["wte", "wpe", "layers.0"], ["layers.1", "layers.2", "layers.3", "ln_f", "lm_head"]],  # every stage listed
])
def test_manual_stages(stages):
    plan = sw.Plan(stages=stages)
    run_and_compare(2, {"pp": 2, "microbatches": 2}, functools.partial(make_gpt, 0, n_layer=4), gpt_batches(3, 4), plan=plan)


def _dict_batches(steps: int):
    return [{"input_ids": b[:, :-1], "labels": b[:, 1:]} for b in gpt_batches(steps, 8)]


def test_dict_batch_model_and_inference():
    """Each stage takes what it needs from the dict batch (the last stage: labels)."""
    factory = functools.partial(make_gpt, 0, n_layer=4)
    run_and_compare(2, {"pp": 2, "microbatches": 4}, factory, _dict_batches(STEPS))
    batch = _dict_batches(1)[0]
    small = {k: v[:3] for k, v in batch.items()}  # inference takes any batch size, not the sample's
    with torch.no_grad():
        want = [float(factory()(b)) for b in (batch, small)]
    for got in sw.testing.run_on_ranks(_infer, 2, batch, small):  # every rank gets the last stage's output
        assert got == pytest.approx(want, abs=1e-5)


def _infer(batch, small):
    pm = sw.parallelize(make_gpt(0, n_layer=4), sw.ParallelConfig(pp=2, microbatches=2), sample=batch)
    return [float(pm.infer_step(b)) for b in (batch, small)]


def test_automatic_split_balances_cost():
    assert balance([1, 1, 1, 1], [True] * 4, 2) == [0, 2]
    assert balance([4, 1, 1, 1, 1], [True] * 5, 2) == [0, 1]
    assert balance([1, 5, 1, 1, 5, 1], [True, True, False, True, True, True], 2) == [0, 3]
    model = make_gpt(0, n_layer=6)
    program = capture_module(model, gpt_batches(1, 2)[0])[0]
    layout = layout_stages(model, sw.Plan(), sw.ParallelConfig(pp=3), program)
    costs = [layout.cost(s) for s in range(3)]
    assert max(costs) / min(costs) < 1.3, costs
    assert layout.units_of(0)[0] == "wte" and layout.units_of(2)[-1] == "lm_head"


def test_dropout_under_pp_draws_the_masks_of_one_process():
    """Embedding and residual dropout on every stage: the masks one process draws running the
    same microbatches in order (each rank replays the other stages' draws)."""
    factory = functools.partial(make_gpt, 0, n_layer=4, dropout=0.2)
    cases = [Case(f"pp2 {schedule}", {"pp": 2, "microbatches": 4, "schedule": schedule}, factory, gpt_batches(4, 8),
                  reference_microbatches=4) for schedule in ("1f1b", "interleaved-1f1b")]
    compare_cases(2, cases)


def test_interleaved_and_zero_bubble_compose_with_data_parallel_and_zero():
    """Two stages per rank, wte and lm_head tied across pipeline ranks, each stage's buckets
    launched as soon as its last backward is done (while the other stage still runs)."""
    factory = functools.partial(make_gpt, 0, n_layer=4)
    cases = [Case(f"pp2 dp2 {schedule} zero{zero}", {"pp": 2, "microbatches": 4, "schedule": schedule, "zero": zero},
                  factory, gpt_batches(STEPS, 8), optimizer="adamw")
             for schedule, zero in (("interleaved-1f1b", 0), ("zero-bubble", 1), ("interleaved-1f1b", 2),
                                    ("zero-bubble", 2))]  # the planner's usual pick at scale; ZeRO-3 is refused
    compare_cases(4, cases)


def _launches(schedule: str) -> list[tuple[int, bool]]:
    """(microbatches awaiting backward on this rank, inside a backward?) at each bucket launch."""
    batch = gpt_batches(1, 8)[0]
    config = sw.ParallelConfig(pp=2, microbatches=4, schedule=schedule, bucket_mb=0.01)  # several buckets per stage
    pm = sw.parallelize(make_gpt(0, n_layer=4), config, sample=batch)
    launches = []
    pm.gradients.pre_hooks.append(lambda grads: launches.append(
        (sum(pm.pipeline.stats.alive.values()), torch._C._current_graph_task_id() != -1)))
    pm.train_step(batch)
    return launches, pm.pipeline.stats.peak_alive


def _schedules() -> dict[str, tuple[list, dict]]:
    return {schedule: _launches(schedule) for schedule in ("interleaved-1f1b", "1f1b", "gpipe")}


def test_stage_buckets_launch_during_the_last_backward():
    """A stage's last backward reduces buckets as they fill (as DDP's last microbatch does);
    interleaved: the later stage's buckets start while microbatches of the earlier stage
    still await backward. The last bucket carries the loss: launched after the schedule.
    Each schedule keeps the microbatches alive that it promises: GPipe all m = 4, 1F1B
    p - stage, interleaved (v = 2) torch's warm-up order."""
    peaks: dict[str, dict[int, int]] = {}
    for result in sw.testing.run_on_ranks(_schedules, 4):
        for schedule, (seen, peak) in result.items():
            peaks.setdefault(schedule, {}).update(peak)
            if schedule != "gpipe":
                assert len(seen) >= 3 and sum(inside for _, inside in seen) >= 2, (schedule, seen)
                assert seen[-1] == (0, False), (schedule, seen)
        assert max(alive for alive, _ in result["interleaved-1f1b"][0]) > 0, result
    assert peaks == {"gpipe": {0: 4, 1: 4}, "1f1b": {0: 2, 1: 1}, "interleaved-1f1b": {0: 4, 1: 3, 2: 2, 3: 1}}, peaks


class SharedBlocks(torch.nn.Module):
    """Four blocks, the first and third sharing one weight (ALBERT-style sharing): under
    interleaved pp=2 both land on rank 0, in stages 0 and 2."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))
        self.blocks[2].weight = self.blocks[0].weight

    def forward(self, batch):
        x = batch
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x.pow(2).mean()


def test_a_parameter_shared_by_two_stages_of_one_rank_is_reduced_once_both_are_done():
    batches = [torch.randn(8, 16, generator=torch.Generator().manual_seed(i)) for i in range(STEPS)]
    run_and_compare(4, {"pp": 2, "microbatches": 4, "schedule": "interleaved-1f1b"}, SharedBlocks, batches,
                    optimizer="adamw")


def _orders(schedule: str, p: int, v: int, m: int) -> dict[int, list]:
    """Every pipeline rank's steps, as the executor builds them."""
    from shardwise.parallel.pipeline.runner import single_stage_steps, steps_of

    if schedule in ("gpipe", "1f1b"):
        return {rank: single_stage_steps(schedule, rank, p, m) for rank in range(p)}
    order = torch_pipeline_order(schedule, p, v, m)
    return {rank: steps_of(order[rank]) for rank in range(p)}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved-1f1b"])
def test_a_send_is_released_only_once_its_peer_has_received_it(schedule):
    """Each rank runs its order with blocking receives (a step waits until what it receives was
    sent); when a step's receive releases earlier sends, the peer must already have run the
    steps that consume them. Sends still held at the end are bounded by the pipeline's depth,
    not the microbatch count: the memory the release saves grows with m."""
    from shardwise.parallel.pipeline.runner import _message, send_releases

    for p, v, m in ((2, 1, 4), (4, 1, 8), (2, 2, 8), (4, 2, 8), (4, 2, 16)):
        if (v > 1) != (schedule == "interleaved-1f1b"):
            continue
        orders, stages = _orders(schedule, p, v, m), p * v
        releases = {rank: send_releases(orders, rank, stages) for rank in orders}
        done = {rank: 0 for rank in orders}  # steps each rank has run
        ran = set()
        while any(done[r] < len(orders[r]) for r in orders):
            progressed = False
            for rank, steps in orders.items():
                if done[rank] == len(steps):
                    continue
                step = steps[done[rank]]
                senders = [s for s in (orders[(step.stage - 1) % p] if step.forward else orders[(step.stage + 1) % p])
                           if _message(s, stages) == step]
                if any(s not in ran for s in senders):
                    continue  # its receive waits
                for earlier in releases[rank].get(done[rank], ()):
                    assert _message(steps[earlier], stages) in ran, (p, v, m, rank, done[rank], earlier)
                ran.add(step)
                done[rank] += 1
                progressed = True
            assert progressed, "the orders deadlock"
        for rank, steps in orders.items():
            released = {a for group in releases[rank].values() for a in group}
            held = [a for a, step in enumerate(steps) if _message(step, stages) is not None and a not in released]
            assert len(held) <= 2 * p * v, (p, v, m, rank, len(held))


def test_a_pipelines_peak_does_not_grow_with_its_microbatches():
    """1F1B on two ranks holds at most two microbatches' activations at once, whatever m: the
    in-step peak (torch's profiler, bench/planner.py) at m=16 is the peak at m=4 (both past the
    warm-up; a few bytes of per-microbatch bookkeeping aside). Holding each sent activation and
    input gradient until the step's end added one (microbatch x seq x width) float32 tensor per
    microbatch and boundary: 12 x 128 KiB on the first rank. The bound is 4 of them: gloo's
    worker thread lets go of a send's tensor a moment after its wait returns, so a run may
    see the last sends of a step (one per direction and rank) still alive at its peak."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import planner as bench

    cases = [("gpt", {"pp": 2, "microbatches": m}) for m in (4, 16)]
    one = bench.MICRO * bench.SEQ * bench.WIDTH * 4
    for (_, few), (_, many) in sw.testing.run_on_ranks(bench.measure_peak, 2, cases):
        assert many - few < 4 * one, f"the peak grew by {many - few} bytes from 4 to 16 microbatches"


class WideGlue(torch.nn.Module):
    """Glue computing a wide tensor that no later step reads (a mean taken over it), before four
    blocks whose activations weigh as much as it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, GLUE_WIDTH), torch.nn.Tanh(),
                                                              torch.nn.Linear(GLUE_WIDTH, 16)) for _ in range(4))

    def forward(self, batch):
        x = batch + batch.repeat(1, 4 * GLUE_WIDTH // 16).mean(-1, keepdim=True)  # the wide tensor: 4 tensors' worth
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


GLUE_WIDTH, GLUE_ROWS = 4096, 64


def _first_stage_peak() -> tuple[int, float]:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import planner as bench

    batch = torch.randn(2 * GLUE_ROWS, 16, generator=torch.Generator().manual_seed(0))
    pm = sw.parallelize(WideGlue(), sw.ParallelConfig(pp=2, microbatches=2), plan=sw.Plan(stages=["blocks.2"]),
                        sample=batch)
    opt = sw.build_optimizer(pm, torch.optim.SGD, lr=0.1)

    def step():
        pm.train_step(batch)
        opt.step()
        opt.zero_grad()

    step()
    return pm.topology.rank, float(bench._allocation_peak(step, pm.topology.device))


def test_a_stage_lets_go_of_glue_values_after_their_last_use():
    """A stage replays its glue and calls its blocks with the values it keeps by id; it kept them
    all to the stage's end, so a glue value no later step reads (here a wide tensor whose mean is
    taken: W = 4 tensors of a microbatch's GLUE_ROWS x GLUE_WIDTH floats) stayed beside the
    blocks' activations. The first stage holds two blocks (A: each keeps its Tanh's output, one
    tensor) for both microbatches under 1F1B. Freed after its last use, the first stage's in-step
    peak is the largest of: A + W (the second microbatch's glue beside the first's blocks), 2A +
    the Linear's output before the Tanh, and 2A + two gradients of that size in backward + the
    four weight gradients (a quarter tensor each): at most 7 tensors. Kept, it is at least 2A + W +
    the Linear's output = 9 tensors."""
    one = GLUE_ROWS * GLUE_WIDTH * 4
    first = sw.testing.run_on_ranks(_first_stage_peak, 2)[0][1]
    assert first < 8 * one, f"the first stage's peak is {first / one:.2f} tensors of {one} bytes"
