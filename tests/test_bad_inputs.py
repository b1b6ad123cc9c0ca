"""A catalogue of bad inputs and faults: each ends in a clear ShardwiseError, the same on
every rank and within seconds, or in the right result.

Single-process cases run in the test process. Multi-rank cases are grouped: one world runs a
whole group, case after case (an agreed error leaves every rank in step, so the next case
runs in the same world), and records on every rank the error class, its message and how long
the failing call took. Each case is then its own test, checked on every rank. Faults that take
a rank down (a rank raising, exiting, sleeping) have a world each.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner
from torch import nn
from torch.distributed.tensor import Shard

import shardwise as sw
from parity import ADAMW, SGD, gpt_batches, make_gpt, replica_slice
from shardwise.batch import split_batch

SLOWEST_ALLOWED_S = 10.0  # every multi-rank error reaches every rank within this, default settings


@dataclass(frozen=True)
class Case:
    action: Callable[..., Any]
    error: str | None  # expected ShardwiseError class name; None: the right result, checked by `check`
    phrase: str = ""
    check: Callable[[Any], bool] | None = None


def outcome(action: Callable[[], Any]) -> tuple[str, str, float, Any]:
    """(error class or "ok", message, seconds the call took, its value)."""
    start = time.monotonic()
    try:
        value = action()
        if isinstance(value, nn.Module):  # not picklable across processes: describe it
            value = f"a {type(value).__name__}"
        return "ok", "", time.monotonic() - start, value
    except sw.ShardwiseError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start, None


def judge(case: Case, result: tuple[str, str, float, Any], where: str = "") -> None:
    kind, message, seconds, value = result
    if case.error is None:
        assert kind == "ok", f"{where} expected a result, got {kind}: {message}"
        assert case.check is None or case.check(value), f"{where} wrong result {value!r}"
    else:
        assert kind == case.error, f"{where} expected {case.error}, got {kind}: {message}"
        assert case.phrase in message, f"{where} {case.phrase!r} not in {message!r}"


# ==== single process ==========================================================================
def config(**kwargs):
    return lambda: sw.ParallelConfig(**kwargs)


def resolve(world: int, **kwargs):
    return lambda: sw.ParallelConfig(**kwargs).resolve(world)


CONFIG = {
    "tp zero": Case(config(tp=0), "ConfigError", "tp=0 is not a positive integer"),
    "tp negative": Case(config(tp=-2), "ConfigError", "tp=-2 is not a positive integer"),
    "tp fraction": Case(config(tp=1.5), "ConfigError", "tp=1.5 is not a positive integer"),
    "tp bool": Case(config(tp=True), "ConfigError", "tp=True is not a positive integer"),
    "tp string": Case(config(tp="2"), "ConfigError", "tp='2' is not a positive integer"),
    "pp zero": Case(config(pp=0), "ConfigError", "pp=0 is not a positive integer"),
    "cp zero": Case(config(cp=0), "ConfigError", "cp=0 is not a positive integer"),
    "dp zero": Case(config(dp=0), "ConfigError", "dp=0 is not a positive integer"),
    "dp float": Case(config(dp=2.0), "ConfigError", "dp=2.0 is not a positive integer"),
    "zero 4": Case(config(zero=4), "ConfigError", "zero=4 is not a ZeRO stage"),
    "zero negative": Case(config(zero=-1), "ConfigError", "zero=-1 is not a ZeRO stage"),
    "zero float": Case(config(zero=3.0), "ConfigError", "zero=3.0 is not a ZeRO stage"),
    "zero bool": Case(config(zero=True), "ConfigError", "zero=True is not a ZeRO stage"),
    "zero string": Case(config(zero="1"), "ConfigError", "zero='1' is not a ZeRO stage"),
    "schedule unknown": Case(config(schedule="fast"), "ConfigError", "schedule='fast' is unknown"),
    "microbatches zero": Case(config(microbatches=0), "ConfigError", "microbatches=0 is not a positive integer"),
    "check_every zero": Case(config(check_every=0), "ConfigError", "check_every=0 is not a positive integer"),
    "bucket zero": Case(config(bucket_mb=0), "ConfigError", "bucket_mb=0 must be a positive number"),
    "bucket negative": Case(config(bucket_mb=-1), "ConfigError", "bucket_mb=-1 must be a positive number"),
    "bucket inf": Case(config(bucket_mb=float("inf")), "ConfigError", "bucket_mb=inf must be a positive number"),
    "bucket nan": Case(config(bucket_mb=float("nan")), "ConfigError", "bucket_mb=nan must be a positive number"),
    "bucket string": Case(config(bucket_mb="25"), "ConfigError", "bucket_mb='25' must be a positive number"),
    "timeout zero": Case(config(timeout_s=0), "ConfigError", "timeout_s=0 must be a positive number"),
    "timeout inf": Case(config(timeout_s=float("inf")), "ConfigError", "timeout_s=inf must be a positive number"),
    "timeout nan": Case(config(timeout_s=float("nan")), "ConfigError", "timeout_s=nan must be a positive number"),
    "timeout huge": Case(config(timeout_s=1e9), "ConfigError", "up to 86400 (a day)"),
    "param dtype int": Case(config(param_dtype=torch.int32), "ConfigError", "param_dtype=torch.int32 is not supported"),
    "param dtype float64": Case(config(param_dtype=torch.float64), "ConfigError", "param_dtype=torch.float64 is not"),
    "param dtype string": Case(config(param_dtype="bf16"), "ConfigError", "param_dtype='bf16' is not supported"),
    "reduce dtype float8": Case(config(reduce_dtype=torch.float8_e4m3fn), "ConfigError",
                                "reduce_dtype=torch.float8_e4m3fn is not supported"),
    "reduce dtype float64": Case(config(reduce_dtype=torch.float64), "ConfigError", "reduce_dtype=torch.float64 is not"),
    "sequence parallel string": Case(config(sequence_parallel="yes"), "ConfigError", "must be True or False"),
    "sequence parallel without tp": Case(config(sequence_parallel=True), "ConfigError", "tp=1 has none to shard over"),
    "recompute unknown": Case(config(recompute="blocks"), "ConfigError", "recompute='blocks' is not a recompute mode"),
    "recompute bool": Case(config(recompute=True), "ConfigError", "recompute=True is not a recompute mode"),
    "a torch.compile'd model": Case(lambda: sw.parallelize(torch.compile(make_gpt(0))), "ModelError",
                                    "is torch.compile's wrapper, which adds '_orig_mod.' to every state-dict key"),
    "a torch.compile'd block": Case(lambda: sw.parallelize(_with_compiled_block(make_gpt(0))), "ModelError",
                                    "its submodule 'layers.0' is torch.compile's wrapper"),
    "recompute without a layer list": Case(lambda: sw.parallelize(Tuple(), sw.ParallelConfig(recompute="full")),
                                           "PlanError", "Tuple has no ModuleList or Sequential"),
    "zero in plan and config disagree": Case(lambda: sw.parallelize(make_gpt(0), sw.ParallelConfig(zero=1),
                                                                    plan=sw.Plan(zero=2)),
                                             "ConfigError", "the config asks for zero=1 and plan given for zero=2"),
    "tp not dividing world": Case(resolve(8, tp=3), "ConfigError", "tp=3 does not divide world size 8"),
    "dp contradicting world": Case(resolve(8, dp=3, tp=2), "ConfigError", "set dp=4 or dp=None"),
    "product not dividing world": Case(resolve(8, tp=4, pp=4), "ConfigError", "= 16 does not divide world size 8"),
    "sequence dim zero": Case(config(sequence_dim=0), "ConfigError", "sequence_dim=0 must be the batch tensors' token"),
    "sequence dim bool": Case(config(sequence_dim=True), "ConfigError", "sequence_dim=True must be"),
    "config of wrong type": Case(lambda: sw.parallelize(make_gpt(0), {"tp": 2}), "ConfigError",
                                 "config must be a sw.ParallelConfig"),
}


def plan_dict(data):
    return lambda: sw.Plan.from_dict(data)


def plan_on_gpt(plan, tp: int = 2, **config):
    return lambda: sw.parallelize(make_gpt(0), sw.ParallelConfig(tp=tp, **config), plan=plan)


def _binary_plan_file():
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        f.write(b"\x80\x04\x95 a pickle, not JSON")
        f.flush()
        return sw.Plan.from_json(f.name)


class _RuleRaisingByRank(nn.Linear):
    pass


def _raise_by_rank(path, module, placements):
    raise sw.PlanError(f"rank {_rank()} refuses {path}")


sw.plan.register_rule(_RuleRaisingByRank, _raise_by_rank)


class _OneLayer(nn.Module):
    """A model of one layer of `layer_class` (4 -> 4), for the registered-rule cases."""

    def __init__(self, layer_class: type):
        super().__init__()
        self.layer = layer_class(4, 4)

    def forward(self, x):
        return self.layer(x).pow(2).mean()


PLANS = {
    "a rule for nn.Linear itself": Case(lambda: sw.plan.register_rule(nn.Linear, lambda *a: None), "PlanError",
                                        "register_rule(Linear): shardwise has a built-in rule for it"),
    "a rule for nn.Embedding itself": Case(lambda: sw.plan.register_rule(nn.Embedding, lambda *a: None), "PlanError",
                                           "register_rule(Embedding): shardwise has a built-in rule"),    "plan file holding binary data": Case(_binary_plan_file, "PlanError", "is not JSON text (it holds binary data)"),
    "placement without dim": Case(plan_dict({"params": {"a.weight": "Shard()"}}), "PlanError", "needs a dimension"),
    "placement unknown": Case(plan_dict({"params": {"a.weight": "Sharded(0)"}}), "PlanError", "is not a placement"),
    "replicate with argument": Case(plan_dict({"params": {"a.weight": "Replicate(1)"}}), "PlanError", "takes no argument"),
    "shard two arguments": Case(plan_dict({"params": {"a.weight": "Shard(0, 2)"}}), "PlanError", "at most one argument"),
    "strided without factor": Case(plan_dict({"params": {"a.weight": "StridedShard(1)"}}), "PlanError",
                                   "needs a dimension and a split factor"),
    "activation suffix": Case(plan_dict({"activations": {"a.inputs": "Replicate()"}}), "PlanError",
                              "must end in '.input' or '.output'"),
    "conversion two arrows": Case(plan_dict({"activations": {"a.input": "Shard(1) -> Replicate() -> Shard(0)"}}),
                                  "PlanError", "has more than one '->'"),
    "conversion to partial": Case(plan_dict({"activations": {"a.input": "Replicate() -> Partial()"}}), "PlanError",
                                  "nothing converts to Partial()"),
    "conversion to itself": Case(plan_dict({"activations": {"a.input": "Shard(1) -> Shard(1)"}}), "PlanError",
                                 "converts a placement to itself; write just 'Shard(1)'"),
    "conversion of a parameter": Case(plan_dict({"params": {"a.weight": "Replicate() -> Shard(0)"}}), "PlanError",
                                      "is not a placement"),
    "unknown field": Case(plan_dict({"placements": {}}), "PlanError", "unknown plan fields ['placements']"),
    "zero stage 5": Case(plan_dict({"zero": 5}), "PlanError", "plan zero=5 must be a ZeRO stage 0-3"),
    "recompute inside recompute": Case(lambda: sw.parallelize(make_gpt(0), plan=sw.Plan(recompute=["layers.*",
                                                                                                  "layers.0.mlp"])),
                                       "PlanError", "names 'layers.0.mlp' inside 'layers.0'"),
    "recompute names nothing": Case(lambda: sw.parallelize(make_gpt(0), plan=sw.Plan(recompute=["blocks.*"])),
                                    "PlanError", "plan module 'blocks.*' matches no module"),
    "params a list": Case(plan_dict({"params": [("fc1.weight", "Shard(0)")]}), "PlanError", "plan params must be a dict"),
    "vescale forward a list": Case(plan_dict({"forward": ["x"]}), "PlanError", "plan activations must be a dict"),
    "vescale nested param": Case(plan_dict({"parameter": {"fc1.weight": [["Shard(0)"]]}}), "PlanError",
                                 "is not a placement"),
    "bad regex": Case(plan_dict({"params": {"re:layers.(.mlp": "Shard(0)"}}), "PlanError",
                      "is not a valid regular expression"),
    "empty path segment": Case(plan_dict({"params": {"layers..fc1.weight": "Shard(0)"}}), "PlanError",
                               "is not a module path pattern"),
    "recompute a string": Case(plan_dict({"recompute": "layers.*"}), "PlanError", "must be a list of module-path"),
    "stages an integer": Case(plan_dict({"stages": 3}), "PlanError", "must be a list of module paths"),
    "virtual stages zero": Case(plan_dict({"virtual_stages": 0}), "PlanError", "must be a positive integer"),
    "virtual stages bool": Case(plan_dict({"virtual_stages": True}), "PlanError", "must be a positive integer"),
    "plan not a dict": Case(lambda: sw.Plan.from_dict(["x"]), "PlanError", "must be a dict"),
    "json not an object": Case(lambda: sw.Plan.from_json("[1, 2]"), "PlanError", "plan JSON must be an object"),
    "json invalid": Case(lambda: sw.Plan.from_json("{params: }"), "PlanError", "plan JSON does not parse"),
    "json file missing": Case(lambda: sw.Plan.from_json("/nonexistent/plan.json"), "PlanError", "does not exist"),
    "zoo name unknown": Case(plan_on_gpt("falcon"), "PlanError", "neither a zoo plan"),
    "plan of wrong type": Case(plan_on_gpt(42), "PlanError", "must be a Plan, a dict"),
    "parameter typo": Case(plan_on_gpt({"params": {"layers.*.attn.qproj.weight": "Shard(0)"}}), "PlanError",
                           "closest names: layers.0.attn.q_proj.weight"),
    "dim not divisible": Case(plan_on_gpt({"params": {"wte.weight": "Shard(1)"}}, tp=3), "PlanError",
                              "not divisible by 3"),
    "two placements": Case(plan_on_gpt({"params": {"wte.weight": ["Shard(0)", "Shard(1)"]}}), "PlanError",
                           "has 2 placements"),
    "shard dim out of range": Case(plan_on_gpt({"params": {"layers.0.mlp.fc1.weight": "Shard(2)"}}), "PlanError",
                                   "it has only 2 dims"),
    "partial parameter": Case(plan_on_gpt({"params": {"wte.weight": "Partial()"}}), "PlanError", "cannot be Partial"),
    "too many input placements": Case(plan_on_gpt({"activations": {"layers.*.mlp.fc1.input": [["Replicate()"],
                                                                                               ["Replicate()"]]}}),
                                      "PlanError", "gives 2 input placements"),
    "unknown module": Case(plan_on_gpt({"activations": {"layers.*.mlp.fc3.input": "Replicate()"}}), "PlanError",
                           "matches no module of GPT"),
    "tied conflict": Case(plan_on_gpt({"params": {"wte.weight": "Shard(0)", "lm_head.weight": "Shard(1)"}}),
                          "PlanError", "two different placements"),
    "no rule for layernorm": Case(plan_on_gpt({"params": {"layers.0.ln1.weight": "Shard(0)"}}), "PlanError",
                                  "no tensor-parallel rule for LayerNorm"),
    "bias against weight": Case(plan_on_gpt({"params": {"layers.0.mlp.fc1.weight": "Shard(0)",
                                                        "layers.0.mlp.fc1.bias": "Shard(0)",
                                                        "layers.0.mlp.fc2.weight": "Shard(1)",
                                                        "layers.0.mlp.fc2.bias": "Shard(0)"}}), "PlanError",
                                "layers.0.mlp.fc2.bias must be Replicate()"),
    "strided row": Case(plan_on_gpt({"params": {"layers.0.mlp.fc2.weight": "StridedShard(1, 2)"}}), "PlanError",
                        "column) or 1 (row), got StridedShard(1, 2)"),
    "zoo plan on another model": Case(lambda: sw.parallelize(make_gpt(0), plan="llama"), "PlanError",
                                      "applies to LlamaForCausalLM modules, but GPT contains none"),
    "divide_by_tp not an int": Case(plan_on_gpt({"divide_by_tp": ["layers.*.attn.dropout"]}), "PlanError",
                                    "must be an integer divisible by tp=2"),
    "linear subclass with its own forward": Case(lambda: sw.parallelize(
        _with_scaled_fc1(make_gpt(0)), sw.ParallelConfig(tp=2), plan={"params": {"layers.0.mlp.fc1.weight": "Shard(0)"}}),
        "PlanError", "no tensor-parallel rule for ScaledLinear"),
    "root module tensor-parallel": Case(lambda: sw.parallelize(nn.Linear(4, 4), sw.ParallelConfig(tp=2),
                                                               plan={"params": {"weight": "Shard(0)"}}),
                                        "PlanError", "the root module (Linear) itself is tensor-parallel"),
}


class ScaledLinear(nn.Linear):
    """A Linear whose forward computes something else: a tp rule would silently drop the scale."""

    def forward(self, x):
        return 2.0 * super().forward(x)


def _with_scaled_fc1(model: nn.Module) -> nn.Module:
    fc1 = model.layers[0].mlp.fc1
    scaled = ScaledLinear(fc1.in_features, fc1.out_features)
    model.layers[0].mlp.fc1 = scaled
    return model


def _partial_sgd() -> tuple[bool, float, float]:
    opt = sw.build_optimizer(sw.parallelize(Tuple()), functools.partial(torch.optim.SGD, momentum=0.9), lr=0.1)
    return isinstance(opt, torch.optim.SGD), opt.param_groups[0]["momentum"], opt.param_groups[0]["lr"]


class NoParams(nn.Module):
    def forward(self, x):
        return x.sum()


class Frozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1).requires_grad_(False)

    def forward(self, x):
        return self.lin(x).mean()


class ReturnsLogits(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        return self.lin(x)


class ReturnsNone(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        self.lin(x)


def _with_compiled_block(model: nn.Module) -> nn.Module:
    model.layers[0] = torch.compile(model.layers[0])
    return model


class Tuple(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x):
        out = self.lin(x)
        return out.pow(2).mean(), out


def _on_meta():
    with torch.device("meta"):
        return sw.parallelize(make_gpt(0))


def _deferred_twice():
    module = sw.deferred_init(make_gpt, 0)
    sw.parallelize(module)
    return sw.parallelize(module)


def _parallelized_twice():
    module = Tuple()
    sw.parallelize(module)
    return sw.parallelize(module)  # its parameters' gradients got 0.5x


def _inner_parallelized():
    inner = Tuple()
    sw.parallelize(inner)
    return sw.parallelize(nn.ModuleDict({"inner": inner, "head": nn.Linear(1, 1)}))


def _load_superseded():
    """A load whose version a concurrent save removed mid-read: said as such, not 'corrupt'."""
    import tempfile

    import shardwise.checkpoint as checkpoint

    pm = sw.parallelize(Tuple())
    with tempfile.TemporaryDirectory() as root:
        first = sw.save_checkpoint(root, pm)
        shutil.copytree(first, Path(root) / "v-00000000000old")  # a version that a newer save then removed
        real, calls = checkpoint.latest, []

        def stale_then_real(path):
            calls.append(path)
            if len(calls) == 1:
                shutil.rmtree(Path(root) / "v-00000000000old")
                return Path(root) / "v-00000000000old"
            return real(path)

        checkpoint.latest = stale_then_real
        try:
            return sw.load_checkpoint(root, pm)
        finally:
            checkpoint.latest = real


def _state_dict_load(kind: str):
    pm = sw.parallelize(Tuple())
    state = pm.state_dict()
    if kind == "assign":
        return pm.load_state_dict(state, assign=True)
    return pm.load_state_dict({"module.lin.weight": state["module.lin.weight"]})


def _loss_without_grad():
    pm = sw.parallelize(Tuple())
    with torch.no_grad():
        return pm.train_step(torch.randn(8, 4))


MODELS = {
    "not a module": Case(lambda: sw.parallelize(lambda x: x), "ModelError", "needs a torch.nn.Module, got function"),
    "no parameters": Case(lambda: sw.parallelize(NoParams()), "ModelError", "has no trainable parameters"),
    "only frozen parameters": Case(lambda: sw.parallelize(Frozen()), "ModelError", "has no trainable parameters"),
    "already parallel": Case(lambda: sw.parallelize(sw.parallelize(Tuple())), "ModelError", "already a ParallelModule"),
    "parallelized twice": Case(_parallelized_twice, "ModelError", "it was parallelized already"),
    "a ParallelModule inside a module": Case(lambda: sw.parallelize(nn.ModuleDict({"inner": sw.parallelize(Tuple()),
                                                                                  "head": nn.Linear(1, 1)})),
                                             "ModelError", "its submodule 'inner' was parallelized already"),
    "a parallelized module inside a module": Case(_inner_parallelized, "ModelError",
                                                  "its submodule 'inner' was parallelized already"),
    "meta tensors": Case(_on_meta, "ModelError", "not built with sw.deferred_init"),
    "deferred module twice": Case(_deferred_twice, "ModelError", "it was parallelized already"),
    "forward returns logits": Case(lambda: sw.parallelize(ReturnsLogits()).train_step(torch.randn(8, 4)), "ModelError",
                                   "return the scalar loss first"),
    "forward returns None": Case(lambda: sw.parallelize(ReturnsNone()).train_step(torch.randn(8, 4)), "ModelError",
                                 "the first output was NoneType"),
    "loss without grad": Case(_loss_without_grad, "ModelError", "does not require grad"),
    "optimizer on the plain module": Case(lambda: sw.build_optimizer(make_gpt(0), torch.optim.SGD, lr=0.1),
                                          "ShardwiseError", "build_optimizer needs the ParallelModule"),
    "optimizer with a foreign parameter": Case(
        lambda: sw.build_optimizer(sw.parallelize(Tuple()), torch.optim.SGD, params=[nn.Parameter(torch.zeros(2))],
                                   lr=0.1), "ShardwiseError", "is not a parameter of the ParallelModule"),
    "optimizer factory returning junk": Case(lambda: sw.build_optimizer(sw.parallelize(Tuple()), lambda p, **k: 3),
                                             "ShardwiseError", "not a torch.optim.Optimizer"),
    "optimizer as a lambda": Case(lambda: sw.build_optimizer(sw.parallelize(Tuple()),
                                                             lambda p, **k: torch.optim.SGD(p, **k), lr=0.1),
                                  "ShardwiseError", "functools.partial(OptimizerClass, ...)"),
    "optimizer as functools.partial": Case(lambda: _partial_sgd(), None, check=lambda v: v == (True, 0.9, 0.1)),
    "state dict missing key": Case(lambda: sw.parallelize(Tuple()).load_full_state_dict({"lin.weight": torch.zeros(1, 4)}),
                                   "CheckpointError", "missing keys ['lin.bias']"),
    "state dict wrong shape": Case(lambda: sw.parallelize(Tuple()).load_full_state_dict(
        {"lin.weight": torch.zeros(2, 4), "lin.bias": torch.zeros(1)}), "CheckpointError",
        "'lin.weight' has shape (2, 4) but the model's is (1, 4)"),
    "load of a version replaced meanwhile": Case(_load_superseded, "CheckpointError",
                                                 "was replaced by a newer save (v-"),
    "load_state_dict with assign=True": Case(lambda: _state_dict_load("assign"), "CheckpointError",
                                             "load with assign=False"),
    "load_state_dict missing a key": Case(lambda: _state_dict_load("missing"), "CheckpointError",
                                          "missing keys ['lin.bias']"),
    "LBFGS with whole parameters": Case(lambda: type(sw.build_optimizer(sw.parallelize(Tuple()), torch.optim.LBFGS))
                                        .__name__, None, check=lambda v: v == "LBFGS"),
    "group helper mixing dp and tp": Case(lambda: sw.reduce(torch.ones(2), "dp+tp", topology=sw.parallelize(
        Tuple()).topology), "ConfigError", "mixes ranks that compute different losses"),
    "check with batches not a list": Case(lambda: sw.check(Tuple, lambda: 3, sw.ParallelConfig(), ranks=2),
                                          "ConfigError", "batches must be a list of batches"),
    "check with a factory that raises": Case(lambda: sw.check(lambda: 1 / 0, [torch.ones(4, 4)] * 3,
                                                              sw.ParallelConfig(), ranks=2),
                                             "ConfigError", "raised ZeroDivisionError"),
    "check with batches the replicas cannot share": Case(lambda: sw.check(Tuple, [torch.ones(3, 4)] * 3,
                                                                          sw.ParallelConfig(), ranks=2),
                                                         "ConfigError", "batch 0 has 3 samples, which the 2 data"),
    "state dict not a dict": Case(lambda: sw.parallelize(Tuple()).load_full_state_dict([1, 2]), "CheckpointError",
                                  "a state dict maps names to tensors"),
}


def _train_tuple(batch, microbatches: int = 4):
    return sw.parallelize(Tuple(), sw.ParallelConfig(microbatches=microbatches)).train_step(batch)


BATCHES = {
    "not divisible by microbatches": Case(lambda: _train_tuple(torch.randn(6, 4)), "BatchError",
                                          "batch size 6 is not divisible by microbatches=4"),
    "leaves of different sizes": Case(lambda: split_batch({"x": torch.randn(8, 4), "y": torch.randn(7)}, 4),
                                      "BatchError", "batch['y'] has 7 samples along dim 0 but batch['x'] has 8"),
    "no tensors": Case(lambda: _train_tuple({"x": 3}), "BatchError", "holds no tensor with a batch dimension"),
    "empty batch": Case(lambda: _train_tuple(torch.randn(0, 4)), "BatchError", "batch size 0 is not divisible"),
    "fewer samples than microbatches": Case(lambda: _train_tuple(torch.randn(2, 4)), "BatchError",
                                            "batch size 2 is not divisible by microbatches=4"),
    "scalar only": Case(lambda: _train_tuple(torch.tensor(3.0)), "BatchError", "holds no tensor with a batch dimension"),
    "tuple loss is fine": Case(lambda: float(_train_tuple(torch.randn(8, 4))), None, check=lambda v: v > 0),
}


def cluster(**kwargs):
    return lambda: sw.Cluster(**{"gpus": 8, **kwargs})


def search(**kwargs):
    return lambda: sw.plan.search("llama3-8b", sw.Cluster(gpus=8), **{"global_batch": 8, "seq_len": 2048, **kwargs})


def _huge_spec():
    import dataclasses

    from shardwise.planner import MODELS

    return dataclasses.replace(MODELS["llama3-8b"], layers=1_000_000)


def _spec(**changes):
    import dataclasses

    from shardwise.planner import MODELS

    return dataclasses.replace(MODELS["llama3-8b"], **changes)


def _scale_underflow():
    scaler = sw.LossScaler(init_scale=2.0 ** -120)
    for _ in range(10):
        scaler.update(found_inf=True)


PLANNER = {  # each was accepted and planned nonsense before (issue 26)
    "memory_bytes zero": Case(cluster(memory_bytes=0), "ConfigError", "memory_bytes=0 must be a positive finite"),
    "memory_bytes negative": Case(cluster(memory_bytes=-1), "ConfigError", "memory_bytes=-1 must be a positive"),
    "memory_fraction above one": Case(cluster(memory_fraction=50), "ConfigError", "memory_fraction=50 must be in (0, 1]"),
    "memory_fraction zero": Case(cluster(memory_fraction=0), "ConfigError", "memory_fraction=0 must be in (0, 1]"),
    "peak_flops negative": Case(cluster(peak_flops=-1e15), "ConfigError", "peak_flops=-1000000000000000.0 must be a positive"),
    "peak_flops nan": Case(cluster(peak_flops=float("nan")), "ConfigError", "peak_flops=nan must be a positive"),
    "bandwidth inf": Case(cluster(inter_node_bw=float("inf")), "ConfigError", "inter_node_bw=inf must be a positive"),
    "bandwidth bool": Case(cluster(intra_node_bw=True), "ConfigError", "intra_node_bw=True must be a positive"),
    "gpus bool": Case(cluster(gpus=True), "ConfigError", "gpus=True must be a positive integer"),
    "seq_len bool": Case(search(seq_len=True), "ConfigError", "seq_len=True must be a positive number"),
    "global_batch bool": Case(search(global_batch=True), "ConfigError", "global_batch=True must be a positive integer"),
    "model spec with a million layers": Case(lambda: sw.plan.search(_huge_spec(), sw.Cluster(gpus=8), global_batch=8,
                                                                    seq_len=2048), "ConfigError", "layers=1000000"),
    "loss scale underflow": Case(_scale_underflow, "ModelError", "the loss scale fell to"),
    "model spec with no heads": Case(lambda: _spec(heads=0), "ConfigError", "ModelSpec(heads=0) must be a positive"),
    "model spec with an unknown mlp": Case(lambda: _spec(mlp="relu"), "ConfigError", "mlp is 'gelu' or 'swiglu'"),
    "gpus_per_node bool": Case(cluster(gpus_per_node=True), "ConfigError", "gpus_per_node=True must be a positive"),
    "nics_per_node zero": Case(cluster(nics_per_node=0), "ConfigError", "nics_per_node=0 must be a positive integer"),
    "nics_per_node float": Case(cluster(nics_per_node=2.0), "ConfigError", "nics_per_node=2.0 must be a positive integer"),
    "memory_fraction nan": Case(cluster(memory_fraction=float("nan")), "ConfigError", "memory_fraction=nan must be"),
    "memory_fraction 1.5": Case(cluster(memory_fraction=1.5), "ConfigError", "memory_fraction=1.5 must be in (0, 1]"),
    "global_batch zero": Case(search(global_batch=0), "ConfigError", "global_batch=0 must be a positive integer"),
    "override kept": Case(lambda: sw.Cluster(gpus=8, memory_bytes=40e9).spec.memory_bytes, None, check=lambda v: v == 40e9),
    "gemm_efficiency above one": Case(cluster(gemm_efficiency=1.5), "ConfigError", "gemm_efficiency=1.5 is a fraction"),
    "matmul_overhead negative": Case(cluster(matmul_overhead=-1e-6), "ConfigError", "matmul_overhead=-1e-06 must be a"),
    "calibration override kept": Case(lambda: sw.Cluster(gpus=8, matmul_overhead=0, elementwise=16).spec, None,
                                      check=lambda d: d.matmul_overhead == 0 and d.elementwise == 16),
}

SINGLE = {**{f"config: {k}": v for k, v in CONFIG.items()}, **{f"plan: {k}": v for k, v in PLANS.items()},
          **{f"model: {k}": v for k, v in MODELS.items()}, **{f"batch: {k}": v for k, v in BATCHES.items()},
          **{f"planner: {k}": v for k, v in PLANNER.items()}}


@pytest.mark.parametrize("name", list(SINGLE))
def test_single_process(name):
    case = SINGLE[name]
    judge(case, outcome(case.action), name)


# ==== several ranks, grouped into worlds ==========================================================
def _rank() -> int:
    return dist.get_rank()


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
                                                            plan=f"/tmp/shardwise-plan-{_rank()}-{os.getpid()}.json"),
                                     "PlanError", "does not exist (found on rank"),
}


def _mismatched_model(kind: str):
    r = _rank()
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
    batch = gpt_batches(1, 4)[0][_rank() * 2:(_rank() + 1) * 2]
    pm.train_step(batch)
    if _rank() == 0:
        return {"full_state_dict": pm.full_state_dict, "clip_grad_norm": lambda: opt.clip_grad_norm(1.0),
                "optimizer.step": opt.step, "full_grad_dict": pm.full_grad_dict}[method]()
    return pm.train_step(batch)  # the other rank moved on to the next step


def _state_dict_on_rank_zero():
    pm = sw.parallelize(make_gpt(0), sw.ParallelConfig(tp=2), plan="gpt")
    return pm.load_full_state_dict(make_gpt(1).state_dict() if _rank() == 0 else {})


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
    if _rank() == 0:  # a rule that completes the bias's placement on one rank only
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
        if _rank() == 0:
            y = sw.reduce(y, "dp", op="mean")
        return y.pow(2).mean()


def _reduce_on_rank_zero():
    return float(sw.parallelize(_ReducesOnRankZero()).train_step(torch.ones(4, 4)))


def _reduce_by_rank():
    pm = sw.parallelize(make_gpt(0), sw.ParallelConfig())
    batch = gpt_batches(1, 4)[0][_rank() * 2:(_rank() + 1) * 2]
    return float(pm.train_step(batch, reduce="sum" if _rank() == 1 else "mean"))


def _given_by_rank(kind: str):
    """Ranks handed different values to load: each kept its own half before (issue 26)."""
    r = _rank()
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
        return self.lin(x).pow(2).mean(), self.count(_rank(), self.calls)


def _tokens(count, tp: int = 1, steps: int = 3):
    pm = sw.parallelize(_Counting(count), sw.ParallelConfig(tp=tp, microbatches=2), plan=sw.Plan(name="none"))
    for _ in range(steps):
        pm.train_step(torch.ones(4, 4), reduce="tokens")
    return "trained"


def _optimizer_in(cls, elementwise=None, **config):
    """A non-element-wise optimizer where parameters are sharded (it trained 4% off, or raised raw)."""
    plan = "gpt" if config.get("tp", 1) > 1 else None
    pm = sw.parallelize(make_gpt(0), sw.ParallelConfig(**config), plan=plan)
    extra = {} if elementwise is None else {"elementwise": elementwise}
    opt = sw.build_optimizer(pm, cls, lr=1e-3, **extra)
    pm.train_step(gpt_batches(1, 4)[0])
    opt.step()
    return "stepped"


class _Outer(nn.Module):
    """A plain module holding a ParallelModule after its own trainable layer."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(4, 4)
        self.inner = sw.parallelize(Tuple())

    def forward(self, x):
        return self.inner(self.stem(x))


class _Headed(nn.Module):
    """A plain module applying its own trainable head to a ParallelModule's outputs."""

    def __init__(self):
        super().__init__()
        self.body = sw.parallelize(nn.Sequential(nn.Linear(4, 4)))
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.body(x))


def _headed(frozen: bool):
    outer = _Headed()
    outer.head.requires_grad_(not frozen)
    outer(torch.randn(4, 4)).sum().backward()  # the head's gradient would be this replica's alone
    return "trained"


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
    r = _rank()
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


def _unequal_reference():
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
        if _rank() == 1:
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
    "a rule raising KeyError": Case(lambda: sw.parallelize(_OneLayer(_BrokenRuleLayer), sw.ParallelConfig(tp=2),
                                                           plan={"params": {"layer.weight": "Shard(0)"}}),
                                    "ShardwiseError", "parallelize failed before communicating: KeyError: 'weight_scale'"),
    "a tp plan on a Linear shared by two blocks": Case(
        lambda: float(sw.parallelize(_SharedLinear(), sw.ParallelConfig(tp=2),
                                     plan={"params": {"blocks.*.0.weight": "Shard(0)"}}).train_step(torch.ones(4, 4))),
        "PlanError", "Linear 'blocks.0.0' is one module used at ['blocks.0.0', 'blocks.1.0']"),
    "a rule completing a placement on one rank only": Case(
        lambda: sw.parallelize(_OneLayer(_RankDependentRuleLayer), sw.ParallelConfig(tp=2),
                               plan={"params": {"layer.weight": "Shard(0)"}}), "ModelError",
        "rank 1 has rule for layer"),
    "a rule refusing with a rank-dependent message": Case(
        lambda: sw.parallelize(_OneLayer(_RuleRaisingByRank), sw.ParallelConfig(tp=2),
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
    "Adafactor under ZeRO-1": Case(lambda: _optimizer_in(torch.optim.Adafactor, zero=1), "ConfigError",
                                   "Adafactor is not an element-wise optimizer"),
    "Adafactor under tp": Case(lambda: _optimizer_in(torch.optim.Adafactor, tp=2), "ConfigError",
                               "in this layout (zero=0, tp=2) it would get parts of"),
    "Muon under ZeRO-2": Case(lambda: _optimizer_in(functools.partial(torch.optim.Muon, adjust_lr_fn="original"),
                                                    zero=2), "ConfigError", "Muon is not an element-wise optimizer"),
    "Adafactor with whole parameters": Case(lambda: _optimizer_in(torch.optim.Adafactor), None,
                                            check=lambda v: v == "stepped"),
    "an element-wise optimizer vouched for": Case(lambda: _optimizer_in(torch.optim.Adafactor, elementwise=True,
                                                                        zero=1), None, check=lambda v: v == "stepped"),
    "a head trained on a ParallelModule's outputs": Case(lambda: _headed(frozen=False), "ModelError",
                                                         "is trained together with Sequential's ParallelModule"),
    "a frozen head on a ParallelModule's outputs": Case(lambda: _headed(frozen=True), None,
                                                        check=lambda v: v == "trained"),
    "veScale's [[Shard(1)]] on an input that arrives whole": Case(
        lambda: _sequence_mlp({"forward": {"mlp.fc1.input": [["Shard(1)"]], "mlp.fc2.output": [["Shard(1)"]]}}),
        "PlanError", "it is the same on every tp rank: it arrives whole"),
    "the same input split by the plan": Case(
        lambda: _sequence_mlp({"forward": {"mlp.fc1.input": [["Replicate() -> Shard(1)"]], "mlp.fc2.input": [["Shard(1)"]],
                                           "mlp.fc2.output": [["Shard(1)"]]}}), None, check=lambda v: v == "trained"),
    "tokens: the same count on tp peers": Case(lambda: _tokens(lambda r, i: 3, tp=2), None,
                                               check=lambda v: v == "trained"),
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


RANKS4 = {
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


def _run_group(group: str, setup: Any = None) -> dict[str, tuple]:
    cases = {"ranks2": RANKS2, "ranks4": RANKS4, "checkpoints": CHECKPOINTS}[group]
    if group == "ranks2" and _rank() == 0:
        Path(f"/tmp/shardwise-plan-0-{os.getpid()}.json").write_text(json.dumps({"params": {}}))
    if group == "checkpoints":
        CONTEXT.update(setup)
    return {name: outcome(case.action) for name, case in cases.items()}


@pytest.fixture(scope="module")
def ranks2():
    return sw.testing.run_on_ranks(_run_group, 2, "ranks2", timeout=300)


@pytest.fixture(scope="module")
def ranks4():
    return sw.testing.run_on_ranks(_run_group, 4, "ranks4", timeout=300)


def _judge_all_ranks(case: Case, results: list[dict], name: str) -> None:
    for rank, result in enumerate(results):
        judge(case, result[name], f"{name} on rank {rank}:")
        assert result[name][2] < SLOWEST_ALLOWED_S, f"{name} on rank {rank} took {result[name][2]:.1f}s"
        TIMES[name] = max(TIMES.get(name, 0.0), result[name][2])
    if case.error is not None:  # the same message everywhere
        assert len({r[name][1] for r in results}) == 1, [r[name][1] for r in results]


TIMES: dict[str, float] = {}


@pytest.mark.parametrize("name", list(RANKS2))
def test_two_ranks(ranks2, name):
    _judge_all_ranks(RANKS2[name], ranks2, name)


@pytest.mark.parametrize("name", list(RANKS4))
def test_four_ranks(ranks4, name):
    _judge_all_ranks(RANKS4[name], ranks4, name)
    if name == "unequal replicas weighted by samples":  # one process on the 8 samples
        want = _unequal_reference()
        for result in ranks4:
            got = result[name][3]["wpe.weight"]
            assert (got - want).abs().max() <= 2e-3 * want.abs().max()  # EPS_GRAD, tests/parity.py


# ==== checkpoints ===================================================================================
CONTEXT: dict[str, str] = {}


def _ckpt_model(**overrides):
    pm = sw.parallelize(make_gpt(0, **overrides), sw.ParallelConfig(tp=2), plan="gpt")
    return pm, sw.build_optimizer(pm, torch.optim.SGD, **SGD)


def _load(key: str, optimizer: bool = True, **overrides):
    pm, opt = _ckpt_model(**overrides)
    return sw.load_checkpoint(CONTEXT[key], pm, opt if optimizer else None)


def _save(path: str, extra: Any = None):
    pm, opt = _ckpt_model()
    return sw.save_checkpoint(path, pm, opt, extra=extra)


def _disk_full(kind: str):
    """A save whose write fails (a full disk) on one or every rank; then training goes on and
    the next save succeeds. The failure is injected where the file is written."""
    import errno

    from safetensors import SafetensorError
    from shardwise.checkpoint import store

    pm, opt = _ckpt_model()
    real = store.save_file

    def full(tensors, filename):
        if kind == "safetensors":
            raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")
        if _rank() == 1:
            raise OSError(errno.ENOSPC, "No space left on device", filename)
        return real(tensors, filename)

    store.save_file = full
    try:
        sw.save_checkpoint(CONTEXT["fresh"], pm, opt)
    except sw.CheckpointError as exc:
        message = str(exc)
    finally:
        store.save_file = real
    pm.train_step(gpt_batches(1, 4)[0])
    opt.step()
    sw.save_checkpoint(CONTEXT["fresh"], pm, opt)
    sw.load_checkpoint(CONTEXT["fresh"], pm, opt)
    raise sw.CheckpointError(message)  # what the failed save said, after training went on


def _beside_another_job():
    """Another job's save in progress in the same directory survives ours; a stale one does not."""
    root = Path(CONTEXT["shared"])
    if _rank() == 0:
        (root / "v-0000000000other.tmp").mkdir(parents=True, exist_ok=True)
        stale = root / "v-00000000000dead.tmp"
        stale.mkdir(exist_ok=True)
        os.utime(stale, (time.time() - 7200, time.time() - 7200))
    _save(str(root))
    dist.barrier()
    return sorted(p.name for p in root.glob("v-*.tmp"))


def _load_into_groups(key: str, split: str):
    """The 'good' checkpoint (one SGD group) into an optimizer with two groups."""
    pm = sw.parallelize(make_gpt(0), sw.ParallelConfig(tp=2), plan="gpt")
    named = list(pm.named_parameters())
    if split == "two groups":
        groups = [{"params": [p for n, p in named if "wte" in n]}, {"params": [p for n, p in named if "wte" not in n],
                                                                    "lr": 0.5}]
    else:
        groups = [{"params": [p for n, p in named]}]
    opt = sw.build_optimizer(pm, torch.optim.SGD, params=groups, **SGD)
    return sw.load_checkpoint(CONTEXT[key], pm, opt)


def _after_failures_training_goes_on():
    pm, opt = _ckpt_model()
    for target in (f"{CONTEXT['file']}/ck", CONTEXT["missing"]):
        try:
            sw.save_checkpoint(target, pm, opt) if target.endswith("/ck") else sw.load_checkpoint(target, pm, opt)
        except sw.CheckpointError:
            pass
    loss = float(pm.train_step(gpt_batches(1, 4)[0]))
    opt.step()
    sw.save_checkpoint(CONTEXT["fresh"], pm, opt)
    sw.load_checkpoint(CONTEXT["fresh"], pm, opt)
    return loss


CHECKPOINTS = {
    "missing directory": Case(lambda: _load("missing"), "CheckpointError", "no complete checkpoint at"),
    "empty directory": Case(lambda: _load("empty"), "CheckpointError", "(no LATEST file)"),
    "LATEST names a missing version": Case(lambda: _load("dangling"), "CheckpointError", "is incomplete"),
    "no COMPLETE marker": Case(lambda: _load("incomplete"), "CheckpointError", "it has no COMPLETE marker"),
    "truncated rank file": Case(lambda: _load("truncated"), "CheckpointError", "is corrupt"),
    "corrupt bytes in a chunk": Case(lambda: _load("corrupt"), "CheckpointError",
                                     "chunk t0 of 'model/wte.weight' does not match its checksum"),
    "edited shardwise.json": Case(lambda: _load("meta"), "CheckpointError", "shardwise.json does not match its checksum"),
    "edited rank index": Case(lambda: _load("index"), "CheckpointError", "rank-1.json does not match its checksum"),
    "missing rank file": Case(lambda: _load("lost"), "CheckpointError", "rank-1.safetensors"),
    "another model": Case(lambda: _load("good", n_layer=3), "CheckpointError", "is from another model"),
    "no optimizer state saved": Case(lambda: _load("no-optimizer"), "CheckpointError", "has no optimizer state"),
    "checkpoint on rank 0 only": Case(lambda: _load(f"rank{_rank()}-only"), "CheckpointError", "found on rank 1"),
    "unwritable directory": Case(lambda: _save(f"{CONTEXT['file']}/ck"), "CheckpointError",
                                 "cannot create checkpoint directory"),
    "directory not shared": Case(lambda: _save(f"{CONTEXT['unshared']}/{_rank()}"), "CheckpointError",
                                 "rank 1 does not see"),
    "plain file that is not a state dict": Case(lambda: _load("not-a-state-dict"), "CheckpointError",
                                                "is not a readable state dict"),
    "plain state dict of another model": Case(lambda: _load("other-state-dict"), "CheckpointError",
                                              "state dict does not match GPT"),
    "training goes on after failures": Case(_after_failures_training_goes_on, None, check=lambda v: v > 0),
    "optimizer with more groups than saved": Case(lambda: _load_into_groups("good", "two groups"), "CheckpointError",
                                                  "saved with 1 optimizer parameter group(s) and this optimizer has 2"),
    "optimizer with the saved group": Case(lambda: _load_into_groups("good", "one group"), None),
    "extra holding an object": Case(lambda: _save(CONTEXT["fresh"], extra={"sampler": Case(None, None)}),
                                    "CheckpointError", "may not contain"),
    "disk full on one rank": Case(lambda: _disk_full("oserror"), "CheckpointError",
                                  "rank 1's checkpoint file in"),
    "disk full, said in words": Case(lambda: _disk_full("oserror"), "CheckpointError",
                                     "the disk is full: free space or save elsewhere"),
    "disk full, safetensors' error": Case(lambda: _disk_full("safetensors"), "CheckpointError",
                                          "SafetensorError: Error while serializing"),
    "permission denied said as such": Case(lambda: _save("/sys/shardwise-ck"), "CheckpointError",
                                           "permission denied: make the directory writable"),
    "another job's save in progress survives": Case(_beside_another_job, None,
                                                    check=lambda v: v == ["v-0000000000other.tmp"]),
    "extra that cannot be pickled": Case(lambda: _save(CONTEXT["fresh"], extra={"fn": lambda: 0}), "CheckpointError",
                                         "cannot be saved"),
}


def _make_checkpoint(path: str, optimizer: bool = True):
    pm, opt = _ckpt_model()
    pm.train_step(gpt_batches(1, 4)[0])
    opt.step()
    sw.save_checkpoint(path, pm, opt if optimizer else None)
    if dist.get_rank() == 0:
        torch.save(make_gpt(0, n_layer=3).state_dict(), f"{path}-other.pt")


def _version(path: Path) -> Path:
    return path / (path / "LATEST").read_text()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    sw.testing.run_on_ranks(_make_checkpoint, 2, str(root / "good"))
    sw.testing.run_on_ranks(_make_checkpoint, 2, str(root / "no-optimizer"), False)
    paths = {"good": root / "good", "no-optimizer": root / "no-optimizer", "missing": root / "missing",
             "empty": root / "empty", "fresh": root / "fresh", "unshared": root / "unshared",
             "rank0-only": root / "good", "rank1-only": root / "nowhere"}
    (root / "empty").mkdir()
    (root / "file").write_text("a file, not a directory")
    paths["file"] = root / "file"
    paths["shared"] = root / "shared"
    (root / "unshared").mkdir()

    def variant(name: str, damage: Callable[[Path], None]) -> None:
        shutil.copytree(root / "good", root / name)
        damage(_version(root / name))
        paths[name] = root / name

    def corrupt_chunk(version: Path) -> None:
        target = version / "rank-0.safetensors"
        data = bytearray(target.read_bytes())
        header = int.from_bytes(data[:8], "little")
        name = json.loads((version / "rank-0.json").read_text())["index"]["model/wte.weight"][0][0]
        offset = 8 + header + json.loads(data[8:8 + header])[name]["data_offsets"][0] + 32
        data[offset:offset + 16] = b"\x11" * 16
        target.write_bytes(bytes(data))

    variant("dangling", lambda v: shutil.rmtree(v))
    variant("incomplete", lambda v: (v / "COMPLETE").unlink())
    variant("truncated", lambda v: (v / "rank-1.safetensors").write_bytes((v / "rank-1.safetensors").read_bytes()[:100]))
    variant("corrupt", corrupt_chunk)
    variant("meta", lambda v: (v / "shardwise.json").write_text((v / "shardwise.json").read_text().replace('"steps": 1',
                                                                                                       '"steps": 7')))
    variant("index", lambda v: (v / "rank-1.json").write_text((v / "rank-1.json").read_text().replace("[0, ", "[1, ", 1)))
    variant("lost", lambda v: (v / "rank-1.safetensors").unlink())
    (root / "junk.pt").write_bytes(b"not a pickle")
    paths["not-a-state-dict"] = root / "junk.pt"
    paths["other-state-dict"] = root / "good-other.pt"
    context = {k: str(v) for k, v in paths.items()}
    return sw.testing.run_on_ranks(_run_group, 2, "checkpoints", context, timeout=300), root


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_checkpoints(checkpoints, name):
    _judge_all_ranks(CHECKPOINTS[name], checkpoints[0], name)


MERGES = {  # one process: what load refuses, merge refuses
    "merge of a corrupt chunk": ("corrupt", "m.safetensors", False, "does not match its checksum"),
    "merge of a truncated file": ("truncated", "m.safetensors", False, "is corrupt"),
    "merge of a missing checkpoint": ("missing", "m.safetensors", False, "no complete checkpoint"),
    "merge into a missing directory": ("good", "nowhere/m.safetensors", False, "does not exist; create it first"),
    "merge with a wrong suffix": ("good", "m.bin", False, "must end in .safetensors or .pt"),
    "merge of optimizer state never saved": ("no-optimizer", "m.pt", True, "has no optimizer state to merge"),
    "merge into an unwritable directory": ("good", "/sys/m.safetensors", False, "Permission denied (os error 13)"),
}


@pytest.mark.parametrize("name", list(MERGES))
def test_merge(checkpoints, name):
    key, out, optimizer, phrase = MERGES[name]
    root = checkpoints[1]
    source = root / key if key != "missing" else root / "missing"
    judge(Case(None, "CheckpointError", phrase),
          outcome(lambda: sw.merge_checkpoint(source, root / out, optimizer=optimizer)), name)


# ==== the command line ===============================================================================
CLI = {
    "demo --ranks 0": (["demo", "--ranks", "0"], "0 is not in the range x>=1"),
    "demo --ranks -1": (["demo", "--ranks", "-1"], "-1 is not in the range x>=1"),
    "demo --microbatches 0": (["demo", "--microbatches", "0"], "0 is not in the range x>=1"),
    "demo --steps 0": (["demo", "--steps", "0"], "0 is not in the range x>=1"),
    "demo --batch 0": (["demo", "--batch", "0"], "0 is not in the range x>=1"),
    "demo --tp 3 on 4 ranks": (["demo", "--tp", "3"], "--tp 3 x --pp 1 x --cp 1 must divide --ranks 4"),
    "demo --cp 3 on 4 ranks": (["demo", "--cp", "3"], "--tp 1 x --pp 1 x --cp 3 must divide --ranks 4"),
    "demo batch not a multiple": (["demo", "--batch", "6"], "must be a multiple of replicas*microbatches = 8"),
    "demo --lr 0": (["demo", "--lr", "0"], "0.0 is not in the range x>0"),
    "merge of a missing path": (["merge", "/nonexistent/ckpt", "/tmp/x.safetensors"], "does not exist"),
    "demo --backend nccl without a GPU per rank": (["demo", "--backend", "nccl"], "--backend nccl needs a GPU per rank"),
    "demo --backend mpi": (["demo", "--backend", "mpi"], "'mpi' is not one of 'gloo', 'nccl'"),
    "plan --model of a function needing arguments": (["plan", "--model", "json:loads", "--gpus", "8", "--seq", "2048",
                                                      "--global-batch", "8"], "json:loads() raised TypeError"),
    "plan --model returning a string": (["plan", "--model", "os:getcwd", "--gpus", "8", "--seq", "2048",
                                         "--global-batch", "8"], "os:getcwd() returned a str, not a torch.nn.Module"),
    "check of a factory returning a string": (["check", "os:getcwd", "test_groups:mlp_batches", "--ranks", "2"],
                                              "returned a str, not a torch.nn.Module"),
    "check with string batches": (["check", "test_check:gpt", "os:getcwd", "--ranks", "2"],
                                  "batches must be a list of batches"),
    "check with batches of strings": (["check", "test_check:gpt", "test_bad_inputs:_strings", "--ranks", "2"],
                                      "batch 0 is a str holding no tensor"),
}


def _strings():
    return ["a", "b", "c"]


@pytest.mark.parametrize("name", list(CLI))
def test_cli(name):
    from shardwise.cli import main

    args, phrase = CLI[name]
    result = CliRunner().invoke(main, args)
    assert result.exit_code != 0 and phrase in result.output, result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("name", ["corrupt", "truncated", "into a missing directory"])
def test_cli_merge_refuses_in_one_line(checkpoints, name):
    from shardwise.cli import main

    root = checkpoints[1]
    source, out = {"corrupt": ("corrupt", "m.safetensors"), "truncated": ("truncated", "m.safetensors"),
                   "into a missing directory": ("good", "nowhere/m.safetensors")}[name]
    result = CliRunner().invoke(main, ["merge", str(root / source), str(root / out)])
    assert result.exit_code == 1 and result.output.startswith("Error: ") and len(result.output.splitlines()) == 1, \
        result.output


# ==== a rank that raises, exits or stalls ===========================================================
def _peer_fails(action: str, timeout_s: float | None, report: str | None = None):
    config = sw.ParallelConfig() if timeout_s is None else sw.ParallelConfig(timeout_s=timeout_s)
    pm = sw.parallelize(make_gpt(0), config)
    batch = gpt_batches(1, 4)[0][_rank() * 2:(_rank() + 1) * 2]
    pm.train_step(batch)
    if _rank() == 1:
        if action == "raises":
            pm.module.wpe.forward = _boom
            try:
                pm.train_step(batch)
            except ValueError as exc:
                return str(exc)
            return "no error"
        if action == "exits":
            os._exit(3)
        time.sleep(timeout_s + 5)
        return "slept"
    result = outcome(lambda: pm.train_step(batch))
    if report:  # the harness raises for the dead rank; rank 0's own outcome goes through a file
        Path(report).write_text(json.dumps(result[:3]))
    return result


def _boom(*args):
    raise ValueError("a bug in rank 1's forward")


@pytest.mark.parametrize("action, timeout_s, phrase", [
    ("raises", None, "rank 1: out of step: train_step #2 raised ValueError: a bug in rank 1's forward"),
    ("sleeps", 3.0, "not every rank joined within timeout_s=3s"),
])
def test_peer_that_raises_or_stalls(action, timeout_s, phrase):
    results = sw.testing.run_on_ranks(_peer_fails, 2, action, timeout_s, timeout=60)
    kind, message, seconds, _ = results[0]
    assert kind == "CommunicationError" and phrase in message, message
    assert seconds < SLOWEST_ALLOWED_S, seconds
    TIMES[f"peer {action}"] = seconds


def test_peer_that_exits_is_named(tmp_path):
    report = tmp_path / "rank0.json"
    with pytest.raises(sw.RankFailedError, match=r"rank 1 of 2 died with exit code 3"):
        sw.testing.run_on_ranks(_peer_fails, 2, "exits", None, str(report), timeout=60)
    kind, message, seconds = json.loads(report.read_text())
    assert kind == "CommunicationError" and "a peer closed its connection" in message, message
    assert seconds < SLOWEST_ALLOWED_S
    TIMES["peer exits"] = seconds


def _peer_dies_inside(kind: str, report: str):
    """Rank 1 exits in the middle of a tp forward, a pipeline schedule, cp attention or the experts' dispatch."""
    configs = {"tp": (sw.ParallelConfig(tp=2), "gpt", None), "pp": (sw.ParallelConfig(pp=2, microbatches=2), None,
                                                                  gpt_batches(1, 4)[0]),
               "cp": (sw.ParallelConfig(cp=2), None, None)}
    if kind == "ep":  # experts split over the two ranks: rank 1 dies as its tokens reach the experts
        from test_expert import make_moe, moe_batches

        pm = sw.parallelize(make_moe("mixtral"), sw.ParallelConfig(ep=2))
        batch = {k: v[_rank() * 2:_rank() * 2 + 2] for k, v in moe_batches(1)[0].items()}
        pm.train_step(batch)
        if _rank() == 1:
            pm.module.lm.model.layers[-1].mlp.experts.register_forward_pre_hook(lambda *args: os._exit(3))
        result = outcome(lambda: pm.train_step(batch))
        Path(report).write_text(json.dumps(result[:3]))
        return result
    config, plan, sample = configs[kind]
    pm = sw.parallelize(make_gpt(0, n_layer=4, block_size=16), config, plan=plan, sample=sample)
    batch = gpt_batches(1, 4)[0]
    if kind == "cp":
        batch = {"input_ids": batch[:, :-1][:, :16], "labels": batch[:, 1:][:, :16]}
    pm.train_step(batch)
    if _rank() == 1 and kind == "pp":  # stages replay a captured program: die at the first send of the schedule
        import shardwise.parallel.pipeline.runner as runner

        class Dying:
            def __getattr__(self, name):
                return getattr(dist, name)

            @staticmethod
            def isend(*args, **kwargs):
                os._exit(3)

        runner.dist = Dying()
    elif _rank() == 1:
        pm.module.layers[-1].register_forward_hook(lambda *args: os._exit(3))
    result = outcome(lambda: pm.train_step(batch))
    Path(report).write_text(json.dumps(result[:3]))
    return result


@pytest.mark.parametrize("kind", ["tp", "pp", "cp", "ep"])
def test_peer_that_exits_inside_a_parallel_forward_is_named(tmp_path, kind):
    """Before, the survivor saw gloo's raw 'Connection reset by peer'."""
    report = tmp_path / "rank0.json"
    with pytest.raises(sw.RankFailedError, match=r"rank 1 of 2 died with exit code 3"):
        sw.testing.run_on_ranks(_peer_dies_inside, 2, kind, str(report), timeout=60)
    kind_, message, seconds = json.loads(report.read_text())
    assert kind_ == "CommunicationError" and "a peer closed its connection" in message and "rank 0:" in message, message
    assert seconds < SLOWEST_ALLOWED_S
    TIMES[f"peer exits inside {kind}"] = seconds


def test_zz_report_slowest():
    """Prints the slowest multi-rank error (run with -s to see it)."""
    if TIMES:
        name = max(TIMES, key=TIMES.get)
        print(f"\nslowest multi-rank error: {name}: {TIMES[name]:.2f} s (of {len(TIMES)} timed)")
