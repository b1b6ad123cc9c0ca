"""Users' state-dict habits on a ParallelModule: `torch.save(pm.state_dict())` and
`pm.load_state_dict(...)` work in every ZeRO stage, or are refused.

Under ZeRO-3 the parameters between steps are views of freed storage; `state_dict()` used to
hand those out (torch.save wrote 6 KB for a 424 KB model and could not read it back). Under
ZeRO 1-2 the optimizer updates float32 masters and writes them back, so a plain nn.Module
load that changed only the parameters was undone by the next step; under ZeRO-3 the float32
shard is the master, refilled by a load and left unrounded by `state_dict()`.
"""

from __future__ import annotations

import io

import torch

import shardwise as sw
from parity import SGD, gpt_batches, make_gpt, replica_slice


def _step(pm, opt, batch):
    index, count = sw.data_parallel_info(pm)
    pm.train_step(replica_slice(batch, index, count))
    opt.step()
    opt.zero_grad()


def _habits(zero: int, tp: int):
    config = sw.ParallelConfig(zero=zero, tp=tp, param_dtype=torch.bfloat16 if zero >= 1 else None)
    plan = "gpt" if tp > 1 else None
    pm = sw.parallelize(make_gpt(0), config, plan=plan)
    opt = sw.build_optimizer(pm, torch.optim.SGD, **SGD)
    batches = gpt_batches(3, 8)
    _step(pm, opt, batches[0])
    whole = {k: v.clone() for k, v in pm.full_state_dict().items()}

    buffer = io.BytesIO()
    torch.save(pm.state_dict(), buffer)  # the habit
    saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    from torch.distributed.tensor import DTensor

    readable = all((v.full_tensor() if isinstance(v, DTensor) else v).equal(whole[k.removeprefix("module.")])
                   for k, v in saved.items())

    # load another model's values through the habit, into this trained model and into a fresh
    # one, then train a step: both must take the same step (masters reloaded, shards refilled;
    # under bf16 both hold the same rounded values)
    source = sw.parallelize(make_gpt(5), config, plan=plan).state_dict()
    other = sw.parallelize(make_gpt(7), config, plan=plan)
    pm.load_state_dict(source)
    other.load_state_dict(source)
    other_opt = sw.build_optimizer(other, torch.optim.SGD, **SGD)
    opt.state.clear()  # momentum: start both from none
    _step(pm, opt, batches[1])
    _step(other, other_opt, batches[1])
    mine, theirs = pm.full_state_dict(), other.full_state_dict()
    return readable, len(buffer.getvalue()), max((mine[k] - theirs[k]).abs().max().item() for k in mine)


LAYOUTS = ((3, 1), (2, 1), (1, 2), (0, 2))  # (zero, tp) on 2 ranks


def _all_layouts():
    return [_habits(zero, tp) for zero, tp in LAYOUTS]


def test_state_dict_and_load_state_dict_in_every_zero_stage():
    """Equal bit for bit: both runs take the same operations on the same values and layout."""
    results = sw.testing.run_on_ranks(_all_layouts, 2)
    for (zero, tp), per_rank in zip(LAYOUTS, zip(*results)):
        for rank, (readable, size, diff) in enumerate(per_rank):
            assert readable, f"zero={zero} tp={tp} rank {rank}: torch.save(pm.state_dict()) did not read back whole"
            assert size > 100_000, f"zero={zero}: torch.save wrote {size} bytes (freed storage?)"
            assert diff == 0.0, f"zero={zero} tp={tp} rank {rank}: load_state_dict then a step differs by {diff}"


def _hook_calls(zero: int) -> list[str]:
    """Step hooks on the optimizer (its own and torch's global ones) over two steps, after a
    plain instance of the same class exists, as it does wherever a user also builds one."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])  # torch now wraps AdamW.step itself too
    pm = sw.parallelize(make_gpt(0), sw.ParallelConfig(zero=zero))
    opt = sw.build_optimizer(pm, torch.optim.AdamW, lr=1e-3)
    calls = []
    opt.register_step_pre_hook(lambda *_: calls.append("pre"))
    opt.register_step_post_hook(lambda *_: calls.append("post"))
    register_optimizer_step_pre_hook(lambda *_: calls.append("global pre"))
    register_optimizer_step_post_hook(lambda *_: calls.append("global post"))
    for batch in gpt_batches(2, 4):
        _step(pm, opt, batch)
    return calls


def test_optimizer_step_hooks_run_once_per_step():
    """torch.optim's step hooks run once per optimizer.step, as on a plain optimizer (they ran
    twice once torch had wrapped the base class's step as well as ours)."""
    once = ["global pre", "pre", "post", "global post"]
    assert sw.testing.run_on_ranks(_hook_calls, 2, 1) == [once * 2] * 2
