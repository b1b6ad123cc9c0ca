"""What a pipeline schedule holds at its peak on its end ranks, in stage-microbatches and the
boundary tensors beside them: counted from the orders the executors run (torch's for interleaved
1F1B and zero-bubble, ours for GPipe and 1F1B) by tests/test_planner.py, used by cost.py's memory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .cost import Layout

SCHEDULE_CODES = {"gpipe": 0, "1f1b": 1, "interleaved-1f1b": 2, "zero-bubble": 3}


def in_flight(layout: Layout) -> np.ndarray:
    """Microbatches' worth of this rank's activations the first pipeline rank holds at its
    peak: GPipe all m; 1F1B min(m, p); torch's interleaved 1F1B warms up (v-1)p + 2(p-1)
    stage-microbatches before the first backward, each 1/v of the rank's blocks; its
    zero-bubble order holds p v at most on every rank (a stage-microbatch's graph lives until
    its weight backward): min(m, p). tests/test_planner.py counts torch's orders."""
    p, m, v = layout.pp, layout.microbatches, layout.virtual
    interleaved = np.minimum(m * v, (v - 1) * p + 2 * (p - 1) + 1) / v
    held = np.select([layout.schedule == 0, layout.schedule == 1, layout.schedule == 3],
                     [m, np.minimum(m, p), np.minimum(m, p)], interleaved)
    return np.where(p == 1, 1, held)


def last_rank_in_flight(layout: Layout) -> tuple[np.ndarray, np.ndarray]:
    """(microbatches' worth of the last pipeline rank's blocks, of its head's tensors) it holds
    at its peak: GPipe all m (every forward comes first, on the last stage too); one under
    1F1B's single stage (its backward follows each forward); interleaved 1F1B's final stage
    also holds one, its other v-1 stages p each ((v-1)p + 1 stage-microbatches); zero-bubble
    holds min(m, p) of every stage, the final one's included."""
    p, m, v = layout.pp, layout.microbatches, layout.virtual
    p_or_m = np.minimum(m, p)
    blocks = np.select([layout.schedule == 0, layout.schedule == 2, layout.schedule == 3],
                       [m, (p_or_m * (v - 1) + 1) / v, p_or_m], 1.0)
    head = np.select([layout.schedule == 0, layout.schedule == 3], [m, p_or_m], 1.0)
    return np.where(p == 1, 1, blocks), np.where(p == 1, 1, head)


def runner_boundaries(layout: Layout) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Boundary tensors our pipeline runner (parallel/pipeline/runner.py: GPipe, 1F1B, interleaved
    1F1B) holds at the peak beyond `in_flight`'s microbatches' worth, on the (first, last) rank,
    each as (stage outputs, input gradients sent): a stage-microbatch keeps its stage's output for
    its backward (a microbatch's worth of the rank's activations charges one; interleaved stages
    hold v per microbatch's worth, and the last rank's non-final stages one each), and a sent input
    gradient lives until a reply from the peer proves it received (`send_releases`): none at the
    first rank's peak under GPipe and 1F1B, one at the last rank's under 1F1B, two under
    interleaved 1F1B past its first round (one at the last rank of a single round on two ranks).
    tests/test_planner.py counts the runner's own orders and releases. Zero-bubble runs on torch's
    executor, whose sends (every output among them) `_memory` charges to the step's end."""
    p, m, v, schedule = layout.pp, layout.microbatches, layout.virtual, layout.schedule
    interleaved = (schedule == SCHEDULE_CODES["interleaved-1f1b"]) & (p > 1)
    held_blocks, held_head = last_rank_in_flight(layout)
    outputs_first = np.where(interleaved, in_flight(layout) * (v - 1), 0.0)
    outputs_last = np.where(interleaved, held_blocks * v - held_head, 0.0)
    sent_first = np.where(interleaved & (m > p), 2.0, 0.0)
    sent_last = np.select([interleaved, (schedule == SCHEDULE_CODES["1f1b"]) & (p > 1)],
                          [np.where((p == 2) & (m <= p), 1.0, 2.0), 1.0], 0.0)
    return (outputs_first, sent_first), (outputs_last, sent_last)
