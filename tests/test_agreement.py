"""The per-step agreement's fast path: a log2(n) sum of fixed-size check sums.

`exchanges` is simulated for every world size up to 130 (each rank's steps replayed in
lock-step on plain integers), so the schedule is proven to sum exactly for odd sizes and
non-powers of two without spawning 130 processes; real ranks then run it at sizes that
exercise each branch (a power of two, one and two extra ranks). The check sums are zero
exactly when every rank agrees (`_zero_sum_term`).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.coordination import _int64, _zero_sum_term
from shardwise.small_allreduce import SmallSum, exchanges


def _simulate(size: int) -> tuple[list[int], int]:
    """Every rank's final value when rank i starts with i + 1; and the rounds taken."""
    values = [i + 1 for i in range(size)]
    schedules = [list(exchanges(i, size)) for i in range(size)]
    rounds = max(len(s) for s in schedules)
    # steps are matched in order between partners; replay them in global lock-step by rounds
    cursor = [0] * size
    progress = True
    while progress:
        progress = False
        outgoing = {}
        for i in range(size):
            if cursor[i] < len(schedules[i]):
                send, receive, add = schedules[i][cursor[i]]
                ready = receive is None or (cursor[receive] < len(schedules[receive])
                                            and schedules[receive][cursor[receive]][0] == i)
                if ready:
                    outgoing[i] = (send, receive, add, values[i])
        # a step runs when its receive's partner is sending to it in its current step too
        done = {}
        for i, (send, receive, add, _) in outgoing.items():
            if receive is not None and (receive not in outgoing or outgoing[receive][0] != i):
                continue
            if send is not None and (send not in outgoing or outgoing[send][1] not in (i, None)):
                continue
            done[i] = outgoing[receive][3] if receive is not None else None
        for i, incoming in done.items():
            _, receive, add, _ = outgoing[i]
            if receive is not None:
                values[i] = values[i] + incoming if add else incoming
            cursor[i] += 1
            progress = True
    assert all(c == len(s) for c, s in zip(cursor, schedules)), f"size {size}: the schedule deadlocks"
    return values, rounds


@pytest.mark.parametrize("size", range(1, 131))
def test_schedule_sums_exactly_in_log_rounds(size):
    values, rounds = _simulate(size)
    assert values == [size * (size + 1) // 2] * size
    p = 1 << (size.bit_length() - 1)
    assert rounds <= int(math.log2(p)) + 2 * (size != p)  # log2(n) exchanges: no term grows with n


def _sum_on_ranks():
    rank, size = dist.get_rank(), dist.get_world_size()
    tensor = torch.tensor([rank + 1, -(1 << 62), rank * rank], dtype=torch.int64)
    SmallSum(tensor, dist.group.WORLD, list(range(size)), rank).start().finish(lambda w, what: w.wait(), "test")
    return tensor.tolist()


@pytest.mark.parametrize("size", [3, 4, 5])
def test_sum_on_real_ranks(size):
    want = [size * (size + 1) // 2, _int64(-(1 << 62) * size), sum(r * r for r in range(size))]
    assert sw.testing.run_on_ranks(_sum_on_ranks, size) == [want] * size


def test_check_sums_are_zero_exactly_when_members_agree():
    code = (1 << 55) + 12345
    for size in (1, 2, 3, 16384):
        assert _int64(sum(_zero_sum_term(code, i, size) for i in range(size))) == 0
    assert _int64(_zero_sum_term(code, 0, 3) + _zero_sum_term(code, 1, 3) + _zero_sum_term(code + 1, 2, 3)) != 0
