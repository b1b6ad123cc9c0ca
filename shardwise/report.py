"""What a `ParallelModule` holds and does, as numbers and text: the tensors and bytes this
rank holds (`memory`) and the layout, executors and traffic per step (`summary`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .activations import activation_memory
from .parallel.data.gradients import MiB
from .tensors import local

if TYPE_CHECKING:
    from .module import ParallelModule


def memory(pmodel: "ParallelModule") -> dict[str, int]:
    """Bytes this rank holds now: parameters, gradients, and the optimizer state (of the
    optimizers built with `sw.build_optimizer`, master weights included)."""
    def storage_bytes(tensors) -> int:
        seen = {}
        for t in tensors:
            if t is not None and t.numel():
                storage = local(t).untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())

    params, grads = pmodel.held_tensors()
    state = [v for opt in pmodel.optimizers for s in opt.state.values() for v in s.values()
             if isinstance(v, torch.Tensor)]
    return {"parameters": storage_bytes(params), "gradients": storage_bytes(grads),
            "optimizer": storage_bytes(state) + pmodel.optimizer_params.state_bytes()}


def summary(pmodel: "ParallelModule", batch: Any = None) -> str:
    """Layout, per-rank parameter bytes and communication per step, as text; given a
    `batch`, also the activation bytes one microbatch saves for backward (collective then:
    every rank calls it, as sw.activation_memory)."""
    activations = activation_memory(pmodel, batch) if batch is not None else None
    params = list(pmodel.module.parameters())
    shards = [local(p) for p in params]
    numel = sum(t.numel() for t in shards)
    nbytes = sum(t.numel() * t.element_size() for t in shards)
    full = sum(p.numel() * p.element_size() for p in params)
    dtypes = ", ".join(sorted({str(p.dtype).replace("torch.", "") for p in params}))
    grads = pmodel.gradients
    lines = [
        f"shardwise.ParallelModule({type(pmodel.module).__name__})",
        f"  layout      {pmodel.topology.describe()}",
        f"  config      {pmodel.config.describe()}",
        f"  plan        {pmodel.plan.name or ('custom' if pmodel.plan.params else 'replicate everything')}",
        f"  parameters  {len(params)} tensors, {numel / 1e6:.3f} M elements, {nbytes / MiB:.2f} MiB on this rank "
        f"of {full / MiB:.2f} MiB ({dtypes})",
    ]
    tp = pmodel.tensor_parallel
    if tp is not None:
        kinds: dict[str, int] = {}
        for rule in tp.sharded_modules.values():
            kinds[rule] = kinds.get(rule, 0) + 1
        lines.append(
            f"  tensor par. {len(tp.sharded_modules)} modules over tp ranks {pmodel.topology.group_ranks('tp')}: "
            + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
            + (f"; {len(tp.partial_grad_params)} replicated params with partial grads (summed over tp)"
               if tp.partial_grad_params else "")
            + ("; loss-parallel head" if tp.loss_parallel else "")
        )
    cp = pmodel.context_parallel
    if cp is not None:
        traffic = (f"{cp.gathers} K/V all-gathers, {cp.gathered_bytes / MiB:.2f} MiB received per rank in the last "
                   "train_step's forward (its backward gathers them again and reduce-scatters as many bytes of "
                   "gradients)" if cp.gathers else "K/V traffic is counted from the first train_step")
        lines.append(f"  context par. sequences split over cp ranks {pmodel.topology.group_ranks('cp')} in "
                     f"{2 * cp.shards.size} load-balanced chunks along dim {cp.sequence_dim}; {traffic}")
    if pmodel.expert_parallel is not None:
        lines += pmodel.expert_parallel.describe()
    if pmodel.pipeline is not None:
        pipe = pmodel.pipeline
        lines.append(f"  pipeline    {pipe.layout.num_stages} stages, schedule {pipe.schedule_name}, "
                     f"{pmodel.config.microbatches} microbatches; this rank runs stage(s) {pipe.stages}")
        lines += [f"              {line}" for line in pipe.layout.describe()]
        if pmodel.index.tied:
            lines.append(f"              tied across pipeline ranks (gradients summed): {sorted(pmodel.index.tied)}")
    if grads.buckets:
        payload = sum(b.nbytes for b in grads.buckets if b.reduce.size > 1)
        lines.append(f"  gradients   {len(grads.buckets)} bucket(s), all-reduced {payload / MiB:.2f} MiB per step")
        lines += [f"              {line}" for line in grads.describe()]
    else:
        lines.append("  gradients   one replica: plain autograd gradients, nothing to average")
    held = memory(pmodel)
    lines.append("  memory      " + ", ".join(f"{k} {v / MiB:.2f} MiB" for k, v in held.items())
                 + (f" (ZeRO-{pmodel.config.zero})" if pmodel.config.zero else ""))
    recompute = f"; {len(pmodel.recomputed)} module(s) recomputed ({pmodel.config.recompute or 'full'})" \
        if pmodel.recomputed else ""
    lines.append("  activations " + (activations.describe() if activations is not None
                                     else "summary(batch) measures them") + recompute)
    return "\n".join(lines)
