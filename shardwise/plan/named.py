"""Named plans for well-known models: `plan="gpt"`, `"llama"`, `"qwen2"`, `"mistral"`, `"mixtral"`,
`"qwen2_moe"`, `"gpt2"`, `"bert"`.

Each entry builds a `Plan` for a ParallelConfig (the sequence-parallel variant differs:
norms, dropout and residuals on sequence shards, the sequence gathered where attention or
a column-parallel MLP reads it and reduce-scattered after the row-parallel projection).
Plans for Hugging Face classes are relative to that class (`applies_to`), so they apply
wherever the model sits inside a user's end2end module. The layout is Megatron's: attention
q/k/v and the first MLP projection column-parallel, the attention output and second MLP
projection row-parallel (one all-reduce per pair forward and one backward), the token
embedding vocab-parallel and the output head column-parallel over the vocabulary with a
loss-parallel cross-entropy, so logits are never gathered whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Callable, Iterator

from ..config import ParallelConfig
from ..errors import PlanError
from .plan import Plan

COL, ROW, SEQ = "Shard(0)", "Shard(1)", "Shard(1)"  # Linear weight (out, in); activations (batch, seq, hidden)
REPLICATE_TO_SEQ, SEQ_TO_REPLICATE = "Replicate() -> Shard(1)", "Shard(1) -> Replicate()"


def _sp(keys_in: list[str], keys_out: list[str]) -> dict[str, str]:
    return {**{f"{k}.input": SEQ for k in keys_in}, **{f"{k}.output": SEQ for k in keys_out}}


def gpt(config: ParallelConfig) -> Plan:
    """shardwise.models.GPT."""
    params = {
        "wte.weight": COL,  # vocab-parallel; the tied lm_head is then column-parallel over the vocabulary
        "layers.*.attn.q_proj.weight": COL, "layers.*.attn.q_proj.bias": COL,
        "layers.*.attn.k_proj.weight": COL,
        "layers.*.attn.v_proj.weight": COL, "layers.*.attn.v_proj.bias": COL,
        "layers.*.attn.o_proj.weight": ROW,
        "layers.*.mlp.fc1.weight": COL, "layers.*.mlp.fc1.bias": COL,
        "layers.*.mlp.fc2.weight": ROW,
    }
    activations = {}
    if config.sequence_parallel:
        activations = _sp(
            ["layers.*.ln1", "layers.*.ln2", "layers.*.drop", "layers.*.attn.q_proj", "layers.*.attn.k_proj",
             "layers.*.attn.v_proj", "layers.*.mlp.fc1", "ln_f", "lm_head"],
            ["drop", "layers.*.attn.o_proj", "layers.*.mlp.fc2"],
        )
    return Plan(params=params, activations=activations, loss_parallel=["lm_head"], applies_to="GPT", name="gpt")


def _llama_like(name: str, root: str, config: ParallelConfig, bias: bool, mlp: str | None = "mlp") -> Plan:
    """Llama's layout; `mlp`: the dense MLP's path in a layer (None: a mixture of experts only,
    which tp leaves whole: its experts are split by ep instead). Under sequence parallelism a
    mixture of experts routes and computes this rank's sequence shard (router and expert
    gradients then partial over tp)."""
    params = {
        "model.embed_tokens.weight": COL,
        "model.layers.*.self_attn.q_proj.weight": COL,
        "model.layers.*.self_attn.k_proj.weight": COL,
        "model.layers.*.self_attn.v_proj.weight": COL,
        "model.layers.*.self_attn.o_proj.weight": ROW,
        "lm_head.weight": COL,
    }
    if mlp is not None:
        params.update({f"model.layers.*.{mlp}.gate_proj.weight": COL, f"model.layers.*.{mlp}.up_proj.weight": COL,
                       f"model.layers.*.{mlp}.down_proj.weight": ROW})
    if bias:  # Qwen2: q/k/v projections have biases
        params.update({f"model.layers.*.self_attn.{p}_proj.bias": COL for p in "qkv"})
    activations = {}
    if config.sequence_parallel:
        layer = "model.layers.*"
        activations = {
            # the model builds its causal mask and rotary positions from the whole embedding
            # output; the first layer cuts it into sequence shards
            "model.layers.0.input": REPLICATE_TO_SEQ,
            f"{layer}.input_layernorm.input": SEQ,
            # the attention reads hidden_states.shape for its head views: gather it there
            f"{layer}.self_attn.input": SEQ_TO_REPLICATE,
            f"{layer}.self_attn.o_proj.output": SEQ,
            f"{layer}.post_attention_layernorm.input": SEQ,
            "model.norm.input": SEQ,
            "lm_head.input": SEQ,
        }
        if mlp == "mlp":
            activations.update({f"{layer}.mlp.gate_proj.input": SEQ, f"{layer}.mlp.up_proj.input": SEQ,
                                f"{layer}.mlp.down_proj.output": SEQ})
        else:  # a mixture of experts on this rank's sequence shard: its tokens flattened, so shards of dim 0
            tokens = "Shard(0)"
            activations.update({f"{layer}.mlp.input": SEQ, f"{layer}.mlp.gate.input": tokens,
                                f"{layer}.mlp.experts.input": tokens})
            if mlp is not None:  # the shared expert, column/row parallel over the gathered tokens
                activations.update({f"{layer}.{mlp}.gate_proj.input": tokens, f"{layer}.{mlp}.up_proj.input": tokens,
                                    f"{layer}.{mlp}.down_proj.output": tokens,
                                    f"{layer}.mlp.shared_expert_gate.input": tokens})
    return Plan(params=params, activations=activations, loss_parallel=["lm_head"], applies_to=root, name=name)


def llama(config: ParallelConfig) -> Plan:
    """transformers LlamaForCausalLM."""
    return _llama_like("llama", "LlamaForCausalLM", config, bias=False)


def qwen2(config: ParallelConfig) -> Plan:
    """transformers Qwen2ForCausalLM."""
    return _llama_like("qwen2", "Qwen2ForCausalLM", config, bias=True)


def mistral(config: ParallelConfig) -> Plan:
    """transformers MistralForCausalLM."""
    return _llama_like("mistral", "MistralForCausalLM", config, bias=False)


def mixtral(config: ParallelConfig) -> Plan:
    """transformers MixtralForCausalLM: attention, embedding and head as Llama's; the experts
    whole on each tp rank (split over ep ranks with ParallelConfig(ep=...))."""
    return _llama_like("mixtral", "MixtralForCausalLM", config, bias=False, mlp=None)


def qwen2_moe(config: ParallelConfig) -> Plan:
    """transformers Qwen2MoeForCausalLM: as Qwen2's, the shared expert as its MLP; the routed
    experts whole on each tp rank (split over ep ranks with ParallelConfig(ep=...))."""
    return _llama_like("qwen2_moe", "Qwen2MoeForCausalLM", config, bias=True, mlp="mlp.shared_expert")


def gpt2(config: ParallelConfig) -> Plan:
    """transformers GPT2LMHeadModel (Conv1D weights are (in, out): column = Shard(1))."""
    params = {
        "transformer.wte.weight": COL,  # tied with lm_head: vocab-parallel, loss-parallel head
        "transformer.h.*.attn.c_attn.weight": "StridedShard(1, 3)",  # fused q|k|v: shard each block
        "transformer.h.*.attn.c_proj.weight": "Shard(0)",
        "transformer.h.*.mlp.c_fc.weight": "Shard(1)",
        "transformer.h.*.mlp.c_proj.weight": "Shard(0)",
    }
    activations = {}
    if config.sequence_parallel:
        block = "transformer.h.*"
        activations = {
            "transformer.drop.input": REPLICATE_TO_SEQ,  # after the causal mask is built from the whole sequence
            f"{block}.ln_1.input": SEQ,
            f"{block}.attn.input": SEQ_TO_REPLICATE,
            f"{block}.attn.c_proj.output": SEQ,
            f"{block}.attn.resid_dropout.input": SEQ,
            f"{block}.ln_2.input": SEQ,
            f"{block}.mlp.c_fc.input": SEQ,
            f"{block}.mlp.c_proj.output": SEQ,
            f"{block}.mlp.dropout.input": SEQ,
            "transformer.ln_f.input": SEQ,
            "transformer.ln_f.output": "Replicate()",  # GPT2Model views it with the whole sequence's shape
        }
    return Plan(params=params, activations=activations, loss_parallel=["lm_head"],
                divide_by_tp=["transformer.h.*.attn.split_size"], applies_to="GPT2LMHeadModel", name="gpt2")


def bert(config: ParallelConfig) -> Plan:
    """transformers BertForMaskedLM."""
    layer = "bert.encoder.layer.*"
    params = {
        "bert.embeddings.word_embeddings.weight": COL,  # tied with the MLM decoder
        f"{layer}.attention.self.query.weight": COL, f"{layer}.attention.self.query.bias": COL,
        f"{layer}.attention.self.key.weight": COL, f"{layer}.attention.self.key.bias": COL,
        f"{layer}.attention.self.value.weight": COL, f"{layer}.attention.self.value.bias": COL,
        f"{layer}.attention.output.dense.weight": ROW,
        f"{layer}.intermediate.dense.weight": COL, f"{layer}.intermediate.dense.bias": COL,
        f"{layer}.output.dense.weight": ROW,
        "cls.predictions.decoder.bias": COL,
    }
    activations = {}
    if config.sequence_parallel:
        activations = {
            "bert.encoder.layer.0.input": REPLICATE_TO_SEQ,  # after the attention mask is built
            f"{layer}.attention.self.input": SEQ_TO_REPLICATE,  # BertSelfOutput reads the sharded residual
            f"{layer}.attention.output.dense.output": SEQ,
            f"{layer}.attention.output.dropout.input": SEQ,
            f"{layer}.attention.output.LayerNorm.input": SEQ,
            f"{layer}.intermediate.dense.input": SEQ,
            f"{layer}.output.dense.output": SEQ,
            f"{layer}.output.dropout.input": SEQ,
            f"{layer}.output.LayerNorm.input": SEQ,
            "cls.predictions.transform.dense.input": SEQ,
            "cls.predictions.transform.LayerNorm.input": SEQ,
            "cls.predictions.decoder.input": SEQ,
        }
    return Plan(params=params, activations=activations, loss_parallel=["cls.predictions.decoder"],
                applies_to="BertForMaskedLM", name="bert")


class Zoo(Mapping):
    """Plan builders by name: `zoo["llama"](config)` is a Plan; `list(zoo)` the names."""

    def __init__(self, builders: dict[str, Callable[[ParallelConfig], Plan]]):
        self._builders = dict(builders)

    def __getitem__(self, name: str) -> Callable[[ParallelConfig], Plan]:
        if name not in self._builders:
            raise PlanError(f"no zoo plan named {name!r}; the zoo has {', '.join(sorted(self._builders))}")
        return self._builders[name]

    def __contains__(self, name: object) -> bool:
        return name in self._builders

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._builders))

    def __len__(self) -> int:
        return len(self._builders)

    def __repr__(self) -> str:
        return f"zoo plans: {', '.join(self)}"


zoo = Zoo({"gpt": gpt, "llama": llama, "qwen2": qwen2, "mistral": mistral, "mixtral": mixtral, "qwen2_moe": qwen2_moe,
           "gpt2": gpt2, "bert": bert})
