"""Context parallelism: attention of each rank's shard of the queries over the whole
sequence's keys (float64, against one process's attention), then whole models trained with
cp alone and composed with dp, tp + sp, pp and ZeRO-3 against one process (tests/parity.py),
and the batches and models cp refuses."""

from __future__ import annotations

import functools
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from torch import nn

import shardwise as sw
from parity import Case, compare_cases, corpus_batches, make_gpt, run_and_compare
from shardwise.errors import BatchError, ModelError
from shardwise.models import CausalLM
from shardwise.parallel.context.sequence import SequenceShards, context_parallel_attention
from test_zoo import COMMON
from test_zoo import make as make_zoo_model

# (batch, query heads, key/value heads, head dim, sequence): GQA (4 query heads per kv head)
# and plain multi-head, sequences divisible by 2*cp for cp = 2 and 4.
SHAPES = [(2, 8, 2, 16, 64), (1, 4, 4, 8, 32)]


def _attention_cases(group_sizes: tuple[int, ...]) -> list[dict]:
    """On every rank: for each cp group size and shape and mask kind, the largest difference
    between this rank's result and its rows of one process's result, relative to that
    quantity's largest magnitude (outputs, and gradients of q, k, v)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for size in group_sizes:
        groups = [dist.new_group(list(range(start, start + size))) for start in range(0, world, size)]
        group = groups[rank // size]
        shards = SequenceShards(size, rank % size)
        for shape_index, (b, h, h_kv, d, s) in enumerate(SHAPES):
            for kind_index, kind in enumerate(("causal", "additive mask", "bool mask and causal")):
                generator = torch.Generator().manual_seed(10 * shape_index + kind_index)  # the same on every rank
                q, k, v = (torch.randn(b, heads, s, d, generator=generator, dtype=torch.float64)
                           for heads in (h, h_kv, h_kv))
                weight = torch.randn(b, h, s, d, generator=generator, dtype=torch.float64)
                mask, causal = None, kind != "additive mask"
                if kind == "additive mask":
                    mask = torch.randn(s, s, generator=generator, dtype=torch.float64)
                elif kind == "bool mask and causal":
                    mask = torch.rand(b, 1, s, s, generator=generator) > 0.3
                    mask |= torch.eye(s, dtype=torch.bool)  # every query keeps itself: no empty row
                whole = [t.clone().requires_grad_() for t in (q, k, v)]
                full_mask = mask if not (causal and mask is not None) else mask & torch.ones(s, s).tril().bool()
                out = F.scaled_dot_product_attention(*whole, attn_mask=full_mask, is_causal=causal and mask is None,
                                                     enable_gqa=h != h_kv)
                (out * weight).sum().backward()
                mine = [shards.split(t, 2).detach().requires_grad_() for t in (q, k, v)]
                local = context_parallel_attention(*mine, group, attn_mask=mask, is_causal=causal, enable_gqa=h != h_kv)
                (local * shards.split(weight, 2)).sum().backward()
                pairs = {"out": (local, out), "dq": (mine[0].grad, whole[0].grad), "dk": (mine[1].grad, whole[1].grad),
                         "dv": (mine[2].grad, whole[2].grad)}
                results.append({"case": f"cp={size} {(b, h, h_kv, d, s)} {kind}",
                                **{name: float((got.detach() - shards.split(want, 2)).abs().max() / want.abs().max())
                                   for name, (got, want) in pairs.items()}})
    return results


def test_attention_over_shards_matches_whole_sequence():
    """cp=4 and cp=2 (two groups of two) in one world of 4.

    Tolerance: float64 throughout, so a result differs from one process's only by the order
    of its sums: the gathered keys come in another order than the whole sequence's, and the
    reduce-scatter adds the ranks' key gradients in its own order. Each value is a sum of at
    most s = 64 products over keys (and, for dk/dv, over b*h/h_kv*s query terms, 4*64 = 256),
    so reordering changes it by at most ~256 * 2^-53 ~ 3e-14 of the terms' largest magnitude;
    softmax's exp and normalisation add a few ulps. 1e-11 relative to the quantity's largest
    magnitude leaves two orders of margin for any BLAS or thread count, while a wrong mask,
    a missing reduction or a mis-ordered shard is off by O(1)."""
    for rank_results in sw.testing.run_on_ranks(_attention_cases, 4, (4, 2)):
        assert len(rank_results) == 2 * len(SHAPES) * 3
        for result in rank_results:
            for name in ("out", "dq", "dk", "dv"):
                assert result[name] < 1e-11, f"{result['case']}: {name} differs by {result[name]:.2e} (relative)"


def test_load_balanced_split():
    shards = [SequenceShards(2, r) for r in range(2)]
    assert shards[0].positions(8).tolist() == [0, 1, 6, 7]
    assert shards[1].positions(8).tolist() == [2, 3, 4, 5]
    assert shards[0].gathered_positions(8).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    sequence = torch.arange(16).view(1, 16)
    four = [SequenceShards(4, r).split(sequence, 1).tolist()[0] for r in range(4)]
    assert four == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    # causal work is balanced: the number of (query, key) pairs each rank computes is equal
    work = [sum(p + 1 for p in SequenceShards(4, r).positions(64).tolist()) for r in range(4)]
    assert len(set(work)) == 1
    with pytest.raises(BatchError, match="pad the sequence to a multiple of 8"):
        SequenceShards(4, 0).positions(20)


def _dropout_refused() -> str:
    q = torch.randn(1, 2, 4, 8)
    try:
        context_parallel_attention(q, q, q, dist.group.WORLD, dropout_p=0.1, is_causal=True)
    except ModelError as exc:
        return str(exc)
    return "no error"


def test_random_draws_on_a_shard_are_the_whole_sequences():
    """Under the cp draws each rank's dropout mask, random fills and rand_like are its tokens'
    part of what one process draws for the whole sequence, bit for bit."""
    from shardwise.parallel.context.sequence import SequenceDraws, WholeSequenceDraws

    draws = {"dropout": lambda x: F.dropout(x, 0.3, True), "uniform_": lambda x: x.uniform_(0.9, 1.1),
             "normal_": lambda x: x.normal_(), "bernoulli_": lambda x: x.bernoulli_(0.4),
             "rand_like": torch.rand_like, "randn_like": torch.randn_like}
    for size in (2, 4):
        for name, draw in draws.items():
            torch.manual_seed(5)
            whole = draw(torch.ones(3, 8 * size, 4))
            for rank in range(size):
                shards = SequenceShards(size, rank)
                torch.manual_seed(5)
                with WholeSequenceDraws(SequenceDraws(shards, 1, 8)):
                    mine = draw(torch.ones(3, 8, 4))
                assert torch.equal(mine, shards.split(whole, 1)), (name, size, rank)


def test_attention_dropout_is_refused():
    for message in sw.testing.run_on_ranks(_dropout_refused, 2):
        assert "set the attention dropout to 0 for cp > 1" in message


def make(kind: str, dropout: float = 0.0) -> nn.Module:
    """`dropout`: our GPT's embedding and residual dropout; Mixtral's router jitter (noise drawn
    by `uniform_` on the router's input)."""
    if kind == "gpt":
        return make_gpt(block_size=16, dropout=dropout)
    if kind == "mixtral":
        from test_expert import make_moe

        return CausalLM(make_moe("mixtral", jitter=dropout, router_seed=JITTER_ROUTER_SEED).lm)
    torch.manual_seed(0)
    t = transformers
    config_class, model_class = {"llama": (t.LlamaConfig, t.LlamaForCausalLM),
                                 "qwen2": (t.Qwen2Config, t.Qwen2ForCausalLM)}[kind]
    return CausalLM(model_class(config_class(num_key_value_heads=2, **COMMON)))  # GQA: 2 kv heads for 4


def cp_batches(steps: int = 4, uneven: bool = False) -> list[dict]:
    """Corpus text, 16 tokens per row with pre-shifted labels. `uneven`: labels ignored (-100)
    unevenly along the sequence (most of the last third, a fifth elsewhere), so cp ranks
    count different numbers of tokens and an unweighted mean over shards would be wrong."""
    gen = torch.Generator().manual_seed(2)
    out = []
    for tokens in corpus_batches(steps, 4, seq=16):
        labels = tokens[:, 1:].clone()
        if uneven:
            odds = torch.full(labels.shape, 0.2)
            odds[:, 11:] = 0.8
            labels[torch.rand(labels.shape, generator=gen) < odds] = -100
            labels[:, 4] = tokens[:, 5]  # every cp rank keeps a counted token (cp=2: positions 4..11 on rank 1)
            labels[:, 0] = tokens[:, 1]
        out.append({"input_ids": tokens[:, :-1].contiguous(), "labels": labels})
    return out


JITTER_ROUTER_SEED = 13  # Mixtral's routing margin (tests/test_expert.py) over cp_batches: 2.4x here
RANDOM_LAYOUTS = {2: {"cp2": {"cp": 2}}, 4: {"cp2 x tp2 sp": {"cp": 2, "tp": 2, "sequence_parallel": True},
                                            "cp2 x pp2": {"cp": 2, "pp": 2, "microbatches": 2}}}
CP_LAYOUTS = {2: {"cp2": {"cp": 2}},
              4: {"cp4": {"cp": 4}, "cp2 x dp2": {"cp": 2, "dp": 2},
                  "cp2 x tp2 sp": {"cp": 2, "tp": 2, "sequence_parallel": True},
                  "cp2 x pp2": {"cp": 2, "pp": 2, "microbatches": 2},
                  # ZeRO-3 over dp x cp, each microbatch's gradients reduce-scattered into the shards
                  "cp2 x dp2 zero3 x2 microbatches": {"cp": 2, "dp": 2, "zero": 3, "microbatches": 2}}}


@pytest.mark.parametrize("world", sorted(CP_LAYOUTS))
def test_context_parallel_parity(world):
    """Our GPT (AdamW), Llama and Qwen2 (SGD: AdamW barely moves their loss in four steps)
    trained with cp against one process on the whole sequence, with tests/parity.py's
    tolerances: cp only reorders sums (the gathered keys, the reduce-scatter of their
    gradients, the loss as a weighted sum of shard means), as dp and tp do. Uneven ignored
    labels: at cp=2 (exact one-process mean; with dp > 1 replicas are weighted by samples, as
    under DDP) and under pp, whose last stage weights each microbatch's loss."""
    cases = [Case(f"{kind} {name}", config, functools.partial(make, kind), cp_batches(),
                  plan=kind if config.get("tp", 1) > 1 else None, optimizer="adamw" if kind == "gpt" else "sgd")
             for kind in ("gpt", "llama", "qwen2") for name, config in CP_LAYOUTS[world].items()
             if kind != "qwen2" or name in ("cp2", "cp4")]  # (Qwen2 is Llama with q, k, v biases: cp alone)
    uneven = {"cp": 2} if world == 2 else {"cp": 2, "pp": 2, "microbatches": 2}
    cases += [Case(f"{kind} {uneven} uneven ignored labels", uneven, functools.partial(make, kind),
                   cp_batches(uneven=True), optimizer="adamw" if kind == "gpt" else "sgd",
                   reference_microbatches=uneven.get("microbatches", 1))  # (a mean over microbatches' means)
              for kind in ("gpt", "llama")]
    # random numbers drawn for a shard's tokens: the whole sequence's, cut like it (without dp, one
    # process's masks exist; pp draws them per microbatch, in order)
    cases += [Case(f"gpt {name} dropout", config, functools.partial(make, "gpt", 0.2), cp_batches(), optimizer="adamw",
                   plan="gpt" if config.get("tp", 1) > 1 else None,
                   reference_microbatches=config.get("microbatches", 1)) for name, config in RANDOM_LAYOUTS[world].items()]
    if world == 2:
        cases.append(Case("mixtral cp2 router jitter", {"cp": 2}, functools.partial(make, "mixtral", 0.1), cp_batches()))
    compare_cases(world, cases)


def test_random_draws_fail_under_fault():
    """Each cp rank drawing dropout masks for its own shard of the sequence."""
    with pytest.raises(AssertionError):
        run_and_compare(2, {"cp": 2}, functools.partial(make, "gpt", 0.2), cp_batches(), optimizer="adamw",
                        fault="cp-random-per-shard")


class EagerAttention(nn.Module):
    """Attention written by hand (matmul, softmax): it would see only its shard's keys."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.head = nn.Linear(16, 64)

    def forward(self, batch):
        x = self.embed(batch["input_ids"])
        scores = (x @ x.transpose(-1, -2)).unsqueeze(1)
        x = (scores.softmax(-1) @ x.unsqueeze(1)).squeeze(1)
        return F.cross_entropy(self.head(x).flatten(0, 1), batch["labels"].flatten())


class SummedLoss(nn.Module):
    """Our GPT with its loss summed over tokens instead of averaged."""

    def __init__(self):
        super().__init__()
        self.gpt = make("gpt")

    def forward(self, batch):
        logits = self.gpt.logits(batch["input_ids"], batch.get("position_ids"))
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum")


def _refusals() -> dict[str, str]:
    """Each refused use of cp=2, by name -> the error's class and message on this rank; and the
    loss infer_step returns for a batch."""
    config = sw.ParallelConfig(cp=2)
    batch = cp_batches(1)[0]
    found = {}

    def attempt(name, fn):
        try:
            fn()
            found[name] = "no error"
        except sw.ShardwiseError as exc:
            found[name] = f"{type(exc).__name__}: {exc}"

    pm = sw.parallelize(make("gpt"), config)
    pm.train_step(batch)
    found["gathered bytes"] = pm.context_parallel.gathered_bytes
    found["summary"] = pm.summary()
    attempt("sequence of 14", lambda: pm.train_step({k: v[:, :14] for k, v in batch.items()}))
    attempt("tensor batch", lambda: pm.train_step(batch["input_ids"]))
    attempt("attention_mask", lambda: pm.train_step({**batch, "attention_mask": torch.ones(4, 16)}))
    ignored = batch["labels"].clone()
    ignored[:, 4:12] = -100  # all of cp rank 1's tokens
    attempt("shard with only ignored labels", lambda: pm.train_step({**batch, "labels": ignored}))
    attempt("plain forward", lambda: pm(batch))
    found["infer_step loss"] = float(pm.infer_step(batch))
    attempt("hand-written attention", lambda: sw.parallelize(EagerAttention(), config).train_step(batch))
    attempt("labels shifted by the model", lambda: sw.parallelize(make_zoo_model("llama"), config).train_step(batch))
    attempt("loss summed over tokens", lambda: sw.parallelize(SummedLoss(), config).train_step(batch))
    eager = make("llama")
    eager.lm.config._attn_implementation = "eager"
    attempt("eager attention configured", lambda: sw.parallelize(eager, config))
    return found


def test_context_parallel_refusals():
    """What cp cannot run exactly is refused with the fix named, the same error on every rank."""
    expected = {
        "sequence of 14": "BatchError: .*pad the sequence to a multiple of 4",
        "tensor batch": "BatchError: under context parallelism .* must be a dict holding 'labels'",
        "attention_mask": "BatchError: .*cannot carry an 'attention_mask'.*label -100",
        "shard with only ignored labels": "BatchError: microbatch 0: .*cp rank 1.* only ignored labels",
        "plain forward": "ModelError: with cp > 1 a forward spans ranks.*train_step",
        "hand-written attention": "ModelError: .*softmax .*scaled_dot_product_attention",
        "labels shifted by the model": "ModelError: .*shifts its labels itself.*shift_labels=",
        "loss summed over tokens": "ModelError: .*a loss with reduction='sum' would be scaled down",
        "eager attention configured": "ModelError: lm computes attention with 'eager'.*attn_implementation='sdpa'",
    }
    ranks = sw.testing.run_on_ranks(_refusals, 2)
    summaries = [found.pop("summary") for found in ranks]
    assert ranks[0] == ranks[1]
    for name, pattern in expected.items():
        assert re.match(pattern, ranks[0][name], re.S), f"{name}: {ranks[0][name]}"
    # K/V traffic: per layer K and V, each (cp-1)/cp of the whole sequence's b x s x d_model float32 received
    gpt = make("gpt").cfg
    per_layer = 2 * (2 - 1) / 2 * 4 * 16 * gpt.d_model * 4
    assert ranks[0]["gathered bytes"] == gpt.n_layer * per_layer
    assert f"{2 * gpt.n_layer} K/V all-gathers, {gpt.n_layer * per_layer / 2**20:.2f} MiB received" in summaries[0]
    reference = float(make("gpt")(cp_batches(1)[0]).detach())
    # the loss: a weighted sum of two shard means, in float32 (a few ulps of ~4) against one process's
    assert abs(ranks[0]["infer_step loss"] - reference) <= 1e-5 * reference


def test_labels_shifted_by_the_model_are_refused_under_pp():
    """Under pp the loss is glue code replayed at the aten level, out of the routing mode's
    sight: the captured program is checked instead (parallelize does it before any stage runs)."""
    from shardwise.parallel.context.sequence import refuse_shifted_labels
    from shardwise.parallel.pipeline.program import capture_module

    shard = {k: v[:2, :8].contiguous() for k, v in cp_batches(1)[0].items()}
    with pytest.raises(ModelError, match="shifts its labels itself.*shift_labels="):
        refuse_shifted_labels(capture_module(make_zoo_model("llama"), shard, None)[0].steps)
    refuse_shifted_labels(capture_module(make("llama"), shard, None)[0].steps)  # shift_labels=: accepted
    with pytest.raises(ModelError, match="reduction='sum' would be scaled down"):  # cp=2 halved it (issue 26)
        refuse_shifted_labels(capture_module(SummedLoss(), shard, None)[0].steps)
