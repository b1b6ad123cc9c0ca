"""Data parallelism: gradients averaged over replicas in flat buckets, overlapped with backward.

Each parameter's gradient lives in a flat bucket buffer: the first gradient of a step is
copied in once by a post-accumulate-grad hook and `.grad` becomes a view of the bucket, so
later microbatches accumulate straight into it. Buckets hold parameters in reverse
registration order (roughly the order backward produces gradients); the same hook counts a
bucket down, and the bucket's all-reduce is launched asynchronously as soon as it is full,
so communication overlaps the rest of backward. Buckets launch strictly in order, so every
rank issues the same collectives in the same order even when ranks see different
parameters unused. One wait at the end of backward finishes the step; under ZeRO-2/3, whose
gradients live as shards, a bucket's whole-gradient buffer is freed as soon as a later launch
finds its reduce-scatter done (at most `IN_FLIGHT` held), not at the end of the step; a step of
several microbatches reduces each into the shards, which sum them, so no whole gradient outlives
a backward (as FSDP and DeepSpeed do; it costs a reduce-scatter of the gradients a microbatch).
A pipeline's schedule accumulates whole gradients and reduces after a stage's last backward.

Each parameter is reduced over its own group with its own scale: the data-parallel ranks
(mean), or, for a replicated parameter whose gradient is partial over tensor-parallel ranks
(a norm under sequence parallelism), data- and tensor-parallel ranks together (sum over tp,
mean over dp) — one collective, in the same pass, instead of re-reducing the partial
gradient each time an optimizer reads it. DTensor parameters are reduced through their
local shards.

A `ReplicaSummary` is averaged with the gradients: per parameter, whether this replica
produced a gradient, and the step's loss. It tells every rank which parameters no replica
used — those end the step with `grad = None`, exactly as on one process, so optimizers skip
them — and gives the mean loss over replicas. It rides in the last bucket's declared summary
slots at no extra collective (in a small all-reduce of its own when that bucket cannot
carry it: not float32, reduce-scattered under ZeRO, or reduced with pipeline ranks that hold
other parameters).

Why not torch's DistributedDataParallel: the same pass must reduce-scatter (ZeRO-1/2) and
sum tensor-parallel partial gradients, and DDP owns its buckets; DDP also makes unused
parameters a mode (find_unused_parameters) with its own cost, where here they are always
handled.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from ...comm import CommStats, coalesce, trace_range, wait
from ...compat import all_gather_single, reduce_scatter_single
from ...errors import ShardwiseError
from ...tensors import local
from .buckets import Bucket, ReduceGroup, ReplicaSummary, ZeroStage, as_grad
from .held_apart import StandIns
from .step_gradients import HeldGradients, StepGradients

MiB = 1 << 20
IN_FLIGHT = 2  # ZeRO-2/3: whole-gradient buffers of launched reduce-scatters kept at once


class GradientBuckets:
    """Bucketed, overlapped gradient reduction, each parameter over its `ReduceGroup`.

    `no_sync()` accumulates without communicating; the next synchronized backward (or
    `finish()`) reduces everything accumulated since the last synchronization.
    """

    def __init__(self, params: list[nn.Parameter], reduce_of: list[ReduceGroup], bucket_bytes: int,
                 replicas: ReduceGroup, zero: ZeroStage = ZeroStage(), reduce_dtype: torch.dtype | None = None,
                 apart: dict[int, tuple] | None = None):
        if not params:
            raise ShardwiseError("no trainable parameters to synchronize")
        self.params = params
        self.replicas = replicas  # where the ReplicaSummary is averaged
        self.zero = zero
        self.stats = CommStats()
        self.pre_hooks: list = []  # called on each bucket's gradients before its collective
        self.post_hooks: list = []  # called on the reduced gradients (buffer, or shard under ZeRO) after it
        self.coordinator = None  # names stalled or failed peers when a wait cannot finish
        self.unused: set[int] = set()  # ids of parameters no replica produced a gradient for last sync
        self._stand_ins = StandIns(self.apart, self.refuse_accumulating_over_syncs)  # .grad where gradients live apart

        def dtype(p: nn.Parameter) -> torch.dtype:
            return reduce_dtype or local(p).dtype

        # A parameter whose group is one rank has nothing to reduce: a plain autograd gradient,
        # unless it is accumulated in another dtype than its own (bfloat16 parameters, float32
        # reduce_dtype): autograd's .grad would round every microbatch's sum to the parameter's
        # dtype, so it takes a bucket that is never communicated (not under ZeRO, whose buckets
        # are shards of a group; one replica runs zero=0 anyway)
        def bucketed(p: nn.Parameter, r: ReduceGroup) -> bool:
            return r.size > 1 or (dtype(p) != local(p).dtype and not zero.grads_sharded)

        synced = [(p, r) for p, r in zip(reversed(params), reversed(reduce_of)) if bucketed(p, r)]
        # a bucket never holds parameters with two labels: a ZeRO-3 unit gathers its own, a
        # pipeline stage launches its own as soon as its last backward is done
        apart = apart or {}
        runs = list(coalesce(synced, bucket_bytes,
                             key=lambda pr: (dtype(pr[0]), local(pr[0]).device, pr[1], apart.get(id(pr[0]))),
                             nbytes=lambda pr: local(pr[0]).numel() * local(pr[0]).element_size()))
        self.summary = ReplicaSummary(len(params))
        self._summary_in_bucket = (bool(runs) and not zero.grads_sharded and dtype(runs[-1][0][0]) == torch.float32
                                   and runs[-1][0][1].same_params_on_members and runs[-1][0][1].spans_replicas)
        self.buckets = [
            Bucket(i, [p for p, _ in run], run[0][1], dtype(run[0][0]), zero,
                   summary_slots=self.summary.slots if self._summary_in_bucket and i == len(runs) - 1 else 0)
            for i, run in enumerate(runs)
        ]
        self._index = {p: i for i, p in enumerate(params)}
        self._slot = {p: (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        # reduced over one rank: plain .grad, no bucket to weigh it (experts are weighted where their tokens leave)
        self._lone = [p for p, r in zip(params, reduce_of) if p not in self._slot and not r.weighted_at_origin]
        self.sync_enabled = True
        self.has_grads = False  # reduced gradients exist: a sync ran since zero_grad(set_to_none=True)
        self.cleared = True  # no forward or step since zero_grad: any gradient held is zeros
        self.auto_finish = True  # finish at the end of each synchronized backward
        self._reset_window()
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in self._slot]

    def _reset_window(self) -> None:
        self._used = [False] * len(self.params)  # any local gradient since the last sync
        self._dirty = False  # gradients accumulated since the last sync
        self.summary.loss = None
        # this replica's share relative to an equal one (n_replica * replicas / n_total): 1.0
        # unless train_step's replicas hold different numbers of samples
        self.replica_weight = 1.0
        self._summary_alone: torch.Tensor | None = None  # the summary, when it has its own collective
        self._summary_work: dist.Work | None = None
        for bucket in self.buckets:
            bucket.shard_factor = None
        self._reset_launches()

    def _reset_launches(self) -> None:
        """Ready for the next synchronized backward (of this step's next microbatch, or the next step)."""
        self._ready = [False] * len(self.params)  # gradient final in this synced backward
        self._next = 0  # first bucket not yet launched
        self._callback_queued = False
        self._hold_last = False  # the last bucket waits for finish() (pipeline schedules)
        self._partial = False  # a microbatch's reduction into the shards, not the step's last
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
            bucket.work = None

    @property
    def replica_weight(self) -> float:
        if callable(self._replica_weight):
            self._replica_weight = self._replica_weight()
        return self._replica_weight

    @replica_weight.setter
    def replica_weight(self, value: float | Callable[[], float]) -> None:
        self._replica_weight = value

    # backward ----------------------------------------------------------------------
    def _move_grad_into_bucket(self, param: nn.Parameter, bucket: Bucket, i: int) -> None:
        """Move `param.grad` (if any) into its bucket slot: the first gradient of a window is
        copied, later ones were accumulated in place (or are added, for cast "main" grads)."""
        if bucket.holds_reduced:
            self.refuse_accumulating_over_syncs()
        index = self._index[param]
        view = bucket.views[i]
        if param.grad is not None:
            grad = local(param.grad)
            if grad.data_ptr() != view.data_ptr():
                view.add_(grad) if self._used[index] and bucket.casts_grads else view.copy_(grad)
            self._used[index] = True
        elif not self._used[index]:
            view.zero_()  # no local gradient (yet): contributes zeros; finish() decides
        param.grad = None if bucket.casts_grads else as_grad(param, view)

    def refuse_accumulating_over_syncs(self) -> None:
        """A backward reaches gradients a synchronization reduced and no zero_grad cleared, where
        they live apart from `.grad` (ZeRO's shards, float32 buckets of bfloat16 parameters): a
        DDP user accumulating over synchronized backwards and one who cleared `.grad` by hand
        look the same here, and adding or overwriting would be silently wrong for the other.
        Raised on every rank alike (the state is), before this backward launches anything."""
        raise ShardwiseError(
            f"a backward after a synchronized one without zero_grad in between (gradients live {self.apart()}, "
            "so shardwise cannot tell accumulating from .grad cleared by hand). Call "
            "optimizer.zero_grad() or pmodel.zero_grad() between steps, and accumulate over backwards inside "
            "`with pmodel.no_sync():` (the last one outside it) or with config.microbatches")

    def _grad_ready(self, param: nn.Parameter) -> None:
        index = self._index[param]
        bucket, i = self._slot[param]
        bucket.allocate()
        self._move_grad_into_bucket(param, bucket, i)
        self._dirty = True
        if not self.sync_enabled:
            return
        if self._ready[index]:
            raise ShardwiseError(
                "a parameter received a second gradient before its bucket was synchronized; "
                "accumulate gradients inside `pmodel.no_sync()` or use config.microbatches"
            )
        self._ready[index] = True
        bucket.pending -= 1
        if self.auto_finish and not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_after_backward)
            self._callback_queued = True
        self._launch_full()

    def _launch_full(self) -> None:
        """Launch, in order, the buckets whose gradients are all final (inside a pipeline
        schedule, all but the last: its summary carries the loss, known when the schedule ends)."""
        end = len(self.buckets) - (1 if self._hold_last else 0)
        while self._next < end and self.buckets[self._next].pending == 0:
            self._launch(self.buckets[self._next])

    def _finish_after_backward(self) -> None:
        self.finish()

    def grads_final(self, params: list[nn.Parameter]) -> None:
        """The gradients of `params` are final for this step though backward is running
        without sync (a pipeline stage's last backward is done, some may have had no
        gradient): launch, in order, every bucket whose parameters are all final. The last
        bucket waits for `finish()`, which stages the step's loss first."""
        for param in params:
            if param not in self._slot or self._ready[self._index[param]]:
                continue
            bucket, i = self._slot[param]
            bucket.allocate()
            self._move_grad_into_bucket(param, bucket, i)
            self._ready[self._index[param]] = True
            bucket.pending -= 1
        self._hold_last = True
        self._launch_full()

    @contextlib.contextmanager
    def final_backward(self) -> Iterator[None]:
        """Inside a step that accumulates without sync (a pipeline schedule): the backward
        in this block is the last to produce the gradients it produces, so each bucket launches
        as soon as it is full, as in a synchronized backward; `finish()` completes the step."""
        saved = self.sync_enabled, self.auto_finish
        self.sync_enabled, self.auto_finish, self._hold_last = True, False, True
        try:
            yield
        finally:
            self.sync_enabled, self.auto_finish = saved

    @property
    def pending(self) -> bool:
        """Gradients accumulated (or a loss staged) since the last synchronization."""
        return self._dirty or self.summary.loss is not None

    def stage_loss(self, loss: torch.Tensor) -> None:
        """This replica's loss, averaged with this step's gradients (see `ReplicaSummary`).
        Call before the step's last backward; `finish()` returns the mean over replicas."""
        self.summary.loss = loss.detach().reshape(()).float()

    def _launch(self, bucket: Bucket) -> None:
        with trace_range(f"launch {'reduce-scatter' if bucket.sharded else 'all-reduce'} of gradient bucket {bucket.index}"):
            self._launch_bucket(bucket)

    def _launch_bucket(self, bucket: Bucket) -> None:
        bucket.allocate()
        if bucket.pending:  # parameters no hook reported in this backward
            for i, param in enumerate(bucket.params):
                if not self._ready[self._index[param]]:
                    self._move_grad_into_bucket(param, bucket, i)
        reduce = bucket.reduce
        for hook in self.pre_hooks:
            hook(bucket.grads)
        bucket.launch_factor = reduce.scale * (1.0 if reduce.weighted_at_origin else self.replica_weight)
        bucket.buffer.mul_(bucket.launch_factor)
        if bucket.summary_slots:
            bucket.summary.copy_(self.summary.pack(self._used, reduce.size, bucket.device))
        if reduce.size == 1:  # accumulated in the bucket's dtype, nothing to reduce
            bucket.work = None
        elif bucket.sharded:
            self.stats.record("reduce_scatter", bucket.grads)
            bucket.work = reduce_scatter_single(bucket.reduced_into(), bucket.grads, group=reduce.group, async_op=True)
        else:
            self.stats.record("all_reduce", bucket.buffer)
            bucket.work = dist.all_reduce(bucket.buffer, group=reduce.group, async_op=True)
        if not self.zero.grad_buffer_kept:
            self._bound_in_flight(bucket.index)
        if bucket is self.buckets[-1] and not self._summary_in_bucket and self.replicas.size > 1 and not self._partial:
            self._summary_alone = self.summary.pack(self._used, self.replicas.size, bucket.device)
            self.stats.record("all_reduce", self._summary_alone)
            self._summary_work = dist.all_reduce(self._summary_alone, group=self.replicas.group, async_op=True)
        self._next = bucket.index + 1

    def _bound_in_flight(self, launched: int) -> None:
        """ZeRO-2/3: finish the reduce-scatter launched IN_FLIGHT buckets ago and free its
        whole-gradient buffer, so backward holds at most IN_FLIGHT of them (plus the one
        filling) instead of every bucket's until the step ends; it has usually finished by
        then (a group runs its collectives in order)."""
        if launched < IN_FLIGHT:
            return
        done = self.buckets[launched - IN_FLIGHT]
        if done.work is not None:
            self._complete(done)
        done.release()

    def _complete(self, bucket: Bucket) -> None:
        """Wait for `bucket`'s collective (a shard's: and add it to the step's partial sum)."""
        op = "reduce-scatter" if bucket.sharded else "all-reduce"
        wait(bucket.work, f"{op} of gradient bucket {bucket.index} ({bucket.nbytes} bytes)", bucket.reduce.group,
             self.coordinator)
        bucket.work = None
        if bucket.sharded:
            bucket.settle()

    def _launch_rest_and_wait(self) -> None:
        """Launch, in order, the buckets not launched yet and wait for every bucket's collective."""
        for bucket in self.buckets[self._next:]:
            self._launch(bucket)
        for bucket in self.buckets:
            if bucket.work is not None:
                self._complete(bucket)

    @contextlib.contextmanager
    def reduce_into_shards(self) -> Iterator[None]:
        """ZeRO-2/3, around a microbatch of a step that is not its last: its backward
        reduce-scatters each bucket as it fills, as the last one does, and the shards sum the
        microbatches, so no whole gradient outlives a backward (FSDP's and DeepSpeed's way,
        one reduce-scatter of the gradients a microbatch). What only the step's last reduction
        carries waits for it: the loss, the unused-parameter mask, the reduce hooks' `post`."""
        self._partial = True
        try:
            yield
        except BaseException:
            self._partial = False
            raise
        self._launch_rest_and_wait()
        for bucket in self.buckets:
            bucket.release()
        self._reset_launches()

    def finish(self) -> torch.Tensor | None:
        """Complete synchronization: launch what is left, wait once, settle unused params.

        Returns the mean loss over replicas staged with `stage_loss`, if one was.
        """
        if not self.pending:
            return None
        if not self.buckets:  # nothing to reduce: gradients are final once weighted
            self._weigh_lone()
            loss = self.summary.loss
            self._reset_window()
            return loss
        self._launch_rest_and_wait()
        self._weigh_lone()
        for bucket in self.buckets:
            for hook in self.post_hooks:
                hook(bucket.grad_shard if bucket.sharded else bucket.grads)
        wait(self._summary_work, "all-reduce of the unused-parameter mask and the loss", self.replicas.group,
             self.coordinator)
        reduced = self.buckets[-1].summary if self._summary_in_bucket else self._summary_alone
        self.unused = set()
        self.has_grads = True
        if not all(self._used[self._index[p]] for p in self._slot):
            used_anywhere = self._used if reduced is None else self.summary.used_anywhere(reduced)
            self.unused = {id(p) for p in self._slot if not used_anywhere[self._index[p]]}
        for param, (bucket, _) in self._slot.items():
            if bucket.sharded or id(param) in self.unused:  # ZeRO: gradients live in the shards
                param.grad = None
        for bucket in self.buckets:
            bucket.holds_reduced = bucket.grads_apart
        if not self.zero.grad_buffer_kept:
            for bucket in self.buckets:
                bucket.release()
        self._stand_ins.assign(p for p, (b, _) in self._slot.items() if b.grads_apart and id(p) not in self.unused)
        loss = self.summary.loss
        if loss is not None and reduced is not None:
            loss = self.summary.mean_loss(reduced)
        self._reset_window()
        return loss

    def _weigh_lone(self) -> None:
        """Parameters reduced over one rank have no bucket whose launch weighs them: their
        gradients take this replica's weight here (reduce="tokens" weighs even a lone replica,
        by 1 / the step's token total; a tp-only layout buckets only its tp-partial gradients)."""
        if self.replica_weight != 1.0:
            for param in self._lone:
                if param.grad is not None:
                    param.grad.mul_(self.replica_weight)

    def full_grads(self) -> dict[int, torch.Tensor]:
        """Parameter id -> its whole reduced gradient (local shard of a DTensor), gathered from
        the ZeRO shards; collective over each bucket's group (where a reduction ran since the
        gradients were set to None: the same on every rank). Parameters without a gradient, as
        one process would see them, are absent: unused ones, and all after zero_grad(set_to_none=True)
        but what a backward accumulated since (whole, in the buffer, not yet reduced)."""
        grads = {}
        for bucket in self.buckets:
            in_buffer = not (bucket.sharded and self.has_grads)  # whole, as this rank holds it
            if not in_buffer:
                full = torch.empty(bucket.padded, dtype=bucket.dtype, device=bucket.device)
                all_gather_single(full, bucket.grad_shard, group=bucket.reduce.group)
            elif bucket.buffer is not None:
                full = bucket.grads
            else:
                continue
            for param, offset, size, shape in zip(bucket.params, bucket.offsets, bucket.sizes, bucket.shapes):
                reduced = self.has_grads and id(param) not in self.unused
                accumulated = in_buffer and self._used[self._index[param]]
                if reduced or accumulated:
                    grads[id(param)] = full[offset: offset + size].view(shape)
        return grads

    # controls ----------------------------------------------------------------------
    @contextlib.contextmanager
    def _switched_off(self, flag: str) -> Iterator[None]:
        previous = getattr(self, flag)
        setattr(self, flag, False)
        try:
            yield
        finally:
            setattr(self, flag, previous)

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Accumulate without communicating inside this block."""
        return self._switched_off("sync_enabled")

    def _manual_finish(self) -> contextlib.AbstractContextManager:
        """Within this block the caller calls `finish()` itself."""
        return self._switched_off("auto_finish")

    @contextlib.contextmanager
    def step(self, replica_weight: float | Callable[[], float],
             set_aside: Callable[[], None] | None = None) -> Iterator[StepGradients]:
        """One training step's gradient accumulation (see `StepGradients`); `replica_weight`
        is this replica's share relative to an equal one (a callable: read when first needed,
        by the loss or the first bucket, which lets the step's agreement run during the forward).
        `set_aside`: gradients held from before the step sit out its weighting (`HeldGradients`,
        which calls it, the module's zero_grad, once they are taken)."""
        held = HeldGradients(self, set_aside) if set_aside is not None else None
        self.replica_weight = replica_weight
        with self._manual_finish():
            yield StepGradients(self, held)

    @torch.no_grad()
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset gradients as `torch.optim.Optimizer.zero_grad` does.

        With `set_to_none` (the default) each `.grad` becomes None and what was accumulated
        since the last synchronization is discarded (a backward under `no_sync` that the user
        drops must not reach the next reduction), ZeRO-2/3's shards and buffers are freed, and
        the next backward's gradient is moved into its bucket once; otherwise buckets and shards
        are zeroed in place.
        """
        for bucket in self.buckets:  # a reduction launched and not yet waited for lands first
            if bucket.work is not None:
                self._complete(bucket)
        self.cleared = True
        if set_to_none:
            self.has_grads = False
            self._reset_window()
            for bucket in self.buckets:
                bucket.drop_grads()
        with torch._C.DisableTorchFunctionSubclass():  # ZeRO-3's released parameters: straight to torch
            for param in self.params:
                if set_to_none:
                    param.grad = None
                elif param not in self._slot and param.grad is not None:
                    param.grad.zero_()
        if not set_to_none:
            for bucket in self.buckets:
                if bucket.buffer is not None:
                    bucket.buffer.zero_()
                if bucket.shard is not None:
                    bucket.shard.zero_()
                bucket.holds_reduced = False
                for param, view in zip(bucket.params, bucket.views):
                    param.grad = None if bucket.grads_apart else as_grad(param, view)

    def outside_grad(self) -> list[nn.Parameter]:
        """Parameters whose reduced gradient lives outside `.grad`: in ZeRO's shards, or in the
        float32 bucket of a parameter of lower precision (`sw.build_optimizer`'s optimizers read
        them there; `full_grad_dict()` gathers them)."""
        return [p for b in self.buckets if b.grads_apart for p in b.params]

    def apart(self) -> str:
        """Where `outside_grad()`'s gradients live, for messages."""
        if self.zero.grads_sharded:
            return f"in the optimizer's shards (zero={self.zero.stage}), not in .grad"
        cast = next(b for b in self.buckets if b.casts_grads)
        name = lambda dtype: str(dtype).replace("torch.", "")  # noqa: E731
        return f"in {name(cast.dtype)} buckets, not in the {name(local(cast.params[0]).dtype)} parameters' .grad"

    def describe(self) -> list[str]:
        return [
            f"bucket {b.index}: {len(b.params)} tensors, {b.nbytes / MiB:.2f} MiB "
            f"{str(b.dtype).replace('torch.', '')} "
            + (f"over {b.reduce.label}" if b.reduce.size > 1 else "on this rank alone (accumulated, not communicated)")
            + (f", {'reduce-scattered' if b.sharded else ''} shard {b.shard_size} elements" if b.sharded else "")
            + (f" (incl. {b.summary_slots} summary slots: unused mask, loss)" if b.summary_slots else "")
            for b in self.buckets
        ]
