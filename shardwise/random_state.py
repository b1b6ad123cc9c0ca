"""The random-number state of a rank, taken and put back (for forwards that must leave no trace)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn


def rng_state(device: torch.device) -> tuple:
    """The CPU generator's state, and the device's when it is an accelerator."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def set_rng_state(state: tuple, device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


@contextlib.contextmanager
def without_trace(module: nn.Module, device: torch.device) -> Iterator[None]:
    """Inside the block forwards may draw random numbers and update buffers (batch-norm
    statistics); afterwards both are as they were, so training continues as if it never ran."""
    buffers = [(b, b.detach().clone()) for b in module.buffers() if b is not None]
    state = rng_state(device)
    try:
        yield
    finally:
        set_rng_state(state, device)
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
