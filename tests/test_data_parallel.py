"""Data-parallel parity: several gloo processes against one process on the whole batch."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardwise as sw
from parity import (SGD, Run, assert_meaningful, assert_parity, full_grads, gpt_batches, make_gpt, reference_run,
                    replica_slice)

STEPS = 5


def _train(config: dict, factory, batches, mode: str = "train_step"):
    pm = sw.parallelize(factory(), sw.ParallelConfig(**config))
    opt = sw.build_optimizer(pm, torch.optim.SGD, **SGD)
    index, count = sw.data_parallel_info(pm)
    losses, extra, grads = [], {}, None
    for batch in batches:
        local = replica_slice(batch, index, count)
        if mode == "train_step":
            loss = pm.train_step(local)
        elif mode == "backward":  # plain forward + loss.backward(), gradients synced by hooks
            loss = pm(local)
            loss.backward()
            loss = _mean_over_replicas(loss.detach(), pm)
        elif mode == "synced":  # DDP users' accumulation over 3 slices, each backward synchronizing
            parts = [pm(replica_slice(local, i, 3)) for i in range(3)]
            for part in parts:
                (part / 3).backward()
            loss = _mean_over_replicas(torch.stack(parts).detach().mean(), pm)
        elif mode == "no_sync":  # manual accumulation over 3 slices, one sync at the end
            parts = [replica_slice(local, i, 3) for i in range(3)]
            with pm.no_sync():
                first = [pm(p) for p in parts[:2]]
                for l in first:
                    (l / 3).backward()
            last = pm(parts[2])
            (last / 3).backward()
            loss = _mean_over_replicas(torch.stack([*first, last]).detach().mean(), pm)
        grads = grads or full_grads(pm.module)
        opt.step()
        extra["grad_none"] = sorted(n for n, p in pm.module.named_parameters() if p.grad is None)
        if mode == "no_sync":  # buckets zeroed in place, grads stay bucket views
            opt.zero_grad(set_to_none=False)
            assert all(p.grad is not None and not p.grad.any() for p in pm.parameters())
        elif mode == "train_step":
            opt.zero_grad()
            assert all(p.grad is None for p in pm.parameters())
        else:  # plain torch zero_grad(set_to_none=True): the reducer must cope
            for p in pm.parameters():
                p.grad = None
        losses.append(float(loss.detach()))
    if hasattr(pm.module, "lm_head"):
        extra["tied"] = pm.module.lm_head.weight is pm.module.wte.weight
    extra["reduced_bytes"] = dict(pm.gradients.stats.bytes)
    run = Run(losses, [grads], final={k: v.detach().clone() for k, v in pm.full_state_dict().items()})
    return run, extra


def _mean_over_replicas(value: torch.Tensor, pm) -> torch.Tensor:
    value = value.clone()
    dist.all_reduce(value, group=pm.topology.group("dp"))
    return value / pm.topology.sizes["dp"]


def _check_all_ranks(results, factory, batches):
    reference = reference_run(factory, batches)
    assert_meaningful(reference)
    for run, _ in results:
        assert_parity(reference, run)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("microbatches", [1, 4])
def test_dp_parity_gpt(world, microbatches):
    factory = functools.partial(make_gpt, 0)
    batches = gpt_batches(STEPS, batch=4 * world)
    results = sw.testing.run_on_ranks(_train, world, {"microbatches": microbatches}, factory, batches)
    _check_all_ranks(results, factory, batches)
    for _, extra in results:
        assert extra["tied"], "tied embedding and head must stay one parameter"
        assert extra["grad_none"] == []


def test_dp_plain_backward_and_no_sync():
    factory = functools.partial(make_gpt, 0)
    batches = gpt_batches(STEPS, batch=12)
    for mode in ("backward", "no_sync", "synced"):
        results = sw.testing.run_on_ranks(_train, 2, {}, factory, batches, mode)
        _check_all_ranks(results, factory, batches)


# where gradients live apart from .grad, a second synchronized backward without zero_grad is
# accumulation to one user and .grad cleared by hand to another: refused, not guessed
APART = {"float32 buckets of bf16": dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
         "zero=1": dict(zero=1), "zero=2": dict(zero=2), "zero=3": dict(zero=3)}


def _second_synced_backward() -> dict[str, tuple[str, bool]]:
    outcomes = {}
    for label, config in APART.items():
        pm = sw.parallelize(make_gpt(0), sw.ParallelConfig(**config))
        opt = sw.build_optimizer(pm, torch.optim.SGD, **SGD)
        index, count = sw.data_parallel_info(pm)
        local = replica_slice(gpt_batches(1, 8)[0], index, count)
        (pm(local[:2]) / 2).backward()
        try:
            (pm(local[2:]) / 2).backward()
            outcome = "accumulated"
        except sw.ShardwiseError as error:
            outcome = str(error)
        opt.zero_grad()  # the fix the message names; the step then goes on
        with pm.no_sync():
            (pm(local[:2]) / 2).backward()
        (pm(local[2:]) / 2).backward()
        before = {k: v.clone() for k, v in pm.full_state_dict().items()}
        opt.step()
        outcomes[label] = (outcome, any(not v.equal(before[k]) for k, v in pm.full_state_dict().items()))
    return outcomes


def test_a_second_synchronized_backward_is_refused_where_gradients_live_apart():
    """Under ZeRO 1-3 and with bf16 parameters reduced in float32 the reduced gradients live in
    shards or float32 buckets, not .grad. A second synchronized backward without zero_grad
    kept only its own gradient (84% off the accumulated one at dp=2: the reduction overwrote the
    shard) where a DDP user accumulates; a user who cleared .grad by hand wants exactly that.
    Both look the same, so it is refused on every rank, naming the fix, and the fix works.
    (float32 without ZeRO accumulates in .grad, as DDP: test_dp_plain_backward_and_no_sync.)"""
    for rank, outcomes in enumerate(sw.testing.run_on_ranks(_second_synced_backward, 2)):
        for label, (outcome, stepped) in outcomes.items():
            assert "zero_grad" in outcome and "no_sync" in outcome, f"{label}, rank {rank}: {outcome}"
            assert stepped, f"{label}, rank {rank}: the step after zero_grad changed nothing"


def test_tied_weights_reduced_once():
    factory = functools.partial(make_gpt, 0)
    batches = gpt_batches(STEPS, batch=8)
    results = sw.testing.run_on_ranks(_train, 2, {}, factory, batches)
    _check_all_ranks(results, factory, batches)
    model = factory()
    unique_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    n_params = len(list(model.parameters()))
    side_bytes = 4 * (n_params + 1)  # unused-parameter mask + loss
    for _, extra in results:
        assert extra["reduced_bytes"]["all_reduce"] == STEPS * (unique_bytes + side_bytes)


class Gated(nn.Module):
    """`extra` is used only by flagged samples; `never` is never used."""

    def __init__(self):
        super().__init__()
        self.base = nn.Linear(8, 8)
        self.extra = nn.Linear(8, 8)
        self.never = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, batch):
        h = torch.tanh(self.base(batch["x"]))
        flag = batch["flag"]
        if bool(flag.any()):
            h = h.clone()
            h[flag] = h[flag] + self.extra(batch["x"][flag])
        return nn.functional.mse_loss(self.head(h).squeeze(-1), batch["y"])


def make_gated(seed: int = 0) -> Gated:
    torch.manual_seed(seed)
    return Gated()


def gated_batches(steps: int, batch: int):
    gen = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        flag = torch.zeros(batch, dtype=torch.bool)
        flag[: batch // 4] = True  # only the first replica of two ever sees flagged samples
        out.append({"x": torch.randn(batch, 8, generator=gen), "y": torch.randn(batch, generator=gen), "flag": flag})
    return out


def test_unused_parameters():
    batches = gated_batches(STEPS, batch=8)
    for mode in ("train_step", "backward"):
        results = sw.testing.run_on_ranks(_train, 2, {"bucket_mb": 0.0001}, make_gated, batches, mode)
        _check_all_ranks(results, make_gated, batches)
        for _, extra in results:
            assert extra["grad_none"] == ["never.bias", "never.weight"]


def _launch_timing():
    pm = sw.parallelize(make_gpt(0), sw.ParallelConfig(bucket_mb=0.02))
    seen = []
    # wpe's gradient is among the last backward produces; by then most buckets must be in flight
    pm.module.wpe.weight.register_post_accumulate_grad_hook(lambda p: seen.append(pm.gradients.stats.calls["all_reduce"]))
    pm.train_step(gpt_batches(1, 4)[0][:2])
    return seen[0], pm.gradients.stats.calls["all_reduce"], len(pm.gradients.buckets)


def test_buckets_launch_during_backward():
    launched_early, total, buckets = sw.testing.run_on_ranks(_launch_timing, 2)[0]
    assert buckets > 4 and total == buckets  # one collective per bucket, nothing else
    assert launched_early >= buckets - 2, (launched_early, buckets)


def _unequal(batches, sizes, fault=None):
    """Replicas given different numbers of samples (the last batch of an epoch)."""
    import faults

    if fault:
        faults.inject(fault, {})
    pm = sw.parallelize(make_gpt(0), sw.ParallelConfig(microbatches=2))
    opt = sw.build_optimizer(pm, torch.optim.SGD, **SGD)
    index, _ = sw.data_parallel_info(pm)
    start = sum(sizes[:index])
    run = Run([], [])
    for batch in batches:
        run.losses.append(float(pm.train_step(batch[start:start + sizes[index]])))
        if not run.grads:
            run.grads.append(pm.full_grad_dict())
        opt.step()
        opt.zero_grad()
    run.final = {k: v.clone() for k, v in pm.full_state_dict().items()}
    return run


@pytest.mark.parametrize("fault", [None, "replica-weight-ignored"])
def test_unequal_replica_batches_are_weighted_by_samples(fault):
    """Replicas of 4 and 2 samples: exactly one process on the 6 samples concatenated."""
    batches = gpt_batches(STEPS, 6)
    reference = reference_run(functools.partial(make_gpt, 0), batches)
    assert_meaningful(reference)
    results = sw.testing.run_on_ranks(_unequal, 2, batches, [4, 2], fault)
    if fault is None:
        for run in results:
            assert_parity(reference, run)
    else:  # the check this test relies on catches equal weighting
        with pytest.raises(AssertionError):
            assert_parity(reference, results[0])


def _agreements_per_step(layouts: list[tuple[int, int]]) -> list[list[int]]:
    return [_agreements(zero, check_every) for zero, check_every in layouts]


def _agreements(zero: int, check_every: int) -> list[int]:
    """Agreements (control all-gathers) each of four steps of train_step, clip_grad_norm and
    optimizer.step opened."""
    pm = sw.parallelize(make_gpt(0), sw.ParallelConfig(zero=zero, check_every=check_every))
    opt = sw.build_optimizer(pm, torch.optim.SGD, **SGD)
    counts = []
    for batch in gpt_batches(4, 4):
        before = pm.coordinator.seq
        pm.train_step(replica_slice(batch, dist.get_rank(), 2))
        opt.clip_grad_norm(1.0)
        opt.step()
        opt.zero_grad()
        counts.append(pm.coordinator.seq - before)
    return counts


def test_one_agreement_per_step():
    """An agreed train_step vouches for the clip_grad_norm and optimizer.step after it: they
    open none of their own (a rank that skips one is named by the waits, test_bad_inputs'
    "collective on rank 0 only"). With check_every=2 the unchecked steps open none at all."""
    cases = {(1, 1): [1, 1, 1, 1], (0, 1): [1, 1, 1, 1], (1, 2): [1, 0, 1, 0]}  # (zero, check_every): per step
    for got in sw.testing.run_on_ranks(_agreements_per_step, 2, list(cases)):
        assert dict(zip(cases, got)) == cases


def _refused_at_a_later_step(_):
    """Step 3's agreement runs during the forward (step.overlaps_forward): rank 1's batch is
    refused there; every rank must raise the same BatchError and train on afterwards."""
    pm = sw.parallelize(make_gpt(0), sw.ParallelConfig(microbatches=2))
    opt = sw.build_optimizer(pm, torch.optim.SGD, **SGD)
    index, count = sw.data_parallel_info(pm)
    batches = [replica_slice(b, index, count) for b in gpt_batches(5, 8)]
    seen, overlapped, during = [], [], []
    pm.module.register_forward_pre_hook(lambda m, args: during.append(pm.coordinator.deferred is not None))
    for i, batch in enumerate(batches):
        if i == 2 and dist.get_rank() == 1:
            batch = batch[:3]  # not divisible by microbatches=2: refused by this rank's batch checks only
        during.clear()
        try:
            seen.append(round(float(pm.train_step(batch)), 6))
            opt.step()
            opt.zero_grad()
        except sw.ShardwiseError as exc:
            seen.append(f"{type(exc).__name__}: {exc}")
        overlapped.append(all(during) if during else None)  # the agreement still running in every forward
    return seen, overlapped


def test_a_batch_refused_while_the_agreement_overlaps_the_forward():
    first, second = sw.testing.run_on_ranks(_refused_at_a_later_step, 2, None)
    assert first[1] == [False, True, True, True, True], first[1]  # the first step agrees before its forward
    assert second[1] == [False, True, None, True, True], second[1]  # rank 1 refused its batch: no forward
    assert isinstance(first[0][2], str) and first[0][2] == second[0][2], (first[0][2], second[0][2])
    assert "rank 1" in first[0][2]
    assert first[0][:2] + first[0][3:] == second[0][:2] + second[0][3:]  # the same mean loss on both ranks
    assert all(isinstance(v, float) for v in first[0][3:])  # training goes on
