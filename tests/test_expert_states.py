"""The states of a mixture of experts split over ep ranks (tiny Hugging Face Mixtral and
Qwen2-MoE, tests/test_expert.py's models): where each expert tensor lives, what the summary
and the planner say about it, and that norms, checkpoints and save_pretrained count every
element once and load across ep degrees and ZeRO stages bit for bit.
"""

from __future__ import annotations

import functools

import pytest
import torch
import transformers

import shardwise as sw
from parity import run_and_compare
from test_expert import make_moe, moe_batches


def _sharded_and_checkpointed(path: str):
    """ep=4: each rank holds a quarter of every expert tensor; the summary shows the step's
    all-to-all bytes and per-expert loads; a checkpoint saved at ep=4 (model and AdamW state)
    loads at ep=2, with the experts replicated, and at ep=2 under ZeRO-1, bit for bit; so does
    save_pretrained's Hugging Face directory, read back by load_pretrained at ep=2."""
    import torch.distributed as dist

    batch = moe_batches(1)[0]
    pm = sw.parallelize(make_moe("mixtral"), sw.ParallelConfig(ep=4))
    opt = sw.build_optimizer(pm, torch.optim.AdamW, lr=1e-3)
    rank = dist.get_rank()
    pm.train_step({k: v[rank:rank + 1] for k, v in batch.items()})
    experts = pm.module.lm.model.layers[0].mlp.experts
    shapes = {name: tuple(p.to_local().shape) for name, p in experts.named_parameters()}
    text, sent = pm.summary(), pm.expert_parallel.bytes_sent
    opt.step()
    sw.save_checkpoint(path, pm, opt)
    saved = {k: v.clone() for k, v in pm.full_state_dict().items()}
    saved_state = opt.full_state_dict()["state"]
    sw.save_pretrained(pm, path + "-hf")  # transformers' own files: whole expert tensors
    same = []
    pretrained = sw.parallelize(make_moe("mixtral"), sw.ParallelConfig(ep=2))
    sw.load_pretrained(pretrained, path + "-hf")
    loaded = pretrained.full_state_dict()
    same.append(all(torch.equal(saved[k], loaded[k]) for k in saved))
    for config in (sw.ParallelConfig(ep=2), sw.ParallelConfig(), sw.ParallelConfig(ep=2, zero=1)):
        other = sw.parallelize(make_moe("mixtral"), config)  # experts over 2 ranks, replicated, ZeRO-sharded
        other_opt = sw.build_optimizer(other, torch.optim.AdamW, lr=1e-3)
        sw.load_checkpoint(path, other, other_opt)
        loaded, state = other.full_state_dict(), other_opt.full_state_dict()["state"]
        same.append(saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
                    and state.keys() == saved_state.keys()
                    and all(torch.equal(torch.as_tensor(saved_state[n][k]), torch.as_tensor(state[n][k]))
                            for n in saved_state for k in saved_state[n]))
    return shapes, text, sent, same


def _slots_leaving_their_rank(model, batch) -> int:
    """One process's routing of `batch` (row r on rank r at ep=4, expert e on rank e): the
    token slots whose expert is on another rank, over every layer."""
    leaving = []

    def record(router, args, out):
        experts = out[2].view(batch["input_ids"].shape[0], -1, router.top_k)  # (rows, positions, k)
        rows = torch.arange(experts.shape[0]).view(-1, 1, 1)
        leaving.append(int((experts != rows).sum()))

    hooks = [m.register_forward_hook(record) for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    with torch.no_grad():
        model(batch)
    for hook in hooks:
        hook.remove()
    return sum(leaving)


def test_experts_sharded_summarized_and_checkpointed_across_ep(tmp_path):
    leaving = _slots_leaving_their_rank(make_moe("mixtral"), moe_batches(1)[0])
    results = sw.testing.run_on_ranks(_sharded_and_checkpointed, 4, str(tmp_path / "ckpt"))
    # each slot that leaves its rank goes out as 32 floats and comes back as 32 more
    assert sum(sent for _, _, sent, _ in results) == leaving * 2 * 32 * 4 > 0
    for rank, (shapes, text, sent, same) in enumerate(results):
        assert shapes == {"gate_up_proj": (1, 64, 32), "down_proj": (1, 32, 32)}, shapes
        assert "2 MoE layer(s), 4 experts over ep ranks [0, 1, 2, 3]" in text and f"experts {rank}-{rank} here" in text
        assert f"{sent / 2 ** 20:.4f} MiB sent to other ranks by all-to-all" in text, text
        assert "token slots per local expert" in text
        assert same == [True, True, True, True]


def _model_states(configs: list[dict]) -> list[dict[str, int]]:
    """Bytes this rank holds after a step with AdamW: parameters, gradients, optimizer state."""
    import torch.distributed as dist

    out = []
    for config in configs:
        pm = sw.parallelize(make_moe("mixtral"), sw.ParallelConfig(**config))
        opt = sw.build_optimizer(pm, torch.optim.AdamW, lr=1e-3)
        rows = slice(dist.get_rank() // 4 * 0, 4) if pm.topology.sizes["dp"] == 1 else slice(pm.topology.dp_rank,
                                                                                               pm.topology.dp_rank + 1)
        pm.train_step({k: v[rows] for k, v in moe_batches(1)[0].items()})
        opt.step()
        out.append(pm.memory())
    return out


def test_planner_knows_experts():
    """The planner reads a mixture of experts from the module or its config alike, splits
    expert states over ep (ZeRO over dp / ep), and predicts each rank's model states as the
    executor holds them; its all-to-all term follows the formula."""
    from shardwise.planner import Cluster, model_spec
    from shardwise.planner.model import from_hf_config

    for kind in ("mixtral", "qwen2_moe"):
        model = make_moe(kind)
        spec = model_spec(model)
        assert spec == from_hf_config(model.lm.config)
        assert spec.params == sum(p.numel() for p in model.parameters()) and spec.experts == 4 and spec.top_k == 2
    cluster = Cluster(gpus=4, device="local", memory_bytes=2 ** 34)
    configs = [{"ep": 2}, {"ep": 4}, {"ep": 2, "zero": 1}, {"ep": 2, "zero": 3}, {}]
    measured = sw.testing.run_on_ranks(_model_states, 4, configs)
    for i, config in enumerate(configs):
        predicted = sw.plan.evaluate(make_moe("mixtral"), cluster, sw.ParallelConfig(**config), seq_len=8,
                                     global_batch=4)
        terms = predicted.memory_terms
        for rank in measured:
            held = rank[i]
            for ours, theirs in (("params", "parameters"), ("grads", "gradients"), ("optimizer", "optimizer")):
                assert abs(terms[ours] - held[theirs]) <= 0.01 * held[theirs], (config, ours, terms[ours], held)
    one, four = (sw.plan.evaluate("mixtral-8x7b", Cluster(gpus=64, gpus_per_node=8, device="h100"),
                                  sw.ParallelConfig(tp=8, ep=ep), seq_len=4096, global_batch=64) for ep in (1, 8))
    assert one.time_terms["ep_comm"] == 0 and four.time_terms["ep_comm"] > 0
    assert four.memory_terms["params"] < one.memory_terms["params"]


@pytest.mark.parametrize("config, plan", [({"ep": 2, "tp": 2}, "mixtral"), ({"ep": 2, "zero": 2}, None)])
def test_clipped_norm_counts_each_expert_once(config, plan):
    """clip_grad_norm's global norm (and the clipped training) equals one process's: an expert
    shard is counted by one rank, not by every tp peer or data-parallel copy holding it."""
    run_and_compare(4, config, functools.partial(make_moe, "mixtral"), moe_batches(), plan=plan, clip=0.5)


def _owned_elements(config: dict, plan):
    pm = sw.parallelize(make_moe(plan or "mixtral"), sw.ParallelConfig(**config), plan=plan)
    counts = {}
    for name, param in pm.module.named_parameters():
        counts[name] = (sum(p.end - p.start for p in pm.optimizer_params.pieces[id(param)] if p.owned), param.numel())
    return counts


@pytest.mark.parametrize("config, plan", [({"ep": 2, "tp": 2}, "mixtral"), ({"ep": 2, "zero": 2}, None),
                                          ({"ep": 2, "zero": 3}, None),
                                          ({"ep": 2, "tp": 2, "sequence_parallel": True, "zero": 1}, "qwen2_moe")])
def test_every_element_owned_once(config, plan):
    """Norms and checkpoints count each element on the one rank that owns it: over the ranks,
    the owned elements of every parameter add up to its size exactly."""
    results = sw.testing.run_on_ranks(_owned_elements, 4, config, plan)
    for name, (_, size) in results[0].items():
        assert sum(r[name][0] for r in results) == size, name


def _pretrained_round_trip(path: str, kind: str):
    """save_pretrained from ep=2 writes the checkpoint format (one tensor per expert); it loads
    back at ep=2 and, in the test process, into transformers' own from_pretrained."""
    pm = sw.parallelize(make_moe(kind), sw.ParallelConfig(ep=2))
    opt = sw.build_optimizer(pm, torch.optim.SGD, lr=0.1)
    pm.train_step({k: v[pm.topology.dp_rank * 2:pm.topology.dp_rank * 2 + 2] for k, v in moe_batches(1)[0].items()})
    opt.step()
    saved = pm.full_state_dict()
    sw.save_pretrained(pm, path)
    other = sw.parallelize(make_moe(kind), sw.ParallelConfig(ep=2))
    sw.load_pretrained(other, path)
    loaded = other.full_state_dict()
    return {k: v for k, v in saved.items()}, all(torch.equal(saved[k], loaded[k]) for k in saved)


@pytest.mark.parametrize("kind", ["qwen2_moe"])
def test_pretrained_checkpoints_of_experts(tmp_path, kind):
    from safetensors import safe_open

    path = str(tmp_path / "hf")
    saved, equal = sw.testing.run_on_ranks(_pretrained_round_trip, 2, path, kind)[0]
    assert equal
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt") as f:  # per-expert pieces on disk
        assert "model.layers.0.mlp.experts.3.up_proj.weight" in f.keys()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(path)
    ours = {k.removeprefix("lm."): v for k, v in saved.items()}
    assert all(torch.equal(v, ours[k]) for k, v in reloaded.state_dict().items())
