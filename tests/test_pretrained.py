"""sw.load_pretrained: Hugging Face weights written by `save_pretrained` into any layout.

A tiny Llama is saved by transformers itself (one file, and sharded with an index; tied and
untied embeddings) and loaded into tp2 x dp2, pp2 x dp2, ZeRO-3 over 4 replicas and cp2 x dp2,
each built with `sw.deferred_init` (no rank ever holds the whole model) and wrapped in an
end2end module (the weights' keys are found under its `lm.` prefix). Every parameter must
equal the checkpoint's bit for bit, and the loss `infer_step` computes must be one process's
`from_pretrained` model's, within float32 rounding of a forward (tests/parity.py's EPS_LOSS).
transformers' own `save_pretrained` on the model inside writes the whole model where every rank
holds it (cp2 x dp2) and is refused in the other layouts, where it would write part of it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

import shardwise as sw
from parity import EPS_LOSS, corpus_batches
from shardwise.models import CausalLM
from test_zoo import COMMON

LAYOUTS = {"tp2 x dp2": ({"tp": 2}, "llama"), "pp2 x dp2": ({"pp": 2, "microbatches": 2}, None),
           "zero3 x dp4": ({"zero": 3}, None), "cp2 x dp2": ({"cp": 2}, None)}


def _config(tied: bool):
    return transformers.LlamaConfig(num_key_value_heads=2, tie_word_embeddings=tied, **COMMON)


def _batch() -> dict:
    tokens = corpus_batches(1, 4, seq=16)[0]
    return {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}


def _build(tied: bool):
    torch.manual_seed(123)  # other values than the checkpoint's: only loading can make them equal
    return CausalLM(transformers.LlamaForCausalLM(_config(tied)))


def _load_everywhere(directory: str, tied: bool):
    from shardwise.checkpoint import pretrained

    out = {}
    batch = _batch()
    real_read, read = pretrained._File.read, []

    def counting(self, key, rect):
        tensor = real_read(self, key, rect)
        read.append(tensor.numel())
        return tensor

    pretrained._File.read = counting
    for name, (config, plan) in LAYOUTS.items():
        sample = {k: v[:2] for k, v in batch.items()} if config.get("pp", 1) > 1 else None
        pm = sw.parallelize(sw.deferred_init(_build, tied), sw.ParallelConfig(**config), plan=plan, sample=sample)
        read.clear()
        sw.load_pretrained(pm, directory)
        out[name] = ({k: v.clone() for k, v in pm.full_state_dict().items()}, float(pm.infer_step(batch)), sum(read),
                     _own_save_pretrained(pm, Path(directory).parent / f"own-{tied}-{name}-{pm.topology.rank}"))
    return out


def _own_save_pretrained(pm, directory: Path) -> str:
    """transformers' own save_pretrained called on the model inside, as HF users do: the
    directory it wrote, or the refusal where this rank holds part of the weights (under pp it
    wrote stage 0's tensors alone, and from_pretrained filled the rest at random)."""
    try:
        pm.module.lm.save_pretrained(directory)
    except sw.CheckpointError as exc:
        return f"refused: {exc}"
    return str(directory)


@pytest.fixture(scope="module", params=[(True, None), (False, "20KB")], ids=["tied, one file", "untied, sharded"])
def saved(request, tmp_path_factory):
    tied, shard = request.param
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config(tied))
    directory = tmp_path_factory.mktemp("hf")
    model.save_pretrained(directory, **({"max_shard_size": shard} if shard else {}))
    if shard:
        assert (directory / "model.safetensors.index.json").is_file()
        assert len(set(json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"].values())) > 1
    return directory, tied


def test_hugging_face_weights_load_into_every_layout(saved):
    directory, tied = saved
    reference = transformers.LlamaForCausalLM.from_pretrained(directory)
    want_state = {f"lm.{k}": v for k, v in reference.state_dict().items()}
    with torch.no_grad():
        want_loss = float(CausalLM(reference)(_batch()))
    total = sum(v.numel() for v in reference.state_dict().values())
    # what a rank reads: ZeRO-3 over 4 replicas reads a quarter (its flat shard; buckets are padded
    # to 4 equal parts, so a little more), tp2 half of each sharded matrix and the small norms whole
    share = {"zero3 x dp4": 0.25 * 1.1, "tp2 x dp2": 0.6}
    for rank, layouts in enumerate(sw.testing.run_on_ranks(_load_everywhere, 4, str(directory), tied)):
        for name, (state, loss, elements, own_save) in layouts.items():
            assert elements <= share.get(name, 1.0) * total, (name, rank, elements, total)
            if name == "cp2 x dp2":  # every rank holds every weight: transformers' own save is right
                if rank == 0:
                    own = transformers.LlamaForCausalLM.from_pretrained(own_save).state_dict()
                    assert all(torch.equal(v, state[f"lm.{k}"]) for k, v in own.items()) and len(own) == len(reference.state_dict())
            else:
                assert own_save.startswith("refused") and "so transformers would write part of the model" in own_save, \
                    (name, own_save)
            assert state.keys() == want_state.keys(), (name, sorted(set(state) ^ set(want_state)))
            for key, value in want_state.items():
                assert torch.equal(state[key], value), f"{name} rank {rank}: {key} differs from the checkpoint"
            assert abs(loss - want_loss) <= EPS_LOSS * abs(want_loss), (name, rank, loss, want_loss)


def _refusals(good: str, other: str, missing: str, truncated: str):
    found = {}
    for name, path in {"another configuration": other, "a directory without weights": missing,
                       "a missing key": good, "a truncated file": truncated}.items():
        pm = sw.parallelize(_build(True), sw.ParallelConfig(tp=2), plan="llama")
        if name == "a missing key":  # the checkpoint has no values for the wrapper's own layer
            pm = sw.parallelize(torch.nn.ModuleDict({"lm": _build(True).lm, "extra": torch.nn.Linear(2, 2)}))
        try:
            sw.load_pretrained(pm, path)
            found[name] = "loaded"
        except sw.CheckpointError as exc:
            found[name] = str(exc)
    return found


def test_refusals_name_the_file_and_key(tmp_path):
    directory, other = tmp_path / "good", tmp_path / "other"
    transformers.LlamaForCausalLM(_config(True)).save_pretrained(directory)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(num_key_value_heads=2, **{**COMMON, "hidden_size": 64})) \
        .save_pretrained(other)
    (tmp_path / "empty").mkdir()
    truncated = tmp_path / "truncated.safetensors"
    data = (directory / "model.safetensors").read_bytes()
    truncated.write_bytes(data[:len(data) // 2])
    results = sw.testing.run_on_ranks(_refusals, 2, str(directory), str(other), str(tmp_path / "empty"),
                                      str(truncated))
    assert results[0] == results[1]
    assert "'model.embed_tokens.weight' has shape (64, 64), the model's 'lm.model.embed_tokens.weight' is (64, 32)" \
        in results[0]["another configuration"], results[0]
    assert "holds no Hugging Face weights" in results[0]["a directory without weights"]
    assert "missing ['extra.bias', 'extra.weight']" in results[0]["a missing key"], results[0]
    assert "truncated.safetensors" in results[0]["a truncated file"], results[0]


def _export(directory: str, dtype, tied: bool):
    batch = _batch()
    pm = sw.parallelize(sw.deferred_init(_build, tied), sw.ParallelConfig(tp=2, pp=2, microbatches=2), plan="llama",
                        sample={k: v[:2] for k, v in batch.items()})
    optimizer = sw.build_optimizer(pm, torch.optim.SGD, lr=0.1)
    pm.train_step(batch)  # values no file holds yet
    optimizer.step()
    sw.save_pretrained(pm, directory, dtype=dtype)
    return {k: v.clone() for k, v in pm.full_state_dict().items()}, float(pm.infer_step(batch))


@pytest.mark.parametrize("dtype, tied", [(None, False), (torch.bfloat16, False), (None, True)],
                         ids=["float32", "bfloat16", "float32 tied"])
def test_save_pretrained_from_tp2_x_pp2_is_what_from_pretrained_reads(tmp_path, dtype, tied):
    """The export is a directory transformers loads as is: config.json, safetensors, the
    model's own key names; its parameters are the trained ones (in the dtype asked for)."""
    state, loss = sw.testing.run_on_ranks(_export, 4, str(tmp_path), dtype, tied)[0]
    assert (tmp_path / "config.json").is_file() and list(tmp_path.glob("*.safetensors"))
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path, torch_dtype=dtype or torch.float32)
    for key, value in loaded.state_dict().items():
        want = state[f"lm.{key}"].to(dtype) if dtype is not None else state[f"lm.{key}"]
        assert torch.equal(value, want), key
    if dtype is None:
        with torch.no_grad():
            got = float(CausalLM(loaded)(_batch()))
        assert abs(got - loss) <= EPS_LOSS * abs(loss), (got, loss)


def hugging_face_lm():
    """The module `shardwise export --model test_pretrained:hugging_face_lm` builds (on meta)."""
    return CausalLM(transformers.LlamaForCausalLM(_config(False)))


def _save_sharded(path: str):
    pm = sw.parallelize(_build(False), sw.ParallelConfig(tp=2), plan="llama")
    sw.save_checkpoint(path, pm)
    return {k: v.clone() for k, v in pm.full_state_dict().items()}


def test_shardwise_export_writes_what_from_pretrained_reads(tmp_path, monkeypatch):
    """A tp2 checkpoint exported by the CLI, one process, no GPU: from_pretrained's values are
    the checkpoint's, in the dtype asked for."""
    from click.testing import CliRunner

    from shardwise.cli import main

    state = sw.testing.run_on_ranks(_save_sharded, 2, str(tmp_path / "ck"))[0]
    monkeypatch.chdir(Path(__file__).parent)  # the factory's module, importable as `python -m` would find it
    result = CliRunner().invoke(main, ["export", str(tmp_path / "ck"), str(tmp_path / "hf"), "--hf",
                                       "--model", "test_pretrained:hugging_face_lm", "--dtype", "bfloat16"])
    assert result.exit_code == 0, result.output
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.bfloat16)
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, state[f"lm.{key}"].to(torch.bfloat16)), key
    refused = CliRunner().invoke(main, ["export", str(tmp_path / "ck"), str(tmp_path / "x"), "--hf", "--model",
                                        "torch.nn:Identity"])
    assert refused.exit_code != 0 and "holds no Hugging Face model" in refused.output, refused.output
