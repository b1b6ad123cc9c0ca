"""Shared by the benchmarks: the model, its batches, and timed rounds alternating between
implementations in one run."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.models import GPT, GPTConfig


def bench_parser(doc: str, ranks: int, rounds: int, steps: int) -> argparse.ArgumentParser:
    """The options every benchmark takes: ranks, the GPT's size, the batch, and the timing."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=ranks)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="samples per rank per step")
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--steps", type=int, default=steps, help="steps per timed round")
    return parser


def bench_gpt(args) -> GPT:
    """The benchmarks' GPT, identical on every rank and in every implementation."""
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=8, d_model=args.d_model))


def bench_batches(args, seed: int) -> list[torch.Tensor]:
    """`args.steps` token batches of `args.batch` x `args.seq + 1`."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (args.batch, args.seq + 1), generator=gen) for _ in range(args.steps)]


def training_step(forward_backward, optimizer):
    """A step for `timed_rounds`: forward and backward on a batch, then the optimizer."""
    def step(batch):
        forward_backward(batch)
        optimizer.step()
        optimizer.zero_grad()
    return step


def synchronize() -> None:
    """Wait for the device's queued work (a GPU's step returns once its kernels are queued)."""
    if torch.accelerator.is_available() and dist.is_initialized() and dist.get_backend() != "gloo":
        torch.accelerator.synchronize()


def timed_rounds(steps: dict[str, Callable[[object], None]], batches: list, rounds: int) -> dict[str, list[float]]:
    """Seconds per step for each implementation, one entry per round; rounds alternate
    between implementations so both see the same machine load, and the order rotates each
    round so none is always first after the barrier. One warm-up step each."""
    for step in steps.values():
        step(batches[0])
    times: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            step = steps[name]
            synchronize()
            dist.barrier()
            start = time.perf_counter()
            for batch in batches:
                step(batch)
            synchronize()
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


def pairs_plan() -> sw.Plan:
    """Megatron's layout of the benchmarks' GPT, as torch's native ColwiseParallel/RowwiseParallel pairs
    write it: q, k, v and fc1 column-parallel, o_proj and fc2 row-parallel, the rest replicated."""
    col, row = "Shard(0)", "Shard(1)"
    return sw.Plan(params={
        "layers.*.attn.q_proj.weight": col, "layers.*.attn.q_proj.bias": col, "layers.*.attn.k_proj.weight": col,
        "layers.*.attn.v_proj.weight": col, "layers.*.attn.v_proj.bias": col, "layers.*.attn.o_proj.weight": row,
        "layers.*.mlp.fc1.weight": col, "layers.*.mlp.fc1.bias": col, "layers.*.mlp.fc2.weight": row,
    }, name="column/row pairs")


def native_pairs(args) -> torch.nn.Module:
    """The benchmarks' GPT under torch's `parallelize_module` with `pairs_plan`'s layout
    (ColwiseParallel / RowwiseParallel), tensor-parallel over every rank."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {}
    for i in range(args.layers):
        for proj in ("q_proj", "k_proj", "v_proj"):
            plan[f"layers.{i}.attn.{proj}"] = ColwiseParallel()
        plan[f"layers.{i}.attn.o_proj"] = RowwiseParallel()
        plan[f"layers.{i}.mlp.fc1"] = ColwiseParallel()
        plan[f"layers.{i}.mlp.fc2"] = RowwiseParallel()
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (dist.get_world_size(),))
    return parallelize_module(bench_gpt(args), mesh, plan)
