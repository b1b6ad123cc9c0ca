"""Dynamic loss scaling (sw.LossScaler) against torch.amp.GradScaler on one process.

A small MLP trains 5 SGD steps at dp=2 under ZeRO 0-3 with LossScaler(growth_interval=2),
and on one process with torch.amp.GradScaler(init_scale=2**16, growth_interval=2). At step 2 one
parameter's gradient is 1e34: finite, but times the scale it overflows float32, in that
parameter alone (under ZeRO in one rank's shard alone), so both must skip that step and
halve the scale; the scale grows after two clean steps. The
scale sequence must be equal, the losses and parameters within tests/parity.py's bounds
(the scale is a power of two, so scaled and unscaled gradients differ by no rounding; the
skipped step enters the bound with zero gradient). Under float16 compute, a loss whose
gradients underflow float16 leaves the first layer unchanged without a scaler and moves it
with the default one (its first step skipped: 2^16 does not fit float16).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardwise as sw
from parity import SGD, Run, assert_parity, full_grads, gpt_batches, make_gpt, reference_run, replica_slice
from shardwise.batch import split_batch

STEPS = 5
OVERFLOW_STEP = 2


class MLP(nn.Module):
    def __init__(self, loss_factor: float = 1.0):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        self.gate = nn.Parameter(torch.zeros(1))  # its gradient is batch["big"]'s mean: one shard's overflow
        self.loss_factor = loss_factor

    def forward(self, batch):
        loss = (self.net(batch["x"]) - batch["y"]).pow(2).mean() + self.gate[0] * batch["big"].mean()
        return loss * self.loss_factor


def batches() -> list[dict]:
    gen = torch.Generator().manual_seed(2)
    out = [{"x": torch.randn(8, 8, generator=gen), "y": torch.randn(8, 4, generator=gen), "big": torch.zeros(8)}
           for _ in range(STEPS)]
    out[OVERFLOW_STEP]["big"][:] = 1e34
    return out


def reference() -> tuple[Run, list[float]]:
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), **SGD)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=2)
    run = Run([], [], initial={k: v.detach().clone() for k, v in model.state_dict().items()})
    run.parameter_of = {n: n for n, _ in model.named_parameters()}
    scales = []
    for batch in batches():
        loss = model(batch)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        grads = full_grads(model)
        finite = all(torch.isfinite(g).all() for g in grads.values())
        run.grads.append(grads if finite else {k: torch.zeros_like(g) for k, g in grads.items()})
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        run.losses.append(float(loss.detach()))
        scales.append(scaler.get_scale())
    run.final = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return run, scales


def _train(zero: int) -> tuple[Run, list[float]]:
    pm = sw.parallelize(MLP(), sw.ParallelConfig(zero=zero))
    scaler = sw.LossScaler(growth_interval=2)
    opt = sw.build_optimizer(pm, torch.optim.SGD, loss_scaler=scaler, **SGD)
    index, count = sw.data_parallel_info(pm)
    run, scales = Run([], []), []
    for batch in batches():
        scale = scaler.scale
        run.losses.append(float(pm.train_step(replica_slice(batch, index, count))))
        if not run.grads:
            run.grads.append({k: v / scale for k, v in pm.full_grad_dict().items()})  # exact: a power of two
        opt.step()
        opt.zero_grad()
        scales.append(scaler.scale)
    run.final = {k: v.detach().clone() for k, v in pm.full_state_dict().items()}
    return run, scales


def _torch_grad_scaler(config: dict, model=MLP, plan=None, loss_scaler=None) -> tuple[Run, list[float]] | str:
    """torch.amp.GradScaler driving sw.build_optimizer's optimizer by hand, as single-device AMP
    code does (a plain forward and backward); the replicas' mean loss. Or the refusal."""
    pm = sw.parallelize(model(), sw.ParallelConfig(**config), plan=plan)
    opt = sw.build_optimizer(pm, torch.optim.SGD, loss_scaler=loss_scaler, **SGD)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=2)
    index, count = sw.data_parallel_info(pm)
    run, scales = Run([], []), []
    for batch in batches() if model is MLP else gpt_batches(2, 4):
        loss = pm(replica_slice(batch, index, count))
        scaler.scale(loss).backward()
        if not run.grads:
            run.grads.append({k: v / scaler.get_scale() for k, v in pm.full_grad_dict().items()})
        try:
            scaler.step(opt)
        except sw.ConfigError as exc:
            return str(exc)
        scaler.update()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        run.losses.append(float(mean) / dist.get_world_size())
        scales.append(scaler.get_scale())
    run.final = {k: v.detach().clone() for k, v in pm.full_state_dict().items()}
    return run, scales


def _every_zero():
    return [_train(zero) for zero in (0, 1, 2, 3)], {
        "dp": _torch_grad_scaler({}),
        "zero1": _torch_grad_scaler({"zero": 1}),
        "bfloat16": _torch_grad_scaler({"param_dtype": torch.bfloat16}),
        "tp": _torch_grad_scaler({"tp": 2}, functools.partial(make_gpt, 0), plan="gpt"),
        "with its own scaler": _torch_grad_scaler({}, loss_scaler=sw.LossScaler())}


def test_loss_scaler_matches_torch_grad_scaler_at_every_zero_stage():
    """sw.LossScaler at every ZeRO stage, and torch's GradScaler used by hand on our optimizer:
    where the optimizer's tensors are the parameters with the same reduced `.grad` on every rank
    (float32, zero=0, dp=2) it steps and skips as on one process; elsewhere (ZeRO's shards,
    float32 masters, tp's DTensors, a scaler of our own already attached) it is refused, where
    it used to fail deep inside GradScaler (an AssertionError, a DTensor error)."""
    want, want_scales = reference()
    assert want_scales == [2.0 ** 16, 2.0 ** 17, 2.0 ** 16, 2.0 ** 16, 2.0 ** 17], want_scales
    for runs, by_hand in sw.testing.run_on_ranks(_every_zero, 2):
        for zero, (got, scales) in enumerate(runs):
            assert scales == want_scales, (zero, scales)
            assert_parity(want, got)
        got, scales = by_hand["dp"]
        assert scales == want_scales, scales
        assert_parity(want, got)
        for name, phrase in (("zero1", "this rank's shards of the parameters (zero=1)"),
                             ("bfloat16", "float32 master copies"), ("tp", "DTensors"),
                             ("with its own scaler", "its own sw.LossScaler")):
            assert isinstance(by_hand[name], str) and "torch.amp.GradScaler steps this SGD, but" in by_hand[name] \
                and phrase in by_hand[name], (name, by_hand[name])


FP16_TOLERANCE = 0.05  # float16 unit roundoff 2^-11; λ·sqrt(D·n)·u with λ=10, D=4 reductions of n≤16: 0.04


def _autocast_reference() -> tuple[list[float], list[float], list[bool]]:
    """One process under float16 autocast with torch's GradScaler: losses, scales, skips."""
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), **SGD)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 15, growth_interval=2)
    losses, scales, skipped = [], [], []
    for batch in batches():
        before = [p.detach().clone() for p in model.parameters()]
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(batch)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        scales.append(scaler.get_scale())
        skipped.append(all(torch.equal(a, b) for a, b in zip(before, model.parameters())))
    return losses, scales, skipped


def _fp16_run(zero: int, root: str | None = None) -> tuple[list[float], list[float], list[bool]]:
    pm = sw.parallelize(MLP(), sw.ParallelConfig(param_dtype=torch.float16, zero=zero))
    opt = sw.build_optimizer(pm, torch.optim.SGD, loss_scaler=sw.LossScaler(2.0 ** 15, growth_interval=2), **SGD)
    index, count = sw.data_parallel_info(pm)
    losses, scales, skipped = [], [], []
    for batch in batches():
        before = pm.full_state_dict()
        losses.append(float(pm.train_step(replica_slice(batch, index, count))))
        opt.step()
        opt.zero_grad()
        scales.append(opt.loss_scaler.scale)
        after = pm.full_state_dict()
        skipped.append(all(torch.equal(v, after[k]) for k, v in before.items()))
    if root is not None:  # the scale and its growth count travel with checkpoints
        sw.save_checkpoint(root, pm, opt)
        fresh = sw.build_optimizer(sw.parallelize(MLP(), sw.ParallelConfig(param_dtype=torch.float16, zero=zero)),
                                   torch.optim.SGD, loss_scaler=sw.LossScaler(init_scale=4.0), **SGD)
        sw.load_checkpoint(root, fresh._pmodel, fresh)
        assert fresh.loss_scaler.state_dict() == opt.loss_scaler.state_dict(), fresh.loss_scaler
    return losses, scales, skipped


def _fp16_zero_stages(root: str):
    return [_fp16_run(zero, root if zero == 2 else None) for zero in (0, 1, 2, 3)]  # ZeRO-1-3: float32 masters


def test_float16_training_skips_and_scales_as_autocast_with_grad_scaler(tmp_path):
    """float16 compute (float32 masters) against one process under float16 autocast with
    torch's GradScaler from 2^15: the same scale after every step and the same skipped step
    (step 2, whose gradient overflows; its float16 loss is not finite here, so it is not
    compared), the other losses within float16 rounding (FP16_TOLERANCE, derived above)."""
    want_losses, want_scales, want_skipped = _autocast_reference()
    assert want_skipped == [i == OVERFLOW_STEP for i in range(STEPS)], want_skipped
    for runs in sw.testing.run_on_ranks(_fp16_zero_stages, 2, str(tmp_path / "ckpt")):
        for losses, scales, skipped in runs:
            assert scales == want_scales and skipped == want_skipped, (scales, skipped)
            for step, (got, want) in enumerate(zip(losses, want_losses)):
                if step != OVERFLOW_STEP:
                    assert abs(got - want) <= FP16_TOLERANCE * abs(want), (step, got, want)


def _fp16_first_layer(scaled: bool) -> bool:
    pm = sw.parallelize(MLP(loss_factor=1e-8), sw.ParallelConfig(param_dtype=torch.float16))
    kwargs = {} if scaled else {"loss_scaler": None}
    opt = sw.build_optimizer(pm, torch.optim.SGD, lr=1e3, **kwargs)
    assert (opt.loss_scaler is not None) == scaled
    before = pm.full_state_dict()["net.0.weight"].clone()
    index, count = sw.data_parallel_info(pm)
    for batch in batches()[:2]:  # a float16 loss: the scale must fit float16, so 2^16 is skipped once
        pm.train_step(replica_slice(batch, index, count))
        opt.step()
        opt.zero_grad()
    return not torch.equal(pm.full_state_dict()["net.0.weight"], before)


def _fp16_both():
    return _fp16_first_layer(True), _fp16_first_layer(False)


def test_float16_gets_a_loss_scaler_by_default():
    for moved_scaled, moved_unscaled in sw.testing.run_on_ranks(_fp16_both, 2):
        assert moved_scaled and not moved_unscaled


def test_loss_scaler_rejects_bad_settings():
    with pytest.raises(sw.ConfigError):
        sw.LossScaler(backoff_factor=1.5)
    with pytest.raises(sw.ConfigError):
        sw.LossScaler(growth_interval=0)
    if dist.is_initialized():
        dist.destroy_process_group()


def _pipelined(reduce: str) -> tuple[Run, list[float]]:
    batches = gpt_batches(4, 8)
    pm = sw.parallelize(make_gpt(0, n_layer=4), sw.ParallelConfig(pp=2, microbatches=2), sample=batches[0])
    opt = sw.build_optimizer(pm, torch.optim.SGD, loss_scaler=sw.LossScaler(growth_interval=2), **SGD)
    run, scales = Run([], []), []
    for batch in batches:
        scale = opt.loss_scaler.scale
        run.losses.append(float(pm.train_step(batch, reduce=reduce)))
        if not run.grads:
            run.grads.append({k: v / scale for k, v in pm.full_grad_dict().items()})
        opt.step()
        opt.zero_grad()
        scales.append(opt.loss_scaler.scale)
    run.final = {k: v.detach().clone() for k, v in pm.full_state_dict().items()}
    return run, scales


def _both_reductions():
    return {reduce: _pipelined(reduce) for reduce in ("mean", "sum")}


def test_loss_scaler_and_summed_microbatches_under_a_pipeline():
    """pp=2, 2 microbatches: the scaled loss enters the schedule's backward and is unscaled
    before the step (nothing overflows here: the scale grows every 2 steps); reduce="sum"
    sums the two microbatches' losses and gradients. Against one process (parity bounds)."""
    batches = gpt_batches(4, 8)
    want = {"mean": reference_run(functools.partial(make_gpt, 0, n_layer=4), batches, microbatches=2),
            "sum": reference_run(functools.partial(make_gpt, 0, n_layer=4), batches,
                                 loss=lambda model, batch: sum(model(part) for part in split_batch(batch, 2)))}
    for result in sw.testing.run_on_ranks(_both_reductions, 2):
        for reduce, (got, scales) in result.items():
            assert scales == [2.0 ** 16, 2.0 ** 17, 2.0 ** 17, 2.0 ** 18], scales
            assert_parity(want[reduce], got)
