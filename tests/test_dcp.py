"""torch.distributed.checkpoint both ways (sw.dcp_state).

A plain GPT trained one AdamW step on 2 ranks is saved with DCP's own tools (`state_dict()`,
`get_optimizer_state_dict`) and loaded into tp2 x ZeRO-2 on 4 ranks through `sw.dcp_state`;
and the reverse: tp2 x ZeRO-2 trained a step is saved through `sw.dcp_state` and loaded into
a plain GPT with `dcp.load` and `set_optimizer_state_dict`. Parameters and Adam's state must
equal the saving side's bit for bit: loading copies values, it computes nothing.
"""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

import shardwise as sw
from parity import ADAMW, gpt_batches, make_gpt

LAYOUT = {"tp": 2, "zero": 2}


def _whole(state: dict) -> dict:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone() for k, v in state.items()}


def _adam_state(state: dict) -> dict:
    return {(name, slot): value.detach().cpu().clone() for name, slots in state["state"].items()
            for slot, value in slots.items()}


def _plain_saves(path: str):
    model = make_gpt(0)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    model(gpt_batches(1, 4)[0]).backward()
    optimizer.step()
    optim_state = get_optimizer_state_dict(model, optimizer)
    dcp.save({"model": model.state_dict(), "optim": optim_state}, checkpoint_id=path)
    return _whole(model.state_dict()), _adam_state(optim_state)


def _shardwise_loads(path: str):
    pm = sw.parallelize(make_gpt(5), sw.ParallelConfig(**LAYOUT), plan="gpt")
    optimizer = sw.build_optimizer(pm, torch.optim.AdamW, **ADAMW)  # no step yet: slots from the checkpoint
    dcp.load(sw.dcp_state(pm, optimizer, checkpoint_id=path), checkpoint_id=path)
    return _whole(pm.full_state_dict()), _adam_state(optimizer.full_state_dict())


def _shardwise_saves(path: str):
    pm = sw.parallelize(make_gpt(0), sw.ParallelConfig(**LAYOUT), plan="gpt")
    optimizer = sw.build_optimizer(pm, torch.optim.AdamW, **ADAMW)
    index, count = sw.data_parallel_info(pm)
    batch = gpt_batches(1, 4)[0]
    pm.train_step(batch[index * 4 // count:(index + 1) * 4 // count])
    optimizer.step()
    dcp.save(sw.dcp_state(pm, optimizer), checkpoint_id=path)
    return _whole(pm.full_state_dict()), _adam_state(optimizer.full_state_dict())


def _plain_loads(path: str):
    model = make_gpt(5)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    state = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    return _whole(model.state_dict()), _adam_state(get_optimizer_state_dict(model, optimizer))


def _assert_equal(got: tuple, want: tuple, where: str) -> None:
    for part, (g, w) in zip(("parameters", "Adam state"), zip(got, want)):
        assert g.keys() == w.keys(), (where, part, sorted(set(g) ^ set(w))[:6])
        for key in w:
            assert torch.equal(g[key], w[key]), f"{where}: {part} {key} differs"


def test_plain_dcp_checkpoint_loads_into_tp2_zero2(tmp_path):
    want = sw.testing.run_on_ranks(_plain_saves, 2, str(tmp_path))[0]
    for rank, got in enumerate(sw.testing.run_on_ranks(_shardwise_loads, 4, str(tmp_path))):
        _assert_equal(got, want, f"rank {rank}")


def test_shardwise_dcp_checkpoint_loads_into_a_plain_module(tmp_path):
    want = sw.testing.run_on_ranks(_shardwise_saves, 4, str(tmp_path))[0]
    for rank, got in enumerate(sw.testing.run_on_ranks(_plain_loads, 2, str(tmp_path))):
        _assert_equal(got, want, f"rank {rank}")
