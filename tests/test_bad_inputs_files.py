"""Bad inputs that reach files (see test_bad_inputs.py): checkpoints loaded and saved on two
ranks (each damaged or misplaced on purpose), merged on one process, and the command line's
refusals, each in one line.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner

import shardwise as sw
from parity import SGD, gpt_batches, make_gpt
from bad_inputs import Case, judge, judge_all_ranks, outcome, rank


# ==== checkpoints ===================================================================================
CONTEXT: dict[str, str] = {}


def _ckpt_model(**overrides):
    pm = sw.parallelize(make_gpt(0, **overrides), sw.ParallelConfig(tp=2), plan="gpt")
    return pm, sw.build_optimizer(pm, torch.optim.SGD, **SGD)


def _load(key: str, optimizer: bool = True, **overrides):
    pm, opt = _ckpt_model(**overrides)
    return sw.load_checkpoint(CONTEXT[key], pm, opt if optimizer else None)


def _save(path: str, extra: Any = None):
    pm, opt = _ckpt_model()
    return sw.save_checkpoint(path, pm, opt, extra=extra)


def _disk_full(kind: str):
    """A save whose write fails (a full disk) on one or every rank; then training goes on and
    the next save succeeds. The failure is injected where the file is written."""
    import errno

    from safetensors import SafetensorError
    from shardwise.checkpoint import store

    pm, opt = _ckpt_model()
    real = store.save_file

    def full(tensors, filename):
        if kind == "safetensors":
            raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")
        if rank() == 1:
            raise OSError(errno.ENOSPC, "No space left on device", filename)
        return real(tensors, filename)

    store.save_file = full
    try:
        sw.save_checkpoint(CONTEXT["fresh"], pm, opt)
    except sw.CheckpointError as exc:
        message = str(exc)
    finally:
        store.save_file = real
    pm.train_step(gpt_batches(1, 4)[0])
    opt.step()
    sw.save_checkpoint(CONTEXT["fresh"], pm, opt)
    sw.load_checkpoint(CONTEXT["fresh"], pm, opt)
    raise sw.CheckpointError(message)  # what the failed save said, after training went on


def _beside_another_job():
    """Another job's save in progress in the same directory survives ours; a stale one does not."""
    root = Path(CONTEXT["shared"])
    if rank() == 0:
        (root / "v-0000000000other.tmp").mkdir(parents=True, exist_ok=True)
        stale = root / "v-00000000000dead.tmp"
        stale.mkdir(exist_ok=True)
        os.utime(stale, (time.time() - 7200, time.time() - 7200))
    _save(str(root))
    dist.barrier()
    return sorted(p.name for p in root.glob("v-*.tmp"))


def _load_into_groups(key: str, split: str):
    """The 'good' checkpoint (one SGD group) into an optimizer with two groups."""
    pm = sw.parallelize(make_gpt(0), sw.ParallelConfig(tp=2), plan="gpt")
    named = list(pm.named_parameters())
    if split == "two groups":
        groups = [{"params": [p for n, p in named if "wte" in n]}, {"params": [p for n, p in named if "wte" not in n],
                                                                    "lr": 0.5}]
    else:
        groups = [{"params": [p for n, p in named]}]
    opt = sw.build_optimizer(pm, torch.optim.SGD, params=groups, **SGD)
    return sw.load_checkpoint(CONTEXT[key], pm, opt)


def _after_failures_training_goes_on():
    pm, opt = _ckpt_model()
    for target in (f"{CONTEXT['file']}/ck", CONTEXT["missing"]):
        try:
            sw.save_checkpoint(target, pm, opt) if target.endswith("/ck") else sw.load_checkpoint(target, pm, opt)
        except sw.CheckpointError:
            pass
    loss = float(pm.train_step(gpt_batches(1, 4)[0]))
    opt.step()
    sw.save_checkpoint(CONTEXT["fresh"], pm, opt)
    sw.load_checkpoint(CONTEXT["fresh"], pm, opt)
    return loss


CHECKPOINTS = {
    "missing directory": Case(lambda: _load("missing"), "CheckpointError", "no complete checkpoint at"),
    "empty directory": Case(lambda: _load("empty"), "CheckpointError", "(no LATEST file)"),
    "LATEST names a missing version": Case(lambda: _load("dangling"), "CheckpointError", "is incomplete"),
    "no COMPLETE marker": Case(lambda: _load("incomplete"), "CheckpointError", "it has no COMPLETE marker"),
    "truncated rank file": Case(lambda: _load("truncated"), "CheckpointError", "is corrupt"),
    "corrupt bytes in a chunk": Case(lambda: _load("corrupt"), "CheckpointError",
                                     "chunk t0 of 'model/wte.weight' does not match its checksum"),
    "edited shardwise.json": Case(lambda: _load("meta"), "CheckpointError", "shardwise.json does not match its checksum"),
    "edited rank index": Case(lambda: _load("index"), "CheckpointError", "rank-1.json does not match its checksum"),
    "missing rank file": Case(lambda: _load("lost"), "CheckpointError", "rank-1.safetensors"),
    "another model": Case(lambda: _load("good", n_layer=3), "CheckpointError", "is from another model"),
    "no optimizer state saved": Case(lambda: _load("no-optimizer"), "CheckpointError", "has no optimizer state"),
    "checkpoint on rank 0 only": Case(lambda: _load(f"rank{rank()}-only"), "CheckpointError", "found on rank 1"),
    "unwritable directory": Case(lambda: _save(f"{CONTEXT['file']}/ck"), "CheckpointError",
                                 "cannot create checkpoint directory"),
    "directory not shared": Case(lambda: _save(f"{CONTEXT['unshared']}/{rank()}"), "CheckpointError",
                                 "rank 1 does not see"),
    "plain file that is not a state dict": Case(lambda: _load("not-a-state-dict"), "CheckpointError",
                                                "is not a readable state dict"),
    "plain state dict of another model": Case(lambda: _load("other-state-dict"), "CheckpointError",
                                              "state dict does not match GPT"),
    "training goes on after failures": Case(_after_failures_training_goes_on, None, check=lambda v: v > 0),
    "optimizer with more groups than saved": Case(lambda: _load_into_groups("good", "two groups"), "CheckpointError",
                                                  "saved with 1 optimizer parameter group(s) and this optimizer has 2"),
    "optimizer with the saved group": Case(lambda: _load_into_groups("good", "one group"), None),
    "extra holding an object": Case(lambda: _save(CONTEXT["fresh"], extra={"sampler": Case(None, None)}),
                                    "CheckpointError", "may not contain"),
    "disk full on one rank": Case(lambda: _disk_full("oserror"), "CheckpointError",
                                  "rank 1's checkpoint file in"),
    "disk full, said in words": Case(lambda: _disk_full("oserror"), "CheckpointError",
                                     "the disk is full: free space or save elsewhere"),
    "disk full, safetensors' error": Case(lambda: _disk_full("safetensors"), "CheckpointError",
                                          "SafetensorError: Error while serializing"),
    "permission denied said as such": Case(lambda: _save("/sys/shardwise-ck"), "CheckpointError",
                                           "permission denied: make the directory writable"),
    "another job's save in progress survives": Case(_beside_another_job, None,
                                                    check=lambda v: v == ["v-0000000000other.tmp"]),
    "extra that cannot be pickled": Case(lambda: _save(CONTEXT["fresh"], extra={"fn": lambda: 0}), "CheckpointError",
                                         "cannot be saved"),
}


def _make_checkpoint(path: str, optimizer: bool = True):
    pm, opt = _ckpt_model()
    pm.train_step(gpt_batches(1, 4)[0])
    opt.step()
    sw.save_checkpoint(path, pm, opt if optimizer else None)
    if dist.get_rank() == 0:
        torch.save(make_gpt(0, n_layer=3).state_dict(), f"{path}-other.pt")


def _version(path: Path) -> Path:
    return path / (path / "LATEST").read_text()

def _run_checkpoints(context: dict[str, str]) -> dict[str, tuple]:
    CONTEXT.update(context)
    return {name: outcome(case.action) for name, case in CHECKPOINTS.items()}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    sw.testing.run_on_ranks(_make_checkpoint, 2, str(root / "good"))
    sw.testing.run_on_ranks(_make_checkpoint, 2, str(root / "no-optimizer"), False)
    paths = {"good": root / "good", "no-optimizer": root / "no-optimizer", "missing": root / "missing",
             "empty": root / "empty", "fresh": root / "fresh", "unshared": root / "unshared",
             "rank0-only": root / "good", "rank1-only": root / "nowhere"}
    (root / "empty").mkdir()
    (root / "file").write_text("a file, not a directory")
    paths["file"] = root / "file"
    paths["shared"] = root / "shared"
    (root / "unshared").mkdir()

    def variant(name: str, damage: Callable[[Path], None]) -> None:
        shutil.copytree(root / "good", root / name)
        damage(_version(root / name))
        paths[name] = root / name

    def corrupt_chunk(version: Path) -> None:
        target = version / "rank-0.safetensors"
        data = bytearray(target.read_bytes())
        header = int.from_bytes(data[:8], "little")
        name = json.loads((version / "rank-0.json").read_text())["index"]["model/wte.weight"][0][0]
        offset = 8 + header + json.loads(data[8:8 + header])[name]["data_offsets"][0] + 32
        data[offset:offset + 16] = b"\x11" * 16
        target.write_bytes(bytes(data))

    variant("dangling", lambda v: shutil.rmtree(v))
    variant("incomplete", lambda v: (v / "COMPLETE").unlink())
    variant("truncated", lambda v: (v / "rank-1.safetensors").write_bytes((v / "rank-1.safetensors").read_bytes()[:100]))
    variant("corrupt", corrupt_chunk)
    variant("meta", lambda v: (v / "shardwise.json").write_text((v / "shardwise.json").read_text().replace('"steps": 1',
                                                                                                       '"steps": 7')))
    variant("index", lambda v: (v / "rank-1.json").write_text((v / "rank-1.json").read_text().replace("[0, ", "[1, ", 1)))
    variant("lost", lambda v: (v / "rank-1.safetensors").unlink())
    (root / "junk.pt").write_bytes(b"not a pickle")
    paths["not-a-state-dict"] = root / "junk.pt"
    paths["other-state-dict"] = root / "good-other.pt"
    context = {k: str(v) for k, v in paths.items()}
    return sw.testing.run_on_ranks(_run_checkpoints, 2, context, timeout=300), root


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_checkpoints(checkpoints, name):
    judge_all_ranks(CHECKPOINTS[name], checkpoints[0], name)


MERGES = {  # one process: what load refuses, merge refuses
    "merge of a corrupt chunk": ("corrupt", "m.safetensors", False, "does not match its checksum"),
    "merge of a truncated file": ("truncated", "m.safetensors", False, "is corrupt"),
    "merge of a missing checkpoint": ("missing", "m.safetensors", False, "no complete checkpoint"),
    "merge into a missing directory": ("good", "nowhere/m.safetensors", False, "does not exist; create it first"),
    "merge with a wrong suffix": ("good", "m.bin", False, "must end in .safetensors or .pt"),
    "merge of optimizer state never saved": ("no-optimizer", "m.pt", True, "has no optimizer state to merge"),
    "merge into an unwritable directory": ("good", "/sys/m.safetensors", False, "Permission denied (os error 13)"),
}


@pytest.mark.parametrize("name", list(MERGES))
def test_merge(checkpoints, name):
    key, out, optimizer, phrase = MERGES[name]
    root = checkpoints[1]
    source = root / key if key != "missing" else root / "missing"
    judge(Case(None, "CheckpointError", phrase),
          outcome(lambda: sw.merge_checkpoint(source, root / out, optimizer=optimizer)), name)


# ==== the command line ===============================================================================
CLI = {
    "demo --ranks 0": (["demo", "--ranks", "0"], "0 is not in the range x>=1"),
    "demo --ranks -1": (["demo", "--ranks", "-1"], "-1 is not in the range x>=1"),
    "demo --microbatches 0": (["demo", "--microbatches", "0"], "0 is not in the range x>=1"),
    "demo --steps 0": (["demo", "--steps", "0"], "0 is not in the range x>=1"),
    "demo --batch 0": (["demo", "--batch", "0"], "0 is not in the range x>=1"),
    "demo --tp 3 on 4 ranks": (["demo", "--tp", "3"], "--tp 3 x --pp 1 x --cp 1 must divide --ranks 4"),
    "demo --cp 3 on 4 ranks": (["demo", "--cp", "3"], "--tp 1 x --pp 1 x --cp 3 must divide --ranks 4"),
    "demo batch not a multiple": (["demo", "--batch", "6"], "must be a multiple of replicas*microbatches = 8"),
    "demo --lr 0": (["demo", "--lr", "0"], "0.0 is not in the range x>0"),
    "merge of a missing path": (["merge", "/nonexistent/ckpt", "/tmp/x.safetensors"], "does not exist"),
    "demo --backend nccl without a GPU per rank": (["demo", "--backend", "nccl"], "--backend nccl needs a GPU per rank"),
    "demo --backend mpi": (["demo", "--backend", "mpi"], "'mpi' is not one of 'gloo', 'nccl'"),
    "plan --model of a function needing arguments": (["plan", "--model", "json:loads", "--gpus", "8", "--seq", "2048",
                                                      "--global-batch", "8"], "json:loads() raised TypeError"),
    "plan --model returning a string": (["plan", "--model", "os:getcwd", "--gpus", "8", "--seq", "2048",
                                         "--global-batch", "8"], "os:getcwd() returned a str, not a torch.nn.Module"),
    "check of a factory returning a string": (["check", "os:getcwd", "test_groups:mlp_batches", "--ranks", "2"],
                                              "returned a str, not a torch.nn.Module"),
    "check with string batches": (["check", "test_check:gpt", "os:getcwd", "--ranks", "2"],
                                  "batches must be a list of batches"),
    "check with batches of strings": (["check", "test_check:gpt", "test_bad_inputs_files:_strings", "--ranks", "2"],
                                      "batch 0 is a str holding no tensor"),
}


def _strings():
    return ["a", "b", "c"]


@pytest.mark.parametrize("name", list(CLI))
def test_cli(name):
    from shardwise.cli import main

    args, phrase = CLI[name]
    result = CliRunner().invoke(main, args)
    assert result.exit_code != 0 and phrase in result.output, result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("name", ["corrupt", "truncated", "into a missing directory"])
def test_cli_merge_refuses_in_one_line(checkpoints, name):
    from shardwise.cli import main

    root = checkpoints[1]
    source, out = {"corrupt": ("corrupt", "m.safetensors"), "truncated": ("truncated", "m.safetensors"),
                   "into a missing directory": ("good", "nowhere/m.safetensors")}[name]
    result = CliRunner().invoke(main, ["merge", str(root / source), str(root / out)])
    assert result.exit_code == 1 and result.output.startswith("Error: ") and len(result.output.splitlines()) == 1, \
        result.output
