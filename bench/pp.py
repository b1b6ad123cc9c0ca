"""Pipeline schedules: measured bubble fraction and live activations, beside the theory.

    python bench/pp.py [--ms 4] [--blocks 8]

The model is a stack of blocks whose compute is emulated by fixed sleeps: forward, input
gradient and weight gradient each take --ms milliseconds per block, on separate autograd
paths so a zero-bubble schedule can run them apart. A learned input offset stands for the
embedding, whose gradient makes the first block compute its input gradient as every other
block does: every stage has the same work, as the theory assumes. Sleeping keeps a 2-core machine from
turning p ranks into p compute-bound processes fighting for cores, so what is measured is
the schedule, not the machine. For each schedule, p in {2, 4} and m in {4, 8}: the bubble,
1 - (time this rank spent computing) / (step time), averaged over ranks, next to
(p-1)/(m+p-1) (interleaved, v stages per rank: (p-1)/(v*m+p-1)), and the peak number of
microbatches whose activations were alive at once on each stage (1F1B: at most p - stage).

The `torch` column is the reference: the same blocks split by hand into torch's own
PipelineStages and run by torch's schedule class, the loss broadcast from the last stage
as train_step does; it is what torch's executor alone costs on this machine, so the gap
between theory and shardwise splits into torch's part and ours.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

import shardwise as sw
from shardwise.parallel.pipeline import PipelineStats

SCHEDULES = list(sw.config.SCHEDULES)


class _Sleep(torch.autograd.Function):
    """Identity that sleeps `forward_s` in forward and `backward_s` in backward."""

    @staticmethod
    def forward(ctx, x, forward_s, backward_s, clock):
        ctx.backward_s, ctx.clock = backward_s, clock
        _nap(forward_s, clock)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        _nap(ctx.backward_s, ctx.clock)
        return grad, None, None, None


def _nap(seconds: float, clock: list) -> None:
    """Sleep; the clock counts the time the sleep really took (the OS wakes a sleeper up to
    ~0.1 ms late, which is compute time of the emulated block, not bubble)."""
    if seconds:
        start = time.perf_counter()
        time.sleep(seconds)
        clock[0] += time.perf_counter() - start


class Block(nn.Module):
    def __init__(self, width: int, ms: float):
        super().__init__()
        self.weight = nn.Parameter(torch.eye(width) + 0.01 * torch.randn(width, width))
        self.seconds = ms / 1000
        self.clock = [0.0]  # seconds this block spent "computing"

    def forward(self, x):
        x = _Sleep.apply(x, self.seconds, self.seconds, self.clock)  # forward; input-gradient path
        weight = _Sleep.apply(self.weight, 0.0, self.seconds, self.clock)  # weight-gradient path
        return x @ weight


class Offset(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(width))

    def forward(self, x):
        return x + self.bias


class Stack(nn.Module):
    def __init__(self, blocks: int, width: int, ms: float):
        super().__init__()
        torch.manual_seed(0)
        self.embed = Offset(width)  # as an embedding does, makes block 0 compute its input gradient
        self.blocks = nn.ModuleList(Block(width, ms) for _ in range(blocks))

    def forward(self, batch):
        x = self.embed(batch["x"])
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


class HandSplit(nn.Module):
    """Blocks [first, last) of a Stack (with its offset on stage 0): a stage written by hand."""

    def __init__(self, stack: Stack, first: int, last: int):
        super().__init__()
        self.embed = stack.embed if first == 0 else None
        self.blocks = nn.ModuleList(stack.blocks[first:last])

    def forward(self, x):
        x = self.embed(x) if self.embed is not None else x
        for block in self.blocks:
            x = block(x)
        return x


def _timed(run, blocks, steps: int) -> float:
    """The best bubble over `steps` runs of `run()` on this rank."""
    run()  # warm-up
    bubbles = []
    for _ in range(steps):
        for b in blocks:
            b.clock[0] = 0.0
        dist.barrier()
        start = time.perf_counter()
        run()
        wall = time.perf_counter() - start
        bubbles.append(1 - sum(b.clock[0] for b in blocks) / wall)
    return min(bubbles)


def _torch_native(args, schedule: str, m: int, virtual: int) -> float:
    """The bubble of torch's schedule running hand-split PipelineStages of the same Stack."""
    pp, rank = dist.get_world_size(), dist.get_rank()
    stack = Stack(args.blocks, 16, args.ms)
    num_stages = pp * virtual
    per = args.blocks // num_stages
    example = torch.randn(2, 16)
    stages = [PipelineStage(HandSplit(stack, s * per, (s + 1) * per), s, num_stages, torch.device("cpu"),
                            input_args=(example.clone().requires_grad_(s > 0),),
                            output_args=(example.clone().requires_grad_(),))
              for s in range(rank, num_stages, pp)]
    losses = []
    cls = sw.config.SCHEDULES[schedule].torch_class
    runner = cls(stages if virtual > 1 else stages[0], m, loss_fn=lambda out, _: out.pow(2).mean())
    x, target = torch.randn(2 * m, 16), torch.zeros(2 * m)

    def run():
        losses.clear()
        runner.step(x, target=target, losses=losses) if rank == 0 else runner.step(target=target, losses=losses)
        mean = torch.stack(losses).mean().reshape(1) if losses else torch.zeros(1)
        dist.broadcast(mean, src=pp - 1)

    mine = torch.tensor([_timed(run, [b for st in stages for b in st.submod.blocks], args.steps)])
    dist.all_reduce(mine)
    return float(mine) / pp


def _bench(args):
    pp = dist.get_world_size()
    rows = []
    for schedule in SCHEDULES:
        for m in (4, 8):
            batch = {"x": torch.randn(2 * m, 16)}
            pm = sw.parallelize(Stack(args.blocks, 16, args.ms), sw.ParallelConfig(pp=pp, microbatches=m, schedule=schedule),
                                sample=batch)
            blocks = [b for b in pm.module.blocks if b.weight is not None]
            pm.pipeline.stats = PipelineStats()
            mine = torch.tensor([_timed(lambda: pm.train_step(batch), blocks, args.steps)])
            dist.all_reduce(mine)
            peaks = [None] * pp
            dist.all_gather_object(peaks, pm.pipeline.stats.peak_alive)
            virtual = pm.pipeline.layout.virtual
            native = _torch_native(args, schedule, m, virtual)
            rows.append((schedule, pp, m, virtual, float(mine) / pp, native, (pp - 1) / (virtual * m + pp - 1),
                         {s: n for p in peaks for s, n in p.items()}))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ms", type=float, default=4.0, help="milliseconds per block for each of F, B-input, B-weight")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="measured steps (the best is kept)")
    args = parser.parse_args()
    print(f"pipeline schedules: {args.blocks} blocks, {args.ms} ms per block for forward, input-grad and weight-grad; "
          "bubble = 1 - compute time / step time, mean over ranks (best of steps)")
    print(f"{'schedule':<18} {'p':>2} {'m':>2} {'v':>2} {'bubble':>8} {'torch':>8} {'theory':>8}   "
          "peak microbatches alive per stage")
    for pp in (2, 4):
        for schedule, p, m, v, bubble, native, theory, peaks in sw.testing.run_on_ranks(_bench, pp, args, timeout=1800)[0]:
            note = "  (theory: interleaved 1F1B; zero-bubble aims lower)" if schedule == "zero-bubble" else ""
            alive = " ".join(str(peaks[s]) for s in sorted(peaks))
            print(f"{schedule:<18} {p:>2} {m:>2} {v:>2} {bubble:>8.3f} {native:>8.3f} {theory:>8.3f}   {alive}{note}")


if __name__ == "__main__":
    main()
