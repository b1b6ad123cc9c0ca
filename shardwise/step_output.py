"""What `train_step(batch, reduce=..., outputs=True)` returns, and how microbatch results combine.

Reductions over the microbatches of a step (and the data-parallel replicas):
- "mean" (default): the mean of the microbatch losses; gradients likewise, as one process
  computes them on the whole batch when the loss is a per-sample mean.
- "sum": their sum (SageMaker's `average_grads_across_microbatches=False`); replicas are
  still averaged, as data parallelism does.
- "tokens": the forward returns `(loss, num_tokens)`, loss the mean over the microbatch's
  tokens; the step's loss is Σ loss·num_tokens / Σ num_tokens over every microbatch of every
  replica, and the gradient that of this quantity: one process's loss over all the step's
  tokens at once, however unevenly they fall (padding, masked-LM labels).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .errors import ConfigError, ModelError
from .tensors import whole

REDUCTIONS = ("mean", "sum", "tokens")


@dataclass
class StepOutput:
    """A training step's results: `loss` (as `reduce` combines it, the same on every rank),
    `outputs` (the forward's output for this replica's whole batch: each microbatch's tensors
    concatenated along dim 0, 0-dim tensors averaged), and under reduce="tokens" `num_tokens`,
    the step's total over every replica."""

    loss: torch.Tensor
    outputs: Any = None
    num_tokens: int | None = None


def check_reduce(reduce: str, outputs: bool, pipelined: bool, context_parallel: bool) -> None:
    if reduce not in REDUCTIONS:
        raise ConfigError(f"train_step(reduce={reduce!r}): use one of {REDUCTIONS}")
    if (reduce == "tokens" or outputs) and (pipelined or context_parallel):
        what = "reduce='tokens'" if reduce == "tokens" else "outputs=True"
        raise ConfigError(f"train_step({what}) is not available with pp > 1 or cp > 1 yet: the last stage or the "
                          "sequence shards hold the outputs; use reduce='mean'/'sum' and infer_step for outputs")


def tokens_of(output: Any) -> torch.Tensor:
    """The token count a forward returned second, for reduce="tokens"."""
    count = output[1] if isinstance(output, (list, tuple)) and len(output) > 1 else None
    if isinstance(count, (int, float)) and not isinstance(count, bool):
        count = torch.tensor(float(count))
    if not isinstance(count, torch.Tensor) or count.numel() != 1:
        raise ModelError("train_step(reduce='tokens') needs forward(batch) to return (loss, num_tokens), the loss "
                         "a mean over the microbatch's tokens and num_tokens their count (an int or a 1-element "
                         f"tensor); the second output was {type(count).__name__}")
    return count.detach().reshape(()).float()


def detached(output: Any) -> Any:
    """A microbatch's output kept for `StepOutput.outputs`: whole tensors, no graph."""
    leaves, spec = tree_flatten(output)
    return tree_unflatten([whole(leaf).detach()
                           if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves], spec)


def concatenated(outputs: list[Any]) -> Any:
    """The microbatches' outputs as one: tensors concatenated along dim 0, 0-dim floating
    ones (a loss) averaged, integer counts (0-dim integer tensors, ints) summed, other values
    those of the first microbatch."""
    flat = [tree_flatten(o) for o in outputs]
    spec = flat[0][1]
    merged = []
    for values in zip(*(leaves for leaves, _ in flat)):
        first = values[0]
        if isinstance(first, torch.Tensor) and first.dim() == 0:
            stacked = torch.stack(values)
            merged.append(stacked.float().mean().to(first.dtype) if first.is_floating_point() else stacked.sum())
        elif isinstance(first, torch.Tensor):
            merged.append(torch.cat(values))
        elif isinstance(first, int) and not isinstance(first, bool):
            merged.append(sum(values))
        else:
            merged.append(first)
    return tree_unflatten(merged, spec)
