"""The optimizer's state whole: opt.full_state_dict / load_full_state_dict and merged files.

A one-process AdamW's state (torch's integer-id form) is loaded into a tp2 x dp2 ZeRO-2
layout and read back whole by name: every tensor bit for bit, since loading and gathering
only move elements. Saved there, merged with the optimizer state, and loaded into a pp2 x dp2
ZeRO-1 layout through load_checkpoint(file, pm, opt), it is again the same. A merged file
without its optimizer state is refused on every rank when an optimizer is given.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

import shardwise as sw
from parity import ADAMW, gpt_batches, make_gpt, replica_slice

gpt = functools.partial(make_gpt, 0, n_layer=2)


def one_process_state():
    model = gpt()
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    for batch in gpt_batches(2, 8):
        model(batch).backward()
        opt.step()
        opt.zero_grad()
    names = [n for n, _ in model.named_parameters()]
    return model.state_dict(), opt.state_dict(), names


def _layouts(model_state, torch_state, root: str):
    pm = sw.parallelize(gpt(), sw.ParallelConfig(tp=2, zero=2), plan="gpt")
    opt = sw.build_optimizer(pm, torch.optim.AdamW, **ADAMW)
    pm.load_full_state_dict(model_state)
    opt.load_full_state_dict(torch_state)
    first = opt.full_state_dict()
    sw.save_checkpoint(f"{root}/ckpt", pm, opt)
    if dist.get_rank() == 0:
        sw.merge_checkpoint(f"{root}/ckpt", f"{root}/merged.safetensors", optimizer=True)
        sw.merge_checkpoint(f"{root}/ckpt", f"{root}/bare.safetensors")
    dist.barrier()
    pm2 = sw.parallelize(gpt(), sw.ParallelConfig(pp=2, zero=1, microbatches=2), sample=gpt_batches(1, 4)[0])
    opt2 = sw.build_optimizer(pm2, torch.optim.AdamW, **ADAMW)
    sw.load_checkpoint(f"{root}/merged.safetensors", pm2, opt2)
    second = opt2.full_state_dict()
    index, count = sw.data_parallel_info(pm2)
    pm2.train_step(replica_slice(gpt_batches(3, 8)[2], index, count))
    opt2.step()  # the loaded state is usable: steps count on
    stepped = opt2.full_state_dict()
    return first, second, stepped, _refusal(f"{root}/bare.safetensors", pm2, opt2)


def _refusal(path: str, pm, opt) -> str | None:
    """The CheckpointError loading `path` into `pm` and `opt` raises, if any."""
    try:
        sw.load_checkpoint(path, pm, opt)
    except sw.CheckpointError as exc:
        return str(exc)
    return None


def test_optimizer_state_round_trips_through_layouts_and_merged_files(tmp_path):
    model_state, torch_state, names = one_process_state()
    expected = {names[i]: entry for i, entry in torch_state["state"].items()}
    for first, second, stepped, refused in sw.testing.run_on_ranks(_layouts, 4, model_state, torch_state,
                                                                    str(tmp_path)):
        for got in (first, second):
            assert got["state"].keys() == expected.keys()
            for name, entry in expected.items():
                assert got["state"][name].keys() == entry.keys(), name
                for key, value in entry.items():
                    assert torch.equal(got["state"][name][key], value), (name, key)
            assert [g["params"] for g in got["param_groups"]] == [names]
            assert got["param_groups"][0]["lr"] == ADAMW["lr"]
        assert all(float(e["step"]) == 3 for e in stepped["state"].values())
        assert not all(torch.equal(stepped["state"][n]["exp_avg"], expected[n]["exp_avg"]) for n in expected)
        assert refused is not None and "no optimizer state beside it" in refused, refused


def _mismatched(root: str):
    """An optimizer with other parameter groups than the merged state's: refused, model untouched."""
    pm = sw.parallelize(gpt(), sw.ParallelConfig())
    named = list(pm.named_parameters())
    opt = sw.build_optimizer(pm, torch.optim.AdamW, params=[{"params": [p for _, p in named[:2]]},
                                                            {"params": [p for _, p in named[2:]]}], **ADAMW)
    before = pm.full_state_dict()
    refused = _refusal(f"{root}/merged.safetensors", pm, opt)
    good = opt.full_state_dict()
    try:  # malformed on one rank only: the same error on every rank, not a rank waiting alone
        sizes = [len(g["params"]) for g in good["param_groups"]]
        groups = [{"params": list(range(sum(sizes[:i]), sum(sizes[:i + 1])))} for i in range(len(sizes))]
        opt.load_full_state_dict({"state": {999: {}}, "param_groups": groups} if dist.get_rank() else good)
        malformed = None
    except sw.CheckpointError as exc:
        malformed = str(exc)
    after = pm.full_state_dict()
    return refused, all(torch.equal(v, after[k]) for k, v in before.items()), malformed


def test_a_mismatched_optimizer_changes_nothing(tmp_path):
    model_state, torch_state, _ = one_process_state()
    sw.testing.run_on_ranks(_layouts, 4, model_state, torch_state, str(tmp_path))  # writes merged.safetensors
    for refused, untouched, malformed in sw.testing.run_on_ranks(_mismatched, 2, str(tmp_path)):
        assert refused is not None and "parameter groups" in refused, refused
        assert untouched
        assert malformed is not None and "ids [999]" in malformed and "raised on every rank" in malformed, malformed
