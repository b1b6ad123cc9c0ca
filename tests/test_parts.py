"""parallelize(..., parts=["llm"]): an LLM part inside a larger model.

A conditioning encoder (a Sequential of linear layers holding more parameters than the LLM's
layer list, so "the model's layer list" would otherwise be the encoder's) adds its output to
a tiny HF Llama's input embeddings. With parts=["llm"] the zoo plan, recompute and the
pipeline's layer list look inside the LLM only; the encoder stays replicated, its gradients
averaged in the same buckets, one optimizer over both. Trained at tp2 x dp2 with full
recompute, and at pp2 x dp2, against one process (tests/parity.py's bounds); full_state_dict
holds both parts. A plan sharding the encoder while parts=["llm"] is refused.
"""

from __future__ import annotations

import torch
import transformers
from torch import nn

import shardwise as sw
from parity import Case, compare_cases
from test_zoo import COMMON, batches


class Conditioned(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Sequential(nn.Linear(16, 1024), nn.Tanh(), nn.Linear(1024, 32))
        self.llm = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_key_value_heads=2, **COMMON))

    def forward(self, batch):
        ids = batch["input_ids"]
        features = torch.linspace(-1, 1, 16, device=ids.device).expand(ids.shape[0], 16) * ids[:, :1].float() / 64
        embeds = self.llm.get_input_embeddings()(ids) + self.encoder(features)[:, None, :]
        return self.llm(inputs_embeds=embeds, labels=batch["labels"]).loss


def test_llm_part_inside_a_larger_model():
    data = batches("llama")
    compare_cases(4, [
        Case("tp2 dp2 recompute, parts=llm", {"tp": 2, "recompute": "full"}, Conditioned, data,
             plan=sw.Plan.from_dict({**sw.plan.zoo["llama"](sw.ParallelConfig(tp=2)).to_dict(), "parts": ["llm"]})),
        Case("pp2 dp2, parts=llm", {"pp": 2, "microbatches": 2}, Conditioned, data, plan=sw.Plan(parts=["llm"])),
    ])


def _scoped():
    pm = sw.parallelize(Conditioned(), sw.ParallelConfig(tp=2, recompute="full"), plan="llama", parts="llm")
    whole = sw.parallelize(Conditioned(), sw.ParallelConfig(recompute="full"))
    try:
        sw.parallelize(Conditioned(), sw.ParallelConfig(tp=2), plan={"params": {"encoder.0.weight": ["Shard(0)"]}},
                       parts=["llm"])
        refused = None
    except sw.PlanError as exc:
        refused = str(exc)
    try:
        sw.parallelize(Conditioned(), sw.ParallelConfig(), parts=["lm"])
        missing = None
    except sw.PlanError as exc:
        missing = str(exc)
    return pm.recomputed, whole.recomputed, sorted(pm.full_state_dict()), refused, missing


def test_parts_scope_the_plan_and_recompute():
    recomputed, unscoped, keys, refused, missing = sw.testing.run_on_ranks(_scoped, 2)[0]
    assert recomputed == ["llm.model.layers.0", "llm.model.layers.1"], recomputed
    assert unscoped == ["encoder.0", "encoder.1", "encoder.2"], unscoped  # what "the layer list" means unscoped
    assert "encoder.0.weight" in keys and "llm.model.layers.0.mlp.up_proj.weight" in keys
    assert refused is not None and "outside parts ['llm']" in refused, refused
    assert missing is not None and "'lm' is not a submodule" in missing and "llm" in missing, missing
