"""The machines a plan runs on: device memory, peak FLOP/s and link bandwidths.

The table holds vendors' datasheet numbers (dense bf16 tensor and plain float32 FLOP/s, HBM
size and bandwidth), the bus bandwidth a ring collective reaches over NVLink inside a node
and over the network between nodes (per GPU, one direction, bytes/s), the latency of one
collective step on each, and three calibrated numbers: the fraction of the tensor-core peak
a large matmul reaches in a training step (`gemm_efficiency`, per device), a matmul's fixed
cost (`matmul_overhead`) and the traffic of a block's elementwise ops (`elementwise`), fitted
on part of bench/planner_published.py's corpus of published runs (the rest shows how they
generalise).
Any of them can be overridden: `Cluster(gpus=64, device="h100", inter_node_bw=25e9)`, or the
fitted ones to a machine's own runs. `nics_per_node` says how many NICs a node's cross-node
traffic spreads over (DGX-style nodes: one per GPU, the default). `compiled=True` plans blocks
compiled with torch.compile (`pmodel.compile()`), whose elementwise work moves a counted share
of eager's traffic.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np

from ..errors import ConfigError

GB = 1e9
GIB = 2.0 ** 30


@dataclass(frozen=True)
class Device:
    name: str
    memory_bytes: float
    peak_flops: float  # dense bf16 (the local CPU's: float32)
    intra_node_bw: float  # bytes/s per GPU inside a node (NVLink), one direction
    inter_node_bw: float  # bytes/s per NIC between nodes (InfiniBand / RoCE), one direction; one NIC per GPU
    fp32_flops: float = 0.0  # plain float32 (torch's default matmul precision, no TF32); 0: peak_flops
    hbm_bw: float = 1e12  # bytes/s of device memory
    gemm_efficiency: float = 0.6  # of the peak, a large matmul inside a training step (calibrated)
    matmul_overhead: float = 0.0  # seconds a matmul costs beyond its FLOPs: launch, tail wave (calibrated)
    elementwise: float = 48.0  # values per token and hidden unit a block's elementwise ops move (calibrated)
    intra_latency: float = 5e-6  # seconds per step of a collective inside a node
    inter_latency: float = 15e-6  # ... between nodes


# Memory is what torch.cuda reports as the device's total (an "80 GB" part holds 79.3-79.6 GiB).
# Link bandwidths are 80% of the link rate (NVLink per direction; the network's per-GPU NIC),
# what nccl-tests' bus bandwidth reaches on large messages.
DEVICES = {
    "h100": Device("h100", 79.6 * GIB, 989e12, 360 * GB, 40 * GB, 67e12, 3.35e12, 0.66, 80e-6),
    "h200": Device("h200", 139.8 * GIB, 989e12, 360 * GB, 40 * GB, 67e12, 4.8e12, 0.66, 80e-6),  # the H100's chip
    "a100": Device("a100", 79.3 * GIB, 312e12, 240 * GB, 20 * GB, 19.5e12, 2.04e12, 0.78, 80e-6),
    "b200": Device("b200", 192 * GB, 2250e12, 720 * GB, 40 * GB, 80e12, 8e12, 0.66, 80e-6),  # no published run: H100's
    # this machine's CPU ranks (gloo over loopback): rough, for ranking local layouts only
    "local": Device("local", 0.0, 5e10, 2 * GB, 2 * GB, 5e10, 10 * GB, 1.0, 0.0, 48.0, 50e-6, 50e-6),
}


# The elementwise traffic of a block compiled with torch.compile, as a share of eager's: inductor fuses its
# norms, residual adds, rotary and activation, forward and backward, into a few kernels. Counted, not fitted
# (bench/elementwise_count.py, torch 2.13): Hugging Face Llama's block moves 65.9 bf16 values per token and hidden
# unit through inductor's kernels against 235.6 through eager's ops (GPT-2's block: 0.259 of eager's).
COMPILED_ELEMENTWISE_SHARE = 0.279


class Executor(NamedTuple):
    """How a step runs where training stacks differ (`Cluster.executor` names one of EXECUTORS).
    Each field changes one term of the time or memory model, read where that term is computed;
    Korthikanti et al.'s Table 4 (one 22B layer, with and without sp, full and selective
    recompute) tests the Megatron-LM fields in bench/planner_published.py."""

    # Full recompute runs a block's whole forward again, its last matmul (the down projection) and
    # reduction included, as a reentrant checkpoint or torch's before 2.1 did; torch's since stops
    # once backward has what it needs.
    full_reruns_last: bool
    # Selective recompute runs again, under tp, the row-parallel matmuls whose full-size partial sums
    # it does not keep (shardwise's, torch's selective checkpointing policy).
    selective_reruns_partials: bool
    # Sequence parallelism's backward all-gather of a column-parallel layer's input runs beside the
    # input-gradient matmul (Megatron-LM's and shardwise's), not before it.
    sp_gather_hidden: bool
    # Under recompute the column-parallel inputs are gathered again by the recomputation's forward,
    # before anything can run beside them (shardwise's recompute covers the whole block; Megatron-LM's
    # selective recomputes attention's core and keeps the shards as without it).
    recompute_gathers: bool
    # ZeRO-3 under mixed precision keeps a low-precision copy of its parameter shard beside the float32
    # master (DeepSpeed's stage 3), 2 bytes an element more than casting the master as it is gathered
    # (FSDP's, shardwise's).
    zero3_cast_shard: bool
    # Under dp the gradients stay allocated between steps at ZeRO stages below this one: shardwise's
    # stage 0/1 buckets (as DDP's), Megatron-LM's main-gradient buffers and DeepSpeed's partitions at
    # every stage (4). zero_grad(set_to_none=True) frees the rest (shardwise's ZeRO-2/3 shards,
    # torchtitan's FSDP2, Composer's FSDP: 0), so the first microbatch's loss backward runs before any
    # exists (measured on torchtitan's own step: bench/planner_torchtitan.py; on shardwise's ZeRO-2,
    # bench/planner.py's gpt-vocab on 4 ranks: its in-step peak fell by exactly the shard).
    grads_kept_below_zero: int = 4
    # Selective recompute reruns attention's core (its two batched matmuls, the scores' softmax and
    # dropout) and nothing else: Megatron-LM's `--recompute-granularity selective`. Otherwise it keeps
    # the matmuls' outputs and reruns the block's elementwise work (shardwise's).
    selective_reruns_attention_core: bool = False
    # Of the `elementwise` values a block moves per token and hidden unit, those outside the tp
    # regions, which every tp rank runs whole without sp; the rest runs on the rank's tp shard. None:
    # all of them (eager PyTorch's norms, residuals and casts). Megatron-LM's fused kernels: two
    # LayerNorms (a read and a write each) and two bias-dropout-adds (two reads, a write and a one-byte
    # mask each), 11. A Cluster whose `elementwise` is below it is refused.
    tp_replicated_elementwise: float | None = None
    # tp's two backward all-reduces (a column-parallel layer's input gradient) run beside its
    # weight-gradient matmul, charged OVERLAP_COST of their time: Megatron-LM's since 2022 ("an
    # optimization in the backward pass where we overlap all-reduce communication with the linear
    # weight's gradient computation"); shardwise's run before it.
    tp_backward_beside_weight_grads: bool = False
    # Without sp, a pipeline boundary's activation, whole on every tp rank, crosses as each tp rank's
    # 1/tp over its own link and is all-gathered inside the tp group on the far side (Megatron-LM's
    # since SC21, Section 4.1); shardwise's and torch's pipelining send it whole from every tp rank.
    pp_scatter_gather: bool = False
    # ZeRO 0-2's gradient reduction starts once the backward is done, nothing beside it (Megatron-LM's
    # before its --overlap-grad-reduce; Korthikanti et al. 2022: "we do not use any overlapping of
    # gradient all-reduces with back-propagation"). Otherwise the reduction runs beside the last
    # microbatch's backward (shardwise's buckets, DDP's).
    dp_reduce_after_backward: bool = False
    # ZeRO 1-3 copy on the compute stream, at HBM speed with nothing beside them: each gathered buffer
    # out into the parameters (2 x their bytes an element: a read and a write) and each unit's
    # gradients into the reduce-scatter's buffer in the reduction's dtype (FSDP2's split_with_sizes_copy
    # and chunk_cat; its ZeRO-2 is reshard_after_forward=False). shardwise's and DeepSpeed's gather into
    # buffers the parameters are views of.
    shard_copies: bool = False


SHARDWISE_EXECUTOR = Executor(full_reruns_last=False, selective_reruns_partials=True, sp_gather_hidden=True,
                              recompute_gathers=True, zero3_cast_shard=False, grads_kept_below_zero=2)

MEGATRON_EXECUTOR = Executor(full_reruns_last=True, selective_reruns_partials=False, sp_gather_hidden=True,
                             recompute_gathers=False, zero3_cast_shard=True, selective_reruns_attention_core=True,
                             tp_replicated_elementwise=11.0, tp_backward_beside_weight_grads=True,
                             pp_scatter_gather=True)

# shardwise's own, and those of the published runs bench/planner_published.py sets the model against
EXECUTORS = {
    "shardwise": SHARDWISE_EXECUTOR,
    "megatron": MEGATRON_EXECUTOR,
    # Megatron-LM before its tp backward all-reduces ran beside the weight gradients (SC21's runs), its
    # gradients all-reduced after the backward
    "megatron-2021": MEGATRON_EXECUTOR._replace(tp_backward_beside_weight_grads=False, dp_reduce_after_backward=True),
    # llm-foundry's MPT benchmarks: Composer's FSDP on torch 1.13, whose checkpoint reran the whole forward;
    # Composer's trainer calls zero_grad(set_to_none=True) before each batch
    "torch-1.13": Executor(full_reruns_last=True, selective_reruns_partials=True, sp_gather_hidden=False,
                           recompute_gathers=True, zero3_cast_shard=False, grads_kept_below_zero=0),
    # torchtitan's FSDP2 (its published Llama 3 runs): shardwise's recompute and ZeRO-3 gathers with
    # FSDP2's copies around them, its gradients freed by zero_grad(set_to_none=True) between steps at
    # every stage
    "fsdp2": SHARDWISE_EXECUTOR._replace(grads_kept_below_zero=0, shard_copies=True),
}


@dataclass(frozen=True)
class Cluster:
    """`gpus` devices of kind `device`, `gpus_per_node` per node; None fields come from
    the device table. `memory_fraction` of each device's memory is usable (the rest is the
    runtime's, the allocator's fragmentation and the framework's buffers). `nics_per_node`:
    the NICs of `inter_node_bw` each that one collective's cross-node rings can use at once
    (None: one per GPU; fewer where nodes have fewer NICs, or where an executor's collectives
    cross on fewer, as DeepSpeed's ZeRO-3 did in bench/planner_published.py). `executor`: whose
    recompute and collectives the step runs (`EXECUTORS`). `compiled`: the blocks run compiled
    (`pmodel.compile()`, torchtitan's `compile`), their elementwise traffic
    COMPILED_ELEMENTWISE_SHARE of eager's (time only: their saved tensors are charged as eager's,
    an upper bound; a compiled Llama block keeps a third less, bench/elementwise_count.py)."""

    gpus: int
    gpus_per_node: int = 8
    device: str = "h100"
    memory_bytes: float | None = None
    peak_flops: float | None = None
    intra_node_bw: float | None = None
    inter_node_bw: float | None = None
    hbm_bw: float | None = None
    gemm_efficiency: float | None = None
    matmul_overhead: float | None = None
    elementwise: float | None = None
    memory_fraction: float = 0.9
    nics_per_node: int | None = None  # NICs a collective's cross-node bytes spread over; None: one per GPU
    executor: str = "shardwise"  # whose execution the time model charges: a key of EXECUTORS
    compiled: bool = False  # blocks compiled with torch.compile: fused elementwise kernels
    spec: Device = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ConfigError(f"device={self.device!r} is not in the planner's table; use one of {', '.join(DEVICES)} "
                              "and override memory_bytes / peak_flops / *_bw for another")
        if not isinstance(self.gpus, int) or isinstance(self.gpus, bool) or self.gpus < 1:
            raise ConfigError(f"gpus={self.gpus!r} must be a positive integer")
        if not isinstance(self.gpus_per_node, int) or isinstance(self.gpus_per_node, bool) or self.gpus_per_node < 1:
            raise ConfigError(f"gpus_per_node={self.gpus_per_node!r} must be a positive integer")
        overrides = {k: getattr(self, k) for k in ("memory_bytes", "peak_flops", "intra_node_bw", "inter_node_bw", "hbm_bw",
                                                   "gemm_efficiency", "matmul_overhead", "elementwise")}
        for name, value in overrides.items():
            if value is not None and not (_positive(value) or (name == "matmul_overhead" and value == 0)):
                raise ConfigError(f"{name}={value!r} must be a positive finite number (or None for the "
                                  f"{self.device!r} table's value)")
        if self.gemm_efficiency is not None and self.gemm_efficiency > 1:
            raise ConfigError(f"gemm_efficiency={self.gemm_efficiency!r} is a fraction of the peak, at most 1")
        if self.nics_per_node is not None and (not isinstance(self.nics_per_node, int)
                                               or isinstance(self.nics_per_node, bool) or self.nics_per_node < 1):
            raise ConfigError(f"nics_per_node={self.nics_per_node!r} must be a positive integer (or None: one per GPU)")
        if not isinstance(self.compiled, bool):
            raise ConfigError(f"compiled={self.compiled!r} must be True (blocks compiled with torch.compile, "
                              "pmodel.compile()) or False (eager)")
        if self.executor not in EXECUTORS:
            raise ConfigError(f"executor={self.executor!r} is one of {', '.join(map(repr, EXECUTORS))}")
        if not _positive(self.memory_fraction) or self.memory_fraction > 1:
            raise ConfigError(f"memory_fraction={self.memory_fraction!r} must be in (0, 1]: the share of each "
                              "device's memory a run may use (0.9 leaves 10% to the runtime)")
        base = DEVICES[self.device]
        spec = replace(base, **{k: float(v) for k, v in overrides.items() if v is not None})
        if self.compiled:
            spec = replace(spec, elementwise=spec.elementwise * COMPILED_ELEMENTWISE_SHARE)
        if spec.memory_bytes <= 0:
            raise ConfigError(f"device {self.device!r} has no memory size; pass memory_bytes=...")
        replicated = EXECUTORS[self.executor].tp_replicated_elementwise
        if replicated is not None and self.compiled:
            raise ConfigError(f"compiled=True with executor={self.executor!r}: compiled means blocks of eager "
                              "PyTorch under torch.compile; that executor's kernels are fused by hand (describe "
                              "their traffic with elementwise=...), so pass compiled=False")
        if replicated is not None and spec.elementwise < replicated:
            raise ConfigError(f"elementwise={spec.elementwise!r} is below the {replicated:g} values per token and "
                              f"hidden unit that executor={self.executor!r} runs outside its tp regions alone; "
                              f"pass elementwise >= {replicated:g}")
        object.__setattr__(self, "spec", spec)

    @property
    def runs(self) -> Executor:
        """How `executor` runs a step where stacks differ."""
        return EXECUTORS[self.executor]

    @property
    def usable_bytes(self) -> float:
        return self.spec.memory_bytes * self.memory_fraction

    def bandwidth(self, group_span, members=1):
        """Per-GPU bandwidth of a collective over `members` ranks spanning `group_span`
        consecutive ranks (arrays or numbers): NVLink's while they fit in a node; across nodes
        one NIC's, times the group's members in each node up to the node's NICs (NCCL runs a
        ring per NIC, so a node's members share the cross-node bytes over their NICs), at most
        NVLink's."""
        span, members = np.asarray(group_span), np.asarray(members)
        per_node = np.maximum(members * self.gpus_per_node / np.maximum(span, 1), 1)
        nics = self.gpus_per_node if self.nics_per_node is None else self.nics_per_node
        across = np.minimum(self.spec.inter_node_bw * np.minimum(per_node, nics), self.spec.intra_node_bw)
        return np.where(span <= self.gpus_per_node, self.spec.intra_node_bw, across)

    def latency(self, group_span):
        """Seconds per step of a collective over ranks spanning `group_span` consecutive ranks."""
        return np.where(np.asarray(group_span) <= self.gpus_per_node, self.spec.intra_latency, self.spec.inter_latency)

    def matmul_flops(self, param_bytes):
        """FLOP/s a large matmul reaches in a step: the tensor-core peak for 2-byte dtypes,
        plain float32's for 4 (torch leaves TF32 off for matmuls by default), times the
        calibrated efficiency."""
        fp32 = self.spec.fp32_flops or self.spec.peak_flops
        return np.where(np.asarray(param_bytes) >= 4, fp32, self.spec.peak_flops) * self.spec.gemm_efficiency

    @classmethod
    def local(cls, ranks: int | None = None) -> "Cluster":
        """This machine's ranks (the world size when launched, else the CPU count), sharing
        its memory."""
        if ranks is None:
            import torch.distributed as dist

            ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else os.cpu_count() or 1
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return cls(gpus=ranks, gpus_per_node=ranks, device="local", memory_bytes=total / ranks)


def device_kind(name: str) -> str | None:
    """The table's entry for an accelerator's reported name ("NVIDIA H100 80GB HBM3" -> "h100",
    "NVIDIA GH200 480GB" -> "h200": the H100's chip with more memory), None when it has none."""
    name = name.lower()
    return next((kind for kind in ("h200", "h100", "a100", "b200") if kind in name), None)


def _positive(value) -> bool:
    """A real number (not a bool) above zero and finite."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
