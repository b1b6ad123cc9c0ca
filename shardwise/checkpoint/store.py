"""The checkpoint on disk: versions published atomically, chunks in global coordinates.

    PATH/
      LATEST                      name of the newest complete version (replaced atomically)
      v-<id>/
        COMPLETE                  written last: the version is whole; holds shardwise.json's CRC-32
        shardwise.json            format, config, plan, layout, keys and their shapes, the
                                  CRC-32 of meta.pt and of every rank-<r>.json
        meta.pt                   optimizer hyper-parameters and the loss scale
        rank-<r>.safetensors      the chunks rank r owns (each tensor region written once), its
                                  random state and its `extra` (as bytes)
        rank-<r>.json             their index: key -> [(tensor name, rectangle, CRC-32 of its bytes)]

A save writes `v-<id>.tmp/`, renames it to `v-<id>/` once every rank has written, then
points LATEST at it with `os.replace`; a crash at any moment leaves LATEST on the previous
complete version. Older versions are then removed, but not another job's save in progress
(a staging directory written to within the hour) nor the version LATEST names. A load reads only the byte ranges it needs (safetensors slices); every
chunk's checksum is verified once (`Reader.validate`), so a flipped byte anywhere is refused
with the file and the tensor it belongs to, by load and merge alike.

Nothing read here can execute code: the checksums are plain data anyone who can write the
directory can recompute, so they guard against damage, not against an attacker. Pickled
objects (meta.pt, each rank's `extra`) are read with `torch.load(weights_only=True)`, whose
unpickler builds only tensors, numbers, strings and containers; the same check runs at save
time, so what a save accepts is what a load can read.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import time
import zlib
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..errors import CheckpointError
from ..progress import progress
from ..tensors import crc32
from .geometry import Rect, intersect, rect_shape, shift

FORMAT = 3  # 3: each rank's extra in its own file; meta.pt read with weights_only
LATEST, COMPLETE, META = "LATEST", "COMPLETE", "shardwise.json"


class RankWriter:
    """The chunks one rank owns, gathered in memory and written as one file."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.index: dict[str, list] = {}
        self.keys: dict[str, dict[str, Any]] = {}  # key -> {"shape", "dtype"} of the whole tensor
        self.raw: dict[str, int] = {}  # per-rank tensors outside the index (random states) -> CRC-32

    def add(self, key: str, shape: tuple[int, ...], rect: Rect, tensor: torch.Tensor) -> None:
        name = f"t{len(self.tensors)}"
        chunk = tensor.detach().to("cpu", copy=True).contiguous().reshape(rect_shape(rect))
        self.tensors[name] = chunk
        self.index.setdefault(key, []).append([name, [list(span) for span in rect], crc32(chunk)])
        self.keys[key] = {"shape": list(shape), "dtype": str(tensor.dtype).replace("torch.", "")}

    def add_raw(self, name: str, tensor: torch.Tensor) -> None:
        """A tensor of this rank only (its random state), stored under `name` with its checksum."""
        self.tensors[name] = tensor.detach().to("cpu", copy=True).contiguous()
        self.raw[name] = crc32(self.tensors[name])

    def write(self, directory: Path, rank: int, extra: dict[str, Any]) -> int:
        """Write this rank's two files; returns the CRC-32 of its index (rank-<r>.json)."""
        target = directory / f"rank-{rank}.safetensors"
        save_file(self.tensors, str(target) + ".part")
        os.replace(str(target) + ".part", target)
        text = json.dumps({"index": self.index, "keys": self.keys, "raw": self.raw, **extra})
        (directory / f"rank-{rank}.json").write_text(text)
        return zlib.crc32(text.encode())


def to_safe_bytes(value: Any, what: str) -> bytes:
    """`value` pickled, or a CheckpointError if a weights_only load could not read it back."""
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
        from_safe_bytes(buffer.getvalue(), what)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - pickling any object can fail in any way
        raise CheckpointError(f"{what} cannot be saved ({type(exc).__name__}: {exc})") from exc
    return buffer.getvalue()


def from_safe_bytes(data: bytes, what: str) -> Any:
    """Unpickle with torch's weights_only loader: only tensors, numbers, strings and containers."""
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - the unpickler refuses in many ways
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{what} holds something other than tensors, numbers, strings, lists and dicts, which "
                              f"a checkpoint may not contain (they could run code when loaded): {first}. Keep to "
                              "those types, e.g. store a class's state_dict() rather than the object") from exc


def latest(path: Path) -> Path:
    """The newest complete version under `path`; `CheckpointError` if there is none."""
    pointer = path / LATEST
    if not pointer.is_file():
        partial = sorted(p.name for p in path.glob("v-*.tmp")) if path.is_dir() else []
        raise CheckpointError(
            f"no complete checkpoint at {str(path)!r}"
            + (f": only interrupted saves ({', '.join(partial)})" if partial else " (no LATEST file)")
        )
    version = path / pointer.read_text().strip()
    if not (version / COMPLETE).is_file():
        raise CheckpointError(f"checkpoint {str(version)!r} is incomplete: it has no {COMPLETE} marker")
    return version


def publish(path: Path, staging: Path, meta: dict[str, Any], saved: dict[str, Any]) -> Path:
    """Seal a fully written staging directory and make it the latest version (rank 0 only).

    `meta["files"]` holds every rank index's CRC-32; meta.pt's is added here, and
    shardwise.json's goes into COMPLETE, so every byte of the version is covered."""
    (staging / "meta.pt").write_bytes(to_safe_bytes(saved, "the optimizer's hyper-parameters"))
    meta = dict(meta, meta_crc=zlib.crc32((staging / "meta.pt").read_bytes()))
    text = json.dumps(meta, indent=1)
    (staging / META).write_text(text)
    (staging / COMPLETE).write_text(f"complete {zlib.crc32(text.encode())}\n")
    final = staging.with_name(staging.name.removesuffix(".tmp"))
    os.rename(staging, final)
    pointer = path / (LATEST + ".tmp")
    pointer.write_text(final.name)
    os.replace(pointer, path / LATEST)
    _remove_superseded(path, final)
    return final


STALE_S = 3600.0  # a staging directory untouched this long belongs to a save that died


def _remove_superseded(path: Path, final: Path) -> None:
    """Drop earlier versions and interrupted saves, but not what another job saving into the
    same directory is using: the version LATEST names now, or a staging directory recently
    written to."""
    try:
        current = (path / LATEST).read_text().strip()
    except OSError:
        current = final.name
    for old in path.glob("v-*"):
        if old == final or old.name == current:
            continue
        try:
            if old.name.endswith(".tmp") and time.time() - old.stat().st_mtime < STALE_S:
                continue
        except OSError:  # removed meanwhile
            continue
        shutil.rmtree(old, ignore_errors=True)


def _complete_crc(version: Path) -> int:
    """The checksum of shardwise.json that the COMPLETE marker holds."""
    try:
        text = (version / COMPLETE).read_text().split()
        return int(text[1])
    except (OSError, IndexError, ValueError):
        raise CheckpointError(f"checkpoint {str(version)!r} is incomplete or corrupt: its {COMPLETE} marker is "
                              "missing or unreadable") from None


class Reader:
    """Reads any rectangle of any key from a complete version."""

    def __init__(self, version: Path):
        self.version = version
        self.meta = json.loads(self._verified(META, _complete_crc(version)))
        if self.meta.get("format") != FORMAT:
            raise CheckpointError(f"checkpoint {str(version)!r} has format {self.meta.get('format')}, this shardwise "
                                  f"reads {FORMAT}; it was written by another version of shardwise")
        try:
            self._verified("meta.pt", self.meta["meta_crc"])
            self.saved = from_safe_bytes((version / "meta.pt").read_bytes(), f"checkpoint {str(version)!r}: meta.pt")
        except (OSError, KeyError) as exc:
            raise CheckpointError(f"checkpoint {str(version)!r} is corrupt: cannot read meta.pt ({exc})") from None
        self.chunks: dict[str, list[tuple[int, str, Rect, int]]] = {}
        self.keys: dict[str, dict[str, Any]] = {}
        self.ranks: dict[int, dict[str, Any]] = {}
        self._files: dict[int, Any] = {}
        for rank in range(self.meta["world_size"]):
            entry = json.loads(self._verified(f"rank-{rank}.json", self.meta["files"][str(rank)]))
            self.ranks[rank] = entry
            self.keys.update(entry["keys"])
            for key, items in entry["index"].items():
                self.chunks.setdefault(key, []).extend((rank, name, tuple(map(tuple, rect)), crc)
                                                       for name, rect, crc in items)

    def _verified(self, name: str, expected: int) -> str:
        """The text of one of the version's small files, after checking its CRC-32."""
        try:
            data = (self.version / name).read_bytes()
        except OSError as exc:
            raise CheckpointError(f"checkpoint {str(self.version)!r} is corrupt or incomplete: cannot read {name} "
                                  f"({exc.strerror or exc})") from None
        if zlib.crc32(data) != expected:
            raise CheckpointError(f"checkpoint {str(self.version)!r} is corrupt: {name} does not match its checksum "
                                  "(the file was changed or damaged after it was written)")
        return data.decode(errors="replace")

    def _file(self, rank: int):
        if rank not in self._files:
            path = self.version / f"rank-{rank}.safetensors"
            try:
                self._files[rank] = safe_open(str(path), framework="pt")
            except (OSError, SafetensorError) as exc:
                raise CheckpointError(f"checkpoint file {str(path)!r} is corrupt or missing: {exc}") from None
        return self._files[rank]

    def read(self, key: str, rect: Rect) -> torch.Tensor:
        """The values of `key` inside `rect` (global coordinates), assembled from its chunks."""
        if key not in self.chunks:
            raise CheckpointError(f"checkpoint {str(self.version)!r} has no {key!r}")
        dtype = getattr(torch, self.keys[key]["dtype"])
        out = torch.empty(rect_shape(rect), dtype=dtype)
        covered = 0
        for rank, name, chunk, _ in self.chunks[key]:
            overlap = intersect(chunk, rect) if rect else chunk
            if overlap is None:
                continue
            try:
                if overlap:
                    piece = self._file(rank).get_slice(name)[shift(overlap, chunk)]
                else:
                    piece = self._file(rank).get_tensor(name)
            except (SafetensorError, RuntimeError) as exc:
                raise CheckpointError(f"checkpoint {str(self.version)!r}: chunk {name} of {key!r} in rank-{rank} "
                                      f"cannot be read ({exc})") from None
            out[shift(overlap, rect)] = piece
            covered += piece.numel()
            if not rect:
                break
        if covered != out.numel():
            raise CheckpointError(f"checkpoint {str(self.version)!r} is missing part of {key!r} "
                                  f"({covered} of {out.numel()} elements of {rect})")
        return out

    def validate(self, ranks) -> None:
        """Read the given ranks' files whole and check every chunk against its checksum."""
        ranks = list(ranks)
        for rank in progress(ranks, "checking checkpoint files", unit="file"):
            where = f"checkpoint file rank-{rank}.safetensors in {str(self.version)!r}"
            items = [(key, name, crc) for key, entries in self.ranks[rank]["index"].items() for name, _, crc in entries]
            items += [(name, name, crc) for name, crc in self.ranks[rank]["raw"].items()]
            present = set(self._file(rank).keys())
            missing = sorted({name for _, name, _ in items} - present)
            if missing:
                raise CheckpointError(f"{where} is corrupt: it lacks {missing[:4]}")
            for key, name, crc in items:
                try:
                    data = self._file(rank).get_tensor(name)
                except (SafetensorError, RuntimeError) as exc:
                    raise CheckpointError(f"{where} is corrupt: chunk {name} of {key!r} cannot be read ({exc})") from None
                if crc32(data) != crc:
                    raise CheckpointError(f"{where} is corrupt: chunk {name} of {key!r} does not match its checksum "
                                          "(the file was changed or damaged after it was written)")

    def extra(self, rank: int, world_size: int) -> Any:
        """The `extra` that saving rank `rank` passed; across a change of world size, the one every
        saving rank passed (a CheckpointError if they differed, since no rank's is the right one)."""
        blobs = [self.rank_tensor(r, "extra") for r in range(self.meta["world_size"])]
        if world_size != self.meta["world_size"]:
            if any(not torch.equal(b, blobs[0]) for b in blobs[1:]):
                raise CheckpointError(
                    f"checkpoint {str(self.version)!r} holds a different `extra` per rank from "
                    f"{self.meta['world_size']} ranks and this run has {world_size}: no rank's is the right one. "
                    "Load with the saving world size, or save an `extra` that is the same on every rank")
            rank = 0
        return from_safe_bytes(blobs[rank].numpy().tobytes(), f"checkpoint {str(self.version)!r}: rank {rank}'s extra")

    def rank_tensor(self, rank: int, name: str) -> torch.Tensor | None:
        """A tensor stored with `RankWriter.add_raw` by `rank` (validated), or None."""
        if name not in self.ranks[rank]["raw"]:
            return None
        return self._file(rank).get_tensor(name)
