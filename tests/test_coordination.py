"""The agreement's fast path (a recursive-doubling sum of check sums) decides as the gathered
records would: the same sums on every rank, agreement where only groups that need not agree
differ, and the gathered path's named error where any rank differs from a peer it must match."""

from __future__ import annotations

import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.control_sum import RecursiveDoublingSum, doubling_steps
from shardwise.coordination import Coordinator, Fingerprint


def _outcome(fn):
    try:
        return fn()
    except sw.ShardwiseError as exc:
        return type(exc).__name__, str(exc)


def _fast_path_cases():
    rank, world = dist.get_rank(), dist.get_world_size()
    # the fast path as from 7 ranks: its own control group, as a topology makes
    coordinator = Coordinator(dist.new_group(list(range(world)), backend="gloo"), 60.0, fast_path=True)
    out = {}
    # sums exact at every rank count (the world is 5: one rank folds in beyond the power of two)
    vector = torch.tensor([rank, 10 ** 12 * (rank + 1), -rank, 7], dtype=torch.int64)
    work = RecursiveDoublingSum(coordinator.group, coordinator.ranks).start(vector)
    work.wait()
    out["sum"] = work.result.tolist()
    agreed = coordinator.agree("agree", value=rank + 1)
    out["plain"] = (agreed.total, agreed.table is None)
    out["every value"] = coordinator.agree("agree", value=rank + 1, every_value=True).values()
    pairs = [[0, 1], [2, 3], [4]]  # groups that must agree inside, not with each other
    across = Fingerprint(rank // 2, lambda: [str(rank // 2)], sw.BatchError, "the fix", peers=pairs)
    out["groups differ from each other"] = coordinator.agree("agree", fingerprints=[across]).table is None
    inside = Fingerprint(8 if rank == 3 else 7, lambda: [f"batch {8 if rank == 3 else 7}"], sw.BatchError,
                         "the fix", peers=pairs)
    out["a rank differs from its peer"] = _outcome(lambda: coordinator.agree("agree", fingerprints=[inside]))
    whole = Fingerprint(1 if rank == 4 else 0, lambda: [f"shape {1 if rank == 4 else 0}"], sw.PlanError, "fix")
    out["a rank differs from the world"] = _outcome(lambda: coordinator.agree("agree", fingerprints=[whole]))
    problem = sw.CheckpointError("rank 2 cannot read the file") if rank == 2 else None
    out["a problem on one rank"] = _outcome(lambda: coordinator.agree("agree", problem))
    out["different operations"] = _outcome(lambda: coordinator.agree("forward" if rank == 1 else "agree"))
    return out


def test_fast_path_decides_as_the_gathered_records_would():
    world = 5
    results = sw.testing.run_on_ranks(_fast_path_cases, world)
    for rank, got in enumerate(results):
        assert got["sum"] == [10, 15 * 10 ** 12, -10, 35]
        assert got["plain"] == (15, True), "the fast path agreed and summed the values"
        assert got["every value"] == [1, 2, 3, 4, 5]
        assert got["groups differ from each other"] is True, "groups that need not agree took the slow path"
        assert got["a rank differs from its peer"] == (
            "BatchError", "ranks [2, 3] must agree at agree, but rank 3 differs from rank 2: rank 2 has batch 7, "
            "rank 3 has batch 8. the fix")
        assert got["a rank differs from the world"] == (
            "PlanError", "ranks [0, 1, 2, 3, 4] must agree at agree, but rank 4 differs from rank 0: rank 0 has "
            "shape 0, rank 4 has shape 1. fix")
        assert got["a problem on one rank"] == (
            "CheckpointError", "rank 2 cannot read the file (found on rank 2, raised on every rank)")
        kind, message = got["different operations"]
        assert kind == "CommunicationError" and "ranks [1] called forward" in message, message
    assert doubling_steps(5) == 4 and doubling_steps(4) == 2 and doubling_steps(1024) == 10


class _Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, batch):
        return (self.lin(batch[:, :4]).squeeze(-1) - batch[:, 4]).pow(2).mean()


def _rows(world: int) -> torch.Tensor:
    return torch.randn(world + 1, 5, generator=torch.Generator().manual_seed(3))


def _train_default(steps: int):
    """A step's sample counts travel in the agreement: rank 0's replica holds two samples, the
    others one, so the gradient is right only if the agreement's sum is."""
    torch.manual_seed(0)
    pm = sw.parallelize(_Regression(), sw.ParallelConfig())
    opt = sw.build_optimizer(pm, torch.optim.SGD, lr=0.1)
    rank, rows = dist.get_rank(), _rows(dist.get_world_size())
    mine = rows[:2] if rank == 0 else rows[rank + 1:rank + 2]
    for _ in range(steps):
        pm.train_step(mine)
        opt.step()
        opt.zero_grad()
    return pm.coordinator.summing is not None, [t.tolist() for t in pm.full_state_dict().values()]


def test_fast_path_from_seven_ranks():
    """Below 7 ranks gloo's all-gather ring is at most two steps longer than the sum, which
    costs a thread hand-off: the records are gathered directly. From 7 the sum carries a
    step's sample counts: training equals one process on the whole batch."""
    assert [fast for fast, _ in sw.testing.run_on_ranks(_train_default, 4, 1)] == [False] * 4
    torch.manual_seed(0)
    model = _Regression()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        model(_rows(7)).backward()
        opt.step()
        opt.zero_grad()
    expected = [t.tolist() for t in model.state_dict().values()]
    for fast, params in sw.testing.run_on_ranks(_train_default, 7, 3):
        assert fast
        # float32 sums of 8 terms in another order: a gradient off by <= 8 ulp (5e-7 relative); SGD
        # lr 0.1 moves O(1) parameters by O(0.1) a step, so 3 steps differ by ~2e-7 at most (5x margin)
        torch.testing.assert_close(params, expected, rtol=1e-5, atol=1e-6)
