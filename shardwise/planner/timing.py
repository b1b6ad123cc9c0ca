"""The planner's time model: seconds per step of a layout, term by term, from the shapes.

Compute is a roofline per matmul: 2mnk FLOPs at the device's calibrated matmul rate (the
tensor-core peak for bf16, plain float32's for float32) or the operands' traffic at HBM
speed, whichever is slower, so a narrow tp shard or a small microbatch costs what it costs.
A block is its projections, its MLP (or its experts: the tokens' slots spread over the
rank's experts), causal attention (2·tokens·seq·h/tp FLOPs forward, at flash attention's
rate; eager or Megatron's, the whole square's matmuls and its scores' traffic) and the
memory-bound elementwise work around them (norms, residuals, activation functions, rotary:
the device table's `elementwise` values per token and hidden unit; without sp, those outside the
tp regions run whole on every tp rank: `Executor.tp_replicated_elementwise`). Backward is twice
the forward.
The busiest pipeline rank sets the pace: its blocks (as the stage balancer places them) and
the head's matmul and cross-entropy on the last rank.

Collectives are α-β: a step's latency per ring step (inside a node or between nodes) plus
the bytes over the link's bandwidth (across nodes, one NIC's rate per member of the group in
a node: NCCL runs a ring per NIC; `Cluster.bandwidth`). A data-parallel all-reduce takes the better of a ring
(2(n-1) steps) and NCCL's tree (2 log2 n steps) at scale; all-gathers, reduce-scatters and
all-to-alls are rings. Tensor-parallel collectives are not overlapped (4 all-reduces' worth per
block and microbatch, 5 under sp or full recompute, 5.5 under both, as shardwise runs them;
other stacks' `Cluster.executor` differ); context-parallel K/V exchanges and expert all-to-alls
neither. Pipeline p2p is paid per microbatch on each of a rank's boundaries, forward and
backward, and again through the fill and drain. The bubble is (p-1)/(v·m) of the pipelined
time (zero-bubble fills part of it with deferred weight gradients: `zero_bubble_share`). The gradient
reduction overlaps the last microbatch's backward (ZeRO-1/2's all-gather of the updated
parameters follows the optimizer step, exposed, as shardwise runs it); ZeRO-3's per-block gathers (forward,
backward) and gradient reduce-scatters overlap that block's compute, block by block, and
the first block's gather of each pass is exposed (FSDP2 also copies each gathered buffer out
and each unit's gradients in, on the compute stream: `Executor.shard_copies`). Selective
recompute runs a block's elementwise work again and the matmuls whose outputs it does not
keep (`rerun_matmul_seconds`) (Megatron-LM's its attention core only: `attention_core`);
full recompute the forward but its last matmul, where torch's checkpoint stops (other stacks:
`Cluster.executor`). The optimizer step streams the rank's
shard of parameters, gradients, moments and master weights through HBM: once for a fused
optimizer, nine passes and the casts around them for torch's (`optimizer_bytes`).
"""

from __future__ import annotations

import numpy as np

from .cluster import Cluster
from .model import ModelSpec

# The elementwise traffic of a block per token in forward: the device table's `elementwise`
# values per hidden unit (norms, residual adds, rotary, casts: fitted, 48 for eager PyTorch)
# and this share of it per MLP unit (the activation function's read, read, write: 3 of 16).
MLP_ELEMENTWISE = 3 / 16
# A collective overlapped with compute still slows it: NCCL's kernels take SMs and HBM
# bandwidth from the matmuls they run beside (16-32 channels of an A100's 108 SMs). Charged
# as this fraction of the overlapped time.
OVERLAP_COST = 0.25
FLOAT32 = 4
# How the optimizer runs: "fused", one kernel (torch's fused=True; Megatron's, DeepSpeed's and Apex's Adam: the
# published runs'); "foreach", torch's default on GPUs (one float32 temporary per element); "for-loop", torch's
# default on CPUs (two float32 temporaries of one tensor at a time). Each casts gradients below float32 to float32
# for float32 masters first (shardwise's load_grads, Megatron's main gradients).
OPTIMIZER_CODES = {"fused": 0, "foreach": 1, "for-loop": 2}
# The share of HBM bandwidth torch's foreach and for-loop Adam passes reach: shardwise's step with
# torch's foreach AdamW took 40.4-40.9 and 96.4-97.6 ms for 1.50 B and 3.61 B parameter Llamas on an
# H200 (4.8 TB/s; bf16 parameters and gradients), 130.4 and 128.9 bytes an element at the link's rate:
# 14 of casts, write-back and zeroing (optimizer_bytes) and Adam's 80 at 0.687 and 0.696 of it
# (bench/planner_device.py, torch 2.11). A fused update is charged the full link, as the published
# runs' fused optimizers calibrate it; torch's fused AdamW under shardwise took 20.6-20.8 ms there,
# where that charges 13.1 ms.
TORCH_OPTIMIZER_RATE = 0.69
# Flash attention against a matmul of its FLOPs: its forward runs near matmul efficiency, its
# backward does 2.5x the forward's FLOPs (it recomputes the scores) at about 0.7 of the
# forward's rate (FlashAttention-2, arXiv 2307.08691): (1 + 2.5 / 0.7) / 3 of a matmul's time
# for the 3x-forward FLOPs the model counts.
ATTENTION = (1 + 2.5 / 0.7) / 3


def score_traffic(attention: str, nb):
    """Bytes a forward moves per attention score that attention writes to memory (ModelSpec.
    attention), with activations of `nb` bytes. Megatron-LM: the scores' matmul writes it,
    its fused scale-mask-softmax reads and writes it, dropout reads it and writes its output
    and a one-byte mask, the matmul with V reads it: 6.5 values (13 bytes at 2). Hugging
    Face's eager: the matmul writes it, scaling and the mask's add each read and write it,
    softmax reads it and writes float32, a cast back reads that and writes it (none in
    float32), the matmul with V reads it: 7 values and 4 bytes, 6 more below float32."""
    if attention == "megatron":
        return 6.5 * nb
    return 7 * nb + FLOAT32 + np.where(nb < FLOAT32, nb + FLOAT32, 0)


def matmul_seconds(cluster: Cluster, m, n, k, nbytes):
    """Seconds of one (m x k) @ (k x n) matmul: the slower of its FLOPs and its traffic, plus
    the device's fixed cost of a matmul (launch and the last, partly filled wave of tiles)."""
    return np.maximum(2 * m * n * k / cluster.matmul_flops(nbytes),
                      (m * k + k * n + m * n) * nbytes / cluster.spec.hbm_bw) + cluster.spec.matmul_overhead


def _overlapped(comm, compute):
    """Seconds `comm` adds to `compute` when they run side by side: what sticks out, and the
    contention for the part that overlaps."""
    return np.maximum(comm - compute, 0) + OVERLAP_COST * np.minimum(comm, compute)


def ring(cluster: Cluster, n, nbytes, span, factor=1.0):
    """A ring collective over n ranks spanning `span` consecutive ranks: (n-1) steps of
    latency per unit of `factor` and factor*(n-1)/n of `nbytes` over the link."""
    steps = factor * (n - 1)
    return np.where(n > 1, steps * cluster.latency(span) + steps / n * nbytes / cluster.bandwidth(span, n), 0.0)


def all_reduce(cluster: Cluster, n, nbytes, span):
    """The faster of a ring and a tree (2 log2 n latency steps, 2x the bytes) all-reduce."""
    tree = 2 * np.ceil(np.log2(np.maximum(n, 1))) * cluster.latency(span) + 2 * nbytes / cluster.bandwidth(span, n)
    return np.where(n > 1, np.minimum(ring(cluster, n, nbytes, span, 2.0), tree), 0.0)


def block_seconds(spec: ModelSpec, cluster: Cluster, L, tokens, seq_len):
    """(forward seconds of one block on one microbatch of `tokens` tokens on this rank, the
    elementwise part of it, the linear layers' matmuls of it): matmuls, attention, elementwise
    traffic."""
    h, tp, nb = spec.hidden, L.tp, L.param_bytes
    kv = spec.kv_heads * h / spec.heads
    seq_shard = np.where((L.sp == 1) | (tp == 1), tp, 1)  # elementwise work outside the tp regions
    time = matmul_seconds(cluster, tokens, (h + 2 * kv) / tp, h, nb) + matmul_seconds(cluster, tokens, h, h / tp, nb)
    per_unit = cluster.spec.elementwise
    # of the block's elementwise values per hidden unit, those outside the tp regions (norms, dropouts,
    # residuals) run whole on every tp rank without sp; the rest on the rank's shard (Executor)
    replicated = per_unit if cluster.runs.tp_replicated_elementwise is None else cluster.runs.tp_replicated_elementwise
    elementwise = replicated * tokens * h * nb / seq_shard + (per_unit - replicated) * tokens * h * nb / tp
    attention, _, scores = attention_core(spec, cluster, L, tokens, seq_len)
    elementwise = elementwise + scores
    if spec.experts:
        # each token's top_k slots; without sp every tp rank computes all of them (experts stay whole)
        slots = tokens * spec.top_k / np.where(L.sp == 1, tp, 1)
        local = spec.experts / L.ep
        per_expert = slots / local  # balanced routing: a rank's own slots' worth lands on its experts
        time = time + local * (matmul_seconds(cluster, per_expert, 2 * spec.ffn, h, nb)
                               + matmul_seconds(cluster, per_expert, h, spec.ffn, nb))
        elementwise = elementwise + MLP_ELEMENTWISE * per_unit * slots * spec.ffn * nb
    else:
        time = time + (matmul_seconds(cluster, tokens, spec.up_projections * spec.ffn / tp, h, nb)
                       + matmul_seconds(cluster, tokens, h, spec.ffn / tp, nb))
        elementwise = elementwise + MLP_ELEMENTWISE * per_unit * tokens * spec.ffn / tp * nb
    elementwise = elementwise / cluster.spec.hbm_bw
    return time + attention + elementwise, elementwise, time


def attention_core(spec: ModelSpec, cluster: Cluster, L, tokens, seq_len):
    """(seconds a block's forward is charged for attention's two batched matmuls on one
    microbatch, seconds its forward alone takes, bytes its scores move in memory). Flash
    attention keeps no scores; causal, its forward runs at a matmul's rate, the charge is
    ATTENTION of that for the whole step's work. Eager or Megatron's: the whole square's
    matmuls (the mask skips no work) and each score's traffic (`score_traffic`)."""
    h, tp, nb = spec.hidden, L.tp, L.param_bytes
    if spec.attention == "flash":
        forward = 2 * tokens * seq_len * h / tp / cluster.matmul_flops(nb)
        return ATTENTION * forward, forward, 0.0 * tokens
    square = 2 * 2 * tokens * seq_len * h / tp / cluster.matmul_flops(nb)
    return square, square, score_traffic(spec.attention, nb) * tokens * seq_len * spec.heads / tp


def rerun_matmul_seconds(spec: ModelSpec, cluster: Cluster, L, tokens, alternate: bool):
    """Forward seconds of the weight matmuls a selective recomputation of one block runs again
    on one microbatch (parallel/recompute.py; torch's checkpoint stops once backward has what it
    needs, so never the last, the down projection): under tp the row-parallel ones, whose
    full-size partial sums are not kept (`Executor.selective_reruns_partials`: not Megatron-LM's,
    which reruns its attention core only); under selective-alternate also every second one."""
    matmuls = spec.weight_matmuls
    total = np.zeros_like(np.asarray(tokens, dtype=np.float64))
    for i, (_, out, inp, rows) in enumerate(matmuls[:-1]):
        partial = rows and cluster.runs.selective_reruns_partials
        again = np.where(L.tp > 1, partial, False) | (alternate and i % 2 == 1)
        shape = (inp / L.tp, out) if rows else (inp, out / L.tp)
        total = total + np.where(again, matmul_seconds(cluster, tokens, shape[1], shape[0], L.param_bytes), 0.0)
    return total


def head_seconds(spec: ModelSpec, cluster: Cluster, L, tokens):
    """Forward seconds of the head on one microbatch: the vocabulary matmul (sharded over tp)
    and the cross-entropy's float32 passes over the logits."""
    vocab = spec.vocab / L.tp
    return (matmul_seconds(cluster, tokens, vocab, spec.hidden, L.param_bytes)
            + 3 * 4 * tokens * vocab / cluster.spec.hbm_bw)


def optimizer_bytes(L, zero3_cast_shard: bool = False):
    """HBM bytes an Adam step moves per element of the rank's optimizer shard, at the link's
    full rate: float32 masters first take float32 copies of gradients below float32; the update
    reads float32 gradients and reads and writes parameters (or masters) and both moments, in
    one pass when fused (28 bytes), in nine for torch's foreach or for-loop Adam (weight decay,
    the first moment's lerp, the second's scale and addcmul, its square root, the bias
    correction, epsilon, the addcdiv: 80, streaming at TORCH_OPTIMIZER_RATE of the link); the
    masters are written back to the parameters (not at ZeRO-3, whose gathers cast the master
    shard, unless `zero3_cast_shard`: Executor's) and the gradient buffers zeroed."""
    masters = np.where(L.param_bytes >= FLOAT32, 0, 1)
    casts = np.where(L.grad_bytes < FLOAT32, L.grad_bytes + FLOAT32, 0) * masters
    update = np.where(L.optimizer == OPTIMIZER_CODES["fused"], 28, 80 / TORCH_OPTIMIZER_RATE)
    written_back = masters * np.where((L.zero == 3) & (not zero3_cast_shard), 0, 1)
    return casts + update + (FLOAT32 + L.param_bytes) * written_back + L.grad_bytes


def boundary_bytes(spec: ModelSpec, L, tokens):
    """Bytes of one microbatch's activation crossing a pipeline stage boundary (`tokens` on this
    rank): sharded over tp under sequence parallelism, whole on every tp rank without."""
    return tokens * spec.hidden * L.param_bytes / np.where(L.sp == 1, L.tp, 1)


def zero_bubble_share(weight_share):
    """The share of 1F1B's bubble a zero-bubble schedule leaves: ZB-H1 (arXiv 2401.10241), what
    torch's ScheduleInterleavedZeroBubble orders, leaves (p-1)(F + I - W) of 1F1B's (p-1)(F + I
    + W), with F a forward, I the input backward and W the weight backward of a stage. W is one
    matmul per linear layer, `weight_share` of the forward; I the rest of the backward (twice
    the forward): (3 - 2 w) / 3 of it. A third when everything is a linear layer (torch's own
    order with equal times, tests/test_planner_time.py); more with attention and elementwise work."""
    return (3 - 2 * np.asarray(weight_share)) / 3


def step_times(spec: ModelSpec, cluster: Cluster, L, seq_len: int, memory) -> tuple:
    """Seconds per step by term (compute, recompute, tp, cp, ep, pp, bubble, dp, optimizer step)
    and the model FLOPs of the step (all ranks, no recomputation)."""
    h = spec.hidden
    layers_first, layers_last = memory.layers_first, memory.layers_last
    world = L.dp * L.tp * L.pp * L.cp
    shards = L.dp * L.cp
    tokens = L.micro_batch * seq_len / L.cp  # one microbatch on this rank
    tokens_step = L.dp * L.micro_batch * L.microbatches * seq_len  # the global batch

    sharded_l, active = spec.layer_params[0], spec.active_expert_params
    flops_token = spec.layers * (6 * (sharded_l + active) + 6 * h * seq_len) \
        + 6 * (spec.dense_params - spec.layers * (sharded_l + active))
    model_flops = flops_token * tokens_step

    # the busiest pipeline rank's blocks per microbatch; the head on the last
    middle = np.where(L.pp > 2, np.ceil((spec.layers - layers_first - layers_last) / np.maximum(L.pp - 2, 1)), 0)
    block, elementwise, linear = block_seconds(spec, cluster, L, tokens, seq_len)
    head = head_seconds(spec, cluster, L, tokens)
    first = layers_first * block + np.where(L.pp == 1, head, 0)
    busiest_blocks = np.where(L.pp == 1, layers_first, np.maximum(np.maximum(layers_first, layers_last), middle))
    stage = np.maximum(first, np.maximum(layers_last * block + head, middle * block))
    compute = 3 * L.microbatches * stage
    # full recompute: the whole forward again; torch's checkpoint (shardwise) stops before the last
    # matmul, the down projection, and its reduction, which nothing in backward needs (`Executor`)
    runs = cluster.runs
    down = 0.0 if runs.full_reruns_last or not spec.weight_matmuls else \
        matmul_seconds(cluster, tokens, h, spec.weight_matmuls[-1][2] / L.tp, L.param_bytes)
    if runs.selective_reruns_attention_core:
        _, attention, scores = attention_core(spec, cluster, L, tokens, seq_len)
        selective = attention + scores / cluster.spec.hbm_bw
    else:
        selective = elementwise + rerun_matmul_seconds(spec, cluster, L, tokens, False)
    recompute = L.microbatches * busiest_blocks * np.select(
        [L.recompute == 2, L.recompute == 1, L.recompute == 3],
        [block - down, selective, elementwise + rerun_matmul_seconds(spec, cluster, L, tokens, True)], 0.0)

    act_bytes = tokens * h * L.param_bytes  # one (s/cp) x b x h activation
    # a block's tp collectives per microbatch, in all-reduces of one activation (an all-gather or a
    # reduce-scatter is half of one): two forward, two backward; under sp two more all-gathers in
    # backward (a column-parallel layer's input again, for its weight gradient, beside the
    # input-gradient matmul; under shardwise's recompute the recomputation's forward gathers them,
    # exposed); full recompute's forward again: shardwise's without the last reduction, and under
    # sp its all-gathers replace backward's (tests/test_planner.py counts them); Megatron-LM's two
    # backward ones run beside the weight-gradient matmuls (Executor)
    sp = (L.sp == 1) & (L.tp > 1)
    full = L.recompute == 2
    beside = runs.sp_gather_hidden & ~(runs.recompute_gathers & (L.recompute != 0))
    regather = sp * np.where(beside, OVERLAP_COST, 1.0)
    backward = 2 * (OVERLAP_COST if runs.tp_backward_beside_weight_grads else 1.0)
    collectives = 2 + backward + regather + np.where(runs.full_reruns_last, 2 * full, full * np.where(sp, 0.5, 1.0))
    tp_comm = busiest_blocks * L.microbatches * collectives * all_reduce(cluster, L.tp, act_bytes, L.tp)
    kv_bytes = 2 * L.micro_batch * seq_len * (spec.kv_heads * h / spec.heads) * L.param_bytes / L.tp
    cp_comm = busiest_blocks * L.microbatches * 3 * ring(cluster, L.cp, kv_bytes, L.tp * L.cp)
    if spec.experts:  # each slot out and back, forward and backward
        slot_bytes = tokens * spec.top_k * h * L.param_bytes / np.where(L.sp == 1, L.tp, 1)
        ep_comm = busiest_blocks * L.microbatches * 4 * ring(cluster, L.ep, slot_bytes, L.tp * L.cp * L.ep)
    else:
        ep_comm = np.zeros_like(tokens)
    # stages are the outermost ranks; a scatter-gather p2p (Executor) sends each tp rank's 1/tp of an activation
    # that is whole on every tp rank and all-gathers it inside the tp group on the far side
    sent = boundary_bytes(spec, L, tokens)
    whole = (L.sp == 0) & (L.tp > 1) & runs.pp_scatter_gather
    hop = cluster.latency(world) + np.where(whole, sent / L.tp, sent) / cluster.bandwidth(world) \
        + np.where(whole, ring(cluster, L.tp, sent, L.tp), 0.0)
    pp_comm = np.where(L.pp > 1, 2 * L.virtual * (L.microbatches + L.pp - 1) * hop, 0.0)

    pipelined = compute + recompute + tp_comm + cp_comm + ep_comm
    bubble = pipelined * (L.pp - 1) / (L.virtual * L.microbatches) * np.where(L.schedule == 3,
                                                                              zero_bubble_share(linear / block), 1)

    rank_params = np.maximum(memory.params_first, memory.params_last)
    grad_bytes = rank_params * L.grad_bytes
    span = L.tp * shards
    last_backward = 2 / 3 * (compute + recompute) / L.microbatches
    # ZeRO 0-2: the gradients' all-reduce (ZeRO-1/2: reduce-scatter), one collective per bucket, each
    # paying its own latency, after the step's last backward; without a pipeline ZeRO-2 reduces every
    # microbatch's into the shards (data/gradients.py's reduce_into_shards)
    buckets = np.maximum(np.ceil(grad_bytes / memory.bucket), 1)
    reduce = np.where(L.zero == 0, buckets * all_reduce(cluster, shards, grad_bytes / buckets, span),
                      buckets * ring(cluster, shards, grad_bytes / buckets, span))
    # ZeRO-1/2: the updated shards' all-gather runs after the optimizer step, with nothing to hide behind
    gather_after_step = np.where((L.zero == 1) | (L.zero == 2), ring(cluster, shards, rank_params * L.param_bytes, span),
                                 0.0)
    # ZeRO-3, block by block and microbatch: a gather before its forward, a gather and (without a
    # pipeline) a gradient reduce-scatter during its backward, each hidden behind that block's
    # compute; a pipeline's gradients are reduce-scattered after its last backward, as ZeRO-2's
    per_block = rank_params / np.maximum(busiest_blocks, 1)
    gather = ring(cluster, shards, per_block * L.param_bytes, span)
    scatter = np.where(L.pp == 1, ring(cluster, shards, per_block * L.grad_bytes, span), 0.0)
    forward = block + recompute / np.maximum(L.microbatches * busiest_blocks, 1)
    exposed3 = _overlapped(gather, forward) + _overlapped(gather + scatter, 2 * block)
    zero3 = L.microbatches * (busiest_blocks * exposed3 + 2 * gather) + np.where(L.pp > 1, _overlapped(reduce, last_backward),
                                                                                 0.0)
    reductions = np.where((L.zero == 2) & (L.pp == 1), L.microbatches, 1)
    exposed = reduce if runs.dp_reduce_after_backward else _overlapped(reduce, last_backward)
    # FSDP2's copies (Executor.shard_copies): each gathered buffer out into the parameters (ZeRO-3: the two
    # gathers a microbatch charged above, where the root and the last block are gathered once; ZeRO-1/2: the
    # step's one gather) and each reduction's gradients into its buffer
    dp_comm = np.where(L.zero == 3, zero3, reductions * exposed + gather_after_step)
    if runs.shard_copies:
        gathers = np.where(L.zero == 3, 2 * L.microbatches, 1)
        reduced = np.where(L.zero == 3, np.where(L.pp == 1, L.microbatches, 1), reductions)
        copied = rank_params * (gathers * 2 * L.param_bytes + reduced * (L.param_bytes + L.grad_bytes))
        dp_comm = dp_comm + np.where(L.zero >= 1, copied / cluster.spec.hbm_bw, 0.0)

    optimizer_step = rank_params / np.where(L.zero >= 1, shards, 1) * optimizer_bytes(L, cluster.runs.zero3_cast_shard) / cluster.spec.hbm_bw
    return compute, recompute, tp_comm, cp_comm, ep_comm, pp_comm, bubble, dp_comm, optimizer_step, model_flops
