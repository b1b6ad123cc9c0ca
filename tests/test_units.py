"""Single-process pieces: batch splitting, plans as data, the single-rank path."""

from __future__ import annotations

from collections import OrderedDict, defaultdict, namedtuple
from collections.abc import Mapping

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import shardwise as sw
from shardwise.batch import split_batch, with_dicts
from shardwise.plan import Conversion


def test_split_nested_batch():
    Pair = namedtuple("Pair", "a b")
    batch = {"x": torch.arange(8).view(8, 1), "meta": {"ids": [torch.arange(8), "tag"]}, "p": Pair(torch.ones(8), torch.tensor(2.0))}
    parts = split_batch(batch, 4)
    assert len(parts) == 4
    assert parts[1]["x"].flatten().tolist() == [2, 3]
    assert parts[3]["meta"]["ids"][0].tolist() == [6, 7] and parts[3]["meta"]["ids"][1] == "tag"
    assert isinstance(parts[2]["p"], Pair) and parts[2]["p"].b.item() == 2.0
    assert split_batch(batch, 1) == [batch]


class _Frozen(Mapping):
    """A read-only mapping of the user's own, whose copy would share its items."""

    def __init__(self, items):
        self._items = items

    def __getitem__(self, key):
        return self._items[key]

    def __iter__(self):
        return iter(self._items)

    def __len__(self):
        return len(self._items)


def test_split_keeps_the_batch_mapping_types():
    """A tokenizer's BatchEncoding (a UserDict) and transformers' ModelOutput (a dict) keep
    their type in each microbatch, so a forward reading `batch.input_ids` runs; the user's batch
    is left as it was. A mapping whose copy would share its items becomes a dict."""
    from transformers import BatchEncoding
    from transformers.modeling_outputs import CausalLMOutput

    ids = torch.arange(8).view(4, 2)
    for batch in (BatchEncoding({"input_ids": ids}), CausalLMOutput(logits=ids), OrderedDict(input_ids=ids),
                  defaultdict(list, input_ids=ids)):
        key = next(iter(batch))
        parts = split_batch(batch, 2)
        assert [type(part) for part in parts] == [type(batch)] * 2, type(batch)
        assert parts[1][key].tolist() == [[4, 5], [6, 7]] and batch[key] is ids
    assert split_batch(BatchEncoding({"input_ids": ids}), 2)[1].input_ids.tolist() == [[4, 5], [6, 7]]
    frozen = _Frozen({"input_ids": ids})
    parts = split_batch(frozen, 2)
    assert type(parts[0]) is dict and frozen["input_ids"] is ids
    assert type(with_dicts(BatchEncoding({"input_ids": ids}))) is dict


def test_plan_round_trips_through_json(tmp_path):
    plan = sw.Plan(
        params={"layers.*.attn.q_proj.weight": [Shard(0)], "re:layers\\.\\d+\\.mlp\\.fc2\\.weight": ["Shard(1)"]},
        activations={"layers.*.mlp.input": [[Replicate()]], "layers.*.mlp.output": "Partial()",
                     "layers.*.attn.input": "Shard(1) -> Replicate()"},
        stages=["layers.2"], zero=1, recompute=["layers.*"], name="demo",
    )
    assert plan.activations["layers.*.mlp.output"] == ((Partial(),),)
    assert plan.activations["layers.*.attn.input"] == ((Conversion(Shard(1), Replicate()),),)
    again = sw.Plan.from_json(plan.to_json())
    assert again == plan
    path = tmp_path / "plan.json"
    plan.to_json(path)
    assert sw.Plan.from_json(path) == plan
    text = str(plan)
    assert "layers.*.attn.q_proj.weight" in text and "Shard(0)" in text and "stages begin at: layers.2" in text
    assert "Shard(1) -> Replicate()" in text


def test_plan_accepts_vescale_dict_form():
    plan = sw.Plan.from_dict({
        "parameter": {"fc1.weight": [Shard(0)], "fc1.bias": [Shard(0)], "fc2.weight": [Shard(1)], "fc2.bias": [Replicate()]},
        "forward": {"fc1.input": [[Replicate()]], "fc2.output": [[Replicate()]]},
    })
    assert plan.params["fc2.weight"] == (Shard(1),)
    assert plan.activations["fc1.input"] == ((Replicate(),),)


@pytest.mark.parametrize("bad, pattern", [
    ({"params": {"a.weight": "Shard()"}}, r"'Shard\(\)' needs a dimension"),
    ({"params": {"a.weight": "Sharded(0)"}}, r"'Sharded\(0\)' is not a placement"),
    ({"activations": {"a.inputs": "Replicate()"}}, r"must end in '.input' or '.output'"),
    ({"placements": {}}, r"unknown plan fields \['placements'\]"),
])
def test_bad_plans(bad, pattern):
    with pytest.raises(sw.PlanError, match=pattern):
        sw.Plan.from_dict(bad)


def test_single_rank_path_matches_plain_module():
    """world size 1: the wrapper trains exactly like the plain module."""
    from parity import SGD, gpt_batches, make_gpt, reference_run

    batches = gpt_batches(3, 4)
    reference = reference_run(lambda: make_gpt(0), batches)
    pm = sw.parallelize(make_gpt(0))
    opt = sw.build_optimizer(pm, torch.optim.SGD, **SGD)
    losses = []
    for b in batches:
        losses.append(float(pm.train_step(b)))
        opt.step()
        opt.zero_grad()
    assert losses == reference.losses
    state = pm.full_state_dict()
    assert all(torch.equal(state[k], v) for k, v in reference.final.items())
    assert "world 1" in pm.summary()
    out = pm.infer_step(batches[0])
    assert out.dim() == 0 and not out.requires_grad
    assert torch.equal(out, pm.module(batches[0]).detach())
