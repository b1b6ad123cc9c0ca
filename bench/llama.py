"""Hugging Face Llama: shardwise vs the same model composed from PyTorch's own pieces, same run.

    python bench/llama.py [--layers 8] [--hidden 512] [--seq 512] [--batch 2] [--rounds 3]
                          [--layout tp,pp,dp,zero3] [--compile [--backend inductor]]

Layouts on 4 ranks, each timed against its native composition in alternating rounds
(forward, backward and an AdamW step; the same global batch, each replica its own slice):

  dp=4               shardwise: plain data parallelism. native: DistributedDataParallel.
  zero3 x dp=4       shardwise: zero=3. native: `fully_shard` per layer and on the root (FSDP2).

  tp=2 x dp=2 + sp   shardwise: zoo plan "llama" with sequence_parallel=True, zero=3 (zero=0 with
                     --compile before torch 2.14, which cannot compile tp shards inside ZeRO's
                     flat buffers).
                     native: `parallelize_module` (Colwise/Rowwise projections, vocab-parallel
                     embedding, SequenceParallel norms, PrepareModuleInput gathering the
                     attention and MLP inputs, a sequence-sharded column-parallel head under
                     `loss_parallel`) then `fully_shard` per layer and root over dp (FSDP2,
                     ZeRO-3 like zero=3).
  pp=2 x dp=2        shardwise: pp=2, dp=2, 1F1B, 4 microbatches, stage 1 from layers[n/2].
                     native: the stage modules a user writes for torch's pipelining (stage 0
                     embeds and runs the first half, stage 1 the rest, norm and head, and the
                     loss), each under `fully_shard` over dp (FSDP2, torchtitan's pp x dp),
                     `PipelineStage` + `Schedule1F1B`.

With `--compile` every decoder layer of every model is compiled in place (`layer.compile()`,
torchtitan's granularity), a third line times shardwise eager, and Dynamo's graphs and graph
breaks during the compiled models' first two steps are printed; the ratios are then compiled
shardwise / compiled native and compiled / eager.

For tp and pp it also prints the bytes one microbatch saves for backward on
a rank (shardwise's `sw.activation_memory`, and a saved-tensor hook count for native) against
the per-layer formula (Korthikanti et al. adapted to fp32, RMSNorm and SwiGLU with f = 2h; see
tests/test_activations.py), and the bytes every collective and send took in during one step
against the layout's minimum (see `_report`). Under sp shardwise saves gathered inputs as
their shards and gathers them again in backward, as Megatron does; the native composition
keeps them gathered: fewer all-gathers, more activation memory.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, loss_parallel, parallelize_module)
from torch.nn.parallel import DistributedDataParallel
from transformers.masking_utils import create_causal_mask

import shardwise as sw
from shardwise.compat import COMPILES_DTENSOR_VIEWS
from common import timed_rounds, training_step
from shardwise.comm import CollectiveCounter

VOCAB = 1024


class EndToEnd(nn.Module):
    """The user's module: the loss of a causal LM on a batch of token ids (HF shifts the labels)."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, batch):
        return self.lm(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss


def make_llama(args) -> EndToEnd:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.heads, max_position_embeddings=args.seq,
        tie_word_embeddings=False, attn_implementation="sdpa", use_cache=False)  # training: no KV cache
    return EndToEnd(transformers.LlamaForCausalLM(config))


def causal_lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """HF's causal-LM loss: position i predicts token i + 1, mean over the predicted tokens."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


# -- native compositions ---------------------------------------------------------------------
def native_tp_sp(args, mesh) -> nn.Module:
    model = make_llama(args)
    lm = model.lm
    tp = mesh["tp"]
    parallelize_module(lm.model.embed_tokens, tp, RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
    for i, layer in enumerate(lm.model.layers):
        parallelize_module(layer, tp, {
            # the mask and rotary positions come from the whole embedding: cut the sequence here
            **({"": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                   use_local_output=True)} if i == 0 else {}),
            "input_layernorm": SequenceParallel(),
            "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                            desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            "post_attention_layernorm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        })
    parallelize_module(lm.model.norm, tp, SequenceParallel())
    parallelize_module(lm.lm_head, tp, ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                                       use_local_output=False))
    for layer in lm.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


class NativeStage(nn.Module):
    """A pipeline stage as a user writes it for torch's pipelining: HF's pieces called directly."""

    def __init__(self, lm: nn.Module, layers: range, first: bool, last: bool):
        super().__init__()
        self.config = lm.config
        self.embed = lm.model.embed_tokens if first else None
        self.rotary = lm.model.rotary_emb
        self.layers = nn.ModuleList(lm.model.layers[i] for i in layers)
        self.norm = lm.model.norm if last else None
        self.head = lm.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(x) if self.embed is not None else x
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=None,
                                  past_key_values=None, position_ids=positions)
        rotary = self.rotary(hidden, positions)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=mask, position_embeddings=rotary, position_ids=positions)
        return self.head(self.norm(hidden)) if self.head is not None else hidden


def native_pp(args, mesh, microbatches: int):
    lm = make_llama(args).lm
    stage = mesh["pp"].get_local_rank()
    half = args.layers // 2
    module = NativeStage(lm, range(half) if stage == 0 else range(half, args.layers), stage == 0, stage == 1)
    # FSDP2 over dp, as torchtitan composes pp with dp: DistributedDataParallel under torch's schedules
    # fails on torch 2.13 (its reducer sees each parameter once per microbatch: INTERNAL ASSERT)
    fully_shard(module, mesh=mesh["dp"], reshard_after_forward=False)
    pipe = PipelineStage(module, stage, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    return Schedule1F1B(pipe, microbatches, loss_fn=causal_lm_loss), module, stage


# -- measuring ---------------------------------------------------------------------------------
def saved_bytes(run) -> int:
    """Bytes of the distinct storages autograd saves while `run()` builds its graph, parameters
    (and their DTensor shards) excluded."""
    seen: dict[int, int] = {}
    params = set()

    def storage(t: torch.Tensor):
        while hasattr(t, "_local_tensor"):
            t = t._local_tensor
        return t.untyped_storage()

    def pack(t: torch.Tensor):
        s = storage(t)
        if s._cdata not in params:
            seen[s._cdata] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    del out
    return sum(seen.values())


def layer_formula(args, t: int, microbatch: int) -> float:
    """Bytes one Llama block keeps without recompute (tests/test_activations.py, f = 2h):
    4 (sbh (4 + 6 + 8) + 2 sb + a s b) / t with sequence parallelism (or t = 1)."""
    s, b, h, a = args.seq, microbatch, args.hidden, args.heads
    return 4 * (s * b * h * (4 + 6 + 8) + 2 * s * b + a * s * b) / t


def counted(step, batch) -> dict[str, int]:
    with CollectiveCounter(c10d=True) as counter:
        step(batch)
    return dict(counter.bytes)


def _native_data(args, layout: str):
    """DDP (dp=4) or FSDP2 per layer and root (zero3) around the whole model."""
    model = make_llama(args)
    if layout.startswith("zero3"):
        for layer in model.lm.model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model
    return DistributedDataParallel(model)


def _layers(model: nn.Module):
    """The decoder layers a model computes with, wherever its wrapper keeps them."""
    inner = model.module if isinstance(model, (sw.ParallelModule, DistributedDataParallel)) else model
    return inner.layers if hasattr(inner, "rotary") else inner.lm.model.layers  # a NativeStage (FSDP2's subclass)


def _compile(model: nn.Module, step, batch, backend: str) -> dict:
    """Compile each layer, run two steps; the graphs and breaks Dynamo counted meanwhile."""
    from torch._dynamo.utils import counters

    for layer in _layers(model):
        layer.compile(backend=backend)
    torch._dynamo.reset()
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    for _ in range(2):
        step(batch)
    reasons = sorted({k.splitlines()[0][:120] for k in counters["graph_break"]})
    return {"graphs": counters["stats"]["unique_graphs"] - graphs,
            "breaks": sum(counters["graph_break"].values()) - breaks, "reasons": reasons}


def _shardwise(args, layout: str, batches):
    if layout.startswith("pp"):
        plan = sw.Plan(stages=[f"lm.model.layers.{args.layers // 2}"])
        return sw.parallelize(make_llama(args), sw.ParallelConfig(pp=2, dp=2, microbatches=args.microbatches),
                              plan=plan, sample={"input_ids": batches[0][: args.batch]})
    if layout.startswith("tp"):  # compiled before torch 2.14: zero=0 (tp shards in ZeRO's flat buffers refused)
        zero = 0 if args.compile and not COMPILES_DTENSOR_VIEWS else 3
        return sw.parallelize(make_llama(args), sw.ParallelConfig(tp=2, dp=2, sequence_parallel=True, zero=zero),
                              plan="llama")
    return sw.parallelize(make_llama(args), sw.ParallelConfig(zero=3 if layout.startswith("zero3") else 0))


def _bench(args, layout: str):
    rank = dist.get_rank()
    replicas = 2 if layout.startswith(("tp", "pp")) else 4
    gen = torch.Generator().manual_seed(100)
    batches = [torch.randint(0, VOCAB, (replicas * args.batch, args.seq), generator=gen) for _ in range(args.steps)]
    result = {}
    if layout.startswith("tp"):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        native = native_tp_sp(args, mesh)
        replica = mesh["dp"].get_local_rank()

        def native_loss(batch):
            with loss_parallel():
                return native({"input_ids": batch})

        def native_step(batch):
            with loss_parallel():
                native({"input_ids": batch}).backward()
    elif layout.startswith("pp"):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        schedule, native, stage = native_pp(args, mesh, args.microbatches)
        replica, native_loss = mesh["dp"].get_local_rank(), None

        def native_step(batch):
            if stage == 0:
                schedule.step(batch)
            else:
                schedule.step(target=batch)
    else:
        native, replica, native_loss = _native_data(args, layout), rank, None

        def native_step(batch):
            native({"input_ids": batch}).backward()

    mine = [b[replica * args.batch: (replica + 1) * args.batch] for b in batches]
    ours = _shardwise(args, layout, batches)
    steps = {"shardwise": training_step(lambda b: ours.train_step({"input_ids": b}),
                                        sw.build_optimizer(ours, torch.optim.AdamW, lr=1e-4)),
             "torch native": training_step(native_step, torch.optim.AdamW(native.parameters(), lr=1e-4))}
    if args.compile:
        result["dynamo"] = {"shardwise": _compile(ours, steps["shardwise"], mine[0], args.backend),
                            "torch native": _compile(native, steps["torch native"], mine[0], args.backend)}
        eager = _shardwise(args, layout, batches)
        steps["shardwise eager"] = training_step(lambda b: eager.train_step({"input_ids": b}),
                                                 sw.build_optimizer(eager, torch.optim.AdamW, lr=1e-4))
    result["times"] = timed_rounds(steps, mine, args.rounds)
    result["rank"] = rank
    result["params"] = sum(p.numel() for p in make_llama(args).parameters())
    if args.compile or not layout.startswith(("tp", "pp")):
        return result
    result["bytes"] = {name: counted(go, mine[0]) for name, go in steps.items()}
    result["microbatch"] = args.batch // (args.microbatches if layout.startswith("pp") else 1)
    memory = sw.activation_memory(ours, {"input_ids": mine[0]})
    result["ours_memory"] = (memory.total, memory.per_layer, len(memory.layers))
    if native_loss is not None:
        result["native_memory"] = saved_bytes(lambda: native_loss(mine[0]))
    return result


def _report(args, layout: str, results: list[dict]) -> None:
    res = results[0]
    times = res["times"]
    median = {name: statistics.median(v) for name, v in times.items()}
    compiled = f", layers compiled ({args.backend})" if args.compile else ""
    print(f"\n{layout}: HF Llama {res['params'] / 1e6:.1f} M params ({args.layers} layers, hidden {args.hidden}, "
          f"seq {args.seq}), {args.batch} samples per replica per step, AdamW, 4 gloo ranks{compiled}")
    for name, found in res.get("dynamo", {}).items():
        print(f"  {name:<16} {found['graphs']} graphs, {found['breaks']} graph breaks in the first two steps"
              + (f" ({'; '.join(found['reasons'])[:200]})" if found["breaks"] else ""))
    for name, values in times.items():
        print(f"  {name:<16} {median[name] * 1e3:9.1f} ms/step   rounds: " + " ".join(f"{t * 1e3:.0f}" for t in values))
    print(f"  ratio shardwise / native step rate: {median['torch native'] / median['shardwise']:.3f}  (aim >= 1.0)")
    if "shardwise eager" in median:
        print(f"  compiled / eager (shardwise) step rate: {median['shardwise eager'] / median['shardwise']:.3f}")
    if "bytes" not in res:
        return

    b, s, h, mb = args.batch, args.seq, args.hidden, res["microbatch"]
    t = 2 if layout.startswith("tp") else 1
    formula = layer_formula(args, t, mb)
    print(f"  saved for backward, one microbatch of {mb} (MiB):")
    for r in results:
        total, per_layer, layers = r["ours_memory"]
        native = f", native {r['native_memory'] / 2**20:.2f} total" if "native_memory" in r else ""
        print(f"    rank {r['rank']}: shardwise {total / 2**20:.2f} total, {per_layer / 2**20:.3f} per layer over "
              f"{layers} layers (formula {formula / 2**20:.3f}, ratio {per_layer / formula:.3f}){native}")

    psi = res["params"]
    sbh = b * s * h * 4  # one replica's b*s*h activation, fp32 bytes
    mib = 2 ** 20
    if layout.startswith("tp"):
        # bytes in (an all-gather's shard, a reduce-scatter's whole input), per layer: Megatron's
        # sp saves each gathered input as its shard and gathers it again for the weight gradient
        # (6 all-gathers of sbh/t, 4 reduce-scatters of sbh); keeping the gathered inputs instead
        # needs 4 + 4 and saves t x more input bytes. ZeRO-3 adds 2 all-gathers of the parameter
        # shard (forward, backward) and a reduce-scatter of this rank's tp half of the gradients.
        shard = psi * 4 // 4
        megatron = (6 * args.layers * sbh // 2 + 2 * shard, 4 * args.layers * sbh + 2 * shard)
        kept = (4 * args.layers * sbh // 2 + 2 * shard, 4 * args.layers * sbh + 2 * shard)
        minimum = (f"all-gather / reduce-scatter {megatron[0] / mib:.0f} / {megatron[1] / mib:.0f} MiB with inputs "
                   f"saved as shards (Megatron), {kept[0] / mib:.0f} / {kept[1] / mib:.0f} MiB keeping them gathered")
    else:
        minimum = (f"sends {sbh / mib:.1f} MiB (b*s*h: the activation from stage 0, its gradient from stage 1) "
                   f"+ gradient all-reduce {psi * 4 // 2 / mib:.1f} MiB (this stage's half of the parameters)")
    print(f"  bytes per step per rank by operation (MiB), minimum {minimum}:")
    for r in results:
        for name, nbytes in r["bytes"].items():
            shown = ", ".join(f"{op} {n / 2**20:.1f}" for op, n in sorted(nbytes.items()))
            print(f"    rank {r['rank']} {name:<13} total {sum(nbytes.values()) / 2**20:7.1f}   {shown}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4, help="samples per data-parallel replica per step")
    parser.add_argument("--microbatches", type=int, default=4, help="pipeline microbatches")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2, help="steps per timed round")
    parser.add_argument("--layout", default="tp,pp", help="comma-separated: tp, pp, dp, zero3")
    parser.add_argument("--compile", action="store_true", help="compile every decoder layer of every model")
    parser.add_argument("--backend", default="inductor")
    args = parser.parse_args()
    names = {"tp": "tp2 x dp2 + sp", "pp": "pp2 x dp2", "dp": "dp4", "zero3": "zero3 x dp4"}
    for layout in (names[key] for key in args.layout.split(",")):
        _report(args, layout, sw.testing.run_on_ranks(_bench, 4, args, layout, timeout=3600))


if __name__ == "__main__":
    main()
