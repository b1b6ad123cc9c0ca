"""Step metrics are right, not only present: FLOPs are what one process executes (split
exactly over tp shards and pipeline stages), tokens/s and MFU follow from the step's own
numbers, time is what the step took, communication is seen where buckets are waited on, and
the loggers write files their own readers parse."""

from __future__ import annotations

import json
import os
import math
import resource
import struct
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

import shardwise as sw
from parity import gpt_batches, make_gpt

PEAK = 1e12  # a stated device peak (CPUs have no table entry)
LAYOUTS = {"dp2": ({}, None), "tp2": ({"tp": 2}, "gpt"), "pp2": ({"pp": 2, "microbatches": 2}, None)}


def _one_process_flops(batch: torch.Tensor) -> float:
    model = make_gpt(0)
    with FlopCounterMode(display=False) as counter:
        model(batch).backward()
    return float(counter.get_total_flops())


def _run(layout: str, logdir: str):
    overrides, plan = LAYOUTS[layout]
    batches = gpt_batches(3, 4)
    rank = dist.get_rank()
    pm = sw.parallelize(make_gpt(0), sw.ParallelConfig(**overrides), plan=plan,
                        sample=batches[0] if overrides.get("pp") else None)
    opt = sw.build_optimizer(pm, torch.optim.AdamW, lr=1e-3)
    pm.metrics.peak_flops = PEAK
    if layout == "dp2":
        pm.metrics.log_to(sw.JsonlLogger(Path(logdir) / "metrics.jsonl"))
        pm.metrics.log_to(sw.TensorBoardLogger(Path(logdir) / "tb"), every=2)
    records = []
    for batch in batches:
        mine = batch[rank * 2:(rank + 1) * 2] if layout == "dp2" else batch
        start = time.perf_counter()
        out = pm.train_step(mine, metrics=True)
        wall = time.perf_counter() - start
        norm = opt.clip_grad_norm(1.0)
        start = time.perf_counter()
        opt.step()
        optimizer_wall = time.perf_counter() - start
        opt.zero_grad()
        record = out.metrics.as_dict()
        record.update(wall=wall, optimizer_wall=optimizer_wall, clip_norm=float(norm), out_loss=float(out.loss),
                      rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        records.append(record)
    pm.metrics.close()
    return records


def test_metrics_are_right(tmp_path):
    whole = _one_process_flops(gpt_batches(3, 4)[0])
    cfg = make_gpt(0).cfg  # 6 N per token, N the matmul weights (the model's own count: 6*N*tokens)
    matmul_params = cfg.n_layer * 12 * cfg.d_model ** 2 + cfg.vocab_size * cfg.d_model
    tokens = 4 * 16
    # CPU attention kernels are not in torch's FLOP table, biases and norms are cheap: 6*N*tokens within 3%
    assert abs(whole - 6 * matmul_params * tokens) <= 0.03 * whole
    by_layout = {}
    for layout in LAYOUTS:
        results = by_layout[layout] = sw.testing.run_on_ranks(_run, 2, layout, str(tmp_path))
        for rank, records in enumerate(results):
            for r in records:
                assert r["tokens"] == (32 if layout == "dp2" else 64) and r["global_tokens"] == 64
                assert 0 < r["train_step_s"] <= r["wall"] and 0 < r["optimizer_s"] <= r["optimizer_wall"]
                assert math.isclose(r["step_s"], r["train_step_s"] + r["optimizer_s"])
                assert math.isclose(r["tokens_per_s"], r["tokens"] / r["ranks_per_replica"] / r["step_s"])
                assert math.isclose(r["global_tokens_per_s"], 64 / r["step_s"])
                if r["step"] == 1:  # its shape's first step: one-time work (a pipeline's capture)
                    assert r["flops"] is None and r["mfu"] is None
                else:
                    assert math.isclose(r["mfu"], r["flops"] / (r["step_s"] * PEAK))
                assert r["loss"] == r["out_loss"] and r["grad_norm"] == r["clip_norm"]
                assert 0 < r["peak_memory_bytes"] <= r["rss"]
                assert r["communication_s"] >= 0 and r["compute_s"] >= 0
            flops = [r["flops"] for r in records[1:]]
            assert len(set(flops)) == 1, "counted once per batch shape"
            if layout == "dp2":
                assert all(r["communication_s"] > 0 for r in records), "gradient buckets are waited on"
                assert flops[0] == _one_process_flops(gpt_batches(3, 4)[0][:2])  # the replica's half batch
            if layout == "pp2":
                assert all(r["bubble_s"] is not None and r["bubble_s"] >= 0 for r in records)
        if layout != "dp2":  # shards and stages split one process's FLOPs exactly
            assert results[0][1]["flops"] + results[1][1]["flops"] == whole, layout

    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3], "rank 0 only, every step"
    for line, mine, theirs in zip(lines, *by_layout["dp2"]):  # the slowest rank's step, as each rank timed it
        slowest = max((mine, theirs), key=lambda r: r["step_s"])
        assert line["slowest_rank"] == (mine, theirs).index(slowest) and line["slowest_step_s"] == slowest["step_s"]
    assert [line["loss"] for line in lines] == [r["out_loss"] for r in by_layout["dp2"][0]]
    assert [line["flops"] for line in lines] == [r["flops"] for r in by_layout["dp2"][0]]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    losses = events.Scalars("train/loss")
    assert [e.step for e in losses] == [2]
    assert math.isclose(losses[0].value, lines[1]["loss"], rel_tol=1e-6)
    assert [e.step for e in events.Scalars("train/mfu")] == [2]


def test_wandb_logger_writes_an_offline_run(tmp_path, monkeypatch):
    """W&B keeps its offline run in its own binary log (its Python reader is gone since 0.2x;
    `wandb sync` uploads it): the logged keys and values must be in it, None left out."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = sw.WandbLogger(mode="offline", project="shardwise-test", dir=str(tmp_path))
    logger.open()
    logger.log({"step": 7, "loss": 1.625, "global_tokens_per_s": 12345.5, "mfu": None}, 7)
    logger.close()
    import wandb

    # finish() returns once the run's end is handled; W&B's service process writes the offline
    # file's blocks in its own time (one CI run read only the header). teardown() waits for it.
    wandb.teardown()
    (run,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    data = b"".join(_wandb_records(run.read_bytes()))
    for text in (b"global_tokens_per_s", b"12345.5", b"loss", b"1.625"):
        assert text in data, text
    assert b"mfu" not in data


def _wandb_records(data: bytes) -> list[bytes]:
    """The records of a .wandb file, reassembled: it is a LevelDB-style log (a 7-byte file header,
    then 32 KiB blocks of records, each with a 7-byte header: crc, length, type full/first/middle/
    last), so a key can straddle a block boundary and a raw byte search misses it."""
    assert data[:4] == b":W&B", data[:7]
    block, pos, records, part = 32768, 7, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zero padding to the end of a block
            pos += block - pos % block
            continue
        assert kind in (1, 2, 3, 4), (kind, pos)
        part = (b"" if kind in (1, 2) else part) + data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            records.append(part)
    return records


def _traced_step(path: str):
    pm = sw.parallelize(make_gpt(0, n_layer=4), sw.ParallelConfig(pp=2, microbatches=2), sample=gpt_batches(1, 4)[0])
    opt = sw.build_optimizer(pm, torch.optim.AdamW, lr=1e-3)
    batch = gpt_batches(1, 4)[0][pm.topology.dp_rank * 2:(pm.topology.dp_rank + 1) * 2]
    pm.train_step(batch)
    opt.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        pm.train_step(batch)
        opt.step()
    out = f"{path}/trace-{dist.get_rank()}.json"
    prof.export_chrome_trace(out)
    return out


def test_a_chrome_trace_reads_as_the_schedule(tmp_path):
    """torch.profiler's trace of a pp2 x dp2 step names shardwise's phases: the step, each
    stage action and receive, the gradient buckets' launches and waits, the agreement."""
    for rank, path in enumerate(sw.testing.run_on_ranks(_traced_step, 4, str(tmp_path))):
        names = {e.get("name", "") for e in json.loads(Path(path).read_text())["traceEvents"]}
        ours = {n for n in names if n.startswith("shardwise/")}
        stage = rank // 2
        expected = {"shardwise/train_step", "shardwise/optimizer.step",
                    f"shardwise/pp forward stage {stage} microbatch 0", f"shardwise/pp backward stage {stage} microbatch 1",
                    "shardwise/launch all-reduce of gradient bucket 0"}
        expected.add(f"shardwise/pp receive from rank {rank + 2 if stage == 0 else rank - 2}")
        assert expected <= ours, sorted(ours)
        assert any(n.startswith("shardwise/wait: all-reduce of gradient bucket") for n in ours), sorted(ours)


def test_theoretical_schedule_places_1f1b_by_hand():
    """pp=2, m=2, 1F1B, forward 1 and backward 2 units: worked by hand, a 9-unit step (6 of
    work per rank, a bubble of (p-1)(F+B) = 3)."""
    from shardwise.parallel.pipeline.runner import single_stage_steps
    from shardwise.timeline import theoretical

    placed = theoretical({r: single_stage_steps("1f1b", r, 2, 2) for r in range(2)})
    assert placed[0] == [("pp forward stage 0 microbatch 0", 0, 1), ("pp forward stage 0 microbatch 1", 1, 2),
                         ("pp backward stage 0 microbatch 0", 4, 6), ("pp backward stage 0 microbatch 1", 7, 9)]
    assert placed[1] == [("pp forward stage 1 microbatch 0", 1, 2), ("pp backward stage 1 microbatch 0", 2, 4),
                         ("pp forward stage 1 microbatch 1", 4, 5), ("pp backward stage 1 microbatch 1", 5, 7)]


def _drawn(path: str):
    batches = gpt_batches(2, 4)
    pm = sw.parallelize(make_gpt(0, n_layer=4), sw.ParallelConfig(pp=2, microbatches=2), sample=batches[0])
    pm.train_step(batches[0])
    out = pm.timeline(batches[1], path)
    return None if out is None else str(out)


def test_timeline_draws_every_rank_measured_and_in_theory(tmp_path):
    import xml.etree.ElementTree as ET

    path = tmp_path / "step.svg"
    assert sw.testing.run_on_ranks(_drawn, 2, str(path)) == [str(path), None]
    titles = [t.text for t in ET.parse(path).getroot().iter("{http://www.w3.org/2000/svg}title")]
    for stage in (0, 1):
        for microbatch in (0, 1):
            for kind in ("forward", "backward"):
                name = f"pp {kind} stage {stage} microbatch {microbatch}"
                measured = [t for t in titles if t.startswith(name) and t.endswith(" ms)")]
                ideal = [t for t in titles if t.startswith(name) and t.endswith(" units)")]
                assert len(measured) == 1 and len(ideal) == 1, (name, titles)
    assert any(t.startswith("pp receive from rank") for t in titles)


def test_console_logger_and_rank_in_log_records(caplog):
    import io
    import logging

    stream = io.StringIO()
    console = sw.ConsoleLogger(stream)
    console.open()
    console.log({"loss": 2.5, "global_tokens_per_s": 1234.4, "mfu": 0.412, "peak_memory_bytes": 2 ** 31,
                 "step_s": 0.25, "communication_s": None, "grad_norm": 1.0}, 7)
    assert stream.getvalue() == ("step 7: loss 2.5000, global_tokens_per_s 1,234, mfu 41.2%, "
                                 "peak_memory_bytes 2.00 GiB, step_s 0.250 s, grad_norm 1.000\n")
    with caplog.at_level(logging.WARNING, logger="shardwise"):
        sw.get_logger("shardwise.test").warning("a message")
    (record,) = [r for r in caplog.records if r.name == "shardwise.test"]
    import torch.distributed as dist

    # the world's rank where an earlier test in this process left one initialized, else RANK or "-"
    expected = str(dist.get_rank()) if dist.is_available() and dist.is_initialized() else os.environ.get("RANK", "-")
    assert record.getMessage() == "a message" and record.rank == expected
