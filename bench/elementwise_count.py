"""What a block's elementwise ops move, counted, against what the planner charges.

The planner charges a block's memory-bound work as the device table's `elementwise` values per
token and hidden unit, and MLP_ELEMENTWISE of that per MLP unit (planner/timing.py); eager
PyTorch's 48 is fitted on published runs (bench/planner_published.py). This counts the same
traffic directly, on one Hugging Face block in bfloat16: the bytes every aten op reads and
writes, except the matmuls and attention (charged apart) and views (which move nothing), per
token and hidden unit, in bf16 values. A fitted number that strayed from what the kernels move
would show here.

Compiled blocks (torch.compile: torchtitan's compiled rows, shardwise's `pmodel.compile()`)
run the same work in inductor's fused kernels. Their traffic is counted over a forward and
backward, each kernel's reads and writes as inductor's scheduler counts them (each buffer once:
what the kernel must move), matmuls and attention apart, and set against eager's count over the
same forward and backward: the share of eager's traffic a compiled block moves, which
`Cluster(compiled=True)` charges (planner/cluster.py's COMPILED_ELEMENTWISE_SHARE).

Run: python bench/elementwise_count.py (bench/planner_published.py prints it too)
"""

from __future__ import annotations

import contextlib
import logging

import torch
import transformers
from torch._inductor import compile_fx, metrics
from torch._inductor.scheduler import ExternKernelSchedulerNode, NopKernelSchedulerNode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from shardwise.planner import DEVICES
from shardwise.planner.cluster import COMPILED_ELEMENTWISE_SHARE
from shardwise.planner.model import from_hf_config
from shardwise.planner.timing import MLP_ELEMENTWISE

# charged apart from the elementwise traffic: the linear layers' matmuls and attention's core
CHARGED_APART = {"mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention_for_cpu",
                 "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention"}
CHARGED_APART |= {f"{name}_backward" for name in CHARGED_APART}
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


def _forward_backward(block, hidden: int, tokens: int, counted, **kwargs) -> None:
    """`block`'s forward and backward on random bf16 activations; only what runs inside the
    `counted` context is counted (not making the input and its gradient)."""
    x = torch.randn(1, tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    with counted:
        out = block(x, **kwargs)
        (out[0] if isinstance(out, tuple) else out).backward(grad)


def eager_training_values(block: torch.nn.Module, hidden: int, tokens: int, **kwargs) -> float:
    """bf16 values per token and hidden unit that `block`'s eager forward and backward move
    outside the matmuls and attention."""
    counter = ElementwiseBytes()
    _forward_backward(block, hidden, tokens, counter, **kwargs)
    return sum(counter.by_op.values()) / (tokens * hidden * 2)


def compiled_training_values(block: torch.nn.Module, hidden: int, tokens: int, **kwargs) -> float:
    """The same for `torch.compile(block)`: the bytes inductor's kernels read and write, forward
    and backward graphs, as its scheduler counts them (`metrics.nodes_num_elem`, filled when its
    metrics log is on); extern kernels (matmuls, attention) apart. Compiled afresh: a cached
    graph would count nothing."""
    log = logging.getLogger(compile_fx.inductor_metrics_log.name)
    level, propagate = log.level, log.propagate
    log.setLevel(logging.INFO)
    log.propagate = False  # on for the count, printed nowhere
    torch._dynamo.reset()
    metrics.reset()
    try:
        with torch._inductor.config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            _forward_backward(torch.compile(block), hidden, tokens, contextlib.nullcontext(), **kwargs)
        moved = sum(4 * elements for node, elements in metrics.nodes_num_elem  # it keeps bytes // 4
                    if not isinstance(node, (ExternKernelSchedulerNode, NopKernelSchedulerNode)))
    finally:
        log.setLevel(level)
        log.propagate = propagate
        torch._dynamo.reset()
    if moved == 0:
        raise RuntimeError("inductor counted no kernels: its metrics were not collected")
    return moved / (tokens * hidden * 2)


def kept_for_backward(block: torch.nn.Module, hidden: int, tokens: int, **kwargs) -> float:
    """Bytes per token and hidden unit that `block`'s forward keeps for its backward (autograd's
    saved tensors, each storage once; its input and parameters apart): a compiled block keeps
    what inductor's partitioner saves, recomputing cheap elementwise results instead."""
    x = torch.randn(1, tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
    kept = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, **kwargs)
    for t in (x, *block.parameters()):
        kept.pop(t.untyped_storage().data_ptr(), None)
    return sum(kept.values()) / (tokens * hidden)


def charged_values(config) -> float:
    """What the planner charges a block of `config` per token and hidden unit (eager PyTorch)."""
    spec = from_hf_config(config)
    return DEVICES["h100"].elementwise * (1 + MLP_ELEMENTWISE * spec.ffn / spec.hidden)


def hugging_face_blocks():
    """(model, config, block, its keyword arguments) for Llama's block (RMSNorm in float32,
    rotary, SwiGLU of 3.5h) and GPT-2's (LayerNorm, tanh GELU of 4h), both with SDPA, in
    eval mode (GPT-2's dropout off, as training runs of this size have it)."""
    llama = transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=HIDDEN * 7 // 2, num_attention_heads=8,
                                     num_key_value_heads=2, num_hidden_layers=1, vocab_size=1024)
    gpt2 = transformers.GPT2Config(n_embd=HIDDEN, n_head=8, n_layer=1, vocab_size=1024, n_positions=TOKENS,
                                   bos_token_id=0, eos_token_id=0)
    for name, config in (("Llama", llama), ("GPT-2", gpt2)):
        config._attn_implementation = "sdpa"
        model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
        if name == "Llama":
            positions = torch.arange(TOKENS)[None]
            rotary = model.model.rotary_emb(torch.zeros(1, TOKENS, HIDDEN, dtype=torch.bfloat16), positions)
            yield name, config, model.model.layers[0], dict(position_embeddings=rotary, position_ids=positions)
        else:
            yield name, config, model.transformer.h[0], {}


def print_counts(compiled: bool = False) -> None:
    """The eager counts against the fitted charge; with `compiled`, also the compiled blocks'
    share of eager's traffic against the planner's COMPILED_ELEMENTWISE_SHARE."""
    print("Hugging Face blocks' elementwise traffic (bf16 values per token and hidden unit), counted: eager forward "
          "op by op against the planner's fitted charge" + ("; eager and compiled forward + backward" if
                                                             compiled else ""))
    for name, config, block, kwargs in hugging_face_blocks():
        counted, charged = counted_values(block, HIDDEN, TOKENS, **kwargs), charged_values(config)
        line = f"  {name:<6} forward counted {counted:5.1f}, charged {charged:5.1f} ({charged / counted - 1:+.1%})"
        if compiled:
            eager = eager_training_values(block, HIDDEN, TOKENS, **kwargs)
            fused = compiled_training_values(block, HIDDEN, TOKENS, **kwargs)
            share = fused / eager
            line += (f"; forward + backward eager {eager:5.1f}, compiled {fused:5.1f}: {share:.3f} of eager "
                     f"(the planner charges {COMPILED_ELEMENTWISE_SHARE:.3f})")
            torch._dynamo.reset()
            eager_kept, compiled_kept = (kept_for_backward(b, HIDDEN, TOKENS, **kwargs) for b in (block, torch.compile(block)))
            torch._dynamo.reset()
            line += (f"\n         kept for backward (bytes per token and hidden unit): eager {eager_kept:.1f}, compiled "
                     f"{compiled_kept:.1f} ({compiled_kept / eager_kept - 1:+.0%}; the planner charges eager's)")
        print(line)


if __name__ == "__main__":
    print_counts(compiled=True)
