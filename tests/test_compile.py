"""torch.compile on a parallelized model: `pmodel.compile()` compiles each block in place,
`fullgraph=True` (so any graph break inside a block is an error).

Dynamo's eager backend traces exactly as inductor does (graphs, breaks, guards) without the
C++ build, so the suite stays fast. Three SGD steps must match one eager process as every
parity test does (tests/parity.py: losses, the first step's whole gradients, the parameters
after the last step, within bounds derived there: the same arithmetic, reordered only by the
layout's collectives), and Dynamo must have built graphs with no graph break inside a block (under pp, blocks compiled inside their stage): tensor
parallelism's per-forward caches are traceable dicts keyed by the tensors themselves,
sequence parallelism's saved-shard hooks stay out of compiled code, and ZeRO-3's gather
hooks run outside the graph, as FSDP2's do.

On torch before 2.13 compiled code loses the gradients of DTensor parameters (every block
gradient zero at tp=2 on 2.11), so there a compiled tensor-parallel block is refused, and
that refusal is what the test checks. Before 2.14 Dynamo crashes on a DTensor parameter whose
shard lives in ZeRO's flat buffer (compat.COMPILES_DTENSOR_VIEWS): tp with ZeRO compiled is
refused there and trains (with the same parity) from 2.14.

The blocks share one compiled graph: the plan reaches compiled code as one interned layout
object per distinct layout, never as a module path Dynamo would specialize each block on
(ten blocks, past Dynamo's recompile limit of 8, which the test makes an error instead of a
quiet fall back to eager).

On 4 ranks, Hugging Face Llama compiles in the compositions bench/llama.py --compile times
(tp2 + sp x dp2, ZeRO-3 over dp4, pp2 x dp2) with the same checks.

A Hugging Face decoder layer under tp + sequence parallelism calls its attention with keyword
arguments, which the plan's input conversions find by the forward's signature, read once (binding
it with `inspect` at every call broke the graph).

Under context parallelism the blocks' attention is routed (a torch function mode) to the
whole-sequence attention, whose backward Dynamo traces too (no `autograd.grad` inside it), and
its traffic counter is a tensor (a Python counter would be guarded on and compile every block
anew).

torchao's Float8Linear under tp + sequence parallelism (the float8 rules), and ZeRO-3 gathering
float8 weights, compile the same way, and match the same layout run uncompiled within the same
bounds. Not one float8 process: through ten blocks a layout's reordered sums flip float8 roundings
that cascade (each flip moves what the next cast sees), so at ten blocks tp2 + sp sits 0.58 of
float8's own error from one float8 process whether compiled or not, and its losses anywhere from
0.35 to 1.6 of float8's own loss deviation, by CPU (AVX-512 and AVX2 kernels). tests/test_float8.py
holds the layouts to one float8 process on two blocks, where the derivation there applies.

Faults this catches: the first forward's plan check (a dispatch mode) seen by Dynamo, which
then skipped the blocks for good (no graph: issue 30); a storage-keyed lookup or a
saved-tensor hook inside a block (graph breaks).
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torchao.float8 import Float8LinearConfig

import shardwise as sw
from shardwise.compat import COMPILES_DTENSOR_PARAMETERS, COMPILES_DTENSOR_VIEWS
from parity import Run, assert_meaningful, assert_parity, gpt_batches, make_gpt, reference_run, train_parallel
from test_context_parallel import cp_batches
from test_float8 import llama, llama_batches, to_float8

BLOCKS = 10  # more than Dynamo's recompile limit (8): blocks specialized by their path would fall back to eager
LAYOUTS = {
    "tp2": ({"tp": 2}, "gpt"),
    "tp2 sp recompute": ({"tp": 2, "sequence_parallel": True, "recompute": "full"}, "gpt"),
    "tp2 selective-alternate": ({"tp": 2, "recompute": "selective-alternate"}, "gpt"),  # a policy counting matmuls
    "zero3 dp2": ({"zero": 3}, None),
    "pp2": ({"pp": 2, "microbatches": 2}, None),  # rank 0's stage: layers.0 compiled inside it
    "tp2 sp float8": ({"tp": 2, "sequence_parallel": True}, "gpt"),  # torchao's Float8Linear, float8 rules
    "cp2": ({"cp": 2}, None),  # attention over the whole sequence, traced through cp's routing mode
    "zero3 dp2 float8 all-gather": ({"zero": 3}, None),  # weights gathered as float8 into torchao's matmul
}
LAYOUTS_4 = {  # on 4 ranks: Hugging Face Llama in the compositions bench/llama.py --compile times; tp with ZeRO
    "llama tp2 sp x dp2": ({"tp": 2, "sequence_parallel": True}, "llama"),  # input conversions on kwargs (HF attention)
    "llama zero3 dp4": ({"zero": 3}, None),
    "llama pp2 x dp2": ({"pp": 2, "microbatches": 2}, None),
    "tp2 x dp2 zero1": ({"tp": 2, "zero": 1}, "gpt"),  # tp shards inside ZeRO's flat buffers (torch >= 2.14)
    "tp2 sp x dp2 zero3": ({"tp": 2, "sequence_parallel": True, "zero": 3}, "gpt"),
}


def batches(name: str) -> list:
    return cp_batches(3) if "cp" in name else llama_batches(3) if "llama" in name else gpt_batches(3, 8)


def model(name: str, float8: bool | None = None) -> torch.nn.Module:
    if "llama" in name:
        return llama(float8=False, layers=BLOCKS)
    gpt = make_gpt(0, n_layer=BLOCKS)
    gathered = Float8LinearConfig(emulate=True, enable_fsdp_float8_all_gather="all-gather" in name)
    return to_float8(gpt, gathered) if (float8 if float8 is not None else "float8" in name) else gpt


def _compiled_runs(layouts: dict) -> dict[str, tuple[Run, int, dict] | str]:
    """Per layout: the run (tests/parity.py), graphs built, graph breaks (reason -> count); or
    the ConfigError's message where compiling is refused."""
    from torch._dynamo.utils import counters

    torch._dynamo.config.fail_on_recompile_limit_hit = True  # blocks compiled once each would raise, not run eager
    found = {}
    for name, (config, plan) in layouts.items():
        torch._dynamo.reset()
        counters.clear()
        try:  # every block, fullgraph=True: a graph break inside one is an error
            run = train_parallel(config, functools.partial(model, name), batches(name), plan,
                                 compile_kwargs={"backend": "eager"})
        except sw.ConfigError as exc:  # refused where torch cannot (below)
            found[name] = str(exc)
            continue
        found[name] = (run, counters["stats"]["unique_graphs"], {k.splitlines()[0]: v for k, v in
                                                                  counters["graph_break"].items()})
        if "float8" in name:  # the reference: the same layout, uncompiled (the module docstring)
            found[f"{name} uncompiled"] = train_parallel(config, functools.partial(model, name), batches(name), plan,
                                                         every_step=True)
    return found


@pytest.fixture(scope="module")
def compiled():
    found = sw.testing.run_on_ranks(_compiled_runs, 2, LAYOUTS)[0]
    return {**found, **sw.testing.run_on_ranks(_compiled_runs, 4, LAYOUTS_4)[0]}


@pytest.mark.parametrize("name", list(LAYOUTS) + list(LAYOUTS_4))
def test_compiled_blocks_build_graphs_without_breaks_and_match_eager(compiled, name):
    config = {**LAYOUTS, **LAYOUTS_4}[name][0]
    if not COMPILES_DTENSOR_PARAMETERS and "tp" in config:
        assert "loses the gradients of tensor-parallel parameters" in compiled[name], compiled[name]
        return
    if not COMPILES_DTENSOR_VIEWS and "tp" in config and config.get("zero"):
        assert "compiled under tensor parallelism with ZeRO" in compiled[name], compiled[name]
        return
    run, graphs, breaks = compiled[name]
    assert graphs > 0, f"{name}: no graph was built, the compiled blocks ran eager"
    assert not breaks, f"{name}: graph breaks inside compiled blocks: {breaks}"
    if "float8" in name:
        eager = compiled[f"{name} uncompiled"]
        assert_meaningful(eager)
    else:
        eager = reference_run(functools.partial(model, name), batches(name))
    assert_parity(eager, run)



def _tp_with_zero_compiled() -> list[str]:
    """pmodel.compile() refuses at once; blocks compiled by hand are refused at the next forward."""
    pm = sw.parallelize(make_gpt(0), sw.ParallelConfig(tp=2, zero=1), plan="gpt")
    messages = []
    try:
        pm.compile(backend="eager")
        messages.append("compiled")
    except sw.ConfigError as exc:
        messages.append(str(exc))
    for block in pm.module.layers:
        block.compile(backend="eager")
    try:
        pm.train_step(gpt_batches(1, 8)[0][:4])
        messages.append("trained")
    except sw.ConfigError as exc:
        messages.append(str(exc))
    return messages


def test_compiled_tp_blocks_with_zero_buffers_are_refused_before_torch_2_14():
    """A tp shard inside ZeRO's flat parameter buffer (a storage offset) crashes Dynamo before
    torch 2.14 (InternalTorchDynamoError): refused by name on every rank, whether pmodel.compile()
    or the user compiled the blocks. From 2.14 both train (parity: the layouts above)."""
    for messages in sw.testing.run_on_ranks(_tp_with_zero_compiled, 4):
        if COMPILES_DTENSOR_VIEWS:
            assert messages == ["compiled", "trained"], messages
            continue
        for message in messages:
            assert "compiled under tensor parallelism with ZeRO" in message or (
                not COMPILES_DTENSOR_PARAMETERS and "loses the gradients" in message), message


def test_a_hugging_face_kv_cache_that_would_send_layers_eager_is_named():
    """use_cache=True hands every layer one cache object; Dynamo compiles each layer anew and
    past its recompile limit runs the rest eager, which torch only logs: pmodel.compile warns."""
    from shardwise.compiling import compile_blocks

    lm = llama(float8=False, layers=BLOCKS).lm
    lm.config.use_cache = True
    with pytest.warns(UserWarning, match="use_cache=True"):
        compile_blocks(lm, None, [], backend="eager")
    lm.config.use_cache = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compile_blocks(lm, None, [], backend="eager")
