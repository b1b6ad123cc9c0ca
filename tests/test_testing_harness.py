"""run_on_ranks: results in rank order, worker errors re-raised with rank and traceback,
dead and hanging workers reported instead of waited on, a crash on the way out reported too;
workers start from the forkserver's imports, frozen."""

from __future__ import annotations

import gc
import multiprocessing.util
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import shardwise as sw


def _tensors(rank: int) -> dict[str, torch.Tensor]:
    """Tensors results carry, of every kind run_on_ranks writes as bytes (and a Parameter, which it
    leaves to torch): dtypes, a transposed view, an empty and a 0-d tensor, a leaf that requires grad."""
    torch.manual_seed(rank)
    return {"bf16": torch.randn(3, 5).bfloat16(), "transposed": torch.arange(6).reshape(2, 3).t(),
            "empty": torch.empty(0, 4), "scalar": torch.tensor(2.5 + rank), "mask": torch.rand(7) > 0.5,
            "leaf": torch.randn(4, requires_grad=True), "parameter": torch.nn.Parameter(torch.randn(2))}


def _sum_of_ranks(scale):
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    tensors = _tensors(dist.get_rank())
    return {"rank": dist.get_rank(), "env": os.environ["RANK"], "sum": float(t) * scale, "tensor": t,
            "tensors": tensors, "again": tensors["bf16"]}


def _raise_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom from the worker")
    dist.barrier()


def _die_on_rank_two():
    if dist.get_rank() == 2:
        os._exit(3)
    time.sleep(60)


def _hang():
    time.sleep(60)


def _what_the_worker_started_with():
    return gc.get_freeze_count()


def _crash_on_exit_on_rank_one():
    if dist.get_rank() == 1:  # runs as the worker leaves, after its result was sent
        multiprocessing.util.Finalize(None, os._exit, args=(7,), exitpriority=0)
    return dist.get_rank()


def test_results_come_back_in_rank_order():
    results = sw.testing.run_on_ranks(_sum_of_ranks, 3, 2.0)
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert [r["env"] for r in results] == ["0", "1", "2"]
    assert all(r["sum"] == 6.0 for r in results)
    assert isinstance(results[0]["tensor"], torch.Tensor)
    for rank, result in enumerate(results):  # every tensor as the rank had it; one object sent twice stays one
        for name, want in _tensors(rank).items():
            got = result["tensors"][name]
            assert type(got) is type(want) and got.dtype == want.dtype and got.requires_grad == want.requires_grad, name
            assert got.shape == want.shape and torch.equal(got.detach(), want.detach()), name
        assert result["again"] is result["tensors"]["bf16"]


def test_workers_start_with_the_preloaded_modules_frozen():
    """What the forkserver imported (torch, shardwise, the caller's heavy libraries: hundreds of
    thousands of objects) is out of the collector's sight in a worker: without that a full
    collection there walked all of torch and transformers (test_activations.py ran 17 s -> 37 s)."""
    frozen = sw.testing.run_on_ranks(_what_the_worker_started_with, 2)
    assert all(count > 100_000 for count in frozen), frozen


def test_worker_exception_names_rank_and_traceback():
    with pytest.raises(sw.RankFailedError) as info:
        sw.testing.run_on_ranks(_raise_on_rank_one, 2, timeout=60)
    message = str(info.value)
    assert "rank 1 of 2 raised" in message
    assert "ValueError: boom from the worker" in message
    assert "_raise_on_rank_one" in message  # the worker's traceback


def test_dead_worker_is_reported_not_waited_on():
    start = time.monotonic()
    with pytest.raises(sw.RankFailedError, match="rank 2 of 3 died with exit code 3"):
        sw.testing.run_on_ranks(_die_on_rank_two, 3, timeout=60)
    assert time.monotonic() - start < 30


def test_hanging_workers_are_killed_after_timeout():
    start = time.monotonic()
    with pytest.raises(sw.RankFailedError, match=r"ranks \[0, 1\] of 2 did not finish within 2s"):
        sw.testing.run_on_ranks(_hang, 2, timeout=2)
    assert time.monotonic() - start < 20


def test_worker_that_crashes_after_returning_fails_the_run():
    with pytest.raises(sw.RankFailedError, match="rank 1 with exit code 7 of 2 crashed or hung on exit"):
        sw.testing.run_on_ranks(_crash_on_exit_on_rank_one, 2, timeout=60)


_CRASHING_TESTS = '''
import os
import resource
import torch.distributed as dist
from shardwise.testing import run_on_ranks


def _abort_unless_done(marker):
    if not os.path.exists(marker):
        open(marker, "w").close()
        os.abort()


def _rank_one(action, marker):
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # CI keeps cores: none from these aborts
    if action == "both abort once":
        _abort_unless_done(f"{marker}.{dist.get_rank()}")
    if dist.get_rank() == 1:
        if action == "abort once":
            _abort_unless_done(marker)
        if action == "abort":
            os.abort()
        if action == "exit":
            os._exit(3)
        if action == "raise":
            raise ValueError("a bug in the worker")
    dist.barrier()
    return dist.get_rank()


def test_abort_once():  # the marker outlives the first attempt (a rerun gets a new tmp_path)
    assert run_on_ranks(_rank_one, 2, "abort once", os.path.abspath("aborted"), timeout=60) == [0, 1]


def test_both_abort_once():  # no rank reports: the other message run_on_ranks raises
    assert run_on_ranks(_rank_one, 2, "both abort once", os.path.abspath("both"), timeout=60) == [0, 1]


def test_abort_always():
    run_on_ranks(_rank_one, 2, "abort", "", timeout=60)


def test_exit():
    run_on_ranks(_rank_one, 2, "exit", "", timeout=60)


def test_raise():
    run_on_ranks(_rank_one, 2, "raise", "", timeout=60)
'''


def _rerun_options() -> list[str]:
    """pyproject's --reruns and --only-rerun, as the suite itself runs with them."""
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    addopts = shlex.split(re.search(r'^addopts = "(.*)"$', text, re.M).group(1).replace("\\\\", "\\"))
    keep = [i for i, opt in enumerate(addopts) if opt in ("--reruns", "--only-rerun")]
    return [part for i in keep for part in addopts[i:i + 2]]


def test_only_a_rank_dying_in_native_code_reruns_and_only_once(tmp_path):
    """The suite's rerun policy (pyproject.toml): a test whose rank died by SIGABRT runs once more
    (passing if the rerun does), whichever of run_on_ranks' messages names the death; dying again
    fails it; a rank's exception or plain exit is never rerun."""
    (tmp_path / "test_crashes.py").write_text(_CRASHING_TESTS)
    options = _rerun_options()
    assert options[:2] == ["--reruns", "1"] and len(options) == 4, options
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-raR", *options,
                          "test_crashes.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    summary = run.stdout.strip().splitlines()[-1]
    assert "2 passed" in summary and "3 failed" in summary and "3 rerun" in summary, run.stdout[-3000:]
    reruns = sorted(line.split("::")[1] for line in run.stdout.splitlines() if line.startswith("RERUN "))
    assert reruns == ["test_abort_always", "test_abort_once", "test_both_abort_once"], run.stdout[-3000:]
