"""Hugging Face weights into any layout, `load_pretrained(pmodel, path)`, and out of it,
`save_pretrained(pmodel, directory)`.

`path` is what `save_pretrained` writes (a directory with `model.safetensors`, or shards and
`model.safetensors.index.json`; `pytorch_model.bin` and its index too) or one `.safetensors`
/ `.bin` file. The checkpoint's keys are the Hugging Face model's own; they are found inside
the user's module by where the `PreTrainedModel` sits (`lm.` in an end2end wrapper), with
the base model's prefix added or dropped when the file was saved from the other class
(`model.layers.0...` vs `layers.0...`), and tied parameters read once. Mixture-of-experts
checkpoints keep one tensor per expert and projection (Mixtral's `block_sparse_moe.experts.3.w1`,
Qwen-MoE's `mlp.experts.3.gate_proj`) where transformers 5 models hold grouped tensors
(`mlp.experts.gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`); a grouped tensor is read from
those pieces (`GroupedKey`), each rank reading only its experts, as transformers' own
conversion on load does.

Each rank reads only the rectangles of its own shards (safetensors slices, the same global
regions `load_checkpoint` reads), so with `sw.deferred_init` no rank holds more than its
shards plus one region in flight; `.bin` files are memory-mapped. Every rank checks the
files, keys and shapes first and the ranks agree, so a missing key or a shape that does not
match is the same `CheckpointError` on every rank, naming the file and the key, and nothing
changes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import SafetensorError, safe_open

from ..errors import CheckpointError

INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
SINGLE = ("model.safetensors", "pytorch_model.bin")


def weight_files(path: Path) -> dict[str, Path]:
    """Checkpoint key -> the file holding it, for a save_pretrained directory or one file."""
    if path.is_file():
        return {key: path for key in _open(path).keys()}
    if not path.is_dir():
        raise CheckpointError(f"{str(path)!r} does not exist: give a save_pretrained directory or a .safetensors / "
                              ".bin file")
    for name in INDEXES:
        index = path / name
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, OSError) as exc:
                raise CheckpointError(f"{str(index)!r} is not a Hugging Face index (no readable weight_map: {exc})") \
                    from None
            return {key: path / file for key, file in weight_map.items()}
    for name in SINGLE:
        if (path / name).is_file():
            return weight_files(path / name)
    raise CheckpointError(f"{str(path)!r} holds no Hugging Face weights: none of {', '.join(INDEXES + SINGLE)}")


class _File:
    """One weights file, opened once: its keys, shapes and rectangles."""

    def __init__(self, path: Path):
        self.path = path
        try:
            if path.suffix == ".safetensors":
                self._safe = safe_open(str(path), framework="pt")
                self._tensors = None
            else:
                self._safe = None
                self._tensors = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except (OSError, SafetensorError, RuntimeError, ValueError) as exc:
            raise CheckpointError(f"{str(path)!r} is not a readable weights file: {exc}") from None

    def keys(self) -> list[str]:
        return list(self._safe.keys()) if self._safe is not None else list(self._tensors)

    def shape(self, key: str) -> tuple[int, ...]:
        if self._safe is not None:
            return tuple(self._safe.get_slice(key).get_shape())
        return tuple(self._tensors[key].shape)

    def read(self, key: str, rect: tuple) -> torch.Tensor:
        index = tuple(slice(lo, hi) for lo, hi in rect)
        try:
            if self._safe is not None:
                return self._safe.get_slice(key)[index] if rect else self._safe.get_tensor(key)
            return self._tensors[key][index]
        except (SafetensorError, RuntimeError, KeyError, OSError) as exc:  # one rank's bad bytes: agreed, not raw
            raise CheckpointError(f"{str(self.path)!r}: {key!r} cannot be read ({exc})") from None


def _open(path: Path) -> _File:
    return _File(path)


# grouped expert tensor -> the per-expert projections it stacks, concatenated along their dim 0
EXPERT_PIECES = {"gate_up_proj": (("w1", "w3"), ("gate_proj", "up_proj")), "down_proj": (("w2",), ("down_proj",))}
MOE_BLOCK_NAMES = ((".mlp.", ".block_sparse_moe."),)  # transformers 5's name -> an original checkpoint's


class GroupedKey(tuple):
    """The checkpoint keys of a grouped expert tensor: for each expert, the pieces stacked
    along its dim 1 (that is, each piece's dim 0)."""


def _grouped_key(name: str, experts: int, files: dict[str, Path]) -> GroupedKey | None:
    """The per-expert keys holding grouped tensor `name` (a checkpoint-side name), if all exist."""
    block, _, leaf = name.rpartition(".experts.")
    if not block or leaf not in EXPERT_PIECES:
        return None
    for pieces in EXPERT_PIECES[leaf]:
        keys = GroupedKey(tuple(f"{block}.experts.{e}.{piece}.weight" for piece in pieces) for e in range(experts))
        if all(key in files for expert in keys for key in expert):
            return keys
    return None


class PretrainedReader:
    """`Reader`'s interface (`keys`, `read(key, rect)`) over Hugging Face files, keyed as
    shardwise's checkpoint is ("model/<name>", "buffer/<name>"), for `checkpoint._stage`."""

    def __init__(self, files: dict[str, Path], names: dict[str, str]):
        self.files = files  # checkpoint key -> file
        self.names = names  # "model/<name>" or "buffer/<name>" -> checkpoint key (or GroupedKey)
        self._opened: dict[Path, _File] = {}
        self.keys = {ours: {"shape": list(self.shape(theirs))} for ours, theirs in names.items()}

    def shape(self, theirs: str | GroupedKey) -> tuple[int, ...]:
        if not isinstance(theirs, GroupedKey):
            return self.file(theirs).shape(theirs)
        pieces = [self.file(key).shape(key) for key in theirs[0]]
        if any(self.file(key).shape(key) != self.file(first).shape(first) for expert in theirs
               for key, first in zip(expert, theirs[0])) or len({p[1:] for p in pieces}) != 1:
            raise CheckpointError(f"{str(self.files[theirs[0][0]])!r}: the experts' {[k.rsplit('.', 2)[-2] for k in theirs[0]]} "
                                  "projections differ in shape between experts; load weights of the same architecture")
        return (len(theirs), sum(p[0] for p in pieces), *pieces[0][1:])

    def file(self, key: str) -> _File:
        path = self.files[key]
        if path not in self._opened:
            self._opened[path] = _open(path)
        return self._opened[path]

    def read(self, key: str, rect: tuple) -> torch.Tensor:
        theirs = self.names[key]
        if not isinstance(theirs, GroupedKey):
            return self.file(theirs).read(theirs, rect)
        shape = self.keys[key]["shape"]
        (e0, e1), (r0, r1), *rest = rect or tuple((0, s) for s in shape)
        experts = []
        for expert in theirs[e0:e1]:
            parts, offset = [], 0
            for piece in expert:
                rows = self.file(piece).shape(piece)[0]
                lo, hi = max(r0, offset), min(r1, offset + rows)
                if lo < hi:
                    parts.append(self.file(piece).read(piece, ((lo - offset, hi - offset), *rest)))
                offset += rows
            experts.append(torch.cat(parts))
        return torch.stack(experts)


def match_names(pmodel, files: dict[str, Path]) -> dict[str, str]:
    """Our "model/<name>" / "buffer/<name>" -> the checkpoint's key, with the prefix that makes
    the most of them match; CheckpointError listing what is missing or unexpected."""
    ours = {name: ("buffer" if name not in pmodel.index.aliases else "model")
            for name in pmodel.index.state_shapes if pmodel.index.canonical(name) == name}
    aliases: dict[str, list[str]] = {}
    for alias, canonical in pmodel.index.aliases.items():
        aliases.setdefault(canonical, []).append(alias)
    best: dict[str, str | GroupedKey] = {}
    translations = _translations(pmodel.module)
    for translate in translations:
        found = {}
        for name in ours:
            for candidate in aliases.get(name, [name]):
                key = translate(candidate)
                grouped = _grouped_key(key, pmodel.index.state_shapes[name][0], files) \
                    if key is not None and key not in files else None
                if key is not None and (key in files or grouped is not None):
                    found[name] = grouped or key
                    break
        if len(found) > len(best):
            best = found
    missing = sorted(set(ours) - set(best))
    every_name = {translate(alias) for translate in translations for alias in pmodel.index.aliases}
    every_name |= {key for theirs in best.values() if isinstance(theirs, GroupedKey) for expert in theirs
                   for key in expert}
    unexpected = sorted(k for k in files if k not in every_name)  # a tied copy saved twice is expected
    if missing or unexpected:
        raise CheckpointError(f"the Hugging Face weights in {str(next(iter(files.values())).parent)!r} do not match "
                              f"{type(pmodel.module).__name__}: missing {missing[:6]} (of {len(missing)}), unexpected "
                              f"{unexpected[:6]} (of {len(unexpected)}); load weights of the same architecture")
    return {f"{ours[name]}/{name}": key for name, key in best.items()}


def _translations(module: torch.nn.Module) -> list[Callable[[str], str | None]]:
    """Ways our names may map to the checkpoint's: under each Hugging Face model in the module
    (its prefix stripped), with its base model prefix as saved or not, and as they are."""
    out: list[Callable[[str], str | None]] = [lambda name: name]
    for path, sub in module.named_modules():
        if not hasattr(getattr(sub, "config", None), "model_type"):
            continue
        prefix = f"{path}." if path else ""
        base = getattr(sub, "base_model_prefix", "") or ""

        def strip(name: str, prefix=prefix) -> str | None:
            return name[len(prefix):] if name.startswith(prefix) else None

        def drop_base(name: str, prefix=prefix, base=base) -> str | None:
            inner = strip(name, prefix)
            return inner[len(base) + 1:] if inner is not None and base and inner.startswith(base + ".") else None

        def add_base(name: str, prefix=prefix, base=base) -> str | None:
            inner = strip(name, prefix)
            return f"{base}.{inner}" if inner is not None and base else None

        out += [strip, drop_base, add_base]
    renamed = [lambda name, t=t, a=a, b=b: None if t(name) is None else t(name).replace(a, b)
               for t in list(out) for a, b in MOE_BLOCK_NAMES]
    return out + renamed


def check_shapes(reader: PretrainedReader, pmodel) -> None:
    shapes = pmodel.index.state_shapes
    for ours, info in reader.keys.items():
        name = ours.split("/", 1)[1]
        if tuple(info["shape"]) != tuple(shapes[name]):
            theirs = reader.names[ours]
            theirs = theirs[0][0].replace(".experts.0.", ".experts.*.") if isinstance(theirs, GroupedKey) else theirs
            raise CheckpointError(f"{str(reader.files[theirs.replace('*', '0')])!r}: {theirs!r} has shape "
                                  f"{tuple(info['shape'])}, the "
                                  f"model's {name!r} is {tuple(shapes[name])}; load weights of the same configuration")


def pretrained_reader(pmodel, path: str | Path) -> Any:
    """The reader `load_pretrained` stages from, after every check this rank can make alone."""
    files = weight_files(Path(path))
    reader = PretrainedReader(files, match_names(pmodel, files))
    check_shapes(reader, pmodel)
    return reader


def hugging_face_model(module: torch.nn.Module) -> tuple[str, Any]:
    """(path, module) of the Hugging Face `PreTrainedModel` inside `module` (the outermost)."""
    for path, sub in module.named_modules():
        if hasattr(getattr(sub, "config", None), "model_type") and callable(getattr(sub, "save_pretrained", None)):
            return path, sub
    raise CheckpointError(f"{type(module).__name__} holds no Hugging Face model (a transformers PreTrainedModel), so "
                          "there is no config.json to write; save with sw.save_checkpoint or full_state_dict()")


class SavePretrainedRefused:
    """Stands in for a Hugging Face model's own `save_pretrained` (which `push_to_hub` calls) on
    a rank that holds only part of its weights: transformers would write that part, and
    `from_pretrained` would fill the rest at random with a warning (pp: stage 0's 10 of a tiny
    Llama's 21 tensors), or fail deep in torch (tp's DTensors, ZeRO-3's released storage).
    A module-level class, so a module holding it still pickles."""

    def __init__(self, held: str):
        self.held = held

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        raise CheckpointError(
            f"save_pretrained of a Hugging Face model inside a ParallelModule: {self.held}, so transformers "
            "would write part of the model. Call sw.save_pretrained(pmodel, directory) on every rank instead: it "
            "gathers the whole model and writes config.json and safetensors from one rank")


def guard_hugging_face_saves(module: torch.nn.Module, held: str | None) -> None:
    """Where this rank holds part of the weights (`held` says how; None: all of them), each
    Hugging Face model inside `module` refuses its own save_pretrained (`SavePretrainedRefused`)."""
    if held is None:
        return
    for _, sub in module.named_modules():
        if hasattr(getattr(sub, "config", None), "model_type") and callable(getattr(sub, "save_pretrained", None)):
            object.__setattr__(sub, "save_pretrained", SavePretrainedRefused(held))


def write_pretrained(hf_model: Any, prefix: str, state: dict[str, torch.Tensor], directory: Path,
                     dtype: torch.dtype | None, max_shard_size: str) -> None:
    """The Hugging Face model's part of the whole `state` written by transformers itself:
    config.json, safetensors shards and their index, the model's own key names."""
    start = f"{prefix}." if prefix else ""
    own = {k[len(start):]: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).contiguous()
           for k, v in state.items() if k.startswith(start)}
    type(hf_model).save_pretrained(hf_model, str(directory), state_dict=own, safe_serialization=True,
                                   max_shard_size=max_shard_size)  # the class's: the instance's may be refused
    if dtype is not None:
        config = json.loads((directory / "config.json").read_text())
        config["torch_dtype"] = config["dtype"] = str(dtype).removeprefix("torch.")
        (directory / "config.json").write_text(json.dumps(config, indent=2))
