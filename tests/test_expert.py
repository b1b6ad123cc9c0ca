"""Expert parallelism on tiny Hugging Face mixtures of experts (Mixtral, Qwen2-MoE) against one
process: experts split over ep ranks, tokens sent to them by all-to-all, nothing dropped.

Routing is discontinuous: a token whose k-th and (k+1)-th router logits were within rounding
of each other could pick another expert in one run than in the other, and no gradient bound
would then hold. So each reference run first shows that no such token exists (`routing_margin`):
a logit is a sum of n = 32 products whose inputs come from the forward (the D ≈ 52 dependent
reductions of parity.py), so two evaluations differ by at most 2·EPS_LOSS·M, M = Σ|w·h| the
magnitudes it sums (parity.py's derivation of EPS_LOSS); parameters entering later steps differ
by the SGD bound, of the same order, so a gap above 4·EPS_LOSS·M cannot flip. The routers start
from N(0, 1) weights (seed 3) so that every token of every step clears it (by 2.1x at least on
the machine that chose the seed; the reference itself moves by at most a quarter of the margin
from one machine to another). Runs that draw random numbers (router jitter, attention dropout)
route other tokens, so they start from RANDOM_ROUTER_SEED, chosen the same way.
"""

from __future__ import annotations

import functools

import pytest
import torch
import transformers

import shardwise as sw
from parity import (EPS_LOSS, Case, assert_meaningful, assert_parity, compare_cases, corpus_batches, reference_run,
                    run_and_compare, train_parallel)
from shardwise.parallel.expert import check_expert_parallel
from shardwise.models import CausalLM
from test_context_parallel import cp_batches
from test_zoo import EndToEnd

ROUTER_SEED = 3
ALL, MIXTRAL = ("mixtral", "qwen2_moe"), ("mixtral",)
RANDOM_ROUTER_SEED = 19  # with router jitter and attention dropout: every margin clears it by 3.1x here


def make_moe(kind: str, experts: int = 4, aux_loss: bool = False, jitter: float = 0.0,
             attention_dropout: float = 0.0, router_seed: int = ROUTER_SEED) -> EndToEnd:
    """`jitter`: Mixtral's router input jitter (uniform noise on every token the router sees)."""
    torch.manual_seed(0)
    t = transformers
    common = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                  max_position_embeddings=64, num_experts_per_tok=2, output_router_logits=aux_loss,
                  attention_dropout=attention_dropout)
    if kind == "mixtral":
        model = t.MixtralForCausalLM(t.MixtralConfig(intermediate_size=32, num_local_experts=experts,
                                                     router_jitter_noise=jitter, **common))
    elif kind == "qwen3_moe":
        model = t.Qwen3MoeForCausalLM(t.Qwen3MoeConfig(moe_intermediate_size=32, intermediate_size=32,
                                                       num_experts=experts, decoder_sparse_step=1, **common))
    elif kind == "deepseek_v3":  # sigmoid scores, group-limited top-k (every group open here), a shared expert
        model = t.DeepseekV3ForCausalLM(t.DeepseekV3Config(
            intermediate_size=32, moe_intermediate_size=16, n_routed_experts=experts, n_shared_experts=1,
            first_k_dense_replace=1, n_group=2, topk_group=2, routed_scaling_factor=1.0, kv_lora_rank=16, q_lora_rank=None,
            qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, **{**common, "num_key_value_heads": 4}))
    elif kind == "olmoe":
        model = t.OlmoeForCausalLM(t.OlmoeConfig(intermediate_size=32, num_experts=experts, bos_token_id=0,
                                                 eos_token_id=0, **common))
    else:
        model = t.Qwen2MoeForCausalLM(t.Qwen2MoeConfig(
            moe_intermediate_size=32, shared_expert_intermediate_size=32, intermediate_size=32, num_experts=experts,
            decoder_sparse_step=1, **common))
    generator = torch.Generator().manual_seed(router_seed)
    with torch.no_grad():
        for module in model.modules():
            if _is_router(module):
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator))
    return EndToEnd(model)


def causal_moe(kind: str, aux_loss: bool = False) -> CausalLM:
    """The model taking pre-shifted labels, as context parallelism needs."""
    seed = CP_AUX_ROUTER_SEED if aux_loss else CP_ROUTER_SEED
    return CausalLM(make_moe(kind, aux_loss=aux_loss, router_seed=seed).lm)


def moe_batches(steps: int = 4, seq: int = 8) -> list[dict[str, torch.Tensor]]:
    """4 rows of seq + 1 tokens (an even 8 with seq=7, for sequence parallelism)."""
    return [{"input_ids": t, "labels": t.clone()} for t in corpus_batches(steps, 4, seq=seq)]


def _record_gap(ratios: list[float], router, args, out) -> None:
    """A router's forward hook: the smallest gap of this call, in units of 4·EPS_LOSS·M."""
    hidden, logits = args[0].reshape(-1, router.hidden_dim).detach(), out[0].detach()
    top = logits.sort(-1, descending=True).values
    gap = top[:, router.top_k - 1] - top[:, router.top_k]
    magnitude = (hidden.abs() @ router.weight.detach().abs().T).max(-1).values
    ratios.append(float((gap / (4 * EPS_LOSS * magnitude)).min()))


def _is_router(module) -> bool:
    return type(module).__name__.lower().endswith("topkrouter")  # DeepSeek-V3 spells it TopkRouter


def _routers(model) -> list:
    return [m for m in model.modules() if _is_router(m)]


def routing_margin(factory, batches) -> float:
    """The smallest (k-th minus (k+1)-th router logit) / (4·EPS_LOSS·M) over every token, layer
    and step of the one-process run; above 1, no run within rounding routes differently."""
    ratios = []
    record = functools.partial(_record_gap, ratios)

    def loss(model, batch):
        hooks = [m.register_forward_hook(record) for m in _routers(model)]
        try:
            return model(batch)
        finally:
            for hook in hooks:
                hook.remove()

    reference_run(factory, batches, loss=loss)
    return min(ratios)


@pytest.mark.parametrize("kind, options, seq", [("mixtral", {}, 8), ("qwen2_moe", {}, 8),
                                                ("mixtral", {"aux_loss": True}, 8), ("qwen2_moe", {"aux_loss": True}, 8),
                                                ("mixtral", {}, 7), ("qwen2_moe", {}, 7),
                                                ("mixtral", {"aux_loss": True}, 7), ("qwen2_moe", {"aux_loss": True}, 7),
                                                ("mixtral", {"jitter": 0.1, "router_seed": RANDOM_ROUTER_SEED}, 7)])
def test_routing_clears_rounding(kind, options, seq):
    assert routing_margin(functools.partial(make_moe, kind, **options), moe_batches(seq=seq)) > 1.0


@pytest.mark.parametrize("kind, aux_loss", [("mixtral", False), ("qwen2_moe", False), ("mixtral", True),
                                            ("qwen2_moe", True)])
def test_routing_clears_rounding_on_context_parallel_batches(kind, aux_loss):
    assert routing_margin(functools.partial(causal_moe, kind, aux_loss), cp_batches()) > 1.0


EP_LAYOUTS = {  # name: config, optimizer, zoo plan (tp), kinds
    2: {"ep2": ({"ep": 2}, "sgd", False, ALL)},
    4: {"ep4": ({"ep": 4}, "sgd", False, ALL), "ep2 x dp2": ({"ep": 2}, "sgd", False, ALL),
        "ep2 x tp2": ({"ep": 2, "tp": 2}, "sgd", True, ALL),
        "ep2 x pp2": ({"ep": 2, "pp": 2, "microbatches": 2}, "sgd", False, ALL),
        "ep2 x dp2 zero3": ({"ep": 2, "zero": 3}, "adamw", False, ALL),
        # (the suite's time: these three on Mixtral alone, whose experts are Qwen2-MoE's routed ones)
        "ep2 x dp2 zero1": ({"ep": 2, "zero": 1}, "adamw", False, MIXTRAL),
        "ep4 zero2": ({"ep": 4, "zero": 2}, "adamw", False, MIXTRAL),
        "ep2 x dp2 recompute": ({"ep": 2, "recompute": "full"}, "sgd", False, MIXTRAL)},
}


# the load-balancing loss over the whole batch: name -> config, sequence length (7: sequence shards)
AUX_LAYOUTS = {2: {"dp2": ({}, 8), "ep2": ({"ep": 2}, 8), "tp2": ({"tp": 2}, 8),
                   "tp2 + sp": ({"tp": 2, "sequence_parallel": True}, 7)},
               4: {"ep4": ({"ep": 4}, 8), "ep2 x dp2": ({"ep": 2}, 8), "ep2 x tp2": ({"ep": 2, "tp": 2}, 8),
                   "ep2 x dp2 zero3": ({"ep": 2, "zero": 3}, 8),
                   "ep2 x tp2 + sp": ({"ep": 2, "tp": 2, "sequence_parallel": True}, 7)}}
SEQUENCE_LAYOUTS = {2: {}, 4: {"ep2 x tp2 + sp": {"ep": 2, "tp": 2, "sequence_parallel": True},  # experts route the
                               "tp2 + sp x dp2": {"tp": 2, "sequence_parallel": True}}}  # tokens of a sequence shard
# context parallelism: each cp rank routes its own tokens of every sequence (pre-shifted labels,
# test_context_parallel's batches; their 64 tokens a step route clear of rounding from CP_ROUTER_SEED)
CP_ROUTER_SEED, CP_AUX_ROUTER_SEED = 13, 31  # margins 1.8x and 3.4x at least here
CONTEXT_LAYOUTS = {2: {}, 4: {"ep2 x cp2": ({"ep": 2, "cp": 2}, "sgd", MIXTRAL),
                              "ep2 x cp2 zero3": ({"ep": 2, "cp": 2, "zero": 3}, "adamw", ALL)}}
# Mixtral's router jitter (uniform noise on the router's input): one process's noise exists only
# without dp; on sequence shards each tp rank takes its part of the noise drawn for the whole input
JITTER_LAYOUTS = {2: {"tp2 + sp": {"tp": 2, "sequence_parallel": True}, "tp2": {"tp": 2}}, 4: {}}


@pytest.mark.parametrize("world", sorted(EP_LAYOUTS))
def test_expert_parallel_parity(world):
    """Losses, whole gradients and parameters after 4 steps equal one process's (AdamW where
    ZeRO shards its state); under tp the zoo plan shards attention, the experts stay whole. With
    transformers' load-balancing loss too: over the whole batch, not each replica's."""
    cases = [Case(f"{kind} {name}", config, functools.partial(make_moe, kind), moe_batches(), optimizer=optimizer,
                  plan=kind if planned else None)
             for name, (config, optimizer, planned, kinds) in EP_LAYOUTS[world].items() for kind in kinds]
    cases += [Case(f"{kind} {name} load-balancing loss", config, functools.partial(make_moe, kind, aux_loss=True),
                   moe_batches(seq=seq), plan=kind if config.get("tp", 1) > 1 else None)
              for kind in ("mixtral", "qwen2_moe") for name, (config, seq) in AUX_LAYOUTS[world].items()]
    cases += [Case(f"{kind} {name}", config, functools.partial(make_moe, kind), moe_batches(seq=7), plan=kind)
              for kind in ("mixtral", "qwen2_moe") for name, config in SEQUENCE_LAYOUTS[world].items()]
    cases += [Case(f"{kind} {name}", config, functools.partial(causal_moe, kind), cp_batches(), optimizer=optimizer)
              for name, (config, optimizer, kinds) in CONTEXT_LAYOUTS[world].items() for kind in kinds]
    if world == 4:  # each cp shard's tokens in the load-balancing loss, weighted by cp like the rest of the loss
        cases += [Case(f"{kind} ep2 x cp2 load-balancing loss", {"ep": 2, "cp": 2},
                       functools.partial(causal_moe, kind, aux_loss=True), cp_batches()) for kind in MIXTRAL]
    jittered = functools.partial(make_moe, "mixtral", jitter=0.1, router_seed=RANDOM_ROUTER_SEED)
    cases += [Case(f"mixtral {name} router jitter", config, jittered, moe_batches(seq=7), plan="mixtral")
              for name, config in JITTER_LAYOUTS[world].items()]
    compare_cases(world, cases)


def pipelined_aux_cases(fault: str | None = None) -> list[Case]:
    """The load-balancing loss under pp: each microbatch's, over the rows every replica (and cp
    or sequence shard) routes in it, as one process accumulating gradients over those
    microbatches takes it. Over dp2 (ep2 x pp2) replica r's microbatch m holds row 2r + m of
    the 4, so the reference's microbatches are rows (0, 2) and (1, 3)."""
    if fault is not None:
        return [Case(f"mixtral ep2 x pp2 load-balancing loss, {fault}", {"ep": 2, "pp": 2, "microbatches": 2},
                     functools.partial(make_moe, "mixtral", aux_loss=True), moe_batches(), reference_microbatches=2,
                     reference_rows=[0, 2, 1, 3], fault=fault)]
    pipelined = {"ep": 2, "pp": 2, "microbatches": 2}
    cases = [Case(f"{kind} ep2 x pp2 load-balancing loss", pipelined, functools.partial(make_moe, kind, aux_loss=True),
                  moe_batches(), reference_microbatches=2, reference_rows=[0, 2, 1, 3]) for kind in ALL]
    cases.append(Case("mixtral tp2 + sp x pp2 load-balancing loss",
                      {"tp": 2, "sequence_parallel": True, "pp": 2, "microbatches": 2},
                      functools.partial(make_moe, "mixtral", aux_loss=True), moe_batches(seq=7), plan="mixtral",
                      reference_microbatches=2))
    cases.append(Case("mixtral cp2 x pp2 load-balancing loss", {"cp": 2, "pp": 2, "microbatches": 2},
                      functools.partial(causal_moe, "mixtral", aux_loss=True), cp_batches(), reference_microbatches=2))
    return cases


def test_pipelined_load_balancing_loss_parity():
    """The pipelined cases in a spawn of their own: at the end of test_expert_parallel_parity's
    many cases they ran several times slower than alone and pushed it past run_on_ranks' timeout."""
    compare_cases(4, pipelined_aux_cases())


@pytest.mark.parametrize("fault", ["aux-loss-per-replica", "aux-logits-detached"])
def test_pipelined_load_balancing_loss_fails_under_fault(fault):
    """Under pp: the loss over one replica's rows (the router logits not gathered, the capture
    laid out for one replica's), or the logits sent to the last stage without their gradient."""
    with pytest.raises(AssertionError):
        compare_cases(4, pipelined_aux_cases(fault))


OTHER_ROUTER_SEED = 13  # Qwen3-MoE, OLMoE and DeepSeek-V3: margins 2.4x, 6.8x and 5.1x here
OTHER_KINDS = ("qwen3_moe", "olmoe", "deepseek_v3")


@pytest.mark.parametrize("kind", OTHER_KINDS)
def test_other_models_route_clear_of_rounding(kind):
    assert routing_margin(functools.partial(make_moe, kind, router_seed=OTHER_ROUTER_SEED), moe_batches()) > 1.0


def test_other_hugging_face_mixtures_of_experts():
    """Qwen3-MoE, OLMoE (q/k norms) and DeepSeek-V3 (latent attention, a dense first layer, sigmoid
    group-limited routing, a shared expert) keep their experts as grouped tensors too: found
    where they sit and split at ep2 with no plan, exact."""
    compare_cases(2, [Case(f"{kind} ep2", {"ep": 2}, functools.partial(make_moe, kind, router_seed=OTHER_ROUTER_SEED),
                           moe_batches()) for kind in OTHER_KINDS])


def _replicated_then_expert_parallel(kinds: list[str], fault: str | None = None):
    """Per kind: dp2 with every expert on each replica (recording the routing margin of its
    forwards), then ep2 (with `fault` injected), both with attention dropout and, for Mixtral,
    router jitter."""
    out = []
    for kind in kinds:
        factory = functools.partial(make_moe, kind, attention_dropout=0.2, jitter=0.1 if kind == "mixtral" else 0.0,
                                    router_seed=RANDOM_ROUTER_SEED)
        ratios = []

        def recorded():
            model = factory()
            for router in _routers(model):
                router.register_forward_hook(functools.partial(_record_gap, ratios))
            return model

        replicated = train_parallel({}, recorded, moe_batches(), every_step=True)
        out.append((replicated, train_parallel({"ep": 2}, factory, moe_batches(), fault=fault), min(ratios)))
    return out


def test_random_draws_under_ep_are_those_of_replicated_experts():
    """Dropout and router jitter draw on each replica's own tokens (one process's masks exist
    only without dp, as for dense models): ep moves token slots between ranks, which must not
    change a single random number the replicas draw. So ep2 with attention dropout and router
    jitter matches dp2 with the experts at home, within the parity bounds (whose reference is
    the dp2 run, its own routing margin checked as the one-process one is)."""
    kinds = ["mixtral", "qwen2_moe"]
    for rank, runs in enumerate(sw.testing.run_on_ranks(_replicated_then_expert_parallel, 2, kinds)):
        for kind, (replicated, expert_parallel, margin) in zip(kinds, runs):
            assert margin > 1.0, (kind, margin)
            assert_meaningful(replicated)
            assert_parity(replicated, expert_parallel)


def test_random_draws_under_ep_fail_under_fault():
    """The ep path drawing one random number of its own shifts every later draw."""
    replicated, expert_parallel, _ = sw.testing.run_on_ranks(_replicated_then_expert_parallel, 2, ["mixtral"],
                                                             "expert-dispatch-draws")[0][0]
    with pytest.raises(AssertionError):
        assert_parity(replicated, expert_parallel)


def _unequal_replicas(kind: str, aux_loss: bool):
    """Rank 0 trains on 3 samples, rank 1 on 1: expert gradients must weight each replica's
    tokens by its share as the dense ones do (what one process computes on all 4); the
    load-balancing loss gathers 24 router rows from one rank and 8 from the other."""
    import torch.distributed as dist

    pm = sw.parallelize(make_moe(kind, aux_loss=aux_loss), sw.ParallelConfig(ep=2))
    batch = moe_batches(1)[0]
    rows = slice(0, 3) if dist.get_rank() == 0 else slice(3, 4)
    loss = pm.train_step({k: v[rows] for k, v in batch.items()})
    return float(loss), pm.full_grad_dict()


@pytest.mark.parametrize("kind, aux_loss", [("mixtral", False), ("qwen2_moe", True)])
def test_unequal_replicas_weight_expert_gradients(kind, aux_loss):
    from parity import EPS_GRAD, module_scales

    model = make_moe(kind, aux_loss=aux_loss)
    batch = moe_batches(1)[0]
    out = model(batch)
    out.backward()
    want_loss = float(out.detach())
    want = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    scales = module_scales(want)
    for loss, grads in sw.testing.run_on_ranks(_unequal_replicas, 2, kind, aux_loss):
        assert abs(loss - want_loss) <= EPS_LOSS * want_loss
        assert grads.keys() == want.keys()
        for name, grad in grads.items():
            assert (grad - want[name]).abs().max() <= EPS_GRAD * scales[name], name


@pytest.mark.parametrize("fault", ["expert-tokens-dropped", "expert-grads-over-dp", "aux-loss-per-replica",
                                   "expert-grads-without-cp", "expert-weight-without-cp"])
def test_expert_parity_fails_under_fault(fault):
    """A capacity limit that drops token slots (as capacity-factor routers do), expert gradients
    summed over every data-parallel rank instead of those holding the same experts, the
    load-balancing loss taken over each replica's tokens; under cp, expert gradients not summed
    over the cp peers, or weighted for the dp mean alone."""
    if fault.endswith("-cp"):  # (healthy: "mixtral ep2 x cp2" of test_expert_parallel_parity)
        with pytest.raises(AssertionError):
            run_and_compare(4, {"ep": 2, "cp": 2}, functools.partial(causal_moe, "mixtral"), cp_batches(), fault=fault)
        return
    factory = functools.partial(make_moe, "mixtral", aux_loss=fault == "aux-loss-per-replica")
    with pytest.raises(AssertionError):
        run_and_compare(4, {"ep": 2}, factory, moe_batches(), fault=fault)


def test_sequence_parallel_load_balancing_loss_fails_under_fault():
    """The tp peers' gradients of the gathered router logits summed without dividing by tp."""
    with pytest.raises(AssertionError):
        run_and_compare(2, {"tp": 2, "sequence_parallel": True}, functools.partial(make_moe, "mixtral", aux_loss=True),
                        moe_batches(seq=7), plan="mixtral", fault="aux-tp-peers-summed")


def test_router_jitter_parity_fails_under_fault():
    """Each sequence shard drawing its own router jitter (the noise of its shard's shape)."""
    with pytest.raises(AssertionError):
        run_and_compare(2, {"tp": 2, "sequence_parallel": True},
                        functools.partial(make_moe, "mixtral", jitter=0.1, router_seed=RANDOM_ROUTER_SEED),
                        moe_batches(seq=7), plan="mixtral", fault="jitter-per-shard")


def test_refusals():
    with pytest.raises(sw.ConfigError, match="ep=2 does not divide dp=3"):
        sw.ParallelConfig(ep=2).resolve(3)
    with pytest.raises(sw.ConfigError, match="ep=4 does not divide the 6 experts"):
        check_expert_parallel(make_moe("mixtral", experts=6), sw.ParallelConfig(ep=4))

    from test_zoo import make

    with pytest.raises(sw.ConfigError, match="no mixture-of-experts layer"):
        check_expert_parallel(make("llama"), sw.ParallelConfig(ep=2))


def make_moe_mixtral() -> EndToEnd:
    """`make_moe("mixtral")` as a factory without arguments (`shardwise check`)."""
    return make_moe("mixtral")


def _compiled(cases):
    from parity import train_parallel

    return [train_parallel(config, functools.partial(make_moe, kind, aux_loss=aux), moe_batches(seq=seq), plan,
                           compile_kwargs={"backend": "eager"}) for kind, config, aux, plan, seq in cases]


def test_compiled_blocks_with_experts_dispatched():
    """pmodel.compile() under ep: each block compiled, the token dispatch (and the router logits'
    gather for the load-balancing loss) eager between its graphs; parity with one process.
    fullgraph=True is refused: the dispatch cannot be inside the graph. With the load-balancing
    loss under tp + sp (a loss-parallel head's PlainLoss in compiled code's company) too:
    transformers' router-logit hooks read a ContextVar Dynamo cannot trace, so they run between
    graphs and fullgraph=True is refused there as well."""
    from parity import assert_parity

    from shardwise.compat import COMPILES_DTENSOR_PARAMETERS

    tensor_parallel = ("mixtral", {"tp": 2, "sequence_parallel": True}, True, "mixtral", 7)
    cases = [("mixtral", {"ep": 2}, True, None, 8)]  # (Dynamo's eager backend: its graphs and breaks, no inductor build)
    if COMPILES_DTENSOR_PARAMETERS:
        cases.append(tensor_parallel)
    else:  # torch < 2.13 loses tensor-parallel gradients in compiled code: refused (tests/test_compile.py)
        with pytest.raises(sw.RankFailedError, match="loses the gradients of tensor-parallel parameters"):
            sw.testing.run_on_ranks(_compiled, 2, [tensor_parallel])
    references = [reference_run(functools.partial(make_moe, kind, aux_loss=aux), moe_batches(seq=seq))
                  for kind, _, aux, _, seq in cases]
    for runs in sw.testing.run_on_ranks(_compiled, 2, cases):
        for reference, run in zip(references, runs):
            assert_parity(reference, run)
    for config, aux, refusal in (({"ep": 2}, False, "fullgraph=True with expert parallelism"),
                                 ({}, True, "fullgraph=True with MixtralForCausalLM's load-balancing loss")):
        with pytest.raises(sw.RankFailedError, match=refusal):
            sw.testing.run_on_ranks(_compile_fullgraph, 2, config, aux)


def _compile_fullgraph(config: dict, aux_loss: bool):
    pm = sw.parallelize(make_moe("mixtral", aux_loss=aux_loss), sw.ParallelConfig(**config))
    pm.compile(fullgraph=True)


def test_deferred_init_keeps_only_this_ranks_experts():
    """sw.deferred_init: each rank materializes its own experts (cut as each tensor is built),
    with exactly the eager values: training equals one process's."""
    run_and_compare(4, {"ep": 4}, functools.partial(make_moe, "qwen2_moe"), moe_batches(), deferred=True)
