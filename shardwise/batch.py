"""Batches as nested dicts, lists and tuples of tensors: validate, split, move, read the loss.

Every tensor with at least one dimension is a batch tensor and is split along dim 0; all of
them must agree on that size. Scalars and non-tensor leaves go to every microbatch as they
are. Errors name the offending leaf by its path in the batch (e.g. `batch['labels']`).
"""

from __future__ import annotations

import copy
from collections import UserDict
from collections.abc import Mapping
from typing import Any, Callable, Iterator

import torch
from torch.distributed.tensor import DTensor

from .errors import BatchError, ModelError


def leaves(obj: Any, path: str = "batch") -> Iterator[tuple[str, Any]]:
    """(path, leaf) for every leaf of a nested batch, paths as `batch['labels']`."""
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from leaves(value, f"{path}[{key!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from leaves(value, f"{path}[{i}]")
    else:
        yield path, obj


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any], keep_mappings: bool = True) -> Any:
    """Rebuild `obj` with `fn` applied to every tensor leaf; mappings keep their type where
    they can (`_same_mapping`), or all become dicts without `keep_mappings`."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        items = {key: map_tensors(value, fn, keep_mappings) for key, value in obj.items()}
        return _same_mapping(obj, items) if keep_mappings else items
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_tensors(v, fn, keep_mappings) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn, keep_mappings) for v in obj)
    return obj


def with_dicts(batch: Any) -> Any:
    """`batch` with its mappings made dicts: pipeline programs flatten their inputs with torch's
    pytree, which sees a tokenizer's BatchEncoding as one leaf and the tensors in it as none
    (its stages then waited on each other for ever)."""
    return map_tensors(batch, lambda t: t, keep_mappings=False)


def _same_mapping(obj: Mapping, items: dict) -> Mapping:
    """`items` in `obj`'s own type where that is a dict or UserDict subclass (transformers'
    BatchEncoding and ModelOutput, OrderedDict), whose copies own their items, so the user's
    batch is left as it was; any other mapping becomes a dict. A forward reading
    `batch.input_ids` from a tokenizer's output failed on the dict it was given."""
    if type(obj) is dict or not isinstance(obj, (dict, UserDict)):
        return items
    try:
        out = copy.copy(obj)
        for key, value in items.items():
            out[key] = value
    except Exception:  # a subclass whose copy or item assignment is refused: a dict, as before
        return items
    return out


def batch_size(batch: Any) -> int:
    """The common dim-0 size of the batch tensors; raises `BatchError` if they disagree."""
    sizes = [(path, leaf.shape[0]) for path, leaf in leaves(batch) if isinstance(leaf, torch.Tensor) and leaf.dim() > 0]
    if not sizes:
        raise BatchError(
            f"the batch ({type(batch).__name__}) holds no tensor with a batch dimension; "
            "pass a tensor or a dict/list/tuple of tensors whose dim 0 is the batch"
        )
    first_path, first = sizes[0]
    for path, size in sizes[1:]:
        if size != first:
            raise BatchError(
                f"{path} has {size} samples along dim 0 but {first_path} has {first}; "
                "every batch tensor must have the same batch size"
            )
    return first


def split_batch(batch: Any, parts: int) -> list[Any]:
    """Split every batch tensor along dim 0 into `parts` equal microbatches."""
    size = batch_size(batch)
    if size % parts or size < parts:
        suggestion = parts * max(1, round(size / parts))
        raise BatchError(
            f"batch size {size} is not divisible by microbatches={parts}; "
            f"use a batch size that is a multiple of {parts} (e.g. {suggestion}) or change microbatches"
        )
    if parts == 1:
        return [batch]
    step = size // parts
    return [map_tensors(batch, lambda t, i=i: t[i * step:(i + 1) * step] if t.dim() > 0 else t) for i in range(parts)]


_BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def checksum(tensor: torch.Tensor) -> int:
    """An exact checksum of a tensor's bits that depends on element order.

    Floating values are read as integers of the same width and summed with position weights
    in wrapping int64 arithmetic, so equal tensors give equal sums on any device and rank, and
    a permutation of the same samples does not."""
    x = tensor.detach()
    if x.numel() == 0:
        return 0
    if x.is_complex():
        x = torch.view_as_real(x)
    if x.dtype == torch.bool:
        x = x.to(torch.uint8)
    elif x.is_floating_point():
        x = x.contiguous().view(_BITS[x.element_size()])
    flat = x.reshape(-1).to(torch.int64)
    weights = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.int64) % 65521 + 1
    return int((flat * weights).sum())


def batch_signature(batch: Any, content: bool = True) -> list[str]:
    """One line per leaf: its path, shape and dtype (and checksum with `content`), for
    checking that ranks given the same batch were, and naming the first difference."""
    lines = []
    for path, leaf in leaves(batch):
        if isinstance(leaf, torch.Tensor):
            line = f"{path} of shape {tuple(leaf.shape)} {str(leaf.dtype).replace('torch.', '')}"
            lines.append(line + (f" (checksum {checksum(leaf)})" if content else ""))
        else:
            lines.append(f"{path} = {repr(leaf)[:80]}")
    return lines


def to_device(batch: Any, device: torch.device) -> Any:
    return map_tensors(batch, lambda t: t.to(device, non_blocking=True))


def loss_of(output: Any, needs_grad: bool = True) -> torch.Tensor:
    """The loss a module's forward returned first; `ModelError` unless it is a scalar (with
    grad, unless `needs_grad` is False).

    A DTensor loss (from a loss-parallel head) is returned as its full, replicated value.
    """
    loss = output
    if isinstance(output, Mapping):
        loss = output["loss"] if "loss" in output else next(iter(output.values()), None)
    elif isinstance(output, (list, tuple)):
        loss = output[0] if output else None
    if isinstance(loss, DTensor):
        loss = loss.full_tensor()
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        got = f"a tensor of shape {tuple(loss.shape)} and dtype {loss.dtype}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ModelError(
            f"train_step (and pipeline parallelism) needs module.forward(batch) to return the scalar loss first "
            f"(a tensor, or a tuple/dict whose first entry is one); the first output was {got}. "
            "Compute the loss inside forward, e.g. `return F.cross_entropy(logits, batch['labels'])`"
        )
    if needs_grad and not loss.requires_grad:
        raise ModelError(
            "the loss returned by module.forward(batch) does not require grad; "
            "check that the module has trainable parameters and that forward does not run under torch.no_grad()"
        )
    return loss
