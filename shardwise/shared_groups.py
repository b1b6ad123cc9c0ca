"""Process groups made once per process and shared by every topology that needs the same ones.

A second `parallelize` in one process (an eval copy, a sweep, a test that trains many layouts)
asks for the groups the first one made. Making them again would cost each one for as long as
the process lives: a gloo group keeps a transport thread that wakes every 10 ms (by the 200th
group, ranks sharing a CPU's cores step 2.4x slower), an NCCL group its communicator's device
buffers. A group cannot be destroyed and made again either: torch names a locally synchronized
group by its ranks and a count of live groups, so the new one would reuse a dead one's
rendezvous keys. So a group is looked up in torch's own registry of this process's groups, by
its ranks and a description naming its role, backend, timeout and generation, and made only
when none matches.

Every member decides alike: the members of a group made it together, so each finds it or none
does. A group in which a collective was abandoned (a rank out of step: a peer skipped it, died
or timed out) cannot carry another, so such a failure retires every shared group: it counts
one more `generation` in the rendezvous store, read by each topology after parallelize's
opening agreement (which orders it after any rank's failure), and later topologies make their
groups anew. A topology's control group (its agreements) is not shared: two models'
agreements must never pair with each other.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Iterable

import torch.distributed as dist


_RETIRED = "shardwise/groups/retired"


def _description(role: str, backend: str | None, timeout: timedelta, generation: int) -> str:
    return f"shardwise {role} {backend or 'default'} {timeout.total_seconds():g}s g{generation}"


def generation(store: Any | None) -> int:
    """How many times shared groups were retired in this world (0 without a store)."""
    return int(store.add(_RETIRED, 0)) if store is not None else 0


def retire_shared_groups(store: Any | None) -> None:
    """Stop every rank's later topologies from sharing the groups made so far. Called while
    an operation fails: a store that cannot be reached then (its world is ending, and no
    topology will follow) must not hide that failure."""
    try:
        if store is not None:
            store.add(_RETIRED, 1)
    except RuntimeError:
        pass


def find_group(ranks: list[int], description: str) -> dist.ProcessGroup | None:
    """A live group of this process with exactly `ranks` made under `description`, if any."""
    from torch.distributed import distributed_c10d as c10d

    registry = getattr(getattr(c10d, "_world", None), "pg_group_ranks", None) or {}
    for group, members in registry.items():
        if getattr(group, "group_desc", None) == description and sorted(members) == ranks:
            return group
    return None


def shared_group(ranks: Iterable[int], role: str, timeout: timedelta, backend: str | None = None,
                 generation: int = 0) -> dist.ProcessGroup:
    """The group of exactly `ranks` for `role` (e.g. "tp": groups of one role carry one kind of
    collective, so a collective one rank skips cannot pair with another role's) on `backend`
    (None: the default group's) with `timeout`: this process's existing one of this
    `generation`, else a new one made by its members alone (every member must ask for it)."""
    ranks = sorted(set(ranks))
    description = _description(role, backend, timeout, generation)
    found = find_group(ranks, description)
    if found is not None:
        return found
    return dist.new_group(ranks, timeout=timeout, backend=backend, use_local_synchronization=True,
                          group_desc=description)
