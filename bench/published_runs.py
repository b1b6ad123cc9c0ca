"""Published training runs that nobody here made, as the planner sees them.

Each `Run` is a model, a cluster and the layout its authors used, with the step time they
published (or what their tables give it from: FLOP/s per GPU with their FLOP count, tokens
per second) and memory where they published it; `SOURCES` names the paper table or file and
`Run.row` the row. `corpus()` holds them all, `predict()` is the planner's Candidate for a
run's own layout. bench/planner_published.py sets the planner against them; the calibration
part (`Run.calibrate`) is what its fitted numbers were fitted on.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

import shardwise as sw
from shardwise.planner import Cluster
from shardwise.planner.model import MODELS, ModelSpec, gpt2_like, llama_like

GIB = 2.0 ** 30
FP32 = torch.float32
SOURCES = {
    "megatron-t1": "Narayanan et al., SC21 (arXiv 2104.04473), Table 1: weak scaling, A100 80 GB, seq 2048, "
                   "V 51200; step = eq. 3's FLOPs (with recompute) / (GPUs x achieved TFLOP/s); microbatch sizes "
                   "and interleaving from Megatron-LM's examples/academic_paper_scripts/sc21/run_table_1.sh (as kept "
                   "in sail-sg/zero-bubble-pipeline-parallelism at 39f2c186)",
    "megatron-t2": "Narayanan et al., SC21 (arXiv 2104.04473), Table 2: ZeRO-3 without model parallelism vs PTD-P, "
                   "175B and 530B GPT; step as Table 1",
    "korthikanti": "Korthikanti et al. 2022 (arXiv 2205.05198), Tables 3 and 5: end-to-end iteration time, "
                   "full recompute vs sequence parallel + selective recompute, A100 80 GB (layouts: Table 3, "
                   "interleaving: Section 6); Table 4: one 22B layer's forward + backward",
    "llama3": "Llama 3 Herd of Models (arXiv 2407.21783), Table 4: 405B on H100, BF16 TFLOP/s per GPU; "
              "step = the planner's model FLOPs (6N + causal attention) / (GPUs x TFLOP/s)",
    "llm-foundry": "mosaicml/llm-foundry scripts/train/benchmarking/README.md (commit 061f2c7): MPT 125M-70B with "
                   "FSDP FULL_SHARD, flash attention, bf16; step = global batch tokens / (tokens/s per GPU x GPUs)",
    "torchtitan-2024": "torchtitan docs/performance.md (commit 3faaa1a0d, 2024-08): Llama 2 13B/70B and Llama 3 "
                       "8B/70B, FSDP2 on 64 A100 80 GB; Llama 3.1 405B, FSDP2 x TP8 on 128 H100 96 GB HBM2e at 500 W; "
                       "WPS per GPU; step = local batch x seq / WPS",
    "torchtitan": "torchtitan benchmarks/llama3_h100_202412_torchtitan.md: Llama 3.1 8B, FSDP, H100 96 GB HBM2e at "
                  "500 W, seq 8192; step = local batch x seq / TPS per GPU; memory as published",
}


# FSDP reduce-scatters a wrapped block's whole gradient in one collective: buckets as large as a
# block (an 8B Llama's is 0.8 GiB in float32), where shardwise's default holds 25 MiB ones.
FSDP_BUCKET_MB = 4096.0

# Megatron-LM's fused kernels (LayerNorm, bias-GeLU, bias-dropout-add, scale-mask-softmax) move fewer values
# per token and hidden unit than eager PyTorch's ops (the device table's `elementwise`): fitted with the rest
# (`--fit`), on its runs of the calibration part. Its recompute and sequence parallelism run as
# `Cluster(executor="megatron")` describes (planner/cluster.py's EXECUTORS).
MEGATRON_EXECUTOR = dict(elementwise=32.0, executor="megatron")
# SC21's runs (Narayanan et al., 2021) predate the backward all-reduce beside the weight gradients that
# Korthikanti et al. (2022) describe as their optimization: their tp collectives are all exposed (assumed: neither
# paper dates it); their gradients are all-reduced after the backward (Megatron-LM's --overlap-grad-reduce came later)
MEGATRON_2021_EXECUTOR = dict(MEGATRON_EXECUTOR, executor="megatron-2021")


# Korthikanti et al. 2022, Table 4: one transformer layer of the 22B (its Table 3 layout: tp8, a microbatch of 4
# sequences of 2048), forward + backward in ms, by (recompute, sequence parallel): a per-layer test of the
# recompute and sp terms that the end-to-end rows mix with everything else.
KORTHIKANTI_LAYER_MS = {(None, False): 19.6, (None, True): 19.0, ("full", False): 27.2,
                        ("selective", False): 20.9, ("selective", True): 20.3}


SC21_OVERLAP = "tp's backward all-reduces exposed, gradients all-reduced after the backward (Megatron-LM of 2021)"


def megatron_gpt(billions: float, heads: int, hidden: int, layers: int) -> ModelSpec:
    """Megatron's GPT: learned positions (2048), GELU MLP of 4h, LayerNorm, tied head, V 51200;
    attention's scores written to memory (flash attention came to Megatron-LM in 2023)."""
    return replace(gpt2_like(f"gpt-{billions}b", layers, hidden, heads, 51200, 2048), attention="megatron")


def megatron_flops(spec: ModelSpec, batch: int, seq: int) -> float:
    """Narayanan et al.'s eq. 3: FLOPs per iteration with activation recomputation."""
    h, layers = spec.hidden, spec.layers
    return 96 * batch * seq * layers * h * h * (1 + seq / (6 * h) + spec.vocab / (16 * layers * h))


@dataclass
class Run:
    """One published run: the layout its authors used and what they measured."""

    name: str
    source: str  # a key of SOURCES, and the row
    row: str
    spec: ModelSpec
    cluster: Cluster
    seq: int
    global_batch: int
    config: dict
    micro_batch: int
    published_step: float | None = None  # seconds, when published directly
    tflops: float | None = None  # achieved TFLOP/s per GPU, when that is what was published
    tokens_per_gpu: float | None = None  # tokens/s per GPU
    memory_gib: float | None = None
    calibrate: bool = False
    virtual: int = 1
    notes: str = ""  # what the source does not say and the layout assumes
    executor: dict | None = None  # Cluster overrides for what the run's software reached on the hardware
    optimizer: str = "fused"  # its optimizer step's implementation (planner/timing.py's OPTIMIZER_CODES)

    @property
    def executed_on(self) -> Cluster:
        """The cluster as the run's software used it: the hardware with `executor`'s overrides
        (the search's own picks run on the hardware itself)."""
        return replace(self.cluster, **self.executor) if self.executor else self.cluster

    def step_seconds(self, model_flops: float) -> float:
        """The published step time, in seconds."""
        if self.published_step is not None:
            return self.published_step
        if self.tokens_per_gpu is not None:
            return self.global_batch * self.seq / (self.tokens_per_gpu * self.cluster.gpus)
        flops = megatron_flops(self.spec, self.global_batch, self.seq) if self.source.startswith("megatron") \
            else model_flops
        return flops / (self.cluster.gpus * self.tflops * 1e12)


def corpus() -> list[Run]:
    runs = []
    a100 = lambda gpus: Cluster(gpus, device="a100")  # noqa: E731  Selene: DGX A100 80 GB, 8 x 200 Gb/s HDR per node
    # Megatron Table 1: (billions, heads, hidden, layers, tp, pp, GPUs, batch, TFLOP/s per GPU, microbatch size,
    # virtual stages). Full recompute (eq. 3 counts it), no ZeRO, no sequence parallelism (2021), fp16. The
    # microbatch sizes and the interleaved schedule's stages (--num-layers-per-virtual-pipeline-stage) are the
    # paper's own launch script's (SOURCES["megatron-t1"]).
    for b, heads, hidden, layers, tp, pp, gpus, batch, tflops, micro, virtual in (
            (1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 16, 1), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 16, 1),
            (7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 16, 1), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 8, 1),
            (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 4, 1), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 2, 3),
            (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 2, 2), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 1, 2),
            (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 1, 3),
            (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 1, 1)):
        dp = gpus // (tp * pp)
        schedule = dict(schedule="interleaved-1f1b") if virtual > 1 else {}
        runs.append(Run(f"megatron {b}B tp{tp} pp{pp} x{gpus}", "megatron-t1", f"{b}B row",
                        megatron_gpt(b, heads, hidden, layers), a100(gpus), 2048, batch,
                        dict(dp=dp, tp=tp, pp=pp, recompute="full", microbatches=batch // dp // micro, **schedule), micro,
                        tflops=tflops, calibrate=b in (1.7, 7.5, 39.1, 145.6, 529.6), virtual=virtual,
                        executor=MEGATRON_2021_EXECUTOR, notes=SC21_OVERLAP))
    # Megatron Table 2: ZeRO-3 (DeepSpeed) without model parallelism, and PTD-P (tp8, pp12 / pp35), full recompute.
    # DeepSpeed's ZeRO-3 of 2021 moved its bytes across nodes at one NIC's rate per node, not over the node's
    # eight: doubling the GPUs at a fixed batch left its step time unchanged (66.7 s at 768 and 1536 GPUs), and
    # (published - compute) s carries its 3 x 349 GB of gathers and reduce-scatter at 19-28 GB/s a GPU, one HDR
    # NIC's 20-25 (NCCL's eight rings would reach 160). Modelled as nics_per_node=1 on its rows: no number is
    # fitted, but the choice was read off the 175B rows' scaling; the 530B rows test it. DeepSpeed ran
    # Megatron-LM's GPT, its fused kernels and attention.
    gpt175, gpt530 = megatron_gpt(174.6, 96, 12288, 96), megatron_gpt(529.6, 128, 20480, 105)
    for spec, batch, gpus, micro, tflops in ((gpt175, 1536, 384, 4, 144), (gpt175, 1536, 768, 2, 88),
                                             (gpt175, 1536, 1536, 1, 44), (gpt530, 2560, 640, 4, 138),
                                             (gpt530, 2240, 1120, 2, 98), (gpt530, 2240, 2240, 1, 48)):
        runs.append(Run(f"megatron {spec.name} zero3 x{gpus}", "megatron-t2", f"ZeRO-3 {spec.name} {gpus} GPUs",
                        spec, a100(gpus), 2048, batch,
                        dict(dp=gpus, zero=3, recompute="full", microbatches=batch // gpus // micro), micro,
                        tflops=tflops, executor=dict(nics_per_node=1, **MEGATRON_2021_EXECUTOR),
                        notes="DeepSpeed's collectives cross nodes on one NIC per node (the published rates')"))
    for spec, pp, batch, gpus, tflops in ((gpt175, 12, 1536, 384, 153), (gpt175, 12, 1536, 768, 149),
                                          (gpt175, 12, 1536, 1536, 141), (gpt530, 35, 2240, 560, 171),
                                          (gpt530, 35, 2240, 1120, 167), (gpt530, 35, 2240, 2240, 159)):
        dp = gpus // (8 * pp)
        runs.append(Run(f"megatron {spec.name} tp8 pp{pp} x{gpus}", "megatron-t2", f"PTD-P {spec.name} {gpus} GPUs",
                        spec, a100(gpus), 2048, batch,
                        dict(dp=dp, tp=8, pp=pp, recompute="full", microbatches=batch // dp), 1,
                        tflops=tflops, notes=f"1F1B assumed; {SC21_OVERLAP}", executor=MEGATRON_2021_EXECUTOR))
    # Korthikanti et al.: tp8, dp 1; full recompute vs sp + selective. Table 3 gives the microbatch sizes (the 22B
    # runs its batch of 4 as one microbatch, the others one sequence a microbatch); Section 6: "the interleaving
    # schedule with three interleaving stages" for 175B and 530B (1T's is plain 1F1B, as the text implies).
    for b, heads, hidden, layers, pp, gpus, batch, micro, virtual, full, present in (
            (22, 64, 6144, 48, 1, 8, 4, 4, 1, 1.42, 1.10), (175, 96, 12288, 96, 8, 64, 64, 1, 3, 18.13, 13.75),
            (530, 128, 20480, 105, 35, 280, 280, 1, 3, 49.05, 37.83),
            (1000, 160, 25600, 128, 64, 512, 512, 1, 1, 94.42, 71.49)):
        spec = megatron_gpt(b, heads, hidden, layers)
        schedule = dict(schedule="interleaved-1f1b") if virtual > 1 else {}
        for label, step, extra in (("full recompute", full, dict(recompute="full")),
                                   ("sp + selective", present, dict(recompute="selective", sequence_parallel=True))):
            runs.append(Run(f"korthikanti {b}B {label}", "korthikanti", f"{b}B {label}", spec, a100(gpus), 2048, batch,
                            dict(dp=1, tp=8, pp=pp, microbatches=batch // micro, **schedule, **extra), micro,
                            published_step=step, executor=MEGATRON_EXECUTOR, virtual=virtual,
                            notes="1T's schedule 1F1B assumed" if b == 1000 else ""))
    # Llama 3 405B, Table 4. Meta ran FSDP that keeps parameters between forward and backward (ZeRO-2 here)
    # reducing gradients in float32, sequence parallel tp, no activation checkpointing at 8K; one sequence per
    # microbatch assumed.
    h100 = lambda gpus: Cluster(gpus, device="h100")  # noqa: E731
    for gpus, seq, cp, dp, per_dp, tflops, held_out in ((8192, 8192, 1, 64, 32, 430, False),
                                                         (16384, 8192, 1, 128, 16, 400, False),
                                                         (16384, 131072, 16, 8, 16, 380, True)):
        runs.append(Run(f"llama3 405B x{gpus} seq {seq}", "llama3", f"{gpus} GPUs seq {seq}", MODELS["llama3-405b"],
                        h100(gpus), seq, dp * per_dp,
                        dict(dp=dp, tp=8, pp=16, cp=cp, zero=2, sequence_parallel=True, microbatches=per_dp,
                             schedule="interleaved-1f1b", reduce_dtype=FP32), 1, tflops=tflops, calibrate=not held_out, virtual=4,
                        executor=dict(executor="megatron"),
                        notes="ZeRO-2, interleaved v4, no recompute, Megatron-LM's sp (its backward all-gathers hidden) "
                              "assumed (Meta's pipeline schedule is its own)"))
    # torchtitan, Llama 3.1 8B, FSDP (ZeRO-3, gradients reduced in float32, its default), local batch 2, seq 8192,
    # bf16 rows only (float8 is not in the planner). The H100s are HBM2e 96 GB at 500 W: their peak lies between the
    # SXM's 989 and the NVL's 835 TFLOP/s, by torchtitan's note, which does not know it exactly (912 is the midpoint).
    # At the benchmark's commit (9dec370, train_configs/llama3_8b.toml and train.py): selective AC with its "op"
    # policy, which keeps the matmuls' and attention's outputs but every second mm's (shardwise's
    # selective-alternate); torch.compile compiles each TransformerBlock (`Cluster(compiled=True)`), not the loss
    # ("compiling loss function causes CUDA errors, turning off for now"): both rows run torch's eager cross-entropy on
    # float32 logits; AdamW is torch's foreach one (--optimizer.fused is off by default); zero_grad(set_to_none=True)
    # frees the gradients between steps (the "fsdp2" executor:
    # bench/planner_torchtitan.py measures that step's allocated peak). Memory is published as the peak the
    # caching allocator reserved (max_reserved_gib); the planner predicts the peak allocated, which it cannot
    # exceed.
    titan = lambda gpus: Cluster(gpus, device="h100", memory_bytes=96 * GIB, hbm_bw=2.4e12, peak_flops=912e12)  # noqa: E731
    for gpus, label, tps, memory in ((8, "eager", 5762, 82.4), (8, "compiled", 6667, 77.0),
                                     (128, "eager", 5605, 67.0), (128, "compiled", 6514, 62.0)):
        runs.append(Run(f"torchtitan 8B fsdp{gpus} {label}", "torchtitan", f"Table {1 if gpus == 8 else 3} {label}",
                        MODELS["llama3-8b"], titan(gpus), 8192, 2 * gpus,
                        dict(dp=gpus, zero=3, recompute="selective-alternate", microbatches=1, reduce_dtype=FP32,
                             bucket_mb=FSDP_BUCKET_MB), 2,
                        tokens_per_gpu=tps, executor=dict(executor="fsdp2", compiled=label == "compiled"), optimizer="foreach",
                        memory_gib=memory))
    # torchtitan's earlier A100 runs (SOURCES["torchtitan-2024"]; run at its April 2024 code, 1ea476e9f): FSDP2 over
    # all 64 GPUs (ZeRO-3, bf16 parameters, gradients reduced in float32), eager (its presets: compile = false), the
    # loss on float32 logits (`self.output(h).float()`), foreach AdamW, the presets' norms: fused_rmsnorm for the 8B
    # and 13B, torchtitan's float32 RMSNorm for the 70Bs (which keeps what Hugging Face's does). "selective op" is its
    # op policy (shardwise's selective-alternate), "full" full recompute. Its "selective layer" rows (every second
    # block fully recomputed, the rest kept whole) have no planner equivalent and are left out.
    llama2_13b = llama_like("llama2-13b", 40, 5120, 40, 40, 13824, 32000)
    llama2_70b = llama_like("llama2-70b", 80, 8192, 64, 8, 28672, 32000)
    for label, spec, fused_norm, seq, batch, recompute, tps in (
            ("llama3 8B selective op", MODELS["llama3-8b"], True, 8192, 1, "selective-alternate", 2973),
            ("llama3 70B full", MODELS["llama3-70b"], False, 8192, 1, "full", 331),
            ("llama2 13B no recompute", llama2_13b, True, 4096, 2, None, 2162),
            ("llama2 13B selective op", llama2_13b, True, 4096, 2, "selective-alternate", 1904),
            ("llama2 70B selective op", llama2_70b, False, 4096, 1, "selective-alternate", 355),
            ("llama2 70B full", llama2_70b, False, 4096, 2, "full", 353)):
        runs.append(Run(f"torchtitan {label} a100 fsdp64", "torchtitan-2024", label,
                        replace(spec, norm_float32=not fused_norm), Cluster(64, device="a100"), seq, batch * 64,
                        dict(dp=64, zero=3, recompute=recompute, microbatches=1, reduce_dtype=FP32,
                             bucket_mb=FSDP_BUCKET_MB), batch,
                        tokens_per_gpu=tps, executor=dict(executor="fsdp2"), optimizer="foreach",
                        notes="the presets' norms, tp 1 and the table's batch (the table names neither)"))
    # its 405B (Llama 3.1 table, bf16 row; train_configs/llama3_405b.toml at 3faaa1a0d): FSDP 16 x TP 8 with sequence
    # parallelism and a loss-parallel head, full recompute, local batch 2 of 8K tokens, the preset's compiled blocks
    # and float32 RMSNorm, on the same 500 W H100s as the 8B's
    runs.append(Run("torchtitan llama3 405B full h100 fsdp16 tp8", "torchtitan-2024", "405B full", MODELS["llama3-405b"],
                    titan(128), 8192, 32,
                    dict(dp=16, tp=8, sequence_parallel=True, zero=3, recompute="full", microbatches=1,
                         reduce_dtype=FP32, bucket_mb=FSDP_BUCKET_MB), 2,
                    tokens_per_gpu=109, executor=dict(executor="fsdp2", compiled=True), optimizer="foreach",
                    notes="the preset's compile and norm (the table names neither)"))
    # llm-foundry's MPT: GPT-2's block with biases, learned positions, tied head, vocabulary 50368. FSDP
    # FULL_SHARD is ZeRO-3 over every GPU; "Activation Checkpointing True" is full recompute, by torch 1.13's
    # checkpoint (the README says its tables still await a torch 2.0 rerun), which reran a block's whole
    # forward. Rows at 2048 tokens
    # (and two at 8192), one per model size and device. Every other size calibrates (the H100's with Llama 3's
    # two 8K runs), the rest are held out.
    mpt = {"125m": (768, 12, 12), "350m": (1024, 16, 24), "760m": (1536, 12, 24), "1b": (2048, 16, 24),
           "3b": (2560, 20, 32), "7b": (4096, 32, 32), "13b": (5120, 40, 40), "30b": (7168, 56, 48),
           "70b": (8192, 64, 80)}
    calibrating = {("a100", "125m", 2048), ("a100", "760m", 2048), ("a100", "3b", 2048), ("a100", "13b", 2048),
                   ("a100", "30b", 2048), ("a100", "7b", 8192), ("h100", "1b", 2048), ("h100", "7b", 2048),
                   ("h100", "30b", 2048)}
    for device, size, seq, gpus, micro, accum, checkpointing, tokens_per_gpu in (
            ("a100", "125m", 2048, 8, 40, 2, False, 142830), ("a100", "350m", 2048, 8, 32, 2, False, 58782),
            ("a100", "760m", 2048, 8, 24, 2, False, 32434), ("a100", "1b", 2048, 8, 14, 4, False, 20513),
            ("a100", "3b", 2048, 8, 10, 2, False, 10811), ("a100", "7b", 2048, 8, 6, 2, False, 4641),
            ("a100", "13b", 2048, 8, 2, 3, False, 2262), ("a100", "30b", 2048, 8, 3, 21, True, 916),
            ("a100", "70b", 2048, 64, 8, 4, True, 410), ("a100", "7b", 8192, 8, 8, 2, True, 3206),
            ("a100", "13b", 8192, 8, 5, 3, True, 1795),
            ("h100", "1b", 2048, 8, 14, 1, False, 45455), ("h100", "3b", 2048, 16, 10, 3, False, 24142),
            ("h100", "7b", 2048, 8, 6, 1, False, 10643), ("h100", "13b", 2048, 64, 2, 1, False, 4800),
            ("h100", "30b", 2048, 8, 3, 21, True, 2002), ("h100", "70b", 2048, 64, 8, 4, True, 1039),
            ("h100", "7b", 8192, 8, 8, 2, True, 6935)):
        hidden, heads, layers = mpt[size]
        spec = gpt2_like(f"mpt-{size}", layers, hidden, heads, 50368, seq)
        runs.append(Run(f"mpt {size} {device} seq {seq} fsdp{gpus}", "llm-foundry", f"{device} {size} {seq} {gpus} GPUs",
                        spec, Cluster(gpus, device=device), seq, micro * accum * gpus,
                        dict(dp=gpus, zero=3, recompute="full" if checkpointing else None, microbatches=accum,
                             reduce_dtype=None if (device, size) == ("a100", "70b") else FP32,
                             bucket_mb=FSDP_BUCKET_MB), micro,
                        tokens_per_gpu=tokens_per_gpu, calibrate=(device, size, seq) in calibrating,
                        executor=dict(executor="torch-1.13")))
    # every run's loss but torchtitan's is a fused kernel that writes the logits' gradient in place: Megatron's
    # vocab-parallel cross-entropy (also Meta's, a Megatron descendant), llm-foundry's fused_crossentropy
    # (flash-attn's, its default); torchtitan's is torch's eager one (above)
    return [r if r.source.startswith("torchtitan") else replace(r, spec=replace(r.spec, fused_loss=True)) for r in runs]


def predict(run: Run, cluster: Cluster | None = None):
    """The planner's Candidate for the run's own layout (bf16 parameters; gradients in float32
    where the source says the run reduced them so: Llama 3, torchtitan's default, llm-foundry's
    DEFAULT precision; Megatron's 2021-2022 runs do not say, so theirs are the parameters'), and
    its optimizer step (`Run.optimizer`: fused for Megatron's and DeepSpeed's Adam and
    llm-foundry's, counted alike; torch's foreach AdamW for torchtitan's, its default)."""
    config = sw.ParallelConfig(param_dtype=torch.bfloat16, **run.config)
    return sw.plan.evaluate(run.spec, cluster or run.executed_on, config, seq_len=run.seq, global_batch=run.global_batch,
                            virtual=run.virtual, optimizer=run.optimizer)
