"""`ParallelModule`: the user's module with the executors `parallelize` (build.py) applied.

It runs the module: `forward`, `train_step` (microbatches accumulate in the gradient
buckets; the last backward, or each pipeline stage's last, reduces them), `infer_step`,
`no_sync`. The step's batch agreement and microbatch loop are in `step.py`, whole-model
state dicts in `state.py`, memory and summaries in `report.py`; the methods here delegate.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterator, NamedTuple

import torch
from torch import nn
from torch.distributed.tensor.parallel import loss_parallel

from . import report, state
from .batch import map_tensors, to_device
from .comm import trace_range
from .compiling import compile_blocks
from .errors import ConfigError, ModelError
from .groups import running
from .parallel.data.buffers import BufferBroadcast
from .parallel.context.sequence import ContextParallel
from .parallel.data.gradients import GradientBuckets
from .parallel.data.held_apart import GradientHeldApart
from .parallel.data.step_gradients import HeldGradients
from .parallel.expert import ExpertParallel, RouterLogitsOverReplicas
from .parallel.pipeline.stages import Pipeline
from .parallel.tensor.sharding import TensorParallel
from .parallel.data.zero import OptimizerParams
from .parallel.data.zero3 import ParameterShards
from .plan import Plan, ResolvedPlan
from .state import ModelIndex
from .step import MicrobatchLosses, StepBatch, agree_on_batch, check_forward
from .metrics import MetricsRecorder
from .step_output import StepOutput, check_reduce, concatenated
from .tensors import local, whole
from .topology import Topology


_NOT_COPIED = ("a ParallelModule cannot be copied or pickled: it holds this run's process groups, its hooks into "
               "autograd and (under ZeRO) shards of the parameters. Copy its values instead, e.g. for an EMA: "
               "ema = copy.deepcopy(your_module) made before sw.parallelize (after it the module holds DTensors under "
               "tp and released buffers under ZeRO-3), then blend in or load pmodel.full_state_dict() (whole tensors, "
               "on every rank); save with torch.save(pmodel.state_dict()) or sw.save_checkpoint")


class ParallelModule(nn.Module):
    """A module trained across ranks: the user's module plus the executors applied to it
    (built by `parallelize`). Running lives here; whole-model state in `state.py`; reports
    in `report.py`."""

    def __init__(self, module: nn.Module, topology: Topology, plan: Plan, resolved: ResolvedPlan,
                 index: ModelIndex, *, gradients: GradientBuckets, optimizer_params: OptimizerParams,
                 tensor_parallel: TensorParallel | None = None, pipeline: Pipeline | None = None,
                 param_shards: ParameterShards | None = None, recomputed: list[str] | None = None,
                 context_parallel: ContextParallel | None = None, buffers: BufferBroadcast | None = None,
                 expert_parallel: ExpertParallel | None = None, router_logits: RouterLogitsOverReplicas | None = None):
        super().__init__()
        self.module = module
        self.topology = topology
        self.config = topology.config
        self.plan = plan
        self.resolved_plan = resolved
        self.index = index  # the whole model's names and shapes (pipeline ranks hold part of it)
        self.tensor_parallel = tensor_parallel
        self.pipeline = pipeline
        self.context_parallel = context_parallel
        self.expert_parallel = expert_parallel
        self.router_logits = router_logits  # a load-balancing loss's router logits gathered over dp (forward communicates)
        self.gradients = gradients
        self.broadcast_buffers = buffers or (lambda: None)  # config.broadcast_buffers (dp or cp > 1, any buffers)
        self.param_shards = param_shards  # ZeRO-3
        self.optimizer_params = optimizer_params
        self.recomputed = recomputed or []  # modules whose activations are rebuilt in backward
        self.optimizers: list = []  # those built by sw.build_optimizer, for memory reports
        self.loss_scaler = None  # a LossScaler its optimizer attached (float16): train_step scales the loss
        self.steps = 0  # train_step calls, saved in checkpoints
        self._forwards = 0  # plain forward calls (checked like train_step every config.check_every)
        self._calls: dict[str, int] = {}  # calls of other per-step collective methods, for the same
        self._covered: set[str] = set()  # methods whose next call the last agreed train_step vouches for
        self.metrics = MetricsRecorder(self)  # what steps measured show (metrics.py)
        self.losses = MicrobatchLosses(self)  # the microbatch loop of a step without a pipeline (step.py)
        self.pending_save = None  # an asynchronous save still writing (checkpoint/save.py)
        self.save_coordinator = None  # the agreement of asynchronous saves, over a group of their own

    def __reduce_ex__(self, protocol: Any) -> Any:  # copy.deepcopy, copy.copy, pickle, torch.save(pmodel)
        raise ModelError(_NOT_COPIED)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> ParallelModule:
        """`pmodel.to(...)`, `.half()`, `.cuda()` and the like: run as torch runs them where no
        parameter or buffer would change dtype or device (`pmodel.to(its own device)`), refused
        where one would. The gradient buckets, optimizer shards, ZeRO-3's gathers and the
        float32 masters were built for the dtypes and devices parallelize saw: a later `.to`
        left them behind (a raw error in backward under dp, a crash in torch under ZeRO-3)."""
        changes = sorted(_conversions(self, fn))
        if changes:
            before, after = changes[0]
            raise ConfigError(
                f"converting a ParallelModule (pmodel.to, .half, .bfloat16, .cuda, ...) after sw.parallelize would "
                f"move its tensors from {before} to {after}; its gradient buckets, optimizer shards and gathers were "
                "built for the first. Convert or move the module before sw.parallelize (model.to(...)); for a "
                "low-precision run set ParallelConfig(param_dtype=torch.bfloat16), which keeps float32 masters")
        return super()._apply(fn, recurse)

    # running -------------------------------------------------------------------------
    def loss_parallel(self) -> contextlib.AbstractContextManager:
        """The context forward and backward of a loss-parallel plan run in (a no-op otherwise):
        train_step and infer_step use it; after a plain `pmodel(batch)` the loss's backward enters it
        itself (tensor/loss.py)."""
        tp = self.tensor_parallel
        return loss_parallel() if tp is not None and tp.loss_parallel else contextlib.nullcontext()

    def prepare(self, batch: Any) -> Any:
        """The batch on this rank's device; floating tensors in `param_dtype` under mixed precision."""
        batch = to_device(batch, self.topology.device)
        dtype = self.config.param_dtype
        return batch if dtype is None else map_tensors(batch, lambda t: t.to(dtype) if t.is_floating_point() else t)

    def run_module(self, *args: Any, **kwargs: Any) -> Any:
        """One forward of the wrapped module, inside tensor parallel's forward context."""
        with forward_context(self.tensor_parallel, self.context_parallel, self.module):
            return self.module(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's forward; `loss.backward()` then synchronizes gradients. Under
        mixed precision floating inputs are cast to `param_dtype`, as train_step's batch is.

        With pipeline parallelism use train_step and infer_step: one rank holds only its stages.
        """
        if torch.compiler.is_compiling():
            _refuse_tracing("pmodel's forward (torch.compile(pmodel))")
        if self.pipeline is not None or self.context_parallel is not None:
            raise ModelError(f"with {'pp' if self.pipeline is not None else 'cp'} > 1 a forward spans ranks (and "
                             "shardwise splits the batch): use pmodel.train_step(batch) or pmodel.infer_step(batch)")
        self._forwards += 1
        check_forward(self, args, kwargs)
        self.gradients.cleared = False
        if self.config.param_dtype is not None:  # floating inputs in it, as train_step's (and FSDP2's)
            args, kwargs = self.prepare((args, kwargs))
        with self.in_step("forward"), self.loss_parallel():
            self.broadcast_buffers()  # before, as DDP: the backward that follows has no hook at its end
            return self.run_module(*args, **kwargs)

    @property
    def coordinator(self):
        """Agreement between this topology's ranks before each collective operation."""
        return self.topology.coordinator

    def agree_on_batch(self, op: str, batch: Any, parts: int, check: bool) -> StepBatch:
        """The step's batch checked, split and agreed with every rank (step.py)."""
        return agree_on_batch(self, op, batch, parts, check)

    def _checking(self) -> bool:
        return (self.steps - 1) % self.config.check_every == 0

    @contextlib.contextmanager
    def collective(self, op: str, communicates: bool = True) -> Iterator[Callable[[], None]]:
        """Around a method called once per step that may communicate (optimizer.step,
        clip_grad_norm): agreed on the first call and every `config.check_every` calls, as
        train_step is, except right after a train_step that agreed: every rank has just shown
        it is in step, and a rank that then skips this method is found by the waits instead
        (a peer that moved on to a later operation, coordination.py). Yields `ready()`, to
        call before the method's first collective: the ranks' records are gathered while it
        does its local work."""
        calls = self._calls[op] = self._calls.get(op, 0) + 1
        covered, pending = op in self._covered, None
        self._covered.discard(op)
        if communicates and self.topology.world_size > 1 and (calls - 1) % self.config.check_every == 0 \
                and not covered:
            pending = self.coordinator.begin(op)
        ready = pending.result if pending is not None else (lambda: None)
        with self.in_step(op):
            yield ready
            ready()

    def train_step(self, batch: Any, reduce: str = "mean", outputs: bool = False,
                   metrics: bool = False) -> torch.Tensor | StepOutput:
        """Forward and backward over `config.microbatches` slices of `batch`.

        Gradients are the mean over microbatches and replicas weighted by their sample
        counts (exactly as one process computes them on the replicas' batches concatenated);
        returns the mean loss, detached, the same on every rank. Inside `no_sync()`
        gradients are only accumulated and the loss is this replica's. `reduce="sum"` sums
        over microbatches instead, `reduce="tokens"` weights each by the token count its
        forward returns second; `outputs=True` returns a `StepOutput` with the forward's
        outputs too (step_output.py), `metrics=True` one with the step's `StepMetrics`
        (metrics.py; every step is measured once `pmodel.metrics.log_to(...)` is called).
        """
        if not (metrics or self.metrics.wanted):
            with trace_range("train_step"):
                return self._train_step(batch, reduce, outputs)
        with self.metrics.measure(batch) as measured, trace_range("train_step"):
            result = self._train_step(batch, reduce, outputs, measured)
        if not (outputs or metrics):
            return result
        out = result if outputs else StepOutput(result)
        out.metrics = measured.metrics
        return out

    def _train_step(self, batch: Any, reduce: str, outputs: bool, measured: Any = None) -> torch.Tensor | StepOutput:
        if torch.compiler.is_compiling():
            _refuse_tracing("pmodel.train_step")
        check_reduce(reduce, outputs, self.pipeline is not None, self.context_parallel is not None)
        if reduce == "tokens" and self.expert_parallel is not None:
            raise ConfigError("train_step(reduce='tokens') with ep > 1: expert gradients take each replica's weight "
                              "where its tokens leave, and the token weights are known only after the last "
                              "microbatch; use reduce='mean' (or 'sum')")
        if reduce == "tokens" and not self.gradients.sync_enabled:
            raise ConfigError("train_step(reduce='tokens') inside no_sync(): the token total that weights the "
                              "gradients is only known at the synchronizing step; accumulate with microbatches")
        if reduce == "tokens":
            HeldGradients.refuse_unkeepable(self.gradients)
        self.steps += 1
        if self.steps == 1 and not self.optimizers and self.gradients.outside_grad():
            warnings.warn(f"gradients live {self.gradients.apart()}, so only an optimizer built with "
                          "sw.build_optimizer(pmodel, ...) sees them (a plain torch optimizer is refused at its step)",
                          stacklevel=2)
        parts = self.config.microbatches
        op = "train_step" if reduce == "mean" else f"train_step(reduce={reduce!r})"  # ranks must reduce alike
        step = self.agree_on_batch(op, batch, parts, self._checking())
        self._covered = {"optimizer.step", "clip_grad_norm"} if self._checking() else set()
        if self.context_parallel is not None:
            self.context_parallel.reset_traffic()
        if self.expert_parallel is not None:
            self.expert_parallel.reset_traffic()
        weight = 1.0 if reduce == "tokens" else step.weight  # tokens: set at the last microbatch
        kept, tokens = [], None
        set_aside = self.zero_grad if reduce == "tokens" else None  # earlier .grad sits out the token weights
        with self.in_step("train_step"), self.gradients.step(weight, set_aside) as gradients, self.loss_parallel():
            if self.pipeline is not None:
                with gradients.pipelined() as sync:
                    local = self.pipeline.train_step(step.batch, sync, step.loss_weights,
                                                     self.loss_scaler.scale if self.loss_scaler else 1.0, reduce)
                gradients.loss(local)
            else:
                local, kept, tokens = self.losses.accumulate(step, gradients, reduce, outputs)
            mean = gradients.finish(local)
            self.broadcast_buffers()
        if gradients.syncing:
            self.after_sync()
        if tokens is not None:
            mean, tokens = tokens[0] / tokens[1], int(tokens[1])
        if measured is not None:
            measured.loss, measured.samples, measured.total_samples = mean.detach(), step.samples, step.total_samples
        return StepOutput(mean, concatenated(kept), tokens) if outputs else mean

    @contextlib.contextmanager
    def in_step(self, op: str) -> Iterator[None]:
        """The body of an agreed operation: an exception escaping it on this rank alone puts
        this rank out of step (see coordination.py)."""
        with self.coordinator.body(op), running(self.topology):
            yield

    def after_sync(self) -> None:
        """After gradients are reduced: ZeRO-3 frees gathered parameters; the first sync checks
        replicated tp gradients."""
        if self.param_shards is not None:
            self.param_shards.release_all()
        self.losses.check_replicated_grads()

    def compile(self, *args: Any, **kwargs: Any) -> list[str]:
        """Compile each block of the main layer list in place (torchtitan's granularity;
        compiling.py); returns their paths."""
        return compile_blocks(self.module, self.tensor_parallel, self.recomputed, *args, **kwargs)

    def timeline(self, batch: Any, path: str, trace_dir: str | None = None) -> Any:
        """Run one train_step on `batch` and draw every rank's lane, measured and (under our
        pipeline executor) from theory, as an SVG at `path` on rank 0 (timeline.py)."""
        from .timeline import timeline

        return timeline(self, batch, path, trace_dir)

    @torch.no_grad()
    def infer_step(self, batch: Any) -> Any:
        """The module's outputs for `batch`, without gradients, on every rank; sharded outputs
        gathered whole. With pp > 1: the last stage's outputs."""
        step = self.agree_on_batch("infer_step", batch, 1, check=True)
        with self.in_step("infer_step"), self.loss_parallel():
            if self.pipeline is not None:
                out = self.pipeline.infer_step(step.batch)
            else:
                out = map_tensors(self.run_module(step.batch), whole)
            if self.context_parallel is not None:
                out = self.context_parallel.whole_outputs(out, step.loss_weights[0])
            if self.module.training:  # BatchNorm statistics moved
                self.broadcast_buffers()
            return out

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first backward after the block synchronizes."""
        with self.gradients.no_sync():
            yield

    def finish_gradient_sync(self) -> None:
        """Complete any pending gradient synchronization (the optimizer calls this)."""
        with self.collective("finish_gradient_sync", communicates=self.gradients.pending) as ready:
            ready()
            self.gradients.finish()
            self.after_sync()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset gradients (to None by default), keeping the gradient buckets consistent; the
        optimizer's tensors let go of theirs too, so freed gradient storage is not kept alive."""
        self.gradients.zero_grad(set_to_none)
        self.optimizer_params.zero_grad()

    # state dicts ---------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """A plain state dict with the original module's keys and full tensors, on every rank.

        Collective: every rank must call it (ranks that do not are named in the error).
        """
        return state.full_state_dict(self)

    def full_grad_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter's gradient, whole, under its original name, as one process would
        hold it (copies: later steps do not change them); parameters without a gradient are
        absent. Collective, like `full_state_dict`."""
        return state.full_grad_dict(self)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """nn.Module's state dict (keys under `module.`, tensor-parallel parameters as
        DTensors, a pipeline rank's own stages). Under ZeRO-3 the parameters are gathered
        whole and copied first, so there it is collective (every rank calls it, as FSDP's
        full state dict); a torch.save of it reads back. Plain keys: `full_state_dict()`."""
        return state.module_state_dict(self, super().state_dict, *args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load what `state_dict()` returned (keys under `module.`): collective, checked on
        every rank first, and kept consistent with ZeRO's shards and master copies (which a
        plain nn.Module load would silently leave as they were)."""
        return state.load_module_state_dict(self, state_dict, strict, assign)

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load a plain state dict (as `full_state_dict` returns): each rank keeps its shards.

        Collective; every rank checks the dict it was given before anything changes, so a
        dict that does not fit on one rank is the same `CheckpointError` on every rank."""
        state.load_full_state_dict(self, state_dict, strict)

    def whole_parameters(self) -> contextlib.AbstractContextManager:
        """Parameters whole inside the block (ZeRO-3 gathers them; otherwise nothing to do)."""
        return self.param_shards.whole() if self.param_shards is not None else contextlib.nullcontext()

    # reporting -----------------------------------------------------------------------
    def held_tensors(self) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """This rank's parameter tensors (local shards, ZeRO shards) and gradient tensors
        (local gradients, bucket buffers and shards); None where a bucket has none."""
        buckets = self.gradients.buckets
        params = [local(p) for p in self.module.parameters()] + [b.param_shard for b in buckets]
        grads = [local(p.grad) for p in self.module.parameters()
                 if p.grad is not None and not isinstance(p.grad, GradientHeldApart)]
        return params, grads + [b.buffer for b in buckets] + [b.shard for b in buckets]

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds now: parameters, gradients, and the optimizer state (of the
        optimizers built with `sw.build_optimizer`, master weights included)."""
        return report.memory(self)

    def summary(self, batch: Any = None) -> str:
        """Layout, per-rank parameter bytes and communication per step, as text; given a
        `batch`, also the activation bytes one microbatch saves for backward (collective then:
        every rank calls it, as sw.activation_memory)."""
        return report.summary(self, batch)


def _conversions(module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> set[tuple[str, str]]:
    """The (dtype on device) pairs of `module`'s tensors that `fn` (an `nn.Module._apply`
    conversion) would change, each with what it makes of them: `fn` runs on an empty tensor
    of each kind, never on the tensors themselves (ZeRO-3's hold no storage between steps)."""
    kinds = {(t.dtype, t.device) for t in (*module.parameters(), *module.buffers())}
    changed = set()
    for dtype, device in kinds:
        out = fn(torch.empty(0, dtype=dtype, device=device))
        if (out.dtype, out.device) != (dtype, device):
            changed.add((f"{dtype} on {device}", f"{out.dtype} on {out.device}"))
    return changed


@torch.compiler.disable
def _refuse_tracing(what: str) -> None:
    """Raised eagerly (Dynamo breaks its graph at a disabled call and runs it): torch.compile
    tracing through shardwise's step would compile its agreements, collectives and hooks too
    (under tp a raw AssertionError from Dynamo; on torch before 2.13 DTensor gradients lost)."""
    raise ConfigError(
        f"torch.compile traced {what}: that would compile shardwise's own step (its agreements, collectives and "
        "hooks) with your model. Compile the model's blocks with pmodel.compile(...) instead (the same arguments "
        "as torch.compile): each block compiled in place, as torchtitan does, the step around them eager")


class DataParallelInfo(NamedTuple):
    """Which data-parallel replica this rank belongs to, and how many there are."""

    index: int
    count: int


def data_parallel_info(pmodel: ParallelModule) -> DataParallelInfo:
    """The replica index and count: feed replica `index` its own 1/`count` of the data."""
    return DataParallelInfo(pmodel.topology.dp_rank, pmodel.topology.sizes["dp"])


@contextlib.contextmanager
def forward_context(tensor_parallel: TensorParallel | None, context_parallel: ContextParallel | None,
                    module: nn.Module) -> Iterator[None]:
    """Around one forward of `module` or a pipeline stage of it: tensor parallel checks the
    first and forgets its per-forward state after each; context parallel routes attention
    over the whole sequence (nothing without either)."""
    with tensor_parallel.forward(module) if tensor_parallel is not None else contextlib.nullcontext(), \
            context_parallel.attention() if context_parallel is not None else contextlib.nullcontext():
        yield
