"""What the catalogue of bad inputs (tests/test_bad_inputs*.py) shares: a case, its outcome
(error class, message, seconds, value) and how it is judged, on one process or on every rank."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch.distributed as dist
from torch import nn

import shardwise as sw
from parity import make_gpt

SLOWEST_ALLOWED_S = 10.0  # every multi-rank error reaches every rank within this, default settings
TIMES: dict[str, float] = {}  # case -> the slowest rank's seconds to its error (test_bad_inputs_ranks.py prints the most)


@dataclass(frozen=True)
class Case:
    action: Callable[..., Any]
    error: str | None  # expected ShardwiseError class name; None: the right result, checked by `check`
    phrase: str = ""
    check: Callable[[Any], bool] | None = None


def outcome(action: Callable[[], Any]) -> tuple[str, str, float, Any]:
    """(error class or "ok", message, seconds the call took, its value)."""
    start = time.monotonic()
    try:
        value = action()
        if isinstance(value, nn.Module):  # not picklable across processes: describe it
            value = f"a {type(value).__name__}"
        return "ok", "", time.monotonic() - start, value
    except sw.ShardwiseError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start, None


def judge(case: Case, result: tuple[str, str, float, Any], where: str = "") -> None:
    kind, message, seconds, value = result
    if case.error is None:
        assert kind == "ok", f"{where} expected a result, got {kind}: {message}"
        assert case.check is None or case.check(value), f"{where} wrong result {value!r}"
    else:
        assert kind == case.error, f"{where} expected {case.error}, got {kind}: {message}"
        assert case.phrase in message, f"{where} {case.phrase!r} not in {message!r}"


def judge_all_ranks(case: Case, results: list[dict], name: str) -> None:
    """`case` judged on every rank's result: each within SLOWEST_ALLOWED_S, an error's message the same everywhere."""
    for where, result in enumerate(results):
        judge(case, result[name], f"{name} on rank {where}:")
        assert result[name][2] < SLOWEST_ALLOWED_S, f"{name} on rank {where} took {result[name][2]:.1f}s"
        TIMES[name] = max(TIMES.get(name, 0.0), result[name][2])
    if case.error is not None:  # the same message everywhere
        assert len({r[name][1] for r in results}) == 1, [r[name][1] for r in results]


def rank() -> int:
    return dist.get_rank()


def plan_on_gpt(plan, tp: int = 2, **config):
    return lambda: sw.parallelize(make_gpt(0), sw.ParallelConfig(tp=tp, **config), plan=plan)


class RuleRaisingByRank(nn.Linear):
    pass


def raise_by_rank(path, module, placements):
    raise sw.PlanError(f"rank {rank()} refuses {path}")


sw.plan.register_rule(RuleRaisingByRank, raise_by_rank)


class OneLayer(nn.Module):
    """A model of one layer of `layer_class` (4 -> 4), for the registered-rule cases."""

    def __init__(self, layer_class: type):
        super().__init__()
        self.layer = layer_class(4, 4)

    def forward(self, x):
        return self.layer(x).pow(2).mean()


class Tuple(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x):
        out = self.lin(x)
        return out.pow(2).mean(), out
