"""The planner's predictions against measurements, its speed, and its choices at scale.

    python bench/planner.py [--quick]

1. Memory: layouts of the reference GPT and a Hugging Face Llama on 1-8 local gloo ranks.
   On each rank, after a training step and an AdamW step: parameters + gradients +
   optimizer state (`pm.memory()`) + the bytes one microbatch saves for backward
   (`sw.activation_memory`), against the planner's prediction for that rank's pipeline
   position (first or last stage; middle stages of pp=4 are not compared). Prints every
   layout's error, the worst and the median.
   Then a 1.1 B-parameter Llama (TinyLlama's shape, 8 KV heads) at world 64, in one process: torch's
   fake process group stands for the other 63 ranks (collectives move nothing), the model
   is built with sw.deferred_init so only rank 0's shards are materialized, a training step
   on a short batch and an AdamW step create the gradients and optimizer state
   (`pm.memory()`: real bytes, independent of the batch), and one microbatch of --big-seq
   tokens is counted under FakeTensorMode (`sw.activation_memory(..., fake=True)`).
2. Speed: the whole search space for llama3-405b on 16,384 H100s and llama3-70b on 1,024.
3. Quality: the top choice against an exhaustive scalar re-evaluation, and Meta's published
   Llama 3 405B layouts (arXiv 2407.21783, Table 4) predicted in the same cost model.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist
import transformers
from torch import nn

import shardwise as sw
from shardwise.config import SCHEDULES
from shardwise.models import GPT, CausalLM, GPTConfig
from shardwise.planner import Cluster, model_spec, search
from shardwise.planner.cost import OPTIMIZER_CODES, RECOMPUTE_CODES, SCHEDULE_CODES, Layout, evaluate
from shardwise.planner.format import table

SEQ, MICRO, VOCAB, WIDTH, HEADS, LAYERS = 64, 8, 64, 64, 4, 4


MIXTURES = ("mixtral",)


def build(kind: str) -> nn.Module:
    """A small model of `kind`: "gpt", "gpt-wide" (4x the width: parameters outweigh one
    sequence's activations, as in a large model's step), "gpt-vocab" (a 16K vocabulary: the
    loss's logits outweigh the blocks, as Llama 3's 128K do), "llama", "llama-eager", "llama-shallow"
    (one block, a KV head per head up to tp 4: what a backward holds beside the activations weighs), "mixtral"."""
    torch.manual_seed(0)
    if kind in ("gpt", "gpt-wide", "gpt-vocab"):
        width = 4 * WIDTH if kind == "gpt-wide" else WIDTH
        vocab = 16384 if kind == "gpt-vocab" else VOCAB
        return GPT(GPTConfig(vocab_size=vocab, block_size=SEQ, n_layer=LAYERS, n_head=HEADS, d_model=width))
    shallow = kind == "llama-shallow"
    shape = dict(vocab_size=VOCAB, hidden_size=WIDTH, num_attention_heads=HEADS,
                 num_key_value_heads=HEADS if shallow else HEADS // 2,
                 num_hidden_layers=1 if shallow else LAYERS, intermediate_size=2 * WIDTH, max_position_embeddings=SEQ)
    if kind == "mixtral":  # 4 experts, 2 per token
        config = transformers.MixtralConfig(**shape, num_local_experts=4, num_experts_per_tok=2)
        config._attn_implementation = "sdpa"
        return CausalLM(transformers.MixtralForCausalLM(config))
    config = transformers.LlamaConfig(**shape)
    config._attn_implementation = "eager" if kind == "llama-eager" else "sdpa"  # eager writes the scores
    return CausalLM(transformers.LlamaForCausalLM(config))


# (model, world, config): each group of one world size runs in one spawn
LAYOUTS = [
    ("gpt", 1, {}), ("gpt", 1, {"recompute": "selective"}), ("gpt", 1, {"recompute": "full"}),
    ("gpt", 1, {"recompute": "selective-alternate"}),
    ("llama", 1, {}), ("llama", 1, {"recompute": "selective"}), ("llama", 1, {"recompute": "selective-alternate"}),
    ("llama", 1, {"param_dtype": torch.bfloat16}), ("llama", 1, {"param_dtype": torch.bfloat16, "recompute": "selective"}),
    ("gpt", 2, {"dp": 2}), ("gpt", 2, {"dp": 2, "zero": 1}), ("gpt", 2, {"dp": 2, "zero": 2}),
    ("gpt", 2, {"dp": 2, "zero": 3}), ("gpt", 2, {"tp": 2}), ("gpt", 2, {"tp": 2, "sequence_parallel": True}),
    ("gpt", 2, {"tp": 2, "sequence_parallel": True, "recompute": "selective"}), ("gpt", 2, {"tp": 2, "recompute": "full"}),
    ("gpt", 2, {"pp": 2, "microbatches": 2}), ("gpt", 2, {"pp": 2, "microbatches": 2, "schedule": "gpipe"}),
    ("gpt", 2, {"cp": 2}), ("llama", 2, {"tp": 2}), ("llama", 2, {"tp": 2, "sequence_parallel": True}),
    ("llama", 2, {"dp": 2, "zero": 2}), ("llama", 2, {"pp": 2, "microbatches": 2}), ("llama", 2, {"cp": 2}),
    ("llama", 2, {"tp": 2, "sequence_parallel": True, "recompute": "full"}), ("llama-eager", 2, {"tp": 2}),
    ("llama", 2, {"tp": 2, "param_dtype": torch.bfloat16}), ("llama", 2, {"pp": 2, "microbatches": 2, "param_dtype": torch.bfloat16}),
    ("llama-eager", 2, {"dp": 2, "recompute": "selective"}),
    ("gpt", 4, {"dp": 2, "tp": 2}), ("gpt", 4, {"tp": 2, "pp": 2, "microbatches": 2}),
    ("gpt", 4, {"dp": 2, "pp": 2, "zero": 1, "microbatches": 2}), ("gpt", 4, {"tp": 4, "sequence_parallel": True}),
    ("gpt", 4, {"cp": 2, "dp": 2}), ("gpt", 4, {"dp": 4, "zero": 3}),
    ("llama", 4, {"dp": 2, "tp": 2, "sequence_parallel": True, "zero": 1}), ("llama", 4, {"cp": 2, "tp": 2, "sequence_parallel": True}),
    ("llama", 4, {"tp": 2, "pp": 2, "microbatches": 2, "recompute": "selective"}),
    ("gpt", 8, {"dp": 2, "tp": 2, "pp": 2, "microbatches": 2}), ("llama", 8, {"dp": 2, "tp": 2, "pp": 2, "microbatches": 2, "zero": 2}),
    ("mixtral", 1, {}), ("mixtral", 1, {"recompute": "selective"}), ("mixtral", 2, {"ep": 2}),
    ("mixtral", 2, {"tp": 2}), ("mixtral", 2, {"tp": 2, "sequence_parallel": True}),
    ("mixtral", 4, {"ep": 4}), ("mixtral", 4, {"ep": 2, "tp": 2, "sequence_parallel": True, "recompute": "selective"}),
    ("mixtral", 4, {"ep": 2, "pp": 2, "microbatches": 2, "zero": 1}),
]


def _batch(microbatches: int, micro: int = MICRO) -> dict:
    ids = torch.randint(0, VOCAB, (micro * microbatches, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}


def parallelized(kind: str, options: dict, micro: int = MICRO) -> tuple[sw.ParallelModule, dict]:
    """A model of `kind` parallelized with `options` (a ParallelConfig's fields; tp by the zoo's
    plan for the kind), and its batch of `micro` sequences a microbatch."""
    config = sw.ParallelConfig(**options)
    batch = _batch(config.microbatches, micro)
    plan = kind.split("-")[0] if config.tp > 1 else None
    return sw.parallelize(build(kind), config, plan=plan, sample=batch), batch


def training_step(pm: sw.ParallelModule, batch: dict) -> Callable[[], None]:
    """One step of `pm` on `batch` as users run it: train_step, AdamW's step, zero_grad."""
    opt = sw.build_optimizer(pm, torch.optim.AdamW, lr=1e-3)

    def step():
        pm.train_step(batch)
        opt.step()
        opt.zero_grad()
    return step


def measure(cases: list[tuple[str, dict]]) -> list[tuple[int, int, float, float]]:
    """On this rank, per case: (pp rank, pp, model-state bytes, one microbatch's saved bytes)."""
    out = []
    for kind, options in cases:
        pm, batch = parallelized(kind, options)
        opt = sw.build_optimizer(pm, torch.optim.AdamW, lr=1e-3)
        pm.train_step(batch)
        opt.step()
        states = sum(pm.memory().values())
        saved = sw.activation_memory(pm, batch).total
        out.append((pm.topology.pp_rank, pm.config.pp, float(states), float(saved)))
    return out


def _cost(options: dict, model: nn.Module, world: int, seq: int = SEQ, micro: int = MICRO):
    """The planner's Cost of `options` (a ParallelConfig's fields) for `model` on `world` local ranks."""
    config = sw.ParallelConfig(**options).resolve(world)
    layout = Layout(dp=config.dp, tp=config.tp, pp=config.pp, cp=config.cp, zero=config.zero,
                    recompute=RECOMPUTE_CODES[config.recompute], sp=int(config.sequence_parallel), micro_batch=micro,
                    microbatches=config.microbatches, schedule=SCHEDULE_CODES[config.schedule],
                    virtual=2 if SCHEDULES[config.schedule].interleaved else 1,  # the executor's default
                    param_bytes=config.param_dtype.itemsize if config.param_dtype else 4, ep=config.ep,
                    reduce_bytes=config.reduce_dtype.itemsize if config.reduce_dtype else 0,
                    bucket_bytes=config.bucket_mb * 2 ** 20, optimizer=OPTIMIZER_CODES["for-loop"])  # torch's on CPUs
    return evaluate(model_spec(model), Cluster.local(world), layout, seq)


def predict(kind: str, options: dict, model: nn.Module, world: int, seq: int = SEQ, micro: int = MICRO):
    """The planner's (first stage, last stage) prediction of (states, one microbatch's activations)."""
    cost = _cost(options, model, world, seq, micro)
    return ((float(cost.states_first), float(cost.microbatch_first)),
            (float(cost.states_last), float(cost.microbatch_last)))


def memory_validation(layouts) -> list[tuple[str, float, float, float]]:
    """Relative errors of predicted against measured bytes, per layout on its worst rank:
    (name, total, model states, one microbatch's activations). A mixture of experts' ranks
    keep what their routing sends them, which the planner does not know: its balanced
    prediction is compared with the mean of the ranks at each pipeline position (the token
    slots one rank receives above the mean another receives below it)."""
    errors = []
    for world in sorted({w for _, w, _ in layouts}):
        group = [(kind, options) for kind, w, options in layouts if w == world]
        measured = sw.testing.run_on_ranks(measure, world, group, timeout=1200)
        for i, (kind, options) in enumerate(group):
            first, last = predict(kind, options, build(kind), world)
            worst = [0.0, 0.0, 0.0]
            values = [rank_values[i] for rank_values in measured]
            if kind in MIXTURES:
                values = [(pp_rank, pp, states, statistics.fmean(v[3] for v in values if v[0] == pp_rank))
                          for pp_rank, pp, states, _ in values]
            for pp_rank, pp, states, saved in values:
                if 0 < pp_rank < pp - 1:
                    continue
                want_states, want_saved = first if pp_rank == 0 else last
                errors_here = ((want_states + want_saved) / (states + saved) - 1, want_states / states - 1,
                               want_saved / saved - 1)
                worst = [max(w, e, key=abs) for w, e in zip(worst, errors_here)]
            name = f"{kind} world {world} " + " ".join(f"{k}={v}" for k, v in options.items())
            print(f"  {name:<78} total {worst[0]:+7.2%}  (states {worst[1]:+7.2%}, activations {worst[2]:+7.2%})")
            errors.append((name, *worst))
    return errors


def profiled_allocations(step: Callable[[], None], device: torch.device, spans: tuple[str, ...] = ()
                         ) -> tuple[list[tuple[int, int, int, bool]], list[tuple[int, int, str]]]:
    """Every allocation and free `step` makes on `device`, in torch's profiler's record: (time,
    bytes (negative: a free), address, inside the backend: a collective's own staging), and the
    (start, end, name) of the profiler ranges whose names start with one of `spans`."""
    from torch._C._profiler import _EventType

    def in_backend(node) -> bool:
        while node is not None:
            if node.name.startswith(("c10d::", "gloo:")):
                return True
            node = node.parent
        return False

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    nodes, allocations, ranges = list(prof.profiler.kineto_results.experimental_event_tree()), [], []
    while nodes:
        node = nodes.pop()
        nodes.extend(node.children)
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == device.type:
            allocations.append((node.start_time_ns, node.extra_fields.alloc_size, node.extra_fields.ptr,
                                node.extra_fields.alloc_size > 0 and in_backend(node.parent)))
        elif spans and node.name.startswith(spans):
            ranges.append((node.start_time_ns, node.end_time_ns, node.name))
    return allocations, ranges


def _allocation_peak(step: Callable[[], None], device: torch.device) -> int:
    """The most `step` adds to the bytes allocated on `device` at any moment. Left out: what a
    collective allocates inside the process group (gloo clones a reduce-scatter's input and
    stages an all-gather's; NCCL's buffers are its own, outside torch's allocator), the
    backend's and not the executor's, which the planner predicts for NCCL."""
    return executor_peak(profiled_allocations(step, device)[0])


def executor_peak(allocations: list[tuple[int, int, int, bool]]) -> int:
    """The most bytes live at once outside the backend, from (time, bytes (negative: a free),
    address, inside the backend) events; frees of blocks from before the events count."""
    # An address is handed out again only once it was freed. A free on a thread the profiler
    # does not follow goes unrecorded (gloo frees the clones it made on the caller's thread on its
    # own worker thread): the block at an address allocated again is gone by then. Without this,
    # a later block of the executor's at a clone's address had its free taken for the clone's
    # and stayed live to the end of the step (ZeRO-3 over 4 microbatches read 13% high, 1 run in 6).
    live = peak = 0
    backend: set[int] = set()  # addresses the backend holds now
    executor: dict[int, int] = {}  # address -> bytes of the executor's blocks live now
    for _, size, ptr, inside in sorted(allocations, key=lambda a: a[0]):
        if size > 0:
            backend.discard(ptr)
            live -= executor.pop(ptr, 0)
            if inside:
                backend.add(ptr)
                continue
            executor[ptr] = size
        elif ptr in backend:
            backend.discard(ptr)
            continue
        else:
            executor.pop(ptr, None)  # (a block from before the step is not in it: its free counts)
        live += size
        peak = max(peak, live)
    return peak


def measure_peak(cases: list[tuple]) -> list[tuple[float, float]]:
    """On this rank, per case (kind, options[, sequences per microbatch: MICRO]): (model-state
    bytes at a step's start, the most the step (train_step, optimizer.step, zero_grad) adds at
    any moment: activations, transient gradients, gathers)."""
    out = []
    for kind, options, *micro in cases:
        pm, batch = parallelized(kind, options, *micro)
        step = training_step(pm, batch)
        for _ in range(2):  # the optimizer state exists, buckets are laid out
            step()
        states = float(sum(pm.memory().values()))
        out.append((states, float(_allocation_peak(step, pm.topology.device))))
    return out


def peak_validation(world: int, layouts: list[tuple]) -> list[tuple[str, float]]:
    """Relative error of the planner's memory (its peak: states, activations and buffers)
    against the peak measured inside a step on the busiest rank; `layouts` as `measure_peak`'s."""
    measured = sw.testing.run_on_ranks(measure_peak, world, layouts, timeout=1200)
    errors = []
    for i, (kind, options, *micro) in enumerate(layouts):
        predicted = float(_cost(options, build(kind), world, micro=micro[0] if micro else MICRO).memory)
        peak = max(states + added for states, added in (rank[i] for rank in measured))
        name = f"{kind} world {world} " + " ".join(f"{k}={v}" for k, v in options.items()) + (
            f", {micro[0]} a microbatch" if micro else "")
        print(f"  {name:<50} peak in the step {peak / 2 ** 20:8.3f} MiB, predicted {predicted / 2 ** 20:8.3f} MiB "
              f"({predicted / peak - 1:+.2%})")
        errors.append((name, predicted / peak - 1))
    return errors


# ZeRO-2/3 over microbatches, where whole gradients weigh most (one sequence a microbatch): reduced
# into the shards each microbatch, or (a pipeline's) accumulated whole until the last backward, whose
# reduce-scatters make the shards (1F1B's peak holds the whole gradients, GPipe's the buckets its first
# backward fills first beside every microbatch's activations; charged the shards too, 6% and 16% over)
MICROBATCH_PEAKS = [
    ("gpt", {"dp": 4, "zero": 2, "microbatches": 4, "bucket_mb": 0.02}, 1),
    ("gpt", {"pp": 2, "dp": 2, "zero": 2, "microbatches": 4, "bucket_mb": 0.02}, 1),
    ("gpt", {"pp": 2, "dp": 2, "zero": 2, "microbatches": 4, "bucket_mb": 0.02, "schedule": "gpipe"}, 1),
    ("gpt", {"dp": 4, "zero": 3, "bucket_mb": 0.02}, 1),  # ZeRO-3's buckets smaller than a block
    ("gpt", {"dp": 4, "zero": 3, "microbatches": 4, "bucket_mb": 0.02}, 1),
    ("gpt", {"dp": 4, "zero": 3, "microbatches": 4}, 1)]  # a bucket a block, whose activations outweigh it
# ZeRO 1-3 where the parameters outweigh the activations (a step's peak comes at the end of
# backward, when the gradients are all there): what each stage keeps of them shows; and the
# weight gradients torch's zero-bubble executor keeps beside shardwise's buckets
WIDE_PEAKS = [("gpt-wide", {"dp": 4, "zero": zero, "bucket_mb": 0.02}, 1) for zero in (1, 2, 3)] + [
    ("gpt-wide", {"dp": 4, "zero": 3, "microbatches": 4}, 1),
    ("gpt-wide", {"dp": 4, "zero": 3, "recompute": "full", "bucket_mb": 0.02}, 1),
    ("gpt-wide", {"pp": 2, "dp": 2, "microbatches": 4, "schedule": "zero-bubble"}, 1)]
# bf16 parameters under full recompute, where the optimizer step's peak is a step's highest: the
# float32 copies of the gradients for the float32 masters (bf16 gradients; not with float32 ones)
# and the for-loop Adam's temporaries, ZeRO-1 on its shard
STEP_PEAKS = [("gpt-wide", {"dp": 4, "zero": zero, "param_dtype": torch.bfloat16, "recompute": "full"}, 1)
              for zero in (0, 1)] + [
    ("gpt-wide", {"dp": 4, "param_dtype": torch.bfloat16, "reduce_dtype": torch.float32, "recompute": "full"}, 1)]
# a vocabulary whose logits outweigh the blocks: the cross-entropy's backward holds two gradients
# of the logits' size beside the kept log-probabilities (bf16: in bf16, as our GPT's loss runs);
# without dp no buffer keeps the gradients between steps, but a second microbatch's loss finds the
# first's accumulated
VOCAB_PEAKS = [("gpt-vocab", {"dp": 4}), ("gpt-vocab", {"dp": 4, "param_dtype": torch.bfloat16}),
               ("gpt-vocab", {"tp": 4}), ("gpt-vocab", {"tp": 2, "dp": 2, "zero": 1, "recompute": "full"}),
               ("gpt-vocab", {"tp": 4, "microbatches": 2}, 1)]
# activations a backward brings back: a block recomputed whole (full) or in part (selective) beside
# what the others keep, on one rank and on a pipeline's, whose other microbatches stay; tp's recomputed
# tensors (its shared lookups outlived the recomputation), sp's gathered inputs (held to the forward's
# end); GPipe's last rank, whose every forward comes first
RECOMPUTE_PEAKS = [("gpt", {"dp": 4, "recompute": "full"}), ("llama", {"dp": 4, "recompute": "selective"}),
                   ("gpt", {"pp": 2, "dp": 2, "microbatches": 4, "recompute": "full"}),
                   ("gpt", {"tp": 2, "dp": 2, "recompute": "full"}),
                   ("gpt", {"tp": 2, "dp": 2, "sequence_parallel": True, "recompute": "full"}),
                   ("llama", {"dp": 4, "recompute": "selective-alternate"}),
                   ("gpt-vocab", {"pp": 2, "dp": 2, "microbatches": 4, "schedule": "gpipe"}, 2)]
# a bf16 Hugging Face Llama, whose RMSNorms keep float32 copies of their inputs (the residual sums)
BF16_PEAKS = [("llama", {"dp": 4, "param_dtype": torch.bfloat16, **options})
              for options in ({}, {"recompute": "selective"}, {"zero": 3}, {"tp": 2, "dp": 2},
                              {"pp": 2, "dp": 2, "microbatches": 4})]
# a norm's backward under tp without sp, where it is replicated and the blocks' tensors are not:
# Hugging Face's RMSNorm computes it in float32 (five tensors of its input's size at once), the
# final norm's after the loss's backward and a block's second norm's after its MLP's (under recompute
# the block's peak); one block, so they weigh against the activations
NORM_PEAKS = [("llama-shallow", {"tp": 4, "param_dtype": torch.bfloat16}), ("llama-shallow", {"tp": 4}),
              ("llama-shallow", {"tp": 4, "param_dtype": torch.bfloat16, "recompute": "full"}),
              ("llama-shallow", {"tp": 4, "param_dtype": torch.bfloat16, "recompute": "selective"})]
# a pipeline over tp with sp, whose first rank peaks in a forward (of its last microbatch in flight,
# beside the others'): the gathered inputs held to the block's end, the row-parallel output and the
# copy its reduce-scatter makes are uncharged (3% under at 4 microbatches; 7-9% and growing with them
# while a stage's replay held every value to its end, 11-13% while finished microbatches' kept
# sequence shards lived with their graphs)
SP_PIPELINE_PEAKS = [("gpt", {"pp": 2, "tp": 2, "sequence_parallel": True, "microbatches": 4})]
PEAK_LAYOUTS = [("gpt", {"dp": 4}), ("gpt", {"dp": 4, "zero": 1}), ("gpt", {"dp": 4, "zero": 2}),
                ("gpt", {"dp": 4, "zero": 2, "bucket_mb": 0.02}), ("gpt", {"dp": 4, "zero": 3})] + [
    ("gpt", {"pp": 2, "dp": 2, "microbatches": m, "schedule": schedule})
    for schedule in ("1f1b", "interleaved-1f1b", "zero-bubble") for m in (4, 8)] + MICROBATCH_PEAKS + WIDE_PEAKS + STEP_PEAKS + VOCAB_PEAKS \
    + RECOMPUTE_PEAKS + BF16_PEAKS + NORM_PEAKS + SP_PIPELINE_PEAKS


BIG_WORLD = 64
BIG = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
           num_key_value_heads=8)  # TinyLlama 1.1B's shape, with 8 KV heads (tp up to 8)
BIG_LAYOUTS = [
    {"tp": 8, "zero": 1}, {"tp": 8, "zero": 1, "recompute": "full"}, {"tp": 4, "zero": 2, "recompute": "selective"},
    {"dp": 64, "zero": 3}, {"tp": 8, "cp": 2, "zero": 1}, {"tp": 4, "pp": 2, "microbatches": 2, "zero": 1},
    {"tp": 2, "pp": 4, "microbatches": 4, "zero": 1, "recompute": "selective"},
]


def _llama_of(shape: dict) -> nn.Module:
    config = transformers.LlamaConfig(**shape, max_position_embeddings=8192)
    config._attn_implementation = "sdpa"
    return CausalLM(transformers.LlamaForCausalLM(config))


def _tokens(vocab: int, rows: int, seq: int) -> dict:
    ids = torch.randint(0, vocab, (rows, seq + 1), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}


def _measure_fake_world(shape: dict, world: int, options: dict, seq: int) -> tuple[float, float, int]:
    """Rank 0 of a fake world of `world` ranks under `options`: (model-state bytes, one
    microbatch's saved bytes, parameters in the whole model)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    config = sw.ParallelConfig(**options).resolve(world)
    model = sw.deferred_init(_llama_of, shape)
    params = sum(p.numel() for p in model.parameters())
    rows, vocab = config.microbatches, shape["vocab_size"]  # this replica's batch: one sequence per microbatch
    pm = sw.parallelize(model, sw.ParallelConfig(**options), plan="llama" if config.tp > 1 else None,
                        sample=_tokens(vocab, rows, seq))
    opt = sw.build_optimizer(pm, torch.optim.AdamW, lr=1e-4)
    pm.train_step(_tokens(vocab, rows, 16 * config.cp))  # gradients and optimizer state exist after a step
    opt.step()
    states = sum(pm.memory().values())
    saved = sw.activation_memory(pm, _tokens(vocab, rows, seq), fake=True).total
    dist.destroy_process_group()
    return float(states), float(saved), params


def fake_world_validation(shape: dict, world: int, layouts: list[dict], seq: int,
                          process_per_layout: bool = True) -> list[tuple[str, float, float, float]]:
    """A Llama of `shape` at `world` ranks, rank 0 measured in a spawned process (a fresh one
    per layout unless `process_per_layout` is False), against the planner: (name, total,
    model states, activations) relative errors."""
    # a fresh process per layout: each holds rank 0's real shards (up to ~10 GiB for the 1.1B at dp=64)
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                                max_tasks_per_child=1 if process_per_layout else None) as pool:
        measured = list(pool.map(_measure_fake_world, *zip(*[(shape, world, options, seq) for options in layouts])))
    errors = []
    with torch.device("meta"):
        spec_model = _llama_of(shape)
    for options, (states, saved, params) in zip(layouts, measured):
        (want_states, want_saved), _ = predict("llama", options, spec_model, world, seq=seq, micro=1)
        worst = ((want_states + want_saved) / (states + saved) - 1, want_states / states - 1, want_saved / saved - 1)
        name = f"llama {params / 1e9:.2f}B world {world} seq {seq} " + " ".join(f"{k}={v}" for k, v in options.items())
        print(f"  {name:<78} total {worst[0]:+7.2%}  (states {worst[1]:+7.2%}, activations {worst[2]:+7.2%})  "
              f"measured {(states + saved) / 2**30:.2f} GiB")
        errors.append((name, *worst))
    return errors


def best_in_degrees(spec, cluster, seq: int, tp: int, cp: int, pp: int, dp: int, tokens: int = 16 * 2 ** 20):
    """The fastest variant that fits of fixed degrees (schedule, virtual stages, recompute,
    ZeRO 1-2, sp on, bf16, one sequence per microbatch): (cost, description), or None."""
    batch = tokens // seq
    best = None
    for schedule, virtual in ((1, 1), (2, 2), (2, 4), (2, 8)):
        for rc in (0, 1, 2):
            for zero in (1, 2):
                layout = Layout(dp=dp, tp=tp, pp=pp, cp=cp, zero=zero, recompute=rc, sp=1, micro_batch=1,
                                microbatches=batch // dp, schedule=schedule, virtual=virtual, param_bytes=2)
                cost = evaluate(spec, cluster, layout, seq)
                if float(cost.memory) <= cluster.usable_bytes and (best is None or cost.step_seconds < best[0].step_seconds):
                    best = (cost, f"tp{tp} cp{cp} pp{pp} dp{dp} zero{zero} v{virtual} rc{rc}")
    return best


def meta_layouts() -> None:
    """Llama 3 405B on 16,384 H100s: Meta's layouts (arXiv 2407.21783, Table 4) and ours."""
    spec, cluster = model_spec("llama3-405b"), Cluster(16384, device="h100")
    print(f"{'seq':>6} {'layout':<70} {'fits':>5} {'mem GiB':>8} {'MFU pred':>9} {'published':>10} {'step s':>8}")
    for seq, tp, cp, pp, dp, published in ((8192, 8, 1, 16, 128, 0.41), (131072, 8, 16, 16, 8, 0.38)):
        ours = search(spec, cluster, global_tokens=16 * 2 ** 20, seq_len=seq, top=1)[0]
        best = best_in_degrees(spec, cluster, seq, tp, cp, pp, dp)
        if best is None:
            print(f"{seq:>6} {f'tp{tp} cp{cp} pp{pp} dp{dp}':<70} {'no':>5}")
        else:
            cost, name = best
            mfu = float(cost.model_flops / (cost.step_seconds * cluster.gpus * cluster.spec.peak_flops))
            print(f"{seq:>6} {name:<70} {'yes':>5} {float(cost.memory) / 2**30:>8.1f} {mfu:>9.1%} {published:>10.0%} "
                  f"{float(cost.step_seconds):>8.2f}")
        print(f"{seq:>6} {'ours: ' + ours.layout():<70} {'yes':>5} {ours.memory / 2**30:>8.1f} {ours.mfu:>9.1%} "
              f"{'':>10} {ours.step_seconds:>8.2f}")


def _print_errors(errors: list[tuple[str, float, float, float]]) -> None:
    for column, label in ((1, "total"), (2, "model states"), (3, "activations")):
        magnitudes = [abs(e[column]) for e in errors]
        print(f"{label}: worst {max(magnitudes):.2%}, median {statistics.median(magnitudes):.2%} over {len(errors)} layouts")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="memory validation on worlds 1 and 2 only")
    parser.add_argument("--big-seq", type=int, default=4096, help="tokens per microbatch of the 1.1B Llama at world 64")
    args = parser.parse_args()
    layouts = [x for x in LAYOUTS if not args.quick or x[1] <= 2]
    print(f"memory: {len(layouts)} layouts, predicted vs measured bytes per rank (states + one microbatch's activations)")
    errors = memory_validation(layouts)
    _print_errors(errors)
    print(f"\nthe peak inside a step (profiler allocations on top of the states at its start) against the planner's "
          f"memory, {len(PEAK_LAYOUTS)} layouts on 4 ranks")
    peak_validation(4, PEAK_LAYOUTS)
    print(f"\nmemory at scale: {len(BIG_LAYOUTS)} layouts of a 1.1B Llama at world {BIG_WORLD}, one process "
          "(fake process group, deferred init, activations under FakeTensorMode)")
    _print_errors(fake_world_validation(BIG, BIG_WORLD, BIG_LAYOUTS, args.big_seq))
    print()

    for name, gpus, tokens in (("llama3-405b", 16384, 16 * 2 ** 20), ("llama3-70b", 1024, 4 * 2 ** 20)):
        start = time.perf_counter()
        result = search(name, Cluster(gpus), global_tokens=tokens, seq_len=8192, top=5)
        elapsed = time.perf_counter() - start
        print(f"{name} on {gpus} H100s, seq 8192, {tokens // 2**20}M tokens per step: {elapsed:.2f} s")
        print(table(result))
        print()
    print(result[0].explain())
    print()
    meta_layouts()


if __name__ == "__main__":
    main()
