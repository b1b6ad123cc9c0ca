"""What a step holds beyond the model states and the saved activations, for a moment: the
backward's transients (the loss's, the final norm's, a block's working memory) and the optimizer
step's temporaries. Each is a count of tensors of known shapes, measured against torch's profiler
inside a step (bench/planner.py's in-step peaks); cost.py takes the largest that can coincide.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .model import ModelSpec
from .timing import FLOAT32, OPTIMIZER_CODES

if TYPE_CHECKING:
    from .cost import Layout


def loss_bytes(spec: ModelSpec, act_bytes):
    """Bytes of a log-probability: float32 where the loss upcasts the logits, else theirs."""
    return FLOAT32 if spec.loss_float32 else act_bytes


def loss_backward_bytes(spec: ModelSpec, L: Layout, tokens, grads, resident):
    """What the cross-entropy's backward adds on the rank with the head, above the states and a
    microbatch's saved activations: the gradients of the log-probabilities and of the logits,
    both alive beside the kept log-probabilities while the log-softmax's backward runs (each
    tokens x vocab / tp; torch's loss_parallel, under tp, one more of that size). It comes
    first in backward, before the parameters' gradients exist unless buffers keep them between
    steps (dp or cp reduce them into buffers the executor keeps below ZeRO stage
    `grads_kept_below_zero`: shardwise's 0/1; its 2/3 shards, as FSDP2's, zero_grad frees) or an
    earlier microbatch's backward made them (`resident`); the planner counts `grads`
    (the rank's gradient bytes) in every case, so only the excess shows.
    Measured (bench/planner.py VOCAB_PEAKS): a GPT with a 16K vocabulary on 4 CPU ranks, dp (float32
    and bf16), tp and tp x dp within 0.4% of the in-step peak (45-67% low without it); Llama 3's 128K
    vocabulary at 8K tokens: 7.8 GiB on an H200."""
    if spec.fused_loss:
        return np.zeros_like(np.asarray(tokens, dtype=np.float64))
    transients = np.where(L.tp > 1, 3, 2) * loss_bytes(spec, L.param_bytes) * tokens * spec.vocab / L.tp
    return np.maximum(transients - np.where(resident, 0.0, grads), 0.0)


def norm_backward_bytes(spec: ModelSpec, L: Layout, tokens):
    """What a norm's backward holds at its peak beyond the tensors it kept, its input's gradient
    included. Hugging Face's RMSNorm computes it in float32 whatever the activations' dtype:
    five float32 tensors of its input's size at once (the mean of squares' backward), 20 bytes
    a token and hidden unit, after its weight's multiply freed the normalised input it kept
    (one tensor in the activations' dtype); a LayerNorm or a fused RMSNorm holds the gradient
    it received and its input's. Under tp without sp the norm is replicated: not divided by tp."""
    held = np.where(spec.keeps_float32_norm, 5 * FLOAT32 - L.param_bytes, 2 * L.param_bytes)
    return held * tokens * spec.hidden / np.where(L.sp == 1, L.tp, 1)


def final_norm_backward_bytes(spec: ModelSpec, L: Layout, tokens, grads, resident, head_grads):
    """What the final norm's backward adds on the rank with the head, above the states and a
    microbatch's saved activations (`norm_backward_bytes`); it comes right after the loss's and
    the head's backwards, which freed the log-probabilities and the norm's output (the head's
    saved input). The step's peak where tp is large without sp and the vocabulary's share of it
    small. Measured (torch's profiler in a step of a Hugging Face Llama at tp 2): 12.2 bytes a
    token and hidden unit at float32 (20 - 4 - 4, and the head's weight gradient) and 16 at bf16
    (20 - 2 - 2); bench/planner.py's NORM_PEAKS. As the loss's, only its excess over the
    gradients not yet made shows (the head's, `head_grads`, exists by then)."""
    output = L.param_bytes * tokens * spec.hidden / np.where(L.sp == 1, L.tp, 1)
    log_probs = loss_bytes(spec, L.param_bytes) * tokens * spec.vocab / L.tp
    excess = norm_backward_bytes(spec, L, tokens) - output - log_probs
    return np.maximum(excess - np.where(resident, 0.0, grads - head_grads), 0.0)


def block_backward_bytes(spec: ModelSpec, L: Layout, tokens):
    """What a block's backward holds at its start beside the saved activations: the gradient
    received for its output, the gradient of the MLP's hidden activation (each up projection's)
    and the down projection's weight gradient before it is accumulated. Measured: 704 KiB on our
    GPT's first pipeline rank at pp 2 under GPipe and 1F1B, where the planner was 6.5% low
    without it (tests/test_planner_memory.py's in-step peaks). Under sp the gradient arrives as a
    sequence shard, kept for the residual branch, and the down projection's backward gathers it
    whole: both are held."""
    ffn = (spec.ffn if not spec.experts else spec.ffn * spec.top_k) / L.tp
    # (under ZeRO-2/3 the weight gradient lands in the bucket the backward's window charges as filling,
    # except where a pipeline accumulates whole gradients: it is made, then added to the bucket's)
    weight_grad = np.where((L.zero >= 2) & ~L.accumulates_whole, 0.0, spec.hidden * ffn * L.param_bytes)
    received = tokens * spec.hidden * L.param_bytes * (1 + np.where((L.sp == 1) & (L.tp > 1), 1 / L.tp, 0.0))
    return received + spec.up_projections * tokens * ffn * L.param_bytes + weight_grad


def deferred_output_gradients(spec: ModelSpec, L: Layout, tokens):
    """(a block's, the final stage's more) bytes a zero-bubble stage-microbatch keeps between its
    input and its weight backward: torch keeps the gradient of each parameter group's output (the
    op where a weight's gradient meets the input's), a block's linear layers' (q, k, v, the
    attention's output projection, each up projection, the down projection: the row-parallel
    ones whole under tp) and its two norms' (sequence shards under sp), and on the final stage
    the final norm's (the head's own takes the place of the log-probabilities its input backward
    freed). tests/test_planner_memory.py counts torch's parameter groups."""
    kv_width = spec.kv_heads * spec.hidden / spec.heads
    norm_output = spec.hidden / np.where(L.sp == 1, L.tp, 1) * tokens * L.param_bytes
    linear = ((spec.hidden + 2 * kv_width + spec.up_projections * spec.ffn) / L.tp + 2 * spec.hidden) \
        * tokens * L.param_bytes
    return linear + 2 * norm_output, norm_output


def norm_in_block_backward_bytes(spec: ModelSpec, L: Layout, tokens, recomputed):
    """What a block's backward holds at its second norm's backward beyond the block's kept
    activations: what recompute brought back of it (`recomputed`), less what the MLP's backward
    freed (its gate, up and their products; the norm's output, its input, with them), plus the
    norm's backward (`norm_backward_bytes`) and the residual stream's gradient, which stands in
    for the output freed. Under tp without sp the norm is replicated
    and the MLP's tensors are not, so with recompute this can outweigh the block's start (the
    gradient received, the MLP hidden's: `block_backward_bytes`). Measured: a one-block bf16
    Llama at tp 2 under full recompute peaks here, 18 bytes a token and hidden unit over what the
    MLP's backward left (bench/planner.py's NORM_PEAKS). A mixture's experts free far more than a
    norm holds, so for them this is not the peak."""
    if spec.experts:
        return np.zeros_like(np.asarray(recomputed, dtype=np.float64))
    act = L.param_bytes
    mlp = (4 if spec.mlp == "swiglu" else 2) * spec.ffn / L.tp * act * tokens
    return recomputed - mlp + norm_backward_bytes(spec, L, tokens)


def step_temporaries(spec: ModelSpec, L: Layout, elements, end_tensor):
    """Bytes the optimizer step allocates on a rank whose optimizer updates `elements`, when the
    activations and the backward's buffers are gone (measured on an H200: bench/planner_device.py;
    on CPUs: bench/planner.py's in-step peak). Float32 masters take their gradients as float32
    copies, all before the step (shardwise's data/zero.py load_grads; Megatron's main gradients);
    torch's foreach Adam then holds the square roots of the second moments, one float32 per
    element, its for-loop two float32 temporaries of one tensor at a time; a fused one none."""
    masters = L.param_bytes < FLOAT32
    casts = np.where(masters & (L.grad_bytes < FLOAT32), FLOAT32 * elements, 0.0)
    largest = np.minimum(np.maximum(largest_block_tensor(spec, L), end_tensor), elements)
    return casts + np.select([L.optimizer == OPTIMIZER_CODES["foreach"], L.optimizer == OPTIMIZER_CODES["for-loop"]],
                             [FLOAT32 * elements, 2 * FLOAT32 * largest], 0.0)


def largest_block_tensor(spec: ModelSpec, L: Layout):
    """Elements of a block's largest parameter on one rank: an MLP matrix (hidden x ffn / tp),
    or a mixture's fused expert weights (Hugging Face keeps gate and up projections of all of
    a layer's experts in one tensor; ep splits the experts, tp leaves them whole)."""
    fused_share = 2 / 3 if spec.mlp == "swiglu" else 1 / 2
    return np.maximum(spec.hidden * spec.ffn / L.tp, spec.expert_params / L.ep * fused_share)
