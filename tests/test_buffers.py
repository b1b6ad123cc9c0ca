"""Buffers across replicas: broadcast_buffers (DDP's default) and sync_batchnorm.

A small BatchNorm CNN at dp=4. With sync_batchnorm its training equals one process on the
replicas' batches concatenated: losses, first-step gradients and parameters within
tests/parity.py's bounds (every reduction here has at most 256 terms: a statistic spans
16 samples x 4 x 4 positions, a convolution 8 x 3 x 3 inputs), and the running statistics
within the bound derived below. Without it each replica normalizes by its own samples (as
DDP does), and broadcast_buffers makes every rank's running statistics rank 0's after
each step; with broadcast_buffers=False they drift apart, which shows the flag acts.

Running statistics. With momentum m a buffer after S steps is (1 - m)^S·b_0 + Σ_k
m·(1 - m)^(S-k)·s_k, the batch statistics s_k being means over ≤ 256 forward values: they
obey the parity bound of a reduction (relative EPS_GRAD of the statistic's largest element,
tests/parity.py), so |Δb| ≤ EPS_GRAD·Σ_k m·(1 - m)^(S-k)·max|s_k| + 4·u·S·max|b| (the second
term: the updates' own rounding). The s_k are recorded from the reference run.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import shardwise as sw
from parity import EPS_GRAD, U, Run, assert_meaningful, assert_parity, reference_run, train_parallel

STEPS = 4
MOMENTUM = 0.1


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8, momentum=MOMENTUM), nn.ReLU(),
                                  nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8, momentum=MOMENTUM), nn.ReLU())
        self.head = nn.Linear(8, 4)

    def forward(self, batch):
        features = self.body(batch["x"]).mean(dim=(2, 3))
        return nn.functional.cross_entropy(self.head(features), batch["y"])


def cnn_batches(steps: int = STEPS, size: int = 16) -> list[dict]:
    gen = torch.Generator().manual_seed(3)
    return [{"x": torch.randn(size, 3, 4, 4, generator=gen) * 2 + 1, "y": torch.randint(0, 4, (size,), generator=gen)}
            for _ in range(steps)]


def _statistics_per_step(batches) -> dict[str, list[float]]:
    """Buffer name -> max|batch statistic| of each step of the one-process run (see above)."""
    model = SmallCNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    seen: dict[str, list[float]] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.BatchNorm2d):
            def hook(mod, args, name=name):
                x = args[0].detach().double()
                seen.setdefault(f"{name}.running_mean", []).append(float(x.mean(dim=(0, 2, 3)).abs().max()))
                seen.setdefault(f"{name}.running_var", []).append(float(x.var(dim=(0, 2, 3)).abs().max()))
            module.register_forward_pre_hook(hook)
    for batch in batches:
        model(batch).backward()
        opt.step()
        opt.zero_grad()
    return seen


def _without(run: Run, keys: set[str]) -> Run:
    return Run(run.losses, run.grads, {k: v for k, v in run.initial.items() if k not in keys},
               {k: v for k, v in run.final.items() if k not in keys}, run.norms, run.parameter_of)


def _layouts(batches):
    """Each layout's run on this rank, and the error an uneven split raises under sync_batchnorm."""
    runs = {name: train_parallel(config, SmallCNN, batches) for name, config in (
        ("sync", {"sync_batchnorm": True}), ("broadcast", {}), ("no-broadcast", {"broadcast_buffers": False}))}
    pm = sw.parallelize(SmallCNN(), sw.ParallelConfig(sync_batchnorm=True))
    size = 5 if dist.get_rank() == 0 else 4  # replica batches of 5, 4, 4, 4
    try:
        pm.train_step({"x": torch.randn(size, 3, 4, 4), "y": torch.zeros(size, dtype=torch.long)})
        error = None
    except sw.BatchError as exc:
        error = str(exc)
    return runs, error


def test_batchnorm_buffers_and_sync_batchnorm_dp4():
    batches = cnn_batches()
    reference = reference_run(SmallCNN, batches)
    assert_meaningful(reference)
    statistics = _statistics_per_step(batches)
    weights = [MOMENTUM * (1 - MOMENTUM) ** (STEPS - 1 - k) for k in range(STEPS)]
    results = sw.testing.run_on_ranks(_layouts, 4, batches)
    for rank, (runs, error) in enumerate(results):
        assert_parity(_without(reference, set(statistics)), _without(runs["sync"], set(statistics)))
        for key, per_step in statistics.items():
            want, got = reference.final[key].double(), runs["sync"].final[key].double()
            bound = EPS_GRAD * sum(w * s for w, s in zip(weights, per_step)) + 4 * U * STEPS * float(want.abs().max())
            diff = float((got - want).abs().max())
            assert diff <= bound, f"rank {rank} {key}: running statistic differs by {diff:.3g} > {bound:.3g}"
            moved = float((want - reference.initial[key].double()).abs().max())
            assert moved > 10 * bound, (key, moved, bound)  # the statistic is far from its start: it was checked
        assert runs["sync"].final["body.1.num_batches_tracked"] == STEPS
        assert error is not None and "replicas' batches differ in size" in error, error
    for key in statistics:
        broadcast = [runs["broadcast"].final[key] for runs, _ in results]
        assert all(torch.equal(b, broadcast[0]) for b in broadcast), key
        apart = [runs["no-broadcast"].final[key] for runs, _ in results]
        assert not all(torch.equal(b, apart[0]) for b in apart), key
        # the unsynchronized statistics are not one process's: sync_batchnorm is what makes them so
        assert not torch.allclose(broadcast[0], reference.final[key], rtol=1e-3, atol=0), key
