"""Bad input fails fast with a ShardwiseError naming the value and the fix, the same on
every rank, and a dead or silent peer makes the others fail instead of hang."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardwise as sw
from parity import gpt_batches, make_gpt


# -- config --------------------------------------------------------------------------
def test_degree_that_does_not_divide_world():
    with pytest.raises(sw.ConfigError, match=r"tp=3 does not divide world size 8; valid tp values: 1, 2, 4, 8"):
        sw.ParallelConfig(tp=3).resolve(8)
    with pytest.raises(sw.ConfigError, match=r"dp=3 .* needs 6 ranks but world size is 8; set dp=4"):
        sw.ParallelConfig(dp=3, tp=2).resolve(8)
    with pytest.raises(sw.ConfigError, match=r"tp\*cp\*pp = 4\*1\*4 = 16 does not divide world size 8"):
        sw.ParallelConfig(tp=4, pp=4).resolve(8)


@pytest.mark.parametrize("kwargs, pattern", [
    ({"tp": 0}, r"tp=0 is not a positive integer"),
    ({"pp": 1.5}, r"pp=1.5 is not a positive integer"),
    ({"zero": 4}, r"zero=4 is not a ZeRO stage"),
    ({"schedule": "fast"}, r"schedule='fast' is unknown; use one of 'gpipe'"),
    ({"microbatches": 0}, r"microbatches=0 is not a positive integer"),
    ({"bucket_mb": -1}, r"bucket_mb=-1 must be a positive number"),
])
def test_config_fields_are_validated(kwargs, pattern):
    with pytest.raises(sw.ConfigError, match=pattern):
        sw.ParallelConfig(**kwargs)


def _parallelize_error(config: dict):
    try:
        sw.parallelize(make_gpt(0), sw.ParallelConfig(**config))
    except sw.ShardwiseError as exc:
        return type(exc).__name__, str(exc)
    return None


def test_bad_degrees_raise_the_same_error_on_every_rank():
    results = sw.testing.run_on_ranks(_parallelize_error, 4, {"dp": 3}, timeout=60)
    assert results[0] is not None and results[0][0] == "ConfigError"
    assert "dp=3" in results[0][1] and "world size is 4" in results[0][1]
    assert all(r == results[0] for r in results)


# -- module and batch ----------------------------------------------------------------
class NoParams(nn.Module):
    def forward(self, x):
        return x.sum()


class ReturnsLogits(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        return self.lin(x)


class ReturnsTuple(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x):
        out = self.lin(x)
        return out.pow(2).mean(), out


def test_module_without_parameters():
    with pytest.raises(sw.ModelError, match="NoParams has no trainable parameters"):
        sw.parallelize(NoParams())


def test_not_a_module_and_double_wrap():
    with pytest.raises(sw.ModelError, match="needs a torch.nn.Module, got function"):
        sw.parallelize(lambda x: x)
    pm = sw.parallelize(ReturnsTuple())
    with pytest.raises(sw.ModelError, match="already a ParallelModule"):
        sw.parallelize(pm)


def test_train_step_needs_a_scalar_loss_first():
    pm = sw.parallelize(ReturnsLogits())
    with pytest.raises(sw.ModelError, match=r"return the scalar loss first .* shape \(8, 3\)"):
        pm.train_step(torch.randn(8, 4))
    pm = sw.parallelize(ReturnsTuple())  # (loss, output) is fine
    assert pm.train_step(torch.randn(8, 4)).dim() == 0
    with torch.no_grad(), pytest.raises(sw.ModelError, match="does not require grad"):
        pm.train_step(torch.randn(8, 4))


def test_batch_not_divisible_by_microbatches():
    pm = sw.parallelize(ReturnsTuple(), sw.ParallelConfig(microbatches=4))
    with pytest.raises(sw.BatchError, match=r"batch size 6 is not divisible by microbatches=4; .* \(e.g. 8\)"):
        pm.train_step(torch.randn(6, 4))
    with pytest.raises(sw.BatchError, match=r"batch\['y'\] has 7 samples along dim 0 but batch\['x'\] has 8"):
        sw.batch.split_batch({"x": torch.randn(8, 4), "y": torch.randn(7)}, 4)
    with pytest.raises(sw.BatchError, match="holds no tensor with a batch dimension"):
        pm.train_step({"x": 3})


def test_optimizer_needs_the_parallel_module():
    model = ReturnsTuple()
    with pytest.raises(sw.ShardwiseError, match="build_optimizer needs the ParallelModule"):
        sw.build_optimizer(model, torch.optim.SGD, lr=0.1)
    pm = sw.parallelize(model)
    with pytest.raises(sw.ShardwiseError, match="not a parameter of the ParallelModule"):
        sw.build_optimizer(pm, torch.optim.SGD, params=[nn.Parameter(torch.zeros(2))], lr=0.1)


def test_full_state_dict_mismatch():
    pm = sw.parallelize(ReturnsTuple())
    sd = pm.full_state_dict()
    with pytest.raises(sw.CheckpointError, match=r"missing keys \['lin.bias'\]"):
        pm.load_full_state_dict({"lin.weight": sd["lin.weight"]})
    with pytest.raises(sw.CheckpointError, match=r"'lin.weight' has shape \(2, 4\) but the model's is \(1, 4\)"):
        pm.load_full_state_dict({"lin.weight": torch.zeros(2, 4), "lin.bias": sd["lin.bias"]})


# -- dead and silent peers -------------------------------------------------------------
def _peer_leaves(timeout_s: float, peer_action: str):
    pm = sw.parallelize(make_gpt(0), sw.ParallelConfig(timeout_s=timeout_s))
    batch = gpt_batches(1, 4)[0][dist.get_rank() * 2:dist.get_rank() * 2 + 2]
    if dist.get_rank() == 1:
        if peer_action == "sleep":
            time.sleep(timeout_s + 4)
        return "left"  # returning ends this process: its connections close
    start = time.monotonic()
    try:
        pm.train_step(batch)
    except sw.CommunicationError as exc:
        return str(exc), time.monotonic() - start
    return "no error", 0.0


@pytest.mark.parametrize("peer_action", ["exit", "sleep"])
def test_dead_or_silent_peer_fails_with_a_message(peer_action):
    results = sw.testing.run_on_ranks(_peer_leaves, 2, 2.0, peer_action, timeout=60)
    message, elapsed = results[0]
    assert message.startswith("rank 0: train_step #1"), message
    expected = {"exit": "a peer closed its connection", "sleep": "not every rank joined within timeout_s=2s"}
    assert expected[peer_action] in message and "rank 1: last entered parallelize #1" in message, message
    assert elapsed < 10
