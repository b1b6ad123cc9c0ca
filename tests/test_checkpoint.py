"""Checkpoints: reshard on load, bit-for-bit resume, atomic saves, merge, bad checkpoints."""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from parity import ADAMW, adamw_bounds, gpt_batches, make_gpt, reference_run, replica_slice
from safetensors.torch import load_file

BATCHES = gpt_batches(5, 8)


def _train(pm, opt, batches):
    index, count = sw.data_parallel_info(pm)
    losses = []
    for batch in batches:
        losses.append(float(pm.train_step(replica_slice(batch, index, count))))
        opt.step()
        opt.zero_grad()
    return losses


def _parallel(config: dict, plan=None, seed: int = 0, dropout: float = 0.0):
    pm = sw.parallelize(make_gpt(seed, n_layer=4, dropout=dropout), sw.ParallelConfig(**config), plan=plan,
                        sample=BATCHES[0][:4])
    return pm, sw.build_optimizer(pm, torch.optim.AdamW, **ADAMW)


def _save(path, config, plan):
    pm, opt = _parallel(config, plan)
    _train(pm, opt, BATCHES[:2])
    sw.save_checkpoint(path, pm, opt, extra={"epoch": 3})
    memory = pm.memory()  # the report counts DTensor optimizer state: AdamW's two buffers (+ step counters)
    tensors = len(list(pm.parameters()))
    assert 2 * memory["parameters"] <= memory["optimizer"] <= 2 * memory["parameters"] + 8 * tensors, memory
    assert f"optimizer {memory['optimizer'] / 2**20:.2f} MiB" in pm.summary()
    return {k: v.clone() for k, v in pm.full_state_dict().items()}


def _load_and_resave(src, dst, config, plan):
    pm, opt = _parallel(config, plan, seed=7)  # different values: only the checkpoint can make them equal
    extra = sw.load_checkpoint(src, pm, opt)
    sw.save_checkpoint(dst, pm, opt)
    return {k: v.clone() for k, v in pm.full_state_dict().items()}, extra, pm.steps


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "run"
    state = sw.testing.run_on_ranks(_save, 4, str(path), {"tp": 2}, "gpt")[0]  # dp=2 x tp=2
    sw.merge_checkpoint(path, path.with_suffix(".safetensors"), optimizer=True)
    return path, state


@pytest.mark.parametrize("world, config, plan", [
    (4, {"tp": 4}, "gpt"),
    (4, {"pp": 2, "microbatches": 2}, None),
    (4, {"zero": 3}, None),
    (4, {"cp": 2, "tp": 2}, "gpt"),
    (4, {"cp": 2, "dp": 2, "zero": 3}, None),  # ZeRO shards over the dp x cp ranks
    (1, {}, None),
])
def test_load_into_another_layout(saved, tmp_path, world, config, plan):
    path, want = saved
    results = sw.testing.run_on_ranks(_load_and_resave, world, str(path), str(tmp_path / "again"), config, plan)
    for state, extra, steps in results:
        assert all(torch.equal(state[k], want[k]) for k in want) and extra == {"epoch": 3} and steps == 2
    # parameters and Adam state, compared whole: re-save in the new layout and merge both
    sw.merge_checkpoint(tmp_path / "again", tmp_path / "again.pt", optimizer=True)
    first = torch.load(path.with_suffix(".safetensors.optimizer.pt"))
    again = torch.load(tmp_path / "again.pt.optimizer.pt")
    assert first["state"].keys() == again["state"].keys() and len(first["state"]) == len(want) - 1  # tied once
    for index, entry in first["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, again["state"][index][key]), (index, key)
    assert first["param_groups"] == again["param_groups"]


def test_merged_file_loads_into_the_original_module(saved):
    path, want = saved
    merged = load_file(str(path.with_suffix(".safetensors")))
    module = make_gpt(3, n_layer=4)
    module.load_state_dict(merged, strict=True)
    got = module.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_start_from_a_plain_state_dict(saved):
    path, want = saved
    results = sw.testing.run_on_ranks(_from_file, 4, str(path.with_suffix(".safetensors")))
    for state in results:
        assert all(torch.equal(state[k], want[k]) for k in want)


def _from_file(file):
    pm, _ = _parallel({"tp": 2, "zero": 1}, "gpt", seed=9)
    sw.load_checkpoint(file, pm)
    return {k: v.clone() for k, v in pm.full_state_dict().items()}


# -- resume bit for bit --------------------------------------------------------------------
def _uninterrupted(config, plan):
    pm, opt = _parallel(config, plan, dropout=0.1)
    losses = _train(pm, opt, BATCHES)
    return losses[2:], {k: v.clone() for k, v in pm.full_state_dict().items()}


def _first_part(path, config, plan):
    pm, opt = _parallel(config, plan, dropout=0.1)
    _train(pm, opt, BATCHES[:2])
    sw.save_checkpoint(path, pm, opt)
    return "saved"  # the processes end here: the run is killed


def _resumed(path, config, plan):
    pm, opt = _parallel(config, plan, seed=5, dropout=0.1)
    sw.load_checkpoint(path, pm, opt)
    losses = _train(pm, opt, BATCHES[2:])
    return losses, {k: v.clone() for k, v in pm.full_state_dict().items()}


@pytest.mark.parametrize("config, plan", [({"tp": 2, "zero": 1}, "gpt"), ({"zero": 3}, None)])
def test_resume_continues_bit_for_bit(tmp_path, config, plan):
    want_losses, want_state = sw.testing.run_on_ranks(_uninterrupted, 4, config, plan)[0]
    sw.testing.run_on_ranks(_first_part, 4, str(tmp_path / "c"), config, plan)
    losses, state = sw.testing.run_on_ranks(_resumed, 4, str(tmp_path / "c"), config, plan)[0]
    assert losses == want_losses  # dropout masks too: random states are restored
    assert all(torch.equal(state[k], want_state[k]) for k in want_state)


def _masters_between_layouts(root: str):
    mixed = {"param_dtype": torch.bfloat16}
    pm, opt = _parallel({"zero": 3, **mixed})
    _train(pm, opt, BATCHES[:2])
    sw.save_checkpoint(f"{root}/zero3", pm, opt)
    other, other_opt = _parallel({"zero": 1, **mixed}, seed=7)
    sw.load_checkpoint(f"{root}/zero3", other, other_opt)
    sw.save_checkpoint(f"{root}/zero1", other, other_opt)
    back, back_opt = _parallel({"zero": 3, **mixed}, seed=9)
    sw.load_checkpoint(f"{root}/zero1", back, back_opt)
    sw.save_checkpoint(f"{root}/zero3-again", back, back_opt)
    return _train(pm, opt, BATCHES[2:4]), _train(back, back_opt, BATCHES[2:4])


def test_float32_masters_cross_layouts_exactly(tmp_path):
    """Mixed precision: ZeRO-3's master is its float32 shard, ZeRO-1's a copy beside bf16
    parameters; a checkpoint carries the masters (not the bf16 values) from one to the other and
    back, and training goes on from the round trip as from the original."""
    original, round_trip = sw.testing.run_on_ranks(_masters_between_layouts, 2, str(tmp_path))[0]
    assert original == round_trip
    merged = {}
    for name in ("zero3", "zero1", "zero3-again"):
        sw.merge_checkpoint(tmp_path / name, tmp_path / f"{name}.safetensors")  # float32 masters preferred
        merged[name] = load_file(str(tmp_path / f"{name}.safetensors"))
    want = merged["zero3"]
    assert all(v.dtype == torch.float32 for v in want.values())
    assert any(not torch.equal(v, v.bfloat16().float()) for v in want.values())  # masters, not bf16 values
    for name in ("zero1", "zero3-again"):
        assert want.keys() == merged[name].keys() and all(torch.equal(want[k], merged[name][k]) for k in want), name


# -- atomic saves ----------------------------------------------------------------------------
def _crash_during_second_save(path):
    pm, opt = _parallel({"zero": 1})
    _train(pm, opt, BATCHES[:1])
    sw.save_checkpoint(path, pm, opt)
    _train(pm, opt, BATCHES[1:2])
    if dist.get_rank() == 1:  # this rank dies halfway through writing its file
        from shardwise.checkpoint import store

        def die_halfway(tensors, filename):
            store.save_file.__wrapped__(tensors, filename)
            size = os.path.getsize(filename)
            with open(filename, "r+b") as f:
                f.truncate(size // 2)
            os._exit(1)

        die_halfway.__wrapped__ = store.save_file
        store.save_file = die_halfway
    sw.save_checkpoint(path, pm, opt)


def _load_state(path):
    pm, opt = _parallel({"tp": 2}, "gpt", seed=4)
    sw.load_checkpoint(path, pm, opt)
    return {k: v.clone() for k, v in pm.full_state_dict().items()}


def test_interrupted_save_leaves_the_previous_checkpoint(tmp_path):
    path = tmp_path / "c"
    with pytest.raises(sw.RankFailedError):
        sw.testing.run_on_ranks(_crash_during_second_save, 4, str(path), timeout=120, collective_timeout=10)
    assert list(path.glob("v-*.tmp"))  # the interrupted save is there, unpublished
    first = (path / "LATEST").read_text()
    state = sw.testing.run_on_ranks(_load_state, 4, str(path))[0]
    reference = make_gpt(0, n_layer=4)
    opt = torch.optim.AdamW(reference.parameters(), **ADAMW)
    distance = []
    for batch in BATCHES[:2]:  # after one step (the first save) and after two (the interrupted one)
        reference(batch).backward()
        opt.step()
        opt.zero_grad()
        distance.append(max(float((state[k] - v).abs().max()) for k, v in reference.state_dict().items()))
    assert distance[0] <= 1e-5 < distance[1], distance  # the first checkpoint, whole
    assert (path / "LATEST").read_text() == first


# -- bytes on disk ---------------------------------------------------------------------------
def _save_dp4(path):
    pm, opt = _parallel({})
    _train(pm, opt, BATCHES[:1])
    sw.save_checkpoint(path, pm, opt)
    memory = pm.memory()
    return memory["parameters"] + memory["optimizer"]


def test_data_parallel_checkpoint_holds_one_copy(tmp_path):
    held = sw.testing.run_on_ranks(_save_dp4, 4, str(tmp_path / "c"))[0]  # per rank: params + Adam state
    version = tmp_path / "c" / (tmp_path / "c" / "LATEST").read_text()
    on_disk = sum(f.stat().st_size for f in version.iterdir())
    ratio = on_disk / held
    print(f"dp=4 checkpoint: {on_disk} bytes on disk for {held} bytes of parameters + optimizer state "
          f"per replica: ratio {ratio:.3f} (4 replicas, written once)")
    assert 0.98 <= ratio <= 1.1


# -- bad checkpoints ---------------------------------------------------------------------------
def _load_error(path):
    pm, opt = _parallel({"tp": 2}, "gpt", seed=4)
    before = {k: v.clone() for k, v in pm.full_state_dict().items()}
    try:
        sw.load_checkpoint(path, pm, opt)
    except sw.CheckpointError as exc:
        after = pm.full_state_dict()
        return str(exc), all(torch.equal(before[k], after[k]) for k in before), len(opt.state)
    return "no error", False, 0


def test_bad_checkpoints_are_refused_and_change_nothing(saved, tmp_path):
    path, _ = saved
    import shutil

    cases = {}
    cases["empty"] = tmp_path / "empty"
    cases["empty"].mkdir()
    cases["incomplete"] = tmp_path / "incomplete"
    shutil.copytree(path, cases["incomplete"])
    version = cases["incomplete"] / (cases["incomplete"] / "LATEST").read_text()
    (version / "COMPLETE").unlink()
    cases["corrupt"] = tmp_path / "corrupt"
    shutil.copytree(path, cases["corrupt"])
    version = cases["corrupt"] / (cases["corrupt"] / "LATEST").read_text()
    with open(version / "rank-3.safetensors", "r+b") as f:
        f.truncate(100)
    expected = {"empty": "no complete checkpoint", "incomplete": "is incomplete: it has no COMPLETE marker",
                "corrupt": "corrupt"}
    for name, target in cases.items():
        for message, unchanged, state in sw.testing.run_on_ranks(_load_error, 4, str(target)):
            assert expected[name] in message, (name, message)
            assert unchanged and state == 0, name


def _other_model(path):
    pm = sw.parallelize(make_gpt(0, n_layer=2), sw.ParallelConfig())
    with pytest.raises(sw.CheckpointError, match=r"is from another model: missing \[\], unexpected \['layers.2"):
        sw.load_checkpoint(path, pm)
    return "ok"


def test_checkpoint_of_another_model(saved):
    assert sw.testing.run_on_ranks(_other_model, 1, str(saved[0])) == ["ok"]


def _llama(seed: int):
    from test_zoo import make

    torch.manual_seed(seed)
    model = make("llama")
    if seed:  # other values than the saved model's: only the checkpoint can make them equal
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
    return model


def _llama_across_layouts(root: str):
    from test_zoo import batches

    data = batches("llama", steps=2)
    layouts = [({"tp": 2}, "llama"), ({"pp": 2, "microbatches": 2}, None), ({"tp": 2}, "llama")]
    saved, loaded = None, []
    for hop, (config, plan) in enumerate(layouts):
        pm = sw.parallelize(_llama(hop), sw.ParallelConfig(**config), plan=plan, sample=replica_slice(data[0], 0, 2))
        opt = sw.build_optimizer(pm, torch.optim.AdamW, **ADAMW)
        if saved is None:
            _train(pm, opt, data)
        else:
            sw.load_checkpoint(f"{root}/{hop - 1}", pm, opt)
            loaded.append(all(torch.equal(v, saved[k]) for k, v in pm.full_state_dict().items()))
        saved = {k: v.clone() for k, v in pm.full_state_dict().items()}
        sw.save_checkpoint(f"{root}/{hop}", pm, opt)
    return loaded


def test_hugging_face_llama_between_tensor_and_pipeline_layouts(tmp_path):
    """Saved at tp2 x dp2, loaded exactly into pp2 x dp2, saved again and loaded back."""
    assert sw.testing.run_on_ranks(_llama_across_layouts, 4, str(tmp_path)) == [[True, True]] * 4


# -- asynchronous saves ---------------------------------------------------------------------
def _save_async_and_train_on(path):
    """The state at the call is what lands on disk, while training changes the tensors."""
    pm, opt = _parallel({"tp": 2}, "gpt")
    _train(pm, opt, BATCHES[:1])
    at_save = {k: v.clone() for k, v in pm.full_state_dict().items()}
    handle = sw.save_checkpoint(path, pm, opt, async_=True)
    assert isinstance(handle, sw.checkpoint.AsyncSave)
    with torch.no_grad():  # at once, before the background write can have read them
        for param in pm.parameters():
            (param._local_tensor if hasattr(param, "_local_tensor") else param).add_(1.0)
    _train(pm, opt, BATCHES[1:3])  # the write goes on meanwhile
    on_disk = _load_version(handle.wait())  # read now: the saves below replace this version
    second = sw.save_checkpoint(path, pm, opt, async_=True)  # a later save waits for a pending one, too
    sw.save_checkpoint(path, pm, opt, async_=True)
    assert second.done()
    return at_save, on_disk


def _load_version(version):
    """The model values a version holds, read directly (one process, no layout)."""
    saved = sw.checkpoint.store.Reader(Path(version))
    state = {}
    for key in saved.meta["state_keys"]:
        canonical = saved.meta["aliases"].get(key, key)
        source = f"model/{canonical}" if f"model/{canonical}" in saved.keys else f"buffer/{canonical}"
        state[key] = saved.read(source, tuple((0, s) for s in saved.keys[source]["shape"]))
    return state


def test_async_save_holds_the_state_at_the_call(tmp_path):
    at_save, on_disk = sw.testing.run_on_ranks(_save_async_and_train_on, 4, str(tmp_path / "c"))[0]
    assert on_disk.keys() == at_save.keys()
    for key, value in at_save.items():
        assert torch.equal(on_disk[key], value), key


def _crash_during_async_save(path):
    pm, opt = _parallel({"tp": 2}, "gpt")
    _train(pm, opt, BATCHES[:1])
    sw.save_checkpoint(path, pm, opt)
    _train(pm, opt, BATCHES[1:2])
    if dist.get_rank() == 1:  # this rank's background writer dies halfway through its file
        from shardwise.checkpoint import store

        def die(tensors, filename):
            with open(filename, "wb") as f:
                f.write(b"half")
            os._exit(1)

        store.save_file = die
    handle = sw.save_checkpoint(path, pm, opt, async_=True)
    handle.wait()


def test_a_crash_during_an_async_save_leaves_the_previous_version(tmp_path):
    path = tmp_path / "c"
    with pytest.raises(sw.RankFailedError):
        sw.testing.run_on_ranks(_crash_during_async_save, 4, str(path), timeout=120, collective_timeout=10)
    first = (path / "LATEST").read_text()
    assert list(path.glob("v-*.tmp")), "the interrupted save is there, unpublished"
    state = sw.testing.run_on_ranks(_load_state, 4, str(path))[0]
    # the first version: one AdamW step, equal to one process's within parity.py's per-element
    # bound (a step of rounding-sized gradient differences); the interrupted second moved ~lr more
    reference = reference_run(functools.partial(make_gpt, 0, n_layer=4), BATCHES[:1], optimizer="adamw")
    bounds = adamw_bounds(reference, ADAMW["lr"])
    assert all(bool(((state[k] - v).abs() <= bounds[k]).all()) for k, v in reference.final.items())
    assert (path / "LATEST").read_text() == first


def _async_save_into_unshared_directories(root):
    pm, opt = _parallel({"tp": 2}, "gpt")
    _train(pm, opt, BATCHES[:1])
    handle = sw.save_checkpoint(f"{root}/{dist.get_rank()}", pm, opt, async_=True)  # a directory per rank
    start = time.monotonic()
    try:
        handle.wait()
    except sw.CheckpointError as exc:
        message = str(exc)
    _train(pm, opt, BATCHES[1:2])  # training goes on after the failed save
    sw.save_checkpoint(f"{root}/shared", pm, opt, async_=True).wait()
    return message, time.monotonic() - start


def test_a_failed_async_save_is_one_error_everywhere_and_training_goes_on(tmp_path):
    results = sw.testing.run_on_ranks(_async_save_into_unshared_directories, 2, str(tmp_path), timeout=120)
    assert results[0][0] == results[1][0] and "rank 1 does not see" in results[0][0], results
    assert all(seconds < 10 for _, seconds in results), results
