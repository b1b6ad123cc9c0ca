"""Float8 training (torchao) against bf16, both under shardwise and compiled, and bf16 compiled
against bf16 eager, same run.

    python bench/float8.py [--layers 4] [--hidden 2048] [--seq 2048] [--batch 4] [--rounds 5] [--steps 5]
    torchrun --nproc-per-node N bench/float8.py        (data parallel over N ranks)

Both models are one Hugging Face Llama (SwiGLU MLP of 11/4 x hidden, 16 heads, 8 KV heads,
vocab 32,000) trained with `param_dtype=torch.bfloat16` (float32 master weights, AdamW), every
decoder layer compiled (`pmodel.compile()`: float8's casts and scales fuse only under compile,
as torchtitan runs them). float8: torchao's `convert_to_float8_training` with its default
tensorwise dynamic scaling on every Linear but the output head. Where the device has float8
matmuls (CUDA compute capability >= 8.9) they are real (`torch._scaled_mm`); elsewhere torchao
emulates them, which checks the path runs but measures nothing a user would see (run it on a
GPU). A third model, bf16 left eager, gives compile's own speed-up. Printed: median step time,
tokens/s per rank, the speed-ups, and the share of the parameters that float8 multiplies.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
import transformers

import shardwise as sw
from common import timed_rounds
from llama import EndToEnd


def _ffn(args) -> int:
    """The MLP's width: 11/4 of hidden, a multiple of 16 (float8 matmuls want 16-aligned shapes)."""
    return args.hidden * 11 // 4 // 16 * 16


def _llama(args) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=args.hidden, intermediate_size=_ffn(args),
        num_attention_heads=16, num_key_value_heads=8, num_hidden_layers=args.layers,
        max_position_embeddings=args.seq, use_cache=False)
    return EndToEnd(transformers.LlamaForCausalLM(config))


def _float8_on_device() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def _model(args, float8: bool, compiled: bool = True) -> sw.ParallelModule:
    model = _llama(args)
    if float8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig(emulate=not _float8_on_device()),
                                   module_filter_fn=lambda module, name: "lm_head" not in name)
    pm = sw.parallelize(model, sw.ParallelConfig(param_dtype=torch.bfloat16))
    if compiled:
        pm.compile()
    return pm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4, help="samples per rank per step")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="steps per timed round")
    args = parser.parse_args()

    sw.init_distributed()
    models = {"bf16 eager": _model(args, float8=False, compiled=False), "bf16": _model(args, float8=False),
              "float8": _model(args, float8=True)}
    gen = torch.Generator().manual_seed(dist.get_rank())
    batches = []
    for _ in range(args.steps):
        batches.append({"input_ids": torch.randint(0, 32000, (args.batch, args.seq), generator=gen)})
    steps = {}
    for name, pm in models.items():
        optimizer = sw.build_optimizer(pm, torch.optim.AdamW, lr=1e-4)

        def step(batch, pm=pm, optimizer=optimizer):
            pm.train_step(batch)
            optimizer.step()
            optimizer.zero_grad()
        steps[name] = step
    for step in steps.values():  # compile
        step(batches[0])
    times = timed_rounds(steps, batches, args.rounds)

    params = sum(p.numel() for p in models["bf16 eager"].module.parameters())  # whole: only dp shards data
    # q and o are hidden x hidden, k and v half that (8 of 16 heads); gate, up and down hidden x ffn
    layer_matmuls = 3 * args.hidden * args.hidden + 3 * args.hidden * _ffn(args)
    share = args.layers * layer_matmuls / params
    device = models["bf16"].topology.device
    where = "real float8 matmuls" if _float8_on_device() else "EMULATED float8 (no float8 matmuls here: not a speed)"
    if dist.get_rank() == 0:
        print(f"float8 vs bf16: HF Llama {params / 1e6:.0f} M params ({args.layers} layers, hidden {args.hidden}), "
              f"batch {args.batch} x {args.seq} per rank, world {dist.get_world_size()} ({dist.get_backend()}) on "
              f"{device}, torch {torch.__version__}; {where}; decoder layers compiled but in 'bf16 eager'")
        print(f"the layers' Linear weights are {share * 100:.0f}% of the parameters (the head and embedding stay bf16)")
        median = {name: statistics.median(values) for name, values in times.items()}
        for name, values in times.items():
            print(f"{name:<10} {median[name] * 1e3:9.2f} ms/step  {args.batch * args.seq / median[name]:10.0f} tokens/s "
                  "  rounds: " + " ".join(f"{t * 1e3:.2f}" for t in values))
        print(f"float8 / bf16 speed-up (both compiled): {median['bf16'] / median['float8']:.3f}x; "
              f"bf16 compiled / eager: {median['bf16 eager'] / median['bf16']:.3f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
