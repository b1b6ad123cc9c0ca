"""The checkpoint on disk: versions published atomically, chunks in global coordinates.

    PATH/
      LATEST                      name of the newest complete version (replaced atomically)
      v-<id>/
        COMPLETE                  written last: the version is whole
        shardwise.json            format, config, plan, layout, keys and their shapes
        meta.pt                   optimizer hyper-parameters and the caller's `extra`
        rank-<r>.safetensors      the chunks rank r owns (each tensor region written once)
        rank-<r>.json             their index: key -> [(tensor name, rectangle)]

A save writes `v-<id>.tmp/`, renames it to `v-<id>/` once every rank has written, then
points LATEST at it with `os.replace`; a crash at any moment leaves LATEST on the previous
complete version. A load reads only the byte ranges it needs (safetensors slices).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..errors import CheckpointError
from .geometry import Rect, intersect, rect_shape, shift

FORMAT = 1
LATEST, COMPLETE, META = "LATEST", "COMPLETE", "shardwise.json"


class RankWriter:
    """The chunks one rank owns, gathered in memory and written as one file."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.index: dict[str, list] = {}
        self.keys: dict[str, dict[str, Any]] = {}  # key -> {"shape", "dtype"} of the whole tensor

    def add(self, key: str, shape: tuple[int, ...], rect: Rect, tensor: torch.Tensor) -> None:
        name = f"t{len(self.tensors)}"
        self.tensors[name] = tensor.detach().to("cpu", copy=True).contiguous().reshape(rect_shape(rect))
        self.index.setdefault(key, []).append([name, [list(span) for span in rect]])
        self.keys[key] = {"shape": list(shape), "dtype": str(tensor.dtype).replace("torch.", "")}

    def write(self, directory: Path, rank: int, extra: dict[str, Any]) -> None:
        target = directory / f"rank-{rank}.safetensors"
        save_file(self.tensors, str(target) + ".part")
        os.replace(str(target) + ".part", target)
        (directory / f"rank-{rank}.json").write_text(json.dumps({"index": self.index, "keys": self.keys, **extra}))


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
    """Seal a fully written staging directory and make it the latest version (rank 0 only)."""
    (staging / META).write_text(json.dumps(meta, indent=1))
    torch.save(saved, staging / "meta.pt")
    (staging / COMPLETE).write_text("complete\n")
    final = staging.with_name(staging.name.removesuffix(".tmp"))
    os.rename(staging, final)
    pointer = path / (LATEST + ".tmp")
    pointer.write_text(final.name)
    os.replace(pointer, path / LATEST)
    for old in path.glob("v-*"):  # earlier versions and interrupted saves
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


class Reader:
    """Reads any rectangle of any key from a complete version."""

    def __init__(self, version: Path):
        self.version = version
        try:
            self.meta = json.loads((version / META).read_text())
            self.saved = torch.load(version / "meta.pt", weights_only=False)
        except (OSError, ValueError, RuntimeError) as exc:
            raise CheckpointError(f"checkpoint {str(version)!r} is corrupt: cannot read its metadata ({exc})") from None
        if self.meta.get("format") != FORMAT:
            raise CheckpointError(f"checkpoint {str(version)!r} has format {self.meta.get('format')}, this shardwise reads {FORMAT}")
        self.chunks: dict[str, list[tuple[int, str, Rect]]] = {}
        self.keys: dict[str, dict[str, Any]] = {}
        self.ranks: dict[int, dict[str, Any]] = {}
        self._files: dict[int, Any] = {}
        for rank in range(self.meta["world_size"]):
            try:
                entry = json.loads((version / f"rank-{rank}.json").read_text())
            except (OSError, ValueError) as exc:
                raise CheckpointError(f"checkpoint {str(version)!r} is corrupt: rank-{rank}.json ({exc})") from None
            self.ranks[rank] = entry
            self.keys.update(entry["keys"])
            for key, items in entry["index"].items():
                self.chunks.setdefault(key, []).extend((rank, name, tuple(map(tuple, rect))) for name, rect in items)

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
        for rank, name, chunk in self.chunks[key]:
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
        """Open the given ranks' files and check that every tensor their index names is there."""
        for rank in ranks:
            names = {name for items in self.ranks[rank]["index"].values() for name, _ in items}
            present = set(self._file(rank).keys())
            if not names <= present:
                raise CheckpointError(f"checkpoint file rank-{rank}.safetensors in {str(self.version)!r} is corrupt: "
                                      f"it lacks {sorted(names - present)[:4]}")

    def rank_tensor(self, rank: int, name: str) -> torch.Tensor | None:
        try:
            return self._file(rank).get_tensor(name)
        except (SafetensorError, CheckpointError):
            return None
