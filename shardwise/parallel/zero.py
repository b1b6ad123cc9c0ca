"""ZeRO-1/2 and master weights: what the optimizer updates, and how updates reach the model.

Under ZeRO (config.zero >= 1) the parameters of each gradient bucket move into a flat
buffer laid out exactly like that bucket's gradient buffer, so this rank's shard of the
reduced gradients and its shard of the parameters cover the same index range. The
optimizer is built over *pieces*: the part of each parameter inside that range, as a 1-d
tensor. Its state therefore exists only for this rank's shard; element-wise optimizers
(SGD, Adam, AdamW, Adagrad, ...) compute exactly what they compute on whole tensors.
After a step the updated shards are all-gathered in place (same bytes as the all-reduce
they replace: ZeRO-1 communicates what plain data parallelism does). Stage 2 also keeps
only the gradient shard between steps (see `Bucket`); stage 3 adds `fsdp.py`.

With `config.param_dtype` (mixed precision) the pieces are float32 master copies and each
step writes them back, cast, into the model; without it they are views into the model's
own storage and cost no memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ..comm import all_gather_single, wait
from ..topology import Topology
from .data import Bucket, GradientBuckets
from ..tensors import is_sharded, local


@dataclass
class Piece:
    """One optimizer tensor: a parameter's part of this rank's shard (or all of it)."""

    param: nn.Parameter
    master: torch.Tensor  # what the optimizer updates (a leaf tensor)
    grad: Callable[[], torch.Tensor | None]  # its gradient once synchronized
    write_back: Callable[[], None] | None  # copies the master into the model (None: master is the model)
    counted: bool  # this rank is the one that owns these elements (norms, checkpoints count them once)
    model: Callable[[], torch.Tensor]  # the model's own values for this range, flat
    lo: int  # the range [lo, hi) of the parameter's local (tp) tensor, flattened, this piece covers
    hi: int


class MasterWeights:
    """The optimizer-facing parameters for ZeRO and/or mixed precision."""

    def __init__(self, module: nn.Module, gradients: GradientBuckets, topology: Topology, zero: int,
                 fp32_values: dict[int, torch.Tensor], tied_first: dict[int, bool]):
        self.gradients = gradients
        self.topology = topology
        self.zero = zero
        self.pieces: dict[int, list[Piece]] = {}
        self._loaded = False
        if zero:  # the model's parameters move into flat buffers (ZeRO-3 has made them already)
            for bucket in gradients.buckets:
                if getattr(bucket, "param_buffer", None) is None:
                    bucket.param_buffer = _flatten_params(bucket)
        slot = {id(p): (b, i) for b in gradients.buckets for i, p in enumerate(b.params)}
        for param in module.parameters():
            if not param.requires_grad:
                continue
            replicated_copy = not is_sharded(param) and topology.tp_rank != 0
            if zero and id(param) in slot:
                bucket, i = slot[id(param)]
                spans_tp = bucket.reduce.spans_tp
                self.pieces[id(param)] = list(self._shard_pieces(param, bucket, i, fp32_values.get(id(param)),
                                                                 counted=spans_tp or not replicated_copy))
            else:
                counted = not replicated_copy and tied_first.get(id(param), True) and topology.dp_rank == 0 \
                    and topology.cp_rank == 0
                self.pieces[id(param)] = [self._whole_piece(param, slot.get(id(param)), fp32_values.get(id(param)),
                                                            counted)]

    # building --------------------------------------------------------------------------
    def _whole_piece(self, param, where, fp32: torch.Tensor | None, counted: bool) -> Piece:
        target = local(param)
        whole = dict(model=lambda: local(param).reshape(-1), lo=0, hi=target.numel())
        if fp32 is None:  # the model's own parameter: nothing to copy
            return Piece(param, param, lambda: param.grad, None, counted, **whole)
        master = fp32.detach().clone()
        if where is not None and where[0].main_grad:  # reduced into a float32 bucket view
            bucket, i = where
            grad = lambda: bucket.views[i] if self._has_grad(param) and bucket.buffer is not None else None
        else:
            grad = lambda: None if param.grad is None else local(param.grad).float()
        return Piece(param, master, grad, lambda: target.data.copy_(master), counted, **whole)

    def _shard_pieces(self, param, bucket: Bucket, i: int, fp32: torch.Tensor | None, counted: bool):
        start, end = bucket.shard_start, bucket.shard_start + bucket.shard_size
        first, last = bucket.offsets[i], bucket.offsets[i] + bucket.sizes[i]
        lo, hi = max(first, start), min(last, end)
        if lo >= hi:
            return
        def grad(lo=lo, hi=hi):
            return bucket.grad_shard[lo - start: hi - start] if self._has_grad(param) else None

        part = dict(model=lambda: _model_range(bucket, lo, hi), lo=lo - first, hi=hi - first)
        if fp32 is None:  # the optimizer updates the model's own shard in place
            yield Piece(param, _model_range(bucket, lo, hi), grad, None, counted, **part)
        else:
            master = fp32.detach().reshape(-1)[lo - first: hi - first].clone()
            yield Piece(param, master, grad, lambda: part["model"]().copy_(master), counted, **part)

    def _has_grad(self, param: nn.Parameter) -> bool:
        """Whether one process would hold a gradient for `param` now: a synchronization ran
        since the gradients were last set to None, and some replica used the parameter."""
        return self.gradients.has_grads and id(param) not in self.gradients.unused

    def param_groups(self, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The user's parameter groups with each parameter replaced by its pieces."""
        return [{**group, "params": [piece.master for p in group["params"] for piece in self.pieces.get(id(p), [])]}
                for group in groups]

    # stepping ----------------------------------------------------------------------------
    def load_grads(self) -> None:
        if self._loaded:
            return
        for pieces in self.pieces.values():
            for piece in pieces:
                piece.master.grad = piece.grad()
        self._loaded = True

    @torch.no_grad()
    def write_back(self, before_collectives: Callable[[], None] = lambda: None) -> None:
        """After a step: the model gets the updated values (all-gathered under ZeRO-1/2)."""
        for pieces in self.pieces.values():
            for piece in pieces:
                if piece.write_back is not None:
                    piece.write_back()
        if self.zero:  # ZeRO-1/2: every buffer; ZeRO-3: those kept whole (outside any unit)
            before_collectives()
            works = []
            for bucket in self.gradients.buckets:
                if self.zero == 3 and bucket.param_buffer.untyped_storage().nbytes() == 0:
                    continue  # released: the next use gathers the updated shard
                shard = bucket.param_shard if self.zero == 3 else \
                    bucket.param_buffer[bucket.shard_start: bucket.shard_start + bucket.shard_size]
                self.gradients.stats.record("all_gather", bucket.param_buffer)
                works.append((all_gather_single(bucket.param_buffer, shard, group=bucket.reduce.group, async_op=True),
                              bucket))
            for work, bucket in works:
                wait(work, f"all-gather of parameter bucket {bucket.index}", bucket.reduce.group,
                     self.topology.coordinator)
        self._loaded = False

    @torch.no_grad()
    def reload(self) -> None:
        """After the model's values were overwritten (a loaded state dict): masters that are
        copies take the new values (views need nothing)."""
        for pieces in self.pieces.values():
            for piece in pieces:
                if piece.write_back is not None:
                    piece.master.copy_(piece.model().reshape(piece.master.shape))

    def zero_grad(self) -> None:
        """Drop the masters' gradients (views of the reduced buckets); a master that is the
        parameter itself follows the module's zero_grad."""
        for pieces in self.pieces.values():
            for piece in pieces:
                if piece.master is not piece.param:
                    piece.master.grad = None
        self._loaded = False

    def grads(self) -> list[torch.Tensor]:
        """The gradients the optimizer will read (local shards), after synchronization."""
        self.load_grads()
        return [local(p.master.grad) for ps in self.pieces.values() for p in ps if p.master.grad is not None]

    def gradient_norm(self, norm_type: float, before_collectives: Callable[[], None] = lambda: None) -> torch.Tensor:
        """The global norm: every element of the model's gradient counted once, on one rank."""
        self.load_grads()
        grads = [local(p.master.grad) for ps in self.pieces.values() for p in ps
                 if p.counted and p.master.grad is not None]
        inf = norm_type == float("inf")
        device = self.topology.device
        if inf:
            total = torch.stack([g.abs().max().float() for g in grads]).max() if grads else torch.zeros((), device=device)
        else:
            total = sum((g.float().norm(norm_type) ** norm_type for g in grads), torch.zeros((), device=device))
        total = total.reshape(1)
        if self.topology.world_size > 1:
            before_collectives()
            world = self.topology.group("pp", "dp", "cp", "tp")
            work = dist.all_reduce(total, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=world, async_op=True)
            self.topology.wait(work, "all-reduce of the gradient norm", world)
        return total[0] if inf else total[0] ** (1.0 / norm_type)

    def state_bytes(self) -> int:
        """Bytes of master copies (those that are not the model itself)."""
        return sum(p.master.numel() * p.master.element_size() for ps in self.pieces.values() for p in ps
                   if p.write_back is not None)


def _model_range(bucket: Bucket, lo: int, hi: int) -> torch.Tensor:
    """The model's values for buffer positions [lo, hi) (this rank's shard)."""
    shard = getattr(bucket, "param_shard", None)
    if shard is not None:  # ZeRO-3: only the shard persists
        return shard[lo - bucket.shard_start: hi - bucket.shard_start]
    return bucket.param_buffer[lo:hi]


@torch.no_grad()
def _flatten_params(bucket: Bucket) -> torch.Tensor:
    """Move a bucket's parameters into one flat buffer with the gradient buffer's layout."""
    dtype = local(bucket.params[0]).dtype
    buffer = torch.zeros(bucket.padded, dtype=dtype, device=bucket.device)
    for param, offset, size, shape in zip(bucket.params, bucket.offsets, bucket.sizes, bucket.shapes):
        view = buffer[offset: offset + size].view(shape)
        view.copy_(local(param))
        local(param).data = view
    return buffer
