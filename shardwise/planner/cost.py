"""The cost model: bytes per rank and seconds per step of a layout, analytic and explainable.

One function, `evaluate`, computes every term with numpy broadcasting, so the search
evaluates a whole grid of layouts at once and `explain()` evaluates one with the same code.

Memory (bytes on the busiest pipeline rank: the first, which keeps the most microbatches in
flight and the embedding, or the last, which keeps the logits):
- parameters: this rank's blocks and end pieces, sharded parts / tp; / (dp*cp) at ZeRO-3
  (whose float32 shard is the master under mixed precision, cast as it is gathered);
  the blocks each end rank holds are what shardwise's stage balancer gives it
  (`stage_layers`: the same cost, FLOP share plus parameter share per module, so the
  embedding's parameters leave the first stage fewer blocks);
- gradients: as parameters, in reduce_dtype (the parameters' dtype by default: the executor
  keeps them in its gradient buffers); / (dp*cp) at ZeRO-2 and 3;
- optimizer: Adam's two float32 moments (+ float32 master weights under bf16, but at ZeRO-3),
  / (dp*cp) from ZeRO-1 on;
- activations: per block and microbatch, the bytes autograd keeps (shardwise's own layers,
  measured against `sw.activation_memory` in tests/test_activations.py and
  bench/planner.py): Korthikanti et al. (arXiv 2205.05198) adapted to what our executors
  keep, times the microbatches a pipeline schedule holds at once (schedules.py, with the boundary
  tensors beside them); and what a backward holds
  beyond them (planner/transients.py), the loss's and then the final norm's transients or,
  while a block's backward runs, what recompute brings back of it and the backward's own
  working memory, its second norm's backward included;
- buffers: ZeRO-3's gathered parameters of two blocks (and the cast shards they are gathered
  from); under ZeRO-2/3 the whole-gradient buckets a backward fills and reduce-scatters, at
  most IN_FLIGHT + 1 at once (ZeRO-3's, a block's each, less the activations of the blocks
  whose backwards are done by then), every one of them in a pipeline's step, which reduces
  after its last microbatch (the peak inside a step, measured by bench/planner.py's in-step
  peak); under torch's zero-bubble executor the sends it keeps until the step ends and the
  weight gradients it keeps apart from the buckets;
- the optimizer step's temporaries (`step_temporaries`: float32 copies of the gradients for
  float32 masters, torch's foreach Adam's square roots), where they outweigh the activations
  and buffers the backward held: the step comes after those are freed.

Time: planner/timing.py, term by term (compute as a roofline per matmul, α-β collectives,
pipeline p2p per microbatch and the bubble, exposed data-parallel and ZeRO-3 traffic, the
optimizer step).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ..config import ParallelConfig
from ..parallel.data.gradients import IN_FLIGHT
from .cluster import Cluster, Executor
from ..plan.stages import Unit, balance, unit_costs
from .model import ModelSpec
from .schedules import SCHEDULE_CODES, in_flight, last_rank_in_flight, runner_boundaries
from .timing import FLOAT32, OPTIMIZER_CODES, boundary_bytes, step_times
from .transients import (block_backward_bytes, deferred_output_gradients, final_norm_backward_bytes, largest_block_tensor,
                         loss_backward_bytes, loss_bytes, norm_backward_bytes, norm_in_block_backward_bytes, step_temporaries)

RECOMPUTE_CODES = {None: 0, "selective": 1, "full": 2, "selective-alternate": 3}


@dataclass
class Layout:
    """Arrays (or scalars) of layout choices, broadcast against each other."""

    dp: np.ndarray
    tp: np.ndarray
    pp: np.ndarray
    cp: np.ndarray
    zero: np.ndarray
    recompute: np.ndarray  # RECOMPUTE_CODES
    sp: np.ndarray  # 0 / 1
    micro_batch: np.ndarray  # sequences per microbatch per replica
    microbatches: np.ndarray
    schedule: np.ndarray  # SCHEDULE_CODES
    virtual: np.ndarray
    param_bytes: np.ndarray  # 2 (bf16) or 4 (fp32)
    ep: np.ndarray | float = 1.0  # experts split over this many of the dp ranks
    reduce_bytes: np.ndarray | float = 0.0  # gradients' dtype (ParallelConfig.reduce_dtype); 0: param_bytes
    bucket_bytes: np.ndarray | float = ParallelConfig.bucket_mb * 2 ** 20  # ParallelConfig.bucket_mb, in bytes
    optimizer: np.ndarray | float = OPTIMIZER_CODES["foreach"]

    @property
    def grad_bytes(self):
        """Bytes of a gradient element: reduce_dtype's, or the parameters' by default."""
        return np.where(np.asarray(self.reduce_bytes) > 0, self.reduce_bytes, self.param_bytes)

    @property
    def accumulates_whole(self):
        """Whether ZeRO-2/3 gradients accumulate whole over a pipeline's microbatches (every stage
        backward adds into buckets of whole gradients; the last one's reduce-scatter makes the
        shards): without a pipeline each microbatch reduces into the shards."""
        return (np.asarray(self.zero) >= 2) & (np.asarray(self.microbatches) > 1) & (np.asarray(self.pp) > 1)


@dataclass
class Cost:
    """Every term of the prediction, per rank (bytes) and per step (seconds)."""

    params: np.ndarray
    grads: np.ndarray
    optimizer: np.ndarray
    activations: np.ndarray  # what the schedule holds at its peak
    buffers: np.ndarray
    step_temporaries: np.ndarray  # what the optimizer step holds beyond the backward's peak
    compute: np.ndarray
    recompute: np.ndarray
    tp_comm: np.ndarray
    cp_comm: np.ndarray
    ep_comm: np.ndarray
    pp_comm: np.ndarray
    bubble: np.ndarray
    dp_comm: np.ndarray
    optimizer_step: np.ndarray
    model_flops: np.ndarray  # per step, all ranks, without recomputation
    # model states and one microbatch's activations at each end of the pipeline (equal at pp=1)
    states_first: np.ndarray
    states_last: np.ndarray
    microbatch_first: np.ndarray
    microbatch_last: np.ndarray

    @property
    def memory(self) -> np.ndarray:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers + self.step_temporaries

    @property
    def step_seconds(self) -> np.ndarray:
        return (self.compute + self.recompute + self.tp_comm + self.cp_comm + self.ep_comm + self.pp_comm + self.bubble
                + self.dp_comm + self.optimizer_step)


def norms_copy_inputs(spec: ModelSpec, act_bytes):
    """Whether the norms keep float32 copies of their inputs in place of the inputs (the residual
    sums): Hugging Face's RMSNorm at activations below float32 (at float32 the copy is the sum)."""
    return spec.keeps_float32_norm & (act_bytes < FLOAT32)


def block_activation_bytes(spec: ModelSpec, tokens, tp, sp, cp, recompute, act_bytes, ep, seq_len):
    """Bytes one block keeps for backward for `tokens` tokens of one microbatch on this rank
    (see tests/test_activations.py for the derivation of each coefficient), sequences of
    `seq_len` (what attention that writes its scores keeps of them)."""
    h = spec.hidden
    sbh = tokens * h
    kv = spec.kv_heads / spec.heads
    attention = 2 + 2 * kv  # q, k, v (after rotary), attention output
    # Hugging Face's eager attention keeps k and v repeated to every head (its matmuls' inputs); selective
    # recompute keeps the projections' outputs (attention)
    kept_qkv = 4.0 if spec.attention == "eager" else attention
    moe = bool(spec.experts)
    mlp = 0.0 if moe else (4 if spec.mlp == "swiglu" else 2) * spec.ffn / h  # swiglu: gate, up, silu, product; gelu: fc1, gelu
    ups = 0.0 if moe else spec.up_projections * spec.ffn / h
    down = 0 if moe else 1  # selective keeps the MLP's (reduced) output; a mixture's is per slot, below
    # the two norms' kept tensors: Hugging Face's RMSNorm computes in float32 (x*rsqrt and the output);
    # LayerNorm and a fused RMSNorm keep one tensor of the activations' size, with mean and rstd or rstd alone
    if spec.keeps_float32_norm:
        norm_bytes, stats = 4 * FLOAT32, 2 * FLOAT32
    else:
        norm_bytes, stats = 2 * act_bytes, (2 if spec.norm == "rmsnorm" else 4) * FLOAT32
    lse = np.where(cp > 1, 0.0, spec.heads * tokens * FLOAT32)  # cp recomputes attention in backward
    scores = tokens * seq_len * spec.heads / tp  # of the s x s squares, on this rank
    if spec.attention == "megatron":
        # softmax's output, dropout's mask and output (Korthikanti et al.'s 5as/h bytes at 2-byte
        # activations); its selective recompute reruns them
        lse, kept, kept_selective = 0.0, (2 * act_bytes + 1) * scores, 0.0
    elif spec.attention == "eager":
        # Hugging Face's: softmax's float32 output and its cast to the activations' dtype (the same
        # tensor in float32); selective recompute keeps the scores' matmul output (measured:
        # tests/test_activations.py)
        lse = 0.0
        kept = (FLOAT32 + np.where(act_bytes < FLOAT32, act_bytes, 0)) * scores
        kept_selective = act_bytes * scores
    else:
        kept = kept_selective = 0.0
    # the two residual sums, each the input of a norm: in a lower precision Hugging Face's RMSNorm
    # keeps its float32 copy (charged in norm_bytes) and nothing keeps the sum itself
    residuals = np.where(norms_copy_inputs(spec, act_bytes), 0, 2)
    split = (tp == 1) | (sp == 1)
    none = np.where(split,
                    (norm_bytes * sbh + (kept_qkv + residuals + mlp) * act_bytes * sbh + stats * tokens + lse) / tp,
                    norm_bytes * sbh + residuals * act_bytes * sbh + (kept_qkv + mlp) * act_bytes * sbh / tp
                    + stats * tokens + lse / tp)
    selective = np.where(split, ((attention + 2 + down + ups) * act_bytes * sbh + lse) / tp,
                         (2 + down + (attention + ups) / tp) * act_bytes * sbh + lse / tp)
    if moe:
        # transformers' grouped experts, per token (tests/test_planner_memory.py measures it): each of its k
        # slots keeps the gathered input and the expert's output (h each), gate_up, silu and their
        # product (4 ffn); the router its float32 probabilities (E), top-k values and their sum (k + 1),
        # the slots' weights (k) and 4k int64 indices (top-k, the sort by expert, gather and scatter
        # back). Under ep a slot's rows come back to their origin and are kept there to be weighed
        # (h, its weight, one more int64 index: a token's mean over the ep ranks, balanced routing).
        # Selective recompute keeps the grouped matmuls' outputs (2 ffn + h a slot) and the
        # router's logits. Experts stay whole on tp ranks: without sp each computes every token.
        k, ffn, experts = spec.top_k, spec.ffn, spec.experts
        kept_none = k * (4 * ffn + 2 * h + 1) * act_bytes + FLOAT32 * (experts + k + 1) + 8 * 4 * k \
            + np.where(ep > 1, k * ((h + 1) * act_bytes + 8), 0)
        kept_selective = (k * (2 * ffn + h) + experts) * act_bytes
        routed = tokens / np.where(sp == 1, tp, 1)
        none = none + kept_none * routed
        selective = selective + kept_selective * routed
    full = np.where(sp == 1, act_bytes * sbh / tp, act_bytes * sbh)
    # selective-alternate: selective without every second weight matmul's output; a row-parallel one's
    # reduced output stays kept under tp (what its collective returns)
    even = spec.weight_matmuls[1::2]
    column, row = (sum(width for _, width, _, rows in even if rows == r) / h for r in (False, True))
    alternate = selective + kept_selective - (column + np.where(tp == 1, row, 0.0)) * act_bytes * sbh / tp
    return np.select([recompute == 0, recompute == 1, recompute == 3], [none + kept, selective + kept_selective,
                                                                          alternate], full)


def end_activation_bytes(spec: ModelSpec, tokens, seq_local, tp, sp, act_bytes, recompute, pp):
    """(first rank, last rank) bytes outside the blocks. First: the embedding's output (on
    sequence shards under sp) and, for rotary models, the cos/sin tables. Last: the final
    norm's kept tensors and the cross-entropy's log-probabilities (`loss_bytes`; the logits
    themselves are not kept; vocabulary-sharded by the loss-parallel head). In a lower precision
    Hugging Face's RMSNorm keeps a float32 copy of its input, not the input (charged to the
    norm), so the ends of the residual stream are kept only where recompute keeps a block's
    input: the embedding's output, and the last block's output recompute charges that block.
    Under pp the first rank's stage output, which the pipeline holds for its backward, stands
    in for the embedding's (the same size) where no block is charged it."""
    sbh = tokens * spec.hidden
    shard = np.where(sp == 1, tp, 1)
    copied = norms_copy_inputs(spec, act_bytes)
    rotary = 2 * seq_local * (spec.hidden // spec.heads) * act_bytes if spec.norm == "rmsnorm" else 0
    first = np.where(copied & (recompute == 0) & (pp == 1), 0.0, act_bytes * sbh / shard) + rotary
    if spec.keeps_float32_norm:  # float32 x*rsqrt and output, rsqrt
        norm = (2 * FLOAT32 * sbh + FLOAT32 * tokens) / shard
        norm = norm - np.where(copied & (recompute > 0), act_bytes * sbh / shard, 0.0)
    else:  # output, mean and rstd (a fused RMSNorm: one tensor and rstd)
        norm = (act_bytes * sbh + (1 if spec.norm == "rmsnorm" else 2) * FLOAT32 * tokens) / shard
    last = norm + loss_bytes(spec, act_bytes) * tokens * spec.vocab / tp
    return first, last


@functools.lru_cache(maxsize=4096)
def stage_layers(spec: ModelSpec, pp: int, virtual: int, seq_len: int) -> tuple[int, int]:
    """Blocks of the layer list on the first and on the last pipeline rank, as shardwise's
    automatic split places them (plan/stages.py's `balance` over the same unit costs: each
    unit's share of forward FLOPs plus its share of parameters; the embedding lookup costs
    parameters and no FLOPs, the head both, a block 2 FLOPs per parameter and token plus
    4 s h for attention, as torch's FLOP counter counts it). A model's replicated embedding
    parameters (GPT's position embedding) are a unit of their own, as the split sees that module:
    where the token embedding outweighs a few blocks the split can give it a stage alone (merged,
    a GPT with a 16K vocabulary at v 2 was charged a block on the wrong rank)."""
    if pp == 1:
        return spec.layers, spec.layers
    layer_params = sum(spec.layer_params)
    tied = spec.head_params[0] == 0
    head_params = sum(spec.head_params) + (spec.embed_params[0] if tied else 0)
    token, position = spec.embed_params
    units = ([Unit("embed", token, 0.0)] + ([Unit("position", position, 0.0)] if position else [])
             + [Unit("block", layer_params, 2.0 * layer_params + 4.0 * seq_len * spec.hidden)] * spec.layers
             + [Unit("head", head_params, 2.0 * spec.hidden * spec.vocab)])
    starts = balance(unit_costs(units), [u.params > 0 for u in units], pp * virtual) + [len(units)]
    blocks = [sum(u.path == "block" for u in units[starts[k]:starts[k + 1]]) for k in range(pp * virtual)]
    return sum(blocks[0::pp]), sum(blocks[pp - 1::pp])


def _end_rank_layers(spec: ModelSpec, pp, virtual, seq_local) -> tuple[np.ndarray, np.ndarray]:
    """`stage_layers` over arrays of layouts (once per distinct pp, virtual and sequence
    length on a rank: the stages are balanced on a rank's own sample, its cp shard)."""
    pp, virtual, seq_local = np.broadcast_arrays(pp, virtual, seq_local)
    keys, inverse = np.unique(np.stack([pp.ravel(), virtual.ravel(), seq_local.ravel()]), axis=1, return_inverse=True)
    counts = np.array([stage_layers(spec, int(p), int(v), int(s)) for p, v, s in keys.T], dtype=np.float64)
    counts = counts.reshape(-1, 2)[inverse.ravel()]
    return counts[:, 0].reshape(pp.shape), counts[:, 1].reshape(pp.shape)


def evaluate(spec: ModelSpec, cluster: Cluster, layout: Layout, seq_len: int) -> Cost:
    """Predicted memory and step time of `layout` (arrays broadcast) for sequences of `seq_len`."""
    L = Layout(*(np.asarray(getattr(layout, f), dtype=np.float64) for f in Layout.__dataclass_fields__))
    memory = _memory(spec, L, seq_len, cluster.runs)
    times = step_times(spec, cluster, L, seq_len, memory)
    return Cost(memory.params, memory.grads, memory.adam, memory.activations, memory.buffers, memory.step, *times,
                sum(memory.first), sum(memory.last), memory.act_first, memory.act_last)


@dataclass
class _Memory:
    """The memory terms of `evaluate`, and what its time terms need of them."""

    params: np.ndarray
    grads: np.ndarray
    adam: np.ndarray
    activations: np.ndarray
    buffers: np.ndarray
    step: np.ndarray  # the optimizer step's temporaries beyond activations + buffers
    params_first: np.ndarray  # parameter counts on the first and last pipeline ranks
    params_last: np.ndarray
    first: tuple  # (params, grads, optimizer) bytes on the first pipeline rank
    last: tuple
    act_first: np.ndarray
    act_last: np.ndarray
    layers_first: np.ndarray  # blocks on the first and last pipeline ranks
    layers_last: np.ndarray
    bucket: np.ndarray  # bytes of one gradient bucket (ZeRO 0-2): bucket_bytes or the largest tensor


def _memory(spec: ModelSpec, L: Layout, seq_len: int, runs: Executor) -> _Memory:
    """Bytes per rank on the busier end of the pipeline: model states and activations."""
    layers_first, layers_last = _end_rank_layers(spec, L.pp, L.virtual, seq_len / L.cp)
    tied_elsewhere = (spec.head_params[0] == 0) & (L.pp > 1)  # the last stage holds the tied embedding too

    # model states on the first pipeline rank (embedding) and on the last (head)
    sharded_l, replicated_l = spec.layer_params
    per_layer = sharded_l / L.tp + replicated_l
    embed = spec.embed_params[0] / L.tp + spec.embed_params[1]
    head = spec.head_params[0] / L.tp + spec.head_params[1] + np.where(tied_elsewhere, spec.embed_params[0] / L.tp, 0)
    params_first = layers_first * per_layer + embed + np.where(L.pp == 1, head, 0)  # at pp=1 one rank holds all
    params_last = layers_last * per_layer + head + np.where(L.pp == 1, embed, 0)
    experts_first, experts_last = layers_first * spec.expert_params / L.ep, layers_last * spec.expert_params / L.ep
    shards = L.dp * L.cp

    # float32 masters under lower-precision parameters, apart from the parameters, except where
    # ZeRO-3's float32 shard is the master and gathers cast it (runs.zero3_cast_shard: not so)
    masters = L.param_bytes < FLOAT32
    master_is_shard = masters & (L.zero == 3) & (not runs.zero3_cast_shard)
    optimizer_bytes = 2 * FLOAT32 + np.where(masters & ~master_is_shard, FLOAT32, 0)
    shard_bytes = np.where(master_is_shard, FLOAT32, L.param_bytes)

    def states(count, experts):  # experts' ZeRO shards are over the dp / ep ranks holding the same experts
        def held(stage):
            return count / np.where(L.zero >= stage, shards, 1) + experts / np.where(L.zero >= stage, shards / L.ep, 1)
        return held(3) * shard_bytes, held(2) * L.grad_bytes, optimizer_bytes * held(1)

    # activations of one microbatch on this rank
    tokens = L.micro_batch * seq_len / L.cp
    block = block_activation_bytes(spec, tokens, L.tp, L.sp, L.cp, L.recompute, L.param_bytes, L.ep, seq_len)
    end_first, end_last = end_activation_bytes(spec, tokens, seq_len / L.cp, L.tp, L.sp, L.param_bytes, L.recompute, L.pp)
    act_first = layers_first * block + end_first + np.where(L.pp == 1, end_last, 0)
    act_last = layers_last * block + end_last
    held = in_flight(L)
    held_blocks, held_head = last_rank_in_flight(L)
    held_first = held * act_first
    held_last = layers_last * block * held_blocks + end_last * held_head
    # our runner's stage outputs and unacknowledged input-gradient sends beyond those
    (outputs_first, sent_first), (outputs_last, sent_last) = runner_boundaries(L)
    boundary = boundary_bytes(spec, L, tokens)
    held_first = held_first + (outputs_first + sent_first) * boundary
    held_last = held_last + (outputs_last + sent_last) * boundary
    # zero-bubble: a stage-microbatch whose weight backward is deferred also keeps its weighted ops'
    # output gradients (`deferred_output_gradients`; the norms' uncharged, 1.7% under the in-step
    # peak); at the peak of torch's order pipeline rank r has r + 1 such (tests/test_planner.py),
    # each 1/v of the rank's blocks, the last rank's all of its final stage
    outputs_grads, norm_output = deferred_output_gradients(spec, L, tokens)
    deferred = (L.schedule == 3) & (L.pp > 1)
    held_first = held_first + np.where(deferred, layers_first / L.virtual * outputs_grads, 0.0)
    held_last = held_last + np.where(deferred, np.minimum(L.microbatches, L.pp)
                                     * (layers_last / L.virtual * outputs_grads + norm_output), 0.0)
    first, last = states(params_first, experts_first), states(params_last, experts_last)
    resident = ((shards > 1) & (L.zero < runs.grads_kept_below_zero)) | (L.microbatches > 1)
    # What a backward holds beyond the saved activations: the loss's transients first, the final
    # norm's next, then, while a block's backward runs, what recompute brings back of it (all of it
    # under full recompute) and its own working memory at its start or at its second norm's backward
    # (zero-bubble's deferred weight backwards keep theirs, charged above). By
    # then the rank with the head has freed one microbatch's head activations; at pp 1 without
    # recompute, what the backward has freed outweighs the working memory (charged, ZeRO 0-3's
    # in-step peaks read 1-7% over: bench/planner.py PEAK_LAYOUTS).
    recomputed = block_activation_bytes(spec, tokens, L.tp, L.sp, L.cp, np.zeros_like(L.recompute), L.param_bytes,
                                        L.ep, seq_len) - block
    # (under sp a recomputation keeps the attention's and the MLP's all-gathered inputs whole, where
    # a forward keeps their shards)
    recomputed = recomputed + np.where((L.recompute > 0) & (L.sp == 1) & (L.tp > 1),
                                       2 * tokens * spec.hidden * L.param_bytes * (1 - 1 / L.tp), 0.0)
    # (zero-bubble's input backward leaves the weight gradients to its weight backward: it ends at
    # the first norm's backward, beside the output gradients kept for it, charged above)
    in_block = recomputed + np.where(deferred, norm_backward_bytes(spec, L, tokens), block_backward_bytes(spec, L, tokens))
    in_block = np.maximum(in_block, norm_in_block_backward_bytes(spec, L, tokens, recomputed))
    # (and the final norm's input, the last block's output, freed by the norm's backward: charged as
    # the embedding's output where the norm keeps the residual sum itself, not a float32 copy)
    norm_input = np.where(norms_copy_inputs(spec, L.param_bytes), 0.0,
                          tokens * spec.hidden * L.param_bytes / np.where(L.sp == 1, L.tp, 1))
    # (zero-bubble's head keeps its saved input for its own weight backward: nothing freed)
    freed = np.where(deferred, 0.0, end_last + norm_input)
    after_head = np.where((L.pp == 1) & (L.recompute == 0), 0.0, np.maximum(in_block - freed, 0.0))
    def in_backward(loss):  # (first, last) ranks' bytes beyond the saved activations, `loss` charging the loss's transients
        return (held_first + np.where(L.pp == 1, np.maximum(loss(first[1]), after_head), in_block),
                held_last + np.maximum(loss(last[1]), after_head))

    head_grads = np.where(spec.head_params[0] == 0, spec.embed_params[0], spec.head_params[0]) / L.tp * L.grad_bytes

    def end_backward(grads, made):  # the loss's backward, then the final norm's (`made`: the gradients exist)
        return np.maximum(loss_backward_bytes(spec, L, tokens, grads, made),
                          final_norm_backward_bytes(spec, L, tokens, grads, made, head_grads))

    saved_first, saved_last = held_first, held_last
    working = in_backward(lambda grads: 0.0)  # what a backward holds beside them, and with all of them
    with_loss = in_backward(lambda grads: end_backward(grads, True))
    held_first, held_last = in_backward(lambda grads: end_backward(grads, resident))
    use_last = (L.pp > 1) & (sum(last) + held_last > sum(first) + held_first)
    params, grads, adam = (np.where(use_last, b, a) for a, b in zip(first, last))
    activations = np.where(use_last, held_last, held_first)
    in_input_backward = activations - np.where(use_last, saved_last, saved_first)  # zero-bubble's, beyond the saved
    working, with_loss = (np.where(use_last, b, a) for a, b in (working, with_loss))
    block_bytes = (per_layer + spec.expert_params / L.ep) * L.param_bytes
    # whole-gradient buckets a ZeRO-2/3 backward holds at once (data/gradients.py: those of the
    # IN_FLIGHT reduce-scatters launched last and the one filling; ZeRO-3's a unit's each), at most
    # the rank's gradients: in the step's peak, not between steps. A ZeRO-0-2 bucket holds whole
    # tensors (comm.coalesce): up to bucket_bytes, or one tensor past that; the window that holds
    # an end rank's embedding or head holds it and IN_FLIGHT buckets of blocks
    rank_params = np.where(use_last, params_last + experts_last, params_first + experts_first)
    rank_bytes = rank_params * L.grad_bytes
    end_first = spec.embed_params[0] / L.tp
    end_last = np.where(tied_elsewhere, end_first, spec.head_params[0] / L.tp)
    end_tensor = np.where(L.pp == 1, np.maximum(end_first, end_last), np.where(use_last, end_last, end_first))
    bucket = np.maximum(L.bucket_bytes, largest_block_tensor(spec, L) * L.grad_bytes)
    window = IN_FLIGHT * bucket + np.maximum(bucket, end_tensor * L.grad_bytes)
    block_grads = block_bytes / L.param_bytes * L.grad_bytes  # ZeRO-3's buckets lie inside a block's
    # ZeRO-3 beside the activations: the k-th bucket of a backward (k <= IN_FLIGHT) fills once
    # floor(k / buckets a block) blocks' backwards are done, their saved activations freed
    unit_bucket = np.minimum(bucket, block_grads)
    per_block = np.ceil(block_grads / unit_bucket)
    window3 = np.max([(k + 1) * unit_bucket - np.where(L.pp == 1, np.floor(k / per_block) * block, 0.0)
                      for k in range(IN_FLIGHT + 1)], axis=0)
    filling = np.select([L.zero == 3, L.zero == 2], [window3, window], 0.0)
    # a pipeline schedule accumulates its microbatches before reducing: ZeRO-2/3 keep every
    # bucket's whole gradient from a stage's first backward to its last (without a pipeline each
    # microbatch reduces into the shards: data/gradients.py's reduce_into_shards)
    # (GPipe's last forward comes before any backward: its peak holds every microbatch's activations and
    # the buckets its first backward fills first, which later hold whole gradients in place of a
    # microbatch's activations)
    gpipe = L.schedule == SCHEDULE_CODES["gpipe"]
    gpipe_peak = np.maximum(rank_bytes - np.where(use_last, act_last, act_first), np.minimum(filling, rank_bytes))
    filling = np.where(L.accumulates_whole, np.where(gpipe, gpipe_peak, rank_bytes), filling)
    # without a pipeline, each microbatch after the first lands its reduce-scatters beside the shards
    # (Bucket.reduced_into): a shard's worth for each launched one still in flight
    landing = np.where((L.zero >= 2) & (L.microbatches > 1) & (L.pp == 1),
                       IN_FLIGHT * np.where(L.zero == 3, np.minimum(bucket, block_grads), bucket) / shards, 0.0)
    filling = filling + landing
    # torch's zero-bubble executor waits for its sends at the step's end: each of a rank's v
    # stages keeps an activation and an input gradient per microbatch (an end rank one fewer)
    sent = np.where(deferred, (2 * L.virtual - 1) * L.microbatches * boundary_bytes(spec, L, tokens), 0.0)
    # and keeps the weight gradients in .grad tensors of its own until the step's end, when
    # shardwise's buckets take them one by one: the rank's gradients in the parameters' dtype, beside
    # the buffers ZeRO 0-1 keep (in place of those ZeRO-2/3 fill). A weight backward computes them a
    # parameter group at a time (torch.autograd.grad over the weights whose gradients meet at one
    # node: a linear layer's weight and bias) and adds each to its .grad: one group's transient, the
    # rank's largest matrix (charged a stage's gradients, ZeRO-1 on one sequence a microbatch read
    # 5.5% over the in-step peak, the 4x wide GPT 4.7%). A weight backward is an action of its own:
    # its transient takes the place of what an input backward holds beyond the saved tensors (the
    # loss's on the last rank; charged both, a 16K vocabulary read 12% over)
    torch_grads = rank_params * L.param_bytes
    held = np.minimum(filling, rank_bytes)
    held = np.where(deferred & (L.zero >= 2), np.maximum(held, torch_grads), held)
    group = np.maximum(largest_block_tensor(spec, L), end_tensor) * L.param_bytes
    weight_grads = np.where(deferred, np.maximum(group - in_input_backward, 0.0)
                            + np.where(L.zero >= 2, 0.0, torch_grads), 0.0)
    # ZeRO-3 gathers two blocks whole; casting a float32 master shard, each sends a cast copy of it
    gathers = 2 * block_bytes * (1 + np.where(master_is_shard, 1 / shards, 0.0))
    buffers = np.where(L.zero == 3, gathers, 0.0) + held + sent + weight_grads
    # ZeRO-2/3 shards freed between steps (`resident` false) come back one bucket at a time as
    # backward reduces, while it frees the activations: the step peaks at the loss (its transients
    # beside every activation, no gradient yet), early in backward (the activations beside the
    # bucket window) or at its end (every shard beside the window): charged grads + buffers +
    # activations, the activations' term is what that leaves (without it, ZeRO-2/3 on a GPT whose
    # parameters outweigh its activations read 10-15% over the in-step peak: bench.WIDE_PEAKS)
    progressive = ~resident & (L.zero >= 2)
    activations = np.where(progressive, np.maximum(np.maximum(with_loss - grads - held, working - grads), 0.0),
                           activations)
    # accumulating whole, the shards come only at the step's end, from the whole buckets, once the
    # activations are gone: the step peaks at the schedule's (without them) or at the end (whole and
    # shards, no activations). Charged both, ZeRO-2 under pp over microbatches read 6.2% over the in-step
    # peak, which is ZeRO-1's to the byte (bench/planner.py MICROBATCH_PEAKS)
    activations = np.where(L.accumulates_whole, np.maximum(activations - grads, 0.0), activations)
    step = np.maximum(step_temporaries(spec, L, adam / optimizer_bytes, end_tensor) - activations - buffers, 0.0)
    return _Memory(params, grads, adam, activations, buffers, step, params_first + experts_first,
                   params_last + experts_last, first, last, act_first, act_last, layers_first, layers_last, bucket)
