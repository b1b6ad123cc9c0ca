"""Checkpoints: sharded save (save.py) and resume, loading into any layout, merging to one
file; Hugging Face weights in and out (pretrained.py); torch.distributed.checkpoint (dcp.py).

`save_checkpoint` has every rank write only the regions it owns, once: the owner of an
element is the rank that counts it in the global gradient norm (`ParamPiece.owned`), so a
tensor replicated over data-parallel ranks is written by one of them and ZeRO shards by the
rank holding them. Regions are stored in global coordinates (`geometry.py`), which makes
`load_checkpoint` independent of the saving run's layout: any dp/tp/pp/zero and world size
reads the rectangles it needs. Model values, float32 master weights, optimizer state,
buffers, step counters, random states, the plan and the config are saved; resuming with
the same layout continues bit for bit. `merge_checkpoint` writes one plain state dict.

Why not torch.distributed.checkpoint: it reshards DTensors, but ZeRO shards here are flat
ranges of bucket buffers that cross parameter boundaries; describing them to DCP needs the
deprecated ShardedTensor with a collective per parameter, or gathering optimizer state
before saving, which defeats ZeRO's memory savings.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..errors import CheckpointError
from ..progress import progress
from ..state import check_state_dict
from ..tensors import local
from .regions import _buffers, _group_names, _part, _pieces, _regions, scalar_state_devices
from .save import AsyncSave, _attempt, save_checkpoint, wait_for_pending_save
from .store import Reader, latest

__all__ = ["AsyncSave", "export_pretrained", "save_checkpoint", "load_checkpoint", "merge_checkpoint", "load_pretrained", "save_pretrained"]


def load_checkpoint(path: str | Path, pmodel, optimizer=None) -> Any:
    """Load a checkpoint saved in any layout into `pmodel` (and `optimizer`); returns `extra`.

    Collective. `path` may also be a plain state dict file (.safetensors or .pt), e.g. one
    written by `merge_checkpoint` or by a single-process run. Everything is read and checked
    (every chunk against its checksum, by one rank each) before anything is changed, and the
    ranks agree: a checkpoint that is bad on any rank, or missing from one rank's disk, is
    the same `CheckpointError` on every rank and changes nothing.
    """
    wait_for_pending_save(pmodel)
    path = Path(path)
    topology = pmodel.topology
    if path.is_file():
        state, optimizer_state, problem = None, None, None
        beside = path.with_name(path.name + ".optimizer.pt")
        try:
            state = _read_state_dict(path)
            check_state_dict(pmodel, state, strict=True)  # another model's file: that, before its optimizer
            if optimizer is not None:
                if not beside.is_file():
                    raise CheckpointError(f"{str(path)!r} is a merged state dict with no optimizer state beside it "
                                          f"({str(beside)!r}): merge with --optimizer, or load with optimizer=None")
                optimizer_state = _read_state_dict(beside)
        except CheckpointError as exc:
            problem = exc
        topology.coordinator.agree("load_checkpoint", problem)
        if optimizer is not None:  # checked on every rank before it changes; the model's file is checked already
            optimizer.load_full_state_dict(optimizer_state)
        pmodel.load_full_state_dict(state)
        return None
    staged: list[tuple[torch.Tensor, torch.Tensor]] = []
    states: dict[int, tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}
    reader, problem, version = None, None, None
    try:
        version = latest(path)
        reader = Reader(version)
        _check_same_model(reader, pmodel, optimizer)
        reader.validate(range(topology.rank, reader.meta["world_size"], topology.world_size))  # each file, by one rank
        _stage(reader, pmodel, optimizer, staged, states)
        extra = reader.extra(topology.rank, topology.world_size)
    except CheckpointError as exc:
        problem = _superseded(path, version) or exc
    topology.coordinator.agree("load_checkpoint", problem)

    with topology.coordinator.body("load_checkpoint"), torch.no_grad():  # commit: every rank has what it needs
        _commit(pmodel, staged)
        if optimizer is not None:
            for master, state in states.values():
                optimizer.state[master] = state
            for group, saved in zip(optimizer.param_groups, reader.saved["param_groups"]):
                group.update(saved)
            if reader.saved.get("loss_scaler") and getattr(optimizer, "loss_scaler", None) is not None:
                optimizer.loss_scaler.load_state_dict(reader.saved["loss_scaler"])
        pmodel.steps = reader.meta["steps"]
        if reader.meta["world_size"] == topology.world_size and reader.meta["layout"] == topology.sizes:
            _restore_rng(reader, topology.rank)  # same layout: continue bit for bit
    return extra


def load_pretrained(pmodel, path: str | Path) -> None:
    """Load Hugging Face weights (a `save_pretrained` directory, sharded or not, or one
    .safetensors / .bin file) into `pmodel`, whatever its layout; each rank reads only its own
    shards' byte ranges (pretrained.py) straight into its parameters. Collective; files, keys
    and shapes are checked on every rank before anything changes, so a missing key or a shape
    that does not match is the same `CheckpointError` everywhere; bytes that fail while read
    are one too, the parameters then partly loaded."""
    from .pretrained import pretrained_reader

    staged: list[tuple[torch.Tensor, torch.Tensor]] = []
    problem, reader = None, None
    try:
        reader = pretrained_reader(pmodel, path)  # files, keys and shapes: nothing read yet
    except CheckpointError as exc:
        problem = exc
    pmodel.topology.coordinator.agree("load_pretrained/check", problem)
    try:  # in place: pretrained weights usually initialize a deferred model, whose shards are all it may hold
        with torch.no_grad():
            _stage(reader, pmodel, None, staged, {}, in_place=True)
    except CheckpointError as exc:
        problem = CheckpointError(f"{exc}; the parameters are partly loaded: load them again before training")
    pmodel.topology.coordinator.agree("load_pretrained", problem)
    with pmodel.topology.coordinator.body("load_pretrained"), torch.no_grad():
        _commit(pmodel, staged)


def save_pretrained(pmodel, directory: str | Path, dtype: torch.dtype | None = None,
                    max_shard_size: str = "5GB") -> Path:
    """Write the Hugging Face model inside `pmodel` as `from_pretrained` reads it: config.json,
    safetensors shards with their index, the model's own key names (the wrapper's prefix
    dropped), in `dtype` if given. Collective: the parameters are gathered whole
    (`full_state_dict`) and rank 0 writes them with transformers' own writer; a failure is
    the same `CheckpointError` on every rank. Returns the directory."""
    from .pretrained import hugging_face_model, write_pretrained

    directory = Path(directory)
    problem, found = None, None
    try:
        found = hugging_face_model(pmodel.module)
    except CheckpointError as exc:
        problem = exc
    pmodel.topology.coordinator.agree("save_pretrained", problem)
    state = pmodel.full_state_dict()
    problem = None
    if pmodel.topology.rank == 0:
        problem = _attempt(lambda: write_pretrained(found[1], found[0], state, directory, dtype, max_shard_size),
                           f"cannot write the Hugging Face model to {str(directory)!r}")
    pmodel.topology.coordinator.agree("save_pretrained/write", problem)
    return directory


def _commit(pmodel, staged: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy staged values into the model's tensors; ZeRO's whole parameters from the shards."""
    for target, value in staged:
        target.copy_(value.to(target.device, target.dtype))
    pmodel.optimizer_params.write_back()


def _superseded(path: Path, version: Path | None) -> CheckpointError | None:
    """A load whose version disappeared while it read: a save since then replaced it (it is
    not corrupt); None if that is not what happened."""
    if version is None or version.exists():
        return None
    try:
        now = latest(path)
    except CheckpointError:
        return None
    return CheckpointError(f"checkpoint {str(version)!r} was replaced by a newer save ({now.name}) while it was being "
                           "loaded (another job or process saves into this directory); load again")


def _stage(reader: Reader, pmodel, optimizer, staged: list, states: dict, in_place: bool = False) -> None:
    """Read every value this rank will load, without changing anything yet; `in_place` reads
    parameters straight into the model's tensors (no second copy of this rank's shards)."""
    steps_on = scalar_state_devices(optimizer, reader.saved["param_groups"], pmodel.topology.device) \
        if optimizer is not None else {}
    for name, piece in _pieces(pmodel):
        model = piece.model_values()
        value, master = model if in_place else torch.empty_like(model), None
        if piece.write_back is not None:
            master = piece.optimized.reshape(-1) if in_place else torch.empty_like(piece.optimized.reshape(-1))
        optim_keys = [k for k in reader.keys if k.startswith(f"optim/{name}/")] if optimizer is not None else []
        state = {k.rsplit("/", 1)[1]: torch.empty(piece.end - piece.start, dtype=getattr(torch, reader.keys[k]["dtype"]),
                                                  device=model.device)
                 for k in optim_keys if reader.keys[k]["shape"]}
        # a float32 master that is the model's only copy (ZeRO-3) loads the saved master where there is one
        values = f"master/{name}" if piece.master_shard and f"master/{name}" in reader.keys else f"model/{name}"
        for g, a, b, rect, sub in _regions(pmodel, piece):
            _part(value, a, b, rect, sub).copy_(reader.read(values, g))
            if master is not None:
                source = f"master/{name}" if f"master/{name}" in reader.keys else f"model/{name}"
                _part(master, a, b, rect, sub).copy_(reader.read(source, g))
            for key, tensor in state.items():
                _part(tensor, a, b, rect, sub).copy_(reader.read(f"optim/{name}/{key}", g))
        if not in_place:
            staged.append((model, value))
        if master is not None and not in_place:
            staged.append((piece.optimized.reshape(-1), master))
        if optimizer is not None:
            scalars = {key: reader.read(k, ()).to(steps_on.get(id(piece.optimized), model.device) if key == "step"
                                                  else model.device)
                       for k in optim_keys if not reader.keys[k]["shape"] for key in [k.rsplit("/", 1)[1]]}
            states[id(piece.optimized)] = (piece.optimized, {**{k: _like(piece.optimized, v) for k, v in state.items()},
                                                       **scalars})
    for name, buffer in _buffers(pmodel).items():
        staged.append((buffer, reader.read(f"buffer/{name}", tuple((0, s) for s in buffer.shape))))


def _like(master: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """Optimizer state shaped like `master`: a DTensor with its layout if the master is one."""
    if isinstance(master, DTensor):
        return DTensor.from_local(flat.view(local(master).shape), master.device_mesh, master.placements,
                                  run_check=False, shape=master.shape, stride=master.stride())
    return flat.view(master.shape)


def _check_same_model(reader: Reader, pmodel, optimizer) -> None:
    expected = {k: shape for k, shape in pmodel.index.state_shapes.items() if pmodel.index.canonical(k) == k}
    found = {k.split("/", 1)[1]: tuple(v["shape"]) for k, v in reader.keys.items() if k.startswith(("model/", "buffer/"))}
    missing, unexpected = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {str(reader.version)!r} is from another model: missing {missing[:6]}, "
                              f"unexpected {unexpected[:6]}")
    wrong = [f"{k}: {found[k]} vs {expected[k]}" for k in expected if tuple(expected[k]) != found[k]]
    if wrong:
        raise CheckpointError(f"checkpoint {str(reader.version)!r} is from another model: shapes differ ({wrong[:4]})")
    if optimizer is not None and not reader.meta["optimizer"]:
        raise CheckpointError(f"checkpoint {str(reader.version)!r} has no optimizer state; load it with optimizer=None")
    if optimizer is not None:
        _check_same_groups(reader, _group_names(pmodel, optimizer))


def _check_same_groups(reader: Reader, groups: list[list[str]]) -> None:
    """The optimizer's parameter groups hold the parameters they held when saved (as torch's
    own `load_state_dict` insists): hyper-parameters are restored group by group."""
    saved = len(reader.saved["param_groups"])
    if saved != len(groups):
        raise CheckpointError(f"checkpoint {str(reader.version)!r} was saved with {saved} optimizer parameter "
                              f"group(s) and this optimizer has {len(groups)}: build the optimizer with the same "
                              "groups, or load with optimizer=None")
    for i, names in enumerate(groups):
        held = {n for entry in reader.ranks.values() for n in entry["groups"][i]}
        moved = sorted(set(names) - held)
        if moved:
            raise CheckpointError(f"checkpoint {str(reader.version)!r}: optimizer parameter group {i} now holds "
                                  f"{moved[:4]}, which were in another group when saved; build the optimizer "
                                  "with the same groups, or load with optimizer=None")


def _restore_rng(reader: Reader, rank: int) -> None:
    cpu = reader.rank_tensor(rank, "rng/cpu")
    if cpu is not None:
        torch.set_rng_state(cpu)
    cuda = reader.rank_tensor(rank, "rng/cuda")
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda)


def _read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(path))
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any reader failure is a bad file
        raise CheckpointError(f"{str(path)!r} is not a readable state dict: {exc}") from None


def merge_checkpoint(path: str | Path, out: str | Path, optimizer: bool = False) -> Path:
    """Write the checkpoint at `path` as one plain state dict `out` (.safetensors or .pt),
    loadable by the original module with `load_state_dict(strict=True)`. One process, no
    GPU. With `optimizer=True`, also `<out>.optimizer.pt`: a torch optimizer state dict for
    an optimizer over `module.parameters()` with the saving run's parameter groups.

    Checks what `load_checkpoint` checks (every chunk against its checksum) before writing."""
    out = Path(out)
    if out.suffix not in (".safetensors", ".pt"):
        raise CheckpointError(f"merge output {str(out)!r} must end in .safetensors or .pt")
    if not out.parent.is_dir():
        raise CheckpointError(f"merge output directory {str(out.parent)!r} does not exist; create it first")
    reader = Reader(latest(Path(path)))
    reader.validate(range(reader.meta["world_size"]))
    if optimizer and not reader.meta["optimizer"]:
        raise CheckpointError(f"checkpoint {str(reader.version)!r} has no optimizer state to merge; "
                              "merge without --optimizer")
    state = _merged_state(reader)
    merged_optimizer = _merged_optimizer(reader) if optimizer else None

    def write() -> None:
        if out.suffix == ".safetensors":
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in state.items()}, str(out) + ".part")
        else:
            torch.save(state, str(out) + ".part")
        os.replace(str(out) + ".part", out)
        if merged_optimizer is not None:
            torch.save(merged_optimizer, out.with_name(out.name + ".optimizer.pt"))

    problem = _attempt(write, f"cannot write {str(out)!r}")
    if problem is not None:
        raise problem
    return out


def _merged_state(reader: Reader) -> dict[str, torch.Tensor]:
    """The whole model's state dict from a validated checkpoint, float32 masters preferred."""
    meta, state = reader.meta, {}
    for key in progress(meta["state_keys"], "merging tensors", unit="tensor"):
        canonical = meta["aliases"].get(key, key)
        source = next((f"{kind}/{canonical}" for kind in ("master", "model", "buffer")
                       if f"{kind}/{canonical}" in reader.keys), None)
        if source is None:
            raise CheckpointError(f"checkpoint {str(reader.version)!r} has no values for {key!r}")
        shape = reader.keys[source]["shape"]
        state[key] = reader.read(source, tuple((0, s) for s in shape)).clone()
    return state


def export_pretrained(path: str | Path, out: str | Path, module: torch.nn.Module,
                      dtype: torch.dtype | None = None) -> Path:
    """Write the checkpoint at `path` as a Hugging Face directory `out` (`from_pretrained`
    reads it), for `module`, the model it was saved from (its Hugging Face part gives config
    and key names; it may be on the meta device). One process, no GPU."""
    from .pretrained import hugging_face_model, write_pretrained

    reader = Reader(latest(Path(path)))
    reader.validate(range(reader.meta["world_size"]))
    prefix, hf_model = hugging_face_model(module)
    state = _merged_state(reader)
    problem = _attempt(lambda: write_pretrained(hf_model, prefix, state, Path(out), dtype, "5GB"),
                       f"cannot write the Hugging Face model to {str(out)!r}")
    if problem is not None:
        raise problem
    return Path(out)


def _merged_optimizer(reader: Reader) -> dict[str, Any]:
    if not reader.meta["optimizer"]:
        raise CheckpointError(f"checkpoint {str(reader.version)!r} has no optimizer state to merge")
    order = {n: i for i, n in enumerate(reader.meta["state_keys"])}
    hyper = reader.saved["param_groups"]
    members = [sorted({n for r in reader.ranks.values() for n in r["groups"][i]}, key=order.get) for i in range(len(hyper))]
    state, groups, index = {}, [], 0
    for group, names in zip(hyper, members):
        ids = []
        for name in names:
            entry = {}
            for key in [k for k in reader.keys if k.startswith(f"optim/{name}/")]:
                shape = reader.keys[key]["shape"]
                entry[key.rsplit("/", 1)[1]] = reader.read(key, tuple((0, s) for s in shape)).clone()
            if entry:
                state[index] = entry
            ids.append(index)
            index += 1
        groups.append({**group, "params": ids})
    return {"state": state, "param_groups": groups}
