"""The planner against published training runs that nobody here made.

Each run is a model, a cluster and the layout its authors used, with the step time they
published (or what their tables give it from: FLOP/s per GPU with their FLOP count, tokens
per second) and memory where they published it. For each the planner predicts the step
time and memory of that exact layout (`sw.plan.evaluate`), and ranks it among every layout
the search would consider at the same degrees (dp, tp, pp, cp). Then, per model, the search's
own best pick is checked against the best MFU anyone published for that model and device, and
its hardware FLOP rate (HFU: recomputation counted) against the best any run of that size
reached there.

The calibration part (`calibrate=True`: every other row of Megatron-LM's weak-scaling table,
every other MPT size of llm-foundry's tables on A100 and H100, Llama 3's two 8K layouts: 16
runs) fixes the planner's fitted numbers (shardwise/planner/cluster.py: each device's
`gemm_efficiency`, the shared `matmul_overhead` and `elementwise`) and Megatron-LM's own
elementwise traffic (its fused kernels: `MEGATRON_EXECUTOR`); the other 39 are held out and
show how the model generalises to other sizes, layouts and executors. `--fit` prints the
numbers that fit the calibration part best. Megatron-LM's runs (2021-2022) wrote attention's
scores to memory (`ModelSpec(attention="megatron")`); the search's own picks run as shardwise
does, with torch's SDPA.

Run: python bench/planner_published.py [--fit] [--no-search]
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass, replace

import numpy as np
import torch

import shardwise as sw
from shardwise.planner import Cluster
from shardwise.planner.cost import RECOMPUTE_CODES, SCHEDULE_CODES
from shardwise.planner.cost import evaluate as evaluate_layouts
from shardwise.planner.model import MODELS, ModelSpec, gpt2_like
from shardwise.planner.search import _factorizations, _inner_grid, search

GIB = 2.0 ** 30
FP32 = torch.float32
SIZE_BAND = 2.5  # "a model of its size": parameters within this factor
SOURCES = {
    "megatron-t1": "Narayanan et al., SC21 (arXiv 2104.04473), Table 1: weak scaling, A100 80 GB, seq 2048, "
                   "V 51200; step = eq. 3's FLOPs (with recompute) / (GPUs x achieved TFLOP/s); microbatch sizes "
                   "and interleaving from Megatron-LM's examples/academic_paper_scripts/sc21/run_table_1.sh (as kept "
                   "in sail-sg/zero-bubble-pipeline-parallelism at 39f2c186)",
    "megatron-t2": "Narayanan et al., SC21 (arXiv 2104.04473), Table 2: ZeRO-3 without model parallelism vs PTD-P, "
                   "175B and 530B GPT; step as Table 1",
    "korthikanti": "Korthikanti et al. 2022 (arXiv 2205.05198), Tables 3 and 5: end-to-end iteration time, "
                   "full recompute vs sequence parallel + selective recompute, A100 80 GB",
    "llama3": "Llama 3 Herd of Models (arXiv 2407.21783), Table 4: 405B on H100, BF16 TFLOP/s per GPU; "
              "step = the planner's model FLOPs (6N + causal attention) / (GPUs x TFLOP/s)",
    "llm-foundry": "mosaicml/llm-foundry scripts/train/benchmarking/README.md (commit 061f2c7): MPT 125M-70B with "
                   "FSDP FULL_SHARD, flash attention, bf16; step = global batch tokens / (tokens/s per GPU x GPUs)",
    "torchtitan": "torchtitan benchmarks/llama3_h100_202412_torchtitan.md: Llama 3.1 8B, FSDP, H100 96 GB HBM2e at "
                  "500 W, seq 8192; step = local batch x seq / TPS per GPU; memory as published",
}


# FSDP reduce-scatters a wrapped block's whole gradient in one collective: buckets as large as a
# block (an 8B Llama's is 0.8 GiB in float32), where shardwise's default holds 25 MiB ones.
FSDP_BUCKET_MB = 4096.0

# Megatron-LM's fused kernels (LayerNorm, bias-GeLU, bias-dropout-add, scale-mask-softmax) move fewer values
# per token and hidden unit than eager PyTorch's ops (the device table's `elementwise`): fitted with the rest
# (`--fit`), on its runs of the calibration part.
MEGATRON_EXECUTOR = dict(elementwise=24.0)


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
                        executor=MEGATRON_EXECUTOR))
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
                        tflops=tflops, executor=dict(nics_per_node=1, **MEGATRON_EXECUTOR),
                        notes="DeepSpeed's collectives cross nodes on one NIC per node (the published rates')"))
    for spec, pp, batch, gpus, tflops in ((gpt175, 12, 1536, 384, 153), (gpt175, 12, 1536, 768, 149),
                                          (gpt175, 12, 1536, 1536, 141), (gpt530, 35, 2240, 560, 171),
                                          (gpt530, 35, 2240, 1120, 167), (gpt530, 35, 2240, 2240, 159)):
        dp = gpus // (8 * pp)
        runs.append(Run(f"megatron {spec.name} tp8 pp{pp} x{gpus}", "megatron-t2", f"PTD-P {spec.name} {gpus} GPUs",
                        spec, a100(gpus), 2048, batch,
                        dict(dp=dp, tp=8, pp=pp, recompute="full", microbatches=batch // dp), 1,
                        tflops=tflops, notes="1F1B assumed", executor=MEGATRON_EXECUTOR))
    # Korthikanti et al.: tp8, dp 1; full recompute vs sp + selective (one sequence a microbatch assumed).
    for b, heads, hidden, layers, pp, gpus, batch, full, present in (
            (22, 64, 6144, 48, 1, 8, 4, 1.42, 1.10), (175, 96, 12288, 96, 8, 64, 64, 18.13, 13.75),
            (530, 128, 20480, 105, 35, 280, 280, 49.05, 37.83), (1000, 160, 25600, 128, 64, 512, 512, 94.42, 71.49)):
        spec = megatron_gpt(b, heads, hidden, layers)
        for label, step, extra in (("full recompute", full, dict(recompute="full")),
                                   ("sp + selective", present, dict(recompute="selective", sequence_parallel=True))):
            runs.append(Run(f"korthikanti {b}B {label}", "korthikanti", f"{b}B {label}", spec, a100(gpus), 2048, batch,
                            dict(dp=1, tp=8, pp=pp, microbatches=batch, **extra), 1,
                            published_step=step, executor=MEGATRON_EXECUTOR,
                            notes="one sequence a microbatch, 1F1B assumed"))
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
                        notes="ZeRO-2, interleaved v4, no recompute assumed (Meta's pipeline schedule is its own)"))
    # torchtitan, Llama 3.1 8B, FSDP (ZeRO-3, gradients reduced in float32, its default), local batch 2, seq 8192,
    # selective AC, bf16 rows only (float8 is not in the planner). The H100s are HBM2e 96 GB at 500 W (below the SXM's peak, by torchtitan's own note).
    # Its peak is "between SXM and NVL" (989 and 835 TFLOP/s): the midpoint.
    titan = lambda gpus: Cluster(gpus, device="h100", memory_bytes=96 * GIB, hbm_bw=2.4e12, peak_flops=912e12)  # noqa: E731
    for gpus, label, tps, memory in ((8, "eager", 5762, 82.4), (8, "compiled", 6667, 77.0),
                                     (128, "eager", 5605, 67.0), (128, "compiled", 6514, 62.0)):
        runs.append(Run(f"torchtitan 8B fsdp{gpus} {label}", "torchtitan", f"Table {1 if gpus == 8 else 3} {label}",
                        MODELS["llama3-8b"], titan(gpus), 8192, 2 * gpus,
                        dict(dp=gpus, zero=3, recompute="selective", microbatches=1, reduce_dtype=FP32,
                             bucket_mb=FSDP_BUCKET_MB), 2,
                        tokens_per_gpu=tps,
                        memory_gib=memory))
    # llm-foundry's MPT: GPT-2's block with biases, learned positions, tied head, vocabulary 50368. FSDP
    # FULL_SHARD is ZeRO-3 over every GPU; "Activation Checkpointing True" is full recompute. Rows at 2048 tokens
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
                        tokens_per_gpu=tokens_per_gpu, calibrate=(device, size, seq) in calibrating))
    return runs


def predict(run: Run, cluster: Cluster | None = None):
    """The planner's Candidate for the run's own layout (bf16 parameters; gradients in float32
    where the source says the run reduced them so: Llama 3, torchtitan's default, llm-foundry's
    DEFAULT precision; Megatron's 2021-2022 runs do not say, so theirs are the parameters')."""
    config = sw.ParallelConfig(param_dtype=torch.bfloat16, **run.config)
    return sw.plan.evaluate(run.spec, cluster or run.executed_on, config, seq_len=run.seq, global_batch=run.global_batch,
                            virtual=run.virtual)


def hardware_share(spec: ModelSpec, seq: int, recompute: str | None, model_flops_per_token: float) -> float:
    """The FLOPs a device runs per model FLOP (HFU / MFU): full recompute runs every block's
    forward again (2 FLOPs per block parameter and token, 2 s h for causal attention), selective
    the attention's."""
    active = spec.layer_params[0] + spec.active_expert_params
    extra = {"full": 2 * active + 2 * spec.hidden * seq, "selective": 2 * spec.hidden * seq}.get(recompute, 0.0)
    return 1 + spec.layers * extra / model_flops_per_token


def _per_token(spec: ModelSpec, cluster: Cluster, seq: int, grid) -> np.ndarray:
    """Predicted seconds per sequence of every layout in `grid` that fits (inf where not)."""
    cost = evaluate_layouts(spec, cluster, grid, seq)
    return np.where(cost.memory <= cluster.usable_bytes, cost.step_seconds / (grid.dp * grid.micro_batch
                                                                               * grid.microbatches), np.inf)


def _bf16_grids(spec: ModelSpec, groups, global_batch: int):
    """The search's bf16 layout grid of each (dp, tp, pp, cp) in `groups` whose dp splits the batch."""
    for dp, tp, pp, cp in groups:
        grid = _inner_grid(dp, tp, pp, cp, global_batch // dp, spec.layers, (2,)) if global_batch % dp == 0 else None
        if grid is not None:
            yield grid


def ranks(run: Run, mine: float) -> list[tuple[int, int, float]]:
    """Where the run's predicted seconds per sequence stand among the bf16 layouts the search
    considers for its batch, as (position, fitting layouts, the fastest one's seconds over the
    run's), 1 = the fastest: at its degrees dp, tp, pp, cp with its own recompute and sequence
    parallelism (what its software had); at its degrees; over every factorization of its GPUs."""
    c = sw.ParallelConfig(**run.config).resolve(run.cluster.gpus)
    mine = mine / run.global_batch * (1 - 1e-9)
    own = (RECOMPUTE_CODES[c.recompute], int(c.sequence_parallel))
    out = []
    for groups, same in (([(c.dp, c.tp, c.pp, c.cp)], True), ([(c.dp, c.tp, c.pp, c.cp)], False),
                         (_factorizations(run.spec, run.executed_on, run.seq, True), False)):
        times = []
        for grid in _bf16_grids(run.spec, groups, run.global_batch):
            grid.reduce_bytes = 4 if c.reduce_dtype == torch.float32 else 0
            per_token = _per_token(run.spec, run.executed_on, run.seq, grid)
            if same:
                per_token = np.where((grid.recompute == own[0]) & (grid.sp == own[1]), per_token, np.inf)
            times.append(per_token)
        times = np.concatenate(times) if times else np.array([])
        fitting = times[np.isfinite(times)]
        out.append((int((fitting < mine).sum()) + 1, int(fitting.size),
                    float(fitting.min() / mine) if fitting.size else 1.0))
    return out


def best_without_new_features(spec: ModelSpec, cluster: Cluster, seq: int, global_batch: int) -> float:
    """The best MFU among the fitting bf16 layouts that use no zero-bubble schedule (no run in
    the corpus did) and no context parallelism (only Llama 3's 131K-token run did): how much of
    a pick's promise rests on them."""
    best = 0.0
    for grid in _bf16_grids(spec, _factorizations(spec, cluster, seq, False), global_batch):
        cost = evaluate_layouts(spec, cluster, grid, seq)
        mfu = cost.model_flops / (cost.step_seconds * cluster.gpus * cluster.spec.peak_flops)
        allowed = (cost.memory <= cluster.usable_bytes) & (grid.schedule != SCHEDULE_CODES["zero-bubble"])
        best = max(best, float(np.max(np.where(allowed, mfu, 0.0))))
    return best


def _calibration_error(runs: list[Run], fused: float, **device) -> float:
    """Root-mean-square log error of the runs' predicted step times with `device` overrides
    (`fused`: the elementwise traffic of runs whose executor sets its own, Megatron-LM's)."""
    logs = []
    for r in runs:
        overrides = dict(device, elementwise=fused) if "elementwise" in (r.executor or {}) else device
        got = predict(r, replace(r.executed_on, **overrides))
        logs.append(np.log(got.step_seconds / r.step_seconds(got.model_flops)) ** 2)
    return float(np.sqrt(np.mean(logs)))


def _best_efficiency(runs: list[Run], fused: float, **device) -> tuple[float, float]:
    """(gemm_efficiency, rms log error) that fit `runs` best with the other `device` overrides:
    a golden-section search."""
    lo, hi = 0.3, 1.0
    for _ in range(25):
        a, b = lo + 0.382 * (hi - lo), lo + 0.618 * (hi - lo)
        if (_calibration_error(runs, fused, gemm_efficiency=a, **device)
                < _calibration_error(runs, fused, gemm_efficiency=b, **device)):
            hi = b
        else:
            lo = a
    efficiency = (lo + hi) / 2
    return efficiency, _calibration_error(runs, fused, gemm_efficiency=efficiency, **device)


def fit(runs: list[Run]) -> tuple[float, float, float, dict[str, float], float]:
    """(elementwise, Megatron-LM's elementwise, matmul_overhead, gemm_efficiency per device, rms
    log error) that fit the calibration part best: a grid over the three shared numbers, each
    device's efficiency its best."""
    devices = sorted({r.cluster.device for r in runs if r.calibrate})
    best = None
    for elementwise in (16.0, 32.0, 48.0, 64.0):
        for fused in (8.0, 16.0, 24.0, 32.0, 48.0):
            for overhead in (0.0, 40e-6, 80e-6, 160e-6, 240e-6, 320e-6):
                efficiencies, squares = {}, 0.0
                for device in devices:
                    chosen = [r for r in runs if r.calibrate and r.cluster.device == device]
                    efficiencies[device], error = _best_efficiency(chosen, fused, elementwise=elementwise,
                                                                   matmul_overhead=overhead)
                    squares += error ** 2 * len(chosen)
                error = float(np.sqrt(squares / sum(r.calibrate for r in runs)))
                if best is None or error < best[-1]:
                    best = (elementwise, fused, overhead, efficiencies, error)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fit", action="store_true", help="print the calibration part's best gemm_efficiency")
    parser.add_argument("--no-search", action="store_true", help="skip the per-model search (MFU ceiling)")
    args = parser.parse_args()
    runs = corpus()
    if args.fit:
        elementwise, fused, overhead, efficiencies, error = fit(runs)
        print(f"fitted on the calibration part: elementwise {elementwise:.0f} (Megatron-LM's {fused:.0f}), "
              f"matmul_overhead {overhead * 1e6:.0f} us, "
              + ", ".join(f"{d} gemm_efficiency {e:.3f}" for d, e in efficiencies.items())
              + f" (rms log error {error:.3f}); the table has elementwise {sw.planner.DEVICES['a100'].elementwise:.0f} "
              f"(Megatron-LM's {MEGATRON_EXECUTOR['elementwise']:.0f}), "
              f"matmul_overhead {sw.planner.DEVICES['a100'].matmul_overhead * 1e6:.0f} us, "
              + ", ".join(f"{d} {sw.planner.DEVICES[d].gemm_efficiency:.3f}" for d in efficiencies))
    print(f"{'run':<42} {'part':<5} {'pub s':>8} {'pred s':>8} {'err':>7} {'pub MFU':>7} {'fits':>4} "
          f"{'mem GiB':>8} {'pub':>6} {'own':>9} {'gap':>5} {'degree':>6} {'all':>6}")
    errors: dict[str, list[float]] = {"calibration": [], "held out": []}
    memory_errors, published_mfu, faster, own_gaps = [], [], ([], [], []), []
    for r in runs:
        got = predict(r)
        published = r.step_seconds(got.model_flops)
        error = got.step_seconds / published - 1
        errors["calibration" if r.calibrate else "held out"].append(error)
        mfu = got.model_flops / (published * r.cluster.gpus * r.cluster.spec.peak_flops)
        share = hardware_share(r.spec, r.seq, got.config.recompute, got.model_flops / (r.global_batch * r.seq))
        published_mfu.append((r.cluster.device, r.spec.params, mfu, mfu * share))
        placed = ranks(r, got.step_seconds)
        # the share of the fitting layouts predicted faster than the published one: 0% = the fastest
        shares = [(position - 1) / fitting if fitting else float("nan") for position, fitting, _ in placed]
        for scope, share in zip(faster, shares):
            scope.extend([share] if got.fits and share == share else [])
        own_gaps.append(max(1 - placed[0][2], 0.0))  # 0 where nothing that fits beats it
        memory = f"{r.memory_gib:>6.1f}" if r.memory_gib else f"{'':>6}"
        if r.memory_gib:
            memory_errors.append(got.memory / GIB / r.memory_gib - 1)
        print(f"{r.name:<42} {'cal' if r.calibrate else 'held':<5} {published:>8.3f} {got.step_seconds:>8.3f} "
              f"{error:>+7.1%} {mfu:>7.1%} {'yes' if got.fits else 'NO':>4} {got.memory / GIB:>8.1f} {memory} "
              f"{placed[0][0]:>4}/{placed[0][1]:<4} {own_gaps[-1]:>5.1%} {shares[1]:>6.1%} {shares[2]:>6.1%}")
    for part, values in (*errors.items(), ("all", errors["calibration"] + errors["held out"])):
        magnitudes = [abs(e) for e in values]
        print(f"step time, {part}: median |error| {statistics.median(magnitudes):.1%}, max {max(magnitudes):.1%} "
              f"over {len(values)} runs (signed median {statistics.median(values):+.1%})")
    for note in dict.fromkeys(r.notes for r in runs if r.notes):
        print(f"assumed where the source does not say ({', '.join(r.name for r in runs if r.notes == note)}): {note}")
    if memory_errors:
        print(f"memory where published: errors {', '.join(f'{e:+.1%}' for e in memory_errors)}")
    print("share of the fitting layouts predicted faster than a published layout that fits (0% = the fastest):")
    for scope, shares in zip(("at its degrees with its own recompute and sp", "at its degrees", "over all degrees"),
                             faster):
        print(f"  {scope}: median {statistics.median(shares):.1%}, worst {max(shares):.1%}; top 5% for "
              f"{sum(x <= 0.05 for x in shares)} of {len(shares)}")
    print(f"the fastest layout at a published layout's degrees with its own recompute and sp is faster by (gap): "
          f"median {statistics.median(own_gaps):.1%}, max {max(own_gaps):.1%}; within 5% for "
          f"{sum(g <= 0.05 for g in own_gaps)} of {len(own_gaps)}")
    if args.no_search:
        return
    print(f"\nthe search's best pick per run against the best MFU published on its device for a model of "
          f"1/{SIZE_BAND:g}x to {SIZE_BAND:g}x its size:")
    over, over_hardware, without_new, on_own_software = [], [], [], []
    for r in runs:
        # the pick as shardwise runs it: torch's SDPA (flash attention), on the hardware itself
        best = search(replace(r.spec, attention="flash"), r.cluster, global_batch=r.global_batch, seq_len=r.seq, top=1,
                      dtypes=(2,))
        if not best:
            print(f"  {r.name:<42} nothing fits")
            continue
        band = [(m, h) for device, params, m, h in published_mfu
                if device == r.cluster.device and 1 / SIZE_BAND <= params / r.spec.params <= SIZE_BAND]
        published, hardware = max(m for m, _ in band), max(h for _, h in band)
        pick = best[0]
        pick_hardware = pick.mfu * hardware_share(r.spec, r.seq, pick.config.recompute,
                                                  pick.model_flops / pick.tokens_per_step)
        gap, hardware_gap = (pick.mfu - published) * 100, (pick_hardware - hardware) * 100
        over += [r.name] if gap > 5 else []
        over_hardware += [r.name] if hardware_gap > 5 else []
        older = ""
        if gap > 5:
            without = best_without_new_features(replace(r.spec, attention="flash"), r.cluster, r.seq, r.global_batch)
            # and as the run's own software would run it: its attention (Megatron's wrote the scores) and kernels
            own_software = best_without_new_features(r.spec, r.executed_on, r.seq, r.global_batch)
            older = f"; without zero-bubble and cp {without:6.1%}, on its own software {own_software:6.1%}"
            without_new.append(without - published)
            on_own_software.append(own_software - published)
        print(f"  {r.name:<42} {pick.layout():<66} MFU {pick.mfu:6.1%} vs published {published:6.1%} "
              f"({gap:+.1f} points); HFU {pick_hardware:6.1%} vs {hardware:6.1%} ({hardware_gap:+.1f}){older}")
    print(f"{len(over)} of {len(runs)} picks more than 5 MFU points above: {', '.join(over) or 'none'}")
    if without_new:
        print(f"  without zero-bubble schedules and context parallelism they stay {min(without_new) * 100:+.1f} to "
              f"{max(without_new) * 100:+.1f} points above: their promise rests on the rest of the layout; "
              f"run also with the attention and kernels of the run's own software, {min(on_own_software) * 100:+.1f} "
              f"to {max(on_own_software) * 100:+.1f}")
    print(f"{len(over_hardware)} of {len(runs)} picks would run more than 5 points of the peak above the FLOP rate "
          f"(HFU: recomputation counted) any published run of their size reached on their device: "
          f"{', '.join(over_hardware) or 'none'}")


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
