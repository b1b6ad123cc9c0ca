"""torch.compile on a parallelized model: shardwise eager, shardwise compiled, and torch's native
composition compiled the same way, same run, same ranks.

    python bench/compile.py [--ranks 2] [--layouts tp2,tp2-sp,zero3,dp] [--backend inductor]

Every implementation compiles each transformer block in place (`block.compile()`, torchtitan's
granularity). Native compositions: `parallelize_module` with the same column/row pairs for tp
(shardwise runs the same pairs at tp2, its zoo "gpt" plan at tp2-sp), `fully_shard` per block and on the root for ZeRO-3, DDP
for dp; tp2-sp has no native line (its native plan needs the embeddings' output
sequence-sharded, not written here). Printed per
layout: Dynamo's graphs and graph breaks while the compiled model warms up (its first two
steps), the median step time of each implementation, and the ratios compiled/eager and
shardwise/native (both compiled). On this CPU machine inductor's C++ kernels are what is
timed; the GPU numbers are the ones that matter for users and come from a lent GPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.distributed.fsdp import fully_shard

import shardwise as sw
from common import (bench_batches, bench_gpt, bench_parser, native_pairs, pairs_plan, print_times, timed_rounds,
                    training_step)


def _native(args, layout: str) -> tuple[torch.nn.Module, object] | None:
    """torch's own composition for `layout`; None for tp2-sp, whose native form needs the
    embeddings' output sequence-sharded (torchtitan's plan) and is not written here."""
    if layout == "tp2-sp":
        return None
    if layout == "tp2":
        model = native_pairs(args)
    elif layout == "zero3":
        model = bench_gpt(args)
        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
    else:
        model = torch.nn.parallel.DistributedDataParallel(bench_gpt(args))
    return model, lambda batch: model(batch).backward()


def _shardwise(args, layout: str):
    config = {"tp2": dict(tp=2), "tp2-sp": dict(tp=2, sequence_parallel=True), "zero3": dict(zero=3), "dp": {}}[layout]
    plan = pairs_plan() if layout == "tp2" else "gpt" if layout == "tp2-sp" else None  # tp2: native's very plan
    pm = sw.parallelize(bench_gpt(args), sw.ParallelConfig(**config), plan=plan)
    return pm, pm.train_step


def _blocks(model: torch.nn.Module):
    inner = model.module if isinstance(model, (sw.ParallelModule, torch.nn.parallel.DistributedDataParallel)) else model
    return inner.layers


def _warm(step, batches, model, backend: str) -> dict[str, int]:
    """Compile the blocks, run two steps, return the graphs and breaks Dynamo counted meanwhile."""
    for block in _blocks(model):
        block.compile(backend=backend)
    torch._dynamo.reset()  # count this model's graphs, not reuse of another's (same block code, guards passing)
    graphs, breaks = counters["stats"]["unique_graphs"], dict(counters["graph_break"])
    for batch in batches[:2]:
        step(batch)
    new_breaks = {k: v - breaks.get(k, 0) for k, v in counters["graph_break"].items() if v > breaks.get(k, 0)}
    return {"graphs": counters["stats"]["unique_graphs"] - graphs, "breaks": sum(new_breaks.values()),
            "break reasons": sorted({k.splitlines()[0] for k in new_breaks})}


def _bench(args, layout: str):
    batches = bench_batches(args, seed=100 + (dist.get_rank() if layout in ("zero3", "dp") else 0))
    models = {"shardwise eager": _shardwise(args, layout), "shardwise compiled": _shardwise(args, layout)}
    if _native(args, layout) is not None:
        models["native compiled"] = _native(args, layout)
    steps = {}
    for name, (model, forward_backward) in models.items():
        optimizer = sw.build_optimizer(model, torch.optim.AdamW, lr=1e-4) if isinstance(model, sw.ParallelModule) \
            else torch.optim.AdamW(model.parameters(), lr=1e-4)
        steps[name] = training_step(forward_backward, optimizer)
    dynamo = {name: _warm(steps[name], batches, models[name][0], args.backend) for name in models if "compiled" in name}
    return {"times": timed_rounds(steps, batches, args.rounds), "dynamo": dynamo}


def main() -> None:
    parser = bench_parser(__doc__, ranks=2, rounds=5, steps=4)
    parser.add_argument("--layouts", default="tp2,tp2-sp,zero3,dp")
    parser.add_argument("--backend", default="inductor")
    args = parser.parse_args()
    print(f"torch.compile per block ({args.backend}): GPT {args.layers} layers, d_model {args.d_model}, "
          f"batch {args.batch} x {args.seq}, {args.ranks} gloo ranks, AdamW, torch {torch.__version__}")
    for layout in args.layouts.split(","):
        res = sw.testing.run_on_ranks(_bench, args.ranks, args, layout, timeout=3600)[0]
        print(f"\n{layout}:")
        for name, found in res["dynamo"].items():
            print(f"  {name:<20} {found['graphs']} graphs, {found['breaks']} graph breaks in the first two steps"
                  + (f" ({'; '.join(found['break reasons'])[:200]})" if found["breaks"] else ""))
        rate = print_times(res["times"], args.batch)
        line = f"  compiled / eager (shardwise): {rate['shardwise compiled'] / rate['shardwise eager']:.3f}"
        if "native compiled" in rate:
            line += f"   shardwise / native, both compiled: {rate['shardwise compiled'] / rate['native compiled']:.3f} (aim >= 1.0)"
        print(line)


if __name__ == "__main__":
    main()
