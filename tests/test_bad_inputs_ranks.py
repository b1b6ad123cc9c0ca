"""Bad inputs on several ranks (see test_bad_inputs.py). The cases are grouped: one world runs a
whole group, case after case (an agreed error leaves every rank in step, so the next case runs
in the same world), and records on every rank the error class, its message and how long the
failing call took. Each case is then its own test, checked on every rank.
"""

from __future__ import annotations

import json

import pytest

import shardwise as sw
from bad_inputs import TIMES, judge_all_ranks, outcome, rank
from bad_inputs_rank_cases import RANKS2, RANKS4, plan_file, unequal_reference


def _run_group(group: str) -> dict[str, tuple]:
    cases = {"ranks2": RANKS2, "ranks4": RANKS4}[group]
    written = plan_file(0) if group == "ranks2" and rank() == 0 else None
    if written is not None:
        written.write_text(json.dumps({"params": {}}))
    try:
        return {name: outcome(case.action) for name, case in cases.items()}
    finally:
        if written is not None:
            written.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def ranks2():
    return sw.testing.run_on_ranks(_run_group, 2, "ranks2", timeout=300)


@pytest.fixture(scope="module")
def ranks4():
    return sw.testing.run_on_ranks(_run_group, 4, "ranks4", timeout=300)


@pytest.mark.parametrize("name", list(RANKS2))
def test_two_ranks(ranks2, name):
    judge_all_ranks(RANKS2[name], ranks2, name)


@pytest.mark.parametrize("name", list(RANKS4))
def test_four_ranks(ranks4, name):
    judge_all_ranks(RANKS4[name], ranks4, name)
    if name == "unequal replicas weighted by samples":  # one process on the 8 samples
        want = unequal_reference()
        for result in ranks4:
            got = result[name][3]["wpe.weight"]
            assert (got - want).abs().max() <= 2e-3 * want.abs().max()  # EPS_GRAD, tests/parity.py


def test_zz_report_slowest():
    """Prints the slowest multi-rank error of the catalogue's files run before it (run with -s to see it)."""
    if TIMES:
        name = max(TIMES, key=TIMES.get)
        print(f"\nslowest multi-rank error: {name}: {TIMES[name]:.2f} s (of {len(TIMES)} timed)")
