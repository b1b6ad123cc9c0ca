"""The catalogue's multi-rank cases (run and judged by test_bad_inputs_ranks.py): each a `Case`
whose action runs on every rank of a world of 2 (`RANKS2`) or 4 (`RANKS4`), with the models,
plans and helpers they need."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Shard

import shardwise as sw
from parity import ADAMW, gpt_batches, make_gpt, replica_slice
from bad_inputs import Case, OneLayer, RuleRaisingByRank, Tuple, plan_on_gpt, rank
from bad_inputs_habit_cases import HABITS


def plan_file(on_rank: int) -> Path:
    """The plan file of the "plan file on rank 0 only" case: rank 0 writes it (`test_bad_inputs_ranks`), the
    case reads each rank's own, so rank 1's is missing."""
    return Path(f"/tmp/shardwise-plan-{on_rank}-{os.getpid()}.json")


def _gpt_tp(**config):
    return sw.parallelize(make_gpt(0), sw.ParallelConfig(tp=2, **config), plan="gpt")


def _first_forward(params):
    pm = sw.parallelize(make_gpt(0), sw.ParallelConfig(tp=2), plan={"params": params})
    return pm.train_step(gpt_batches(1, 4)[0])


COL, ROW = "Shard(0)", "Shard(1)"
TP_PLANS = {  # 2 ranks: plans whose sharded features reach modules that cannot take them
    "fc1 column only": Case(lambda: _first_forward({"layers.*.mlp.fc1.weight": COL, "layers.*.mlp.fc1.bias": COL}),
                            "PlanError", "layers.0.mlp.fc2 (Linear) is replicated but receives the feature-sharded"),
    "v only": Case(lambda: _first_forward({"layers.*.attn.v_proj.weight": COL, "layers.*.attn.v_proj.bias": COL}),
                   "PlanError", "column-parallel ['layers.0.attn.v_proj']"),
    "o_proj column": Case(lambda: _first_forward({"layers.*.attn.o_proj.weight": COL, "layers.*.attn.o_proj.bias": COL}),
                          "PlanError", "column-parallel ['layers.0.attn.o_proj']"),
    "wte feature-sharded": Case(lambda: _first_forward({"wte.weight": ROW}), "PlanError", "column-parallel ['wte']"),
    "strided fc1 into row fc2": Case(lambda: _first_forward({
        "layers.*.mlp.fc1.weight": "StridedShard(0, 2)", "layers.*.mlp.fc1.bias": "StridedShard(0, 2)",
        "layers.*.mlp.fc2.weight": ROW}), "PlanError", "sharded as 2 interleaved blocks (StridedShard)"),
    "sequence not divisible by tp": Case(lambda: _gpt_tp(sequence_parallel=True).train_step(gpt_batches(1, 4, seq=15)[0]),
                                         "PlanError", "15 is not divisible by 2"),
    "conversion of a tensor-parallel output": Case(plan_on_gpt({"params": {"layers.*.mlp.fc2.weight": ROW},
                                                            "activations": {"layers.*.mlp.fc2.output":
                                                                            "Partial() -> Shard(1)"}}),
                                                   "PlanError", "whose rule knows its own output placement"),
    "zoo plan is accepted": Case(lambda: float(_gpt_tp().train_step(gpt_batches(1, 4)[0])), None, check=lambda v: v > 0),
    "plan file on rank 0 only": Case(lambda: sw.parallelize(make_gpt(0), sw.ParallelConfig(tp=2),
                                                            plan=str(plan_file(rank()))),
                                     "PlanError", "does not exist (found on rank"),
}


def _mismatched_model(kind: str):
    r = rank()
    models = {
        "vocab and block sizes swapped": lambda: make_gpt(0, vocab_size=32 if r else 64, block_size=64 if r else 32),
        "two layers against three": lambda: make_gpt(0, n_layer=2 + r),
        "d_model 64 against 32": lambda: make_gpt(0, d_model=64 if r == 0 else 32),
    }
    configs = {"zero 0 against 1": sw.ParallelConfig(zero=r), "tp plan on one rank": sw.ParallelConfig()}
    plan = "gpt" if kind == "tp plan on one rank" and r == 0 else None
    model = models.get(kind, lambda: make_gpt(0))()
    return sw.parallelize(model, configs.get(kind, sw.ParallelConfig()), plan=plan)


def _collective_on_rank_zero(method: str):
    pm = sw.parallelize(make_gpt(0), sw.ParallelConfig(zero=1))
    opt = sw.build_optimizer(pm, torch.optim.AdamW, **ADAMW)
    batch = gpt_batches(1, 4)[0][rank() * 2:(rank() + 1) * 2]
    pm.train_step(batch)
    if rank() == 0:
        return {"full_state_dict": pm.full_state_dict, "clip_grad_norm": lambda: opt.clip_grad_norm(1.0),
                "optimizer.step": opt.step, "full_grad_dict": pm.full_grad_dict}[method]()
    return pm.train_step(batch)  # the other rank moved on to the next step


def _state_dict_on_rank_zero():
    pm = sw.parallelize(make_gpt(0), sw.ParallelConfig(tp=2), plan="gpt")
    return pm.load_full_state_dict(make_gpt(1).state_dict() if rank() == 0 else {})


class _BrokenRuleLayer(nn.Linear):
    pass


def _broken_rule(path, module, placements):
    raise KeyError("weight_scale")  # a bug in the user's rule


sw.plan.register_rule(_BrokenRuleLayer, _broken_rule)


class _SharedLinear(nn.Module):
    """One Linear used by two blocks."""

    def __init__(self):
        super().__init__()
        shared = nn.Linear(4, 4)
        self.blocks = nn.ModuleList([nn.Sequential(shared, nn.ReLU()), nn.Sequential(shared, nn.ReLU())])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


class _RankDependentRuleLayer(nn.Linear):
    pass


def _rank_dependent_rule(path, module, placements):
    if rank() == 0:  # a rule that completes the bias's placement on one rank only
        placements["bias"] = Shard(0)

    def forward(module, x, *, tp):
        return tp.output(torch.nn.functional.linear(tp.replicated_input(x), tp.local(module.weight),
                                                    tp.local(module.bias)), Shard(-1))
    return forward


sw.plan.register_rule(_RankDependentRuleLayer, _rank_dependent_rule)


def _parallelized_twice_at_tp2():
    model = make_gpt(0)
    sw.parallelize(model, sw.ParallelConfig(tp=2), plan="gpt")
    return sw.parallelize(model, sw.ParallelConfig(tp=2), plan="gpt")


class _ReducesOnRankZero(nn.Module):
    """A forward calling sw.reduce under `if rank == 0`: rank 1 goes on to its gradient
    all-reduce, over the same ranks as rank 0's sw.reduce."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, x):
        y = self.layer(x)
        if rank() == 0:
            y = sw.reduce(y, "dp", op="mean")
        return y.pow(2).mean()


def _reduce_on_rank_zero():
    return float(sw.parallelize(_ReducesOnRankZero()).train_step(torch.ones(4, 4)))


def _reduce_by_rank():
    pm = sw.parallelize(make_gpt(0), sw.ParallelConfig())
    batch = gpt_batches(1, 4)[0][rank() * 2:(rank() + 1) * 2]
    return float(pm.train_step(batch, reduce="sum" if rank() == 1 else "mean"))


def _given_by_rank(kind: str):
    """Ranks handed different values to load: each kept its own half before (issue 26)."""
    r = rank()
    pm = _gpt_tp() if kind.startswith("tp") else sw.parallelize(make_gpt(0), sw.ParallelConfig(zero=1))
    if kind.endswith("state dict"):
        return pm.load_full_state_dict(make_gpt(r).state_dict())
    if kind.endswith("own state_dict"):
        mine = pm.state_dict()
        if r == 1:
            mine = {k: v * 2 for k, v in mine.items()}
        return pm.load_state_dict(mine)
    model = make_gpt(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3 * (1 + r))
    model(gpt_batches(1, 4)[0]).backward()
    opt.step()
    state = opt.state_dict()
    if kind.endswith("string"):
        next(iter(state["state"].values()))["step"] = "three"
    if kind.endswith("float step"):  # torch's loader accepts a number; so do we
        for entry in state["state"].values():
            entry["step"] = float(entry["step"])
        state["param_groups"][0]["lr"] = 1e-3
    popt = sw.build_optimizer(pm, torch.optim.AdamW, lr=1e-3)
    popt.load_full_state_dict(state)
    return "loaded"


class _Counting(nn.Module):
    """(mean loss, num_tokens) with the count computed as `count(rank, step)` says."""

    def __init__(self, count):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.count, self.calls = count, 0

    def forward(self, x):
        self.calls += 1
        return self.lin(x).pow(2).mean(), self.count(rank(), self.calls)


def _tokens(count, tp: int = 1, steps: int = 3):
    pm = sw.parallelize(_Counting(count), sw.ParallelConfig(tp=tp, microbatches=2), plan=sw.Plan(name="none"))
    for _ in range(steps):
        pm.train_step(torch.ones(4, 4), reduce="tokens")
    return "trained"


class _Outer(nn.Module):
    """A plain module holding a ParallelModule after its own trainable layer."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(4, 4)
        self.inner = sw.parallelize(Tuple())

    def forward(self, x):
        return self.inner(self.stem(x))


class _SequenceMLP(nn.Module):
    """An MLP over a sequence with its loss inside forward (tests/test_tensor_parallel.py's)."""

    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential()
        self.mlp.fc1, self.mlp.act, self.mlp.fc2 = nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)

    def forward(self, x):
        return (self.mlp(x) - 0.5).pow(2).mean()


def _sequence_mlp(plan: dict):
    pm = sw.parallelize(_SequenceMLP(), sw.ParallelConfig(tp=2, sequence_parallel=True), plan=plan)
    pm.train_step(torch.randn(4, 8, 4, generator=torch.Generator().manual_seed(0)))
    return "trained"


def _inside_a_plain_module():
    outer = _Outer()
    loss = outer(torch.randn(4, 4))[0]
    loss.backward()
    return "trained"  # the stem's gradient is this replica's alone


def _peers_given(kind: str):
    batch = gpt_batches(1, 8)[0]
    r = rank()
    if kind == "tp peers given different samples":
        pm = _gpt_tp()
        return pm.train_step(batch[r * 2:(r + 1) * 2])  # sliced by global rank, not by replica
    if kind == "tp peers given different lengths":
        pm = _gpt_tp()
        index, count = sw.data_parallel_info(pm)
        return pm.train_step(replica_slice(batch, index, count)[:, : 12 + r % 2])
    if kind == "pp peers given different samples":
        pm = sw.parallelize(make_gpt(0, n_layer=4), sw.ParallelConfig(pp=2, microbatches=2), sample=batch[:4])
        return pm.train_step(batch[(r // 2) * 4:(r // 2 + 1) * 4])  # pp peers {0, 2}, {1, 3} differ
    if kind == "one replica not divisible":
        pm = sw.parallelize(make_gpt(0), sw.ParallelConfig(microbatches=2))
        return pm.train_step(batch[:3] if r == 3 else batch[:4])
    if kind == "infer_step given different inputs":
        return _gpt_tp().infer_step(batch[r:r + 2])
    if kind == "plain forward given different inputs":
        return _gpt_tp()(batch[r:r + 2])
    if kind == "unequal replicas weighted by samples":
        pm = sw.parallelize(make_gpt(0), sw.ParallelConfig())
        sizes = [3, 1, 2, 2]
        start = sum(sizes[:r])
        pm.train_step(batch[start:start + sizes[r]])
        return {k: v for k, v in pm.full_grad_dict().items() if k == "wpe.weight"}
    raise AssertionError(kind)


def unequal_reference():
    model = make_gpt(0)
    model(gpt_batches(1, 8)[0]).backward()
    return model.wpe.weight.grad


def _pipeline(config: dict, plan=None, sample: Any = "gpt", model=None):
    sample = gpt_batches(1, 8)[0] if sample == "gpt" else sample
    return lambda: sw.parallelize(model or make_gpt(0, n_layer=4), sw.ParallelConfig(pp=2, **config), plan=plan,
                                  sample=sample)


PIPELINES = {  # 2 ranks, pp=2: layouts refused before any rank communicates
    "no sample": Case(_pipeline({"microbatches": 2}, sample=None), "ConfigError", "pp=2 needs sample="),
    "fewer microbatches than stages": Case(_pipeline({"microbatches": 1}), "ConfigError", "microbatches=1 < pp=2"),
    "interleaved with odd microbatches": Case(_pipeline({"microbatches": 3, "schedule": "interleaved-1f1b"}),
                                              "ConfigError", "needs microbatches divisible by pp=2"),
    "sample not divisible": Case(_pipeline({"microbatches": 3}), "BatchError", "batch size 8 is not divisible"),
    "plan recompute under zero-bubble": Case(_pipeline({"microbatches": 2, "schedule": "zero-bubble"},
                                                       {"recompute": ["layers.1"]}),
                                             "ConfigError", "the plan recomputes ['layers.1'] with schedule='zero-bubble'"),
    "boundary inside a module": Case(_pipeline({"microbatches": 2}, {"stages": ["layers.1.mlp"]}), "PlanError",
                                     "is inside module 'layers.1'"),
    "stages repeat and skip": Case(_pipeline({"microbatches": 2}, {"stages": [["wte", "layers.0"],
                                                                              ["layers.0", "lm_head"]]}),
                                   "PlanError", "plan stages repeat ['layers.0'] and skip"),
    "boundary without parameters": Case(_pipeline({"microbatches": 2}, {"stages": ["drop"]}), "PlanError",
                                        "has no parameters"),
    "virtual stages under 1f1b": Case(_pipeline({"microbatches": 4}, {"virtual_stages": 2}), "PlanError",
                                      "runs one stage per rank"),
    "more stages than modules": Case(_pipeline({"microbatches": 8, "schedule": "interleaved-1f1b"},
                                               {"virtual_stages": 4}, model=make_gpt(0, n_layer=1)),
                                     "PlanError", "has only 5 modules with parameters"),
    "forward returns logits": Case(_pipeline({"microbatches": 2}, sample=torch.randn(8, 4),
                                             model=nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))),
                                   "ModelError", "return the scalar loss first"),
}


class _LoggerFailingOnRank1:
    def open(self):
        if rank() == 1:
            raise PermissionError("no write access to the run directory")

    def log(self, values, step):
        pass

    def close(self):
        pass


def _log_to_then_train(logger, **kwargs):
    """A log_to refused everywhere leaves the module training."""
    pm = sw.parallelize(Tuple())
    try:
        pm.metrics.log_to(logger, **kwargs)
    except sw.ConfigError as exc:
        float(pm.train_step(torch.ones(2, 4)))
        raise sw.ConfigError(f"{exc} (and a step trained after it)") from exc
    return "logging"


RANKS2 = {
    "a metrics file rank 0 cannot create": Case(lambda: _log_to_then_train(sw.JsonlLogger("/proc/no/such/m.jsonl")),
                                                "ConfigError", "JsonlLogger cannot open '/proc/no/such/m.jsonl'"),
    "a metrics logger failing on rank 1 only": Case(lambda: _log_to_then_train(_LoggerFailingOnRank1(), ranks=None),
                                                    "ConfigError", "_LoggerFailingOnRank1.open() raised PermissionError"),
    "log_to every=0": Case(lambda: _log_to_then_train(sw.ConsoleLogger(), every=0), "ConfigError",
                           "log_to(every=0): a positive whole number"),
    "log_to ranks naming a rank beyond the world": Case(lambda: _log_to_then_train(sw.ConsoleLogger(), ranks=[2]),
                                                        "ConfigError", "global ranks below the world size 2"),
    **{f"plan: {k}": v for k, v in TP_PLANS.items()},
    **{f"pipeline: {k}": v for k, v in PIPELINES.items()},
    **{f"model mismatch: {k}": Case(lambda k=k: _mismatched_model(k), "ModelError", phrase) for k, phrase in {
        "vocab and block sizes swapped": "rank 0 has parameter wte.weight of shape (64, 64)",
        "two layers against three": "rank 1 has parameter layers.2",
        "d_model 64 against 32": "rank 1 has parameter wte.weight of shape (64, 32)",
        "zero 0 against 1": "rank 1 has config dp=auto tp=1 pp=1 cp=1 zero=1",
        "tp plan on one rank": "rank 0 has plan",
    }.items()},
    **{f"collective on rank 0 only: {m}": Case(lambda m=m: _collective_on_rank_zero(m), "CommunicationError",
                                               "call each on every rank")
       for m in ("full_state_dict", "clip_grad_norm", "optimizer.step", "full_grad_dict")},
    "state dict given on rank 0 only": Case(_state_dict_on_rank_zero, "CheckpointError", "found on rank 1"),
    "tp ranks given different state dicts": Case(lambda: _given_by_rank("tp state dict"), "CheckpointError",
                                                 "were given different values"),
    "replicas given different state dicts": Case(lambda: _given_by_rank("dp state dict"), "CheckpointError",
                                                 "were given different values"),
    "tp ranks given different own state_dict": Case(lambda: _given_by_rank("tp own state_dict"), "CheckpointError",
                                                    "were given different values"),
    "replicas given different optimizer states": Case(lambda: _given_by_rank("dp optimizer"), "CheckpointError",
                                                      "every rank must load the same optimizer state"),
    "optimizer state holding a string": Case(lambda: _given_by_rank("dp optimizer string"), "CheckpointError",
                                             "is a str; shardwise loads tensor state"),
    "optimizer state with a float step": Case(lambda: _given_by_rank("dp optimizer float step"), None,
                                              check=lambda v: v == "loaded"),
    "tokens: a negative count": Case(lambda: _tokens(lambda r, i: -3 if r == 1 else 3), "ModelError",
                                     "returned a negative or non-finite num_tokens"),
    "tokens: a NaN count": Case(lambda: _tokens(lambda r, i: float("nan") if i == 4 else 3), "ModelError",
                                "returned a negative or non-finite num_tokens"),
    "tokens: tp peers count differently on a later step": Case(
        lambda: _tokens(lambda r, i: 3 + (r if i > 2 else 0), tp=2), "ModelError",
        "tensor-parallel peers counted different token totals"),
    "a rule raising KeyError": Case(lambda: sw.parallelize(OneLayer(_BrokenRuleLayer), sw.ParallelConfig(tp=2),
                                                           plan={"params": {"layer.weight": "Shard(0)"}}),
                                    "ShardwiseError", "parallelize failed before communicating: KeyError: 'weight_scale'"),
    "a tp plan on a Linear shared by two blocks": Case(
        lambda: float(sw.parallelize(_SharedLinear(), sw.ParallelConfig(tp=2),
                                     plan={"params": {"blocks.*.0.weight": "Shard(0)"}}).train_step(torch.ones(4, 4))),
        "PlanError", "Linear 'blocks.0.0' is one module used at ['blocks.0.0', 'blocks.1.0']"),
    "a rule completing a placement on one rank only": Case(
        lambda: sw.parallelize(OneLayer(_RankDependentRuleLayer), sw.ParallelConfig(tp=2),
                               plan={"params": {"layer.weight": "Shard(0)"}}), "ModelError",
        "rank 1 has rule for layer"),
    "a rule refusing with a rank-dependent message": Case(
        lambda: sw.parallelize(OneLayer(RuleRaisingByRank), sw.ParallelConfig(tp=2),
                               plan={"params": {"layer.weight": "Shard(0)"}}), "PlanError", "rank 0 refuses layer"),
    "parts naming a ParallelModule": Case(
        lambda: sw.parallelize(nn.ModuleDict({"inner": sw.parallelize(Tuple()), "head": nn.Linear(1, 1)}),
                               parts=["inner"]), "ModelError", "its submodule 'inner' was parallelized already"),
    "parallelize twice at tp=2": Case(_parallelized_twice_at_tp2, "ModelError", "it was parallelized already"),
    "ranks disagreeing on reduce=": Case(_reduce_by_rank, "CommunicationError",
                                         "train_step(reduce='sum') communicate"),
    "sw.reduce in a forward on one rank only": Case(
        _reduce_on_rank_zero, "CommunicationError",
        "over ranks [0, 1], rank 0 waits in sw.reduce(group='dp'): all-reduce; rank 1 waits in all-reduce of gradient "
        "bucket 0 (92 bytes): a collective that some ranks skipped"),
    "veScale's [[Shard(1)]] on an input that arrives whole": Case(
        lambda: _sequence_mlp({"forward": {"mlp.fc1.input": [["Shard(1)"]], "mlp.fc2.output": [["Shard(1)"]]}}),
        "PlanError", "it is the same on every tp rank: it arrives whole"),
    "the same input split by the plan": Case(
        lambda: _sequence_mlp({"forward": {"mlp.fc1.input": [["Replicate() -> Shard(1)"]], "mlp.fc2.input": [["Shard(1)"]],
                                           "mlp.fc2.output": [["Shard(1)"]]}}), None, check=lambda v: v == "trained"),
    "tokens: the same count on tp peers": Case(lambda: _tokens(lambda r, i: 3, tp=2), None,
                                               check=lambda v: v == "trained"),
    **HABITS,
}
def _float8_gathered_under_tp():
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model = convert_to_float8_training(make_gpt(0), config=Float8LinearConfig(
        emulate=True, enable_fsdp_float8_all_gather=True), module_filter_fn=lambda m, fqn: "lm_head" not in fqn)
    return sw.parallelize(model, sw.ParallelConfig(tp=2, zero=3), plan="gpt")


def _experts(kind: str, **config):
    from test_expert import make_moe
    from test_zoo import make

    return sw.parallelize(make_moe("mixtral", **({"experts": 6} if kind == "six experts" else {}))
                          if kind != "llama" else make("llama"),
                          sw.ParallelConfig(**config), plan="mixtral" if config.get("tp", 1) > 1 else None)


def _heads_past_tp():
    from test_zoo import batches, make

    pm = sw.parallelize(make("llama"), sw.ParallelConfig(tp=4), plan="llama")  # 2 KV heads
    return pm.train_step(batches("llama")[0])


RANKS4 = {
    "tp past the KV heads": Case(_heads_past_tp, "PlanError",
                                 "k_proj's output is 2 heads of 8 features, which tp=4 cannot split evenly"),
    "float8 all-gather under tp with zero=3": Case(_float8_gathered_under_tp, "ConfigError",
                                                   "enable_fsdp_float8_all_gather=True under tp=2 with zero=3"),
    "ep on a model without experts": Case(lambda: _experts("llama", ep=2), "ConfigError",
                                          "ep=2 but EndToEnd has no mixture-of-experts layer"),
    "ep not dividing dp": Case(lambda: _experts("mixtral", ep=4, tp=2), "ConfigError", "ep=4 does not divide dp=2"),
    "ep not dividing the experts": Case(lambda: _experts("six experts", ep=4), "ConfigError",
                                        "ep=4 does not divide the 6 experts"),
    "a ParallelModule inside a plain module": Case(_inside_a_plain_module, "ModelError",
                                                  "called on a tensor computed from trainable parameters outside it"),
    "dp contradicting the world": Case(lambda: sw.parallelize(make_gpt(0), sw.ParallelConfig(dp=3)), "ConfigError",
                                       "dp=3 with tp=1, cp=1, pp=1 needs 3 ranks but world size is 4"),
    "tp peers given different samples": Case(lambda: _peers_given("tp peers given different samples"), "BatchError",
                                             "must be given the same batch"),
    "tp peers given different lengths": Case(lambda: _peers_given("tp peers given different lengths"), "BatchError",
                                             "rank 0 has batch of shape (4, 12)"),
    "pp peers given different samples": Case(lambda: _peers_given("pp peers given different samples"), "BatchError",
                                             "slice the data by sw.data_parallel_info"),
    "one replica not divisible": Case(lambda: _peers_given("one replica not divisible"), "BatchError",
                                      "batch size 3 is not divisible by microbatches=2"),
    "infer_step given different inputs": Case(lambda: _peers_given("infer_step given different inputs"), "BatchError",
                                              "must agree at infer_step"),
    "plain forward given different inputs": Case(lambda: _peers_given("plain forward given different inputs"),
                                                 "BatchError", "must agree at forward"),
    "unequal replicas weighted by samples": Case(lambda: _peers_given("unequal replicas weighted by samples"), None),
}
