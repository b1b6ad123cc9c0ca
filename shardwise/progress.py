"""Progress bars for long work (checking and merging checkpoints, parity checks): tqdm on a
terminal, shown only once the work has lasted a second, on the first rank only; silent where
the output is not a terminal (logs, CI) and inside a parallel step."""

from __future__ import annotations

from typing import Iterable, TypeVar

T = TypeVar("T")


def progress(items: Iterable[T], desc: str, total: int | None = None, unit: str = "it") -> Iterable[T]:
    from tqdm import tqdm

    import torch.distributed as dist

    first = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    return tqdm(items, desc=desc, total=total, unit=unit, delay=1.0, leave=False, disable=None if first else True)
