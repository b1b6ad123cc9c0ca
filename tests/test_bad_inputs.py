"""A catalogue of bad inputs and faults: each ends in a clear ShardwiseError, the same on
every rank and within seconds, or in the right result. This file: the single-process cases,
each run in the test process. Multi-rank cases: bad_inputs_rank_cases.py, run by
test_bad_inputs_ranks.py; checkpoints, merge and the command line: test_bad_inputs_files.py;
a rank that raises, exits or stalls: test_bad_inputs_peers.py.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

import shardwise as sw
from parity import make_gpt
from shardwise.batch import split_batch
from bad_inputs import Case, Tuple, judge, outcome, plan_on_gpt


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
    "recompute under a zero-bubble pipeline": Case(config(pp=2, recompute="selective", schedule="zero-bubble"),
                                                   "ConfigError", "use schedule='interleaved-1f1b' with recompute"),
    "zero-3 under a zero-bubble pipeline": Case(config(pp=2, zero=3, schedule="zero-bubble"), "ConfigError",
                                                "use zero=2 (gradients and optimizer states sharded, parameters whole)"),
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


def _binary_plan_file():
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        f.write(b"\x80\x04\x95 a pickle, not JSON")
        f.flush()
        return sw.Plan.from_json(f.name)


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
