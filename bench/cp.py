"""Context parallel: a long sequence split over cp ranks against one rank holding all of it.

    python bench/cp.py [--ranks 4] [--seq 4096] [--layers 2] [--d-model 256] [--rounds 3]

The same GPT trains on one sequence of `--seq` tokens per step, first on one rank, then with
cp = `--ranks`. Reported: the bytes one step's forward saves for backward on each rank
(measured by `sw.activation_memory`: storages autograd keeps) against 1/cp of one rank's;
the bytes the K/V all-gathers move per layer in forward, counted at the process group,
against the all-gather formula (cp-1)/cp * 2 * b * s * h_kv * bytes per element (h_kv =
d_model for this GPT: every head has its own K and V); and the median step time of each.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import shardwise as sw
from common import bench_gpt, bench_parser, print_times, timed_rounds, training_step
from shardwise.comm import CollectiveCounter


def _batches(args) -> list[dict]:
    gen = torch.Generator().manual_seed(100)
    out = []
    for _ in range(args.steps):
        tokens = torch.randint(0, 256, (args.batch, args.seq + 1), generator=gen)
        out.append({"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()})
    return out


def _bench(args, cp: int):
    batches = _batches(args)
    pm = sw.parallelize(bench_gpt(args), sw.ParallelConfig(cp=cp))
    opt = sw.build_optimizer(pm, torch.optim.AdamW, lr=1e-4)
    step = training_step(pm.train_step, opt)
    times = timed_rounds({f"cp={cp}": step}, batches, args.rounds)
    saved = sw.activation_memory(pm, batches[0])
    received = {}
    for name, run in (("forward", pm.infer_step), ("train step", step)):
        with CollectiveCounter(c10d=True) as counter:
            run(batches[0])
        # an all-gather's counted input is this rank's K or V, which each of the cp - 1 others receives
        received[name] = (counter.calls.get("all_gather", 0), counter.bytes.get("all_gather", 0) * (cp - 1))
    return {"times": times, "saved": saved.total, "received": received,
            "counted": pm.context_parallel.gathered_bytes if cp > 1 else 0, "rank": dist.get_rank()}


def main() -> None:
    parser = bench_parser(__doc__, ranks=4, rounds=3, steps=2)
    parser.set_defaults(seq=4096, batch=1, layers=2)
    args = parser.parse_args()
    cp = args.ranks
    one = sw.testing.run_on_ranks(_bench, 1, args, 1, timeout=3600)[0]
    many = sw.testing.run_on_ranks(_bench, cp, args, cp, timeout=3600)
    print(f"context parallel: GPT ({args.layers} layers, d_model {args.d_model}), one sequence of {args.seq} tokens "
          f"per step (batch {args.batch}), cp={cp} on {cp} gloo ranks vs one rank, AdamW")
    print_times({**one["times"], **many[0]["times"]}, args.batch)

    worst = max(r["saved"] for r in many)
    print(f"\nsaved for backward per step: one rank {one['saved'] / 2**20:.1f} MiB; cp={cp} ranks "
          + ", ".join(f"{r['saved'] / 2**20:.1f}" for r in many) + " MiB")
    print(f"  largest rank / one rank: {worst / one['saved']:.3f}   (1/cp = {1 / cp:.3f}; aim <= 0.3 at cp=4)")

    element = 4  # float32
    formula = (cp - 1) / cp * 2 * args.batch * args.seq * args.d_model * element
    calls, nbytes = many[0]["received"]["forward"]
    print(f"\nall-gather bytes received per rank per layer, forward (infer_step): {nbytes / args.layers / 2**20:.3f} "
          f"MiB in {calls} all-gathers ({calls - 2 * args.layers} of them the batch agreement's); formula "
          f"(cp-1)/cp * 2*b*s*h_kv*4 = {formula / 2**20:.3f} MiB, ratio {nbytes / args.layers / formula:.3f}")
    calls, nbytes = many[0]["received"]["train step"]
    print(f"  a train step: {nbytes / args.layers / 2**20:.3f} MiB per layer in {calls} all-gathers (backward gathers "
          f"K/V again to recompute attention instead of keeping them: {nbytes / args.layers / formula:.2f} x the "
          f"forward formula), plus as many bytes reduce-scattered (K/V gradients)")


if __name__ == "__main__":
    main()
