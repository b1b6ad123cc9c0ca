"""What the per-step agreement costs, and how that grows with the world.

    python bench/agreement.py [--iters 400]

Measured on local gloo ranks, median microseconds per call: one point-to-point exchange of a
64-byte vector (alpha, the latency of one dependent step of any small-message algorithm),
shardwise's agreement summed (its fast path from 7 ranks: a recursive-doubling sum of eight
integers, on a helper thread the caller polls) and gathered (every rank's record
all-gathered: below 7 ranks, and wherever something differs), and gloo's own all-reduce
and all-gather of one record. Then, for worlds of 64 to 16,384 ranks, each algorithm's
dependent message steps times the measured alpha, plus the agreement's fixed local cost
(hashing, the thread hand-off: the measured agreement minus one exchange at 2 ranks).
The rank-local part at large worlds is measured in one process on torch's fake process
group (a world of 1,024 and 16,384: building the record must not scan the world). (This
machine has 2 cores; at 4 ranks the measured numbers are mostly ranks waiting for a core.)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.control_sum import doubling_steps
from shardwise.coordination import Coordinator, Fingerprint


def _median_us(fn, iters: int, best: bool = False) -> float:
    """Median (or with `best` the fastest) of five rounds' mean microseconds per call."""
    for _ in range(20):
        fn()
    samples = []
    for _ in range(5):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters // 5):
            fn()
        samples.append((time.perf_counter() - start) / (iters // 5) * 1e6)
    return min(samples) if best else statistics.median(samples)


def _measure(iters: int) -> dict[str, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    record = torch.zeros(8, dtype=torch.int64)
    out = {}
    if world == 2:
        other = 1 - rank

        def exchange():
            incoming = torch.empty_like(record)
            works = [dist.isend(record, dst=other), dist.irecv(incoming, src=other)]
            for work in works:
                work.wait()

        out["p2p exchange"] = _median_us(exchange, iters)
        out["alpha"] = _median_us(exchange, iters, best=True)  # latency: the least-disturbed round
    summed = Coordinator(dist.new_group(list(range(world)), backend="gloo"), 60.0, fast_path=True)
    gathered_ = Coordinator(dist.new_group(list(range(world)), backend="gloo"), 60.0, fast_path=False)
    out["summed agreement"] = _median_us(lambda: summed.agree("agree"), iters)
    out["gathered agreement"] = _median_us(lambda: gathered_.agree("agree"), iters)
    out["gloo all_reduce"] = _median_us(lambda: dist.all_reduce(record), iters)
    gathered = torch.zeros(8 * world, dtype=torch.int64)
    out["gloo all_gather"] = _median_us(lambda: dist.all_gather_into_tensor(gathered, record), iters)
    return out


def steps(world: int) -> dict[str, int]:
    """Dependent message steps of each algorithm for a small message at `world` ranks."""
    return {"shardwise agreement (summed from 7 ranks)": doubling_steps(world),
            "gathered records (gloo all_gather ring)": world - 1, "gloo all_reduce (ring)": 2 * (world - 1)}


def _local_cost(world: int, iters: int) -> float:
    """Microseconds of one agreement's rank-local work (records, check terms, no messages)
    for a tp=8 topology of `world` ranks, in one process on torch's fake process group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        topology = sw.Topology(sw.ParallelConfig(tp=8))
        coordinator = topology.coordinator

        def local():
            fp = Fingerprint(12345, list, sw.BatchError, "", peers=topology.peer_groups("pp", "cp", "tp"))
            coordinator._summary("train_step", None, 8, [fp])

        local()
        start = time.perf_counter()
        for _ in range(iters):
            local()
        return (time.perf_counter() - start) / iters * 1e6
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=400)
    args = parser.parse_args()
    measured = {n: sw.testing.run_on_ranks(_measure, n, args.iters)[0] for n in (2, 4)}
    alpha = measured[2]["alpha"]
    fixed = max(0.0, measured[2]["summed agreement"] - measured[2]["p2p exchange"])
    print("measured on local gloo (2 cores), median microseconds per call:")
    columns = ["p2p exchange", "summed agreement", "gathered agreement", "gloo all_reduce", "gloo all_gather"]
    print(f"{'ranks':>6} " + " ".join(f"{c:>20}" for c in columns))
    for n, m in measured.items():
        print(f"{n:>6} " + " ".join(f"{m.get(c, float('nan')):>20.0f}" for c in columns))
    local = {n: _local_cost(n, args.iters) for n in (64, 1024, 16384)}
    print("\nrank-local work of one agreement (fake process group, tp=8), microseconds: "
          + ", ".join(f"world {n}: {us:.1f}" for n, us in local.items()))
    print(f"\nmodelled: alpha = {alpha:.0f} us (one exchange at 2 ranks, fastest round) x dependent steps, "
          f"+ {fixed:.0f} us fixed local cost for shardwise's agreement:")
    names = list(steps(2))
    print(f"{'ranks':>6} " + " ".join(f"{name:>40} {'ms':>7}" for name in names))
    for n in (64, 128, 256, 512, 1024, 16384):
        s = steps(n)
        cost = {name: s[name] * alpha / 1e3 for name in names}
        cost[names[0]] += fixed / 1e3
        print(f"{n:>6} " + " ".join(f"{s[name]:>34} steps {cost[name]:>7.2f}" for name in names))
    print("growth: shardwise's agreement ceil(log2 n) (+2 when n is not a power of two) from 7 ranks; "
          "the gathered path (only when ranks differ) n-1; gloo all_reduce 2(n-1)")


if __name__ == "__main__":
    main()
