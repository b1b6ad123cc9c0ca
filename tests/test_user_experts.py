"""A user's own mixture of experts under expert parallelism: `sw.plan.register_experts` declares
an experts class shardwise would not recognize alone (its count under another name, a forward
taking an optional argument after the three tensors), and ep then splits it exactly as it
splits transformers' experts.

Parity bounds and the routing margin are tests/parity.py's and tests/test_expert.py's: the
router here is read the same way (weight [E, H], top_k, logits first), and its seed is chosen
so that every token of every step routes clear of rounding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from parity import Case, assert_parity, compare_cases, reference_run, train_parallel
from test_expert import moe_batches, routing_margin

ROUTER_SEED = 7  # routing margin 30x here


class UserTopKRouter(nn.Module):
    """Softmax top-k routing, weights renormalized over the chosen experts."""

    def __init__(self, hidden: int, experts: int, top_k: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, hidden))
        self.hidden_dim, self.top_k = hidden, top_k

    def forward(self, hidden: torch.Tensor):
        logits = hidden @ self.weight.T
        weights, index = logits.softmax(-1).topk(self.top_k, -1)
        return logits, weights / weights.sum(-1, keepdim=True), index


class LoopedExperts(nn.Module):
    """Experts as a user writes them: grouped weights, the count in `n_experts`, a loop over it."""

    def __init__(self, n_experts: int, hidden: int, inner: int):
        super().__init__()
        self.n_experts = n_experts
        self.w_in = nn.Parameter(torch.randn(n_experts, inner, hidden) / hidden ** 0.5)
        self.w_out = nn.Parameter(torch.randn(n_experts, hidden, inner) / inner ** 0.5)

    def forward(self, hidden, top_k_index, top_k_weights, scale: float = 1.0):
        out = torch.zeros_like(hidden)
        for e in range(self.n_experts):
            token, slot = torch.where(top_k_index == e)
            y = F.gelu(hidden[token] @ self.w_in[e].T) @ self.w_out[e].T
            out = out.index_add(0, token, y * top_k_weights[token, slot, None] * scale)
        return out


@sw.plan.register_experts(num_experts="n_experts")
class RegisteredExperts(LoopedExperts):
    pass


class SharedBiasExperts(LoopedExperts):
    """Registered, but with a parameter every expert shares: refused."""

    def __init__(self, *args):
        super().__init__(*args)
        self.bias = nn.Parameter(torch.zeros(self.w_out.shape[1]))


sw.plan.register_experts(SharedBiasExperts, num_experts="n_experts")


class UserMoE(nn.Module):
    def __init__(self, experts_class: type, hidden: int = 32, experts: int = 4):
        super().__init__()
        self.gate = UserTopKRouter(hidden, experts, top_k=2)
        self.experts = experts_class(experts, hidden, 2 * hidden)

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        _, weights, index = self.gate(flat)
        return x + self.experts(flat, index, weights).reshape(x.shape)


class UserModel(nn.Module):
    """Embedding, two mixture-of-experts blocks with norms, a head; next-token loss."""

    def __init__(self, experts_class: type = RegisteredExperts):
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(32), UserMoE(experts_class)) for _ in range(2))
        self.head = nn.Linear(32, 64)

    def forward(self, batch):
        x = self.embed(batch["input_ids"])
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)[:, :-1]
        return F.cross_entropy(logits.reshape(-1, 64), batch["labels"][:, 1:].reshape(-1))


def user_model(experts_class: type = RegisteredExperts, router_seed: int = ROUTER_SEED) -> UserModel:
    torch.manual_seed(0)
    model = UserModel(experts_class)
    generator = torch.Generator().manual_seed(router_seed)
    with torch.no_grad():
        for block in model.blocks:
            block[1].gate.weight.copy_(torch.randn(block[1].gate.weight.shape, generator=generator))
    return model


def test_user_model_routes_clear_of_rounding():
    assert routing_margin(user_model, moe_batches()) > 1.0


def test_registered_experts_split_exactly():
    """ep2, and ep2 with ZeRO-3 and AdamW, equal one process; the expert weights are sharded
    (each rank holds half of every grouped tensor)."""
    compare_cases(2, [Case("user experts ep2", {"ep": 2}, user_model, moe_batches()),
                      Case("user experts ep2 zero3", {"ep": 2, "zero": 3}, user_model, moe_batches(),
                           optimizer="adamw")])
    held = sw.testing.run_on_ranks(_expert_shapes, 2)
    assert held == [{"w_in": (2, 64, 32), "w_out": (2, 32, 64)}] * 2


def _expert_shapes():
    pm = sw.parallelize(user_model(), sw.ParallelConfig(ep=2))
    experts = pm.module.blocks[0][1].experts
    return {name: tuple(p.to_local().shape) for name, p in experts.named_parameters()}


def _faulty(fault: str):
    return train_parallel({"ep": 2}, user_model, moe_batches(), fault=fault)


def test_registered_experts_fail_under_fault():
    """The parity above is not vacuous: tokens dropped at a capacity of 1 fail it."""
    reference = reference_run(user_model, moe_batches())
    run = sw.testing.run_on_ranks(_faulty, 2, "expert-tokens-dropped")[0]
    with pytest.raises(AssertionError):
        assert_parity(reference, run)


def _refusal(experts_class: type):
    try:
        sw.parallelize(user_model(experts_class), sw.ParallelConfig(ep=2))
    except sw.ConfigError as exc:
        return str(exc)
    return None


def test_unregistered_or_malformed_experts_are_refused():
    """Without registration the looped experts are not found (ep has nothing to split, and the
    message points at register_experts); registered with a parameter every expert shares, the
    same ConfigError on every rank; a class whose forward cannot take the three tensors, or an
    attribute name that is not one, is refused as it is registered."""
    unregistered, shared = (sw.testing.run_on_ranks(_refusal, 2, cls) for cls in (LoopedExperts, SharedBiasExperts))
    assert unregistered[0] == unregistered[1] and "sw.plan.register_experts" in unregistered[0]
    assert shared[0] == shared[1] and "parameters ['bias']" in shared[0] and "n_experts=4" in shared[0]

    class TwoArguments(nn.Module):
        def forward(self, hidden, routing):
            return hidden

    with pytest.raises(sw.PlanError, match="cannot be called as forward"):
        sw.plan.register_experts(TwoArguments)
    with pytest.raises(sw.PlanError, match="name the attribute"):
        sw.plan.register_experts(LoopedExperts, num_experts="n experts")
    with pytest.raises(sw.PlanError, match="not an nn.Module class"):
        sw.plan.register_experts(object)
