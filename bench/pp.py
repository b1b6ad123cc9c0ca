"""Pipeline schedules: measured bubble fraction and live activations, beside the theory.

    python bench/pp.py [--ms 4] [--blocks 8] [--pp 2 4] [--microbatches 4 8] [--schedules ...]
    python bench/pp.py --timeline docs/pp4_interleaved_step.svg [--trace-dir DIR]   # the picture

The model is a stack of blocks whose compute is emulated by fixed sleeps: forward, input
gradient and weight gradient each take --ms milliseconds per block, on separate autograd
paths so a zero-bubble schedule can run them apart. A learned input offset stands for the
embedding, whose gradient makes the first block compute its input gradient as every other
block does: every stage has the same work, as the theory assumes. Sleeping keeps a 2-core machine from
turning p ranks into p compute-bound processes fighting for cores, so what is measured is
the schedule, not the machine. For each schedule, p and m: the bubble next to
(p-1)/(m+p-1) (interleaved, v stages per rank: (p-1)/(v*m+p-1)), and the peak number of
microbatches whose activations were alive at once on each stage (1F1B: at most p - stage).

The bubble is the fraction of the step a rank is not doing the model's work: 1 - (T1 / p) /
(step time), where T1 is one process running the same model on the same m microbatches
(forward and backward each), measured in the same run: a rank's share of the work is T1/p.
The model's own cost beyond its sleeps (its Python, the autograd engine, waking up after
each sleep) is work that one process pays too, so it is not counted as bubble. The
`sleep-only` columns give the older, stricter measure, 1 - (time in the sleeps) / (step
time), which counts that cost as bubble: one process scores `one` on it with no pipeline
at all, the floor of that column.

The `torch` columns are the reference: the same blocks split by hand into torch's own
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
from shardwise.parallel.pipeline.stages import PipelineStats

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


def _timed(run, blocks, steps: int) -> tuple[float, float]:
    """(the best step time, the best sleep-only bubble) over `steps` runs of `run()` on this rank."""
    run()  # warm-up
    walls, bubbles = [], []
    for _ in range(steps):
        for b in blocks:
            b.clock[0] = 0.0
        dist.barrier()
        start = time.perf_counter()
        run()
        walls.append(time.perf_counter() - start)
        bubbles.append(1 - sum(b.clock[0] for b in blocks) / walls[-1])
    return min(walls), min(bubbles)


def _mean_over_ranks(values: tuple[float, ...]) -> list[float]:
    total = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(total)
    return (total / dist.get_world_size()).tolist()


def _one_process(args, m: int) -> tuple[float, float]:
    """T1 and its sleep-only bubble: the whole Stack on one process (rank 0; the others wait),
    forward and backward of each of m microbatches, best of the steps; the same on every rank."""
    result = torch.zeros(2, dtype=torch.float64)
    if dist.get_rank() == 0:
        stack = Stack(args.blocks, 16, args.ms)
        x = torch.randn(2 * m, 16)

        def run():
            for chunk in x.chunk(m):
                stack({"x": chunk}).backward()
        best, sleep_only = float("inf"), 1.0
        run()
        for _ in range(args.steps):
            for b in stack.blocks:
                b.clock[0] = 0.0
            start = time.perf_counter()
            run()
            wall = time.perf_counter() - start
            best, sleep_only = min(best, wall), min(sleep_only, 1 - sum(b.clock[0] for b in stack.blocks) / wall)
        result = torch.tensor([best, sleep_only], dtype=torch.float64)
    dist.broadcast(result, src=0)
    return float(result[0]), float(result[1])


def _torch_native(args, schedule: str, m: int, virtual: int) -> list[float]:
    """Step time and sleep-only bubble (means over ranks) of torch's schedule running
    hand-split PipelineStages of the same Stack."""
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

    return _mean_over_ranks(_timed(run, [b for st in stages for b in st.submod.blocks], args.steps))


def _bench(args):
    pp = dist.get_world_size()
    rows = []
    for m in args.microbatches:
        one, one_sleep_only = _one_process(args, m)
        for schedule in args.schedules:
            batch = {"x": torch.randn(2 * m, 16, generator=torch.Generator().manual_seed(m))}  # same on every rank
            pm = sw.parallelize(Stack(args.blocks, 16, args.ms), sw.ParallelConfig(pp=pp, microbatches=m, schedule=schedule),
                                sample=batch)
            blocks = [b for b in pm.module.blocks if b.weight is not None]
            pm.pipeline.stats = PipelineStats()
            wall, sleep_only = _mean_over_ranks(_timed(lambda: pm.train_step(batch), blocks, args.steps))
            peaks = [None] * pp
            dist.all_gather_object(peaks, pm.pipeline.stats.peak_alive)
            virtual = pm.pipeline.layout.virtual
            native_wall, native_sleep_only = _torch_native(args, schedule, m, virtual)
            rows.append(dict(schedule=schedule, p=pp, m=m, v=virtual, bubble=1 - one / pp / wall,
                             torch=1 - one / pp / native_wall, theory=(pp - 1) / (virtual * m + pp - 1),
                             sleep_only=sleep_only, torch_sleep_only=native_sleep_only, one_sleep_only=one_sleep_only,
                             peaks={s: n for p in peaks for s, n in p.items()}))
    return rows


def _timeline(args) -> str | None:
    """One interleaved-1F1B step (pp = the world, m=8) drawn by pmodel.timeline."""
    m = 8
    batch = {"x": torch.randn(2 * m, 16, generator=torch.Generator().manual_seed(m))}
    pm = sw.parallelize(Stack(args.blocks, 16, args.ms),
                        sw.ParallelConfig(pp=dist.get_world_size(), microbatches=m, schedule="interleaved-1f1b"),
                        sample=batch)
    pm.train_step(batch)  # the first step captures the stages
    out = pm.timeline(batch, args.timeline, trace_dir=args.trace_dir)
    return None if out is None else str(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ms", type=float, default=4.0, help="milliseconds per block for each of F, B-input, B-weight")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="measured steps (the best is kept)")
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4], help="pipeline sizes (ranks)")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--schedules", nargs="+", default=SCHEDULES, choices=SCHEDULES)
    parser.add_argument("--timeline", help="only draw one pp=4 m=8 interleaved-1F1B step to this .svg (pmodel.timeline)")
    parser.add_argument("--trace-dir", help="with --timeline: each rank's Chrome trace (Perfetto) there too")
    args = parser.parse_args()
    if args.timeline:
        print(sw.testing.run_on_ranks(_timeline, 4, args, timeout=600)[0])
        return
    print(f"pipeline schedules: {args.blocks} blocks, {args.ms} ms per block for forward, input-grad and weight-grad; "
          "bubble = 1 - (one process's time / p) / step time, mean over ranks (best of steps)")
    print(f"{'schedule':<18} {'p':>2} {'m':>2} {'v':>2} {'bubble':>7} {'torch':>7} {'theory':>7}   "
          f"{'sleep-only: ours':>16} {'torch':>6} {'one':>6}   peak microbatches alive per stage")
    for pp in args.pp:
        for row in sw.testing.run_on_ranks(_bench, pp, args, timeout=1800)[0]:
            note = "  (theory: interleaved 1F1B; zero-bubble aims lower)" if row["schedule"] == "zero-bubble" else ""
            alive = " ".join(str(row["peaks"][s]) for s in sorted(row["peaks"]))
            print(f"{row['schedule']:<18} {row['p']:>2} {row['m']:>2} {row['v']:>2} {row['bubble']:>7.3f} "
                  f"{row['torch']:>7.3f} {row['theory']:>7.3f}   {row['sleep_only']:>16.3f} {row['torch_sleep_only']:>6.3f} "
                  f"{row['one_sleep_only']:>6.3f}   {alive}{note}")


if __name__ == "__main__":
    main()
