"""What an eager block's elementwise ops move, counted op by op, against what the planner charges.

The planner charges a block's memory-bound work as the device table's `elementwise` values per
token and hidden unit, and MLP_ELEMENTWISE of that per MLP unit (planner/timing.py); eager
PyTorch's 48 is fitted on published runs (bench/planner_published.py). This counts the same
traffic directly, on one Hugging Face block's forward in bfloat16: the bytes every aten op reads
and writes, except the matmuls and attention (charged apart) and views (which move nothing),
per token and hidden unit, in bf16 values. A fitted number that strayed from what the kernels
move would show here.

Run: python bench/elementwise_count.py (bench/planner_published.py prints it too)
"""

from __future__ import annotations

import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from shardwise.planner import DEVICES
from shardwise.planner.model import from_hf_config
from shardwise.planner.timing import MLP_ELEMENTWISE

# charged apart from the elementwise traffic: the linear layers' matmuls and attention's core
CHARGED_APART = {"mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention_for_cpu",
                 "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention"}
# aliases of their input: no bytes move
VIEWS = {"view", "_unsafe_view", "t", "transpose", "permute", "expand", "unsqueeze", "squeeze", "slice",
         "select", "split", "split_with_sizes", "unbind", "alias", "detach", "as_strided", "_reshape_alias",
         "view_as_complex", "view_as_real"}
TOKENS, HIDDEN = 256, 512


class ElementwiseBytes(TorchDispatchMode):
    """Bytes each aten op (by name) reads and writes, but those charged apart and views."""

    def __init__(self):
        super().__init__()
        self.by_op: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name not in CHARGED_APART and name not in VIEWS:
            tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
            self.by_op[name] = self.by_op.get(name, 0) + sum(t.numel() * t.element_size() for t in tensors)
        return out


def counted_values(block: torch.nn.Module, hidden: int, tokens: int, **kwargs) -> float:
    """bf16 values per token and hidden unit that `block`'s forward moves outside its matmuls."""
    x = torch.randn(1, tokens, hidden, dtype=torch.bfloat16)
    counter = ElementwiseBytes()
    with torch.no_grad(), counter:
        block(x, **kwargs)
    return sum(counter.by_op.values()) / (tokens * hidden * 2)


def charged_values(config) -> float:
    """What the planner charges a block of `config` per token and hidden unit (eager PyTorch)."""
    spec = from_hf_config(config)
    return DEVICES["h100"].elementwise * (1 + MLP_ELEMENTWISE * spec.ffn / spec.hidden)


def hugging_face_blocks() -> list[tuple[str, float, float]]:
    """(model, counted, charged) for Llama's block (RMSNorm in float32, rotary, SwiGLU of 3.5h)
    and GPT-2's (LayerNorm, tanh GELU of 4h), both with SDPA."""
    llama = transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=HIDDEN * 7 // 2, num_attention_heads=8,
                                     num_key_value_heads=2, num_hidden_layers=1, vocab_size=1024)
    gpt2 = transformers.GPT2Config(n_embd=HIDDEN, n_head=8, n_layer=1, vocab_size=1024, n_positions=TOKENS,
                                   bos_token_id=0, eos_token_id=0)
    rows = []
    for name, config in (("Llama", llama), ("GPT-2", gpt2)):
        config._attn_implementation = "sdpa"
        model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
        if name == "Llama":
            positions = torch.arange(TOKENS)[None]
            rotary = model.model.rotary_emb(torch.zeros(1, TOKENS, HIDDEN, dtype=torch.bfloat16), positions)
            counted = counted_values(model.model.layers[0], HIDDEN, TOKENS, position_embeddings=rotary,
                                     position_ids=positions)
        else:
            counted = counted_values(model.transformer.h[0], HIDDEN, TOKENS)
        rows.append((name, counted, charged_values(config)))
    return rows


def print_counts() -> None:
    print("an eager Hugging Face block's elementwise traffic (bf16 values per token and hidden unit, forward), "
          "counted op by op against the planner's fitted charge:")
    for name, counted, charged in hugging_face_blocks():
        print(f"  {name:<6} counted {counted:5.1f}, charged {charged:5.1f} ({charged / counted - 1:+.1%})")


if __name__ == "__main__":
    print_counts()
