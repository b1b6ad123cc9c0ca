"""How long a checkpoint save stalls training: synchronous against asynchronous, same run.

    python bench/async_save.py [--ranks 2] [--layers 8] [--d-model 512] [--rounds 3]

Each round trains a few steps, saves (model, AdamW state) into a temporary directory, and
trains on: the stall is the time `save_checkpoint` holds the step (for an asynchronous save,
the copy of this rank's state off the training tensors; the write, the ranks' agreement and
the publication go on in the background), and the background time is until `wait()`
returns. The median round is printed with the checkpoint's size.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import shardwise as sw
from common import bench_batches, bench_gpt, bench_parser, training_step


def _bench(args, scratch: str):
    pm = sw.parallelize(bench_gpt(args), sw.ParallelConfig(timeout_s=args.timeout_s))
    optimizer = sw.build_optimizer(pm, torch.optim.AdamW, lr=1e-4)
    step = training_step(pm.train_step, optimizer)
    batches = bench_batches(args, seed=100 + dist.get_rank())
    step(batches[0])  # optimizer state exists before the first save
    stalls: dict[str, list[float]] = {"synchronous": [], "asynchronous": []}
    background = []
    for _ in range(args.rounds):
        for mode in stalls:
            dist.barrier()
            start = time.perf_counter()
            handle = sw.save_checkpoint(Path(scratch) / mode, pm, optimizer, async_=mode == "asynchronous")
            stalls[mode].append(time.perf_counter() - start)
            if mode == "asynchronous":
                for batch in batches:
                    step(batch)  # training goes on meanwhile
                handle.wait()
                background.append(time.perf_counter() - start)
    version = next(p for p in (Path(scratch) / "synchronous").glob("v-*") if p.is_dir())
    size = sum(f.stat().st_size for f in version.iterdir())
    return {"stalls": stalls, "background": background, "bytes": size,
            "params": sum(p.numel() for p in pm.module.parameters())}


def main() -> None:
    parser = bench_parser(__doc__, ranks=2, rounds=3, steps=3)
    parser.set_defaults(layers=8, d_model=512)
    parser.add_argument("--timeout-s", type=float, default=180.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:  # one directory every rank shares, as a real run has
        res = sw.testing.run_on_ranks(_bench, args.ranks, args, scratch, timeout=3600)[0]
    print(f"checkpoint of a GPT with {res['params'] / 1e6:.1f} M params + AdamW state on {args.ranks} gloo ranks: "
          f"{res['bytes'] / 2**20:.0f} MiB on disk")
    for mode, values in res["stalls"].items():
        print(f"{mode:<13} save stalls the step {statistics.median(values) * 1e3:8.1f} ms  (rounds: "
              + " ".join(f"{v * 1e3:.0f}" for v in values) + ")")
    print(f"asynchronous save done in the background after {statistics.median(res['background']) * 1e3:.0f} ms "
          f"(with {args.steps} training steps running meanwhile)")
    ratio = statistics.median(res["stalls"]["asynchronous"]) / statistics.median(res["stalls"]["synchronous"])
    print(f"stall asynchronous / synchronous: {ratio:.3f}")


if __name__ == "__main__":
    main()
