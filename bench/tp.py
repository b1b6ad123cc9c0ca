"""Tensor parallel: shardwise vs torch's native `parallelize_module`, same run, same ranks.

    python bench/tp.py [--ranks 2] [--layers 4] [--d-model 256] [--rounds 7]

Both parallelize identical GPTs with the same Megatron layout: q, k, v and fc1
ColwiseParallel, o_proj and fc2 RowwiseParallel (embedding and head replicated, because
native `parallelize_module` unties tied weights). Rounds alternate between them; each step
is forward, backward and an AdamW step. Then one step of each is counted, collective by
collective (functional collectives, DTensor's included), and the per-layer count and bytes
are printed against Megatron's formula: per column->row pair one all-reduce of b*s*h
elements forward and one backward. shardwise's full zoo "gpt" plan (vocab-parallel
embedding, loss-parallel head) is timed alongside.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import shardwise as sw
from common import (bench_batches, bench_gpt, bench_parser, native_pairs, pairs_plan, print_times, timed_rounds,
                    training_step)
from shardwise.comm import CollectiveCounter



def _bench(args):
    batches = bench_batches(args, seed=100)
    tp = dist.get_world_size()
    ours = sw.parallelize(bench_gpt(args), sw.ParallelConfig(tp=tp), plan=pairs_plan())
    zoo = sw.parallelize(bench_gpt(args), sw.ParallelConfig(tp=tp), plan="gpt")
    native = native_pairs(args)
    optimizers = {m: torch.optim.AdamW(m.parameters(), lr=1e-4) for m in (ours, zoo, native)}

    steps = {
        "shardwise (pairs)": training_step(ours.train_step, optimizers[ours]),
        "torch native TP": training_step(lambda batch: native(batch).backward(), optimizers[native]),
        "shardwise (zoo gpt)": training_step(zoo.train_step, optimizers[zoo]),
    }
    times = timed_rounds(steps, batches, args.rounds)
    counts = {}
    for name, step in steps.items():
        with CollectiveCounter() as counter:
            step(batches[0])
        counts[name] = (dict(counter.calls), dict(counter.bytes))
    return {"times": times, "counts": counts, "tp": tp, "params": sum(p.numel() for p in bench_gpt(args).parameters())}


def main() -> None:
    parser = bench_parser(__doc__, ranks=2, rounds=7, steps=4)
    args = parser.parse_args()

    res = sw.testing.run_on_ranks(_bench, args.ranks, args, timeout=3600)[0]
    print(f"tensor parallel: GPT {res['params'] / 1e6:.2f} M params ({args.layers} layers, d_model {args.d_model}), "
          f"tp={res['tp']} on {args.ranks} gloo ranks, batch {args.batch} x {args.seq} tokens, AdamW")
    rate = print_times(res["times"], args.batch)
    ratio = rate["shardwise (pairs)"] / rate["torch native TP"]
    print(f"ratio shardwise / native step rate, same plan: {ratio:.3f}  (aim >= 1.0)")

    activation = args.batch * args.seq * args.d_model * 4  # b*s*h fp32 bytes
    print(f"\ncollectives per step per layer (Megatron: 2 pairs x (1 all-reduce fwd + 1 bwd) = 4 all-reduces of "
          f"b*s*h = {activation / 1024:.0f} KiB each, {4 * activation / 1024:.0f} KiB):")
    for name, (calls, nbytes) in res["counts"].items():
        layer_calls = {op: n / args.layers for op, n in calls.items()}
        layer_bytes = sum(nbytes.values()) / args.layers
        shown = ", ".join(f"{n:g} {op}" for op, n in sorted(layer_calls.items()))
        note = " (includes embedding/head collectives, spread over layers)" if "zoo" in name else ""
        print(f"  {name:<22} {shown:<40} {layer_bytes / 1024:8.0f} KiB{note}")


if __name__ == "__main__":
    main()
