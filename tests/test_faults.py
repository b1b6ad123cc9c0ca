"""Each parity check fails when the mechanism it guards is broken (tests/faults.py).

A parity test that would pass with its mechanism broken proves nothing; these runs inject
one fault each into the workers and require the comparison with one process to fail.
"""

from __future__ import annotations

import functools
import re

import pytest

import shardwise as sw
from parity import gpt_batches, make_gpt, run_and_compare
from test_zoo import batches as hf_batches
from test_zoo import make as make_hf

SHARDWISE_ERRORS = {name for name, value in vars(sw.errors).items()
                    if isinstance(value, type) and issubclass(value, sw.ShardwiseError)}
CASES = [  # fault, ranks, config, plan, model (GPT overrides, or a Hugging Face kind), optimizer
    ("sum-not-mean", 2, {}, None, {}, "sgd"),
    ("no-all-reduce", 2, {}, None, {}, "sgd"),
    ("microbatch-sum", 2, {"microbatches": 4}, None, {}, "sgd"),
    ("tp-partial-not-summed", 2, {"tp": 2, "sequence_parallel": True}, "gpt", {}, "sgd"),
    ("zero-off-by-one", 2, {"zero": 1}, None, {}, "adamw"),
    ("tied-not-summed", 2, {"pp": 2, "microbatches": 2}, None, {"n_layer": 4}, "sgd"),
    ("dropout-per-shard", 2, {"tp": 2, "sequence_parallel": True}, "gpt", {"dropout": 0.2}, "sgd"),
    ("recompute-rng-not-restored", 2, {"tp": 2, "recompute": "full"}, "gpt", {"dropout": 0.2}, "sgd"),
    ("gathered-input-reduced-twice", 2, {"tp": 2, "sequence_parallel": True}, "llama", "llama", "sgd"),
]


def test_sharded_loss_fails_under_fault():
    """A loss computed on sequence-sharded activations, taken as each rank's whole loss (x tp)."""
    from test_tensor_parallel import SHARDED_LOSS_PLANS, ShardedLossMLP, _sequences

    config, plan = {"tp": 2, "sequence_parallel": True}, SHARDED_LOSS_PLANS["fc1 input split"]
    run_and_compare(2, config, ShardedLossMLP, _sequences(), plan=plan)
    with pytest.raises(AssertionError):
        run_and_compare(2, config, ShardedLossMLP, _sequences(), plan=plan, fault="sharded-loss-whole")


@pytest.mark.parametrize("fault, world, config, plan, model, optimizer", CASES, ids=[c[0] for c in CASES])
def test_parity_check_fails_under_fault(fault, world, config, plan, model, optimizer):
    if isinstance(model, str):  # a Hugging Face model of tests/test_zoo.py
        factory, batches = functools.partial(make_hf, model), hf_batches(model)
    else:
        factory, batches = functools.partial(make_gpt, 0, **model), gpt_batches(3, 8)
    run_and_compare(world, config, factory, batches, plan=plan, optimizer=optimizer)  # healthy: passes
    with pytest.raises((AssertionError, sw.RankFailedError)) as caught:
        run_and_compare(world, config, factory, batches, plan=plan, optimizer=optimizer, fault=fault)
    if caught.type is sw.RankFailedError:  # one of shardwise's own checks, not a crash of the injected code
        assert re.search(r"^(\w+Error): ", str(caught.value).split("raised:\n", 1)[1]).group(1) in SHARDWISE_ERRORS, \
            caught.value


def test_dp_gather_in_model_code_fails_under_fault():
    """In-batch negatives gathered over dp: with the gradient passed through as DTensor does
    for tp (right only when every rank computes the same loss) the parity check fails."""
    from test_groups import InBatchNegatives, mlp_batches

    run_and_compare(2, {}, InBatchNegatives, mlp_batches())
    with pytest.raises(AssertionError):
        run_and_compare(2, {}, InBatchNegatives, mlp_batches(), fault="dp-gather-pass-through")
