"""Peak memory of `sw.load_pretrained`: a Hugging Face Llama checkpoint with random weights
(TinyLlama's 1.1B shape by default) loaded at tp=N under `sw.deferred_init`.

    python bench/pretrained_memory.py [--ranks 4] [--layers 22] [--dir /tmp/llama-1b]

The checkpoint is written once with `save_pretrained` (sharded safetensors). Each rank then
builds the model on the meta device, parallelizes it (materializing only its shards) and
loads the checkpoint while a thread samples its anonymous resident memory (RssAnon: the
file's pages, mapped by safetensors and dropped by the kernel at will, are not counted) every
5 ms from before `deferred_init` to the end of the load. Printed per rank: its shard, the
checkpoint's largest tensor, and its anonymous memory after parallelize and at its peak
(deferred_init, parallelize and the load), both over what the process held before. The target is peak <= 1.1 x shard + the largest tensor: no rank ever holds a
second copy of its shards, let alone the whole model.
"""

from __future__ import annotations

import argparse
import math
import os
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

import shardwise as sw

GiB = 1 << 30


def _anon_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status (Linux only)")


def _config(args):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=args.layers,
        num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048, tie_word_embeddings=False)


def _build(args):
    import transformers

    return transformers.LlamaForCausalLM(_config(args))


def _write(args) -> None:
    directory = Path(args.dir)
    if (directory / "model.safetensors.index.json").is_file():
        return
    torch.manual_seed(0)
    start = time.perf_counter()
    model = _build(args)
    model.save_pretrained(directory, max_shard_size="1GB")
    print(f"wrote {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters to {directory} "
          f"in {time.perf_counter() - start:.0f} s")


def _load(args) -> dict:
    from safetensors import safe_open

    start_anon, peaks, phase, done = _anon_bytes(), {"deferred_init": 0, "parallelize": 0, "load": 0}, ["deferred_init"], threading.Event()

    def sample():
        while not done.is_set():
            peaks[phase[0]] = max(peaks[phase[0]], _anon_bytes())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    model = sw.deferred_init(_build, args)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    phase[0] = "parallelize"
    pm = sw.parallelize(model, sw.ParallelConfig(tp=dist.get_world_size()), plan="llama")
    shard = sum(sw.tensors.local(p).numel() * p.element_size() for p in pm.parameters())
    before = _anon_bytes()
    dist.barrier()
    phase[0] = "load"
    start = time.perf_counter()
    sw.load_pretrained(pm, args.dir)
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    peaks["load"] = max(peaks["load"], _anon_bytes())
    largest = 0
    for file in Path(args.dir).glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                largest = max(largest, math.prod(handle.get_slice(key).get_shape()) * 4)
    return dict(model=total, shard=shard, largest=largest, held=before - start_anon,
                **{phase: peak - start_anon for phase, peak in peaks.items()}, seconds=seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--dir", default="/tmp/shardwise-llama-1b")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _write(args)
    results = sw.testing.run_on_ranks(_load, args.ranks, args, timeout=1800)
    print(f"load_pretrained at tp={args.ranks}, deferred_init, fp32: model {results[0]['model'] / GiB:.2f} GiB; "
          "per rank, anonymous memory over the process's before deferred_init (GiB)")
    print("rank  shard  largest tensor  held after parallelize  peak in deferred_init, parallelize, load  "
          "target (1.1 shard + largest)  load s")
    for rank, r in enumerate(results):
        target = 1.1 * r["shard"] + r["largest"]
        phases = ("deferred_init", "parallelize", "load")
        verdict = " ".join("ok" if r[phase] <= target else "OVER" for phase in phases)
        print(f"{rank:4d}  {r['shard'] / GiB:5.2f}  {r['largest'] / GiB:14.3f}  {r['held'] / GiB:22.3f}  "
              + "  ".join(f"{r[phase] / GiB:.3f}" for phase in phases).rjust(39)
              + f"  {target / GiB:28.3f} {verdict:>12}  {r['seconds']:6.1f}")


if __name__ == "__main__":
    main()
