"""Shared pieces of the parity tests: seeded models, single-process reference runs, diffs."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from shardwise.models import GPT, GPTConfig

TOL = 1e-5  # fp32 max abs parameter difference after several optimizer steps

# Adam divides each gradient element by its own running magnitude, so for elements whose
# gradient is tiny (saturated GELUs) float32 rounding differences between summation orders
# become steps of size ~lr. Measured on this GPT, 5 AdamW steps at lr=1e-2: torch DDP itself
# differs from one process by 2.7e-5 (2 ranks) and 3.3e-5 (4 ranks). At the usual lr=1e-3
# that floor is ~3e-6, so parity tests use LR and keep the 1e-5 bound.
LR = 1e-3


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


def reference_run(factory: Callable[[], nn.Module], batches, lr: float = LR, clip: float | None = None):
    """Train on one process with plain torch: losses, final state dict, grad norms."""
    model = factory()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, norms = [], []
    for batch in batches:
        loss = model(batch)
        loss.backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a.keys() ^ b.keys()))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def assert_parity(ref_losses, ref_state, losses, state, tol: float = TOL, loss_tol: float = 1e-6) -> float:
    """Losses equal (to float rounding) and parameters within `tol`; returns the max diff."""
    assert len(losses) == len(ref_losses)
    for step, (got, want) in enumerate(zip(losses, ref_losses)):
        assert abs(got - want) <= loss_tol * max(1.0, abs(want)), f"step {step}: loss {got} != {want}"
    diff = max_diff(ref_state, state)
    assert diff <= tol, f"max abs parameter difference {diff:.3g} > {tol}"
    return diff
