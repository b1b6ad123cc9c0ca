"""Activation recompute: the same losses, gradients and parameters as one process keeping
every activation, for full and selective recompute, on every axis, dropout included (and
selective-alternate, which differs from selective only in the matmuls it reruns, on data
and tensor parallelism)."""

from __future__ import annotations

import functools

import pytest

import shardwise as sw
from parity import Case, compare_cases, gpt_batches, make_gpt
from test_zoo import batches as hf_batches
from test_zoo import make as make_hf

MODES = ["full", "selective"]


def test_recompute_parity_on_two_ranks():
    gpt = functools.partial(make_gpt, 0, n_layer=4)
    dropout = functools.partial(make_gpt, 0, n_layer=4, dropout=0.2)  # masks must be drawn again, identically
    llama = functools.partial(make_hf, "llama")
    cases = []
    for mode in MODES:
        cases += [
            Case(f"gpt dp2 {mode}", {"recompute": mode}, gpt, gpt_batches(4, 8)),
            Case(f"gpt dp2 zero3 {mode}", {"recompute": mode, "zero": 3}, gpt, gpt_batches(4, 8)),
            Case(f"gpt tp2 sp dropout {mode}", {"tp": 2, "sequence_parallel": True, "recompute": mode}, dropout,
                 gpt_batches(4, 4), plan="gpt"),
            Case(f"gpt pp2 {mode}", {"pp": 2, "microbatches": 2, "recompute": mode}, gpt, gpt_batches(4, 8)),
            Case(f"llama dp2 {mode}", {"recompute": mode}, llama, hf_batches("llama")),
            Case(f"llama tp2 sp {mode}", {"tp": 2, "sequence_parallel": True, "recompute": mode}, llama,
                 hf_batches("llama"), plan="llama"),
            Case(f"llama pp2 {mode}", {"pp": 2, "microbatches": 2, "recompute": mode}, llama, hf_batches("llama")),
        ]
    mode = "selective-alternate"
    cases += [
        Case(f"gpt dp2 {mode}", {"recompute": mode}, gpt, gpt_batches(4, 8)),
        Case(f"gpt tp2 sp dropout {mode}", {"tp": 2, "sequence_parallel": True, "recompute": mode}, dropout,
             gpt_batches(4, 4), plan="gpt"),
        Case(f"llama tp2 {mode}", {"tp": 2, "recompute": mode}, llama, hf_batches("llama"), plan="llama"),
    ]
    compare_cases(2, cases)


def test_plan_names_the_modules_recomputed():
    """Plan patterns pick exactly the modules they name; the default is every block."""
    assert sw.testing.run_on_ranks(_recomputed, 1) == [[
        ["layers.0", "layers.1", "layers.2", "layers.3"],
        ["layers.1.mlp", "layers.3.mlp"],
        ["layers.1.mlp", "layers.3.mlp"],
    ]]


def _recomputed():
    out = []
    for config, plan in [({"recompute": "full"}, None),
                         ({"recompute": "selective"}, sw.Plan(recompute=["layers.1.mlp", "layers.3.mlp"])),
                         ({}, sw.Plan(recompute=["layers.1.mlp", "layers.3.mlp"]))]:
        pm = sw.parallelize(make_gpt(0, n_layer=4), sw.ParallelConfig(**config), plan=plan)
        out.append(pm.recomputed)
    return out


@pytest.mark.parametrize("zero", [1, 2])
def test_plan_zero_drives_zero(zero):
    """A plan's ZeRO stage is the one applied (with dp=2, optimizer state then lives in shards)."""
    assert sw.testing.run_on_ranks(_plan_zero, 2, zero) == [zero, zero]


def _plan_zero(zero):
    pm = sw.parallelize(make_gpt(0, n_layer=2), sw.ParallelConfig(), plan=sw.Plan(zero=zero))
    assert all(b.sharded for b in pm.gradients.buckets)
    return pm.config.zero
