"""torch.compile the way torchtitan applies it: each block of the model's main layer list
compiled in place (`block.compile()`), `fullgraph=True` unless a block is recomputed (torch's
composable activation checkpoint runs a generator in the block's hooks, which Dynamo leaves
outside the graph: the block's forward still compiles whole).

Equal blocks share one graph (the plan reaches code inside a block as interned layouts, never
as a module path Dynamo would specialize on), state-dict keys stay the module's own (no
`_orig_mod.` wrapper), and what runs around the blocks (the step's agreements, gradient
buckets, the pipeline schedule, ZeRO-3's gathers) stays eager Python, as it must. Where the
compiled code would be wrong or crash the call is refused before anything compiles.
"""

from __future__ import annotations

from typing import Any

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
    kwargs.setdefault("fullgraph", not any(path in recomputed for path, _ in named))
    for _, block in named:
        block.compile(*args, **kwargs)
    return [path for path, _ in named]
