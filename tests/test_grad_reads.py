"""Users' gradient habits where shardwise keeps the reduced gradient apart from `.grad`
(parallel/data/held_apart.py): ZeRO-2/3's shards, float32 buckets of bfloat16 parameters
(reduce_dtype=float32; with bfloat16 reduction the gradients live in `.grad`, and torch's
clip sees them).

There `.grad` was None, so torch's `clip_grad_norm_(model.parameters(), 1.0)` (HF Trainer's,
every hand-written loop's) returned 0 and clipped nothing, without a word. Now `.grad` is a
stand-in: shape, dtype and device of the gradient, no storage, and every use a `ModelError`
that names the parameter and `clip_grad_norm`; `optimizer.clip_grad_norm` and
`pmodel.full_grad_dict()` see the gradients whole. Where gradients live in `.grad` (plain data
parallel in float32) torch's clip works and agrees with the optimizer's. None of it changes
the training: the run with the habits ends bitwise equal to the run without (the same
arithmetic on the same inputs: exact equality, no tolerance).
"""

from __future__ import annotations

import functools

import torch

import shardwise as sw
from parity import gpt_batches, make_gpt, replica_slice
from test_zoo import batches as zoo_batches, make as zoo_make

LAYOUTS = {  # name: (model factory, batches, config, plan, the parameter read, gradient apart)
    "gpt zero1 dp4": (functools.partial(make_gpt, 0), gpt_batches(2, 8), {"zero": 1}, None,
                      "layers.0.attn.q_proj.weight", True),
    "gpt zero2 dp4": (functools.partial(make_gpt, 0), gpt_batches(2, 8), {"zero": 2}, None,
                      "layers.0.attn.q_proj.weight", True),
    "gpt bf16, float32 reduce, dp4": (functools.partial(make_gpt, 0), gpt_batches(2, 8),
                                      {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}, None,
                                      "layers.0.attn.q_proj.weight", True),
    "gpt tp2 x zero2 dp2": (functools.partial(make_gpt, 0), gpt_batches(2, 8), {"zero": 2, "tp": 2}, "gpt",
                            "layers.0.attn.q_proj.weight", True),
    "llama zero3 dp4": (functools.partial(zoo_make, "llama"), zoo_batches("llama", 2), {"zero": 3}, None,
                        "lm.model.layers.0.self_attn.q_proj.weight", True),
    "gpt dp4 (gradients in .grad)": (functools.partial(make_gpt, 0), gpt_batches(2, 8), {}, None,
                                     "layers.0.attn.q_proj.weight", False),
}


def _attempt(call) -> object:
    try:
        return ("ran", call())
    except sw.ModelError as error:
        return ("refused", str(error))


def _habits(pm, opt, model, weight, apart: bool) -> dict[str, object]:
    grad = weight.grad
    if grad is None:  # read as no gradient at all: what torch's clip then clipped by
        return {"present": (False,)}
    found = {
        "present": (grad is not None, tuple(grad.shape) == tuple(weight.shape), grad.dtype == weight.dtype),
        "torch clip": _attempt(lambda: float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))),
        # foreach=True: torch's default on CUDA, one op over lists of gradients
        "torch clip, foreach": _attempt(lambda: float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9,
                                                                                      foreach=True))),
        "norm": _attempt(lambda: float(grad.norm())),
        "optimizer clip": float(opt.clip_grad_norm(1e9)),  # max_norm far above: measures, changes nothing
        "whole": set(pm.full_grad_dict()) >= {n for n, p in model.named_parameters() if p.grad is not None},
    }
    if apart:  # where .grad holds the gradients this zeroes them, as on one process
        found["model.zero_grad(set_to_none=False)"] = _attempt(lambda: model.zero_grad(set_to_none=False))
    return found


def _train(pm, batch) -> None:
    index, count = sw.data_parallel_info(pm)
    pm.train_step(replica_slice(batch, index, count))


def _layout(factory, batches, config, plan, name, apart):
    runs, found = [], {}
    for probed in (True, False):
        model = factory()
        pm = sw.parallelize(model, sw.ParallelConfig(**config), plan=plan)
        opt = sw.build_optimizer(pm, torch.optim.AdamW, lr=1e-3)
        for step, batch in enumerate(batches):
            _train(pm, batch)
            if probed and step == 0:
                found = _habits(pm, opt, model, dict(model.named_parameters())[name], apart)
            opt.step()
            opt.zero_grad()
            if probed and step == 0:
                found["cleared"] = dict(model.named_parameters())[name].grad is None
        runs.append(pm.full_state_dict())
    found["unchanged"] = all(torch.equal(runs[0][k], runs[1][k]) for k in runs[1])
    # a backward over a synchronized one without zero_grad: the refusal for that, not the stand-in's
    _train(pm, batches[0])
    try:
        _train(pm, batches[1])
        found["accumulated"] = "ran"
    except sw.ShardwiseError as error:
        found["accumulated"] = str(error)
    return found


def _all_layouts(_):
    return {layout: _layout(*args) for layout, args in LAYOUTS.items()}


def test_gradients_kept_apart_refuse_torch_habits_and_the_optimizer_sees_them():
    for rank, result in enumerate(sw.testing.run_on_ranks(_all_layouts, 4, None)):
        for layout, found in result.items():
            where = f"{layout} rank {rank}"
            name, apart = LAYOUTS[layout][4], LAYOUTS[layout][5]
            assert found["present"] == (True, True, True), (where, found["present"])
            assert found["optimizer clip"] > 0 and found["whole"] and found["cleared"], (where, found)
            assert found["unchanged"], f"{where}: the habits changed the training"
            if apart:
                for habit in ("torch clip", "torch clip, foreach", "norm", "model.zero_grad(set_to_none=False)"):
                    outcome, text = found[habit]
                    assert outcome == "refused", f"{where}: {habit} ran on a stand-in gradient: {text}"
                    # the parameter read, or (torch's clip, the module's zero_grad) the first one met
                    named = f".grad of {name}," if habit == "norm" else ".grad of "
                    assert named in text and "clip_grad_norm" in text, (where, habit, text)
                assert "without zero_grad" in found["accumulated"], (where, found["accumulated"])
            else:  # torch's clip sees the whole gradients, as the optimizer's does: float32 sums of the same terms
                outcome, norm = found["torch clip"]
                assert outcome == "ran", (where, norm)
                # the same gradients, summed in another order: |Δ| ≤ n·u·‖g‖ with n the element count
                # (≤ 2^20 here) and u = 2^-24, so a relative 2^-4 bound is loose and a partial norm fails it
                assert abs(norm - found["optimizer clip"]) <= found["optimizer clip"] * 2 ** -4, (where, norm, found)
