"""`save_checkpoint`: every rank writes only the regions it owns, once, into a staging
directory that rank 0 publishes atomically (store.py), with every failure agreed on every
rank. With `async_=True` the state is copied off the training tensors first and the write,
the ranks' agreement on it and the publication run in a background thread over a process
group of their own, so the step waits only for the copy (`AsyncSave`)."""

from __future__ import annotations

import copy
import shutil
import threading
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import CheckpointError
from ..tensors import local
from .regions import _buffers, _group_names, _part, _pieces, _regions
from .store import FORMAT, RankWriter, publish, to_safe_bytes


def save_checkpoint(path: str | Path, pmodel, optimizer=None, extra: Any = None,
                    async_: bool = False) -> "Path | AsyncSave":
    """Save `pmodel` (and `optimizer`, and `extra`) under directory `path`.

    `extra` is this rank's own (a data loader's position, say): each rank's is kept and
    `load_checkpoint` returns each rank its own. It may hold tensors, numbers, strings and
    containers of them, which load without running code; anything else is refused.

    Collective. Atomic: until the save completes, `path` keeps presenting the previous
    checkpoint. A failure on any rank (an unwritable directory, a full disk, a directory
    another rank cannot see) is the same `CheckpointError` on every rank, the previous
    checkpoint stays the latest, and training can go on. Returns the directory of the new
    version; with `async_=True`, an `AsyncSave` as soon as this rank's state is copied off
    the training tensors (its `wait()` returns the directory). The next save or load, and
    the program's exit, wait for it.
    """
    wait_for_pending_save(pmodel)
    path = Path(path)
    topology = pmodel.topology
    staging, extra_bytes = _open_staging(path, topology, extra)
    with topology.coordinator.body("save_checkpoint"):
        writer = _collect(pmodel, optimizer)  # copies: training may change the tensors from here on
        writer.add_raw("extra", torch.frombuffer(bytearray(extra_bytes), dtype=torch.uint8))
        groups = _group_names(pmodel, optimizer)
        meta, saved = _metadata(pmodel, optimizer) if topology.rank == 0 else (None, None)

    def finish(coordinator) -> Path:
        crcs = _write_rank_files(staging, writer, groups, topology, coordinator)
        meta_now = dict(meta, files={str(r): c for r, c in enumerate(crcs)}) if meta is not None else None
        _publish(path, staging, meta_now, saved, topology, coordinator)
        return staging.with_name(staging.name.removesuffix(".tmp"))

    if not async_:
        return finish(topology.coordinator)
    pmodel.pending_save = AsyncSave(finish, _saver_coordinator(pmodel))
    return pmodel.pending_save


class AsyncSave:
    """A save writing in the background: this rank's file, the ranks' agreement on it over
    their own process group (so it never interleaves with the training's collectives) and
    rank 0's publication. `wait()` returns the new version's directory or raises the
    save's `CheckpointError` (the same on every rank); the thread is not a daemon, so the
    program's exit waits for it too."""

    def __init__(self, finish: Callable[[Any], Path], coordinator):
        self._result: Path | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(finish, coordinator), name="shardwise-save")
        self._thread.start()

    def _run(self, finish: Callable[[Any], Path], coordinator) -> None:
        try:
            self._result = finish(coordinator)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
            self._error = exc

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> Path:
        self._thread.join()
        self.reported = True
        if self._error is not None:
            raise self._error
        return self._result

    reported = False  # whether `wait()` has handed out the outcome


def wait_for_pending_save(pmodel) -> None:
    """Finish `pmodel`'s asynchronous save, if one is writing; raise its error unless
    `wait()` already did."""
    pending, pmodel.pending_save = pmodel.pending_save, None
    if pending is not None and not pending.reported:
        pending.wait()
    elif pending is not None:
        pending._thread.join()


def _saver_coordinator(pmodel):
    """A coordinator over a process group only asynchronous saves use (made on the first,
    collectively: every rank is in that save_checkpoint call)."""
    if pmodel.save_coordinator is None:
        import torch.distributed as dist

        from ..coordination import Coordinator, control_backend
        from ..peer_watch import default_store

        topology = pmodel.topology
        group = dist.new_group(list(range(topology.world_size)), backend=control_backend(),
                               timeout=timedelta(seconds=topology.config.timeout_s))
        store = default_store()
        pmodel.save_coordinator = Coordinator(group, topology.config.timeout_s,
                                              dist.PrefixStore("shardwise/saver/", store) if store is not None else None)
    return pmodel.save_coordinator


def _open_staging(path: Path, topology, extra: Any) -> tuple[Path, bytes]:
    """Agree on the new version's staging directory, which rank 0 creates, and return it with
    this rank's `extra` pickled (checked first, so nothing is created for a save that cannot
    complete)."""
    staging, problem, extra_bytes = None, None, b""
    token = uuid.uuid4().int >> 72  # 56 bits: rank 0's names the version
    try:
        extra_bytes = to_safe_bytes(extra, f"save_checkpoint's extra on rank {topology.rank}")
    except CheckpointError as exc:
        problem = exc
    if topology.rank == 0 and problem is None:
        staging = path / f"v-{token:014x}.tmp"
        problem = _attempt(lambda: staging.mkdir(parents=True), f"cannot create checkpoint directory {str(staging)!r}")
    try:
        agreement = topology.coordinator.agree("save_checkpoint", problem, value=token, every_value=True)
    except CheckpointError:
        if staging is not None:
            _discard(topology, staging)
        raise
    return path / f"v-{agreement.values()[0]:014x}.tmp", extra_bytes


def _write_rank_files(staging: Path, writer: RankWriter, groups: list[list[str]], topology, coordinator) -> list[int]:
    """Every rank writes what it owns into `staging`; returns each rank's index CRC-32."""
    problem, crc = None, 0
    if not staging.is_dir():
        problem = CheckpointError(f"rank {topology.rank} does not see {str(staging)!r}, which rank 0 created: "
                                  "checkpoints need a directory every rank shares (a shared filesystem)")
    if problem is None:
        crc_box = []
        problem = _attempt(lambda: crc_box.append(writer.write(staging, topology.rank, {"groups": groups})),
                           f"cannot write rank {topology.rank}'s checkpoint file in {str(staging)!r}")
        crc = crc_box[0] if crc_box else 0
    try:
        return coordinator.agree("save_checkpoint/write", problem, value=crc, every_value=True).values()
    except CheckpointError:
        _discard(topology, staging)
        raise


def _metadata(pmodel, optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """shardwise.json's content (the files' checksums added once written) and meta.pt's."""
    topology = pmodel.topology
    meta = {
        "format": FORMAT, "world_size": topology.world_size, "layout": topology.sizes,
        "config": {k: str(v) for k, v in vars(pmodel.config).items()}, "plan": pmodel.plan.to_dict(),
        "steps": pmodel.steps, "state_keys": list(pmodel.index.state_shapes), "aliases": pmodel.index.aliases,
        "optimizer": optimizer is not None,
    }
    hyper = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups] \
        if optimizer else []
    scaler = getattr(optimizer, "loss_scaler", None)
    return meta, {"param_groups": hyper, "loss_scaler": scaler.state_dict() if scaler else None}


def _publish(path: Path, staging: Path, meta: dict | None, saved: dict | None, topology, coordinator) -> None:
    """Rank 0 seals the version and points LATEST at it; every rank learns whether it did."""
    problem = None
    if topology.rank == 0:
        problem = _attempt(lambda: publish(path, staging, meta, saved),
                           f"cannot publish the checkpoint in {str(path)!r}")
    try:
        coordinator.agree("save_checkpoint/publish", problem)
    except CheckpointError:
        _discard(topology, staging)
        raise


def _collect(pmodel, optimizer) -> RankWriter:
    """The regions this rank owns: model values, master weights, optimizer state, buffers, RNG."""
    topology = pmodel.topology
    writer = RankWriter()
    for name, piece in _pieces(pmodel):
        if not piece.owned:
            continue
        model, master = piece.model_values(), piece.optimized.reshape(-1) if piece.write_back is not None else None
        if piece.master_shard:  # saved as any layout saves it: the model's dtype, and the master beside
            master = piece.optimized.reshape(-1)
            model = master.to(local(piece.param).dtype)
        state = {k: local(v) if isinstance(v, torch.Tensor) else v
                 for k, v in (optimizer.state.get(piece.optimized, {}) if optimizer is not None else {}).items()}
        for g, a, b, rect, sub in _regions(pmodel, piece):
            writer.add(f"model/{name}", tuple(piece.param.shape), g, _part(model, a, b, rect, sub))
            if master is not None:
                writer.add(f"master/{name}", tuple(piece.param.shape), g, _part(master, a, b, rect, sub))
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.numel() == piece.end - piece.start and value.dim():
                    writer.add(f"optim/{name}/{key}", tuple(piece.param.shape), g, _part(value.reshape(-1), a, b, rect, sub))
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(f"optimizer state {key!r} of {name!r} is a {type(value).__name__}; "
                                      "shardwise checkpoints tensor state (torch.optim optimizers keep tensors)")
            if value.dim() == 0 and piece.start == 0:
                writer.add(f"optim/{name}/{key}", (), (), value)
    owner = all(topology.coordinates[d] == 0 for d in ("dp", "cp", "tp"))
    for name, buffer in _buffers(pmodel).items():
        if owner:
            writer.add(f"buffer/{name}", tuple(buffer.shape), tuple((0, s) for s in buffer.shape), buffer)
    writer.add_raw("rng/cpu", torch.get_rng_state())
    if torch.cuda.is_available():
        writer.add_raw("rng/cuda", torch.cuda.get_rng_state())
    return writer


def _attempt(action, what: str) -> CheckpointError | None:
    """Run a filesystem action; its failure as a CheckpointError naming `what` and the cause
    (chained), so every rank can be told and training can go on."""
    try:
        action()
    except CheckpointError as exc:
        return exc
    except OSError as exc:
        error = CheckpointError(f"{what}: {_os_reason(exc)}")
        error.__cause__ = exc
        return error
    except Exception as exc:  # noqa: BLE001 - a writer's own errors (safetensors' on a full disk)
        error = CheckpointError(f"{what}: {type(exc).__name__}: {exc}")
        error.__cause__ = exc
        return error
    return None


def _os_reason(exc: OSError) -> str:
    """An OSError's cause in words, with the fix for the common ones."""
    import errno

    hints = {errno.ENOSPC: "the disk is full: free space or save elsewhere",
             errno.EDQUOT: "the disk quota is exceeded: free space or save elsewhere",
             errno.EACCES: "permission denied: make the directory writable by this job",
             errno.EPERM: "permission denied: make the directory writable by this job",
             errno.EROFS: "the filesystem is read-only: save to a writable one"}
    return hints.get(exc.errno, exc.strerror or str(exc)) + (f" ({exc.filename})" if exc.filename else "")


def _discard(topology, staging: Path) -> None:
    """After a failed save: drop its staging directory (rank 0), leaving the previous version."""
    if topology.rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
