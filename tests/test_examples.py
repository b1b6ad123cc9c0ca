"""The fine-tuning recipe runs as a user runs it: a few steps, then a launch of four
torchrun-style processes that resumes from its checkpoint, metrics a reader parses, and a final
directory transformers loads. The first launch and the unbroken run the two must equal run on
run_on_ranks' workers (the same four processes' worth of work, without four interpreter starts
each: about 10 s of the suite's time a launch)."""

from __future__ import annotations

import json
import math
import runpy
import sys
from pathlib import Path

import torch
import transformers

import shardwise as sw
from launch import free_port, launch, torchrun_environment

RECIPE = Path(__file__).resolve().parent.parent / "examples" / "finetune_hf.py"


def _arguments(out: Path, *more: str) -> list[str]:
    return [str(RECIPE), "--tiny", "--out", str(out), "--steps", "6", *more, "--tp", "2", "--save-every", "2",
            "--warmup", "2", "--lr", "3e-3", "--batch", "8", "--seq", "32"]


def _run(out: Path, *more: str) -> None:
    """The recipe in four fresh interpreters with torchrun's variables, as a user launches it."""
    script = f"import runpy, sys; sys.argv = {_arguments(out, *more)!r}; runpy.run_path({str(RECIPE)!r}, run_name='__main__')"
    port = free_port()
    outputs = launch(script, [torchrun_environment(r, 4, port) for r in range(4)], timeout=300)
    assert [code for code, _, _ in outputs] == [0] * 4, [(code, err[-3000:]) for code, _, err in outputs]


def _recipe(arguments: list[str]) -> None:
    sys.argv = arguments
    runpy.run_path(str(RECIPE), run_name="__main__")


def _run_in_workers(out: Path, *more: str) -> None:
    """The same recipe on run_on_ranks' four workers (no interpreter start each)."""
    sw.testing.run_on_ranks(_recipe, 4, _arguments(out, *more), timeout=300)


def test_finetune_recipe_trains_resumes_and_exports(tmp_path):
    out, straight = tmp_path / "run", tmp_path / "straight"
    _run_in_workers(out, "--stop-at", "3")  # preempted after step 3 (a checkpoint there, between the periodic ones)
    _run(out)  # resumes at step 3, in fresh interpreters
    _run_in_workers(straight)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    unbroken = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    # the same layout resumes bit for bit: model, AdamW's moments, the schedule's step, the data's position
    # (the learning-rate schedule decays over --steps: a run given another length is another run)
    assert [r["loss"] for r in records] == [r["loss"] for r in unbroken]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(r["loss"]) and r["global_tokens"] == 8 * 32 for r in records)
    assert records[-1]["loss"] < records[0]["loss"] - 0.3, [r["loss"] for r in records]  # ln(256) = 5.5 to start
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 2, "rank 0 only, one per launch"
    model = transformers.AutoModelForCausalLM.from_pretrained(out / "final")
    logits = model(torch.tensor([[72, 105]])).logits
    assert logits.shape == (1, 2, 256) and torch.isfinite(logits).all()
