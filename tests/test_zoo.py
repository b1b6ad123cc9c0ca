"""Zoo plans on tiny random-weight Hugging Face models against one process: tp, their
sequence-parallel variants, pipelines.

Each model sits inside the user's own end2end module (`self.lm`), as users write it; the
zoo plan finds its class wherever it is in the tree.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import transformers
from torch import nn

import shardwise as sw
from parity import EPS_GRAD, EPS_LOSS, Case, compare_cases, corpus_batches, run_and_compare

COMMON = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
              intermediate_size=64, max_position_embeddings=64)


class EndToEnd(nn.Module):
    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, batch):
        return self.lm(input_ids=batch["input_ids"], labels=batch["labels"]).loss


def make(kind: str, dropout: float = 0.0) -> EndToEnd:
    """`dropout`: GPT-2's embedding and residual dropout (attention dropout stays 0: on head
    shards it cannot draw one process's masks)."""
    torch.manual_seed(0)
    t = transformers
    if kind in ("llama", "qwen2", "mistral"):
        config_class, model_class = {
            "llama": (t.LlamaConfig, t.LlamaForCausalLM),
            "qwen2": (t.Qwen2Config, t.Qwen2ForCausalLM),
            "mistral": (t.MistralConfig, t.MistralForCausalLM),
        }[kind]
        return EndToEnd(model_class(config_class(num_key_value_heads=2, **COMMON)))
    if kind == "gpt2":
        config = t.GPT2Config(vocab_size=64, n_embd=32, n_head=4, n_layer=2, n_positions=64,
                              resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        return EndToEnd(t.GPT2LMHeadModel(config))
    config = t.BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **COMMON)
    return EndToEnd(t.BertForMaskedLM(config))


def batches(kind: str, steps: int = 4):
    """Corpus text; BERT masks 5 random positions of each row's 16 and predicts them (loss
    elsewhere ignored). The same count in every row: HF's loss is a mean over the batch's
    unmasked labels, so replicas (or microbatches) with different counts would be averaged
    with other weights than one process's mean over all of them, as under DDP."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for tokens in corpus_batches(steps, 4, seq=15):
        ids = tokens.clone()
        labels = ids.clone()
        if kind == "bert":  # masked-LM
            order = torch.rand(ids.shape, generator=gen).argsort(dim=1)
            masked = torch.zeros(ids.shape, dtype=torch.bool).scatter_(1, order[:, :5], True)
            labels[~masked] = -100
            ids[masked] = 63
        out.append({"input_ids": ids, "labels": labels})
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "gpt2", "bert"])
def test_zoo_plan_parity(kind):
    run_and_compare(2, {"tp": 2}, functools.partial(make, kind), batches(kind), plan=kind)


def _evaluate_then_train(kinds):
    """Each model at tp=2 under its plan (loss parallel): the loss of a forward under
    torch.inference_mode (Lightning's and HF's evaluation), then of a train_step."""
    out = {}
    for kind in kinds:
        pm = sw.parallelize(make(kind), sw.ParallelConfig(tp=2), plan=kind)
        batch = batches(kind, 1)[0]
        pm.eval()
        with torch.inference_mode():
            evaluated = float(pm(batch))
        pm.train()
        out[kind] = evaluated, float(pm.train_step(batch))
    return out


def test_evaluation_under_inference_mode():
    """Under inference_mode the loss-parallel cross-entropy failed ("mixed torch.Tensor and
    DTensor": inference tensors skip the keys where it decomposes into the ops torch's loss
    parallel handles); it must equal one process's loss, and training go on after it. Bound:
    tests/parity.py's EPS_LOSS, relative."""
    kinds = ["llama", "gpt2", "bert"]
    for results in sw.testing.run_on_ranks(_evaluate_then_train, 2, kinds):
        for kind in kinds:
            model = make(kind)
            with torch.no_grad():
                want = float(model(batches(kind, 1)[0]))
            for got in results[kind]:
                assert abs(got - want) <= EPS_LOSS * abs(want), (kind, results[kind], want)


PROMPT = torch.tensor([[5, 17, 3, 40], [12, 7, 29, 2]])
GENERATE_LAYOUTS = {"tp2": ({"tp": 2}, "llama", False), "zero3": ({"zero": 3}, None, False),
                    "zero3 inside whole_parameters()": ({"zero": 3}, None, True),
                    "tp2 sp": ({"tp": 2, "sequence_parallel": True}, "llama", False)}


def _generate(model: nn.Module, whole: contextlib.AbstractContextManager = contextlib.nullcontext()):
    """transformers' greedy `generate` on the Llama inside `model`: the tokens and each step's logits."""
    with whole:
        out = model.lm.generate(PROMPT, max_new_tokens=6, do_sample=False, output_logits=True,
                                return_dict_in_generate=True, pad_token_id=0)
    return out.sequences, torch.stack(out.logits)


def _generate_in_layouts():
    out = {}
    for name, (config, plan, whole) in GENERATE_LAYOUTS.items():
        model = make("llama")
        pm = sw.parallelize(model, sw.ParallelConfig(**config), plan=plan)
        try:
            out[name] = _generate(model, pm.whole_parameters() if whole else contextlib.nullcontext())
        except sw.ShardwiseError as error:
            out[name] = f"{type(error).__name__}: {error}"
    return out


def test_generate_on_the_hugging_face_model():
    """transformers' `generate` called on the model a ParallelModule holds (users sample during
    training). Under a loss-parallel tp plan it met torch's DTensor argmax over vocabulary shards
    (a raw shape error); inside ZeRO-3's `whole_parameters()` its forwards released the buffers
    the block's end reads. Each step's logits must be one process's within tests/parity.py's
    EPS_GRAD of their largest (a forward's rounding, below the forward and backward's that bound
    covers), and the tokens the same: the reference's top two logits differ by more than twice
    that at every step, so rounding cannot change which wins. Under sequence parallelism the
    one-token steps cannot be cut over tp: a PlanError on every rank, not a hang."""
    want_tokens, want_logits = _generate(make("llama"))
    top2 = want_logits.topk(2, dim=-1).values
    bounds = EPS_GRAD * want_logits.abs().amax(dim=-1)
    assert bool((top2[..., 0] - top2[..., 1] > 2 * bounds).all()), "the prompt's greedy choices are too close to call"
    for results in sw.testing.run_on_ranks(_generate_in_layouts, 2):
        for name in ("tp2", "zero3", "zero3 inside whole_parameters()"):
            assert not isinstance(results[name], str), (name, results[name])
            tokens, logits = results[name]
            assert torch.equal(tokens, want_tokens), (name, tokens, want_tokens)
            assert bool(((logits - want_logits).abs() <= bounds[..., None]).all()), name
        assert results["tp2 sp"].startswith("PlanError: cannot shard a tensor of shape"), results["tp2 sp"]


DECODERS = ["llama", "qwen2", "mistral", "gpt2"]
PIPELINE_LAYOUTS = {
    2: {"pp2 1f1b": {"pp": 2, "microbatches": 2},
        "pp2 interleaved": {"pp": 2, "microbatches": 4, "schedule": "interleaved-1f1b"}},
    4: {"pp2 x tp2": {"pp": 2, "tp": 2, "microbatches": 2},
        "pp2 x dp2 zero1": {"pp": 2, "zero": 1, "microbatches": 2},
        "pp4": {"pp": 4, "microbatches": 4}},
}


@pytest.mark.parametrize("world", sorted(PIPELINE_LAYOUTS))
def test_pipeline_on_hugging_face_decoders(world):
    """Each decoder's stages run only their part of the model (embedding, rotary or position
    embedding, layers, final norm, head), its causal mask and position ids rebuilt per stage.
    The model keeps HF's default use_cache=True: the empty cache it builds is not shared."""
    cases = [Case(f"{kind} {name}", config, functools.partial(make, kind), batches(kind),
                  plan=kind if config.get("tp", 1) > 1 else None)
             for kind in DECODERS for name, config in PIPELINE_LAYOUTS[world].items()]
    compare_cases(world, cases)


def _bf16_pipeline(batch):
    out = []
    for deferred in (False, True):
        model = sw.deferred_init(make, "llama") if deferred else make("llama")
        pm = sw.parallelize(model, sw.ParallelConfig(pp=2, microbatches=2, param_dtype=torch.bfloat16), sample=batch)
        loss = pm.train_step(batch)
        out.append((loss, {k: v.clone() for k, v in pm.full_grad_dict().items()}))
    return out


def test_a_bf16_pipeline_computes_what_the_bf16_model_computes():
    """With param_dtype=bf16 the stages run what the model cast to bf16 runs in one process,
    Hugging Face's loss upcasting the bf16 logits to float32 included. The forward was captured
    on the float32 model, where that upcast is a no-op that records nothing, so the stages
    computed the cross-entropy in bf16: the loss came back rounded to bf16 (4.15625 for
    4.15732) and gradients up to 1.4% of their largest off. Exact: the same ops on the same
    values in the same order, each microbatch's gradients accumulating in bf16 .grad as one
    process's do (Llama's head is untied; a tied one sums its stages' gradients in another
    order). Built eagerly and by deferred init (whose fake tensors the capture shares)."""
    batch = batches("llama")[0]
    model = make("llama").to(torch.bfloat16)
    losses = []
    for half in (slice(0, 2), slice(2, 4)):  # the pipeline's two microbatches
        loss = model({k: v[half] for k, v in batch.items()})
        (loss / 2).backward()
        losses.append(loss.detach())
    want = torch.stack(losses).mean()
    for rank in sw.testing.run_on_ranks(_bf16_pipeline, 2, batch):
        for loss, grads in rank:
            assert loss.dtype == torch.float32 and torch.equal(loss, want), (loss, want)
            for name, p in model.named_parameters():
                assert torch.equal(grads[name].to(p.grad.dtype), p.grad), name


SEQUENCE_PARALLEL = {2: {"tp": 2, "sequence_parallel": True}, 4: {"tp": 2, "dp": 2, "sequence_parallel": True}}


@pytest.mark.parametrize("world", sorted(SEQUENCE_PARALLEL))
def test_sequence_parallel_variants(world):
    """Each zoo plan's sequence-parallel variant: norms, residuals (and GPT-2's dropout, with
    one process's masks) on sequence shards; the mask and rotary positions built for the whole
    sequence; the attention input gathered once for q, k and v."""
    config = SEQUENCE_PARALLEL[world]
    cases = [Case(f"{kind} {config}", config, functools.partial(make, kind), batches(kind), plan=kind)
             for kind in DECODERS + ["bert"]]
    if world == 2:  # (replicas draw their own masks: one process's exist only without dp)
        cases.append(Case(f"gpt2 dropout {config}", config, functools.partial(make, "gpt2", 0.2), batches("gpt2"),
                          plan="gpt2"))
    compare_cases(world, cases)


def test_zoo_lists_its_plans():
    assert list(sw.plan.zoo) == ["bert", "gpt", "gpt2", "llama", "mistral", "mixtral", "qwen2", "qwen2_moe"]
    with pytest.raises(sw.PlanError, match="no zoo plan named 'falcon'; the zoo has bert, gpt, gpt2"):
        sw.plan.zoo["falcon"]
    with pytest.raises(sw.PlanError, match="neither a zoo plan"):
        sw.parallelize(make("llama"), plan="falcon")


def test_zoo_plan_on_the_wrong_model():
    with pytest.raises(sw.PlanError, match="applies to LlamaForCausalLM modules, but EndToEnd contains none"):
        sw.parallelize(make("gpt2"), sw.ParallelConfig(), plan="llama")


@pytest.mark.parametrize("kind", ["llama", "bert"])
def test_deferred_init_of_hugging_face_models(kind):
    """Transformers skips its weight init on the meta device; deferred init must still match eager."""
    run_and_compare(2, {"tp": 2}, functools.partial(make, kind), batches(kind), plan=kind, deferred=True)


DEFERRED_PIPELINE_SCRIPT = """
import shardwise as sw
from test_zoo import batches, make
sw.init_distributed()
pm = sw.parallelize(sw.deferred_init(make, "llama"), sw.ParallelConfig(pp=2, microbatches=2), sample=batches("llama")[0])
print(float(pm.train_step(batches("llama")[0])), flush=True)
"""


def test_deferred_pipeline_script_exits_cleanly():
    """A user's script, torchrun-style: a deferred Hugging Face Llama in two pipeline stages,
    one step, then the interpreter's own shutdown. Fault it catches: the deferred record's
    fake tensors kept to that shutdown, where they corrupted the heap (glibc aborts with
    "corrupted double-linked list" on every run)."""
    from launch import free_port, launch, torchrun_environment

    port = free_port()
    outputs = launch(DEFERRED_PIPELINE_SCRIPT, [torchrun_environment(r, 2, port) for r in range(2)])
    assert [code for code, _, _ in outputs] == [0, 0], [(code, err[-2000:]) for code, _, err in outputs]
    assert len({out for _, out, _ in outputs}) == 1, outputs  # every rank returns the last stage's loss
