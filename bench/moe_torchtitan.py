"""One mixture-of-experts layer at ep = ranks: shardwise on transformers' Mixtral block against
torchtitan's own MoE layer, same sizes, same tokens, on gloo ranks.

    pip install torchtitan triton   # torchtitan imports triton; on CPU its kernels are not used
    python bench/moe_torchtitan.py [--ranks 4] [--d-model 256] [--experts 8] [--seq 128] [--batch 4] [--rounds 3]

torchtitan's expert parallelism runs only on its own MoE module (router, `GroupedExperts` computing
with `torch._grouped_mm`, `AllToAllTokenDispatcher`), so the comparison is per layer: its MoE with
E/ep experts per rank and the ep mesh wired into its dispatcher, against shardwise's ep on
`MixtralSparseMoeBlock` (transformers' experts computing expert by expert). Both top-2 of
`--experts` softmax routing, hidden `--d-model`, expert width 2 x hidden, `--batch` x `--seq` tokens
per rank, fp32 parameters. torchtitan's experts always multiply in bf16, which a CPU without bf16
matrix units runs far slower than fp32, so it is also timed with its `_grouped_mm` seam (the one
its float8 converters override) multiplying in fp32: that variant isolates routing and dispatch.
A step is a forward, the backward of the mean square of the output and an AdamW step;
shardwise's also all-reduces the router's gradient over the ranks (torchtitan's, used alone,
does not). Reported: median step time and the ratios.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import transformers
from torch import nn

import shardwise as sw
from common import bench_parser, print_times, timed_rounds, training_step


class SquareLoss(nn.Module):
    """A layer's output reduced to a loss: the mean square (what both implementations run)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x).pow(2).mean()


def mixtral_block(args) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.MixtralConfig(hidden_size=args.d_model, intermediate_size=2 * args.d_model,
                                        num_local_experts=args.experts, num_experts_per_tok=2)
    block = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(config)
    for p in block.parameters():
        nn.init.normal_(p, std=0.02)
    return block


def _fp32_grouped_mm(self, *, A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(A.float(), B_t.float(), offs=offs).to(A.dtype)


def torchtitan_moe(args, ep: int, fp32: bool) -> nn.Module:
    """torchtitan's MoE with this rank's E/ep experts, its dispatcher on an ep mesh of every rank
    (`fp32`: its grouped matmuls in fp32 instead of bf16)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed.utils import set_spmd_backend
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts, TokenChoiceTopKRouter
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    set_spmd_backend("dtensor")  # plain process groups (its default, spmd_types, needs its trainer's meshes)
    experts = GroupedExperts.Config(dim=args.d_model, hidden_dim=2 * args.d_model, num_experts=args.experts // ep)
    config = MoE.Config(
        num_experts=args.experts, load_balance_coeff=None,
        routed_experts=RoutedExperts.Config(
            inner_experts=experts, token_dispatcher=AllToAllTokenDispatcher.Config(num_experts=args.experts, top_k=2)),
        router=TokenChoiceTopKRouter.Config(num_experts=args.experts, top_k=2, score_func="softmax",
                                            gate=Linear.Config(in_features=args.d_model, out_features=args.experts)))
    torch.manual_seed(0)
    moe = config.build()
    for p in moe.parameters():
        nn.init.normal_(p, std=0.02)
    mesh = init_device_mesh(torch.device("cpu").type, (ep,), mesh_dim_names=("ep",))
    moe.routed_experts.token_dispatcher.wire_meshes(ep_mesh=mesh["ep"])
    if fp32:
        experts = moe.routed_experts.inner_experts
        experts._grouped_mm = _fp32_grouped_mm.__get__(experts)
    return moe


def _bench(args):
    rank, ep = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(100 + rank)
    data = [torch.randn(args.batch, args.seq, args.d_model, generator=gen) for _ in range(args.steps)]
    pm = sw.parallelize(SquareLoss(mixtral_block(args)), sw.ParallelConfig(ep=ep))
    opt = sw.build_optimizer(pm, torch.optim.AdamW, lr=1e-4)
    steps = {f"shardwise ep={ep}": training_step(pm.train_step, opt)}
    for name, fp32 in ((f"torchtitan ep={ep}", False), (f"torchtitan ep={ep} fp32", True)):
        theirs = SquareLoss(torchtitan_moe(args, ep, fp32))
        steps[name] = training_step(lambda x, m=theirs: m(x).backward(),
                                    torch.optim.AdamW(theirs.parameters(), lr=1e-4))
    return timed_rounds(steps, data, args.rounds)


def main() -> None:
    parser = bench_parser(__doc__, ranks=4, rounds=3, steps=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.set_defaults(seq=128, batch=4, d_model=256)
    args = parser.parse_args()
    import importlib.util

    if importlib.util.find_spec("torchtitan") is None:
        raise SystemExit("torchtitan is not installed: pip install torchtitan triton")
    times = sw.testing.run_on_ranks(_bench, args.ranks, args, timeout=3600)[0]
    print(f"one MoE layer: hidden {args.d_model}, {args.experts} experts, top-2, {args.batch} x {args.seq} tokens per "
          f"rank, ep={args.ranks} on gloo, fp32")
    print_times(times, args.batch * args.ranks)
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    ours = med[f"shardwise ep={args.ranks}"]
    print(f"step time ratio shardwise / torchtitan: {ours / med[f'torchtitan ep={args.ranks}']:.3f} (its bf16 "
          f"experts), {ours / med[f'torchtitan ep={args.ranks} fp32']:.3f} (its experts in fp32)")


if __name__ == "__main__":
    main()
