"""The planner's memory against torchtitan's own training step, as its published Llama 3 8B runs
took it (bench/published_runs.py's torchtitan rows), measured on CPU gloo ranks.

    git clone https://github.com/pytorch/torchtitan /tmp/torchtitan && git -C /tmp/torchtitan checkout 9dec370
    python bench/planner_torchtitan.py --torchtitan /tmp/torchtitan [--ranks 2] [--compile] [--backend nccl]

torchtitan publishes memory as the caching allocator's reserved peak, which a CPU cannot show.
What the allocator hands out can be measured anywhere, and this measures it on torchtitan's
own code at the benchmark's commit (its imports need what its requirements.txt lists; an
installed torchtitan does not shadow the checkout): its Llama (float32 RMSNorm and rotary),
its op-level selective AC, FSDP2 with bf16 parameters and float32 reduction (its apply_fsdp),
`--compile`: its per-block torch.compile, and its step (the eager cross-entropy on float32
logits, `del pred`, backward, foreach AdamW, zero_grad). The model keeps the 8B's proportions
at 1/16 of its width: vocabulary / hidden, ffn / hidden, 4 query heads a KV head, 32 layers.
On CPU, SDPA runs `_scaled_dot_product_flash_attention_for_cpu`, which the policy's save list
(CUDA's attention ops) does not name; it is added, so the CPU run keeps what the CUDA run keeps.

Printed per rank: the model states at a step's start (counted tensor by tensor), the most the
step adds at any moment (bench/planner.py's allocation peak, from the profiler's allocation
events), their sum, against the planner under the "fsdp2" executor (gradients freed between
steps) and under shardwise's (the same at ZeRO-3, whose shards zero_grad frees too; its ZeRO-0/1
buckets live between steps).
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import shardwise as sw
from planner import _allocation_peak
from shardwise.planner import Cluster
from shardwise.planner.model import llama_like
from shardwise.topology import backend_device

LAYERS, HEADS, KV_HEADS, VOCAB_PER_HIDDEN = 32, 8, 2, 32


def load_torchtitan(root: str):
    """torchtitan's `parallelize_llama` module and `Transformer` from the checkout at `root`
    (at 9dec370 `torchtitan` has no __init__.py, so an installed copy would win an import)."""
    package = Path(root) / "torchtitan"
    if not (package / "parallelisms" / "parallelize_llama.py").is_file():
        raise SystemExit(f"--torchtitan {root}: no torchtitan/parallelisms/parallelize_llama.py there; check out "
                         "torchtitan at 9dec370 (see this file's docstring)")
    spec = importlib.machinery.ModuleSpec("torchtitan", None, is_package=True)
    spec.submodule_search_locations = [str(package)]
    sys.modules["torchtitan"] = importlib.util.module_from_spec(spec)
    importlib.import_module("torchtitan.parallelisms")  # its __init__ imports parallelize_llama
    from torchtitan.models.llama.model import ModelArgs, Transformer
    return sys.modules["torchtitan.parallelisms.parallelize_llama"], ModelArgs, Transformer


class SelectiveOp:
    """torchtitan's activation-checkpoint config as its train_configs/llama3_8b.toml sets it."""
    mode = "selective"
    selective_ac_option = "op"


def measure(args) -> tuple[int, int, int, int]:
    """On this rank: (model-state bytes at a step's start, the most a step adds, the MLP's
    width, the model's parameter count)."""
    parallelize, ModelArgs, Transformer = load_torchtitan(args.torchtitan)
    parallelize._save_list.add(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)
    torch.manual_seed(0)
    vocab = VOCAB_PER_HIDDEN * args.dim
    model = Transformer(ModelArgs(dim=args.dim, n_layers=LAYERS, n_heads=HEADS, n_kv_heads=KV_HEADS, vocab_size=vocab,
                                  multiple_of=64, ffn_dim_multiplier=1.3, max_seq_len=args.seq, rope_theta=500000))
    model.init_weights()
    count = sum(p.numel() for p in model.parameters())
    device = backend_device()
    model.to(device)
    parallelize.apply_ac(model, SelectiveOp)
    if args.compile:
        parallelize.apply_compile(model)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    parallelize.apply_fsdp(model, mesh, torch.bfloat16, torch.float32, pp_enabled=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)  # its build_optimizers' default
    generator = torch.Generator().manual_seed(dist.get_rank())
    tokens, labels = (torch.randint(0, vocab, (args.batch, args.seq), generator=generator).to(device) for _ in range(2))

    def step():
        pred = model(tokens)
        loss = torch.nn.functional.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))
        del pred
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(2):  # the optimizer state exists
        step()
    held = [*model.parameters(), *model.buffers(), *(t for s in optimizer.state.values() for t in s.values())]
    states = sum(local.numel() * local.element_size() for t in held if torch.is_tensor(t)
                 for local in [t.to_local() if isinstance(t, DTensor) else t])
    ffn = next(m.w1.weight.shape[0] for m in model.modules() if hasattr(m, "w1"))
    return states, _allocation_peak(step, device), ffn, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--torchtitan", required=True, help="a torchtitan checkout at 9dec370")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--dim", type=int, default=256, help="hidden size (the 8B's is 4096)")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank (the published runs' local batch)")
    parser.add_argument("--compile", action="store_true", help="compile each block, as the 'compiled' rows")
    parser.add_argument("--backend", default="gloo", help="nccl: one GPU a rank")
    args = parser.parse_args()
    load_torchtitan(args.torchtitan)  # a wrong path fails here, before any rank starts
    measured = sw.testing.run_on_ranks(measure, args.ranks, args, backend=args.backend, timeout=1800)
    _, _, ffn, count = measured[0]
    spec = llama_like("torchtitan-llama", LAYERS, args.dim, HEADS, KV_HEADS, ffn, VOCAB_PER_HIDDEN * args.dim)
    if spec.params != count:
        raise SystemExit(f"the planner's spec counts {spec.params} parameters, the model has {count}")
    config = sw.ParallelConfig(dp=args.ranks, zero=3, recompute="selective-alternate", param_dtype=torch.bfloat16,
                               reduce_dtype=torch.float32, bucket_mb=4096.0)  # FSDP2: a block's gradient at once
    mib = 2 ** 20
    print(f"torchtitan 9dec370 Llama, {count / 1e6:.1f}M parameters (dim {args.dim}, ffn {ffn}, {LAYERS} layers), "
          f"{args.ranks} ranks, {args.batch} x {args.seq} tokens a rank, {'compiled' if args.compile else 'eager'}")
    peak = max(states + added for states, added, _, _ in measured)
    for rank, (states, added, _, _) in enumerate(measured):
        print(f"  rank {rank}: states {states / mib:8.2f} MiB + the step's most {added / mib:8.2f} MiB = "
              f"{(states + added) / mib:8.2f} MiB")
    for executor in ("fsdp2", "shardwise"):
        predicted = sw.plan.evaluate(spec, Cluster(args.ranks, device="h100", executor=executor), config,
                                     seq_len=args.seq, global_batch=args.batch * args.ranks,
                                     optimizer="foreach").memory
        print(f"  planner, executor={executor!r}: {predicted / mib:8.2f} MiB ({predicted / peak - 1:+.2%})")


if __name__ == "__main__":
    main()
