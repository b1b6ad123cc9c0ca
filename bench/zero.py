"""ZeRO: shardwise zero=3 vs PyTorch FSDP2 throughput, and collective volume per ZeRO stage.

    python bench/zero.py [--ranks 4] [--layers 4] [--d-model 256] [--rounds 5] [--microbatches 1]

Both shard the same GPT over the same ranks (FSDP2: `fully_shard` on every block and on the
root); rounds alternate between them. With --microbatches m each step accumulates m slices
(FSDP2 reduce-scatters after each backward, its default; shardwise reduces each into its shards).
Then one step of each shardwise ZeRO stage is counted: elements moved by collectives per step
in units of the parameter count Psi, next to the ZeRO paper's volumes: 2 Psi for stages 1 and 2
(reduce-scatter + all-gather, the same as an all-reduce), 3 Psi for stage 3 (one more
all-gather, in backward); over m microbatches stage 2 reduce-scatters m times ((m + 1) Psi) and
stage 3 gathers and reduce-scatters each microbatch (3m Psi).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import shardwise as sw
from common import bench_batches, bench_parser, bench_gpt, print_times, timed_rounds, training_step



def _bench(args):
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = bench_batches(args, seed=100 + rank)

    m = args.microbatches
    ours = sw.parallelize(bench_gpt(args), sw.ParallelConfig(zero=3, microbatches=m))
    ours_opt = sw.build_optimizer(ours, torch.optim.AdamW, lr=1e-4)
    fsdp = bench_gpt(args)
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,))
    for layer in fsdp.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    fsdp_opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-4)

    ours_step = training_step(ours.train_step, ours_opt)
    def fsdp_forward_backward(batch):
        for part in batch.chunk(m):
            (fsdp(part) / m).backward()

    fsdp_step = training_step(fsdp_forward_backward, fsdp_opt)

    times = timed_rounds({"shardwise zero=3": ours_step, "torch FSDP2": fsdp_step}, batches, args.rounds)

    psi = sum(p.numel() for p in bench_gpt(args).parameters())
    volumes = {}
    for zero in (0, 1, 2, 3):
        pm = sw.parallelize(bench_gpt(args), sw.ParallelConfig(zero=zero, microbatches=m))
        opt = sw.build_optimizer(pm, torch.optim.AdamW, lr=1e-4)
        pm.train_step(batches[0])  # the first step learns the unit order (for prefetch)
        opt.step()
        opt.zero_grad()
        pm.gradients.stats.reset()
        pm.train_step(batches[0])
        opt.step()
        opt.zero_grad()
        stats = pm.gradients.stats
        elements = {op: n // 4 for op, n in stats.bytes.items()}  # fp32
        volumes[zero] = (dict(stats.calls), elements, pm.memory())
    return {"times": times, "volumes": volumes, "psi": psi, "world": world}


def main() -> None:
    parser = bench_parser(__doc__, ranks=4, rounds=15, steps=4)
    parser.add_argument("--microbatches", type=int, default=1, help="slices each step accumulates")
    args = parser.parse_args()
    m = args.microbatches

    res = sw.testing.run_on_ranks(_bench, args.ranks, args, timeout=3600)[0]
    psi, n = res["psi"], res["world"]
    print(f"ZeRO: GPT {psi / 1e6:.2f} M params ({args.layers} layers, d_model {args.d_model}), {n} gloo ranks, "
          f"{args.batch} samples/rank of {args.seq} tokens in {m} microbatch(es), AdamW fp32")
    rate = print_times(res["times"], args.batch * n)
    print(f"ratio shardwise zero=3 / FSDP2 samples/s: {rate['shardwise zero=3'] / rate['torch FSDP2']:.3f}  (aim >= 1.0)")
    print(f"\n{'stage':<6} {'collectives per step':<70} {'elements / Psi':>14} {'ZeRO volume':>12}   "
          f"per-rank MiB between steps: params / grads / optimizer")
    theory = {0: "2 Psi (ring)", 1: "2 Psi", 2: f"{m + 1} Psi", 3: f"{3 * m} Psi"}
    for zero, (calls, elements, memory) in res["volumes"].items():
        moved = sum(e for op, e in elements.items() if op != "broadcast")
        shown = ", ".join(f"{calls[op]} {op} ({elements[op] / psi:.3f} Psi)" for op in sorted(elements) if op != "broadcast")
        mem = " / ".join(f"{memory[k] / 2**20:.2f}" for k in ("parameters", "gradients", "optimizer"))
        note = "  (all-reduce: payload Psi, ring traffic 2 Psi)" if zero == 0 else ""
        print(f"{zero:<6} {shown:<70} {moved / psi:>14.3f} {theory[zero]:>12}   {mem}{note}")


if __name__ == "__main__":
    main()
