"""Where step metrics go: JSON lines, TensorBoard, Weights & Biases.

`pmodel.metrics.log_to(logger, every=N, ranks=(0,))` opens the logger on the ranks that log
(`logger.open()`, agreed: a file one rank cannot create is the same error on every rank) and
hands every N-th step's numbers (`StepMetrics.as_dict()`) to `logger.log(values, step)`; any
object with `log` and `close` (and optionally `open`) is a logger. Constructing one opens
nothing, so ranks that do not log leave no files. TensorBoard and W&B are imported when
their logger opens, so neither is a dependency of shardwise (`pip install tensorboard` /
`wandb`).

`ConsoleLogger` prints a line a step. `get_logger` is Python logging for shardwise's own
messages, each record with the rank that wrote it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any, Protocol

from .errors import ConfigError


class MetricsLogger(Protocol):
    def open(self) -> None: ...

    def log(self, values: dict[str, Any], step: int) -> None: ...

    def close(self) -> None: ...


def _numbers(values: dict[str, Any]) -> dict[str, float]:
    """The fields a scalar back end can plot: finite numbers (None and NaN left out)."""
    return {k: float(v) for k, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class JsonlLogger:
    """One JSON object per logged step, appended to `path` and flushed at once (a crash loses
    nothing logged); None for what was not measured."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._file: Any = None

    def open(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"JsonlLogger cannot open {str(self.path)!r} for appending: {exc.strerror or exc}; "
                              "give a writable path") from exc

    def log(self, values: dict[str, Any], step: int) -> None:
        clean = {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in values.items()}
        self._file.write(json.dumps({"step": step, **clean}) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


class TensorBoardLogger:
    """Scalars under `prefix/` (default "train/") in a TensorBoard event file in `logdir`."""

    def __init__(self, logdir: str | os.PathLike, prefix: str = "train"):
        self.logdir, self.prefix = Path(logdir), prefix.rstrip("/")
        self._writer: Any = None

    def open(self) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ConfigError("TensorBoardLogger needs the tensorboard package: pip install tensorboard") from exc
        try:
            self._writer = SummaryWriter(log_dir=str(self.logdir))
        except OSError as exc:
            raise ConfigError(f"TensorBoardLogger cannot write to {str(self.logdir)!r}: {exc.strerror or exc}; "
                              "give a writable directory") from exc

    def log(self, values: dict[str, Any], step: int) -> None:
        for name, value in _numbers(values).items():
            if name != "step":
                self._writer.add_scalar(f"{self.prefix}/{name}", value, step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


class WandbLogger:
    """A Weights & Biases run (`wandb.init(**init)`, e.g. project=..., mode="offline")."""

    def __init__(self, **init: Any):
        self.init = init
        self._run: Any = None

    def open(self) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise ConfigError("WandbLogger needs the wandb package: pip install wandb") from exc
        self._run = wandb.init(**self.init)

    def log(self, values: dict[str, Any], step: int) -> None:
        self._run.log({k: v for k, v in _numbers(values).items() if k != "step"}, step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()


class ConsoleLogger:
    """One line per logged step on `stream` (stdout): loss, tokens/s, MFU, memory, time split."""

    def __init__(self, stream: Any = None):
        self.stream = stream

    def open(self) -> None:
        pass

    def log(self, values: dict[str, Any], step: int) -> None:
        def fmt(name: str, spec: str, scale: float = 1.0, unit: str = "") -> str | None:
            value = values.get(name)
            return None if value is None else f"{name} {value * scale:{spec}}{unit}"

        parts = [fmt("loss", ".4f"), fmt("global_tokens_per_s", ",.0f"), fmt("mfu", ".1f", 100, "%"),
                 fmt("peak_memory_bytes", ".2f", 2 ** -30, " GiB"), fmt("step_s", ".3f", 1, " s"),
                 fmt("communication_s", ".3f", 1, " s"), fmt("bubble_s", ".3f", 1, " s"), fmt("grad_norm", ".3f")]
        print(f"step {step}: " + ", ".join(p for p in parts if p), file=self.stream or sys.stdout, flush=True)

    def close(self) -> None:
        pass


class _RankAdapter(logging.LoggerAdapter):
    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        kwargs["extra"] = {**kwargs.get("extra", {}), "rank": _rank()}
        return msg, kwargs


def _rank() -> str:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return str(dist.get_rank())
    return os.environ.get("RANK", "-")


def get_logger(name: str = "shardwise") -> logging.LoggerAdapter:
    """shardwise's Python logger: every record carries `rank` (%(rank)s in a format). Where
    the application configured no logging, warnings and above go to stderr as
    "[rank N] shardwise...: message"; otherwise its handlers decide."""
    base = logging.getLogger("shardwise")
    if not base.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[rank %(rank)s] %(name)s: %(message)s"))
        base.addHandler(handler)
        base.propagate = False
    return _RankAdapter(logging.getLogger(name), {})
