"""ZeRO stages 1-3, the distributed optimizer and mixed precision.

The optimizer is what ZeRO shards, so these parity tests train with AdamW and judge the
parameters with the per-element AdamW bound of tests/parity.py (a run that never stepped
fails it); the other parity tests use SGD with momentum.
"""

from __future__ import annotations

import functools
import weakref

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from parity import (ADAMW, SGD, Case, Run, assert_meaningful, compare_cases, assert_parity, full_grads, gpt_batches, make_gpt,
                    reference_run, replica_slice, run_and_compare)

STEPS = 5
gpt = functools.partial(make_gpt, 0, n_layer=4)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_parity_dp4(zero):
    run_and_compare(4, {"zero": zero}, gpt, gpt_batches(STEPS, 8), clip=0.5, optimizer="adamw")


@pytest.mark.parametrize("zero, sequence_parallel", [(1, False), (2, True), (3, False)])
def test_zero_with_tensor_parallel(zero, sequence_parallel):
    config = {"zero": zero, "tp": 2, "sequence_parallel": sequence_parallel}
    run_and_compare(4, config, gpt, gpt_batches(STEPS, 8), plan="gpt", clip=0.5, optimizer="adamw")


def test_zero_reducing_every_microbatch_into_the_shards():
    """ZeRO-2/3 over 2 microbatches reduce-scatter each microbatch's gradients into the shards,
    which sum them (gradients.py's reduce_into_shards): whole gradients, losses and AdamW
    parameters against one process, at dp4 and at dp2 x tp2 with sequence parallelism. A shard
    that kept only the last microbatch's reduction (overwritten, not summed) is off by half the
    gradient, far past parity's bounds."""
    batches = gpt_batches(STEPS, 8)
    cases = [Case(f"zero{zero} dp4", {"zero": zero, "microbatches": 2}, gpt, batches, optimizer="adamw")
             for zero in (2, 3)]
    cases.append(Case("zero2 dp2 tp2+sp", {"zero": 2, "tp": 2, "sequence_parallel": True, "microbatches": 2}, gpt,
                      batches, plan="gpt", optimizer="adamw"))
    compare_cases(4, cases)


@pytest.mark.parametrize("zero", [1, 3])
def test_zero_with_pipeline(zero):
    run_and_compare(4, {"zero": zero, "pp": 2, "microbatches": 2}, gpt, gpt_batches(STEPS, 8), clip=0.5,
                    optimizer="adamw")


# -- memory: the ZeRO paper's formulas --------------------------------------------------
def _memory(zero: int, mixed: bool):
    model = make_gpt(0, n_layer=4, d_model=128)
    pm = sw.parallelize(model, sw.ParallelConfig(zero=zero, param_dtype=torch.bfloat16 if mixed else None))
    opt = sw.build_optimizer(pm, torch.optim.AdamW, **ADAMW)
    index, count = sw.data_parallel_info(pm)
    pm.train_step(replica_slice(gpt_batches(1, 8)[0], index, count))
    opt.step()
    padding = sum((b.padded - sum(b.sizes) + b.summary_slots) * 4 for b in pm.gradients.buckets)
    return pm.memory(), sum(p.numel() for p in pm.module.parameters()), padding, pm.summary()


@pytest.mark.parametrize("zero, mixed", [(0, False), (1, False), (2, False), (3, False), (3, True)])
def test_per_rank_bytes_follow_the_zero_formulas(zero, mixed):
    """Mixed precision under ZeRO-3 (bf16 parameters and gradients): the float32 shard is the
    master and the parameters' only copy, 14 bytes an element over n ranks (FSDP2's); with a
    bf16 shard kept beside it, parameters read 2/n and the optimizer 12/n (16 in all)."""
    n = 4
    for memory, psi, padding, summary in sw.testing.run_on_ranks(_memory, n, zero, mixed):
        expected = {  # Adam, fp32: parameters, gradients, optimizer state (exp_avg + exp_avg_sq)
            (0, False): (4 * psi, 4 * psi, 8 * psi),
            (1, False): (4 * psi, 4 * psi, 8 * psi / n),
            (2, False): (4 * psi, 4 * psi / n, 8 * psi / n),
            (3, False): (4 * psi / n, 4 * psi / n, 8 * psi / n),
            (3, True): (4 * psi / n, 2 * psi / n, 8 * psi / n),
        }[zero, mixed]
        for (name, got), want in zip(memory.items(), expected):
            assert abs(got - want) <= 0.05 * want + padding, (zero, name, got, want, padding)
        assert ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in memory.items()) in summary  # summary reports it


def _zero3_gathers(recomputes):
    return [_zero3_gathers_under(recompute) for recompute in recomputes]


def _zero3_gathers_under(recompute):
    model = make_gpt(0, n_layer=4, d_model=128)
    pm = sw.parallelize(model, sw.ParallelConfig(zero=3, recompute=recompute))
    opt = sw.build_optimizer(pm, torch.optim.AdamW, **ADAMW)
    shards = pm.param_shards
    buckets = pm.gradients.buckets

    def gathered_bytes() -> int:
        return sum(b.param_buffer.untyped_storage().nbytes() for b in buckets)

    batch = gpt_batches(1, 8)[0]
    index, count = sw.data_parallel_info(pm)
    calls, peak = [], [0]
    for _ in range(3):
        pm.gradients.stats.reset()
        # counted at every gather (module hooks would sample less often, and a full backward
        # hook changes the graph the gathers follow)
        shards.most_whole_bytes = shards.whole_bytes
        pm.train_step(replica_slice(batch, index, count))
        opt.step()
        opt.zero_grad()
        calls.append(pm.gradients.stats.calls["all_gather"])
        peak[0] = max(peak[0], shards.most_whole_bytes)
    block = max(sum(b.param_buffer.numel() * 4 for b in shards._needed[u]) for u in shards._needed if "layers" in u)
    ends = [b for b in buckets if all(b in shards._needed[u] for u in ("wte", "wpe", "ln_f"))]
    return calls, peak[0], block, [b.param_buffer.numel() * 4 for b in ends], gathered_bytes(), len(shards._needed)


def test_zero3_gathers_each_block_twice_and_frees_between_steps():
    """ZeRO-3 on a 4-block GPT: the small units around the blocks (embeddings, final norm and
    the head tied to the embedding) share one gather; each block is gathered for its forward and
    again for its backward, except that nothing is freed only to be gathered right back (the
    last unit's backward follows its forward). Per step: forward ends + 4 blocks + ends (ln_f,
    lm_head) = 6, backward 4 blocks + ends (embeddings) = 5. Inside the step at most two units
    (one in use, one prefetched: two blocks, or the ends and a block) are whole, as the planner
    charges; after it, none. Counted at every gather: where one block's output is the next one's
    input, the release of the later block must run before the earlier one prefetches its
    neighbour (fault: the hooks in the order they were registered hold three blocks whole).
    The same under full and selective recompute: a forward recomputed in backward must not
    prefetch the unit after it, whose backward is done (fault: 14 gathers a step, and by the
    end of backward every block whole)."""
    recomputes = (None, "full", "selective")
    for rank in sw.testing.run_on_ranks(_zero3_gathers, 2, recomputes):
        for recompute, (calls, peak, block, ends, after, units) in zip(recomputes, rank):
            assert units == 8 and len(ends) == 1, (recompute, units, ends)
            assert calls[1:] == [11, 11], (recompute, calls)  # the first step learns the order (no prefetch yet)
            assert block < peak <= max(2 * block, ends[0] + block), (recompute, peak, ends, block)
            assert after == 0


def _gradient_buffers_in_flight(zero: int):
    pm = sw.parallelize(make_gpt(0, n_layer=4, d_model=128), sw.ParallelConfig(zero=zero, bucket_mb=0.05))
    opt = sw.build_optimizer(pm, torch.optim.AdamW, **ADAMW)
    buckets = pm.gradients.buckets
    in_blocks = {id(p) for p in pm.module.layers.parameters()}
    # the buckets of the units around the blocks (embeddings, final norm, tied head) fill from the
    # first gradient (the head's) to the last (the embedding's): held throughout, counted apart
    blocks = [b for b in buckets if all(id(p) in in_blocks for p in b.params)]
    # whether a buffer's memory is alive, not the bucket's own reference to it: a view of it
    # (a parameter's .grad) keeps it, as a weak reference to the buffer tells
    buffers: list[weakref.ref] = []
    held = []

    def launching(grads: torch.Tensor) -> None:
        if any(b.buffer is not None and b.buffer.data_ptr() == grads.data_ptr() for b in blocks):
            buffers.append(weakref.ref(grads._base))
        held.append(sum(buffer() is not None for buffer in buffers))

    pm.gradients.pre_hooks.append(launching)
    index, count = sw.data_parallel_info(pm)
    for batch in gpt_batches(2, 8):
        buffers.clear()
        pm.train_step(replica_slice(batch, index, count))
        opt.step()
        opt.zero_grad()
    return max(held), len(blocks), sum(b.buffer is not None for b in buckets) + sum(r() is not None for r in buffers)


@pytest.mark.parametrize("zero", [2, 3])
def test_backward_holds_few_whole_gradient_buckets(zero):
    """ZeRO-2/3 keep gradients as shards: a bucket's whole-gradient buffer is freed once its
    reduce-scatter is done, so backward holds at most IN_FLIGHT launched ones, the one being
    launched and one filling, not every bucket until the step ends (the planner counts shards).
    Counted by the buffers' memory, not the buckets' references: the parameters' .grad views of
    a released buffer kept every one alive until the step's end (fault: all 43 of ZeRO-2's, 48 of ZeRO-3's)."""
    from shardwise.parallel.data.gradients import IN_FLIGHT

    for most, buckets, after in sw.testing.run_on_ranks(_gradient_buffers_in_flight, 2, zero):
        assert buckets >= 20, buckets
        assert most <= IN_FLIGHT + 1, (most, buckets)  # the one launching, IN_FLIGHT - 1 earlier, one filling
        assert after == 0


def _with_a_dropped_backward(cases: list[tuple[int, bool]], drop: bool):
    """Per case (zero, bf16 parameters): STEPS steps of the Gated model (its `extra` layer used
    only by flagged samples), each preceded, when `drop`, by a backward of flagged samples under
    no_sync that zero_grad() throws away; whole gradients and parameters after the steps, and
    the gradient bytes held after each zero_grad()."""
    from test_data_parallel import gated_batches, make_gated

    out = []
    for zero, bf16 in cases:
        dtype = torch.bfloat16 if bf16 else None
        pm = sw.parallelize(make_gated(), sw.ParallelConfig(zero=zero, param_dtype=dtype,
                                                            reduce_dtype=torch.float32 if bf16 else None))
        opt = sw.build_optimizer(pm, torch.optim.SGD, **SGD)
        index, count = sw.data_parallel_info(pm)
        held, grads = [], []
        for batch in gated_batches(STEPS, 8):
            batch = {k: v.to(dtype) if v.is_floating_point() and dtype else v for k, v in batch.items()}
            mine = replica_slice(batch, index, count)
            if drop:
                with pm.no_sync():
                    pm({**mine, "flag": torch.ones_like(mine["flag"])}).backward()
                opt.zero_grad()
            pm({**mine, "flag": torch.zeros_like(mine["flag"])}).backward()
            grads.append({k: v.clone() for k, v in pm.full_grad_dict().items()})
            opt.step()
            opt.zero_grad()
            held.append(pm.memory()["gradients"])
        after = sorted(pm.full_grad_dict())  # none after zero_grad(), as on one process
        out.append((grads, pm.full_state_dict(), held, sum(b.nbytes for b in pm.gradients.buckets), after))
    return out


def test_a_dropped_backward_leaves_no_trace_and_zero_grad_frees_the_shards():
    """A user's habit: a backward accumulated under no_sync, then thrown away with zero_grad()
    (a bad batch, a skipped step). Nothing of it may reach the next reduction: the gradients and
    parameters after several steps equal, bit for bit, those of the same layout never shown it
    (the same operations in the same order). Faults: the accumulation window kept across
    zero_grad() adds the dropped gradients into cast (bf16 -> float32) buckets and gives the
    layer only it used a gradient (zeros under ZeRO-2/3's kept shards, stale values otherwise)
    where one process has None. And zero_grad() frees ZeRO-2/3's gradient shards, as FSDP does,
    so none is held while the next forward and the loss's backward run (ZeRO-0/1 keep their
    buffers, as DDP does; fault: the shards kept, 4 bytes an element over the replicas), and
    full_grad_dict() then reports no gradient, as one process holds none (it read the buffers'
    and shards' zeros)."""
    cases = [(zero, bf16) for zero in (0, 1, 2, 3) for bf16 in (False, True)]
    dropped = sw.testing.run_on_ranks(_with_a_dropped_backward, 2, cases, True)
    clean = sw.testing.run_on_ranks(_with_a_dropped_backward, 2, cases, False)
    for rank_dropped, rank_clean in zip(dropped, clean):
        for (zero, bf16), (grads, final, held, buffers, after), (want_grads, want_final, *_) in zip(
                cases, rank_dropped, rank_clean):
            assert after == [], (zero, bf16, after)
            assert [sorted(g) for g in grads] == [sorted(g) for g in want_grads], (zero, bf16)
            assert all("extra.weight" not in g for g in grads), (zero, bf16)
            for got, want in zip(grads, want_grads):
                assert all(torch.equal(got[k], want[k]) for k in want), (zero, bf16)
            assert all(torch.equal(final[k], want_final[k]) for k in want_final), (zero, bf16)
            assert set(held) == ({0} if zero >= 2 else {buffers}), (zero, bf16, held, buffers)


# -- mixed precision ----------------------------------------------------------------------
def bf16_emulation(batches, replicas: int) -> Run:
    """One process computing what data-parallel bf16 training promises: each replica's
    share in bf16, gradients averaged in float32 (reduce_dtype), float32 master weights
    stepped by SGD with momentum and cast back to bf16. Sums of a few bf16 values are exact
    in float32 and halving/quartering is exact, so the parallel run must match bit for bit."""
    model = make_gpt(0)
    masters = [p.detach().clone() for p in model.parameters()]  # float32, from the values before casting
    model.to(torch.bfloat16)
    opt = torch.optim.SGD(masters, **SGD)
    run = Run([], [])
    for batch in batches:
        grads, losses = [], []
        for index in range(replicas):
            loss = model(replica_slice(batch, index, replicas))
            loss.backward()
            grads.append([p.grad.float() for p in model.parameters()])
            losses.append(loss.detach().float())
            model.zero_grad()
        mean = [sum(g[i] / replicas for g in grads) for i in range(len(masters))]
        if not run.grads:
            run.grads.append({n: g for (n, _), g in zip(model.named_parameters(), mean)})
        for master, grad in zip(masters, mean):
            master.grad = grad
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for master, param in zip(masters, model.parameters()):
                param.copy_(master)
        run.losses.append(float(sum(l / replicas for l in losses)))
    run.final = {k: v.float() for k, v in model.state_dict().items()}
    return run


def _bf16_run(config: dict, batches):
    pm = sw.parallelize(make_gpt(0), sw.ParallelConfig(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, **config),
                        plan="gpt" if config.get("tp", 1) > 1 else None)
    opt = sw.build_optimizer(pm, torch.optim.SGD, **SGD)
    index, count = sw.data_parallel_info(pm)
    run = Run([], [])
    invariants = []
    for batch in batches:
        run.losses.append(float(pm.train_step(replica_slice(batch, index, count))))
        grads = {k: v.float() for k, v in pm.full_grad_dict().items()}
        if not run.grads:
            run.grads.append(grads)
        masters_before = _full_masters(pm, opt)
        momentum = {k: v.clone() for k, v in _full_momentum(pm, opt).items()}
        opt.step()
        opt.zero_grad()
        invariants.append(_mixed_precision_invariants(pm, opt, grads, masters_before, momentum))
    run.final = {k: v.float() for k, v in pm.full_state_dict().items()}
    dtypes = {str(p.dtype) for p in pm.module.parameters()}
    reduce_dtypes = {str(b.dtype) for b in pm.gradients.buckets}
    return run, dtypes, reduce_dtypes, invariants


def _full_masters(pm, opt) -> dict[str, torch.Tensor]:
    """The float32 master weights, whole, by parameter name (collective)."""
    return _gather_pieces(pm, lambda piece: piece.optimized.detach().reshape(-1))


def _full_momentum(pm, opt) -> dict[str, torch.Tensor]:
    return _gather_pieces(pm, lambda piece: opt.state.get(piece.optimized, {}).get(
        "momentum_buffer", torch.zeros_like(piece.optimized)).detach().reshape(-1))


def _gather_pieces(pm, value) -> dict[str, torch.Tensor]:
    """Every parameter's optimizer-side tensor (masters, state), assembled whole from the
    ranks' pieces: each piece covers [lo, hi) of its parameter's local (tp) tensor."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, param in pm.module.named_parameters():
        local = param._local_tensor if isinstance(param, DTensor) else param
        flat = torch.zeros(local.numel())
        for piece in pm.optimizer_params.pieces.get(id(param), []):
            flat[piece.start:piece.end] = value(piece).float()
        if pm.config.zero:
            dist.all_reduce(flat, group=pm.topology.group("dp"))  # each element held by one dp rank
        shaped = flat.view(local.shape)
        if isinstance(param, DTensor):
            shaped = DTensor.from_local(shaped, param.device_mesh, param.placements, run_check=False).full_tensor()
        out[name] = shaped
    return out


def _mixed_precision_invariants(pm, opt, grads, masters_before, momentum) -> tuple[bool, bool]:
    """(masters stepped exactly by SGD with momentum from the reported float32 gradients,
    model parameters exactly the masters cast to bf16)."""
    masters = _full_masters(pm, opt)
    stepped = True
    for name, before in masters_before.items():
        if name not in grads:
            stepped &= torch.equal(masters[name], before)
            continue
        buf = momentum[name].mul(SGD["momentum"]).add_(grads[name])  # torch.optim.SGD's own arithmetic
        stepped &= torch.equal(masters[name], before.clone().add_(buf, alpha=-SGD["lr"]))
    state = pm.full_state_dict()
    cast = all(torch.equal(state[name], masters[name].to(torch.bfloat16)) for name in masters)
    return stepped, cast


@pytest.mark.parametrize("world, config", [(1, {}), (1, {"microbatches": 4}), (2, {}), (4, {"zero": 3}),
                                           (4, {"tp": 2, "zero": 2})])
def test_bf16_mixed_precision(world, config):
    """Data parallel: exactly what bf16_emulation computes (gradients, losses, parameters).
    One rank's microbatches average in float32 too (they summed in bf16 .grad once: 0.6% off).
    Tensor parallel changes where bf16 rounds inside the forward, so one process cannot
    emulate it bit for bit; there the recipe itself is checked exactly on every step: float32
    reduction, masters stepped by exactly the reported gradients, parameters exactly the
    masters cast to bf16, and the loss falls."""
    batches = gpt_batches(STEPS, 8)
    replicas = world // config.get("tp", 1) * config.get("microbatches", 1)  # microbatches average as replicas do
    reference = bf16_emulation(batches, replicas)
    for run, dtypes, reduce_dtypes, invariants in sw.testing.run_on_ranks(_bf16_run, world, config, batches):
        assert dtypes == {"torch.bfloat16"} and reduce_dtypes <= {"torch.float32"}
        assert all(stepped and cast for stepped, cast in invariants), invariants
        assert run.losses[-1] < run.losses[0] * 0.98, run.losses
        if config.get("tp", 1) == 1:
            assert run.losses == reference.losses
            assert all(torch.equal(run.grads[0][k], reference.grads[0][k]) for k in reference.grads[0])
            assert all(torch.equal(run.final[k], reference.final[k]) for k in reference.final)


# -- the distributed optimizer ------------------------------------------------------------
def _groups(named):
    """No weight decay for biases and norms, as users commonly do."""
    decay = [p for n, p in named if n.endswith("weight") and "ln" not in n]
    rest = [p for n, p in named if not (n.endswith("weight") and "ln" not in n)]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def _optimizer_api(batches):
    pm = sw.parallelize(make_gpt(0), sw.ParallelConfig(zero=2, microbatches=2))
    opt = sw.build_optimizer(pm, torch.optim.AdamW, params=_groups(list(pm.module.named_parameters())), **ADAMW)
    # scaled down before each microbatch's reduction, back up once after their sum: nothing changes
    opt.register_reduce_hook(pre=lambda g: g.div_(8), post=lambda g: g.mul_(8))
    index, count = sw.data_parallel_info(pm)
    run = Run([], [])
    for batch in batches:
        run.losses.append(float(pm.train_step(replica_slice(batch, index, count))))
        opt.scale_grads(3.0)  # the reference scales its gradients the same way
        if not run.grads:
            run.grads.append({k: v.clone() for k, v in pm.full_grad_dict().items()})
        opt.step()
        opt.zero_grad()
    run.final = {k: v.clone() for k, v in pm.full_state_dict().items()}
    shard_state = sum(t.numel() for s in opt.state.values() for t in s.values() if t.dim() > 0)
    saved = opt.state_dict()
    fresh = sw.build_optimizer(pm, torch.optim.AdamW, params=_groups(list(pm.module.named_parameters())), **ADAMW)
    fresh.load_state_dict(saved)
    same = all(torch.equal(a, b) for s, t in zip(opt.state.values(), fresh.state.values())
               for a, b in zip(s.values(), t.values()))
    total = sum(p.numel() for p in pm.module.parameters())
    return run, shard_state, total, same, isinstance(opt, torch.optim.AdamW), [g["weight_decay"] for g in opt.param_groups]


def _reference_with_groups(batches) -> Run:
    model = make_gpt(0)
    opt = torch.optim.AdamW(_groups(list(model.named_parameters())), **ADAMW)
    run = Run([], [], initial={k: v.detach().clone() for k, v in model.state_dict().items()})
    run.parameter_of = {"lm_head.weight": "wte.weight"}
    for batch in batches:
        loss = model(batch)
        loss.backward()
        for param in model.parameters():
            param.grad.mul_(3.0)
        run.grads.append(full_grads(model))
        opt.step()
        opt.zero_grad()
        run.losses.append(float(loss.detach()))
    run.final = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return run


def test_optimizer_shards_its_state_and_keeps_the_torch_api():
    batches = gpt_batches(3, 8)
    reference = _reference_with_groups(batches)
    assert_meaningful(reference, "adamw")
    for run, shard_state, total, same, is_adamw, decays in sw.testing.run_on_ranks(_optimizer_api, 4, batches):
        assert_parity(reference, run, "adamw")
        assert 2 * total / 4 <= shard_state <= 2 * total / 4 + 2 * 8  # exp_avg + exp_avg_sq of a quarter (+ padding)
        assert same and is_adamw and decays == [0.1, 0.0]


def test_zero_with_one_replica_runs_as_zero_0():
    with pytest.warns(UserWarning, match="zero=2 with one data-parallel replica has nothing to shard; running as zero=0"):
        pm = sw.parallelize(make_gpt(0), sw.ParallelConfig(zero=2))
    assert pm.config.zero == 0


def _optimizer_from_original(_):
    model = make_gpt(0)
    original = list(model.parameters())
    pm = sw.parallelize(model, sw.ParallelConfig(tp=2, zero=1), plan="gpt")
    try:
        sw.build_optimizer(pm, torch.optim.AdamW, params=original, **ADAMW)
    except sw.ShardwiseError as exc:
        return str(exc)
    return "no error"


def test_optimizer_from_the_unwrapped_module_is_refused():
    with pytest.raises(sw.ShardwiseError, match="build_optimizer needs the ParallelModule"):
        sw.build_optimizer(make_gpt(0), torch.optim.AdamW, **ADAMW)
    for message in sw.testing.run_on_ranks(_optimizer_from_original, 4, None):
        assert "is not a parameter of the ParallelModule" in message


# -- parameters without gradients stay where one process leaves them ------------------------
class UsedOnce(torch.nn.Module):
    """`late` is used only on the first step; afterwards it has no gradient."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(8, 8)
        self.late = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 1)
        self.calls = 0

    def forward(self, x):
        h = torch.tanh(self.body(x))
        if self.calls == 0:
            h = h + self.late(x)
        self.calls += 1
        return self.head(h).pow(2).mean()


def _without_gradients(zero: int, batches):
    pm = sw.parallelize(UsedOnce(), sw.ParallelConfig(zero=zero, bucket_mb=0.0001))
    opt = sw.build_optimizer(pm, torch.optim.AdamW, **ADAMW)
    before = {k: v.clone() for k, v in pm.full_state_dict().items()}
    opt.step()  # no gradient yet: nothing may move (AdamW's weight decay alone would move everything)
    unmoved = all(torch.equal(v, before[k]) for k, v in pm.full_state_dict().items())
    index, count = sw.data_parallel_info(pm)
    run = Run([], [])
    for batch in batches:
        run.losses.append(float(pm.train_step(replica_slice(batch, index, count))))
        if not run.grads:
            run.grads.append(pm.full_grad_dict())
        opt.step()
        opt.zero_grad()
    run.final = {k: v.clone() for k, v in pm.full_state_dict().items()}
    return unmoved, run


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_parameters_without_gradients_stay_put(zero):
    """One process: AdamW skips a parameter whose grad is None, so `late` moves on the first
    step only (no momentum, no weight decay afterwards), and a step before any backward moves
    nothing. Every ZeRO stage must do the same: judged by the per-element AdamW bound, which
    a `late` moved by three more steps of momentum and decay (~lr each) fails."""
    gen = torch.Generator().manual_seed(4)
    batches = [torch.randn(8, 8, generator=gen) for _ in range(4)]
    reference = reference_run(UsedOnce, batches, optimizer="adamw")
    for unmoved, run in sw.testing.run_on_ranks(_without_gradients, 4, zero, batches):
        assert unmoved
        assert_parity(reference, run, "adamw")
