"""A rank that raises, exits or stalls (see test_bad_inputs.py): each in a world of its own, the
others fail with a message naming it, within seconds.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch.distributed as dist

import shardwise as sw
from parity import gpt_batches, make_gpt
from bad_inputs import SLOWEST_ALLOWED_S, TIMES, outcome, rank


# ==== a rank that raises, exits or stalls ===========================================================
def _peer_fails(action: str, timeout_s: float | None, report: str | None = None):
    config = sw.ParallelConfig() if timeout_s is None else sw.ParallelConfig(timeout_s=timeout_s)
    pm = sw.parallelize(make_gpt(0), config)
    batch = gpt_batches(1, 4)[0][rank() * 2:(rank() + 1) * 2]
    pm.train_step(batch)
    if rank() == 1:
        if action == "raises":
            pm.module.wpe.forward = _boom
            try:
                pm.train_step(batch)
            except ValueError as exc:
                return str(exc)
            return "no error"
        if action == "exits":
            os._exit(3)
        time.sleep(timeout_s + 5)
        return "slept"
    result = outcome(lambda: pm.train_step(batch))
    if report:  # the harness raises for the dead rank; rank 0's own outcome goes through a file
        Path(report).write_text(json.dumps(result[:3]))
    return result


def _boom(*args):
    raise ValueError("a bug in rank 1's forward")


@pytest.mark.parametrize("action, timeout_s, phrase", [
    ("raises", None, "rank 1: out of step: train_step #2 raised ValueError: a bug in rank 1's forward"),
    ("sleeps", 3.0, "not every rank joined within timeout_s=3s"),
])
def test_peer_that_raises_or_stalls(action, timeout_s, phrase):
    results = sw.testing.run_on_ranks(_peer_fails, 2, action, timeout_s, timeout=60)
    kind, message, seconds, _ = results[0]
    assert kind == "CommunicationError" and phrase in message, message
    assert seconds < SLOWEST_ALLOWED_S, seconds
    TIMES[f"peer {action}"] = seconds


def test_peer_that_exits_is_named(tmp_path):
    report = tmp_path / "rank0.json"
    with pytest.raises(sw.RankFailedError, match=r"rank 1 of 2 died with exit code 3"):
        sw.testing.run_on_ranks(_peer_fails, 2, "exits", None, str(report), timeout=60)
    kind, message, seconds = json.loads(report.read_text())
    assert kind == "CommunicationError" and "a peer closed its connection" in message, message
    assert seconds < SLOWEST_ALLOWED_S
    TIMES["peer exits"] = seconds


def _peer_dies_inside(kind: str, report: str):
    """Rank 1 exits in the middle of a tp forward, a pipeline schedule, cp attention or the experts' dispatch."""
    configs = {"tp": (sw.ParallelConfig(tp=2), "gpt", None), "pp": (sw.ParallelConfig(pp=2, microbatches=2), None,
                                                                  gpt_batches(1, 4)[0]),
               "cp": (sw.ParallelConfig(cp=2), None, None)}
    if kind == "ep":  # experts split over the two ranks: rank 1 dies as its tokens reach the experts
        from test_expert import make_moe, moe_batches

        pm = sw.parallelize(make_moe("mixtral"), sw.ParallelConfig(ep=2))
        batch = {k: v[rank() * 2:rank() * 2 + 2] for k, v in moe_batches(1)[0].items()}
        pm.train_step(batch)
        if rank() == 1:
            pm.module.lm.model.layers[-1].mlp.experts.register_forward_pre_hook(lambda *args: os._exit(3))
        result = outcome(lambda: pm.train_step(batch))
        Path(report).write_text(json.dumps(result[:3]))
        return result
    config, plan, sample = configs[kind]
    pm = sw.parallelize(make_gpt(0, n_layer=4, block_size=16), config, plan=plan, sample=sample)
    batch = gpt_batches(1, 4)[0]
    if kind == "cp":
        batch = {"input_ids": batch[:, :-1][:, :16], "labels": batch[:, 1:][:, :16]}
    pm.train_step(batch)
    if rank() == 1 and kind == "pp":  # stages replay a captured program: die at the first send of the schedule
        import shardwise.parallel.pipeline.runner as runner

        class Dying:
            def __getattr__(self, name):
                return getattr(dist, name)

            @staticmethod
            def isend(*args, **kwargs):
                os._exit(3)

        runner.dist = Dying()
    elif rank() == 1:
        pm.module.layers[-1].register_forward_hook(lambda *args: os._exit(3))
    result = outcome(lambda: pm.train_step(batch))
    Path(report).write_text(json.dumps(result[:3]))
    return result


@pytest.mark.parametrize("kind", ["tp", "pp", "cp", "ep"])
def test_peer_that_exits_inside_a_parallel_forward_is_named(tmp_path, kind):
    """Before, the survivor saw gloo's raw 'Connection reset by peer'."""
    report = tmp_path / "rank0.json"
    with pytest.raises(sw.RankFailedError, match=r"rank 1 of 2 died with exit code 3"):
        sw.testing.run_on_ranks(_peer_dies_inside, 2, kind, str(report), timeout=60)
    kind_, message, seconds = json.loads(report.read_text())
    assert kind_ == "CommunicationError" and "a peer closed its connection" in message and "rank 0:" in message, message
    assert seconds < SLOWEST_ALLOWED_S
    TIMES[f"peer exits inside {kind}"] = seconds
