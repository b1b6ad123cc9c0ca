"""ZeRO stages 1-3, the distributed optimizer and mixed precision."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from parity import LR, full_grads, gpt_batches, make_gpt, replica_slice, run_and_compare

STEPS = 5
gpt = functools.partial(make_gpt, 0, n_layer=4)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_parity_dp4(zero):
    run_and_compare(4, {"zero": zero}, gpt, gpt_batches(STEPS, 8), clip=0.5)


@pytest.mark.parametrize("zero, sequence_parallel", [(1, False), (2, True), (3, False)])
def test_zero_with_tensor_parallel(zero, sequence_parallel):
    config = {"zero": zero, "tp": 2, "sequence_parallel": sequence_parallel}
    run_and_compare(4, config, gpt, gpt_batches(STEPS, 8), plan="gpt", clip=0.5)


@pytest.mark.parametrize("zero", [1, 3])
def test_zero_with_pipeline(zero):
    run_and_compare(4, {"zero": zero, "pp": 2, "microbatches": 2}, gpt, gpt_batches(STEPS, 8), clip=0.5)


# -- memory: the ZeRO paper's formulas --------------------------------------------------
def _memory(zero: int):
    model = make_gpt(0, n_layer=4, d_model=128)
    pm = sw.parallelize(model, sw.ParallelConfig(zero=zero))
    opt = sw.build_optimizer(pm, torch.optim.AdamW, lr=LR)
    index, count = sw.data_parallel_info(pm)
    pm.train_step(replica_slice(gpt_batches(1, 8)[0], index, count))
    opt.step()
    padding = sum((b.padded - sum(b.sizes) + b.tail_size) * 4 for b in pm.gradients.buckets)
    return pm.memory(), sum(p.numel() for p in pm.module.parameters()), padding, pm.summary()


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_per_rank_bytes_follow_the_zero_formulas(zero):
    n = 4
    for memory, psi, padding, summary in sw.testing.run_on_ranks(_memory, n, zero):
        expected = {  # Adam, fp32: parameters, gradients, optimizer state (exp_avg + exp_avg_sq)
            0: (4 * psi, 4 * psi, 8 * psi),
            1: (4 * psi, 4 * psi, 8 * psi / n),
            2: (4 * psi, 4 * psi / n, 8 * psi / n),
            3: (4 * psi / n, 4 * psi / n, 8 * psi / n),
        }[zero]
        for (name, got), want in zip(memory.items(), expected):
            assert abs(got - want) <= 0.05 * want + padding, (zero, name, got, want, padding)
        assert "memory" in summary and "parameters" in summary


# -- mixed precision ----------------------------------------------------------------------
def bf16_reference(batches):
    """One process, the same recipe: bf16 parameters and compute, float32 master weights."""
    model = make_gpt(0)
    masters = [p.detach().clone() for p in model.parameters()]
    model.to(torch.bfloat16)
    opt = torch.optim.AdamW(masters, lr=LR)
    losses, grads = [], None
    for batch in batches:
        loss = model(batch)
        loss.backward()
        grads = grads or {k: g.float() for k, g in full_grads(model).items()}
        for master, param in zip(masters, model.parameters()):
            master.grad = param.grad.float()
        opt.step()
        model.zero_grad()
        with torch.no_grad():
            for master, param in zip(masters, model.parameters()):
                param.copy_(master)
        losses.append(float(loss.detach()))
    return losses, {k: v.float() for k, v in model.state_dict().items()}, grads


def _bf16_run(config: dict, batches):
    pm = sw.parallelize(make_gpt(0), sw.ParallelConfig(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, **config),
                        plan="gpt" if config.get("tp", 1) > 1 else None)
    opt = sw.build_optimizer(pm, torch.optim.AdamW, lr=LR)
    index, count = sw.data_parallel_info(pm)
    losses, grads = [], None
    for batch in batches:
        losses.append(float(pm.train_step(replica_slice(batch, index, count))))
        grads = grads or {k: v.float() for k, v in pm.full_grad_dict().items()}
        opt.step()
        opt.zero_grad()
    dtypes = {str(p.dtype) for p in pm.module.parameters()}
    return losses, {k: v.float() for k, v in pm.full_state_dict().items()}, grads, dtypes


@pytest.mark.parametrize("world, config", [(1, {}), (2, {}), (4, {"zero": 3}), (4, {"tp": 2, "zero": 2})])
def test_bf16_tracks_one_process_bf16(world, config):
    """Tolerances, from bf16's 8-bit mantissa (relative step 2^-8):
    - loss: the loss is itself a bf16 number (one ulp at 4.17 is 2^-6 = 0.016), and the
      parallel loss is the mean of per-replica bf16 losses: within 3 ulps of |loss|;
    - parameters: AdamW moves an element at most ~lr a step, so rounding that flips a step's
      direction costs at most 2*lr per step, plus one bf16 ulp when cast: 2*steps*lr + |w|/2^7.
    (Gradients are not compared with one process here: its tied-embedding gradient sums the
    whole batch in bf16 and is itself off by ~60% of the largest gradient; what shardwise
    computes is pinned by test_bf16_gradients_are_the_float32_mean_of_replica_gradients.)
    One process with the same config must match exactly."""
    batches = gpt_batches(STEPS, 8)
    ref_losses, ref_state, ref_grads = bf16_reference(batches)
    for losses, state, grads, dtypes in sw.testing.run_on_ranks(_bf16_run, world, config, batches):
        assert dtypes == {"torch.bfloat16"}
        if world == 1:
            assert losses == ref_losses and all(torch.equal(state[k], ref_state[k]) for k in state)
            continue
        for got, want in zip(losses, ref_losses):
            assert abs(got - want) <= 3 * abs(want) * 2 ** -8, (losses, ref_losses)
        for name, want in ref_state.items():
            bound = 2 * STEPS * LR + want.abs() * 2 ** -7
            assert ((state[name] - want).abs() <= bound).all(), name


def _bf16_grads(batch):
    pm = sw.parallelize(make_gpt(0), sw.ParallelConfig(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    index, count = sw.data_parallel_info(pm)
    pm.train_step(replica_slice(batch, index, count))
    return {k: v.clone() for k, v in pm.full_grad_dict().items()}


def test_bf16_gradients_are_the_float32_mean_of_replica_gradients():
    """Each replica's bf16 gradient, accumulated and averaged in float32 (reduce_dtype)."""
    batch = gpt_batches(1, 8)[0]
    replicas = []
    for index in range(2):
        model = make_gpt(0).to(torch.bfloat16)
        model(replica_slice(batch, index, 2)).backward()
        replicas.append({k: g.float() for k, g in full_grads(model).items()})
    want = {k: (replicas[0][k] + replicas[1][k]) / 2 for k in replicas[0]}
    for grads in sw.testing.run_on_ranks(_bf16_grads, 2, batch):
        assert grads.keys() == want.keys()
        for name in want:  # bf16 forward/backward of the same data: equal up to bf16 rounding of a sum
            assert (grads[name] - want[name]).abs().max() <= 1e-4, name


# -- the distributed optimizer ------------------------------------------------------------
def _optimizer_api(batches, groups: bool):
    pm = sw.parallelize(make_gpt(0), sw.ParallelConfig(zero=2))
    kwargs = {}
    if groups:  # no weight decay for biases and norms, as users commonly do
        decay = [p for n, p in pm.module.named_parameters() if n.endswith("weight") and "ln" not in n]
        rest = [p for n, p in pm.module.named_parameters() if not (n.endswith("weight") and "ln" not in n)]
        kwargs["params"] = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    opt = sw.build_optimizer(pm, torch.optim.AdamW, lr=LR, **kwargs)
    # scaled down before the reduction, back up after: nothing changes
    opt.register_reduce_hook(pre=lambda g: g.div_(8), post=lambda g: g.mul_(8))
    index, count = sw.data_parallel_info(pm)
    for batch in batches:
        pm.train_step(replica_slice(batch, index, count))
        opt.scale_grads(3.0)  # the reference scales its gradients the same way
        opt.step()
        opt.zero_grad()
    shard_state = sum(t.numel() for s in opt.state.values() for t in s.values() if t.dim() > 0)
    saved = opt.state_dict()
    fresh = sw.build_optimizer(pm, torch.optim.AdamW, lr=LR, **kwargs)
    fresh.load_state_dict(saved)
    same = all(torch.equal(a, b) for s, t in zip(opt.state.values(), fresh.state.values())
               for a, b in zip(s.values(), t.values()))
    total = sum(p.numel() for p in pm.module.parameters())
    return ({k: v.clone() for k, v in pm.full_state_dict().items()}, shard_state, total, same,
            isinstance(opt, torch.optim.AdamW), [g["weight_decay"] for g in opt.param_groups])


def _reference_with_groups(batches):
    model = make_gpt(0)
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and "ln" not in n]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and "ln" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=LR)
    for batch in batches:
        model(batch).backward()
        for param in model.parameters():
            param.grad.mul_(3.0)
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def test_optimizer_shards_its_state_and_keeps_the_torch_api():
    batches = gpt_batches(3, 8)
    want = _reference_with_groups(batches)
    for state, shard_state, total, same, is_adamw, decays in sw.testing.run_on_ranks(_optimizer_api, 4, batches, True):
        assert max(float((state[k] - want[k]).abs().max()) for k in want) <= 1e-5
        assert 2 * total / 4 <= shard_state <= 2 * total / 4 + 2 * 8  # exp_avg + exp_avg_sq of a quarter (+ padding)
        assert same and is_adamw and decays == [0.1, 0.0]


def test_zero_with_one_replica_runs_as_zero_0():
    with pytest.warns(UserWarning, match="zero=2 with one data-parallel replica has nothing to shard; running as zero=0"):
        pm = sw.parallelize(make_gpt(0), sw.ParallelConfig(zero=2))
    assert pm.config.zero == 0


def _optimizer_from_original(_):
    model = make_gpt(0)
    original = list(model.parameters())
    pm = sw.parallelize(model, sw.ParallelConfig(tp=2, zero=1), plan="gpt")
    try:
        sw.build_optimizer(pm, torch.optim.AdamW, params=original, lr=LR)
    except sw.ShardwiseError as exc:
        return str(exc)
    return "no error"


def test_optimizer_from_the_unwrapped_module_is_refused():
    with pytest.raises(sw.ShardwiseError, match="build_optimizer needs the ParallelModule"):
        sw.build_optimizer(make_gpt(0), torch.optim.AdamW, lr=LR)
    for message in sw.testing.run_on_ranks(_optimizer_from_original, 4, None):
        assert "is not a parameter of the ParallelModule" in message
