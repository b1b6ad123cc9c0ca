"""Shared by the benchmarks: alternate timed rounds between implementations in one run."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch.distributed as dist


def timed_rounds(steps: dict[str, Callable[[object], None]], batches: list, rounds: int) -> dict[str, list[float]]:
    """Seconds per step for each implementation, one entry per round; rounds alternate
    between implementations so both see the same machine load. One warm-up step each."""
    for step in steps.values():
        step(batches[0])
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            dist.barrier()
            start = time.perf_counter()
            for batch in batches:
                step(batch)
            dist.barrier()
            times[name].append((time.perf_counter() - start) / len(batches))
    return times


def print_times(times: dict[str, list[float]], samples: int) -> dict[str, float]:
    """A table of median step time and samples/s; returns samples/s by name."""
    print(f"{'':<22} {'median step':>12} {'samples/s':>10}   rounds (ms/step)")
    rate = {}
    for name, values in times.items():
        median = statistics.median(values)
        rate[name] = samples / median
        print(f"{name:<22} {median * 1e3:>9.1f} ms {rate[name]:>10.1f}   " + " ".join(f"{t * 1e3:.1f}" for t in values))
    return rate
