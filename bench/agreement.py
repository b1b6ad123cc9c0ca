"""What the per-step agreement costs, and how that grows with the world.

    python bench/agreement.py [--iters 400]

Measured on local gloo ranks: one point-to-point exchange of 48 bytes (the latency alpha of
a step of any small-message algorithm), shardwise's agreement (an all-gather of a 48-byte
record per rank), and gloo's own all-reduce and all-gather of one record. Then, for worlds
of 64 to 16,384 ranks, the dependent message steps of each algorithm times the measured
alpha: gloo's all-gather is a ring of n-1 steps, its all-reduce a ring of 2(n-1) (so a
fixed-size all-reduce of check sums, which was tried, is slower under gloo than the
all-gather); recursive doubling would take about log2(n). (A simulation: this machine has 2
cores; at 4 ranks the measured numbers are mostly ranks waiting for a core.)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import shardwise as sw


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
    """Dependent message steps of each algorithm for a small message at `world` ranks: gloo's
    rings, and recursive doubling (ceil(log2 p) exchanges, p the largest power of two <= n,
    plus one before and one after when n is not a power of two)."""
    p = 1 << (world.bit_length() - 1)
    return {"recursive doubling": (p.bit_length() - 1) + 2 * (world != p), "gloo all_gather (the agreement)":
            world - 1,
            "gloo all_reduce": 2 * (world - 1)}


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
    names = list(steps(2))
    print(f"{'ranks':>6} " + " ".join(f"{name + ' steps':>34} {'ms':>8}" for name in names))
    for n in (64, 128, 256, 512, 1024, 16384):
        s = steps(n)
        print(f"{n:>6} " + " ".join(f"{s[name]:>34} {s[name] * alpha / 1e3:>8.2f}" for name in names))
    print("growth: gloo all_reduce 2(n-1), all_gather n-1, recursive doubling ~log2 n")


if __name__ == "__main__":
    main()
