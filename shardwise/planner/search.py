"""The search: every layout of a model on a cluster, evaluated at once, ranked by step time.

The space is every factorization dp*tp*pp*cp of the GPU count (tp inside a node and
dividing the model's heads, kv heads, MLP width and vocabulary; cp leaving at least
`MIN_CP_TOKENS` tokens per rank and dividing the sequence into 2*cp chunks; pp at most the
layer count), every microbatch size dividing a replica's batch (the microbatch count
follows, at least pp under pipelining, a multiple of pp for interleaved schedules), each
schedule with 1 (GPipe, 1F1B) or 2, 4, 8 (interleaved 1F1B, zero-bubble) stages per rank,
ZeRO 0-3, recompute none/selective/selective-alternate/full (no alternate for mixtures of
experts), sequence parallelism on/off under tp, bf16 or
float32 on GPUs, and for a mixture of experts every ep dividing dp and the experts. It is exhaustive: the inner choices of each factorization are one numpy
grid through `cost.evaluate`, so 10^5-10^6 layouts take seconds on one core. Layouts
predicted not to fit are dropped; the rest are ranked by seconds per token.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..config import ParallelConfig, divisors
from ..errors import ConfigError
from .cluster import Cluster
from .cost import OPTIMIZER_CODES, RECOMPUTE_CODES, SCHEDULE_CODES, Cost, Layout
from .cost import evaluate as evaluate_layouts
from .model import ModelSpec, model_spec

MIN_CP_TOKENS = 256
MAX_MICRO_BATCH = 16
VIRTUAL = (2, 4, 8)
SCHEDULE_NAMES = {code: name for name, code in SCHEDULE_CODES.items()}
RECOMPUTE_NAMES = {code: name for name, code in RECOMPUTE_CODES.items()}
OPTIMIZER_NAMES = {code: name for name, code in OPTIMIZER_CODES.items()}
MEMORY_TERMS = ("params", "grads", "optimizer", "activations", "buffers", "step_temporaries")
TIME_TERMS = ("compute", "recompute", "tp_comm", "cp_comm", "ep_comm", "pp_comm", "bubble", "dp_comm",
              "optimizer_step")


@dataclass
class Candidate:
    """One layout and its prediction."""

    config: ParallelConfig
    micro_batch: int  # sequences per microbatch per replica
    spec: ModelSpec
    cluster: Cluster
    seq_len: int
    memory_terms: dict[str, float]
    time_terms: dict[str, float]
    tokens_per_step: int
    model_flops: float
    virtual: int = 1  # pipeline stages per rank
    optimizer: str = "foreach"  # how the optimizer runs (timing.OPTIMIZER_CODES)
    runner_up: "Candidate | None" = field(default=None, repr=False)

    @property
    def memory(self) -> float:
        """Predicted peak bytes on the busiest rank."""
        return sum(self.memory_terms.values())

    @property
    def step_seconds(self) -> float:
        return sum(self.time_terms.values())

    @property
    def fits(self) -> bool:
        """Whether the predicted peak fits the cluster's usable device memory."""
        return self.memory <= self.cluster.usable_bytes

    @property
    def mfu(self) -> float:
        """Model FLOPs (no recomputation) per second over the cluster's peak."""
        return self.model_flops / (self.step_seconds * self.cluster.gpus * self.cluster.spec.peak_flops)

    @property
    def tokens_per_second_per_gpu(self) -> float:
        return self.tokens_per_step / self.step_seconds / self.cluster.gpus

    @property
    def plan(self):
        """The Plan that lays the model out this way (see `plan_for`)."""
        return plan_for(self.spec, self.config, self.virtual)

    def layout(self) -> str:
        c = self.config
        parts = [f"dp{c.dp}", f"tp{c.tp}" + ("+sp" if c.sequence_parallel else ""), f"pp{c.pp}", f"cp{c.cp}"] \
            + ([f"ep{c.ep}"] if c.ep > 1 else []) + [f"zero{c.zero}", f"mb{self.micro_batch}x{c.microbatches}"]
        if c.pp > 1:
            parts.append(c.schedule + (f"/v{self.virtual}" if self.virtual > 1 else ""))
        parts.append(f"rc:{c.recompute or 'none'}")
        parts.append("bf16" if c.param_dtype is not None else "fp32")
        return " ".join(parts)

    def explain(self) -> str:
        from .format import explain

        return explain(self)


def plan_for(spec: ModelSpec, config: ParallelConfig, virtual: int = 1):
    """The model's zoo plan for `config` (tensor and sequence parallel placements) when tp > 1,
    else a plain Plan; with `virtual` > 1 pipeline stages per rank."""
    from ..plan.named import zoo
    from ..plan.plan import Plan

    stages = {"virtual_stages": virtual} if virtual > 1 else {}
    if config.tp > 1 and spec.plan in zoo:
        return zoo[spec.plan](config).replace(**stages)
    return Plan(**stages)


def _factorizations(spec: ModelSpec, cluster: Cluster, seq_len: int, context_parallel: bool):
    """(dp, tp, pp, cp) of every allowed factorization of the GPU count."""
    out = []
    for tp in divisors(cluster.gpus):
        if tp > 1 and (tp > cluster.gpus_per_node or spec.check_tp(tp) or spec.plan is None):
            continue
        for cp in divisors(cluster.gpus // tp):
            if cp > 1 and (not context_parallel or spec.attention != "flash" or seq_len % (2 * cp)
                           or seq_len // cp < MIN_CP_TOKENS):  # cp computes attention with SDPA
                continue
            for pp in divisors(cluster.gpus // (tp * cp)):
                if pp > spec.layers:
                    continue
                out.append((cluster.gpus // (tp * cp * pp), tp, pp, cp))
    return out


def _expert_degrees(spec: ModelSpec, dp: int) -> list[int]:
    """ep values for a factorization: dividing dp and the experts."""
    return [e for e in divisors(dp) if spec.experts % e == 0] if spec.experts else [1]


def recompute_codes(spec: ModelSpec) -> tuple[int, ...]:
    """The recompute modes the planner models for `spec` (selective-alternate only where it knows
    which weight matmuls alternate: dense blocks)."""
    return tuple(code for name, code in RECOMPUTE_CODES.items() if name != "selective-alternate" or spec.weight_matmuls)


def _inner_grid(dp: int, tp: int, pp: int, cp: int, replica_batch: int, layers: int, dtypes: tuple[int, ...],
                eps: list[int] = (1,), recomputes: tuple[int, ...] = (0, 1, 2)):
    """Arrays of every inner choice for one factorization (empty when the batch does not split)."""
    rows = []
    for b in divisors(replica_batch):
        if b > MAX_MICRO_BATCH:
            break
        m = replica_batch // b
        if pp > 1 and m < pp:
            continue
        schedules = [(SCHEDULE_CODES["1f1b"], 1)] if pp == 1 else \
            [(SCHEDULE_CODES["gpipe"], 1), (SCHEDULE_CODES["1f1b"], 1)] + [
                (SCHEDULE_CODES[name], v) for name in ("interleaved-1f1b", "zero-bubble") for v in VIRTUAL
                if pp * v <= layers and m % pp == 0]
        zeros = (0, 1, 2, 3) if dp * cp > 1 else (0,)
        sps = (0, 1) if tp > 1 else (0,)
        for (schedule, v), zero, rc, sp, nbytes, ep in itertools.product(schedules, zeros, recomputes, sps, dtypes, eps):
            if schedule == SCHEDULE_CODES["zero-bubble"] and (zero == 3 or rc > 0):
                continue  # refused by ParallelConfig (released parameters; a block recomputed for two passes)
            rows.append((b, m, schedule, v, zero, rc, sp, nbytes, ep))
    if not rows:
        return None
    grid = np.array(rows, dtype=np.float64).T
    b, m, schedule, v, zero, rc, sp, nbytes, ep = grid
    one = np.ones_like(b)
    return Layout(dp=dp * one, tp=tp * one, pp=pp * one, cp=cp * one, zero=zero, recompute=rc, sp=sp,
                  micro_batch=b, microbatches=m, schedule=schedule, virtual=v, param_bytes=nbytes, ep=ep)


def _candidate(spec, cluster, seq_len, layout: Layout, cost: Cost, i: int) -> Candidate:
    pick = lambda a: float(np.asarray(a).reshape(-1)[i] if np.ndim(a) else a)  # noqa: E731
    nbytes = int(pick(layout.param_bytes))
    config = ParallelConfig(
        dp=int(pick(layout.dp)), tp=int(pick(layout.tp)), pp=int(pick(layout.pp)), cp=int(pick(layout.cp)),
        ep=int(pick(layout.ep)), zero=int(pick(layout.zero)), microbatches=int(pick(layout.microbatches)),
        schedule=SCHEDULE_NAMES[int(pick(layout.schedule))], sequence_parallel=bool(pick(layout.sp)),
        recompute=RECOMPUTE_NAMES[int(pick(layout.recompute))],
        param_dtype=None if nbytes == 4 else torch.bfloat16)
    memory = {name: pick(getattr(cost, name)) for name in MEMORY_TERMS}
    times = {name: pick(getattr(cost, name)) for name in TIME_TERMS}
    tokens = int(pick(layout.dp) * pick(layout.micro_batch) * pick(layout.microbatches) * seq_len)
    return Candidate(config, int(pick(layout.micro_batch)), spec, cluster, seq_len, memory, times, tokens,
                     pick(cost.model_flops), int(pick(layout.virtual)), OPTIMIZER_NAMES[int(pick(layout.optimizer))])


@dataclass(eq=False)  # a list of candidates: compared as one, not by its counters
class SearchResult(list):
    """The ranked candidates (a list), with how many layouts were evaluated and how fast."""

    evaluated: int = 0
    fitting: int = 0
    seconds: float = 0.0

    @property
    def per_second(self) -> float:
        return self.evaluated / self.seconds if self.seconds else float("inf")


def search(model: Any, cluster: Cluster, global_batch: int | None = None, seq_len: int | None = None,
           global_tokens: int | None = None, top: int = 10, replica_batch: int | None = None,
           dtypes: tuple[int, ...] | None = None, progress: bool = False,
           context_parallel: bool = True, optimizer: str | None = None) -> SearchResult:
    """The `top` layouts of `model` on `cluster` predicted to fit, fastest per token first.

    `global_batch` sequences of `seq_len` tokens per step (or `global_tokens` / seq_len);
    `replica_batch` instead fixes each data-parallel replica's batch (the global batch then
    grows with dp), as `parallelize(..., "auto")` does with its sample batch. `dtypes`:
    parameter bytes to try (default bf16 and float32 on GPUs, float32 locally);
    `context_parallel=False` leaves cp out (batches that are not dicts). `optimizer`: how the
    optimizer runs (`optimizer_code`).
    """
    start = time.perf_counter()
    spec = model_spec(model)
    code = optimizer_code(cluster, optimizer)
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise ConfigError(f"seq_len={seq_len!r} must be a positive number of tokens per sequence")
    if spec.max_seq is not None and seq_len > spec.max_seq:
        raise ConfigError(f"seq_len={seq_len} exceeds {spec.name}'s {spec.max_seq} learned positions")
    if global_batch is None and global_tokens is not None:
        if global_tokens % seq_len:
            raise ConfigError(f"global_tokens={global_tokens} is not a multiple of seq_len={seq_len}")
        global_batch = global_tokens // seq_len
    if (global_batch is None) == (replica_batch is None):
        raise ConfigError("give exactly one of global_batch (or global_tokens) and replica_batch")
    for name, value in (("global_batch", global_batch), ("replica_batch", replica_batch)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ConfigError(f"{name}={value!r} must be a positive integer number of sequences")
    dtypes = dtypes or ((4,) if cluster.device == "local" else (2, 4))
    groups = _factorizations(spec, cluster, seq_len, context_parallel)
    if progress:
        from tqdm import tqdm

        groups = tqdm(groups, desc="planning", unit="factorization", delay=1.0, leave=False)
    best: list[tuple[float, float, int, Candidate]] = []
    result = SearchResult()
    for dp, tp, pp, cp in groups:
        batch = replica_batch if replica_batch is not None else (global_batch // dp if global_batch % dp == 0 else 0)
        layout = _inner_grid(dp, tp, pp, cp, batch, spec.layers, dtypes, _expert_degrees(spec, dp),
                             recompute_codes(spec)) if batch else None
        if layout is None:
            continue
        layout.optimizer = code
        cost = evaluate_layouts(spec, cluster, layout, seq_len)
        result.evaluated += layout.dp.size
        fits = cost.memory <= cluster.usable_bytes
        result.fitting += int(fits.sum())
        if not fits.any():
            continue
        per_token = np.where(fits, cost.step_seconds / (layout.dp * layout.micro_batch * layout.microbatches * seq_len),
                             np.inf)
        memory = cost.memory
        for i in np.lexsort((memory, per_token))[: top + 1]:  # equal time: the smaller footprint first
            if np.isfinite(per_token[i]):
                best.append((float(per_token[i]), float(memory[i]), len(best),
                             _candidate(spec, cluster, seq_len, layout, cost, int(i))))
        best = sorted(best)[: top + 1]
    ranked = [entry[-1] for entry in best]
    for a, b in zip(ranked, ranked[1:]):
        a.runner_up = b
    result.extend(ranked[:top])
    result.seconds = time.perf_counter() - start
    return result


def optimizer_code(cluster: Cluster, optimizer: str | None) -> int:
    """`optimizer` ("fused", "foreach" or "for-loop": timing.OPTIMIZER_CODES) as the cost model's
    code; None: torch's default where the cluster's devices are (foreach on GPUs, for-loop on
    the local CPU); "fused" for `sw.build_optimizer(pm, torch.optim.AdamW, ..., fused=True)`."""
    if optimizer is None:
        optimizer = "for-loop" if cluster.device == "local" else "foreach"
    if optimizer not in OPTIMIZER_CODES:
        raise ConfigError(f"optimizer={optimizer!r}: the planner models {', '.join(map(repr, OPTIMIZER_CODES))} "
                          "(None: torch's default for the cluster's device)")
    return OPTIMIZER_CODES[optimizer]


def evaluate(model: Any, cluster: Cluster, config: ParallelConfig, *, seq_len: int, global_batch: int,
             virtual: int = 1, optimizer: str | None = None) -> Candidate:
    """What `config` would cost: the search's prediction for one layout the user has, as a
    `Candidate` (memory and time terms, `explain()`, `fits`), whether or not the search
    would pick it.

    `global_batch` sequences of `seq_len` tokens per step, split over the config's replicas
    and `config.microbatches`; `virtual` pipeline stages per rank (interleaved schedules);
    `optimizer` how the optimizer runs (`optimizer_code`).
    The config's degrees must cover the cluster (dp may be None: derived).
    """
    spec = model_spec(model)
    if not isinstance(config, ParallelConfig):
        raise ConfigError(f"config={config!r} must be a sw.ParallelConfig")
    config = config.resolve(cluster.gpus)
    for name, value in (("seq_len", seq_len), ("global_batch", global_batch), ("virtual", virtual)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name}={value!r} must be a positive integer")
    if spec.max_seq is not None and seq_len > spec.max_seq:
        raise ConfigError(f"seq_len={seq_len} exceeds {spec.name}'s {spec.max_seq} learned positions")
    replicas = config.dp * config.microbatches
    if global_batch % replicas:
        raise ConfigError(f"global_batch={global_batch} does not split into dp={config.dp} replicas x "
                          f"microbatches={config.microbatches}; use a multiple of {replicas}")
    if config.tp > 1 and (why := spec.check_tp(config.tp)):
        raise ConfigError(f"tp={config.tp} cannot split {spec.name}: {why}")
    if config.tp > cluster.gpus_per_node:
        raise ConfigError(f"tp={config.tp} spans nodes of {cluster.gpus_per_node} GPUs; the planner keeps tp inside a node")
    if config.ep > 1 and (not spec.experts or spec.experts % config.ep):
        raise ConfigError(f"ep={config.ep}: {spec.name} has {spec.experts or 'no'} experts per layer"
                          + (f", not divisible by {config.ep}" if spec.experts else ""))
    if config.cp > 1 and spec.attention != "flash":
        raise ConfigError(f"cp={config.cp}: context parallelism computes attention with torch's SDPA, and "
                          f"{spec.name}'s attention is {spec.attention!r}; use attn_implementation='sdpa' (or cp=1)")
    if config.pp * virtual > spec.layers:
        raise ConfigError(f"pp={config.pp} x virtual={virtual} stages exceed {spec.name}'s {spec.layers} layers")
    if config.schedule not in SCHEDULE_CODES:
        raise ConfigError(f"schedule={config.schedule!r}: the planner models {sorted(SCHEDULE_CODES)}")
    if config.recompute not in RECOMPUTE_CODES or RECOMPUTE_CODES[config.recompute] not in recompute_codes(spec):
        raise ConfigError(f"recompute={config.recompute!r}: the planner models "
                          f"{', '.join(repr(RECOMPUTE_NAMES[c]) for c in recompute_codes(spec))} for {spec.name}"
                          + ("" if spec.weight_matmuls else " (which of a mixture's matmuls alternate depends on "
                             "its implementation)"))
    nbytes = 4 if config.param_dtype is None else config.param_dtype.itemsize
    layout = Layout(dp=np.array([config.dp]), tp=np.array([config.tp]), pp=np.array([config.pp]),
                    cp=np.array([config.cp]), zero=np.array([config.zero]),
                    recompute=np.array([RECOMPUTE_CODES[config.recompute]]),
                    sp=np.array([int(config.sequence_parallel)]), micro_batch=np.array([global_batch // replicas]),
                    microbatches=np.array([config.microbatches]), schedule=np.array([SCHEDULE_CODES[config.schedule]]),
                    virtual=np.array([virtual]), param_bytes=np.array([nbytes]), ep=np.array([config.ep]),
                    reduce_bytes=np.array([0 if config.reduce_dtype is None else config.reduce_dtype.itemsize]),
                    bucket_bytes=np.array([config.bucket_mb * 2 ** 20]),
                    optimizer=np.array([optimizer_code(cluster, optimizer)]))
    candidate = _candidate(spec, cluster, seq_len, layout, evaluate_layouts(spec, cluster, layout, seq_len), 0)
    candidate.config = config  # the user's, with what the grid does not vary (reduce_dtype, bucket_mb)
    return candidate
