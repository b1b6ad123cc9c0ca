"""How a call may ask for transformers' load-balancing loss when several ranks route their own
tokens (shardwise/parallel/expert/router.py's call guard), checked at dp2 on tiny Mixtral.

transformers weighs that loss by the call's attention_mask, this replica's only, while the
router logits it weighs are gathered over the replicas: a mask that counts every token is
dropped (the loss is then the unmasked one, the causal attention the same), so training with
the tokenizer's all-ones mask equals one process given that mask; a padded mask is one
ModelError (every rank fails, also when only one replica's batch is padded); and
output_router_logits=True passed per call to a model parallelized with it off is refused
(its loss would have been each replica's: a silently different objective).
"""

from __future__ import annotations

import torch
from torch import nn

import shardwise as sw
from parity import compare_cases, Case
from test_expert import make_moe, moe_batches


class MaskedCall(nn.Module):
    """The model called as a user's loop calls it: the tokenizer's attention_mask passed along."""

    def __init__(self, lm: nn.Module, per_call_router_logits: bool = False):
        super().__init__()
        self.lm = lm
        self.per_call = per_call_router_logits

    def forward(self, batch):
        extra = {"output_router_logits": True} if self.per_call else {}
        return self.lm(input_ids=batch["input_ids"], labels=batch["labels"], attention_mask=batch["attention_mask"],
                       **extra).loss


def masked_moe(per_call: bool = False) -> MaskedCall:
    return MaskedCall(make_moe("mixtral", aux_loss=not per_call).lm, per_call)


def masked_batches(padded_rows: tuple[int, ...] = ()) -> list[dict[str, torch.Tensor]]:
    out = []
    for batch in moe_batches():
        mask = torch.ones_like(batch["input_ids"])
        for row in padded_rows:
            mask[row, :3] = 0
        out.append({**batch, "attention_mask": mask})
    return out


def test_an_all_ones_mask_trains_as_one_process():
    compare_cases(2, [Case("mixtral dp2 load-balancing loss, all-ones attention_mask", {}, masked_moe, masked_batches())])


def _refusal(padded_rows: tuple[int, ...], per_call: bool) -> str:
    pm = sw.parallelize(masked_moe(per_call), sw.ParallelConfig())
    index, count = sw.data_parallel_info(pm)
    batch = masked_batches(padded_rows)[0]
    try:
        pm.train_step({k: v[index * 2:(index + 1) * 2] for k, v in batch.items()})
    except sw.ShardwiseError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "trained"


def test_padded_masks_and_per_call_router_logits_are_refused():
    both = sw.testing.run_on_ranks(_refusal, 2, (0, 3), False)  # a padded row in each replica's half
    assert all(m.startswith("ModelError") and "padded attention_mask" in m for m in both), both
    one = sw.testing.run_on_ranks(_refusal, 2, (3,), False)  # only rank 1's half is padded
    assert one[1].startswith("ModelError") and "padded attention_mask" in one[1], one
    assert one[0] != "trained" and "rank 1" in one[0], one  # the other rank fails too, naming it
    per_call = sw.testing.run_on_ranks(_refusal, 2, (), True)
    assert all("output_router_logits=True but its config had it off" in m for m in per_call), per_call
