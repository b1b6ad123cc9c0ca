"""Tensor and sequence parallel parity, collective counts, deferred init and plan errors."""

from __future__ import annotations

import functools
import gc
import time
import weakref

import pytest
import torch
import torch.distributed as dist
import transformers
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils._python_dispatch import TorchDispatchMode

import shardwise as sw
from parity import (EPS_GRAD, EPS_LOSS, SGD, Case, Run, assert_meaningful, assert_parity, full_grads, gpt_batches, make_gpt,
                    compare_cases, reference_run, run_and_compare)
from shardwise.comm import CollectiveCounter
from shardwise.plan import resolve_plan

STEPS = 5
gpt = functools.partial(make_gpt, 0)


@pytest.mark.parametrize("world, config", [
    (2, {"tp": 2}),
    (2, {"tp": 2, "sequence_parallel": True}),
    (4, {"tp": 4}),
    (4, {"tp": 4, "sequence_parallel": True}),
    (4, {"tp": 2, "sequence_parallel": True}),  # tp=2 x dp=2
])
def test_gpt_parity(world, config):
    run_and_compare(world, config, gpt, gpt_batches(STEPS, 8), plan="gpt")


def test_foreach_and_fused_optimizer_steps():
    """torch's multi-tensor and fused optimizer steps (foreach is its default on CUDA) take tp's
    sharded parameters (DTensors) and replicated ones (plain) in one list, which DTensor refused
    as mixed at the first step; each trains as one process does with the same optimizer."""
    compare_cases(2, [Case(f"tp2 {kind}", {"tp": 2}, gpt, gpt_batches(STEPS, 8), plan="gpt", optimizer=kind)
                      for kind in ("sgd foreach", "adamw fused")])


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_dropout_matches_one_process(sequence_parallel):
    """Embedding and residual dropout draw the masks one process draws, shards included."""
    factory = functools.partial(make_gpt, 0, dropout=0.2)
    run_and_compare(2, {"tp": 2, "sequence_parallel": sequence_parallel}, factory, gpt_batches(STEPS, 4), plan="gpt")


def test_deferred_init_parity():
    run_and_compare(4, {"tp": 2}, gpt, gpt_batches(STEPS, 8), plan="gpt", deferred=True)


def _deferred_memory(tp: int):
    module = sw.deferred_init(make_gpt, 0, n_layer=4, d_model=128)
    record = module.__dict__["_shardwise_deferred"]
    pm = sw.parallelize(module, sw.ParallelConfig(tp=tp), plan="gpt")
    eager = make_gpt(0, n_layer=4, d_model=128)
    full = pm.full_state_dict()
    exact = all(torch.equal(full[k], v) for k, v in eager.state_dict().items())
    local_bytes = sum(p.to_local().nbytes if isinstance(p, DTensor) else p.nbytes for p in pm.module.parameters())
    return exact, local_bytes, record.materialized_bytes, record.peak_bytes


def test_deferred_init_materializes_only_the_shard():
    tp = 4
    eager = make_gpt(0, n_layer=4, d_model=128)
    resolved = resolve_plan(sw.plan.zoo["gpt"](sw.ParallelConfig(tp=tp)), eager, tp)
    full = sum(p.nbytes for p in eager.parameters())
    expected = sum(p.nbytes / tp if not isinstance(resolved.params.get(n, Replicate()), Replicate) else p.nbytes
                   for n, p in eager.named_parameters())
    largest = max(p.nbytes for p in eager.parameters())
    for exact, local_bytes, materialized, peak in sw.testing.run_on_ranks(_deferred_memory, tp, tp):
        assert exact, "deferred values must equal eager construction with the same seed"
        assert local_bytes == expected and materialized == local_bytes
        assert local_bytes < 0.3 * full, (local_bytes, full)  # ~1/tp: only norms, biases, positions are whole
        assert peak <= local_bytes + 2 * largest, (peak, local_bytes, largest)


def test_deferred_init_advances_the_rng_like_eager():
    from shardwise.models import GPT, GPTConfig

    torch.manual_seed(3)
    GPT(GPTConfig())
    after_eager = torch.rand(3)
    torch.manual_seed(3)
    sw.deferred_init(GPT, GPTConfig())
    assert torch.equal(torch.rand(3), after_eager)


class _OwnGenerator(nn.Module):
    """Weights drawn from a generator of the factory's own (torch.randn(..., generator=g))."""

    def __init__(self, generator: torch.Generator):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        with torch.no_grad():
            self.fc.weight.copy_(torch.randn(8, 8, generator=generator))
            self.extra = nn.Parameter(torch.rand(4, generator=generator))

    def forward(self, x):
        return self.fc(x).sum() + self.extra.sum()


def _own_generator_values():
    torch.manual_seed(0)  # nn.Linear's bias (the global stream)
    generator = torch.Generator().manual_seed(5)
    pm = sw.parallelize(sw.deferred_init(_OwnGenerator, generator), sw.ParallelConfig())
    return {k: v.clone() for k, v in pm.full_state_dict().items()}, torch.rand(2, generator=generator)


def test_deferred_init_replays_a_factorys_own_generator():
    """Recording runs each random op once for the stream to advance as eager construction does;
    the replay must start a generator passed to the op from where it was then (it drew other
    values, silently, before), and leave it where eager construction leaves it."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(5)
    eager = _OwnGenerator(generator).state_dict()
    after = torch.rand(2, generator=generator)
    values, stream = sw.testing.run_on_ranks(_own_generator_values, 1)[0]
    assert all(torch.equal(values[k], eager[k]) for k in eager)
    assert torch.equal(stream, after)


# -- the seed's veScale plan, verbatim ----------------------------------------------
class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(self.relu(self.fc1(x)))


VESCALE_PLAN = {
    "parameter": {"fc1.weight": [Shard(0)], "fc1.bias": [Shard(0)], "fc2.weight": [Shard(1)], "fc2.bias": [Replicate()]},
    "forward": {"fc1.input": [[Replicate()]], "fc2.output": [[Replicate()]]},
}


def make_mlp() -> MLP:
    torch.manual_seed(0)
    return MLP()


class MLPLoss(nn.Module):
    """The seed's MLP with its loss, for the reference run."""

    def __init__(self):
        super().__init__()
        self.mlp = make_mlp()

    def forward(self, batch):
        return nn.functional.mse_loss(self.mlp(batch[0]), batch[1])


def _train_mlp(data):
    model = sw.parallelize(make_mlp(), sw.ParallelConfig(tp=dist.get_world_size()), plan=VESCALE_PLAN)
    opt = sw.build_optimizer(model, torch.optim.SGD, **SGD)
    run = Run([], [])
    for x, y in data:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if not run.grads:
            run.grads.append({f"mlp.{k}": v for k, v in full_grads(model.module).items()})
        opt.step()
        opt.zero_grad()
        run.losses.append(float(loss.detach()))
    run.final = {f"mlp.{k}": v.detach().clone() for k, v in model.full_state_dict().items()}
    return run


def _mlp_data():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(6, 4, generator=gen)
    y = torch.tanh(x @ torch.randn(4, 4, generator=gen))  # a target the MLP can learn: its loss falls
    return [(x, y)] * STEPS


def test_vescale_mlp_plan_verbatim():
    data = _mlp_data()
    reference = reference_run(MLPLoss, data)
    assert_meaningful(reference)
    for result in sw.testing.run_on_ranks(_train_mlp, 2, data):
        assert_parity(reference, result)


# -- communication -------------------------------------------------------------------
def _count(layers: int, sequence_parallel: bool, batch):
    pm = sw.parallelize(make_gpt(0, n_layer=layers), sw.ParallelConfig(tp=2, sequence_parallel=sequence_parallel), plan="gpt")
    pm.train_step(batch)
    with CollectiveCounter(c10d=True) as counter:  # regather.py's gathers are c10d calls
        pm.train_step(batch)
    return dict(counter.calls), dict(counter.bytes), dict(pm.gradients.stats.calls)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_one_collective_forward_and_backward_per_column_row_pair(sequence_parallel):
    batch = gpt_batches(1, 4)[0]  # b=4, s=16, h=64
    activation = 4 * 16 * 64 * 4
    (c2, b2, _), (c3, b3, dp_calls) = (sw.testing.run_on_ranks(_count, 2, layers, sequence_parallel, batch)[0] for layers in (2, 3))
    per_layer = {op: c3.get(op, 0) - c2.get(op, 0) for op in set(c2) | set(c3)}
    per_layer_bytes = {op: b3.get(op, 0) - b2.get(op, 0) for op in set(b2) | set(b3)}
    if not sequence_parallel:  # attention pair + MLP pair: one all-reduce each way
        assert {op: n for op, n in per_layer.items() if n} == {"all_reduce": 4}
        assert per_layer_bytes["all_reduce"] == 4 * activation
        assert dp_calls == {}  # one replica, no partial gradients: nothing for the buckets
    else:  # all-gather before each pair, reduce-scatter after it, and their transposes in backward;
        # backward gathers each pair's input again (saved as the sequence shard, as Megatron does)
        assert {op: n for op, n in per_layer.items() if n} == {"all_gather": 6, "reduce_scatter": 4}
        assert per_layer_bytes["reduce_scatter"] == 4 * activation
        assert per_layer_bytes["all_gather"] == 6 * activation // 2
        assert dp_calls == {"all_reduce": 2}  # norm/bias partial grads: one bucket per step, two steps


def _partial_grads_synced(batch):
    pm = sw.parallelize(make_gpt(0), sw.ParallelConfig(tp=2, sequence_parallel=True), plan="gpt")
    pm.train_step(batch)
    partial = sorted(n for n, p in pm.module.named_parameters() if id(p) in pm.tensor_parallel.partial_grad_params)
    plain = sw.parallelize(make_gpt(0), sw.ParallelConfig(tp=2, sequence_parallel=True), plan="gpt")
    plain(batch).backward()  # a user's habit, outside pmodel.loss_parallel(): the loss-parallel head's too
    return type(pm.module.layers[0].ln1.weight.grad).__name__, full_grads(pm.module), partial, full_grads(plain.module)


def test_partial_norm_gradients_are_summed_once_and_stay_plain():
    """Also: `loss = pmodel(batch); loss.backward()` under the loss-parallel plan gives train_step's
    gradients, bit for bit (torch alone fails in nll_loss_backward outside its loss_parallel context)."""
    batch = gpt_batches(1, 4)[0]
    reference = reference_run(gpt, [batch]).grads[0]
    (kind, grads, partial, plain), (_, other, _, _) = sw.testing.run_on_ranks(_partial_grads_synced, 2, batch)
    assert grads.keys() == plain.keys() and all(torch.equal(grads[n], plain[n]) for n in grads)
    assert kind == "Tensor"  # a plain, replicated gradient: optimizers never re-reduce it
    per_layer = ["attn.o_proj.bias", "ln1.bias", "ln1.weight", "ln2.bias", "ln2.weight", "mlp.fc2.bias"]
    assert partial == sorted([f"layers.{i}.{n}" for i in range(2) for n in per_layer] + ["ln_f.bias", "ln_f.weight"])
    for name in partial:  # bound: tests/parity.py
        assert torch.equal(grads[name], other[name])
        assert (grads[name] - reference[name]).abs().max() <= EPS_GRAD * reference[name].abs().max()


# -- state dicts and inference ----------------------------------------------------------
def _state_round_trip(batch):
    pm = sw.parallelize(make_gpt(0), sw.ParallelConfig(tp=2), plan="gpt")
    other = make_gpt(7).state_dict()  # different values, same keys
    pm.load_full_state_dict(other)
    back = pm.full_state_dict()
    wte = pm.module.wte.weight
    return (all(torch.equal(back[k], v) for k, v in other.items()),
            tuple(wte.to_local().shape), pm.infer_step(batch))


def test_full_state_dict_round_trip_and_inference_under_tp_dp():
    batch = gpt_batches(1, 2)[0]
    reference = make_gpt(7)
    with torch.no_grad():
        want = reference(batch)
    for equal, local_shape, loss in sw.testing.run_on_ranks(_state_round_trip, 4, batch):
        assert equal
        assert local_shape == (32, 64)  # vocab 64 split over tp=2
        assert abs(float(loss) - float(want)) <= EPS_LOSS * float(want)  # bound: tests/parity.py


# -- bad plans -------------------------------------------------------------------------
@pytest.mark.parametrize("plan, tp, pattern", [
    ({"params": {"layers.*.attn.qproj.weight": "Shard(0)"}}, 2,
     r"parameter 'layers.\*.attn.qproj.weight' matches no parameter of GPT; closest names: layers.0.attn.q_proj.weight"),
    ({"params": {"wte.weight": "Shard(1)"}}, 3,
     r"parameter 'wte.weight' of shape \(64, 64\) cannot be Shard\(1\) over tp=3: dim 1 has size 64, not divisible by 3"),
    ({"params": {"wte.weight": ["Shard(0)", "Shard(1)"]}}, 2,
     r"'wte.weight' has 2 placements .* sharded over one mesh dim \(tp\)"),
    ({"params": {"layers.0.mlp.fc1.weight": "Shard(2)"}}, 2,
     r"Shard\(2\) on parameter 'layers.0.mlp.fc1.weight' of shape \(256, 64\): it has only 2 dims"),
    ({"params": {"wte.weight": "Partial()"}}, 2, r"'wte.weight' cannot be Partial"),
    ({"activations": {"layers.*.mlp.fc1.input": [["Replicate()"], ["Replicate()"]]}}, 2,
     r"'layers.0.mlp.fc1.input' gives 2 input placements but Linear.forward takes 1 input"),
    ({"activations": {"layers.*.mlp.fc3.input": "Replicate()"}}, 2,
     r"module 'layers.\*.mlp.fc3' matches no module of GPT; closest names: layers.0.mlp.fc2, layers.0.mlp.fc1"),
    ({"params": {"wte.weight": "Shard(0)", "lm_head.weight": "Shard(1)"}}, 2,
     r"tied parameter .* two different placements"),
])
def test_bad_plans_name_the_problem(plan, tp, pattern):
    with pytest.raises(sw.PlanError, match=pattern):
        sw.parallelize(make_gpt(0), sw.ParallelConfig(tp=tp), plan=plan)


def test_sharding_a_module_without_a_rule():
    with pytest.raises(sw.PlanError, match=r"layers.0.ln1 \(LayerNorm\) has sharded parameters but shardwise has no "
                                           r"tensor-parallel rule for LayerNorm"):
        sw.parallelize(make_gpt(0), sw.ParallelConfig(tp=2), plan={"params": {"layers.0.ln1.weight": "Shard(0)"}})


def _plan_error_of_a_step(plan: sw.Plan) -> str:
    """The PlanError one GPT training step raises at tp=2 under `plan`, or "no error"."""
    pm = sw.parallelize(make_gpt(0), sw.ParallelConfig(tp=2), plan=plan)
    try:
        pm.train_step(gpt_batches(1, 2)[0])
    except sw.PlanError as exc:
        return str(exc)
    return "no error"


def _undeclared_sequence_shards():
    plan = sw.plan.zoo["gpt"](sw.ParallelConfig(tp=2, sequence_parallel=True))
    del plan.activations["layers.*.ln2.input"]  # ln2 runs on sequence shards, but the plan no longer says so
    return _plan_error_of_a_step(plan)


def test_replicated_params_on_undeclared_shards_are_caught_on_every_rank():
    messages = sw.testing.run_on_ranks(_undeclared_sequence_shards, 2)
    assert messages[0] == messages[1]
    assert "'layers.0.ln2.weight'" in messages[0] and "different gradients on different tp ranks" in messages[0]


def _gathered_read_by_a_norm():
    plan = sw.plan.zoo["gpt"](sw.ParallelConfig(tp=2, sequence_parallel=True))
    plan = plan.replace(activations={**plan.activations, "layers.*.input": "Shard(1) -> Replicate()"})  # ln1 reads it
    return _plan_error_of_a_step(plan)


def test_a_gathered_input_read_by_a_replicated_module_is_refused():
    """An input conversion Shard -> Replicate sums its gradient over tp (for column-parallel
    readers, whose input gradients are partial); a norm reading it would be counted twice."""
    messages = sw.testing.run_on_ranks(_gathered_read_by_a_norm, 2)
    assert messages[0] == messages[1]
    assert "layers.0 gathers its input over tp" in messages[0] and "but layers.0.ln1 reads it too" in messages[0]


def _llama_collectives(layers: int, batch):
    from test_zoo import EndToEnd

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                      num_hidden_layers=layers, intermediate_size=128, max_position_embeddings=64)
    pm = sw.parallelize(EndToEnd(transformers.LlamaForCausalLM(config)),
                        sw.ParallelConfig(tp=2, sequence_parallel=True), plan="llama")
    pm.train_step(batch)
    beside = _GathersBesideMatmuls()
    waits = pm.tensor_parallel.wait
    pm.tensor_parallel.wait = lambda work, what, group: (beside.waited(), waits(work, what, group))
    with CollectiveCounter(c10d=True) as counter, beside:  # regather.py's gathers are c10d calls
        pm.train_step(batch)
    return dict(counter.calls), dict(counter.bytes), beside.count


class _GathersBesideMatmuls(TorchDispatchMode):
    """Counts backward's gathers of kept shards (c10d all-gathers, waited through the
    tensor-parallel wait, which the caller routes through `waited`) during which, between launch
    and wait, a matmul ran."""

    def __enter__(self):
        self.count, self.launched = 0, []  # per gather launched and not waited for: a matmul since?
        return super().__enter__()

    def waited(self) -> None:  # the latest launch: agreements' all-gathers (waited elsewhere) come before
        if self.launched:
            self.count += self.launched.pop()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if func.namespace == "c10d" and name == "_allgather_base_":
            self.launched.append(False)
        elif name in ("mm", "addmm", "bmm") and self.launched:
            self.launched = [True] * len(self.launched)
        return func(*args, **(kwargs or {}))


def test_hugging_face_sequence_parallel_gathers_once_per_pair():
    """Llama's attention is gathered at its input (it reads hidden_states.shape): still one
    all-gather and one reduce-scatter per column/row pair, and q, k, v share the gather. Backward
    gathers each pair's input again (kept as the shard) beside the first input-gradient matmul,
    before the weight gradients wait for it (regather.py): a gather waited for at once fails."""
    ids = gpt_batches(1, 4)[0]
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}  # b=4, s=16, h=64
    activation = 4 * 16 * 64 * 4
    (c2, b2, beside2), (c3, b3, beside3) = (sw.testing.run_on_ranks(_llama_collectives, 2, layers, batch)[0]
                                            for layers in (2, 3))
    per_layer = {op: c3.get(op, 0) - c2.get(op, 0) for op in set(c2) | set(c3)}
    per_layer_bytes = {op: b3.get(op, 0) - b2.get(op, 0) for op in set(b2) | set(b3)}
    assert {op: n for op, n in per_layer.items() if n} == {"all_gather": 6, "reduce_scatter": 4}
    assert per_layer_bytes["reduce_scatter"] == 4 * activation
    assert per_layer_bytes["all_gather"] == 6 * activation // 2
    assert beside3 - beside2 == 2


def _kept_shard_lifetime() -> tuple[bool, bool, float, float]:
    """A column-parallel matmul keeping its input's sequence shard (regather.py), its graph held
    after backward as a pipeline stage's outputs are: is the shard freed with the backward, and
    does a retained graph keep it for a second backward?"""
    from shardwise.parallel.collectives import all_gather_along
    from shardwise.parallel.tensor.regather import GatheredInput, RegatherCounts, column_matmul_keeping_shard

    group, wait = dist.group.WORLD, lambda work, what, group: work.wait()
    torch.manual_seed(dist.get_rank())
    weight = torch.randn(6, 8, requires_grad=True)
    freed = []
    for retain in (False, True):
        kept = torch.randn(2, 4, 8)  # [b, s / tp, h]: this rank's shard
        whole = all_gather_along(kept, group, 1).requires_grad_()  # what the forward's gather made
        alive = weakref.ref(kept)
        gathered = GatheredInput(kept, 1, group, RegatherCounts(), wait)
        del kept
        out = column_matmul_keeping_shard(whole, weight, None, gathered, False)
        gathered.forget_shard()  # the block's forward ends
        weight.grad = None
        out.sum().backward(retain_graph=retain)
        once = weight.grad.clone()
        if not retain:  # gloo's worker thread lets go of a gather's input a moment after its wait returns
            deadline = time.monotonic() + 10
            while alive() is not None and time.monotonic() < deadline:
                gc.collect()
                time.sleep(0.01)
        freed.append(alive() is None)  # `out` still holds the graph
        if retain:
            out.sum().backward()
    expected = whole.detach().reshape(-1, 8).sum(0).expand(6, 8)  # d(sum(x W^T)) / dW
    return freed[0], freed[1], float((once - expected).abs().max()), float((weight.grad - 2 * expected).abs().max())


def test_a_kept_sequence_shard_is_freed_with_its_backward():
    """Sequence parallelism's column matmuls keep their input's shard and gather it again in
    backward. Kept as the matmul's attribute, a shard lived as long as its graph did: under a
    pipeline, whose stages hold their outputs past their backward, finished microbatches' shards
    stayed (pp 2 x tp 2 with sp, 4 microbatches: the in-step peak 11% over the planner's, 7% without
    that; bench/planner.py). Saved as autograd saves an input, it goes with the
    backward, and a retained graph keeps it: a second backward gathers it again and gets the
    same gradient (sums of 64 products of normal values: exact in float32 to a few ulps, so
    1e-4 is not a tolerance that could hide a wrong gather, which is off by O(1)). Freed means
    within 10 s: gloo's worker thread holds a collective's input a moment after its wait returns
    (one CI run in the first saw it alive at once); a shard the graph holds never goes."""
    for rank, (freed, retained, once, twice) in enumerate(sw.testing.run_on_ranks(_kept_shard_lifetime, 2)):
        assert freed, f"rank {rank}: the kept shard outlived its backward"
        assert not retained, f"rank {rank}: a retained graph lost its kept shard"
        assert once < 1e-4 and twice < 1e-4, f"rank {rank}: regathered gradients off by {once}, {twice}"


class ShardedLossMLP(nn.Module):
    """An MLP over a sequence with its loss inside forward, which the plan leaves
    sequence-sharded up to the loss: each tp rank computes the mean over its own tokens."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.mlp = MLP()

    def forward(self, batch):
        return (self.mlp(batch) - 0.5).pow(2).mean()


def _sequences(steps: int = STEPS) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(4, 8, 4, generator=gen) for _ in range(steps)]


SHARDED_LOSS_PLANS = {  # activations only: every parameter replicated, its gradient partial over tp
    "fc1 input split": {"activations": {"mlp.fc1.input": "Replicate() -> Shard(1)", "mlp.fc2.input": "Shard(1)"}},
    "output declared too": {"activations": {"mlp.fc1.input": "Replicate() -> Shard(1)", "mlp.fc2.input": "Shard(1)",
                                            "mlp.fc2.output": "Shard(1)"}},
}


@pytest.mark.parametrize("name", list(SHARDED_LOSS_PLANS))
def test_loss_on_sequence_sharded_activations_matches_one_process(name):
    """The loss is the whole sequence's (the mean of the tp ranks' equal shards): every
    gradient was exactly 2.0x at tp=2 before (issue 26), with the loss right. tests/faults.py
    'sharded-loss-whole' breaks it."""
    run_and_compare(2, {"tp": 2, "sequence_parallel": True}, ShardedLossMLP, _sequences(), plan=SHARDED_LOSS_PLANS[name])

