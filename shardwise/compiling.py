"""torch.compile the way torchtitan applies it: each block of the model's main layer list
compiled in place (`block.compile()`), `fullgraph=True` unless a block is recomputed (torch's
composable activation checkpoint runs a generator in the block's hooks, which Dynamo leaves
outside the graph: the block's forward still compiles whole), holds experts dispatched by
expert parallelism (their all-to-alls are sized from the routing on the host: eager between
the block's graphs) or records router logits for transformers' load-balancing loss (its
capturing hooks read a ContextVar, which Dynamo cannot trace: they run between graphs).

Equal blocks share one graph (the plan reaches code inside a block as interned layouts, never
as a module path Dynamo would specialize on), state-dict keys stay the module's own (no
`_orig_mod.` wrapper), and what runs around the blocks (the step's agreements, gradient
buckets, the pipeline schedule, ZeRO-3's gathers) stays eager Python, as it must. Where the
compiled code would be wrong or crash the call is refused before anything compiles.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from .errors import ConfigError
from .parallel.tensor.sharding import TensorParallel
from .plan.stages import layer_list


def compile_blocks(module: nn.Module, tensor_parallel: TensorParallel | None, recomputed: list[str],
                   *args: Any, **kwargs: Any) -> list[str]:
    """`block.compile(*args, **kwargs)` for each block of `module`'s main layer list
    (`fullgraph=True` unless given or a block is among `recomputed`); returns their paths.
    `ConfigError` where refused."""
    blocks = layer_list(module)
    if blocks is None:
        raise ConfigError(f"{type(module).__name__} has no layer list (ModuleList or Sequential) to compile block by "
                          "block; compile its submodules yourself with submodule.compile()")
    named = [(f"{blocks}.{name}", block) for name, block in module.get_submodule(blocks).named_children()]
    if tensor_parallel is not None:
        tensor_parallel.refuse_compiling(module, [path for path, _ in named])
    _warn_per_layer_caches(module, len(named))
    dispatched = [path for path, m in module.named_modules() if hasattr(m, "_expert_parallel")]
    if dispatched and kwargs.get("fullgraph"):
        raise ConfigError(f"fullgraph=True with expert parallelism: the token dispatch of {dispatched[0]!r} (and "
                          f"{len(dispatched) - 1} more) sizes its all-to-alls from the routing on the host, so it runs "
                          "eagerly between the block's graphs; compile with fullgraph=False (the default here)")
    recorded = [type(m).__name__ for m in module.modules()
                if getattr(getattr(m, "config", None), "output_router_logits", False) is True]
    if recorded and kwargs.get("fullgraph"):
        raise ConfigError(f"fullgraph=True with {recorded[0]}'s load-balancing loss (output_router_logits=True): "
                          "transformers records router logits with forward hooks that read a ContextVar, which Dynamo "
                          "cannot trace; compile with fullgraph=False (the default here: each hook runs between the "
                          "block's graphs), or set output_router_logits=False")
    kwargs.setdefault("fullgraph", not dispatched and not recorded and not any(path in recomputed for path, _ in named))
    for _, block in named:
        block.compile(*args, **kwargs)
    return [path for path, _ in named]


def _warn_per_layer_caches(module: nn.Module, blocks: int) -> None:
    """A Hugging Face model with `use_cache` builds a key/value cache even in training and hands
    it to every layer; Dynamo guards on the layer's slot in it and compiles each layer anew,
    and past its recompile limit the remaining layers run eager (torch only logs it)."""
    limit = torch._dynamo.config.recompile_limit
    if blocks > limit and any(getattr(getattr(m, "config", None), "use_cache", False) is True for m in module.modules()):
        warnings.warn(
            f"the model's Hugging Face config has use_cache=True: its key/value cache makes torch compile each of the "
            f"{blocks} layers separately, and past torch._dynamo.config.recompile_limit={limit} the rest run eager. "
            "Train with use_cache=False (under context parallelism, which needs the cache's mask, raise the limit "
            "instead)", stacklevel=3)
