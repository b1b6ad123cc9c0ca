"""Where a rank's piece of a tensor sits in the whole tensor: rectangles in global coordinates.

A checkpoint stores every tensor as rectangles of its global (unsharded) shape, so any
layout can read it back. A rank holds a tensor-parallel local shard (`Shard(d)`,
`StridedShard(d, k)` or whole), and under ZeRO only a flat range of that shard; both map to
a few rectangles: a flat range of a row-major array is at most 2*ndim+1 rectangles, each a
contiguous run of the range, and a strided shard splits them at block boundaries.
"""

from __future__ import annotations

from typing import Iterator

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

Rect = tuple[tuple[int, int], ...]  # (start, stop) per dim


def flat_rects(shape: tuple[int, ...], lo: int, hi: int, base: int = 0) -> Iterator[tuple[Rect, int, int]]:
    """Rectangles covering flat positions [lo, hi) of a row-major `shape`, each with the
    contiguous flat range [start, stop) it occupies."""
    if lo >= hi:
        return
    if len(shape) <= 1:
        yield ((lo, hi),) if shape else (), base + lo, base + hi
        return
    row = 1
    for size in shape[1:]:
        row *= size
    first, last = lo // row, (hi - 1) // row
    if first == last:  # within one row: recurse into it
        for rect, start, stop in flat_rects(shape[1:], lo - first * row, hi - first * row, base + first * row):
            yield ((first, first + 1),) + rect, start, stop
        return
    if lo % row:  # partial first row
        yield from flat_rects(shape, lo, (first + 1) * row, base)
        first += 1
    end = last if hi % row else last + 1
    if end > first:  # whole rows
        yield ((first, end),) + tuple((0, s) for s in shape[1:]), base + first * row, base + end * row
    if hi % row:  # partial last row
        yield from flat_rects(shape, last * row, hi, base)


def local_to_global(rect: Rect, placement: Placement, rank: int, size: int, global_shape: tuple[int, ...]) -> list[tuple[Rect, Rect]]:
    """A rectangle of a tp rank's local shard as rectangles of the global tensor:
    (global rect, the same region in local coordinates)."""
    if isinstance(placement, Replicate) or size == 1 or not rect:
        return [(rect, rect)]
    dim = placement.dim
    start, stop = rect[dim]
    if isinstance(placement, _StridedShard):  # k blocks along dim, each sharded over tp
        k = placement.split_factor
        block = global_shape[dim] // k // size  # local rows per block
        out = []
        for b in range(start // block, (stop - 1) // block + 1):
            lo, hi = max(start, b * block), min(stop, (b + 1) * block)
            g = b * (global_shape[dim] // k) + rank * block + (lo - b * block)
            out.append((_with(rect, dim, (g, g + hi - lo)), _with(rect, dim, (lo, hi))))
        return out
    if isinstance(placement, Shard):
        offset = rank * (global_shape[dim] // size)
        return [(_with(rect, dim, (start + offset, stop + offset)), rect)]
    raise ValueError(f"no geometry for placement {placement}")


def _with(rect: Rect, dim: int, span: tuple[int, int]) -> Rect:
    return rect[:dim] + (span,) + rect[dim + 1:]


def intersect(a: Rect, b: Rect) -> Rect | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return None if any(lo >= hi for lo, hi in out) else out


def rect_shape(rect: Rect) -> tuple[int, ...]:
    return tuple(hi - lo for lo, hi in rect)


def shift(rect: Rect, origin: Rect) -> tuple[slice, ...]:
    """`rect` as slices relative to `origin`'s start."""
    return tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(rect, origin))
