"""Files shardwise reads run no code, whoever wrote them, and hold what each rank gave.

A checkpoint's checksums are plain data anyone who can write the directory can recompute,
so they are no defence against a planted pickle. Each file shardwise reads (checkpoint
metadata, each rank's `extra`, merged state dicts, their optimizer files, plan files) gets a
pickle whose unpickling would create a marker directory, with its checksums recomputed so
only the loader's own refusal can stop it; the load must refuse and the marker must not
exist afterwards.
"""

from __future__ import annotations

import io
import json
import os
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

import shardwise as sw
from parity import SGD, gpt_batches, make_gpt


class Planted:
    """Unpickles by calling os.makedirs(marker): harmless, and visible if it ran."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.makedirs, (self.marker,)


def _planted_bytes(marker: Path) -> bytes:
    buffer = io.BytesIO()
    torch.save({"param_groups": [], "loss_scaler": None, "x": Planted(str(marker))}, buffer)
    return buffer.getvalue()


def _model():
    pm = sw.parallelize(make_gpt(0), sw.ParallelConfig(tp=2), plan="gpt")
    return pm, sw.build_optimizer(pm, torch.optim.SGD, **SGD)


def _save(path: str):
    pm, opt = _model()
    pm.train_step(gpt_batches(1, 4)[0])
    opt.step()
    sw.save_checkpoint(path, pm, opt, extra={"rank": dist.get_rank(), "seen": torch.arange(3) + dist.get_rank()})


def _load(path: str):
    """(error class or 'ok', message or the loaded extra) on this rank."""
    pm, opt = _model()
    try:
        return "ok", sw.load_checkpoint(path, pm, opt)
    except sw.ShardwiseError as exc:
        return type(exc).__name__, str(exc)


def _version(path: Path) -> Path:
    return path / (path / "LATEST").read_text()


def _reseal(version: Path) -> None:
    """Recompute every checksum of a version after a planted edit, as an attacker can."""
    meta = json.loads((version / "shardwise.json").read_text())
    meta["meta_crc"] = zlib.crc32((version / "meta.pt").read_bytes())
    for rank in range(meta["world_size"]):
        index = version / f"rank-{rank}.json"
        meta["files"][str(rank)] = zlib.crc32(index.read_bytes())
    text = json.dumps(meta, indent=1)
    (version / "shardwise.json").write_text(text)
    (version / "COMPLETE").write_text(f"complete {zlib.crc32(text.encode())}\n")


def _plant_extra(version: Path, marker: Path) -> None:
    """Replace rank 0's `extra` bytes inside its safetensors file, with its index CRC updated."""
    tensors = load_file(str(version / "rank-0.safetensors"))
    tensors["extra"] = torch.frombuffer(bytearray(_planted_bytes(marker)), dtype=torch.uint8)
    save_file(tensors, str(version / "rank-0.safetensors"))
    entry = json.loads((version / "rank-0.json").read_text())
    entry["raw"]["extra"] = sw.checkpoint.store.crc32(tensors["extra"])
    (version / "rank-0.json").write_text(json.dumps(entry))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("untrusted")
    sw.testing.run_on_ranks(_save, 2, str(root / "good"))
    return root


@pytest.mark.parametrize("where, reseal", [("meta.pt", False), ("meta.pt", True), ("extra", True)])
def test_planted_pickle_in_a_checkpoint_runs_nothing(saved, tmp_path, where, reseal):
    import shutil

    path, marker = tmp_path / "ck", tmp_path / "ran"
    shutil.copytree(saved / "good", path)
    version = _version(path)
    if where == "meta.pt":
        (version / "meta.pt").write_bytes(_planted_bytes(marker))
    else:
        _plant_extra(version, marker)
    if reseal:
        _reseal(version)
    results = sw.testing.run_on_ranks(_load, 2, str(path))
    for rank, (kind, message) in enumerate(results):
        assert kind == "CheckpointError", (rank, kind, message)
        phrase = "does not match its checksum" if not reseal else "may not contain"
        assert phrase in message, (rank, message)
    assert not marker.exists(), "the planted pickle ran during load_checkpoint"
    if where == "meta.pt":
        with pytest.raises(sw.CheckpointError):
            sw.merge_checkpoint(path, tmp_path / "m.pt", optimizer=True)
    else:  # merge never reads the ranks' extras
        sw.merge_checkpoint(path, tmp_path / "m.pt", optimizer=True)
    assert not marker.exists(), "the planted pickle ran during merge"


def test_planted_pickle_in_plain_files_runs_nothing(saved, tmp_path):
    marker = tmp_path / "ran"
    sw.merge_checkpoint(saved / "good", tmp_path / "m.pt", optimizer=True)
    (tmp_path / "m.pt.optimizer.pt").write_bytes(_planted_bytes(marker))
    (tmp_path / "evil.pt").write_bytes(_planted_bytes(marker))
    (tmp_path / "plan.json").write_bytes(_planted_bytes(marker))
    results = sw.testing.run_on_ranks(_load, 2, str(tmp_path / "m.pt"))
    assert all(kind == "CheckpointError" and "not a readable state dict" in msg for kind, msg in results), results
    results = sw.testing.run_on_ranks(_load, 2, str(tmp_path / "evil.pt"))
    assert all(kind == "CheckpointError" and "not a readable state dict" in msg for kind, msg in results), results
    with pytest.raises(sw.PlanError):
        sw.Plan.from_json(tmp_path / "plan.json")
    assert not marker.exists(), "a planted pickle ran"


def test_each_rank_gets_its_own_extra(saved):
    results = sw.testing.run_on_ranks(_load, 2, str(saved / "good"))
    for rank, (kind, extra) in enumerate(results):
        assert kind == "ok", extra
        assert extra["rank"] == rank and torch.equal(extra["seen"], torch.arange(3) + rank), (rank, extra)


def _save_extra(path: str, marker: str):
    pm, opt = _model()
    try:
        sw.save_checkpoint(path, pm, opt, extra={"loader": Planted(marker)})
    except sw.CheckpointError as exc:
        return str(exc)
    return "saved"


def test_an_extra_that_could_run_code_is_refused_at_save(tmp_path):
    results = sw.testing.run_on_ranks(_save_extra, 2, str(tmp_path / "ck"), str(tmp_path / "ran"))
    assert all("may not contain" in r for r in results), results
    assert not (tmp_path / "ran").exists()
    assert not (tmp_path / "ck").exists() or not list((tmp_path / "ck").glob("v-*")), "a failed save left a version"
