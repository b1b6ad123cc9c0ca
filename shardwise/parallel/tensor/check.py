"""The first forward under a tensor-parallel plan, checked: where do sharded features go?

A column-parallel module leaves this rank's share of its output features in the last dim:
a contiguous block (`Shard`) or, for a fused weight (`StridedShard(d, k)`), one slice of
each of k blocks. Such a tensor is only meaningful to a row-parallel module expecting the
same contiguous block, or to code that first splits the k blocks apart (a fused q|k|v or
gate|up output). Shapes cannot tell these apart (a strided fc1 feeding a row-parallel fc2
has exactly the right shape and trains a wrong model), so the first forward runs under a
dispatch mode that follows the features:

- layout: a column output's last dim is tagged (source module, k blocks); the tag follows
  ops that keep the tensor's shape (activations, residual-free arithmetic) and splits of the
  last dim into the k blocks (each piece then holds a contiguous block);
- taint: every tensor computed from a column output remembers which column modules fed it,
  until a module whose rule reduces over tp (row-parallel, vocab-parallel) returns.

Checked: a replicated module with parameters (or one without a tensor-parallel rule for the
layout it gets) receiving a feature-sharded tensor, and a row-parallel module receiving a
strided one, are `PlanError`s naming both modules; an op that fails on tainted inputs (a
shape mismatch from a half-finished plan) becomes a `PlanError` naming the column modules
whose outputs reached it and the module it failed in. A tensor gathered by an input
conversion for column-parallel readers (its backward sums partial gradients over tp) read
by anything else, other than through views, is a `PlanError` too. Only the first forward
pays for this.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from ...errors import PlanError
from ...tensors import op_name, tensor_leaves

_SPLITS = {"split", "split_with_sizes", "chunk", "unbind", "tensor_split"}
_RESHAPES = {"view", "_unsafe_view", "reshape"}


@dataclass(frozen=True)
class FeatureLayout:
    """The last dim holds this rank's features of `source`'s output, as `blocks` slices."""

    source: str
    blocks: int


class FeatureFlow(TorchDispatchMode):
    """Follows sharded features through one forward (see the module docstring)."""

    def __init__(self, column: frozenset[str] = frozenset(), tp: int = 1) -> None:
        super().__init__()
        self.column = column
        self.tp = tp
        self.gathered: dict[int, str] = {}  # tensors an input conversion gathered for column readers -> where
        self.layout: dict[int, FeatureLayout] = {}
        self.taint: dict[int, frozenset[str]] = {}
        self._alive: list[torch.Tensor] = []  # keeps tagged tensors alive so ids stay unique
        self.modules: list[str] = []  # the module stack, innermost last
        self.seen: dict[str, set[str]] = {}  # module path -> column modules whose features it computed on

    def mark(self, tensor: torch.Tensor, layout: FeatureLayout | None) -> None:
        """`tensor` is a column output with `layout`, or (None) a reduced, replicated value."""
        for t in tensor_leaves(tensor):
            if layout is None:
                self.layout.pop(id(t), None)
                self.taint.pop(id(t), None)
            else:
                self._alive.append(t)
                self.layout[id(t)] = layout
                self.taint[id(t)] = frozenset([layout.source])

    def mark_gathered(self, tensor: torch.Tensor, where: str) -> None:
        """`tensor` was gathered by module `where`'s input conversion: its gradient is summed
        over tp, which is right only if column-parallel modules alone read it (or its views)."""
        self._alive.append(tensor)
        self.gathered[id(tensor)] = where

    def _check_gathered_readers(self, func, args, kwargs, out) -> None:
        where = next((self.gathered[id(t)] for t in tensor_leaves((args, kwargs)) if id(t) in self.gathered), None)
        if where is None:
            return
        if func.is_view:
            for t in tensor_leaves(out):
                self._alive.append(t)
                self.gathered[id(t)] = where
        elif not (self.modules and self.modules[-1] in self.column):
            reader = self.modules[-1] if self.modules else "the model's own code"
            raise PlanError(
                f"{where} gathers its input over tp ('Shard -> Replicate' in {where}.input) for column-parallel "
                f"modules, whose input gradients are partial and summed by one reduce-scatter; but {reader} reads it "
                f"too ({op_name(func)}), and its gradient would be summed tp times. Convert the input of the "
                f"column-parallel modules themselves, or gather with '{where}.output' of the module before (its "
                "backward then splits the gradient)"
            )

    def layout_of(self, tensor: torch.Tensor) -> FeatureLayout | None:
        return self.layout.get(id(tensor))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor decomposes into local ops, which come back here
        inputs = [t for t in tensor_leaves((args, kwargs)) if id(t) in self.taint]
        try:
            out = func(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - re-raised, named when the plan is the likely cause
            if inputs:
                sources = sorted(set().union(*(self.taint[id(t)] for t in inputs)))
                where = self.modules[-1] if self.modules else "the model's own code"
                heads = self._partial_heads(func, args)
                if heads:
                    raise PlanError(f"the first forward under the plan failed in {where}: {heads}") from exc
                raise PlanError(
                    f"the first forward under the plan failed in {where} ({op_name(func)}: {str(exc).splitlines()[0]}). "
                    f"Its inputs carry the feature-sharded outputs of column-parallel {sources}: the plan shards "
                    "them without a matching row-parallel module (Shard(1) on the weight of the module that "
                    "consumes their features), or gives a module the wrong placement"
                ) from exc
            raise
        if self.gathered:
            self._check_gathered_readers(func, args, kwargs, out)
        if inputs:
            taint = frozenset().union(*(self.taint[id(t)] for t in inputs))
            if self.modules:
                self.seen.setdefault(self.modules[-1], set()).update(taint)
            layouts = [self.layout[id(t)] for t in inputs if id(t) in self.layout]
            outputs = tensor_leaves(out)
            for t in outputs:
                self._alive.append(t)
                self.taint[id(t)] = taint
            if layouts:
                self._follow_layout(func, inputs, layouts[0], outputs)
        return out

    def _partial_heads(self, func, args) -> str | None:
        """Why a reshape of a column output into heads failed, where tp does not divide its heads:
        the plan is right, the degree is not (a model with 2 KV heads at tp 4)."""
        if op_name(func) not in _RESHAPES or len(args) < 2 or not isinstance(args[0], torch.Tensor):
            return None
        layout, shape = self.layout.get(id(args[0])), list(args[1])
        local = args[0].shape[-1] if args[0].dim() else 0
        if layout is None or not shape or shape[-1] <= 0 or local % shape[-1] == 0 or (local * self.tp) % shape[-1]:
            return None
        width, heads = shape[-1], local * self.tp // shape[-1]
        fits = [d for d in range(1, heads + 1) if heads % d == 0]
        return (f"{layout.source}'s output is {heads} heads of {width} features, which tp={self.tp} cannot split "
                f"evenly ({local} features a rank). tp must divide the number of heads (a Hugging Face config's "
                f"num_attention_heads and num_key_value_heads): tp in {fits} would, or shard fewer modules")

    def _follow_layout(self, func, inputs: list[torch.Tensor], layout: FeatureLayout,
                       outputs: list[torch.Tensor]) -> None:
        source = next(t for t in inputs if self.layout.get(id(t)) == layout)
        if op_name(func) in _SPLITS and len(outputs) > 1:
            dims = {t.dim() for t in outputs}
            split_last = dims == {source.dim()} and all(t.shape[:-1] == source.shape[:-1] for t in outputs)
            if split_last:
                pieces = len(outputs)
                blocks = layout.blocks // pieces if layout.blocks % pieces == 0 else layout.blocks
                for t in outputs:
                    self.layout[id(t)] = FeatureLayout(layout.source, blocks)
            return
        for t in outputs:
            if t.shape == source.shape:
                self.layout[id(t)] = layout


@contextlib.contextmanager
def checked_forward(module: nn.Module, column: dict[str, int], reducing: set[str], row: set[str],
                    declared_inputs: set[str], tp: int = 1) -> Iterator[FeatureFlow]:
    """Run one forward of `module` under a `FeatureFlow`.

    column: path -> k (1 for Shard, k for StridedShard) of column-parallel modules;
    reducing: paths whose outputs are replicated again (row-parallel, vocab-parallel);
    row: row-parallel paths; declared_inputs: modules whose input placement the plan gives;
    tp: the degree, to name the heads a reshape could not split.
    """
    flow = FeatureFlow(frozenset(column), tp)
    handles = []
    for path, mod in module.named_modules():
        def before(m, args, kwargs, path=path):
            flow.modules.append(path or type(m).__name__)
            _check_inputs(flow, path, m, (args, kwargs), column, row, declared_inputs)

        def after(m, args, output, path=path):
            flow.modules.pop()
            if path in column:
                flow.mark(output, FeatureLayout(path, column[path]))
            elif path in reducing:
                flow.mark(output, None)

        handles.append(mod.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(mod.register_forward_hook(after))
    try:
        with flow:
            yield flow
    except PlanError:
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised; named when the module computed on sharded features
        where = flow.modules[-1] if flow.modules else None
        sources = sorted(flow.seen.get(where, ()))
        if not sources:
            raise
        raise PlanError(
            f"the first forward under the plan failed in {where} ({type(exc).__name__}: {str(exc).splitlines()[0]}), "
            f"which computes on the feature-sharded outputs of column-parallel {sources}. If the model runs "
            "unsharded, the plan is the cause: every tensor combined with those outputs must be sharded the same "
            "way (e.g. q, k and v projections all column-parallel), and their features must end in a "
            "row-parallel module (Shard(1) on its weight)"
        ) from exc
    finally:
        for handle in handles:
            handle.remove()


def _check_inputs(flow: FeatureFlow, path: str, mod: nn.Module, inputs: Any, column: dict[str, int],
                  row: set[str], declared_inputs: set[str]) -> None:
    if path in declared_inputs or path in column:
        return
    holds = any(True for _ in mod.parameters(recurse=False))
    for tensor in tensor_leaves(inputs):
        layout = flow.layout_of(tensor)
        if layout is None:
            continue
        if path in row:
            if layout.blocks > 1:
                raise PlanError(
                    f"row-parallel {path} expects its input features as one contiguous shard per rank, but receives "
                    f"the output of {layout.source}, sharded as {layout.blocks} interleaved blocks (StridedShard): "
                    f"split that output into its {layout.blocks} parts before it reaches {path}, or shard "
                    f"{layout.source} with Shard(0)"
                )
        elif holds:
            raise PlanError(
                f"{path} ({type(mod).__name__}) is replicated but receives the feature-sharded output of "
                f"column-parallel {layout.source}: make {path} row-parallel (Shard(1) on its weight) or "
                f"leave {layout.source} replicated"
            )
