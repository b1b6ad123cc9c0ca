"""Expert parallelism: a Hugging Face Mixtral with its experts split over ep ranks against the
same model with every expert on every rank.

    python bench/moe.py [--ranks 4] [--layers 4] [--d-model 256] [--experts 8] [--seq 128] [--batch 4] [--rounds 3]

Three implementations train the same model on the same batches (`--batch` sequences per rank),
AdamW, on `--ranks` gloo ranks: shardwise with ep = ranks, shardwise with the experts replicated
(ep = 1), and torch's DistributedDataParallel (experts replicated). torch has no expert-parallel
style for transformers' modules and torchtitan's runs only on its own MoE model, so DDP is the
native reference here. Reported: parameter bytes per rank (the experts' and the rest), the
bytes the all-to-alls send to other ranks per step against the formula for uniform routing
(tokens x top-k x hidden x 4 bytes x (ep-1)/ep, out and back, forward and backward, per layer),
the per-expert token load of the last step, and the median step time of each.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import transformers
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import shardwise as sw
from common import bench_parser, print_times, timed_rounds, training_step
from shardwise.tensors import local


class CausalLM(nn.Module):
    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, batch):
        return self.lm(input_ids=batch["input_ids"], labels=batch["labels"]).loss


def make_model(args) -> CausalLM:
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=1024, hidden_size=args.d_model, intermediate_size=2 * args.d_model, num_hidden_layers=args.layers,
        num_attention_heads=8, num_key_value_heads=4, num_local_experts=args.experts, num_experts_per_tok=2,
        max_position_embeddings=args.seq)
    return CausalLM(transformers.MixtralForCausalLM(config))


def batches(args, rank: int) -> list[dict]:
    gen = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(args.steps):
        tokens = torch.randint(0, 1024, (args.batch, args.seq), generator=gen)
        out.append({"input_ids": tokens, "labels": tokens.clone()})
    return out


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _bench(args):
    rank = dist.get_rank()
    data = batches(args, rank)
    steps, held = {}, {}
    for ep in (args.ranks, 1):
        pm = sw.parallelize(make_model(args), sw.ParallelConfig(ep=ep))
        opt = sw.build_optimizer(pm, torch.optim.AdamW, lr=1e-4)
        steps[f"shardwise ep={ep}"] = training_step(pm.train_step, opt)
        experts = {id(p) for n, p in pm.module.named_parameters() if ".experts." in n}
        params = list(pm.module.parameters())
        held[ep] = (_bytes(local(p) for p in params if id(p) in experts),
                    _bytes(local(p) for p in params if id(p) not in experts))
        if ep > 1:
            sharded = pm
    model = make_model(args)
    ddp = DistributedDataParallel(model)
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    steps["torch DDP"] = training_step(lambda b: ddp(b).backward(), ddp_opt)
    times = timed_rounds(steps, data, args.rounds)
    sharded.train_step(data[0])
    loads = {path: t.tolist() for path, t in sharded.expert_parallel.tokens_per_expert.items()}
    return {"times": times, "held": held, "sent": sharded.expert_parallel.bytes_sent, "loads": loads, "rank": rank}


def main() -> None:
    parser = bench_parser(__doc__, ranks=4, rounds=3, steps=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.set_defaults(seq=128, batch=4, layers=4, d_model=256)
    args = parser.parse_args()
    results = sw.testing.run_on_ranks(_bench, args.ranks, args, timeout=3600)
    ep = args.ranks
    print(f"expert parallel: HF Mixtral ({args.layers} layers, hidden {args.d_model}, {args.experts} experts, top-2), "
          f"{args.batch} x {args.seq} tokens per rank, {ep} gloo ranks, AdamW")
    print_times(results[0]["times"], args.batch * args.ranks)
    (experts_ep, rest_ep), (experts_all, rest_all) = results[0]["held"][ep], results[0]["held"][1]
    print(f"parameters per rank: experts {experts_ep / 2**20:.2f} MiB at ep={ep} vs {experts_all / 2**20:.2f} MiB "
          f"replicated ({experts_ep / experts_all:.3f}x; 1/ep = {1 / ep:.3f}), the rest {rest_ep / 2**20:.2f} MiB "
          f"({rest_all / 2**20:.2f} MiB replicated)")
    sent = sum(r["sent"] for r in results)  # forward only; the backward sends as many
    tokens = args.ranks * args.batch * args.seq
    formula = tokens * 2 * args.d_model * 4 * (ep - 1) / ep * 2 * args.layers
    print(f"all-to-all bytes sent to other ranks, all ranks, one forward: {sent / 2**20:.2f} MiB; uniform routing "
          f"formula tokens x top-k x hidden x 4 B x (ep-1)/ep x 2 (out, back) x layers = {formula / 2**20:.2f} MiB "
          f"({sent / formula:.3f}x); the backward moves the same again")
    for path, load in list(results[0]["loads"].items())[:2]:
        print(f"token slots per expert on rank 0, {path}: {load}")
    med = {k: sorted(v)[len(v) // 2] for k, v in results[0]["times"].items()}
    print(f"step time ratio shardwise ep={ep} / torch DDP (replicated): {med[f'shardwise ep={ep}'] / med['torch DDP']:.3f}; "
          f"shardwise ep={ep} / ep=1: {med[f'shardwise ep={ep}'] / med['shardwise ep=1']:.3f}")


if __name__ == "__main__":
    main()
