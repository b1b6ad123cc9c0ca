"""Parity: the same model trained on one process and on several, compared with bounds derived
from float32 arithmetic, not measured on one machine.

What differs between the runs is only the order of floating-point sums (per-replica and
per-microbatch partial sums, tensor-parallel partial products, the ring order of an
all-reduce). Every rank and the reference run with one intra-op thread (conftest.py,
`run_on_ranks`), so no kernel's internal blocking depends on the machine's core count.

Rounding. With unit roundoff u = 2^-24, a reduction of n terms evaluated in two orders
differs by at most 2·γ_n·Σ|terms| (γ_n = n·u/(1 - n·u), Higham, Accuracy and Stability of
Numerical Algorithms, Thm 3.5); errors of independent sign grow like sqrt(n), and Higham &
Mary (SIAM J. Sci. Comput. 2019, Thm 3.1) bound them by λ·sqrt(n)·u with probability at least
1 - 2·exp(-λ²/2) per reduction. In these models (d_model ≤ 64, 4·d_model MLP, vocab 64,
≤ 8 layers, ≤ 16 x 16 tokens per step) every reduction has n ≤ 256 terms, and a gradient
depends on at most D ≈ 3 x (6 reductions x 8 layers + 4) ≈ 156 dependent reductions
(forward, and two per operation in backward). With λ = 10 (failure odds below e^-50) the
accumulated error, relative to the magnitudes summed, is λ·sqrt(D·n)·u ≈ 1.2e-4; measured
against a gradient tensor's largest element rather than the magnitudes its elements sum,
cancellation inside a sum over the ≤ 256 tokens costs up to sqrt(256) = 16 more:
    EPS_GRAD = 2e-3 (per tensor: max|g_par - g_ref| ≤ EPS_GRAD · G),
with G the largest gradient element of the tensor's module (its weight and bias together): a
bias's gradient sums the same per-token terms as its weight's, so when it cancels to ~0 (BERT's
key bias, whose true gradient is zero because softmax ignores it) the magnitudes it summed are
still of the module's scale, and so is its rounding.
The loss comes from the forward alone (D ≈ 52) and is a positive mean without cancellation:
    EPS_LOSS = 1e-4 (λ·sqrt(52·256)·u ≈ 7e-5).
The smallest fault these checks guard against moves a gradient tensor by far more: a sum
taken for a mean over 2 replicas (x2), a missing all-reduce (the replica's own gradient, a
different sample), one of 8 microbatches lost (≈ 1/8), a norm's partial gradient not summed
over 2 tp ranks (≈ 1/2), a dropout mask drawn differently (whole elements). tests/test_faults.py
injects each and checks that the comparison fails.

Parameters, SGD with momentum β (torch: buf_j = β·buf_{j-1} + g_j, θ -= lr·buf_j). After S
steps θ_S = θ_0 - lr·Σ_k c_k·g_k with c_k = (1 - β^(S-k+1))/(1 - β): linear in the gradients,
so no rounding is amplified. Each step's gradients obey the bound above (the parameters
entering later steps differ by less than rounding can see), so per tensor
    max|θ_par - θ_ref| ≤ 2·EPS_GRAD·lr·Σ_k c_k·G_k + 4·u·S·max|θ|
(factor 2 for the gradient drift of later steps, the last term for the updates' own
rounding). The reference checks that this bound is far below how far the parameters moved,
so a run that never stepped, or stepped with a wrong gradient, fails.

Parameters, AdamW (used only where the optimizer itself is under test: ZeRO's sharded
state). The update per element is lr·û with û = m̂/(sqrt(v̂) + eps), whose sensitivity to a
gradient change δ is |Δû| ≤ δ·(1 + |û|)/(sqrt(v̂) - δ + eps): an element whose gradient is
far above rounding moves the same way in both runs, one whose gradient is ~0 may move by up
to Adam's largest step either way. Summed over steps, per element (v̂, û from the reference's
own gradients, δ_k = EPS_GRAD·G_k of the tensor's module):
    |θ_par - θ_ref| ≤ Σ_k lr·min(2·U_MAX, δ_k·(1 + |û_k|)/(max(sqrt(v̂_k) - δ_k, 0) + eps)) + 4·u·S·|θ|.
U_MAX = 1.5 bounds |û|: by Cauchy-Schwarz |m̂|/sqrt(v̂) ≤ sqrt(Σ a_i²/b_i) for the EMA weights a,
b of m̂ and v̂, which is 1.011 after 5 steps and 1.028 after 8 (β1=0.9, β2=0.999). A run that
never stepped fails on every element whose gradient is clear of zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

import shardwise as sw
from shardwise.batch import split_batch
from shardwise.models import GPT, CharTokenizer, GPTConfig, tiny_corpus

U = 2.0 ** -24
EPS_GRAD = 2e-3
EPS_LOSS = 1e-4
SGD = {"lr": 0.05, "momentum": 0.9}
ADAMW = {"lr": 1e-3}
U_MAX = 1.5

_CORPUS = tiny_corpus(seed=0)
_TOKENS = CharTokenizer(_CORPUS).encode(_CORPUS)


def make_gpt(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**overrides))


def corpus_batches(steps: int, batch: int, seq: int = 16, seed: int = 1) -> list[torch.Tensor]:
    """`steps` batches of (batch, seq + 1) character ids cut from the tiny corpus: text whose
    loss falls as a model trains (uniform random tokens teach nothing)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        starts = torch.randint(0, len(_TOKENS) - seq - 1, (batch,), generator=gen)
        out.append(torch.stack([_TOKENS[s:s + seq + 1] for s in starts.tolist()]))
    return out


gpt_batches = corpus_batches


def replica_slice(batch, index: int, count: int):
    """Replica `index`'s share of a global batch (tensor or dict of tensors)."""
    if isinstance(batch, dict):
        return {k: replica_slice(v, index, count) for k, v in batch.items()}
    per = batch.shape[0] // count
    return batch[index * per:(index + 1) * per]


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def full_grads(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, gathered whole (collective when sharded)."""
    return {n: _full(p.grad) for n, p in module.named_parameters() if p.grad is not None}


def optimizer_for(kind: str) -> tuple[type, dict]:
    """"sgd" or "adamw", optionally with torch's multi-tensor step ("sgd foreach", "adamw
    foreach") or fused one ("adamw fused"): the same arithmetic per element, so the same bounds."""
    name, _, variant = kind.partition(" ")
    cls, kwargs = {"sgd": (torch.optim.SGD, SGD), "adamw": (torch.optim.AdamW, ADAMW)}[name]
    return cls, {**kwargs, **({variant: True} if variant else {})}


def _loss_value(out) -> torch.Tensor:
    return out.loss if hasattr(out, "loss") else out


@dataclass
class Run:
    """What a run produced: per-step losses (and clipped norms), the gradients of the first
    step (every step for the reference), and the parameters before and after."""

    losses: list[float]
    grads: list[dict[str, torch.Tensor]]
    initial: dict[str, torch.Tensor] = field(default_factory=dict)
    final: dict[str, torch.Tensor] = field(default_factory=dict)
    norms: list[float] = field(default_factory=list)
    parameter_of: dict[str, str] = field(default_factory=dict)  # state key -> parameter name (tied: the first)
    bounds: dict[tuple, dict] = field(default_factory=dict, repr=False)  # a reference's parameter bounds, per optimizer

    @property
    def scales(self) -> list[dict[str, float]]:
        return [module_scales(g) for g in self.grads]


def train_parallel(config: dict, factory: Callable[[], nn.Module], batches, plan=None, deferred: bool = False,
                   clip: float | None = None, optimizer: str = "sgd", fault: str | None = None,
                   compile_kwargs: dict | None = None, every_step: bool = False) -> Run:
    """On each rank: parallelize, train with train_step and sw.build_optimizer. `fault`
    (or SHARDWISE_TEST_FAULT) breaks one mechanism first (tests/faults.py); with
    `compile_kwargs`, `pmodel.compile(**compile_kwargs)` before the first step; `every_step`:
    every step's gradients and the initial parameters, as a reference run records them."""
    import torch.distributed as dist

    import faults

    fault = fault or faults.from_environment()
    if fault:
        faults.inject(fault, config)
    model = sw.deferred_init(factory) if deferred else factory()
    replicas = dist.get_world_size() // (config.get("tp", 1) * config.get("pp", 1) * config.get("cp", 1))
    pm = sw.parallelize(model, sw.ParallelConfig(**config), plan=plan, sample=replica_slice(batches[0], 0, replicas))
    cls, kwargs = optimizer_for(optimizer)
    opt = sw.build_optimizer(pm, cls, **kwargs)
    if compile_kwargs is not None:
        pm.compile(**compile_kwargs)
    index, count = sw.data_parallel_info(pm)
    run = Run([], [])
    if every_step:
        run.initial = {k: _full(v) for k, v in pm.full_state_dict().items()}
        run.parameter_of = _first_names(pm.module)
    for batch in batches:
        run.losses.append(float(pm.train_step(replica_slice(batch, index, count))))
        if not run.grads or every_step:
            run.grads.append({k: v.clone() for k, v in pm.full_grad_dict().items()})
        if clip is not None:
            run.norms.append(float(opt.clip_grad_norm(clip)))
        opt.step()
        opt.zero_grad()
    run.final = {k: _full(v) for k, v in pm.full_state_dict().items()}
    return run


def _first_names(model: nn.Module) -> dict[str, str]:
    """Each parameter name -> the first name of the same parameter (tied ones share it)."""
    first = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(param), name)
    return {name: first[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}


def reference_run(factory: Callable[[], nn.Module], batches, clip: float | None = None, optimizer: str = "sgd",
                  microbatches: int = 1, loss: Callable[[nn.Module, Any], torch.Tensor] | None = None) -> Run:
    """Plain torch on one process: every step's gradients (as the optimizer saw them, after clipping).
    With `microbatches`, each batch runs as that many slices in order, losses averaged (the
    random numbers one process draws for them: the reference for dropout under pp). `loss`:
    the step's loss from (model, batch), when it is not the forward's first output."""
    model = factory()
    cls, kwargs = optimizer_for(optimizer)
    opt = cls(model.parameters(), **kwargs)
    run = Run([], [], initial={k: v.detach().clone() for k, v in model.state_dict().items()})
    run.parameter_of = _first_names(model)
    for batch in batches:
        if microbatches == 1:
            value = loss(model, batch) if loss is not None else _loss_value(model(batch))
            value.backward()
        else:
            losses = []
            for part in split_batch(batch, microbatches):
                losses.append(loss(model, part) if loss is not None else _loss_value(model(part)))
                (losses[-1] / microbatches).backward()
            value = torch.stack([l.detach() for l in losses]).mean()
        run.grads.append(full_grads(model))  # as full_grad_dict shows them: before clipping (which only shrinks)
        if clip is not None:
            run.norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        run.losses.append(float(value.detach()))
    run.final = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return run


def _inf(t: torch.Tensor) -> float:
    return float(t.detach().double().abs().max()) if t.numel() else 0.0


def _grad(ref: Run, step: int, key: str) -> torch.Tensor | None:
    """The reference gradient of state key `key` at `step` (a tied weight's, under its first name)."""
    return ref.grads[step].get(ref.parameter_of.get(key, key))


def module_scales(grads: dict[str, torch.Tensor]) -> dict[str, float]:
    """Parameter name -> the largest gradient element of its module (see EPS_GRAD)."""
    modules: dict[str, float] = {}
    for key, grad in grads.items():
        module = key.rpartition(".")[0]
        modules[module] = max(modules.get(module, 0.0), _inf(grad))
    return {key: modules[key.rpartition(".")[0]] for key in grads}




def sgd_bounds(ref: Run, lr: float, momentum: float) -> dict[str, float]:
    if ("sgd", lr, momentum) not in ref.bounds:  # one reference is judged against every rank's run
        ref.bounds["sgd", lr, momentum] = _sgd_bounds(ref, lr, momentum)
    return ref.bounds["sgd", lr, momentum]


def _sgd_bounds(ref: Run, lr: float, momentum: float) -> dict[str, float]:
    steps = len(ref.grads)
    coefficients = [(1 - momentum ** (steps - k)) / (1 - momentum) for k in range(steps)]
    bounds, scales = {}, ref.scales
    for key, initial in ref.initial.items():
        drift = sum(c * scales[k].get(ref.parameter_of.get(key, key), 0.0) for k, c in enumerate(coefficients))
        bounds[key] = 2 * EPS_GRAD * lr * drift + 4 * U * steps * max(_inf(initial), _inf(ref.final[key]))
    return bounds


def adamw_bounds(ref: Run, lr: float, betas=(0.9, 0.999), eps: float = 1e-8) -> dict[str, torch.Tensor]:
    key = ("adamw", lr, tuple(betas), eps)
    if key not in ref.bounds:
        ref.bounds[key] = _adamw_bounds(ref, lr, betas, eps)
    return ref.bounds[key]


def _adamw_bounds(ref: Run, lr: float, betas, eps: float) -> dict[str, torch.Tensor]:
    steps = len(ref.grads)
    scales = ref.scales
    bounds = {}
    for key, initial in ref.initial.items():
        bound = torch.full_like(initial, 4 * U * steps, dtype=torch.float64) * initial.double().abs().clamp_min(1.0)
        m = v = None
        for k in range(1, steps + 1):
            g = _grad(ref, k - 1, key)
            if g is None:
                continue
            g = g.double()
            m = g * (1 - betas[0]) if m is None else m * betas[0] + g * (1 - betas[0])
            v = g * g * (1 - betas[1]) if v is None else v * betas[1] + g * g * (1 - betas[1])
            m_hat, v_hat = m / (1 - betas[0] ** k), v / (1 - betas[1] ** k)
            u_hat = m_hat / (v_hat.sqrt() + eps)
            delta = EPS_GRAD * scales[k - 1][ref.parameter_of.get(key, key)]
            sensitivity = delta * (1 + u_hat.abs()) / ((v_hat.sqrt() - delta).clamp_min(0) + eps)
            bound += lr * sensitivity.clamp(max=2 * U_MAX)
        bounds[key] = bound
    return bounds


def assert_parity(ref: Run, got: Run, optimizer: str = "sgd") -> dict[str, float]:
    """Losses, first-step gradients and final parameters within the derived bounds; returns
    the largest observed ratio of difference to bound for each (all must be <= 1)."""
    assert len(got.losses) == len(ref.losses)
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    for step, (a, b) in enumerate(zip(got.losses, ref.losses)):
        ratio = abs(a - b) / (EPS_LOSS * abs(b))
        worst["loss"] = max(worst["loss"], ratio)
        assert ratio <= 1, f"step {step}: loss {a} differs from one process's {b} by more than {EPS_LOSS:g} relative"
    grads = got.grads[0]
    assert grads.keys() == ref.grads[0].keys(), sorted(grads.keys() ^ ref.grads[0].keys())
    scales = module_scales(ref.grads[0])
    for key, want in ref.grads[0].items():
        scale = EPS_GRAD * scales[key]
        diff = _inf(grads[key].double() - want.double())
        worst["grad"] = max(worst["grad"], diff / scale if scale else (0.0 if diff == 0 else math.inf))
        assert diff <= scale, f"first-step gradient of {key}: max diff {diff:.3g} > {EPS_GRAD:g} x max|g| = {scale:.3g}"
    assert got.final.keys() == ref.final.keys()
    _, kwargs = optimizer_for(optimizer)
    if optimizer.startswith("sgd"):
        bounds = sgd_bounds(ref, kwargs["lr"], kwargs["momentum"])
        for key, want in ref.final.items():
            diff = _inf(got.final[key].double() - want.double())
            worst["param"] = max(worst["param"], diff / bounds[key] if bounds[key] else 0.0)
            assert diff <= bounds[key], f"{key}: parameters differ by {diff:.3g} > bound {bounds[key]:.3g}"
    else:
        bounds = adamw_bounds(ref, kwargs["lr"])
        for key, want in ref.final.items():
            diff = (got.final[key].double() - want.double()).abs()
            ratio = float((diff / bounds[key]).max())
            worst["param"] = max(worst["param"], ratio)
            assert ratio <= 1, f"{key}: parameters differ by up to {ratio:.3g} x the per-element AdamW bound"
    return worst


def assert_meaningful(ref: Run, optimizer: str = "sgd") -> None:
    """The parameter bounds are far below how far training moved the parameters: a run that
    never stepped would fail the comparison."""
    _, kwargs = optimizer_for(optimizer)
    assert ref.losses[-1] < ref.losses[0] * 0.98, f"the loss hardly moved: {ref.losses}"
    if optimizer.startswith("sgd"):
        moved = sum(_inf(ref.final[k].double() - ref.initial[k].double()) for k in ref.final)
        bound = sum(sgd_bounds(ref, kwargs["lr"], kwargs["momentum"]).values())
        assert moved > 10 * bound, f"parameters moved {moved:.3g} in all, not far above the bounds' {bound:.3g}"
    else:  # Adam moves every element ~lr per step, so a small gradient's bound is wide: require that
        # a quarter of all elements moved 10x past their own bound (a run that never stepped fails on each)
        bounds = adamw_bounds(ref, kwargs["lr"])
        clear = sum(int(((ref.final[k].double() - ref.initial[k].double()).abs() > 10 * bounds[k]).sum()) for k in ref.final)
        total = sum(t.numel() for t in ref.final.values())
        assert clear > total / 4, f"only {clear} of {total} elements moved far past their AdamW bound"


def run_and_compare(world: int, config: dict, factory, batches, plan=None, deferred: bool = False,
                    clip: float | None = None, optimizer: str = "sgd", fault: str | None = None) -> dict[str, float]:
    """Train on `world` ranks and on one process; assert parity on every rank."""
    reference = reference_run(factory, batches, clip=clip, optimizer=optimizer)
    assert_meaningful(reference, optimizer)
    results = sw.testing.run_on_ranks(train_parallel, world, config, factory, batches, plan, deferred, clip, optimizer,
                                      fault)
    worst = {}
    for result in results:
        for got, want in zip(result.norms, reference.norms):  # clip_grad_norm: the global norm, as on one process
            assert abs(got - want) <= EPS_GRAD * want, f"grad norm {got} != {want}"
        for key, value in assert_parity(reference, result, optimizer).items():
            worst[key] = max(worst.get(key, 0.0), value)
    return worst


@dataclass
class Case:
    """One parity check for `compare_cases`: a layout, a model and its batches."""

    name: str
    config: dict
    factory: Callable[[], nn.Module]
    batches: list
    plan: Any = None
    optimizer: str = "sgd"
    reference_microbatches: int = 1  # the reference runs the batch in this many slices
    # the order the reference takes each batch's rows in (its slices then hold the rows of every
    # replica's same microbatch, where a loss over a microbatch's rows gathers them over replicas)
    reference_rows: list[int] | None = None
    fault: str | None = None  # tests/faults.py: a mechanism broken on the ranks (the case must then fail)

    def reference_batches(self) -> list:
        if self.reference_rows is None:
            return self.batches
        rows = torch.tensor(self.reference_rows)
        return [{k: v[rows] for k, v in batch.items()} for batch in self.batches]


def _train_cases(cases: list[Case]) -> list[Run]:
    return [train_parallel(c.config, c.factory, c.batches, c.plan, optimizer=c.optimizer, fault=c.fault) for c in cases]


# Cases trained in one spawn of ranks. Each gloo group keeps a transport thread waking every 10 ms
# for as long as the process lives; ranks are processes sharing the machine's cores. Before
# topologies shared their groups (shardwise/shared_groups.py), each case made its own, and by the
# 20th case of one spawn ~600 threads per rank polled and a case ran 3-10x slower than alone. Now
# a case adds one (its control group). Longer spawns still slow down (test_expert.py: 116 s at 8
# cases a spawn, 133 s at 16), so 8.
CASES_PER_SPAWN = 8


def compare_cases(world: int, cases: list[Case]) -> dict[str, dict[str, float]]:
    """Several parity checks in spawns of `world` ranks (one process start for up to
    CASES_PER_SPAWN of them): each case trains in turn on every rank and is compared with its
    own one-process run."""
    references = []
    for case in cases:
        references.append(reference_run(case.factory, case.reference_batches(), optimizer=case.optimizer,
                                        microbatches=case.reference_microbatches))
        assert_meaningful(references[-1], case.optimizer)
    results: list[list[Run]] = [[] for _ in range(world)]
    for start in range(0, len(cases), CASES_PER_SPAWN):
        for rank, runs in enumerate(sw.testing.run_on_ranks(_train_cases, world, cases[start:start + CASES_PER_SPAWN])):
            results[rank].extend(runs)
    worst: dict[str, dict[str, float]] = {}
    for rank, runs in enumerate(results):
        for case, reference, got in zip(cases, references, runs):
            try:
                ratios = assert_parity(reference, got, case.optimizer)
            except AssertionError as exc:
                raise AssertionError(f"{case.name} on rank {rank}: {exc}") from None
            for key, value in ratios.items():
                worst.setdefault(case.name, {})[key] = max(worst.get(case.name, {}).get(key, 0.0), value)
    return worst


def torch_pipeline_order(schedule: str, p: int, v: int, m: int) -> dict[int, list]:
    """torch's own action order per pipeline rank for `schedule` (an interleaved one of
    sw.config.SCHEDULES) with v stages per rank and m microbatches, built from stand-in stages
    (only what the schedule class reads of them): no process group, no model."""
    class Stage:
        def __init__(self, index):
            self.submod, self.group_size, self.group_rank = torch.nn.Identity(), p, 0
            self.num_stages, self.stage_index, self.has_backward = p * v, index, True
            self.is_first, self.is_last = index == 0, index == p * v - 1

    return sw.config.SCHEDULES[schedule].torch_class([Stage(i * p) for i in range(v)], m).pipeline_order
