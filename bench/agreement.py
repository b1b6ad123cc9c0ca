"""What the per-step agreement costs, and how that grows with the world.

    python bench/agreement.py [--iters 400]

Measured on local gloo ranks: one point-to-point exchange of 48 bytes (the latency alpha of
a step of any small-message algorithm), shardwise's agreement (its fast path: a
recursive-doubling sum of six int64 check sums), and gloo's own all-reduce and all-gather of
the same record. Then, for worlds of 64 to 16,384 ranks, the dependent message steps each
algorithm takes (counted from shardwise's real schedule, `small_allreduce.exchanges`, and
from the ring algorithms gloo runs) times the measured alpha: the growth law is log2(n) for
the agreement, n for an all-gathered record per rank, 2n for gloo's ring all-reduce. (A
simulation: this machine has 2 cores; at 4 ranks and more the measured numbers are mostly
the ranks waiting for a core, which is printed too.)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.small_allreduce import exchanges


def _median_us(fn, iters: int) -> float:
    for _ in range(20):
        fn()
    samples = []
    for _ in range(5):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters // 5):
            fn()
        samples.append((time.perf_counter() - start) / (iters // 5) * 1e6)
    return statistics.median(samples)


def _measure(iters: int) -> dict[str, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    pm = sw.parallelize(torch.nn.Linear(4, 4), sw.ParallelConfig())
    record = torch.zeros(6, dtype=torch.int64)
    out = {}
    if world == 2:
        other = 1 - rank

        def exchange():
            incoming = torch.empty_like(record)
            works = [dist.isend(record, dst=other), dist.irecv(incoming, src=other)]
            for work in works:
                work.wait()

        out["p2p exchange"] = _median_us(exchange, iters)
    out["shardwise agreement"] = _median_us(lambda: pm.coordinator.agree("agree"), iters)
    out["gloo all_reduce"] = _median_us(lambda: dist.all_reduce(record), iters)
    gathered = torch.zeros(6 * world, dtype=torch.int64)
    out["gloo all_gather"] = _median_us(lambda: dist.all_gather_into_tensor(gathered, record), iters)
    return out


def steps(world: int) -> dict[str, int]:
    """Dependent message steps of each algorithm for a small message at `world` ranks."""
    recursive = max(len(list(exchanges(i, world))) for i in range(world)) if world > 1 else 0
    return {"shardwise agreement": recursive, "gloo all_gather": world - 1, "gloo all_reduce": 2 * (world - 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=400)
    args = parser.parse_args()
    measured = {n: sw.testing.run_on_ranks(_measure, n, args.iters)[0] for n in (2, 4)}
    alpha = measured[2]["p2p exchange"]
    print("measured on local gloo (2 cores), median microseconds per call:")
    print(f"{'ranks':>6} {'p2p exchange':>13} {'agreement':>10} {'all_reduce':>11} {'all_gather':>11}")
    for n, m in measured.items():
        print(f"{n:>6} {m.get('p2p exchange', float('nan')):>13.0f} {m['shardwise agreement']:>10.0f} "
              f"{m['gloo all_reduce']:>11.0f} {m['gloo all_gather']:>11.0f}")
    print(f"\nmodelled from alpha = {alpha:.0f} us (one 48-byte exchange at 2 ranks) x dependent steps:")
    print(f"{'ranks':>6} {'agreement steps':>16} {'ms':>7} {'all_gather steps':>17} {'ms':>8} "
          f"{'all_reduce steps':>17} {'ms':>8}")
    for n in (64, 128, 256, 512, 1024, 16384):
        s = steps(n)
        print(f"{n:>6} {s['shardwise agreement']:>16} {s['shardwise agreement'] * alpha / 1e3:>7.2f} "
              f"{s['gloo all_gather']:>17} {s['gloo all_gather'] * alpha / 1e3:>8.1f} "
              f"{s['gloo all_reduce']:>17} {s['gloo all_reduce'] * alpha / 1e3:>8.1f}")
    print("growth: agreement ceil(log2 n) (+2 when n is not a power of two); all_gather n-1; all_reduce 2(n-1)")


if __name__ == "__main__":
    main()
