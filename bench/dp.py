"""Data parallel throughput: shardwise vs torch DistributedDataParallel, same run, same ranks.

    python bench/dp.py [--ranks 4] [--layers 4] [--d-model 256] [--rounds 5] [--steps 5]

Both wrap identical GPTs in the same processes; rounds alternate between them so both see
the same machine load, and the median round is reported. Each step is forward, backward,
gradient averaging and an AdamW step. Also prints the bytes each all-reduces per step next
to the parameter bytes (the payload a data-parallel step must reduce at minimum) and the
ring all-reduce traffic per rank, 2(n-1)/n x payload.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

import shardwise as sw
from common import bench_batches, bench_parser, bench_gpt, print_times, timed_rounds, training_step



def _bench(args):
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = bench_batches(args, seed=100 + rank)

    pm = sw.parallelize(bench_gpt(args), sw.ParallelConfig(bucket_mb=args.bucket_mb))
    sw_opt = sw.build_optimizer(pm, torch.optim.AdamW, lr=1e-4)
    # the same with the per-step agreement off after the first step: what the safety costs
    unchecked = sw.parallelize(bench_gpt(args), sw.ParallelConfig(bucket_mb=args.bucket_mb, check_every=10 ** 9))
    unchecked_opt = sw.build_optimizer(unchecked, torch.optim.AdamW, lr=1e-4)
    ddp = torch.nn.parallel.DistributedDataParallel(bench_gpt(args), bucket_cap_mb=args.bucket_mb)
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)

    sw_step = training_step(pm.train_step, sw_opt)
    ddp_step = training_step(lambda batch: ddp(batch).backward(), ddp_opt)

    unchecked_step = training_step(unchecked.train_step, unchecked_opt)
    times = timed_rounds({"shardwise": sw_step, "torch DDP": ddp_step, "shardwise, checks off": unchecked_step},
                         batches, args.rounds)

    pm.gradients.stats.reset()
    sw_step(batches[0])
    sw_bytes = dict(pm.gradients.stats.bytes)
    sw_calls = pm.gradients.stats.calls["all_reduce"]

    counted = []  # DDP's bytes, from an untimed instance with a counting comm hook

    def counting_hook(state, bucket):
        counted.append(bucket.buffer().numel() * bucket.buffer().element_size())
        return allreduce_hook(state, bucket)

    probe = torch.nn.parallel.DistributedDataParallel(bench_gpt(args), bucket_cap_mb=args.bucket_mb)
    probe.register_comm_hook(None, counting_hook)
    for batch in batches[:2]:  # DDP rebuilds its buckets after the first iteration; count the second
        counted.clear()
        probe(batch).backward()

    param_bytes = sum(p.numel() * p.element_size() for p in pm.module.parameters())
    return {
        "times": times,
        "sw_bytes": sw_bytes["all_reduce"],
        "sw_calls": sw_calls,
        "ddp_bytes": sum(counted),
        "ddp_buckets": len(counted),
        "param_bytes": param_bytes,
        "params": sum(p.numel() for p in pm.module.parameters()),
        "world": world,
    }


def main() -> None:
    parser = bench_parser(__doc__, ranks=4, rounds=15, steps=5)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    args = parser.parse_args()

    res = sw.testing.run_on_ranks(_bench, args.ranks, args, timeout=3600)[0]
    n = res["world"]
    samples = args.batch * n
    print(f"data parallel: GPT {res['params'] / 1e6:.2f} M params ({args.layers} layers, d_model {args.d_model}), "
          f"{n} gloo ranks, {args.batch} samples/rank of {args.seq} tokens, AdamW, bucket {args.bucket_mb} MiB")
    rate = print_times(res["times"], samples)
    print(f"ratio shardwise / DDP samples/s: {rate['shardwise'] / rate['torch DDP']:.3f}  (aim >= 1.0)")
    print(f"ratio shardwise default / checks off (check_every=10**9) samples/s: "
          f"{rate['shardwise'] / rate['shardwise, checks off']:.3f}  (the per-step agreement's cost; aim >= 0.98)")
    mib = 1 << 20
    ring = 2 * (n - 1) / n
    print(f"all-reduced per step: shardwise {res['sw_bytes'] / mib:.3f} MiB in {res['sw_calls']} collective(s) "
          f"(gradients + the replica summary: unused mask, loss); DDP {res['ddp_bytes'] / mib:.3f} MiB in {res['ddp_buckets']} collective(s)")
    print(f"parameter bytes {res['param_bytes'] / mib:.3f} MiB (theoretical minimum payload); shardwise/params = "
          f"{res['sw_bytes'] / res['param_bytes']:.4f}, DDP/params = {res['ddp_bytes'] / res['param_bytes']:.4f}")
    print(f"ring all-reduce sends 2(n-1)/n x payload per rank: shardwise {ring * res['sw_bytes'] / mib:.3f} MiB, "
          f"minimum {ring * res['param_bytes'] / mib:.3f} MiB")


if __name__ == "__main__":
    main()
