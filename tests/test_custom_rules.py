"""sw.plan.register_rule: tensor parallelism for a module class shardwise has no rule for.

`FusedQKVAttention` keeps q, k and v in one (3d, d) weight and runs causal attention. Its
rule (the README's example) shards the weight as StridedShard(0, 3), so each tp rank holds
the q, k and v rows of its own heads, computes attention for those heads on a replicated
input, and leaves its output sharded on the features, which a row-parallel out-projection
sums. At tp=2 (and tp2 x dp2) training equals one process (tests/parity.py's bounds). The
same module without the rule is refused; a rule that refuses a layout says so; two
placements per parameter (2D tensor parallelism) are refused: there is one tp mesh dim.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Partial, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import shardwise as sw
from parity import Case, compare_cases, corpus_batches, gpt_batches, make_gpt

VOCAB, WIDTH, HEADS, SEQ = 64, 16, 4, 8


class FusedQKVAttention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.qkv = nn.Parameter(torch.randn(3 * width, width) / width ** 0.5)
        self.qkv_bias = nn.Parameter(torch.zeros(3 * width))
        self.head_dim = width // heads

    def forward(self, x):
        return attend(F.linear(x, self.qkv, self.qkv_bias), self.head_dim)


class Unruled(FusedQKVAttention):  # a subclass: rules are per class, so it has none
    pass


def attend(qkv: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Causal attention over the heads whose q | k | v columns `qkv` holds."""
    q, k, v = qkv.chunk(3, dim=-1)
    b, t, width = q.shape
    split = [z.view(b, t, width // head_dim, head_dim).transpose(1, 2) for z in (q, k, v)]
    return F.scaled_dot_product_attention(*split, is_causal=True).transpose(1, 2).reshape(b, t, width)


@sw.plan.register_rule(FusedQKVAttention)
def fused_qkv_rule(path, module, placements):
    if placements.get("qkv") != _StridedShard(0, split_factor=3):
        raise sw.PlanError(f"{path}.qkv: shard it StridedShard(0, 3) (each rank the q, k, v rows of its heads)")
    placements["qkv_bias"] = _StridedShard(0, split_factor=3)

    def forward(module, x, *, tp):
        qkv = F.linear(tp.replicated_input(x), tp.local(module.qkv), tp.local(module.qkv_bias))
        return tp.output(attend(qkv, module.head_dim), Shard(-1))  # this rank's heads' features

    return forward


class TinyAttentionLM(nn.Module):
    def __init__(self, attention=FusedQKVAttention):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.attn = attention(WIDTH, HEADS)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids):
        x = self.emb(ids[:, :-1])
        x = x + self.proj(self.attn(x))
        return F.cross_entropy(self.head(x).flatten(0, 1), ids[:, 1:].flatten())


PLAN = {"params": {"attn.qkv": ["StridedShard(0, 3)"], "proj.weight": ["Shard(1)"]}}


def batches(steps: int = 5) -> list[torch.Tensor]:
    return corpus_batches(steps, 8, seq=SEQ)  # text: the loss falls as the model learns


def test_registered_rule_for_fused_qkv_matches_one_process():
    compare_cases(4, [Case("tp2 dp2 fused qkv", {"tp": 2}, TinyAttentionLM, batches(), plan=PLAN),
                      Case("tp4 fused qkv", {"tp": 4}, TinyAttentionLM, batches(), plan=PLAN)])


def _refusals():
    found = {}
    for name, model, plan in (
            ("no rule", TinyAttentionLM(Unruled), PLAN),
            ("rule refuses", TinyAttentionLM(), {"params": {"attn.qkv": ["Shard(0)"], "proj.weight": ["Shard(1)"]}}),
            ("2D", TinyAttentionLM(), {"params": {"attn.qkv": ["StridedShard(0, 3)", "Shard(1)"]}})):
        try:
            sw.parallelize(model, sw.ParallelConfig(tp=2), plan=plan)
            found[name] = None
        except sw.PlanError as exc:
            found[name] = str(exc)
    return found


def test_refusals_name_the_fix():
    found = sw.testing.run_on_ranks(_refusals, 2)[0]
    assert "register one with sw.plan.register_rule(Unruled, rule)" in found["no rule"], found
    assert "shard it StridedShard(0, 3)" in found["rule refuses"], found
    assert "sharded over one mesh dim (tp)" in found["2D"], found


def test_register_rule_checks_its_arguments():
    with pytest.raises(sw.PlanError):
        sw.plan.register_rule(int, fused_qkv_rule)
    with pytest.raises(sw.PlanError):
        sw.plan.register_rule(FusedQKVAttention, "not a function")


class FusedMLP(nn.Module):
    """A whole MLP in one module: up (column-parallel) and down (row-parallel) projections."""

    def __init__(self, width: int):
        super().__init__()
        self.up = nn.Parameter(torch.randn(4 * width, width) / width ** 0.5)
        self.down = nn.Parameter(torch.randn(width, 4 * width) / (4 * width) ** 0.5)
        self.down_bias = nn.Parameter(torch.zeros(width))

    def forward(self, x):
        return F.linear(F.gelu(F.linear(x, self.up)), self.down, self.down_bias)


@sw.plan.register_rule(FusedMLP)
def fused_mlp_rule(path, module, placements):
    def forward(module, x, *, tp):
        hidden = F.gelu(F.linear(tp.replicated_input(x), tp.local(module.up)))
        partial = F.linear(hidden, tp.local(module.down))  # each rank's share of the sum
        return tp.output(partial, Partial()) + tp.local(module.down_bias)

    return forward


class TinyMLPLM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.mlp = FusedMLP(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids):
        x = self.emb(ids[:, :-1])
        x = x + self.mlp(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), ids[:, 1:].flatten())


def test_registered_rule_with_a_partial_output_matches_one_process():
    """A rule returning tp.output(y, Partial()): the partial sums are all-reduced and the
    down projection's gradient is its own shard's (it was 99% off, issue 26)."""
    plan = {"params": {"mlp.up": ["Shard(0)"], "mlp.down": ["Shard(1)"]}}
    compare_cases(2, [Case("tp2 fused mlp, partial output", {"tp": 2}, TinyMLPLM, batches(), plan=plan),
                      Case("tp2 gpt, hooks on sharded Linears", {"tp": 2}, hooked_gpt, gpt_batches(4, 8), plan="gpt")])


def hooked_gpt():
    """Built-in rules are installed in place (as registered ones): the user's hooks on a
    sharded Linear stay and run (here they change the result, so parity needs them to)."""
    model = make_gpt(0)
    mlp = model.layers[0].mlp
    mlp.fc1.register_forward_pre_hook(lambda module, args: (args[0] * 0.5,))
    mlp.fc2.register_forward_hook(lambda module, args, out: out * 3.0)
    return model
