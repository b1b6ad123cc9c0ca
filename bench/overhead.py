"""The wrapper's own cost: shardwise at world size 1 against the plain module, same device.

    python bench/overhead.py [--layers 4] [--d-model 256] [--seq 128] [--batch 8] [--compile]
    torchrun --nproc-per-node 1 bench/overhead.py

Without torchrun's environment `sw.init_distributed()` starts a world of one process (the
single-rank path); under torchrun it joins the launched world. Both steps are forward,
backward, AdamW and zero_grad on the same GPT and the same batches, already on the device;
rounds alternate between them and the device is synchronized around each round. At world
size 1 shardwise has nothing to communicate, so the difference is what the wrapper itself
costs per step: batch checks, the step's bookkeeping and its collectives of one rank.
A third step measures the same with step metrics on, logged every step (`metrics on`).
`--compile` compiles every block of both models in place (inductor), after which the
wrapper's Python is a larger share of a shorter step. The order of the two alternates each round.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

import shardwise as sw
from common import bench_batches, bench_gpt, bench_parser, synchronize


class _Discard:
    """A metrics logger that keeps nothing (the cost measured is the measuring)."""

    def log(self, values, step):
        values.get("mfu")

    def close(self):
        pass


def _timed(step, batches) -> float:
    synchronize()
    start = time.perf_counter()
    for batch in batches:
        step(batch)
    synchronize()
    return (time.perf_counter() - start) / len(batches)


def main() -> None:
    parser = bench_parser(__doc__, ranks=1, rounds=7, steps=20)
    parser.set_defaults(seq=128)
    parser.add_argument("--compile", action="store_true", help="compile each block of both models (inductor)")
    args = parser.parse_args()

    sw.init_distributed()
    pm = sw.parallelize(bench_gpt(args), sw.ParallelConfig())
    device = pm.topology.device
    sw_opt = sw.build_optimizer(pm, torch.optim.AdamW, lr=1e-4)
    # the same with step metrics on, logged every step (to a logger that keeps nothing)
    measured = sw.parallelize(bench_gpt(args), sw.ParallelConfig())
    measured_opt = sw.build_optimizer(measured, torch.optim.AdamW, lr=1e-4)
    measured.metrics.log_to(_Discard())
    plain = bench_gpt(args).to(device)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-4)
    batches = [b.to(device) for b in bench_batches(args, seed=0)]

    def plain_step(batch):
        plain(batch).backward()
        plain_opt.step()
        plain_opt.zero_grad()

    def sw_step(batch):
        pm.train_step(batch)
        sw_opt.step()
        sw_opt.zero_grad()

    def measured_step(batch):
        measured.train_step(batch)
        measured_opt.step()
        measured_opt.zero_grad()

    if args.compile:
        for block in list(plain.layers) + list(pm.module.layers) + list(measured.module.layers):
            block.compile()
    steps = {"plain module": plain_step, "shardwise": sw_step, "metrics on": measured_step}
    for step in steps.values():
        _timed(step, batches[:3])
    times = {name: [] for name in steps}
    for index in range(args.rounds):
        for name in (list(steps) if index % 2 == 0 else list(steps)[::-1]):  # (the shape's FLOPs counted at warm-up)
            times[name].append(_timed(steps[name], batches))

    params = sum(p.numel() for p in plain.parameters())
    print(f"overhead: GPT {params / 1e6:.2f} M params ({args.layers} layers, d_model {args.d_model}), "
          f"batch {args.batch} x {args.seq} tokens, AdamW, {'blocks compiled, ' if args.compile else ''}"
          f"world {dist.get_world_size()} "
          f"({dist.get_backend()}) on {device}")
    median = {name: statistics.median(values) for name, values in times.items()}
    for name, values in times.items():
        print(f"{name:<14} {median[name] * 1e3:8.3f} ms/step   rounds: " + " ".join(f"{t * 1e3:.3f}" for t in values))
    extra = median["shardwise"] - median["plain module"]
    print(f"wrapper overhead: {extra * 1e3:+.3f} ms/step ({extra / median['plain module'] * 100:+.1f}%) from the medians")
    # each round times the two back to back, so their ratio cancels the machine's slower drifts
    paired = statistics.median(s / p - 1 for s, p in zip(times["shardwise"], times["plain module"]))
    print(f"wrapper overhead, median of the rounds' paired ratios: {paired * 100:+.2f}% (aim <= 1%)")
    metrics = statistics.median(m / s - 1 for m, s in zip(times["metrics on"], times["shardwise"]))
    print(f"step metrics on (logged every step) vs off, median of the rounds' paired ratios: {metrics * 100:+.2f}% "
          "(aim <= 1%)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
