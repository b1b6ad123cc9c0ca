"""The planner against bench/published_runs.py's corpus of runs nobody here made: step times
within the issue's bounds, and the bench's analyses (the walk to a pick, the published A/B
pairs, the ranking among a run's own software's choices, the count behind the eager
elementwise charge) doing what they say. Arithmetic only, no timing."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import published_runs as published  # noqa: E402


def _executor_apart(run) -> bool:
    """Runs whose step time the planner does not model as they ran (see the test below; their
    memory it does: Cluster(executor="fsdp2"))."""
    return run.source == "torchtitan"


def test_published_runs_within_bounds():
    """bench/published_runs.py's corpus: the step time predicted for each published layout
    against the published one, within the issue's bounds: median |error| <= 10% on the
    held-out part and on the whole, and at most 25% on every run but torchtitan's, whose
    step the planner does not time as it ran: its selective checkpointing recomputes every second
    matmul (+12% of an 8B Llama's compute), its H100s ran at 500 W with a peak it does not
    know, two rows are eager (they miss by 18-19%).
    Dropping a term breaks a bound: Megatron-LM's materialized attention charged as flash
    attention puts its 1.7B at -30%; no elementwise traffic at all puts MPT 125M at -31%;
    one NIC per node for every run puts llm-foundry's 13B on 64 H100s at +235% (DeepSpeed's
    2021 ZeRO-3 rows are run so, as `Run.executor` says, and land within 16%)."""
    errors = {True: [], False: []}
    for run in published.corpus():
        got = published.predict(run)
        error = got.step_seconds / run.step_seconds(got.model_flops) - 1
        errors[run.calibrate].append(abs(error))
        if not _executor_apart(run):
            assert abs(error) <= 0.25, f"{run.name}: predicted {got.step_seconds:.3f} s, {error:+.1%} off the published"
    assert len(errors[True]) + len(errors[False]) >= 30
    assert statistics.median(errors[False]) <= 0.10
    assert statistics.median(errors[True] + errors[False]) <= 0.10


def test_walk_from_a_published_layout_ends_at_the_pick():
    """bench/planner_published.py explains a pick's MFU over a published run by walking from the
    run's layout to the pick one group of choices at a time. The walk must start at the run's own
    prediction and end at the pick's exactly, else its steps credit gains to the wrong choices.
    Fault: a step that forgets a field (sequence parallelism with the degrees) ends elsewhere."""
    from dataclasses import replace

    import planner_published as analysis
    from shardwise.planner.search import search

    runs = {r.name: r for r in published.corpus()}
    for name, first_steps in (("korthikanti 175B sp + selective",
                               ["published layout",
                                "flash attention, torch's cross-entropy, torch's kernels, shardwise's recompute, sp, tp "
                                "backward and ZeRO-2/3 gradients freed between steps, torch's foreach Adam"]),
                              ("mpt 70b a100 seq 2048 fsdp64",
                               ["published layout", "torch's cross-entropy, shardwise's recompute, sp and ZeRO-0/1 "
                                                    "gradient buffers, torch's foreach Adam"])):
        run = runs[name]
        pick = search(replace(run.spec, attention="flash", fused_loss=False), run.cluster, global_batch=run.global_batch,
                      seq_len=run.seq, top=1, dtypes=(2,))[0]
        steps = analysis.walk(run, pick)
        assert [label for label, _ in steps[:2]] == first_steps
        assert steps[0][1].time_terms == published.predict(run).time_terms
        last = steps[-1][1]
        assert last.config == pick.config and last.virtual == pick.virtual
        assert last.time_terms == pick.time_terms and last.memory_terms == pick.memory_terms
        groups = analysis.walk_groups(steps)
        assert groups[0][0] == "software" and sum(points for _, points in groups) == pytest.approx(
            (pick.mfu - steps[0][1].mfu) * 100, rel=1e-9)
    # the medians the bench prints sort each step by its label (fault: "zero-bubble" read as a ZeRO stage)
    same = published.predict(runs["mpt 70b a100 seq 2048 fsdp64"])
    labels = ["published layout", "zero-bubble/v4", "zero2, 25 MiB buckets", "recompute none", "dp8 tp2+sp pp4 cp1 mb1x256",
              "interleaved-1f1b/v2", "flash attention"]
    assert [g for g, _ in analysis.walk_groups([(label, same) for label in labels])] == [
        "schedule", "sharding", "recompute", "degrees", "schedule", "software"]


def test_published_alternatives_are_the_same_work_in_other_layouts():
    """The bench's A/B check pairs runs published for the same work (model, cluster, sequence and
    batch) in different layouts: Korthikanti's four full-recompute / sp + selective pairs,
    Megatron's five ZeRO-3 / PTD-P pairs at equal GPUs and batch, and torchtitan's Llama 2 13B
    without recompute and with its op-level selective checkpointing. Faults: pairing by model
    alone (Megatron's 530B on 640 GPUs against 560; torchtitan's Llama 2 70B at local batch 1
    against 2) or keeping pairs of one layout (torchtitan's eager and compiled runs differ in no
    choice the planner makes) change the set."""
    import planner_published as analysis

    pairs = {(a.name, b.name) for a, b in analysis.alternatives(published.corpus())}
    korthikanti = {(f"korthikanti {b}B full recompute", f"korthikanti {b}B sp + selective") for b in (22, 175, 530, 1000)}
    megatron = {(f"megatron gpt-{b} zero3 x{g}", f"megatron gpt-{b} tp8 pp{pp} x{g}")
                for b, pp, gpus in (("174.6b", 12, (384, 768, 1536)), ("529.6b", 35, (1120, 2240))) for g in gpus}
    torchtitan = {("torchtitan llama2 13B no recompute a100 fsdp64", "torchtitan llama2 13B selective op a100 fsdp64")}
    assert pairs == korthikanti | megatron | torchtitan


def test_software_choices_keep_the_published_zero_stage():
    """The bench's last ranking holds a published layout's degrees, recompute, sp and ZeRO stage
    and varies what its software could choose. Megatron's 1.7B row (dp32, no pipeline, ZeRO 0):
    the layouts with its recompute and sp are those of its microbatch sizes at each of ZeRO's four
    stages (a higher stage holds less, so each fits where ZeRO 0 does): its software's choices are
    a quarter of them, none faster. Fault: keeping the other stages counts all four."""
    import planner_published as analysis

    run = next(r for r in published.corpus() if r.name == "megatron 1.7B tp1 pp1 x32")
    own, _, _, software = analysis.ranks(run, published.predict(run).step_seconds)
    assert own[1] == 4 * software[1] > 0 and software[0] == 1


def test_elementwise_count_reads_and_writes_every_op_but_matmuls_and_views():
    """bench/elementwise_count.py's counter, which sets the fitted eager charge against what a
    block's ops move: an add of two bf16 tensors reads two values an element and writes one, a
    cast to float32 reads two bytes and writes four, a view moves nothing, a matmul is charged apart."""
    from elementwise_count import ElementwiseBytes

    x, w = torch.ones(4, 8, dtype=torch.bfloat16), torch.ones(8, 8, dtype=torch.bfloat16)
    counter = ElementwiseBytes()
    with counter:
        (x + x).view(8, 4)
        x @ w
        x.float()
    assert counter.by_op == {"add": 3 * 32 * 2, "_to_copy": 32 * (2 + 4)}
