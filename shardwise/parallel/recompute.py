"""Activation recompute: modules whose activations are rebuilt in backward instead of kept.

`apply_recompute` marks each chosen module with torch's composable, non-reentrant activation
checkpoint (`torch.distributed._composable.checkpoint`): it works through forward hooks, so
module paths, state-dict keys, tensor-parallel rules, ZeRO-3 gathers and pipeline stages see
the same modules as without it, and the random state is restored for the recomputation, so
dropout draws the same masks twice.

Which modules: the plan's `recompute` patterns, exactly the modules they name; otherwise,
with `config.recompute` set, every block of the model's main layer list.

How much: "full" keeps only each module's inputs and recomputes everything inside it;
"selective" keeps the outputs of matrix multiplications (experts' grouped ones too), attention and the collectives
that finish a tensor-parallel block (a row-parallel matmul's full-size partial sum is
recomputed instead: its reduced output is kept), and recomputes the cheap rest (norms, activations,
residual adds, rotary embeddings), with torch's selective activation checkpointing policy;
"selective-alternate" keeps the same except the output of every second weight matmul of
the module (the 2nd, 4th, ... mm/addmm/grouped mm in forward order: a Llama block's k, o and
up projections), trading their forward again for their memory: torchtitan's op-level
policy ("save all compute ops except every second mm"). A plan naming modules with
config.recompute=None recomputes them fully.

A key/value cache handed to a recomputed module (Hugging Face layers get the empty
`past_key_values` a training forward builds) would be filled twice, so the recomputation
would see other keys than the forward: the module gets None instead, which computes the
same outputs, as Hugging Face's own gradient checkpointing turns `use_cache` off. A cache
already holding keys is refused.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ..config import ZERO_BUBBLE_RECOMPUTE, ParallelConfig
from ..errors import ConfigError, ModelError, PlanError
from ..plan import ResolvedPlan
from ..plan.stages import layer_list
from ..tensors import is_kv_cache

RECOMPUTE_MODES = ("full", "selective", "selective-alternate")
WEIGHT_MATMULS = ("mm", "addmm", "_grouped_mm")  # what selective-alternate counts (attention's bmm are not)


def _aten_ops(names) -> set:
    """The default overloads of the aten ops this torch has among `names`."""
    return {getattr(torch.ops.aten, name).default for name in names if hasattr(torch.ops.aten, name)}


def _saved_ops() -> set:
    """Ops whose outputs selective recompute keeps: the expensive ones."""
    ops = _aten_ops([*WEIGHT_MATMULS, "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
                     "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                     "_scaled_dot_product_flash_attention_for_cpu"])
    functional = getattr(torch.ops, "_c10d_functional", None)
    for name in ("reduce_scatter_tensor", "all_reduce"):
        if functional is not None and hasattr(functional, name):
            ops.add(getattr(functional, name).default)
    return ops


def _selective_policy(saved: set, tp, alternate: dict | None, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Keep `saved` ops' outputs; under selective-alternate (`alternate`: the module's weight
    matmuls counted so far, in its forward and in its recomputation) not every second one.
    The two counts are kept apart because torch 2.11 asks the policy again during the
    recomputation (2.13 reuses the forward's answers)."""
    if alternate is not None and op in alternate["ops"]:
        mode = "recompute" if ctx.is_recompute else "forward"
        alternate[mode] += 1
        if alternate[mode] % 2 == 0:
            return CheckpointPolicy.PREFER_RECOMPUTE
    if op in saved and not (tp is not None and tp.computing_partial):  # a partial sum: its reduction is kept
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts(saved: set, weight_matmuls: set | None, tp) -> tuple:
    """Forward and recomputation contexts of one selective recomputation (a fresh count of
    weight matmuls for each under selective-alternate)."""
    alternate = None if weight_matmuls is None else {"ops": weight_matmuls, "forward": 0, "recompute": 0}
    return create_selective_checkpoint_contexts(functools.partial(_selective_policy, saved, tp, alternate))


def recompute_targets(module: nn.Module, config: ParallelConfig, resolved: ResolvedPlan) -> list[str]:
    """The module paths recompute applies to (see the module docstring)."""
    if resolved.recompute:
        paths = list(dict.fromkeys(resolved.recompute))
        nested = [(a, b) for a in paths for b in paths if b.startswith(a + ".")]
        if nested:
            raise PlanError(f"plan recompute names {nested[0][1]!r} inside {nested[0][0]!r}, which is already "
                            "recomputed whole; name one of them")
        if config.splits_backward:
            raise ConfigError(f"the plan recomputes {paths[:3]} with schedule='zero-bubble' and pp > 1: "
                              + ZERO_BUBBLE_RECOMPUTE)
        return paths
    if config.recompute is None:
        return []
    parts = resolved.plan.parts
    blocks = layer_list(module, parts)
    if blocks is None:
        raise PlanError(f"recompute={config.recompute!r} recomputes the blocks of the model's layer list, and "
                        f"{type(module).__name__}{f' (in parts {parts})' if parts else ''} has no ModuleList or "
                        "Sequential; name the modules with Plan(recompute=[...])")
    return [f"{blocks}.{name}" for name, _ in module.get_submodule(blocks).named_children()]


def apply_recompute(module: nn.Module, config: ParallelConfig, resolved: ResolvedPlan, tp=None,
                    cp=None) -> list[str]:
    """Mark the modules `recompute_targets` picks; returns their paths. `tp`: the tensor
    parallel executor, whose row-parallel matmuls (full-size partial sums) selective
    recompute does not keep; `cp`: the context parallel executor, whose attention over the
    whole sequence the recomputation runs too (backward runs outside the forward's context)."""
    paths = recompute_targets(module, config, resolved)
    selective = None
    if config.recompute in ("selective", "selective-alternate"):
        weight_matmuls = _aten_ops(WEIGHT_MATMULS) if config.recompute == "selective-alternate" else None
        selective = functools.partial(_selective_contexts, _saved_ops(), weight_matmuls, tp)
    for path in paths:
        target = module.get_submodule(path)
        target.register_forward_pre_hook(functools.partial(_without_cache, path), with_kwargs=True)
        context_fn = None if selective is None and tp is None and cp is None else \
            functools.partial(_contexts, path, tp, cp, selective)
        checkpoint(target, context_fn=context_fn, preserve_rng_state=True)  # its hook runs after the one above
    return paths


def _contexts(path: str, tp, cp, selective) -> tuple:
    """The forward and recomputation contexts of the module at `path`: selective recompute's
    policy, and, while it is recomputed, its own input conversions off (the checkpoint kept
    its inputs as they were after them) and attention over the whole sequence under cp."""
    forward, recomputation = selective() if selective is not None else (contextlib.nullcontext(),
                                                                        contextlib.nullcontext())
    if tp is not None:
        recomputation = _together(recomputation, tp.replaying(path))
    if cp is not None:
        recomputation = _together(recomputation, cp.attention())
    return forward, recomputation


@contextlib.contextmanager
def _together(first, second):
    with first, second:
        yield


def _without_cache(path: str, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """An empty key/value cache argument replaced by None (see the module docstring)."""
    def strip(value):
        if not is_kv_cache(value):
            return value
        if value.get_seq_length() != 0:
            raise ModelError(f"{path} is recomputed in backward and was given a {type(value).__name__} holding "
                             "keys; recompute needs use_cache=False (no past_key_values) when training")
        return None

    if not any(is_kv_cache(v) for v in (*args, *kwargs.values())):
        return None
    return tuple(strip(v) for v in args), {k: strip(v) for k, v in kwargs.items()}
