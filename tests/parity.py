"""Shared pieces of the parity tests: seeded models, the parallel and single-process runs, diffs.

Every parity check compares, against plain torch on one process:
- the first step's gradients, gathered whole (GRAD_TOL): this catches a wrong or mis-scaled
  reduction that AdamW, being invariant to gradient scale, would hide;
- the loss of every step, and every parameter after several AdamW steps (TOL = 1e-5).

Why LR = 1e-4: Adam divides each gradient element by its running magnitude, so elements
whose true gradient is ~0 (saturated GELUs) turn float32 rounding differences between
summation orders into steps of size ~lr. Measured on the reference GPT after 5 AdamW steps at
lr=1e-3: torch DDP vs one process 2.7e-6 (3.3e-5 at lr=1e-2); torch's own tensor parallel
(column/row pairs) 1.6e-6, identical to shardwise with the same plan; the zoo "gpt" plan's
vocab-parallel softmax, summed per shard, 1.7e-5. At lr=1e-4 that floor is ~2e-6.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

import shardwise as sw
from shardwise.models import GPT, GPTConfig

TOL = 1e-5  # fp32 max abs parameter difference after several optimizer steps
GRAD_TOL = 1e-6  # fp32 max abs difference of the first step's gradients
LR = 1e-4


def make_gpt(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**overrides))


def gpt_batches(steps: int, batch: int, seq: int = 16, vocab: int = 64, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq + 1), generator=gen) for _ in range(steps)]


def replica_slice(batch, index: int, count: int):
    """Replica `index`'s share of a global batch (tensor or dict of tensors)."""
    if isinstance(batch, dict):
        return {k: replica_slice(v, index, count) for k, v in batch.items()}
    per = batch.shape[0] // count
    return batch[index * per:(index + 1) * per]


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def full_grads(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, gathered whole (collective when sharded)."""
    return {n: _full(p.grad) for n, p in module.named_parameters() if p.grad is not None}


def train_parallel(config: dict, factory: Callable[[], nn.Module], batches, plan=None, deferred: bool = False,
                   clip: float | None = None):
    """Run on each rank: parallelize, train with train_step; losses, full state, first grads, norms."""
    import torch.distributed as dist

    model = sw.deferred_init(factory) if deferred else factory()
    replicas = dist.get_world_size() // (config.get("tp", 1) * config.get("pp", 1))
    pm = sw.parallelize(model, sw.ParallelConfig(**config), plan=plan, sample=replica_slice(batches[0], 0, replicas))
    opt = sw.build_optimizer(pm, torch.optim.AdamW, lr=LR)
    index, count = sw.data_parallel_info(pm)
    losses, grads, norms = [], None, []
    for batch in batches:
        losses.append(float(pm.train_step(replica_slice(batch, index, count))))
        grads = grads or {k: v.clone() for k, v in pm.full_grad_dict().items()}
        if clip is not None:
            norms.append(float(opt.clip_grad_norm(clip)))
        opt.step()
        opt.zero_grad()
    state = {k: _full(v) for k, v in pm.full_state_dict().items()}
    return losses, state, grads, norms


def reference_run(factory: Callable[[], nn.Module], batches, lr: float = LR, clip: float | None = None):
    """Train on one process with plain torch: losses, final state dict, first grads, grad norms."""
    model = factory()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, norms, grads = [], [], None
    for batch in batches:
        loss = model(batch)
        loss = loss.loss if hasattr(loss, "loss") else loss
        loss.backward()
        grads = grads or full_grads(model)
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, grads, norms


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a.keys() ^ b.keys()))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def assert_parity(reference, result, tol: float = TOL, loss_tol: float = 1e-6) -> float:
    """Same first gradients, losses (to float rounding) and final parameters; returns the max param diff."""
    ref_losses, ref_state, ref_grads = reference[:3]
    losses, state, grads = result[:3]
    assert len(losses) == len(ref_losses)
    for step, (got, want) in enumerate(zip(losses, ref_losses)):
        assert abs(got - want) <= loss_tol * max(1.0, abs(want)), f"step {step}: loss {got} != {want}"
    grad_diff = max_diff(ref_grads, grads)
    assert grad_diff <= GRAD_TOL, f"first-step gradients differ by {grad_diff:.3g} > {GRAD_TOL}"
    diff = max_diff(ref_state, state)
    assert diff <= tol, f"max abs parameter difference {diff:.3g} > {tol}"
    return diff


def run_and_compare(world: int, config: dict, factory, batches, plan=None, deferred: bool = False,
                    clip: float | None = None) -> float:
    reference = reference_run(factory, batches, clip=clip)
    results = sw.testing.run_on_ranks(train_parallel, world, config, factory, batches, plan, deferred, clip)
    for result in results:
        for got, want in zip(result[3], reference[3]):  # clip_grad_norm: the global norm, as on one process
            assert abs(got - want) <= 1e-5 * max(1.0, want), f"grad norm {got} != {want}"
    return max(assert_parity(reference, r) for r in results)
