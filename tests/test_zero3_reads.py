"""Users' reads of ZeRO-3 parameters between steps (parallel/data/released.py).

Between uses a ZeRO-3 parameter keeps its shape but holds no storage, and torch reads such a
tensor unchecked: `weight.sum()`, printing it, an EMA copy or `copy.deepcopy(model)` after a
step killed the process with a segfault. Each must raise a `ModelError` that names the parameter
and `whole_parameters()`; what reads no values (shape, dtype, device, the gradient, sets of
parameters, Hugging Face's `model.device`, `pmodel.to(its own device)`) keeps working, reads
inside `whole_parameters()` see the trained values, and none of it changes the training: the
run with every habit between its steps ends bitwise equal to the run without (the same
arithmetic on the same inputs, so exact equality, no tolerance).
"""

from __future__ import annotations

import copy
import functools
import io

import safetensors.torch
import torch
from torch.distributed.tensor import DTensor

import shardwise as sw
from parity import gpt_batches, make_gpt, replica_slice
from test_zoo import batches as zoo_batches, make as zoo_make

LAYOUTS = {  # name: (model factory, batches, config, plan, the parameter the habits read)
    "gpt zero3 dp4": (functools.partial(make_gpt, 0), gpt_batches(2, 8), {"zero": 3}, None,
                      "layers.0.attn.q_proj.weight"),
    "gpt tp2 x zero3 dp2": (functools.partial(make_gpt, 0), gpt_batches(2, 8), {"zero": 3, "tp": 2}, "gpt",
                            "layers.0.attn.q_proj.weight"),
    "llama zero3 dp4": (functools.partial(zoo_make, "llama"), zoo_batches("llama", 2), {"zero": 3}, None,
                        "lm.model.layers.0.self_attn.q_proj.weight"),
}


def _habits(model: torch.nn.Module, weight: torch.Tensor) -> dict[str, object]:
    """Each reading habit: the error's text when refused, else 'ran'. Those of the whole model
    (copying it, saving its state dict) meet another parameter first; they name that one."""
    ema = torch.zeros(weight.shape, dtype=weight.dtype)
    reads = {
        "sum": lambda: weight.sum(),
        "print": lambda: print(weight),
        "ema copy": lambda: ema.copy_(weight),
        "ema lerp": lambda: ema.lerp_(weight, 0.1),
        "ema foreach lerp": lambda: torch._foreach_lerp_([ema], [weight], 0.1),  # lists of parameters
        "norm": lambda: float(weight.norm()),
        "detach, then read": lambda: weight.detach().sum(),
        ".data, then read": lambda: weight.data.clone(),
        "model: deepcopy": lambda: copy.deepcopy(model),
        "model: torch.save(model.state_dict())": lambda: torch.save(model.state_dict(), io.BytesIO()),
        "model: .double()": model.double,  # refused at its first parameter, before any changed
    }
    if isinstance(weight, DTensor):
        reads.update(full_tensor=weight.full_tensor, to_local=weight.to_local)
    # safetensors reads through data_ptr(): a released view's points at nothing (or at address 0,
    # which it writes as no bytes); transformers' save_pretrained has a refusal of its own
    reads["model: safetensors.torch.save(model.state_dict())"] = lambda: safetensors.torch.save(model.state_dict())
    out: dict[str, object] = {}
    for habit, read in reads.items():
        try:
            read()
            out[habit] = "ran"
        except sw.ModelError as error:
            out[habit] = str(error)
    return out


def _metadata(pm: sw.ParallelModule, model: torch.nn.Module, weight: torch.Tensor) -> tuple:
    """What reads no values, as one process would see it."""
    lm = getattr(model, "lm", None)
    return (tuple(weight.shape), weight.dtype, weight.device.type, weight.requires_grad, weight.grad is None,
            len(set(model.parameters())), sum(p.numel() for p in model.parameters()) > 0,
            pm.to(weight.device) is pm, model.to(weight.device) is model,
            None if lm is None else (lm.device.type, lm.dtype, lm.num_parameters() > 0))


def _train(pm, opt, batch) -> None:
    index, count = sw.data_parallel_info(pm)
    pm.train_step(replica_slice(batch, index, count))
    opt.step()
    opt.zero_grad()


def _layout(factory, batches, config, plan, name):
    runs = []
    for probed in (True, False):
        model = factory()
        pm = sw.parallelize(model, sw.ParallelConfig(**config), plan=plan)
        opt = sw.build_optimizer(pm, torch.optim.AdamW, lr=1e-3)
        _train(pm, opt, batches[0])
        found = {}
        if probed:
            weight = dict(model.named_parameters())[name]
            found["habits"] = _habits(model, weight)
            found["metadata"] = _metadata(pm, model, weight)
            with pm.whole_parameters():  # the way to read: every value, as trained
                local = weight.full_tensor() if isinstance(weight, DTensor) else weight
                found["inside"] = local.detach().clone()
            found["whole"] = pm.full_state_dict()[name]
        _train(pm, opt, batches[1])
        runs.append((found, pm.full_state_dict()))
    (found, probed_end), (_, plain_end) = runs
    found["unchanged"] = all(torch.equal(probed_end[k], plain_end[k]) for k in plain_end)
    return found


def _all_layouts(_):
    return {layout: _layout(*args) for layout, args in LAYOUTS.items()}


def test_reads_between_steps_are_refused_and_the_rest_works():
    for rank, result in enumerate(sw.testing.run_on_ranks(_all_layouts, 4, None)):
        for layout, found in result.items():
            where = f"{layout} rank {rank}"
            name = LAYOUTS[layout][4]
            for habit, outcome in found["habits"].items():
                assert outcome != "ran", f"{where}: {habit} read a released parameter and was let through"
                named = "between ZeRO-3's uses of it" if habit.startswith("model: ") else f"read {name} between"
                assert named in outcome and "whole_parameters()" in outcome, (where, habit, outcome)
            shape, dtype, device, requires_grad, no_grad, count, has_numel, pm_same, model_same, hf = found["metadata"]
            assert (dtype, requires_grad, no_grad, has_numel, pm_same, model_same) == \
                (torch.float32, True, True, True, True, True), (where, found["metadata"])
            assert shape == tuple(found["whole"].shape) and count > 1, (where, shape)
            assert hf is None or (hf[1], hf[2]) == (torch.float32, True), (where, hf)
            assert torch.equal(found["inside"], found["whole"]), f"{where}: whole_parameters() read other values"
            assert found["unchanged"], f"{where}: the habits between steps changed the training"
