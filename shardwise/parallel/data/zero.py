"""ZeRO-1/2 and the optimizer's parameters: what the optimizer updates, and how updates reach the model.

Under ZeRO (config.zero >= 1) the parameters of each gradient bucket move into a flat
buffer laid out exactly like that bucket's gradient buffer, so this rank's shard of the
reduced gradients and its shard of the parameters cover the same index range. The
optimizer is built over *pieces* (`ParamPiece`): the part of each parameter inside that range, as a 1-d
tensor. Its state therefore exists only for this rank's shard; element-wise optimizers
(SGD, Adam, AdamW, Adagrad, ...) compute exactly what they compute on whole tensors.
After a step the updated shards are all-gathered in place (same bytes as the all-reduce
they replace: ZeRO-1 communicates what plain data parallelism does). Stage 2 also keeps
only the gradient shard, from a step's first reduction to zero_grad(set_to_none=True) (see
`Bucket`); stage 3 adds `zero3.py`.

With `config.param_dtype` (mixed precision) the pieces are float32 master copies and each
step writes them back, cast, into the model; without it they are views into the model's
own storage and cost no memory. Under ZeRO-3 the float32 shard is the master and the only
copy kept: gathers cast it (zero3.py), so no low-precision shard sits beside it.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ...comm import wait
from ...compat import all_gather_single
from ...topology import Topology
from .buckets import Bucket
from .gradients import GradientBuckets
from ...tensors import is_sharded, local


@dataclass
class ParamPiece:
    """One optimizer tensor: a parameter's part of this rank's shard (or all of it)."""

    param: nn.Parameter
    optimized: torch.Tensor  # what the optimizer updates (a leaf tensor; a float32 master copy under mixed precision)
    grad: Callable[[], torch.Tensor | None]  # its gradient once synchronized
    write_back: Callable[[], None] | None  # copies `optimized` into the model (None: it is the model's own tensor)
    owned: bool  # this rank is the one that owns these elements (norms, checkpoints count them once)
    model_values: Callable[[], torch.Tensor]  # the model's own values for this range, flat
    start: int  # the range [start, end) of the parameter's local (tp) tensor, flattened, this piece covers
    end: int
    master_shard: bool = False  # `optimized` is a float32 master that is also the model's only copy (ZeRO-3)


class OptimizerParams:
    """The optimizer-facing parameters for ZeRO and/or mixed precision."""

    def __init__(self, module: nn.Module, gradients: GradientBuckets, topology: Topology,
                 fp32_values: dict[int, torch.Tensor], first_holder: dict[int, bool], experts: set[int] = frozenset()):
        self.gradients = gradients
        self.topology = topology
        self.zero = zero = gradients.zero
        self.pieces: dict[int, list[ParamPiece]] = {}
        self._loaded = False
        # made with the topology: optimizer.step and clip_grad_norm may run without an
        # agreement first (ParallelModule.collective), so they must not create a group
        self.world = topology.group("pp", "dp", "cp", "tp") if topology.world_size > 1 else None
        if zero.params_flat:  # the model's parameters move into flat buffers (ZeRO-3 has made them already)
            for bucket in gradients.buckets:
                bucket.flatten_params()
        if zero.params_sharded and fp32_values:
            for bucket in gradients.buckets:
                bucket.hold_master_shard(_master_shard(bucket, fp32_values))
        slot = {id(p): (b, i) for b in gradients.buckets for i, p in enumerate(b.params)}
        for param in module.parameters():
            if not param.requires_grad:
                continue
            # a copy another tp rank also holds: replicated parameters, and experts (whole on every tp rank)
            replicated_copy = (not is_sharded(param) or id(param) in experts) and topology.tp_rank != 0
            if zero.grads_sharded and id(param) in slot:
                bucket, i = slot[id(param)]
                includes_tp_peers = bucket.reduce.includes_tp_peers
                self.pieces[id(param)] = list(self._shard_pieces(param, bucket, i, fp32_values.get(id(param)),
                                                                 counted=includes_tp_peers or not replicated_copy))
            else:
                first_replica = topology.dp_rank < topology.config.ep if id(param) in experts else topology.dp_rank == 0
                counted = not replicated_copy and first_holder.get(id(param), True) and first_replica \
                    and topology.cp_rank == 0
                self.pieces[id(param)] = [self._whole_piece(param, slot.get(id(param)), fp32_values.get(id(param)),
                                                            counted)]
        # the per-step loops visit only pieces with work to do: a piece that is the parameter itself
        # (plain fp32 without ZeRO) takes its gradient and its update in place, so a step at world 1
        # costs no Python per parameter beyond torch's optimizer
        every = [piece for pieces in self.pieces.values() for piece in pieces]
        self._separate = [piece for piece in every if piece.optimized is not piece.param]
        self._written = [piece for piece in every if piece.write_back is not None]
        self._part = self._describe_part(module, experts)

    def _describe_part(self, module: nn.Module, experts: set[int]) -> str:
        """Which part of the optimizer state this rank holds (`part()`)."""
        topology, sizes = self.topology, self.topology.sizes
        held = [d for d in ("pp", "tp") if sizes[d] > 1 and (d == "pp" or any(is_sharded(p) for p in module.parameters()))]
        if self.zero.grads_sharded:
            held += [d for d in ("dp", "cp") if sizes[d] > 1]
        where = [f"{d} rank {topology.coordinates[d]} of {sizes[d]}" for d in held]
        if experts and topology.config.ep > 1:
            where.append(f"ep rank {topology.ep_rank} of {topology.config.ep}")
        if not where:
            return "whole parameters"
        names = {id(p): n for n, p in module.named_parameters()}
        pieces = "".join(f"{names[i]}[{q.start}:{q.end}]" for i, ps in self.pieces.items() for q in ps)
        return f"{', '.join(where)} (pieces {zlib.crc32(pieces.encode()):08x})"

    def part(self) -> str:
        """Which part of the optimizer state this rank holds, as text ranks compare: "whole
        parameters" where every rank holds every parameter whole (its state is any rank's), else
        its coordinates in the dimensions that split the state and a checksum of its pieces."""
        return self._part

    @property
    def in_place(self) -> bool:
        """Every optimizer tensor is the parameter itself (plain float32 without ZeRO)."""
        return not self._separate

    # building --------------------------------------------------------------------------
    def _whole_piece(self, param, where, fp32: torch.Tensor | None, counted: bool) -> ParamPiece:
        target = local(param)
        whole = dict(model_values=lambda: local(param).reshape(-1), start=0, end=target.numel())
        if fp32 is None:  # the model's own parameter: nothing to copy
            return ParamPiece(param, param, lambda: param.grad, None, counted, **whole)
        master = fp32.detach().clone()
        if where is not None and where[0].casts_grads:  # reduced into a float32 bucket view
            bucket, i = where
            grad = lambda: bucket.views[i] if self._has_grad(param) and bucket.buffer is not None else None
        else:
            grad = lambda: None if param.grad is None else local(param.grad).float()
        return ParamPiece(param, master, grad, lambda: target.data.copy_(master), counted, **whole)

    def _shard_pieces(self, param, bucket: Bucket, i: int, fp32: torch.Tensor | None, counted: bool):
        start, end = bucket.shard_start, bucket.shard_start + bucket.shard_size
        first, last = bucket.offsets[i], bucket.offsets[i] + bucket.sizes[i]
        lo, hi = max(first, start), min(last, end)
        if lo >= hi:
            return
        def grad(lo=lo, hi=hi):
            return bucket.grad_shard[lo - start: hi - start] if self._has_grad(param) else None

        def master_grad(grad=grad, dtype=torch.float32):  # a float32 master takes its gradient in float32
            shard = grad()
            return shard if shard is None or shard.dtype == dtype else shard.to(dtype)

        part = dict(model_values=lambda: bucket.param_range(lo, hi), start=lo - first, end=hi - first)
        if fp32 is None:  # the optimizer updates the model's own shard in place
            yield ParamPiece(param, bucket.param_range(lo, hi), grad, None, counted, **part)
        elif self.zero.params_sharded:  # ZeRO-3: the shard is the float32 master (cast as it is gathered)
            yield ParamPiece(param, bucket.param_range(lo, hi), master_grad, None, counted, **part, master_shard=True)
        else:
            master = fp32.detach().reshape(-1)[lo - first: hi - first].clone()
            yield ParamPiece(param, master, master_grad, lambda: part["model_values"]().copy_(master), counted, **part)

    def _has_grad(self, param: nn.Parameter) -> bool:
        """Whether one process would hold a gradient for `param` now: a synchronization ran
        since the gradients were last set to None, and some replica used the parameter."""
        return self.gradients.has_grads and id(param) not in self.gradients.unused

    def param_groups(self, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The user's parameter groups with each parameter replaced by its pieces."""
        return [{**group, "params": [piece.optimized for p in group["params"] for piece in self.pieces.get(id(p), [])]}
                for group in groups]

    # stepping ----------------------------------------------------------------------------
    def load_grads(self) -> None:
        if self._loaded:
            return
        for piece in self._separate:
            piece.optimized.grad = piece.grad()
        self._loaded = True

    @torch.no_grad()
    def write_back(self, before_collectives: Callable[[], None] = lambda: None) -> None:
        """After a step: the model gets the updated values (all-gathered under ZeRO-1/2)."""
        for piece in self._written:
            piece.write_back()
        if self.zero.params_flat:  # ZeRO-1/2: every buffer; ZeRO-3: those kept whole (outside any unit)
            before_collectives()
            works = []
            for bucket in self.gradients.buckets:
                if self.zero.params_sharded and bucket.param_buffer.untyped_storage().nbytes() == 0:
                    continue  # released: the next use gathers the updated shard
                self.gradients.stats.record("all_gather", bucket.param_buffer)
                source = bucket.gather_source
                works.append((all_gather_single(bucket.param_buffer, source, group=bucket.reduce.group, async_op=True),
                              bucket, source))
            for work, bucket, _ in works:
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
                    piece.optimized.copy_(piece.model_values().reshape(piece.optimized.shape))

    def zero_grad(self) -> None:
        """Drop the masters' gradients (views of the reduced buckets); a master that is the
        parameter itself follows the module's zero_grad."""
        for piece in self._separate:
            piece.optimized.grad = None
        self._loaded = False

    def grads(self) -> list[torch.Tensor]:
        """The gradients the optimizer will read (local shards), after synchronization."""
        self.load_grads()
        return [local(p.optimized.grad) for ps in self.pieces.values() for p in ps if p.optimized.grad is not None]

    def gradient_norm(self, norm_type: float, before_collectives: Callable[[], None] = lambda: None) -> torch.Tensor:
        """The global norm: every element of the model's gradient counted once, on one rank."""
        self.load_grads()
        grads = [local(p.optimized.grad) for ps in self.pieces.values() for p in ps
                 if p.owned and p.optimized.grad is not None]
        inf = norm_type == float("inf")
        device = self.topology.device
        if inf:
            total = torch.stack([g.abs().max().float() for g in grads]).max() if grads else torch.zeros((), device=device)
        else:
            total = sum((g.float().norm(norm_type) ** norm_type for g in grads), torch.zeros((), device=device))
        total = total.reshape(1)
        if self.topology.world_size > 1:
            before_collectives()
            work = dist.all_reduce(total, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=self.world,
                                   async_op=True)
            self.topology.wait(work, "all-reduce of the gradient norm", self.world)
        return total[0] if inf else total[0] ** (1.0 / norm_type)

    def nonfinite(self, before_collectives: Callable[[], None] = lambda: None) -> bool:
        """Whether any rank's gradients hold inf or NaN (one all-reduce over the world)."""
        grads = self.grads()
        found = torch.zeros(1, device=self.topology.device)
        if grads:  # on the device, one host sync at the end
            found = torch.stack([~torch.isfinite(g).all() for g in grads]).any().float().reshape(1)
        if self.topology.world_size > 1:
            before_collectives()
            work = dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.world, async_op=True)
            self.topology.wait(work, "all-reduce of the inf/NaN check", self.world)
        return bool(found.item())

    def state_bytes(self) -> int:
        """Bytes of master copies (those that are not the model itself)."""
        return sum(p.optimized.numel() * p.optimized.element_size() for ps in self.pieces.values() for p in ps
                   if p.write_back is not None)


def _master_shard(bucket: Bucket, fp32_values: dict[int, torch.Tensor]) -> torch.Tensor:
    """This rank's part of a ZeRO-3 bucket in float32, from the parameters' values before
    they were cast (the padding, and a parameter without a float32 value, as the shard holds them)."""
    start, end = bucket.shard_start, bucket.shard_start + bucket.shard_size
    master = bucket.param_shard.float()
    for param, first, size in zip(bucket.params, bucket.offsets, bucket.sizes):
        lo, hi = max(first, start), min(first + size, end)
        if lo < hi and id(param) in fp32_values:
            master[lo - start: hi - start] = fp32_values[id(param)].reshape(-1)[lo - first: hi - first]
    return master
