"""`shardwise check` and sw.check: the user's parity check, on a correct and a wrong layout.

The correct layouts (GPT at dp2 x tp2 with the zoo plan; a hand-written row-parallel layer at
tp2) agree with one process well inside the default tolerance; a layer that averages its
partial products where it must sum them (`sw.reduce(..., op="mean")`, a bug only tp > 1
shows) moves that layer's output, and so every gradient, by a factor of 2: the check names
it and the CLI exits 1.
"""

from __future__ import annotations

import torch
from click.testing import CliRunner
from torch import nn

import shardwise as sw
from parity import gpt_batches, make_gpt
from shardwise.cli import main
from test_groups import HandParallelMLP, mlp_batches


class WrongReduce(HandParallelMLP):
    """The hand-written layer with mean where sum is needed: equal to one process at tp=1 only."""

    def forward(self, batch):
        product = self.product
        partial = sw.split(torch.tanh(self.up(batch["x"])), "tp", dim=-1) @ sw.split(product.weight, "tp", dim=1).T
        return (sw.reduce(partial, "tp", op="mean") - batch["y"]).pow(2).mean()


def gpt() -> nn.Module:
    return make_gpt(0, n_layer=2)


def gpt_data() -> list:
    return gpt_batches(3, 8)


def test_check_agrees_on_correct_layouts_and_names_a_wrong_one():
    report = sw.check(HandParallelMLP, mlp_batches, sw.ParallelConfig(tp=2), ranks=2, plan=sw.Plan(name="none"))
    assert report.ok, report.table()
    assert {g.name for g in report.groups} == {"up", "product"}
    assert all(g.grad < 1e-4 and g.param < 1e-4 for g in report.groups), report.table()
    wrong = sw.check(WrongReduce, mlp_batches, sw.ParallelConfig(tp=2), ranks=2, plan=sw.Plan(name="none"))
    assert not wrong.ok and "DISAGREE" in wrong.table()
    assert all(g.grad > 0.1 for g in wrong.groups), wrong.table()


def test_check_cli_exit_status():
    ok = CliRunner().invoke(main, ["check", "test_check:gpt", "test_check:gpt_data", "--ranks", "4", "--tp", "2",
                                   "--plan", "gpt"])
    assert ok.exit_code == 0, ok.output
    assert "verdict: agree" in ok.output and "layers.0.attn.q_proj" in ok.output, ok.output
    wrong = CliRunner().invoke(main, ["check", "test_check:WrongReduce", "test_groups:mlp_batches", "--ranks", "2",
                                      "--tp", "2", "--steps", "2"])
    assert wrong.exit_code == 1, wrong.output
    assert "DISAGREE" in wrong.output and "<-- differs" in wrong.output
    missing = CliRunner().invoke(main, ["check", "no_such_module:f", "test_groups:mlp_batches", "--ranks", "2"])
    assert missing.exit_code == 1 and "cannot import 'no_such_module:f'" in missing.output, missing.output


def test_check_cli_runs_expert_parallel():
    """`shardwise check ... --ep 2` on a Hugging Face Mixtral: experts split over 2 ranks agree."""
    result = CliRunner().invoke(main, ["check", "test_expert:make_moe_mixtral", "test_expert:moe_batches", "--ranks", "2",
                                       "--ep", "2"])
    assert result.exit_code == 0, result.output
    assert "ep=2" in result.output and "verdict: agree" in result.output and "mlp.experts" in result.output, result.output
