"""Users' state-dict and optimizer habits on a ParallelModule: `torch.save(pm.state_dict())`,
`pm.load_state_dict(...)`, `copy.deepcopy(pm)` and a plain torch optimizer work in every ZeRO
stage, or are refused.

Under ZeRO-3 the parameters between steps are views of freed storage; `state_dict()` used to
hand those out (torch.save wrote 6 KB for a 424 KB model and could not read it back). Under
ZeRO 1-2 the optimizer updates float32 masters and writes them back, so a plain nn.Module
load that changed only the parameters was undone by the next step; under ZeRO-3 the float32
shard is the master, refilled by a load and left unrounded by `state_dict()`.
"""

from __future__ import annotations

import io
import re

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
    return readable, len(buffer.getvalue()), max((mine[k] - theirs[k]).abs().max().item() for k in mine), \
        _copies(pm)


def _copies(pm) -> tuple[list[str], bool]:
    """copy.deepcopy(pm) (an EMA's habit), copy.copy, pickle and torch.save(pm): each refused
    naming full_state_dict (it raised pickle's TypeError about a ProcessGroup); the way it
    names gives a plain copy holding the trained values."""
    import copy
    import pickle

    refusals = []
    for attempt in (copy.deepcopy, copy.copy, pickle.dumps, lambda m: torch.save(m, io.BytesIO())):
        try:
            attempt(pm)
            refusals.append("copied")
        except sw.ModelError as error:
            refusals.append(str(error))
    ema = copy.deepcopy(make_gpt(0))
    ema.load_state_dict(pm.full_state_dict())
    trained = pm.full_state_dict()
    return refusals, all(v.equal(trained[k]) for k, v in ema.state_dict().items())


LAYOUTS = ((3, 1), (2, 1), (1, 2), (0, 2))  # (zero, tp) on 2 ranks


def _all_layouts():
    return [_habits(zero, tp) for zero, tp in LAYOUTS]


def test_state_dict_and_load_state_dict_in_every_zero_stage():
    """Equal bit for bit: both runs take the same operations on the same values and layout."""
    results = sw.testing.run_on_ranks(_all_layouts, 2)
    for (zero, tp), per_rank in zip(LAYOUTS, zip(*results)):
        for rank, (readable, size, diff, (refusals, ema_equal)) in enumerate(per_rank):
            assert all("full_state_dict" in r for r in refusals), f"zero={zero} tp={tp} rank {rank}: {refusals}"
            assert ema_equal, f"zero={zero} tp={tp} rank {rank}: a copy loaded from full_state_dict() differs"
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


NAMES = {name for name, _ in make_gpt(0).named_parameters()}
# (label, config, whether a plain torch optimizer can see the gradients) on 2 ranks
PLAIN_OPTIMIZER_LAYOUTS = (
    ("float32, zero=0", dict(), True),
    ("bfloat16 reduced in bfloat16", dict(param_dtype=torch.bfloat16), True),
    ("bfloat16 reduced in float32", dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32), False),
    ("zero=1", dict(zero=1), False),
    ("zero=3, bfloat16", dict(zero=3, param_dtype=torch.bfloat16), False),
)


def _plain_optimizer_step(config: dict, plain: bool):
    """One train_step then one optimizer step, by a plain torch SGD or one sw.build_optimizer
    built; returns what happened, the warnings train_step gave and the full state after it."""
    import warnings

    pm = sw.parallelize(make_gpt(0), sw.ParallelConfig(**config))
    opt = torch.optim.SGD(pm.parameters(), lr=0.1) if plain else sw.build_optimizer(pm, torch.optim.SGD, lr=0.1)
    index, count = sw.data_parallel_info(pm)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm.train_step(replica_slice(gpt_batches(1, 8)[0], index, count))
    try:
        opt.step()
        outcome = "stepped"
    except sw.ConfigError as error:
        outcome = str(error)
    return outcome, [str(w.message) for w in caught if "build_optimizer" in str(w.message)], pm.full_state_dict()


def _plain_optimizers():
    import gc

    from torch.optim.optimizer import _global_optimizer_pre_hooks

    hooks = len(_global_optimizer_pre_hooks)
    before = make_gpt(0).state_dict()
    results = []
    for _, config, _ in PLAIN_OPTIMIZER_LAYOUTS:
        plain, plain_warned, plain_after = _plain_optimizer_step(config, plain=True)
        built, _, built_after = _plain_optimizer_step(config, plain=False)
        changed = lambda after: sorted(k for k in after if not after[k].float().equal(before[k]))  # noqa: E731
        diff = max((plain_after[k].float() - built_after[k].float()).abs().max().item() for k in built_after)
        results.append((plain, plain_warned, built, changed(plain_after), changed(built_after), diff))
    gc.collect()  # their hooks retire to no-ops (shardwise/global_hooks.py), which the next parallelize deletes
    live = sum(getattr(h, "__name__", "") != "_retired" for h in _global_optimizer_pre_hooks.values()) - hooks
    kept = sw.parallelize(make_gpt(0), sw.ParallelConfig(zero=1))  # a ZeRO model: one hook of its own
    return results, (live, len(_global_optimizer_pre_hooks) - hooks - 1, kept is not None)


def test_a_plain_torch_optimizer_steps_what_it_can_see_or_is_refused():
    """A torch optimizer built without sw.build_optimizer reads `.grad`. Under ZeRO, or with
    bfloat16 parameters reduced in float32, the gradients live elsewhere and it used to update
    nothing without a word; it is now refused at its step, naming the fix, on every rank (and
    train_step warns first). Where it can see them it takes the step sw's SGD takes: the same
    parameters change, bit for bit in float32 (both apply the same SGD update to the same reduced
    gradient and weights). No refusal hook outlives its ParallelModule (retired, then deleted by the
    next parallelize)."""
    per_rank = sw.testing.run_on_ranks(_plain_optimizers, 2)
    for rank, (results, (live, swept_left, _)) in enumerate(per_rank):
        assert live == 0, f"rank {rank}: {live} optimizer step hooks outlived their ParallelModule"
        assert swept_left == 0, f"rank {rank}: {swept_left} retired optimizer step hooks were not deleted"
        for (label, _, visible), (plain, warned, built, plain_changed, built_changed, diff) in \
                zip(PLAIN_OPTIMIZER_LAYOUTS, results):
            assert built == "stepped", f"{label}, rank {rank}: sw.build_optimizer's SGD failed: {built}"
            assert len(built_changed) > 20, f"{label}, rank {rank}: sw's SGD changed only {built_changed}"
            if visible:
                assert plain == "stepped", f"{label}, rank {rank}: plain SGD refused: {plain}"
                assert not warned, f"{label}, rank {rank}: train_step warned: {warned}"
                assert plain_changed == built_changed, f"{label}, rank {rank}: {plain_changed} != {built_changed}"
                if label.startswith("float32"):
                    assert diff == 0.0, f"{label}, rank {rank}: plain SGD differs from sw's by {diff}"
            else:
                assert "sw.build_optimizer(pmodel, torch.optim.SGD" in plain, f"{label}, rank {rank}: {plain}"
                named = re.search(r"e\.g\. '([^']+)'", plain)
                assert named and named[1] in NAMES, f"{label}: the refusal names no parameter of the model: {plain}"
                assert len(warned) == 1, f"{label}, rank {rank}: train_step's warnings {warned}"


def _resume(config: dict, files: str, plan=None) -> dict[str, str]:
    """Train 2 steps, save the optimizer's state_dict() (rank 0's file for every rank, or each
    rank's own) with full_state_dict(), train 2 more; then resume a fresh model from the files
    and train the same 2: "exact" when it ends bit for bit where the first did, or the refusal."""
    import torch.distributed as dist

    batches = gpt_batches(4, 8)
    pm = sw.parallelize(make_gpt(0), sw.ParallelConfig(**config), plan=plan)
    opt = sw.build_optimizer(pm, torch.optim.AdamW, lr=1e-2)
    for batch in batches[:2]:
        _step(pm, opt, batch)
    saved = {"model": pm.full_state_dict(), "optim": io.BytesIO()}
    torch.save(opt.state_dict(), saved["optim"])
    mine = saved["optim"].getvalue()
    shared = [mine]
    dist.broadcast_object_list(shared, src=0)  # rank 0's file, read by every rank
    for batch in batches[2:]:
        _step(pm, opt, batch)
    want = pm.full_state_dict()
    pm = sw.parallelize(make_gpt(0), sw.ParallelConfig(**config), plan=plan)
    opt = sw.build_optimizer(pm, torch.optim.AdamW, lr=1e-2)
    pm.load_full_state_dict(saved["model"])
    try:
        opt.load_state_dict(torch.load(io.BytesIO(shared[0] if files == "rank 0's" else mine)))
    except sw.CheckpointError as exc:
        return f"refused: {exc}"
    for batch in batches[2:]:
        _step(pm, opt, batch)
    got = pm.full_state_dict()
    return "exact" if all(torch.equal(got[k], want[k]) for k in want) else "differs"


def _resumes():
    return {f"{name}, {files} file": _resume(config, files, "gpt" if config.get("tp") else None)
            for name, config in (("dp2", {}), ("zero1", {"zero": 1}), ("tp2", {"tp": 2}))
            for files in ("rank 0's", "its own")}


def test_resuming_the_optimizer_from_rank_zeros_file_or_each_ranks_own():
    """optimizer.state_dict() holds this rank's part of the state. Rank 0's file loaded on every
    rank, DDP's habit, is right where every rank holds every parameter whole (dp2) and was
    silently wrong at tp2 (rank 1 took rank 0's moments for the other half of each sharded
    weight: 0.033 off after two steps) and a torch ValueError on one rank under ZeRO-1: both are
    now a CheckpointError on every rank. Each rank's own file resumes exactly everywhere."""
    for results in sw.testing.run_on_ranks(_resumes, 2):
        for name in ("dp2, rank 0's file", "dp2, its own file", "zero1, its own file", "tp2, its own file"):
            assert results[name] == "exact", (name, results[name])
        for name in ("zero1, rank 0's file", "tp2, rank 0's file"):
            assert results[name].startswith("refused: optimizer.load_state_dict: the state holds ") \
                and "this rank holds" in results[name], (name, results[name])
