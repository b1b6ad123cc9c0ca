"""Train the reference GPT with shardwise; run it with torchrun on any number of processes.

    torchrun --nproc-per-node 4 examples/train_gpt.py --steps 50

On CPU the processes talk over gloo; on GPUs, NCCL. The same script runs on one process
(`python examples/train_gpt.py`).
"""

import argparse

import torch

import shardwise as sw
from shardwise.models import GPT, GPTConfig, CharTokenizer, tiny_corpus, token_batches

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=50)
parser.add_argument("--batch", type=int, default=32, help="global batch size")
parser.add_argument("--microbatches", type=int, default=2)
args = parser.parse_args()

sw.init_distributed()
text = tiny_corpus()
tokenizer = CharTokenizer(text)
torch.manual_seed(0)  # every rank builds the same model; replicas also sync from rank 0
model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, block_size=64, n_layer=4, d_model=128))

pmodel = sw.parallelize(model, sw.ParallelConfig(microbatches=args.microbatches))
optimizer = sw.build_optimizer(pmodel, torch.optim.AdamW, lr=1e-3)
replica, replicas = sw.data_parallel_info(pmodel)
if pmodel.topology.rank == 0:
    print(pmodel.summary())

for step, batch in enumerate(token_batches(tokenizer.encode(text), args.batch, 64, args.steps)):
    per_replica = args.batch // replicas
    loss = pmodel.train_step(batch[replica * per_replica:(replica + 1) * per_replica])
    norm = optimizer.clip_grad_norm(1.0)
    optimizer.step()
    optimizer.zero_grad()
    if pmodel.topology.rank == 0 and step % 10 == 0:
        print(f"step {step:4d}  loss {loss.item():.4f}  grad norm {norm.item():.3f}")
