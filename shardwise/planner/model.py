"""What the planner knows about a model: its shapes and its parameters by how they shard.

A `ModelSpec` comes from a name in `MODELS` (published configurations), a Hugging Face
config, or an `nn.Module` (our GPT or a Hugging Face causal LM, alone or inside a user's
end2end module; meta and deferred modules work, nothing runs). From a module the parameter
counts are exact: each parameter is counted as its zoo plan places it (sharded by tensor
parallelism or replicated) and by where it sits (before, inside or after the layer list).
From a config they are the architecture's arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from ..errors import ConfigError, ModelError

ATTENTION_KINDS = ("flash", "eager", "megatron")
MAX_LAYERS = 10_000  # the stage balance is a dynamic program over layers x stages: beyond this it would not fit


@dataclass(frozen=True)
class ModelSpec:
    """Shapes and parameter counts of a decoder-style transformer.

    `*_params` pairs are (sharded by tensor parallelism, replicated across it): per block
    of the layer list, before it (embeddings) and after it (final norm, untied head).
    `mlp` is "gelu" (two matrices of width ffn) or "swiglu" (three); `norm` "layernorm"
    (keeps its output and mean/rstd) or "rmsnorm": with `norm_float32` Hugging Face's, which
    computes in float32 and keeps x*rsqrt, the output and rsqrt in float32; without it a fused
    kernel that keeps one tensor of the activations' size and rsqrt (torchtitan's fused_rmsnorm,
    Megatron-LM's and Transformer Engine's). `plan` is the zoo plan that lays it out. A mixture of
    experts has `experts` per layer, `top_k` of them per token, and `expert_params` per layer
    (all its experts, of width `ffn` each; tp leaves them whole, ep splits them); its
    `layer_params` are the rest of a block (attention, norms, router, a shared expert).
    `attention` is "flash" (one fused kernel that never writes the scores: torch's SDPA,
    flash attention), "eager" (Hugging Face's eager attention: the whole s x s square of
    scores written, scaled, masked and softmaxed in float32 in memory) or "megatron"
    (Megatron-LM before 2023: the square through its fused scale-mask-softmax and dropout).
    `loss_float32`: the cross-entropy runs on float32 logits (Hugging Face's causal-LM loss
    upcasts them), else in the logits' dtype (our GPT). `fused_loss`: it is a fused kernel
    (Megatron's vocab-parallel cross-entropy, flash-attn's, a compiled loss) that writes the
    logits' gradient in place, holding nothing beyond what it keeps; torch's eager one (what
    shardwise runs: `pmodel.compile()` compiles the blocks) holds two gradients of its size.
    """

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    mlp: str
    norm: str
    layer_params: tuple[int, int]
    embed_params: tuple[int, int]
    head_params: tuple[int, int]
    plan: str | None = None
    max_seq: int | None = None  # learned position embeddings bound the sequence
    experts: int = 0
    top_k: int = 0
    expert_params: int = 0
    attention: str = "flash"
    loss_float32: bool = True  # the cross-entropy upcasts the logits (Hugging Face's loss); else their dtype
    fused_loss: bool = False  # a fused cross-entropy: the logits' gradient computed in place
    norm_float32: bool = True  # RMSNorm in float32, its float32 tensors kept (Hugging Face's); else a fused kernel's

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_KINDS:
            raise ConfigError(f"ModelSpec(attention={self.attention!r}) is 'flash' (a fused kernel: torch's SDPA, flash "
                              "attention), 'eager' (Hugging Face's eager attention) or 'megatron' (Megatron-LM's "
                              "fused softmax): the last two write the s x s scores to memory")
        for name in ("experts", "top_k", "expert_params"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"ModelSpec({name}={value!r}) must be an integer >= 0")
        if self.experts and not (1 <= self.top_k <= self.experts and self.expert_params > 0):
            raise ConfigError(f"ModelSpec(experts={self.experts}, top_k={self.top_k}, expert_params="
                              f"{self.expert_params}): a mixture of experts needs 1 <= top_k <= experts and its "
                              "experts' parameter count")
        for name in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"ModelSpec({name}={value!r}) must be a positive integer")
        if self.layers > MAX_LAYERS:
            raise ConfigError(f"ModelSpec(layers={self.layers}) is more than the planner plans for ({MAX_LAYERS}): the "
                              "largest published models have ~100-200 layers; check the spec")
        if not isinstance(self.norm_float32, bool) or (self.norm == "layernorm" and not self.norm_float32):
            raise ConfigError(f"ModelSpec(norm_float32={self.norm_float32!r}) says whether an RMSNorm keeps float32 "
                              f"tensors (True, Hugging Face's) or is a fused kernel (False); norm={self.norm!r} "
                              "takes the default")
        if self.mlp not in ("gelu", "swiglu") or self.norm not in ("layernorm", "rmsnorm"):
            raise ConfigError(f"ModelSpec(mlp={self.mlp!r}, norm={self.norm!r}): mlp is 'gelu' or 'swiglu', norm "
                              "'layernorm' or 'rmsnorm'")

    @property
    def keeps_float32_norm(self) -> bool:
        """Whether the norms keep float32 tensors (Hugging Face's RMSNorm) rather than one of the
        activations' size (LayerNorm, a fused RMSNorm)."""
        return self.norm == "rmsnorm" and self.norm_float32

    @property
    def params(self) -> int:
        return self.layers * (sum(self.layer_params) + self.expert_params) + sum(self.embed_params) + sum(self.head_params)

    @property
    def up_projections(self) -> int:
        """Matrices of width ffn an MLP's input goes through: swiglu's gate and up, gelu's one."""
        return 2 if self.mlp == "swiglu" else 1

    @property
    def weight_matmuls(self) -> list[tuple[str, float, float, bool]]:
        """A dense block's weight matmuls in forward order, as (name, output width, input width,
        row-parallel under tp): q, k, v (GPT-2's one fused c_attn), o, the MLP's up
        projection(s) and down. What selective recompute keeps or reruns is counted in these
        (parallel/recompute.py). Mixtures of experts: their experts' matmuls vary by
        implementation, so none (the planner does not model selective-alternate for them)."""
        if self.experts:
            return []
        h, kv = self.hidden, self.kv_heads * self.hidden // self.heads
        attention = [("qkv", h + 2 * kv, h, False)] if self.plan == "gpt2" else \
            [("q", h, h, False), ("k", kv, h, False), ("v", kv, h, False)]
        ups = [("gate", self.ffn, h, False), ("up", self.ffn, h, False)] if self.mlp == "swiglu" else \
            [("up", self.ffn, h, False)]
        return [*attention, ("o", h, h, True), *ups, ("down", h, self.ffn, True)]

    @property
    def active_expert_params(self) -> float:
        """Parameters of one layer's experts that a token's forward multiplies by (top_k of them)."""
        return self.expert_params * self.top_k / self.experts if self.experts else 0.0

    @property
    def dense_params(self) -> float:
        """Parameters a token's forward multiplies by (embedding lookups excluded; top_k experts)."""
        return self.layers * (sum(self.layer_params) + self.active_expert_params) + sum(self.head_params) + (
            self.embed_params[0] if self.head_params[0] == 0 else 0)  # a tied head multiplies by the embedding

    def check_tp(self, tp: int) -> str | None:
        """Why `tp` cannot split this model (None when it can)."""
        for what, n in (("heads", self.heads), ("kv_heads", self.kv_heads), ("ffn", self.ffn), ("vocab", self.vocab)):
            if n % tp:
                return f"{what}={n} is not divisible by tp={tp}"
        return None


def llama_like(name: str, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int,
               tied: bool = False, qkv_bias: bool = False, plan: str = "llama") -> ModelSpec:
    """A Llama/Qwen2/Mistral decoder: RMSNorm, rotary positions, SwiGLU MLP, GQA."""
    head_dim = hidden // heads
    kv = kv_heads * head_dim
    sharded = hidden * hidden * 2 + 2 * hidden * kv + 3 * hidden * ffn + (hidden + 2 * kv if qkv_bias else 0)
    return ModelSpec(name, layers, hidden, heads, kv_heads, ffn, vocab, "swiglu", "rmsnorm",
                     layer_params=(sharded, 2 * hidden), embed_params=(vocab * hidden, 0),
                     head_params=(0 if tied else vocab * hidden, hidden), plan=plan)


def moe_like(name: str, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int, experts: int,
             top_k: int, shared_ffn: int = 0, qkv_bias: bool = False, plan: str = "mixtral") -> ModelSpec:
    """A Mixtral / Qwen2-MoE decoder: Llama's attention, a router, `experts` SwiGLU experts of
    width `ffn` (a shared expert of width `shared_ffn` with its gate, Qwen's)."""
    dense = llama_like(name, layers, hidden, heads, kv_heads, max(shared_ffn, 1), vocab, qkv_bias=qkv_bias, plan=plan)
    sharded, replicated = dense.layer_params
    sharded -= 3 * hidden * max(shared_ffn, 1) - 3 * hidden * shared_ffn  # the shared expert, if any, as an MLP
    replicated += hidden * experts + (hidden if shared_ffn else 0)  # router, shared expert's gate
    return replace(dense, ffn=ffn, layer_params=(sharded, replicated), experts=experts, top_k=top_k,
                   expert_params=experts * 3 * hidden * ffn)


def gpt2_like(name: str, layers: int, hidden: int, heads: int, vocab: int, max_seq: int) -> ModelSpec:
    """GPT-2 (Hugging Face): LayerNorm, learned positions, GELU MLP of 4h, tied head; the
    zoo plan shards the Conv1D weights and keeps their biases replicated."""
    sharded = 12 * hidden * hidden
    replicated = 3 * hidden + hidden + 4 * hidden + hidden + 4 * hidden  # c_attn, c_proj, c_fc, c_proj biases; 2 norms
    return ModelSpec(name, layers, hidden, heads, heads, 4 * hidden, vocab, "gelu", "layernorm",
                     layer_params=(sharded, replicated), embed_params=(vocab * hidden, max_seq * hidden),
                     head_params=(0, 2 * hidden), plan="gpt2", max_seq=max_seq)


# Published configurations (model cards and papers).
MODELS: dict[str, ModelSpec] = {
    "llama3-8b": llama_like("llama3-8b", 32, 4096, 32, 8, 14336, 128256),
    "llama3-70b": llama_like("llama3-70b", 80, 8192, 64, 8, 28672, 128256),
    "llama3-405b": llama_like("llama3-405b", 126, 16384, 128, 8, 53248, 128256),
    "qwen2-7b": llama_like("qwen2-7b", 28, 3584, 28, 4, 18944, 152064, qkv_bias=True, plan="qwen2"),
    "mistral-7b": llama_like("mistral-7b", 32, 4096, 32, 8, 14336, 32000, plan="mistral"),
    "gpt2": gpt2_like("gpt2", 12, 768, 12, 50257, 1024),
    "mixtral-8x7b": moe_like("mixtral-8x7b", 32, 4096, 32, 8, 14336, 32000, experts=8, top_k=2),
}


def _gpt_spec(cfg: Any) -> ModelSpec:
    """Our reference GPT (shardwise.models.GPT): q/v/o/fc biases, no key bias, tied head."""
    h, f = cfg.d_model, 4 * cfg.d_model
    sharded = 3 * h * h + 2 * h + h * h + 2 * h * f + f  # q,k,v (+q,v bias), o, fc1 (+bias), fc2
    replicated = 2 * h + 4 * h  # o and fc2 biases; two LayerNorms
    return ModelSpec("gpt", cfg.n_layer, h, cfg.n_head, cfg.n_head, f, cfg.vocab_size, "gelu", "layernorm",
                     layer_params=(sharded, replicated), embed_params=(cfg.vocab_size * h, cfg.block_size * h),
                     head_params=(0 if cfg.tie_embeddings else cfg.vocab_size * h, 2 * h), plan="gpt",
                     max_seq=cfg.block_size, loss_float32=False)


def from_hf_config(config: Any) -> ModelSpec:
    """A spec from a transformers config (llama, qwen2, mistral, gpt2)."""
    spec = _from_hf_shapes(config)
    # transformers resolves its default (sdpa) when it builds the model; a config asking for eager attention
    # materializes the scores
    return replace(spec, attention="eager") if getattr(config, "_attn_implementation", None) == "eager" else spec


def _from_hf_shapes(config: Any) -> ModelSpec:
    kind = getattr(config, "model_type", None)
    if kind in ("llama", "qwen2", "mistral"):
        return llama_like(kind, config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
                          getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
                          config.intermediate_size, config.vocab_size, tied=bool(config.tie_word_embeddings),
                          qkv_bias=kind == "qwen2", plan=kind)
    if kind == "gpt2":
        return gpt2_like("gpt2", config.n_layer, config.n_embd, config.n_head, config.vocab_size, config.n_positions)
    if kind in ("mixtral", "qwen2_moe"):
        qwen = kind == "qwen2_moe"
        return replace(moe_like(
            kind, config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
            getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            config.moe_intermediate_size if qwen else config.intermediate_size, config.vocab_size,
            config.num_experts if qwen else config.num_local_experts, config.num_experts_per_tok,
            shared_ffn=config.shared_expert_intermediate_size if qwen else 0, qkv_bias=qwen and config.qkv_bias,
            plan=kind), head_params=(0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size,
                                     config.hidden_size))
    raise ModelError(f"the planner knows Hugging Face model types llama, qwen2, mistral, gpt2, mixtral and qwen2_moe, "
                     f"not {kind!r}; "
                     "pass a ModelSpec describing the model instead")


def _counts_from_module(module: nn.Module, spec: ModelSpec) -> ModelSpec:
    """`spec` with parameter counts read from `module`: each parameter once, sharded when
    the zoo plan places it, and by position around the layer list."""
    from ..config import ParallelConfig
    from ..plan.named import zoo
    from ..plan.resolve import resolve_plan
    from ..plan.stages import layer_list

    from ..parallel.expert import grouped_experts

    blocks = layer_list(module)
    sharded_names = set(resolve_plan(zoo[spec.plan](ParallelConfig()), module, 1).params) if spec.plan else set()
    experts = {id(p) for m in grouped_experts(module).values() for p in m.parameters(recurse=False)}
    layer, embed, head, expert = [0, 0], [0, 0], [0, 0], 0
    seen_layers = False
    for name, param in module.named_parameters():  # tied parameters once, under their first name
        side = 0 if name in sharded_names else 1
        if id(param) in experts:
            expert += param.numel()
        elif blocks and name.startswith(blocks + "."):
            seen_layers = True
            layer[side] += param.numel()
        else:
            (head if seen_layers else embed)[side] += param.numel()
    layers = len(module.get_submodule(blocks)) if blocks else 1
    return replace(spec, layer_params=(layer[0] // layers, layer[1] // layers), embed_params=tuple(embed),
                   head_params=tuple(head), expert_params=expert // layers)


def model_spec(model: "nn.Module | ModelSpec | str | Any") -> ModelSpec:
    """The spec of `model`: a ModelSpec, a name in MODELS, a transformers config, or a module."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, str):
        if model not in MODELS:
            raise ModelError(f"model {model!r} is not in the planner's table; known: {', '.join(MODELS)}")
        return MODELS[model]
    if isinstance(model, nn.Module):
        from ..models.gpt import GPT

        for sub in model.modules():
            if isinstance(sub, GPT):
                return _counts_from_module(model, _gpt_spec(sub.cfg))
            config = getattr(sub, "config", None)
            if config is not None and hasattr(config, "model_type"):
                return _counts_from_module(model, from_hf_config(config))
        raise ModelError(f"the planner reads shapes from shardwise's GPT or a Hugging Face model inside the module; "
                         f"{type(model).__name__} has neither: pass sw.planner.ModelSpec(...) describing it")
    if hasattr(model, "model_type"):
        return from_hf_config(model)
    raise ModelError(f"model={model!r} must be an nn.Module, a transformers config, a ModelSpec or one of "
                     f"{', '.join(MODELS)}")
