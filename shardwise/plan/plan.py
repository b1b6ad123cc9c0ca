"""`Plan`: every layout decision as plain data that prints, diffs and round-trips through JSON.

Parameter and activation placements are keyed by module-path patterns; placements are
torch's `Shard(d)`, `Replicate()` and `Partial()` (or their strings), one per mesh dim the
entry shards over (the tp dim). Anything a plan does not name is replicated. The same type
is written by hand, taken from the zoo, or produced by the planner; executors only read it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from ..errors import PlanError

_PLACEMENT = re.compile(
    r"^\s*(Shard|Replicate|Partial|StridedShard|_StridedShard)\s*\(\s*(?:dim\s*=\s*)?(-?\d*)"
    r"\s*(?:,\s*(?:split_factor\s*=\s*)?(\d+)\s*)?\)\s*$"
)


def parse_placement(value: Any, where: str = "plan") -> Placement:
    """A torch placement from a placement or its string form.

    "Shard(0)", "Replicate()", "Partial()", and "StridedShard(1, 3)": torch's `_StridedShard`,
    a dim made of `split_factor` equal blocks, each sharded (a fused q/k/v weight).
    """
    if isinstance(value, Placement):
        return value
    match = _PLACEMENT.match(value) if isinstance(value, str) else None
    if match is None:
        raise PlanError(
            f"{where}: {value!r} is not a placement; write Shard(d), Replicate() or Partial() "
            "(as torch objects or as those strings)"
        )
    kind, arg, factor = match.groups()
    if kind.endswith("StridedShard"):
        if not arg or not factor:
            raise PlanError(f"{where}: {value!r} needs a dimension and a split factor, e.g. 'StridedShard(1, 3)'")
        return _StridedShard(int(arg), split_factor=int(factor))
    if factor:
        raise PlanError(f"{where}: {value!r} takes at most one argument")
    if kind == "Shard":
        if not arg:
            raise PlanError(f"{where}: {value!r} needs a dimension, e.g. 'Shard(0)'")
        return Shard(int(arg))
    if arg:
        raise PlanError(f"{where}: {value!r} takes no argument; write '{kind}()'")
    return Replicate() if kind == "Replicate" else Partial()


@dataclass(frozen=True)
class Conversion:
    """An activation that arrives as `src` and is moved to `dst` before the module runs
    (written "Shard(1) -> Replicate()"). Only for activations, never parameters."""

    src: Placement
    dst: Placement


def parse_activation_placement(value: Any, where: str) -> Placement | Conversion:
    """A placement, or a `Conversion` from its "A -> B" string form."""
    if isinstance(value, Conversion):
        return value
    if isinstance(value, str) and "->" in value:
        parts = value.split("->")
        if len(parts) != 2:
            raise PlanError(f"{where}: {value!r} has more than one '->'; write one conversion, e.g. "
                            "'Shard(1) -> Replicate()'")
        src, dst = (parse_placement(part, where) for part in parts)
        if src == dst:
            raise PlanError(f"{where}: {value!r} converts a placement to itself; write just {parts[1].strip()!r}")
        if isinstance(dst, Partial) or isinstance(src, _StridedShard) or isinstance(dst, _StridedShard):
            raise PlanError(f"{where}: {value!r}: activations convert between Shard(d), Replicate() and from "
                            "Partial(); nothing converts to Partial() or a StridedShard")
        return Conversion(src, dst)
    return parse_placement(value, where)


def shard_dim(placement: Placement) -> int | None:
    """The dim a Shard or StridedShard placement splits, or None for Replicate/Partial."""
    return placement.dim if isinstance(placement, (Shard, _StridedShard)) else None


def placement_str(placement: Placement | Conversion) -> str:
    if isinstance(placement, Conversion):
        return f"{placement_str(placement.src)} -> {placement_str(placement.dst)}"
    if isinstance(placement, _StridedShard):
        return f"StridedShard({placement.dim}, {placement.split_factor})"
    if isinstance(placement, Shard):
        return f"Shard({placement.dim})"
    if isinstance(placement, Partial):
        return "Partial()"
    if isinstance(placement, Replicate):
        return "Replicate()"
    raise PlanError(f"placement {placement!r} has no string form; use Shard(d), Replicate() or Partial()")


def check_pattern(pattern: str) -> None:
    """`PlanError` unless `pattern` is a usable key: a dotted glob, or 're:' and a valid regex."""
    if pattern.startswith("re:"):
        try:
            re.compile(pattern[3:])
        except re.error as exc:
            raise PlanError(f"plan key {pattern!r} is not a valid regular expression ({exc}); fix it or "
                            "write a glob such as 'layers.*.mlp.fc1.weight'") from None
    elif not pattern or any(not part for part in pattern.split(".")):
        raise PlanError(f"plan key {pattern!r} is not a module path pattern; write e.g. 'layers.*.mlp.fc1.weight'")


def _mapping(value: Any, field: str) -> dict[str, Any]:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise PlanError(f"plan {field} must be a dict from module-path patterns (strings) to placements, "
                        f"got {type(value).__name__}: {str(value)[:80]}")
    return value


def _placements(value: Any, where: str) -> tuple[Placement, ...]:
    values = value if isinstance(value, (list, tuple)) else [value]
    if not values:
        raise PlanError(f"{where}: an empty placement list; write e.g. [Shard(0)]")
    return tuple(parse_placement(v, where) for v in values)


def _activation(value: Any, where: str) -> tuple[tuple[Placement | Conversion, ...] | None, ...]:
    """Per-tensor placements of a module's inputs or outputs; None leaves a tensor alone.

    Accepts veScale's nested form ([[Replicate()]]: one list per tensor) and a flat one
    ([Replicate()] or "Replicate()": a single tensor). A placement may be a conversion
    "A -> B": the tensor arrives as A and is moved to B.
    """
    values = value if isinstance(value, (list, tuple)) else [value]
    nested = values and all(v is None or isinstance(v, (list, tuple)) for v in values)
    per_tensor = values if nested else [values]
    out = []
    for v in per_tensor:
        if v is None:
            out.append(None)
            continue
        if not v:
            raise PlanError(f"{where}: an empty placement list; write e.g. [Shard(1)]")
        out.append(tuple(parse_activation_placement(p, where) for p in v))
    return tuple(out)


@dataclass
class Plan:
    """Placements by pattern, pipeline stages, ZeRO stage and recompute, as data.

    params: {"layers.*.attn.q_proj.weight": [Shard(0)], ...}
    activations: {"layers.*.mlp.input": [[Replicate()]], "layers.*.mlp.output": [[Shard(1)]],
        "layers.*.attn.input": "Shard(1) -> Replicate()"}: where activations are, and conversions
    stages: pipeline stages, as the module paths that begin stages 1..n-1 (["layers.4"]) or as
        every stage's modules ([["wte", "layers.0"], ["layers.1", "lm_head"]]); None: balanced
        automatically. virtual_stages: stages per pipeline rank (interleaved schedules).
    zero: ZeRO stage, or None to take the config's (a config asking for another stage is refused).
    recompute: patterns of modules whose activations are recomputed in backward.
    loss_parallel: column-parallel heads whose vocabulary-sharded logits reach the loss as
        DTensors, so cross-entropy runs vocab-parallel and the logits are never gathered.
    divide_by_tp: integer module attributes a forward uses for local shapes (e.g. GPT-2's
        "h.*.attn.split_size"), divided by tp on each rank.
    applies_to: class name the patterns are relative to; the plan then applies to every
        instance of that class (or of a subclass) wherever it sits in the module tree (zoo
        plans use this).
    parts: submodule paths the plan parallelizes (an LLM inside a larger model); everything
        else stays replicated and data-parallel. Sharding, recompute and the pipeline's layer
        list are looked for inside them only. Empty: the whole model.
    """

    params: dict[str, tuple[Placement, ...]] = field(default_factory=dict)
    activations: dict[str, tuple[tuple[Placement | Conversion, ...] | None, ...]] = field(default_factory=dict)
    stages: list[str] | list[list[str]] | None = None
    virtual_stages: int | None = None
    zero: int | None = None
    recompute: list[str] = field(default_factory=list)
    loss_parallel: list[str] = field(default_factory=list)
    divide_by_tp: list[str] = field(default_factory=list)
    applies_to: str | None = None
    name: str | None = None
    parts: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.params = {k: _placements(v, f"plan param {k!r}") for k, v in _mapping(self.params, "params").items()}
        self.activations = {k: _activation(v, f"plan activation {k!r}")
                            for k, v in _mapping(self.activations, "activations").items()}
        for key in self.activations:
            if not key.endswith((".input", ".output")):
                raise PlanError(
                    f"plan activation {key!r} must end in '.input' or '.output' (e.g. 'layers.*.mlp.input')"
                )
        for key in list(self.params) + list(self.activations):
            check_pattern(key)
        if self.stages is not None:
            if not isinstance(self.stages, (list, tuple)) or not all(
                    isinstance(s, str) or (isinstance(s, (list, tuple)) and all(isinstance(p, str) for p in s))
                    for s in self.stages):
                raise PlanError(f"plan stages={self.stages!r} must be a list of module paths (where stages 1.. begin) "
                                "or a list of lists of module paths (every stage's modules)")
            self.stages = [list(s) if isinstance(s, (list, tuple)) else s for s in self.stages]
        if self.virtual_stages is not None and (isinstance(self.virtual_stages, bool)
                                                or not isinstance(self.virtual_stages, int) or self.virtual_stages < 1):
            raise PlanError(f"virtual_stages={self.virtual_stages!r} must be a positive integer")
        if self.zero is not None and (isinstance(self.zero, bool) or self.zero not in (0, 1, 2, 3)):
            raise PlanError(f"plan zero={self.zero!r} must be a ZeRO stage 0-3, or None to take the config's")
        if isinstance(self.parts, str) or not isinstance(self.parts, (list, tuple)) or \
                not all(isinstance(p, str) and p and not p.startswith(".") for p in self.parts):
            raise PlanError(f"plan parts={self.parts!r} must be a list of submodule paths, e.g. ['llm']")
        self.parts = list(self.parts)
        for name in ("recompute", "loss_parallel", "divide_by_tp"):
            value = getattr(self, name)
            if isinstance(value, str) or not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
                raise PlanError(f"plan {name}={value!r} must be a list of module-path patterns, e.g. ['layers.*']")
            for pattern in value:
                check_pattern(pattern)
            setattr(self, name, list(value))
        for name in ("applies_to", "name"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise PlanError(f"plan {name}={value!r} must be a string or None")

    # conversions ------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Plan":
        """From our own dict form or veScale's {"parameter": ..., "forward": ...}."""
        if not isinstance(data, dict):
            raise PlanError(f"a plan dict must be a dict, got {type(data).__name__}")
        data = dict(data)
        if "parameter" in data or "forward" in data:
            data["params"] = data.pop("parameter", {})
            data["activations"] = data.pop("forward", {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PlanError(f"unknown plan fields {unknown}; a plan has {sorted(known)}")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "params": {k: [placement_str(p) for p in v] for k, v in self.params.items()},
            "activations": {
                k: [None if t is None else [placement_str(p) for p in t] for t in v]
                for k, v in self.activations.items()
            },
            "stages": self.stages,
            "virtual_stages": self.virtual_stages,
            "zero": self.zero,
            "recompute": list(self.recompute),
            "loss_parallel": list(self.loss_parallel),
            "divide_by_tp": list(self.divide_by_tp),
            "applies_to": self.applies_to,
            **({"parts": list(self.parts)} if self.parts else {}),
        }

    def to_json(self, path: str | Path | None = None) -> str:
        """The plan as JSON text; also written to `path` when given."""
        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> "Plan":
        """From JSON text or from a path to a .json file."""
        text = str(text_or_path)
        if not text.lstrip().startswith(("{", "[")):
            path = Path(text)
            if not path.is_file():
                raise PlanError(f"plan file {str(path)!r} does not exist")
            try:
                text = path.read_bytes().decode("utf-8")
            except UnicodeDecodeError:
                raise PlanError(f"plan file {str(path)!r} is not JSON text (it holds binary data)") from None
            except OSError as exc:
                raise PlanError(f"plan file {str(path)!r} cannot be read: {exc.strerror or exc}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(f"plan JSON does not parse: {exc}") from None
        if not isinstance(data, dict):
            raise PlanError(f"plan JSON must be an object, got {type(data).__name__}")
        return cls.from_dict(data)

    def replace(self, **changes: Any) -> "Plan":
        return dataclasses.replace(self, **changes)

    def __str__(self) -> str:
        lines = [f"Plan {self.name or '(unnamed)'}" + (f" for every {self.applies_to}" if self.applies_to else "")]
        if self.params:
            lines.append("  parameters:")
            width = max(map(len, self.params))
            lines += [f"    {k:<{width}}  {', '.join(map(placement_str, v))}" for k, v in self.params.items()]
        if self.activations:
            lines.append("  activations:")
            width = max(map(len, self.activations))
            for k, v in self.activations.items():
                shown = "; ".join("-" if t is None else ", ".join(map(placement_str, t)) for t in v)
                lines.append(f"    {k:<{width}}  {shown}")
        if not self.params and not self.activations:
            lines.append("  every parameter replicated")
        if self.stages is not None:
            shown = "; ".join(", ".join(s) if isinstance(s, list) else s for s in self.stages)
            lines.append(f"  stages begin at: {shown or '(one stage)'}" if all(isinstance(s, str) for s in self.stages)
                         else f"  stages: {shown}")
        if self.virtual_stages is not None:
            lines.append(f"  virtual stages per rank: {self.virtual_stages}")
        if self.zero is not None:
            lines.append(f"  zero: {self.zero}")
        if self.parts:
            lines.append(f"  parts: {', '.join(self.parts)} (the rest replicated)")
        if self.recompute:
            lines.append(f"  recompute: {', '.join(self.recompute)}")
        if self.loss_parallel:
            lines.append(f"  loss-parallel heads: {', '.join(self.loss_parallel)}")
        if self.divide_by_tp:
            lines.append(f"  attributes divided by tp: {', '.join(self.divide_by_tp)}")
        return "\n".join(lines)
