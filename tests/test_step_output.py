"""train_step(reduce=..., outputs=True): summed microbatches, token-weighted losses, StepOutput.

A small token model (embedding, tanh, vocabulary head) at dp=2 with 2 microbatches, against
one process, judged by tests/parity.py's bounds:
- reduce="tokens": labels are masked unevenly (replica 0 keeps far more than replica 1, and
  its microbatches differ), the forward returns (mean loss over its tokens, token count);
  losses and gradients must be one process's mean over all the step's tokens at once. The
  same at tp=2 with nothing sharded (dp=1: no replica to weight); at tp=2 with the GPT sharded
  and sequence parallel, where only the norms' tp-partial gradients are bucketed and the
  sharded weights, reduced over no replica, must take the token weight too (they were left
  unweighted, 128x the gradient, while the bucketed norms were right); and under ZeRO-2 and 3, whose
  first microbatch is reduced into the shards before the token total that weights it is known
  (the shards' sum is rescaled when it is: left as reduced, the step's gradient is off by the
  first microbatch's share).
- two reduce="tokens" steps without zero_grad: `.grad` holds one process's two backwards'
  gradients added (the first step's were weighed again by the second's token total, 90% off);
  under ZeRO-2, or after a no_sync backward, refused.
- reduce="sum": one process's sum over the four microbatch slices, halved for the 2 replicas.
- outputs=True: StepOutput.outputs holds this replica's logits, its two microbatches
  concatenated, equal to one process's logits for the replica's rows.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from parity import EPS_GRAD, EPS_LOSS, SGD, Run, assert_parity, gpt_batches, module_scales, reference_run, replica_slice
from shardwise.models.gpt import GPT, GPTConfig

STEPS = 3
VOCAB, WIDTH, BATCH, SEQ = 16, 8, 8, 6


class TokenModel(nn.Module):
    def __init__(self, count_tokens: bool):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.count_tokens = count_tokens

    def forward(self, batch):
        logits = self.head(torch.tanh(self.emb(batch["ids"])))
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
        return (loss, (batch["labels"] != -100).sum()) if self.count_tokens else (loss, logits)


class CountingGPT(GPT):
    """Our GPT returning (mean loss, token count), as a user's subclass does for reduce="tokens";
    the "gpt" plan applies to it as to its base class."""

    def forward(self, batch):
        return super().forward(batch), batch[:, 1:].numel()


def counting_gpt() -> CountingGPT:
    torch.manual_seed(0)
    return CountingGPT(GPTConfig())


def counting() -> TokenModel:
    return TokenModel(True)


def logits_model() -> TokenModel:
    return TokenModel(False)


def token_batches(masked: bool, empty_replica: bool = False) -> list[dict]:
    gen = torch.Generator().manual_seed(4)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        if masked:  # rows 0-3 (replica 0) keep 6, 5, 4, 3 labels; rows 4-7 (replica 1) keep 1 each, or none
            keep = torch.tensor([6, 5, 4, 3] + [0 if empty_replica else 1] * 4)
            labels[torch.arange(SEQ)[None, :] >= keep[:, None]] = -100
        out.append({"ids": ids, "labels": labels})
    return out


def whole_batch_loss(model, batch):
    return model(batch)[0]


def summed_slices(model, batch):
    """Σ over replicas and their microbatches of each slice's mean loss, over 2 replicas."""
    return sum(model(replica_slice(batch, k, 4))[0] for k in range(4)) / 2


def _train(config: dict, factory, batches, reduce: str, plan=None):
    pm = sw.parallelize(factory(), sw.ParallelConfig(microbatches=2, **config), plan=plan)
    opt = sw.build_optimizer(pm, torch.optim.SGD, **SGD)
    index, count = sw.data_parallel_info(pm)
    run, outputs = Run([], []), []
    for batch in batches:
        result = pm.train_step(replica_slice(batch, index, count), reduce=reduce, outputs=True)
        run.losses.append(float(result.loss))
        outputs.append((result.outputs[1], result.num_tokens))
        if not run.grads:
            run.grads.append({k: v.clone() for k, v in pm.full_grad_dict().items()})
        opt.step()
        opt.zero_grad()
    run.final = {k: v.detach().clone() for k, v in pm.full_state_dict().items()}
    return run, outputs


def _layouts(masked, plain, empty, gpt):
    return {"tokens": _train({}, counting, masked, "tokens"),
            "tokens tp2 sp": _train({"tp": 2, "sequence_parallel": True}, counting_gpt, gpt, "tokens", plan="gpt"),
            "tokens, replica 1 all ignored": _train({}, counting, empty, "tokens"),
            "tokens tp2": _train({"tp": 2}, counting, masked, "tokens", plan=sw.Plan(name="none")),
            "tokens zero2": _train({"zero": 2}, counting, masked, "tokens"),
            "tokens zero3": _train({"zero": 3}, counting, masked, "tokens"),
            "sum": _train({}, logits_model, plain, "sum")}


def test_token_weighted_summed_and_concatenated_outputs():
    masked, plain, empty = token_batches(True), token_batches(False), token_batches(True, empty_replica=True)
    gpt = gpt_batches(STEPS, BATCH)
    want_tokens = reference_run(counting, masked, loss=whole_batch_loss)
    want_gpt = reference_run(counting_gpt, gpt, loss=whole_batch_loss)
    want_empty = reference_run(counting, empty, loss=whole_batch_loss)
    want_sum = reference_run(logits_model, plain, loss=summed_slices)
    first = logits_model()
    for rank, runs in enumerate(sw.testing.run_on_ranks(_layouts, 2, masked, plain, empty, gpt)):
        for name, want in (("tokens", want_tokens), ("tokens tp2", want_tokens), ("tokens tp2 sp", want_gpt),
                           ("tokens zero2", want_tokens),
                           ("tokens zero3", want_tokens), ("sum", want_sum),
                           ("tokens, replica 1 all ignored", want_empty)):
            got, outputs = runs[name]
            assert_parity(want, got)
        _, token_outputs = runs["tokens"]
        assert [n for _, n in token_outputs] == [int((b["labels"] != -100).sum()) for b in masked]
        # outputs=True: this replica's count is its microbatches' counts summed, not averaged
        counts = [int(o) for o, _ in token_outputs]
        assert counts == [int((replica_slice(b, rank, 2)["labels"] != -100).sum()) for b in masked], counts
        logits, tokens = runs["sum"][1][0]
        assert tokens is None and logits.shape == (BATCH // 2, SEQ, VOCAB)
        expected = first(replica_slice(plain[0], rank, 2))[1].detach()
        scale = float(expected.abs().max())
        assert float((logits - expected).abs().max()) <= EPS_LOSS * scale, "logits differ from one process's"


def _token_steps_without_zero_grad(masked, gpt):
    """Two train_step(reduce="tokens") calls with no zero_grad between, as a user accumulating
    over steps writes them; the gradients summed over both, whole, per layout, or the refusal."""
    def accumulate(config, factory, batches, plan=None, nosync=False):
        pm = sw.parallelize(factory(), sw.ParallelConfig(microbatches=2, **config), plan=plan)
        index, count = sw.data_parallel_info(pm)
        try:
            for batch in batches:
                if nosync:
                    with pm.no_sync():
                        pm(replica_slice(batch, index, count))[0].backward()
                pm.train_step(replica_slice(batch, index, count), reduce="tokens")
        except sw.ShardwiseError as exc:
            return type(exc).__name__, str(exc)
        return pm.full_grad_dict()

    return {"dp2": accumulate({}, counting, masked),
            "tp2, nothing sharded (no bucket)": accumulate({"tp": 2}, counting, masked, plan=sw.Plan(name="none")),
            "tp2 sp": accumulate({"tp": 2, "sequence_parallel": True}, counting_gpt, gpt, plan="gpt"),
            "zero2": accumulate({"zero": 2}, counting, masked),
            "no_sync backward first": accumulate({}, counting, masked, nosync=True)}


def test_token_weighted_steps_accumulate_as_backward_does():
    """`.grad` after two token-weighted steps without zero_grad is one process's after two
    backwards of each batch's token mean. The step weighs its gradients by 1 / its token
    total when they are reduced, which once weighed the first step's gradients again (90% off
    at dp=2, and at one rank); they are now set aside for the step. Where they cannot be (ZeRO's
    shards; a no_sync backward's unreduced ones) the step is refused. Bound: each step's
    gradient is within EPS_GRAD of its module's largest element (tests/parity.py), so their sum
    is within EPS_GRAD times the sum of the two."""
    masked, gpt = token_batches(True)[:2], gpt_batches(2, BATCH)

    def per_step(factory, batches):
        model, grads = factory(), []
        for batch in batches:
            model.zero_grad()
            model(batch)[0].backward()
            grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
        return grads

    wants = {"tokens": per_step(counting, masked), "gpt": per_step(counting_gpt, gpt)}
    for runs in sw.testing.run_on_ranks(_token_steps_without_zero_grad, 2, masked, gpt):
        for name in ("dp2", "tp2, nothing sharded (no bucket)", "tp2 sp"):
            steps = wants["gpt" if name == "tp2 sp" else "tokens"]
            scales = [module_scales(grads) for grads in steps]
            assert set(runs[name]) == set(steps[0]), name
            for key, got in runs[name].items():
                bound = EPS_GRAD * (scales[0][key] + scales[1][key])
                error = float((got - steps[0][key] - steps[1][key]).abs().max())
                assert error <= bound, (name, key, error, bound)
        assert runs["zero2"][0] == "ShardwiseError" and "without zero_grad in between" in runs["zero2"][1]
        assert runs["no_sync backward first"][0] == "ConfigError" and "under no_sync()" in runs["no_sync backward first"][1]


def test_reduce_is_checked():
    from shardwise.step_output import check_reduce

    with pytest.raises(sw.ConfigError, match="use one of"):
        check_reduce("median", False, False, False)
    with pytest.raises(sw.ConfigError, match="not available with pp > 1 or cp > 1"):
        check_reduce("tokens", False, True, False)
    with pytest.raises(sw.ConfigError, match="not available with pp > 1 or cp > 1"):
        check_reduce("mean", True, False, True)
    check_reduce("sum", False, True, True)  # summing works everywhere
