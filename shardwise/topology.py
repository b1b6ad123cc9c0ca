"""Process groups and rank coordinates for a `ParallelConfig`.

Ranks are laid out on a 4-d grid of shape (pp, dp, cp, tp): tp varies fastest, then cp,
then dp, then pp (Megatron's default), so tensor-parallel peers are consecutive ranks and
usually share a node. The grid arithmetic is pure (`rank_grid`, `group_family`,
`rank_coordinates`) so it can be tested for every shape without processes; `Topology`
uses exactly these functions to create the real groups and the `DeviceMesh`.

Groups are created here, with the config's timeout, instead of letting DeviceMesh create
them: DeviceMesh's own subgroups use torch's default timeout (30 minutes) whatever the
world group was given, and a collective on a dead peer must fail in bounded time.
"""

from __future__ import annotations

import atexit
import math
import os
import re
import sys
from datetime import timedelta
from typing import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .config import ParallelConfig
from .coordination import Coordinator, control_backend
from .peer_watch import default_store
from .errors import ShardwiseError
from .shared_groups import generation, shared_group

MESH_DIMS = ("pp", "dp", "cp", "tp")  # slowest-varying first


def init_distributed(backend: str | None = None, timeout: timedelta = timedelta(minutes=3)) -> None:
    """Initialize torch.distributed once; later calls do nothing.

    Reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT),
    or, without it, that of SLURM's `srun` (`slurm_environment`). Without either, starts a
    world of one process. The backend is NCCL for CUDA tensors (with gloo beside it for the
    small CPU messages ranks agree with) when CUDA is available, gloo otherwise, unless
    `backend` names one. The group it starts is destroyed when the interpreter exits: a
    process that leaves gloo's threads to static destruction aborts now and then ("terminate
    called without an active exception", seen on torch 2.11 and 2.13 in about 1 exit in 10).
    """
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        os.environ.update(slurm_environment(os.environ))
    backend = backend or ("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    if "nccl" in backend:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    atexit.register(destroy_world_at_exit)


def destroy_world_at_exit() -> None:
    """Destroy the default process group if the program left it alive, ended cleanly and the
    group has no NCCL backend.

    NCCL's shutdown waits for every peer and every outstanding collective, so where a peer is
    dead (an uncaught exception, `sys.last_value`, or one the program caught and ended on)
    it could hang the exit; gloo's is local, and gloo is where the exit abort was seen.
    """
    if dist.is_initialized() and not hasattr(sys, "last_value") and "nccl" not in str(dist.get_backend()):
        dist.destroy_process_group()


def slurm_environment(environ: dict[str, str]) -> dict[str, str]:
    """torchrun's variables for a task that `srun` started, or {} outside an srun step.

    srun sets SLURM_PROCID, SLURM_LOCALID and SLURM_STEP_NUM_TASKS per task (a batch script
    itself has no step task count, so `python train.py` there stays a world of one). The
    first node of the step's node list hosts the rendezvous unless MASTER_ADDR is set; the
    port is derived from the job id unless MASTER_PORT is set, so concurrent jobs differ.
    """
    if "SLURM_PROCID" not in environ or "SLURM_STEP_NUM_TASKS" not in environ:
        return {}
    nodes = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or "127.0.0.1"
    job = environ.get("SLURM_JOB_ID", "0")
    return {
        "RANK": environ["SLURM_PROCID"],
        "WORLD_SIZE": environ["SLURM_STEP_NUM_TASKS"],
        "LOCAL_RANK": environ.get("SLURM_LOCALID", "0"),
        "LOCAL_WORLD_SIZE": environ.get("SLURM_STEP_TASKS_PER_NODE", "1").split("(")[0].split(",")[0],
        "MASTER_ADDR": environ.get("MASTER_ADDR") or first_host(nodes),
        "MASTER_PORT": environ.get("MASTER_PORT") or str(20000 + int(job) % 20000 if job.isdigit() else 29500),
    }


def first_host(nodelist: str) -> str:
    """The first host of a SLURM host list: "gpu[07-09,12],cpu1" -> "gpu07"."""
    prefix, ranges, suffix = re.match(r"([^\[,]*)(?:\[([^\]]*)\])?([^,\[]*)", nodelist).groups()
    return prefix + (ranges.split(",")[0].split("-")[0] if ranges else "") + suffix


def backend_device() -> torch.device:
    """The device whose tensors the default process group communicates."""
    if dist.get_backend() == "gloo" or not torch.accelerator.is_available():
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def canonical_dims(dims: Iterable[str]) -> tuple[str, ...]:
    """`dims` in mesh order, checked; e.g. ("tp", "dp") -> ("dp", "tp")."""
    dims = tuple(dims)
    unknown = [d for d in dims if d not in MESH_DIMS]
    if unknown or not dims or len(set(dims)) != len(dims):
        raise ShardwiseError(f"mesh dimensions {dims!r} are not distinct names from {MESH_DIMS}")
    return tuple(d for d in MESH_DIMS if d in dims)


def rank_grid(sizes: dict[str, int]) -> torch.Tensor:
    """Global ranks arranged as a (pp, dp, cp, tp) tensor."""
    shape = [sizes[d] for d in MESH_DIMS]
    return torch.arange(math.prod(shape)).reshape(shape)


def group_family(grid: torch.Tensor, dims: Iterable[str]) -> list[list[int]]:
    """Every group spanned by `dims`: ranks that differ only in those coordinates.

    The groups partition the world; inside each, ranks are ordered by their coordinates
    along `dims` (so the group rank along a single dim equals that coordinate).
    """
    dims = canonical_dims(dims)
    axes = [MESH_DIMS.index(d) for d in dims]
    size = math.prod(grid.shape[a] for a in axes)
    return grid.movedim(axes, list(range(grid.ndim - len(axes), grid.ndim))).reshape(-1, size).tolist()


def rank_coordinates(rank: int, sizes: dict[str, int]) -> dict[str, int]:
    """The (pp, dp, cp, tp) coordinates of `rank`."""
    coords = {}
    for dim in reversed(MESH_DIMS):
        rank, coords[dim] = divmod(rank, sizes[dim])
    return {d: coords[d] for d in MESH_DIMS}


def _coordinate(dim: str) -> property:
    """A read-only `Topology` property: this rank's coordinate along `dim`."""
    def get(topology: "Topology") -> int:
        return topology.coordinates[dim]
    return property(get, doc=f"This rank's coordinate along {dim}.")


def even_group_names(salts: list[int], salt: int | None) -> None:
    """Make this rank's group-name salt (`compat.group_name_salt`) the largest of the ranks'
    `salts`, with groups of this rank alone.

    Torch names a group made with `use_local_synchronization=True` by its ranks and the salt,
    a count of the groups each member has made. Ranks that made different numbers (a tied
    parameter's group exists on some pipeline ranks only) give the next group they share one
    name each, and each waits for the others under its own: a second parallelize at pp=4 with
    tied embeddings waited out timeout_s in `new_group`."""
    if salt is None or min(salts) < 0 or control_backend() == "fake":  # another naming; one process
        return
    for _ in range(max(salts) - salt):
        dist.new_group([dist.get_rank()], use_local_synchronization=True)


class Topology:
    """This rank's place in the (pp, dp, cp, tp) grid, its groups and the DeviceMesh.

    Built from a `ParallelConfig` on an initialized world; creating one is collective:
    every rank must build it, in the same order relative to other group creations.
    """

    def __init__(self, config: ParallelConfig):
        if not dist.is_initialized():
            raise ShardwiseError("torch.distributed is not initialized; call sw.init_distributed() first")
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        self.config = config.resolve(self.world_size)
        self.sizes = {d: getattr(self.config, d) for d in MESH_DIMS}
        self.grid = rank_grid(self.sizes)
        self.coordinates = rank_coordinates(self.rank, self.sizes)
        self.device = backend_device()
        self.timeout = timedelta(seconds=self.config.timeout_s)
        self._groups: dict[tuple[str, ...], dist.ProcessGroup] = {}
        self._families: dict[tuple[str, ...], list[list[int]]] = {}  # per-step lookups stay O(1) at any world
        self._around: dict[tuple, list[int]] = {}  # ranks_at's answers
        # read after parallelize's agreement: alike on every rank (torch's fake world is one
        # process, and its store cannot count)
        shares = control_backend() != "fake"
        self._generation = generation(default_store()) if shares else 0
        per_dim = [self.group(d) for d in MESH_DIMS]
        if self.world_size > 1:  # made now, on every rank alike: steps use it without agreeing first (ZeRO)
            self.group(*MESH_DIMS)
        self.mesh = DeviceMesh.from_group(
            per_dim, self.device.type, mesh=self.grid, mesh_dim_names=MESH_DIMS
        )
        # Its own CPU group: agreements of one topology never pair with another's collectives.
        control = dist.new_group(list(range(self.world_size)), timeout=self.timeout, backend=control_backend())
        self.coordinator = Coordinator(control, self.config.timeout_s, retires_shared_groups=shares)

    # coordinates -------------------------------------------------------------------
    pp_rank = _coordinate("pp")
    dp_rank = _coordinate("dp")
    cp_rank = _coordinate("cp")
    tp_rank = _coordinate("tp")

    # expert parallelism: ep consecutive data-parallel ranks hold one copy of every expert
    @property
    def ep_rank(self) -> int:
        """This rank's place among the ranks that share out the experts (its ep group)."""
        return self.dp_rank % self.config.ep

    def expert_ranks(self) -> list[int]:
        """This rank's ep group: the `ep` consecutive data-parallel ranks that together hold
        every expert once."""
        ep, dp = self.config.ep, self.group_ranks("dp")
        start = self.dp_rank // ep * ep
        return dp[start:start + ep]

    def expert_replica_ranks(self, with_tp: bool = False) -> list[int]:
        """The data-parallel ranks holding the same experts as this one (every ep-th), at every
        cp coordinate (cp peers hold the same experts and compute other tokens), and with
        `with_tp` their tensor-parallel peers: where expert gradients are reduced."""
        tps = range(self.sizes["tp"]) if with_tp else [self.tp_rank]
        return sorted(r for t in tps for c in range(self.sizes["cp"])
                      for r in self.ranks_at(["dp"], tp=t, cp=c)[self.ep_rank::self.config.ep])

    def size(self, *dims: str) -> int:
        """Number of ranks in this rank's group spanning `dims`."""
        return math.prod(self.sizes[d] for d in canonical_dims(dims))

    # groups ------------------------------------------------------------------------
    def group_ranks(self, *dims: str) -> list[int]:
        """Global ranks of this rank's group spanning `dims`, ordered by coordinate."""
        for ranks in self.peer_groups(*dims):
            if self.rank in ranks:
                return ranks
        raise AssertionError(f"rank {self.rank} is in no {dims} group")  # grid covers every rank

    def ranks_at(self, dims: Iterable[str], **coordinates: int) -> list[int]:
        """The ranks of the group spanning `dims` around this rank's coordinates, with some
        overridden, e.g. `ranks_at(["dp"], pp=0)`: the dp group of pipeline stage 0 here."""
        at = dict(self.coordinates, **coordinates)
        key = (canonical_dims(dims), *(at[d] for d in MESH_DIMS))
        if key not in self._around:
            rank = int(self.grid[tuple(at[d] for d in MESH_DIMS)])
            self._around[key] = next(g for g in self.peer_groups(*dims) if rank in g)
        return self._around[key]

    def group(self, *dims: str) -> dist.ProcessGroup:
        """This rank's process group spanning `dims` (e.g. "dp" or "dp", "cp").

        Made on first use with the config's timeout, or shared with an earlier topology's
        group of the same dims and ranks (`shared_groups`); creation is collective among the
        group's members, so all ranks must ask for the same groups in the same order. The
        dims of size 1 share one group of this rank alone.
        """
        key = canonical_dims(dims)
        if key not in self._groups:
            ranks = self.group_ranks(*key)
            self._groups[key] = (self.group_of(ranks) if len(ranks) == 1  # shared by every dim of size 1
                                 else shared_group(ranks, "+".join(key), self.timeout, generation=self._generation))
        return self._groups[key]

    def group_of(self, ranks: Iterable[int]) -> dist.ProcessGroup:
        """A group of exactly `ranks` (e.g. the pipeline ranks holding a tied parameter).

        Made on first use with the config's timeout (or shared, as `group`'s); every member
        must ask for it.
        """
        key = ("ranks",) + tuple(sorted(set(ranks)))
        if self.rank not in key[1:]:
            raise ShardwiseError(f"rank {self.rank} asked for group {list(key[1:])} it is not a member of")
        if key not in self._groups:
            self._groups[key] = shared_group(key[1:], "ranks", self.timeout, generation=self._generation)
        return self._groups[key]

    def peer_groups(self, *dims: str) -> list[list[int]]:
        """Every group spanned by `dims` (all of them, not only this rank's); the same list
        object on every call (callers must not change it)."""
        key = canonical_dims(dims)
        if key not in self._families:
            self._families[key] = group_family(self.grid, key)
        return self._families[key]

    def wait(self, work: dist.Work | None, what: str, group: dist.ProcessGroup) -> None:
        """Wait for a collective of this topology, naming stalled or failed peers on failure."""
        self.coordinator.wait(work, what, group)

    def describe(self) -> str:
        shape = " × ".join(f"{d} {self.sizes[d]}" for d in MESH_DIMS)
        coords = ", ".join(f"{d} {self.coordinates[d]}" for d in MESH_DIMS)
        return f"world {self.world_size} = {shape}; rank {self.rank} at ({coords}) on {self.device}"

    def __repr__(self) -> str:
        return f"Topology({self.describe()})"

