"""Fine-tune a Hugging Face causal LM with shardwise: a recipe to copy.

    torchrun --nproc-per-node 4 examples/finetune_hf.py --model path/to/hf_dir --data train.txt \
        --tp 2 --out runs/ft --steps 1000
    torchrun --nproc-per-node 4 examples/finetune_hf.py --layout auto --out runs/ft      # the planner picks
    python examples/finetune_hf.py --tiny --out runs/tiny --steps 20                      # CPU, a minute

It loads a `save_pretrained` directory into the layout you choose (each rank reads only its
shards), trains with a token-weighted loss (padding does not dilute it), AdamW with linear
warmup and cosine decay, global gradient clipping, writes an atomic checkpoint every
`--save-every` steps and resumes from the latest one when started again with the same --out,
logs metrics (loss, tokens/s, MFU, memory) to TensorBoard, a JSON-lines file and the console,
and ends by exporting the model as a `from_pretrained`-ready directory (`--out/final`).
`--tiny` builds a small Llama with a byte-level vocabulary and saves it first, so the recipe
runs anywhere without a download. On GPUs the same command runs unchanged (NCCL).
"""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

import shardwise as sw
from shardwise.models import CausalLM, tiny_corpus


class TokenWeightedLM(CausalLM):
    """The LM's loss (a mean over its labelled tokens) and how many tokens it averaged:
    train_step(reduce="tokens") then weights each microbatch and replica by its count."""

    def forward(self, batch):
        return super().forward(batch), (batch["labels"] != -100).sum()


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a save_pretrained directory (with --tiny: where to write the tiny one)")
    parser.add_argument("--tiny", action="store_true", help="build a small byte-level Llama and fine-tune it")
    parser.add_argument("--data", help="a UTF-8 text file, one document per line (default: a built-in corpus's "
                        "sentences)")
    parser.add_argument("--out", default="runs/finetune", help="checkpoints, metrics and the final model")
    parser.add_argument("--layout", choices=["flags", "auto"], default="flags")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--zero", type=int, default=0)
    parser.add_argument("--microbatches", type=int, default=1)
    parser.add_argument("--steps", type=int, default=100, help="the run's length (the schedule decays over it)")
    parser.add_argument("--stop-at", type=int, help="end this launch after this step, as a preempted job does "
                        "(a checkpoint is written there; launch again to resume)")
    parser.add_argument("--batch", type=int, default=8, help="global batch, in sequences")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--log-every", type=int, default=1)
    return parser.parse_args()


def write_tiny_model(directory: Path) -> None:
    """A 4-layer Llama over bytes (vocabulary 256), saved as Hugging Face saves it."""
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)


def encoder(model_dir: Path, tiny: bool):
    if tiny:
        return lambda text: list(text.encode("utf-8"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    return lambda text: tokenizer(text)["input_ids"]


def batches(documents: list[list[int]], step: int, size: int, seq: int) -> dict[str, torch.Tensor]:
    """The step's global batch, the same on every rank: `size` documents (cycling through the
    corpus in a fixed shuffled order), cut or padded to `seq` + 1 tokens; labels are the next
    token, -100 on padding."""
    order = torch.randperm(len(documents), generator=torch.Generator().manual_seed(0)).tolist()
    ids = torch.zeros(size, seq + 1, dtype=torch.long)
    labels = torch.full((size, seq), -100, dtype=torch.long)
    for row in range(size):
        tokens = documents[order[(step * size + row) % len(order)]][:seq + 1]
        ids[row, :len(tokens)] = torch.tensor(tokens)
        labels[row, :len(tokens) - 1] = ids[row, 1:len(tokens)]
    return {"input_ids": ids[:, :-1], "labels": labels}


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """Linear warmup over `--warmup` steps, then cosine decay to a tenth of `--lr`."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def main() -> None:
    args = arguments()
    sw.init_distributed()
    rank = dist.get_rank()
    out = Path(args.out)
    model_dir = Path(args.model) if args.model else out / "base"
    if args.tiny and rank == 0 and not (model_dir / "config.json").exists():
        write_tiny_model(model_dir)
    dist.barrier()

    encode = encoder(model_dir, args.tiny)
    text = Path(args.data).read_text(encoding="utf-8") if args.data else tiny_corpus()
    pieces = text.splitlines() if args.data else re.split(r"(?<=[.!?])\s+", text)  # the corpus: its sentences
    documents = [encode(piece) for piece in pieces if len(piece.strip()) > 1]
    sample = batches(documents, 0, args.batch, args.seq)

    config = transformers.AutoConfig.from_pretrained(model_dir)
    model = sw.deferred_init(lambda: TokenWeightedLM(transformers.AutoModelForCausalLM.from_config(config)))
    if args.layout == "auto":  # the sample stands for one replica's batch: the global one is the safe bound
        pmodel = sw.parallelize(model, "auto", sample=sample)
    else:
        layout = sw.ParallelConfig(tp=args.tp, pp=args.pp, zero=args.zero, microbatches=args.microbatches)
        pmodel = sw.parallelize(model, layout, plan="auto" if args.tp > 1 else None,
                                sample=sample if args.pp > 1 else None)
    sw.load_pretrained(pmodel, model_dir)
    optimizer = sw.build_optimizer(pmodel, torch.optim.AdamW, lr=args.lr, weight_decay=0.01)
    # token weighting is not available with pipeline or context parallelism yet: the mean there
    reduce = "tokens" if pmodel.topology.sizes["pp"] == 1 and pmodel.topology.sizes["cp"] == 1 else "mean"

    start = 0
    checkpoints = out / "checkpoints"
    if checkpoints.exists():  # resume: the model, AdamW's state and the step reached
        start = sw.load_checkpoint(checkpoints, pmodel, optimizer)["step"]
    if rank == 0:
        print(pmodel.summary(), flush=True)
    pmodel.metrics.log_to(sw.JsonlLogger(out / "metrics.jsonl"), every=args.log_every)
    pmodel.metrics.log_to(sw.TensorBoardLogger(out / "tensorboard"), every=args.log_every)
    pmodel.metrics.log_to(sw.ConsoleLogger(), every=max(args.log_every, 10))

    replica, replicas = sw.data_parallel_info(pmodel)
    per_replica = args.batch // replicas
    end = min(args.steps, args.stop_at or args.steps)
    for step in range(start, end):
        batch = batches(documents, step, args.batch, args.seq)
        mine = {k: v[replica * per_replica:(replica + 1) * per_replica] for k, v in batch.items()}
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args)
        pmodel.train_step(mine, reduce=reduce)
        optimizer.clip_grad_norm(args.clip)
        optimizer.step()
        optimizer.zero_grad()
        if (step + 1) % args.save_every == 0 or step + 1 == end:
            sw.save_checkpoint(checkpoints, pmodel, optimizer, extra={"step": step + 1})
    pmodel.metrics.close()
    if end < args.steps:
        return
    final = sw.save_pretrained(pmodel, out / "final")
    if rank == 0:
        print(f"fine-tuned model: {final} (transformers.AutoModelForCausalLM.from_pretrained)", flush=True)


if __name__ == "__main__":
    main()
