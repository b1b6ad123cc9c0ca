"""parallelize(model, "auto"): the planner picks the layout (and the zoo plan) on the job's own
devices, and training in it equals one process's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import shardwise as sw
from parity import Run, _full, assert_parity, make_gpt, optimizer_for, reference_run
from shardwise.errors import ConfigError
from shardwise.planner import Cluster

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import planner as bench  # noqa: E402  (bench/planner.py: its model builders)


def _auto_run(batches) -> Run:
    """On each rank: parallelize with config='auto', train, return what parity compares."""
    model = make_gpt(0)
    pm = sw.parallelize(model, "auto", sample={k: v[:4] for k, v in batches[0].items()})
    cls, kwargs = optimizer_for("sgd")
    opt = sw.build_optimizer(pm, cls, **kwargs)
    index, count = sw.data_parallel_info(pm)
    run = Run([], [])
    for batch in batches:
        per = len(batch["labels"]) // count
        run.losses.append(float(pm.train_step({k: v[index * per:(index + 1) * per] for k, v in batch.items()})))
        if not run.grads:
            run.grads.append({k: v.clone() for k, v in pm.full_grad_dict().items()})
        opt.step()
        opt.zero_grad()
    run.final = {k: _full(v) for k, v in pm.full_state_dict().items()}
    run.layout = pm.config.describe()
    return run


def test_auto_layout_matches_one_process():
    gen = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(3):
        ids = torch.randint(0, 64, (16, 33), generator=gen)
        batches.append({"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()})
    reference = reference_run(make_gpt, batches)
    runs = sw.testing.run_on_ranks(_auto_run, 4, batches)
    assert len({r.layout for r in runs}) == 1
    for run in runs:
        assert_parity(reference, run, "sgd")


def test_auto_plans_on_the_jobs_devices():
    """config="auto" ranks layouts on the devices the job runs on: accelerators by their table
    entry (tests/test_accelerator.py checks a GPU's entry and memory), CPU ranks sharing this
    machine; a device it cannot read is refused, not planned as a CPU."""
    from shardwise.planner.auto import job_cluster
    from shardwise.planner.cluster import device_kind

    names = {"NVIDIA H100 80GB HBM3": "h100", "NVIDIA A100-SXM4-80GB": "a100", "NVIDIA H200": "h200",
             "NVIDIA GH200 480GB": "h200", "NVIDIA B200": "b200", "Tesla V100-SXM2-32GB": None}
    assert {name: device_kind(name) for name in names} == names
    assert job_cluster(4, torch.device("cpu")) == Cluster.local(4)
    with pytest.raises(ConfigError, match="cannot read the name and memory of meta"):
        job_cluster(4, torch.device("meta"))


def test_auto_plan_for_a_given_config():
    """plan="auto" with a config: the model's zoo plan (sp variant, as the config asks)."""
    from shardwise.planner.auto import auto_layout

    config = sw.ParallelConfig(tp=2, sequence_parallel=True)
    chosen_config, plan = auto_layout(make_gpt(0), config, "auto", None, 2)
    assert chosen_config is config and plan.name == "gpt" and plan.activations  # the sequence-parallel variant
    _, plan = auto_layout(bench.build("llama"), sw.ParallelConfig(tp=2), "auto", None, 2)
    assert plan.name == "llama" and not plan.activations
    _, plan = auto_layout(make_gpt(0), sw.ParallelConfig(), "auto", None, 2)
    assert plan.params == {}  # nothing to shard at tp=1
    with pytest.raises(ConfigError, match="chooses the plan too"):
        auto_layout(make_gpt(0), "auto", "gpt", None, 2)
