"""Faults the parity checks guard against, injected into a worker process.

`inject(name, config)` breaks one mechanism of shardwise in the current process only (the
workers of `run_on_ranks` are separate processes, so nothing leaks into other tests). Used by
test_faults.py, and by `SHARDWISE_TEST_FAULT=<name> python -m pytest tests/test_*.py` to run
every parity test with a fault, which must then fail.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

FAULTS = ("sum-not-mean", "no-all-reduce", "microbatch-sum", "tp-partial-not-summed", "zero-off-by-one",
          "tied-not-summed", "dropout-per-shard", "replica-weight-ignored", "recompute-rng-not-restored",
          "pp-random-unscheduled", "gathered-input-reduced-twice", "cp-attention-local", "cp-loss-unweighted",
          "cp-positions-local", "dp-gather-pass-through", "sharded-loss-whole",
          "float8-amax-per-shard", "float8-gather-amax-per-shard", "expert-tokens-dropped", "expert-grads-over-dp",
          "aux-loss-per-replica", "jitter-per-shard", "cp-random-per-shard", "expert-dispatch-draws",
          "expert-grads-without-cp", "expert-weight-without-cp", "aux-tp-peers-summed",
          "aux-logits-detached")


class _NoAllReduce:
    """torch.distributed with all_reduce doing nothing (each rank keeps its own values)."""

    def __getattr__(self, attr):
        return getattr(torch.distributed, attr)

    @staticmethod
    def all_reduce(tensor, *args, **kwargs):
        return None


def from_environment() -> str | None:
    return os.environ.get("SHARDWISE_TEST_FAULT") or None


def inject(name: str, config: dict) -> None:
    import shardwise.build as build
    import shardwise.parallel.context.sequence as context
    import shardwise.parallel.data.gradients as data
    import shardwise.parallel.data.replicas as replicas
    import shardwise.parallel.pipeline.stages as pipeline
    import shardwise.parallel.recompute as recompute
    import shardwise.parallel.tensor.rules as tensor_rules
    import shardwise.parallel.tensor.sharding as tensor

    if name == "expert-tokens-dropped":  # a capacity limit (factor 1): slots past it on a rank reach no expert
        import shardwise.parallel.expert.experts as experts

        original_run = experts.ExpertParallel.run

        def capped(self, module, path, hidden, index, weights):
            count = experts.expert_count(module)
            capacity = index.numel() // count
            flat = index.reshape(-1).clone()
            for expert in range(count):
                slots = (flat == expert).nonzero().squeeze(1)
                flat[slots[capacity:]] = count
            return original_run(self, module, path, hidden, flat.view_as(index), weights)

        experts.ExpertParallel.run = capped
    elif name == "expert-dispatch-draws":  # the expert-parallel path draws a random number (a random tie-break)
        import shardwise.parallel.expert.experts as experts

        original_dispatch = experts.ExpertParallel.run

        def drawing(self, *args):
            torch.rand(1)
            return original_dispatch(self, *args)

        experts.ExpertParallel.run = drawing
    elif name == "expert-grads-without-cp":  # expert gradients summed over dp copies only, not the cp peers
        import shardwise.topology as topology

        def without_cp(self, with_tp=False):
            tps = range(self.sizes["tp"]) if with_tp else [self.tp_rank]
            return sorted(r for t in tps for r in self.ranks_at(["dp"], tp=t)[self.ep_rank::self.config.ep])

        topology.Topology.expert_replica_ranks = without_cp
    elif name == "expert-weight-without-cp":  # tokens weighted for the mean over dp, forgetting the cp shards
        import shardwise.parallel.expert.experts as experts

        def set_weight(self, value):
            self._weight = lambda: value() * self.topology.sizes["cp"]

        experts.ExpertParallel.replica_weight = property(lambda self: self._weight, set_weight)
    elif name == "aux-tp-peers-summed":  # sequence-parallel tp peers' gradients of the same loss summed, not averaged
        import shardwise.parallel.expert.router as router

        original_init = router.RouterLogitsOverReplicas.__init__

        def summing(self, *args, **kwargs):
            original_init(self, *args, **kwargs)
            self.share = 1

        router.RouterLogitsOverReplicas.__init__ = summing
    elif name == "aux-loss-per-replica":  # the load-balancing loss over each replica's own tokens
        import shardwise.parallel.pipeline.program as program

        build.apply_router_logits_over_replicas = lambda *args, **kwargs: None
        recorded = program.recorded_router_logits  # (under pp, captured as one replica's rows too)
        program.recorded_router_logits = lambda module, rows=1: recorded(module, 1)
    elif name == "aux-logits-detached":  # under pp: router logits sent to the loss's stage without their gradient
        import shardwise.parallel.pipeline.stage_module as stage_module

        with_logits = stage_module.StageModule._with_router_logits

        def detached(self, *args):
            out, taken = with_logits(self, *args)
            return out, tuple(t.detach() for t in taken)

        stage_module.StageModule._with_router_logits = detached
    elif name == "expert-grads-over-dp":  # expert gradients summed over all dp ranks, not those holding them
        import shardwise.topology as topology

        topology.Topology.expert_replica_ranks = lambda self, with_tp=False: self.group_ranks("dp")
    elif name == "float8-amax-per-shard":  # each tp rank scales its float8 casts by its own shard's amax
        import shardwise.parallel.tensor.float8 as float8

        original_cast = float8._cast
        float8._cast = lambda t, module, operand, group: original_cast(t, module, operand, None)
    elif name == "float8-gather-amax-per-shard":  # ZeRO-3 casts each weight shard by its own amax
        import shardwise.parallel.data.float8_gather as float8_gather

        float8_gather.dist = _NoAllReduce()
    elif name == "sharded-loss-whole":  # a loss on tp-sharded activations taken as every rank's whole loss
        import shardwise.step as step

        step.MicrobatchLosses.tp_loss_share = lambda self, loss: 1.0
    elif name == "dp-gather-pass-through":  # sw.gather/reduce over dp with DTensor's same-loss backward
        import shardwise.groups as groups

        groups.LOSS_DIMS = frozenset()
    elif name == "sum-not-mean":  # gradients summed over replicas instead of averaged
        base = replicas.ReduceGroup

        class Summing(base):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                object.__setattr__(self, "scale", 1.0)

        Summing.__name__ = base.__name__
        replicas.ReduceGroup = Summing
    elif name == "no-all-reduce":  # each replica keeps its own gradient
        data.dist = _NoAllReduce()
    elif name == "microbatch-sum":  # microbatch losses summed, not averaged
        import shardwise.step as step

        original = step.loss_of
        parts = config.get("microbatches", 1)
        step.loss_of = pipeline.loss_of = lambda *args, **kwargs: original(*args, **kwargs) * parts
    elif name == "tp-partial-not-summed":  # a norm's partial gradient under sequence parallelism left partial
        original = tensor.apply_tensor_parallel

        def unsummed(*args, **kwargs):
            tp = original(*args, **kwargs)
            tp.partial_grad_params.clear()
            return tp

        build.apply_tensor_parallel = unsummed
    elif name == "zero-off-by-one":  # the optimizer updates a shard one element off
        original = data.Bucket.param_range

        def shifted(bucket, lo, hi):  # the same length, one element further on (or back, at the end)
            step = 1 if hi < bucket.shard_start + bucket.shard_size else -1
            return original(bucket, lo + step, hi + step)

        data.Bucket.param_range = shifted
    elif name == "tied-not-summed":  # a tied embedding's gradient not summed across pipeline stages
        build.tied_across_ranks = lambda *args, **kwargs: {}
    elif name == "dropout-per-shard":  # each sequence shard draws its own dropout mask
        tensor_rules.ShardedDropout.forward = lambda mod, x: F.dropout(x, mod.p, mod.training)
    elif name == "replica-weight-ignored":  # replicas weighted equally whatever their sample counts
        import shardwise.step as step

        settled = step.StepBatch.weight

        def equal(self):
            settled(self)
            self.replica_weight = 1.0
            return 1.0

        step.StepBatch.weight = equal
    elif name == "recompute-rng-not-restored":  # the recomputation draws fresh dropout masks
        original_checkpoint = recompute.checkpoint
        recompute.checkpoint = lambda module, **kwargs: original_checkpoint(module, **{**kwargs, "preserve_rng_state": False})
    elif name == "pp-random-unscheduled":  # pipeline stages draw dropout masks as they run
        pipeline.RandomSchedule.active = property(lambda self: False)
    elif name == "gathered-input-reduced-twice":  # q, k, v all-reduce an input a conversion already gathered
        original_convert = tensor.TensorParallel.convert_input

        def forgetting(self, *args, **kwargs):
            out = original_convert(self, *args, **kwargs)
            self._entered_storages.clear()  # the mark, by storage (eager) and by identity (compiled)
            self._converted.clear()
            return out

        tensor.TensorParallel.convert_input = forgetting
    elif name == "cp-attention-local":  # each cp rank's queries attend to its own tokens only
        context.context_parallel_attention = lambda q, k, v, group, **kwargs: F.scaled_dot_product_attention(
            q, k, v, **kwargs)
    elif name == "cp-random-per-shard":  # dropout and random fills on a cp shard draw for the shard alone
        context.SequenceDraws.intercepts = lambda self, func, args: False
    elif name == "jitter-per-shard":  # a router's input jitter drawn for each sequence shard alone
        tensor_rules.ShardedJitter.install = lambda self, module: None
    elif name == "cp-loss-unweighted":  # cp shards' mean losses averaged whatever their counted tokens
        context.ContextParallel.loss_weights = lambda self, batch, parts: [1.0] * parts
    elif name == "cp-positions-local":  # no position_ids: the model numbers a shard's tokens from 0
        original_shard = context.shard_batch

        def without_positions(*args, **kwargs):
            local = original_shard(*args, **kwargs)
            local.pop("position_ids", None)
            return local

        context.shard_batch = without_positions
    else:
        raise ValueError(f"unknown fault {name!r}; faults: {FAULTS}")
