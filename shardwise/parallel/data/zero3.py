"""ZeRO-3: parameters sharded too, gathered whole per unit just before use and freed after.

Buckets are aligned with units (the modules around the main layer list, as for pipeline
stages), so a unit's parameters live in its own flat buffers. Between uses a buffer keeps
only this rank's shard; its full storage is released (resized to zero, so views and tensors
autograd saved stay valid) and re-filled by an all-gather:
- forward: before a unit runs (the next unit in forward order is prefetched, except in a
  forward recomputed for backward, whose next unit is done), released
  after it unless the next unit needs it too, or its backward comes next (the last unit,
  and a forward recomputed in backward);
- backward: when the gradient of a unit's output arrives (the unit before it is
  prefetched), released when the gradient of its input arrives (its backward is done)
  unless the unit before it needs it too, or at the end of the synchronization for a unit
  whose input needs none (an embedding).
Under mixed precision the kept shard is the float32 master itself (zero.py): each gather
sends a copy cast to the parameters' dtype, as FSDP2's all-gather copy-in does, so no
low-precision shard is kept beside it (16 bytes of state an element with float32 gradients and
Adam, not 18).
While a bucket is released its parameters refuse to be read (released.py): a ModelError, not
the crash torch's unchecked read of a storage-less tensor is.
The units around the main layer list share one gather when they are small (build.py's
`zero3_units`): on a GPT that is 11 parameter all-gathers a step instead of 17, and on an
oversubscribed CPU each costs milliseconds of scheduling latency whatever its size.

A bucket shared by pipeline stages (a tied input embedding and output head) stays whole:
each stage would gather it at a different point of the schedule. Its gradients are still
reduce-scattered and its shard updated at the synchronization every rank reaches together.

Why not FSDP2's `fully_shard`: shardwise's tensor-parallel modules compute on the local
shards of DTensor parameters and its pipeline stages run a captured program of the
model's forward; its gradient buckets must also sum sequence-parallel partial gradients over tp and
tied embeddings over pipeline ranks in the same pass. Sharding the buckets those executors
already use keeps one gradient path for every ZeRO stage.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from ...comm import trace_range, wait
from ...compat import all_gather_single
from ...tensors import tensor_leaves
from .buckets import Bucket
from .float8_gather import Float8Gather, use_gathered_weight
from .gradients import GradientBuckets
from .released import ReleasedParameters


BEFORE_BACKWARD = "_shardwise_before_backward"  # the hook a unit's output carries: (handle, unit)


class ParameterShards:
    """Gathers and frees the parameter buffers of ZeRO-3 around each unit's use."""

    def __init__(self, module: nn.Module, gradients: GradientBuckets, units: Iterable[str],
                 float8: dict[int, nn.Module] | None = None):
        self.gradients = gradients
        self.stats = gradients.stats
        self.released = ReleasedParameters()
        self._works: dict[int, Any] = {}
        self._sources: dict[int, torch.Tensor] = {}  # what each all-gather under way sends
        self._gathered: set[int] = set()
        # buckets of Float8Linear weights gathered as float8 bytes for their units' use
        # (float8_gather.py); `whole()` still gathers them in high precision
        float8 = float8 or {}
        self._float8 = {id(b): Float8Gather(b, [float8[id(p)] for p in b.params]) for b in gradients.buckets
                        if b.params[0] is not None and id(b.params[0]) in float8}
        self._works8: dict[int, Any] = {}
        self._gathered8: set[int] = set()
        classes: dict[type, type] = {}
        for gather in self._float8.values():
            for m in gather.modules:
                use_gathered_weight(m, classes)
        self._order: list[str] = []  # forward order of units, learned on the first forward
        self._order_known = False  # a unit ran a second time: the whole order was seen
        self._needed: dict[str, list[Bucket]] = {}
        slot = {id(p): b for b in gradients.buckets for p in b.params}
        for bucket in gradients.buckets:
            bucket.flatten_params()
            bucket.keep_param_shard()
        units_of_bucket: dict[int, int] = {}
        for path in units:
            buckets = list({id(slot[id(p)]): slot[id(p)] for p in module.get_submodule(path).parameters()
                            if id(p) in slot}.values())
            if buckets:
                self._needed[path] = buckets
                for b in buckets:
                    units_of_bucket[id(b)] = units_of_bucket.get(id(b), 0) + 1
                unit = module.get_submodule(path)
                # outside any compiled graph (as FSDP2's hooks): a compiled unit's body stays one graph
                unit.register_forward_pre_hook(torch.compiler.disable(
                    lambda m, args, kwargs, path=path: self._before_forward(path, (args, kwargs))), with_kwargs=True)
                unit.register_forward_hook(torch.compiler.disable(
                    lambda m, args, out, path=path: self._after_forward(path, out)))
        # Whole, always: buckets outside any unit, and those shared by pipeline stages (a tied
        # embedding): their stages use them at different times, so gathers would not line up.
        self._kept = [b for b in gradients.buckets if id(b) not in units_of_bucket or not b.reduce.same_params_on_members]
        # parameter bytes whole now (high precision; float8 gathers apart), and the most at once
        # since `most_whole_bytes` was last set: the planner charges two units' worth (and the kept)
        self.whole_bytes = sum(b.param_buffer.untyped_storage().nbytes() for b in gradients.buckets)
        self.most_whole_bytes = 0
        self._held_whole = 0  # open `whole()` blocks: nothing is released inside one
        self.release_all()

    # gather and release -------------------------------------------------------------------
    def _gather(self, bucket: Bucket, wait_now: bool, whole: bool = False) -> None:
        if bucket in self._kept:
            return
        if not whole and id(bucket) in self._float8:
            self._gather_float8(bucket, wait_now)
            return
        if id(bucket) not in self._gathered and id(bucket) not in self._works:
            buffer = bucket.param_buffer
            buffer.untyped_storage().resize_(buffer.numel() * buffer.element_size())
            self.whole_bytes += buffer.numel() * buffer.element_size()
            self.most_whole_bytes = max(self.most_whole_bytes, self.whole_bytes)
            self.stats.record("all_gather", buffer)
            source = bucket.gather_source  # kept until the wait: a cast copy is referenced nowhere else
            with trace_range(f"launch all-gather of parameter bucket {bucket.index}"):
                self._works[id(bucket)] = all_gather_single(buffer, source, group=bucket.reduce.group, async_op=True)
            self._sources[id(bucket)] = source
        if wait_now and id(bucket) in self._works:
            wait(self._works.pop(id(bucket)), f"all-gather of parameter bucket {bucket.index}", bucket.reduce.group,
                 self.gradients.coordinator)
            del self._sources[id(bucket)]
            self._gathered.add(id(bucket))
            self.released.allow(bucket.params)

    def _gather_float8(self, bucket: Bucket, wait_now: bool) -> None:
        key = id(bucket)
        if key in self._gathered8 and self._float8[key].stale():  # an optimizer step since (no sync between)
            self._gathered8.discard(key)
            self._float8[key].release()
        if key not in self._gathered8 and key not in self._works8:
            gather = self._float8[key]
            self.stats.record("all_gather", gather.full)
            with trace_range(f"launch float8 all-gather of parameter bucket {bucket.index}"):
                self._works8[key] = gather.launch(
                    lambda work, what, group: wait(work, what, group, self.gradients.coordinator))
        if wait_now and key in self._works8:
            wait(self._works8.pop(key), f"float8 all-gather of parameter bucket {bucket.index}", bucket.reduce.group,
                 self.gradients.coordinator)
            self._gathered8.add(key)
            self._float8[key].lend()
            self.released.allow(bucket.params)  # passed to the float8 matmul unread (as its gradient's target)

    def _release(self, bucket: Bucket) -> None:
        if bucket in self._kept or self._held_whole:
            return
        if id(bucket) in self._works or id(bucket) in self._works8:  # an unused prefetch: finish it first
            self._gather(bucket, wait_now=True, whole=id(bucket) in self._works)
        whole = bucket.param_buffer.untyped_storage().nbytes()
        self.whole_bytes -= whole
        bucket.param_buffer.untyped_storage().resize_(0)
        if whole or id(bucket) in self._float8:  # not refusing already (a float8 unit's lent its own)
            self.released.refuse(bucket.params)
        self._gathered.discard(id(bucket))
        if id(bucket) in self._float8:
            self._float8[id(bucket)].release()
            self._gathered8.discard(id(bucket))

    def _neighbour(self, path: str, step: int) -> str | None:
        if path not in self._order:
            return None
        i = self._order.index(path) + step
        return self._order[i] if 0 <= i < len(self._order) else None

    def _release_unless_next(self, path: str, step: int) -> None:
        """Release `path`'s buckets, except those the unit `step` away in forward order uses."""
        following = self._neighbour(path, step)
        kept = self._needed.get(following, []) if following else []
        for bucket in self._needed[path]:
            if bucket not in kept:
                self._release(bucket)

    # hooks --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def whole(self) -> Iterator[None]:
        """Every parameter whole inside the block (collective); writes to them are kept.
        A float32 master shard takes its part again only if something wrote to it. Forwards
        run inside (transformers' `generate`) release nothing: they once freed the buffers
        the block's end reads."""
        for bucket in self.gradients.buckets:
            self._gather(bucket, wait_now=True, whole=True)
        gathered = {id(b): b.buffer_part.clone()
                    for b in self.gradients.buckets if b.param_shard.dtype != b.param_buffer.dtype}
        self._held_whole += 1
        try:
            yield
        finally:
            self._held_whole -= 1
            for bucket in self.gradients.buckets:
                bucket.keep_param_shard(gathered.get(id(bucket)))
            self.release_all()

    def release_all(self) -> None:
        """Free every unit's full buffers (after a synchronization: nothing needs them)."""
        for bucket in self.gradients.buckets:
            self._release(bucket)

    def _before_forward(self, path: str, inputs: Any) -> None:
        if path not in self._order:
            self._order.append(path)
        else:
            self._order_known = True
        if torch.is_grad_enabled() and not _in_backward():  # its backward is done when its input's gradient arrives
            for tensor in tensor_leaves(inputs):
                if tensor.requires_grad:
                    tensor.register_hook(lambda grad, path=path: self._after_backward(path))
                    # the unit before's output too (a residual stream): hooks run in the order they
                    # were registered, so move its gather-and-prefetch behind this release, else
                    # three units are whole at once (this one, that one and the one it prefetches)
                    unit_output = getattr(tensor, BEFORE_BACKWARD, None)
                    if unit_output is not None:
                        handle, before = unit_output
                        handle.remove()
                        self._hook_before_backward(tensor, before)
        for bucket in self._needed[path]:
            self._gather(bucket, wait_now=True)
        if _in_backward():  # a forward recomputed for its backward: the unit after it is done with
            return
        following = self._neighbour(path, +1)
        for bucket in self._needed.get(following, []) if following else []:
            self._gather(bucket, wait_now=False)  # prefetch

    def _after_forward(self, path: str, output: Any) -> None:
        if _in_backward():  # recomputed for backward (activation recompute): still needed there
            return
        last = self._order_known and path == self._order[-1]
        if not (last and torch.is_grad_enabled()):  # the last unit's backward comes next
            self._release_unless_next(path, +1)
        if torch.is_grad_enabled():
            tensors = [t for t in tensor_leaves(output) if t.requires_grad]
            if tensors:
                self._hook_before_backward(tensors[0], path)

    def _hook_before_backward(self, tensor: torch.Tensor, path: str) -> None:
        """Gather `path` (and prefetch the unit before it) when the gradient of its output
        `tensor` arrives; the handle stays on the tensor for a later unit to move."""
        handle = tensor.register_hook(lambda grad, path=path: self._before_backward(path))
        setattr(tensor, BEFORE_BACKWARD, (handle, path))

    def _before_backward(self, path: str) -> None:
        for bucket in self._needed[path]:
            self._gather(bucket, wait_now=True)
        previous = self._neighbour(path, -1)
        for bucket in self._needed.get(previous, []) if previous else []:
            self._gather(bucket, wait_now=False)  # prefetch

    def _after_backward(self, path: str) -> None:
        self._release_unless_next(path, -1)


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (a recompute's forward)."""
    return torch._C._current_graph_task_id() != -1

