"""sw.current_topology() and the group helpers inside model code.

A layer written by hand with sw.split / sw.reduce (a row-parallel product: each tp rank
multiplies its slice of the features by its slice of the weight, the partial products are
summed) trains at tp=2 x dp=2 exactly as the same model on one process, where the helpers
are the identity; bounds and derivation in tests/parity.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardwise as sw
from parity import Case, compare_cases

STEPS = 4


class RowParallelProduct(nn.Module):
    """y = x @ w.T computed as the sum over tp ranks of x's and w's feature slices."""

    def __init__(self, features: int, out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out, features) / features ** 0.5)
        self.seen_tp = 0  # the tp size the last forward ran under (1 on one process)

    def forward(self, x):
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            self.seen_tp = sw.current_topology().sizes["tp"]
        partial = sw.split(x, "tp", dim=-1) @ sw.split(self.weight, "tp", dim=1).T
        return sw.reduce(partial, "tp")


class HandParallelMLP(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(8, 16)
        self.product = RowParallelProduct(16, 8)

    def forward(self, batch):
        return (self.product(torch.tanh(self.up(batch["x"]))) - batch["y"]).pow(2).mean()


def mlp_batches(steps: int = STEPS) -> list[dict]:
    gen = torch.Generator().manual_seed(5)
    return [{"x": torch.randn(8, 8, generator=gen), "y": torch.randn(8, 8, generator=gen)} for _ in range(steps)]


def test_hand_written_parallel_layer_matches_one_process():
    compare_cases(4, [Case("tp2 dp2 hand-written row-parallel", {"tp": 2}, HandParallelMLP, mlp_batches(),
                           plan=sw.Plan(name="none"))])


def _dp_rank() -> int:
    """This replica's index inside a parallel step; 0 on one process (the reference)."""
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        return sw.current_topology().dp_rank
    return 0


class BatchStatistics(nn.Module):
    """Features centred by their mean over the whole batch: the replicas' means averaged over dp."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, batch):
        h = torch.tanh(self.up(batch["x"]))
        centred = h - sw.reduce(h.mean(0), "dp", "mean")
        return (self.down(centred) - batch["y"]).pow(2).mean()


class InBatchNegatives(nn.Module):
    """A contrastive loss whose negatives are every replica's samples (gathered over dp)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.query = nn.Linear(8, 16)
        self.key = nn.Linear(8, 16)

    def forward(self, batch):
        q, k = self.query(batch["x"]), self.key(batch["y"])
        keys = sw.gather(k, "dp", dim=0)
        labels = torch.arange(len(q)) + _dp_rank() * len(q)
        return nn.functional.cross_entropy(q @ keys.T, labels)


def test_dp_group_in_model_code_matches_one_process():
    """Batch statistics and in-batch negatives over the dp group: the gradient one process
    gets on the concatenated batch (DTensor's pass-through backward gave 20-40% off)."""
    compare_cases(4, [Case("dp4 batch statistics", {}, BatchStatistics, mlp_batches()),
                      Case("dp4 in-batch negatives", {}, InBatchNegatives, mlp_batches()),
                      Case("dp2 tp2 in-batch negatives", {"tp": 2}, InBatchNegatives, mlp_batches(),
                           plan=sw.Plan(name="none"))])


def _outside_a_step():
    pm = sw.parallelize(HandParallelMLP(), sw.ParallelConfig(tp=2), plan=sw.Plan(name="none"))
    pm.train_step(mlp_batches(1)[0])
    seen = pm.module.product.seen_tp
    try:
        sw.current_topology()
        outside = None
    except sw.ConfigError as exc:
        outside = str(exc)
    return seen, outside, sw.current_topology(pm.topology).sizes["tp"]


def test_current_topology_is_the_running_step_s():
    for seen, outside, explicit in sw.testing.run_on_ranks(_outside_a_step, 2):
        assert seen == 2 and explicit == 2
        assert outside is not None and "pass pmodel.topology" in outside


def test_helpers_are_the_identity_on_one_process():
    x = torch.randn(4, 6)
    assert torch.equal(sw.split(x, "tp"), x) and torch.equal(sw.gather(x, "tp"), x)
    assert torch.equal(sw.reduce(x, "tp"), x)
    with pytest.raises(sw.ConfigError):
        sw.reduce(x, "tp", op="max")
