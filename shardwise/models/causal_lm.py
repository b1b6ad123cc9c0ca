"""A Hugging Face causal LM as an end2end module: forward(batch) -> loss."""

from __future__ import annotations

from typing import Any

from torch import nn


class CausalLM(nn.Module):
    """Wraps a transformers `*ForCausalLM` so `forward(batch)` returns its loss, for
    train_step under every layout, context parallelism included: positions come from the
    batch (`position_ids`, which cp adds), and labels are pre-shifted and handed over as
    `shift_labels` (HF computes a loss only when labels= is given, and would shift those
    itself, which under cp would cross shard boundaries)."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, batch: Any):
        return self.lm(input_ids=batch["input_ids"], position_ids=batch.get("position_ids"), labels=batch["labels"],
                       shift_labels=batch["labels"]).loss
