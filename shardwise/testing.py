"""Run a function on N local processes joined in one torch.distributed world.

`run_on_ranks(fn, world_size, *args)` is how shardwise's own tests exercise real
collectives, and users can test their training code the same way. Workers are forked from
a forkserver that has already imported torch and shardwise, so starting a world costs a
fraction of a second rather than one interpreter start per rank. The rendezvous store
lives in the calling process on a port the OS picks, so concurrent runs never race for a
port. A worker that raises, dies or outlives `timeout` makes the call raise
`RankFailedError` naming the rank, with its traceback, and every other worker is killed:
nothing is left hanging. So does a worker that returned its result and then crashed, or
did not exit within 10 seconds.
"""

from __future__ import annotations

import faulthandler
import gc
import io
import multiprocessing
import os
import pickle
import queue
import re
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from .errors import RankFailedError

_PRELOAD = ["__main__", "torch", "torch.distributed", "shardwise"]
# Heavy libraries the caller already uses are imported once, in the forkserver, not in every
# worker: Hugging Face's model code costs about a second and a half of CPU per process, pytest
# (which a test module that defines the function imports) and torch's compiler stack (compile,
# float8) about half a second each. Only where CUDA is not available: torchao asks
# torch.cuda.is_available() as it is imported, which starts the CUDA driver in the forkserver,
# and a process forked after that cannot use CUDA. (Asking it here is harmless: the forkserver
# is a fresh interpreter, not a fork of this one.)
_PRELOAD_WHEN_IMPORTED = re.compile(r"transformers(\.models\.\w+\.modeling_\w+)?|torchao\.float8|pytest"
                                    r"|torch\._dynamo|torch\._functorch\.aot_autograd|torch\._inductor\.codegen\.triton")


def _context() -> multiprocessing.context.BaseContext:
    """The forkserver context; its preload list counts only before the server first starts."""
    ctx = multiprocessing.get_context("forkserver")
    heavy = [] if torch.cuda.is_available() else sorted(n for n in sys.modules if _PRELOAD_WHEN_IMPORTED.fullmatch(n))
    ctx.set_forkserver_preload(_PRELOAD + heavy)
    return ctx


class _Pickler(pickle.Pickler):
    """Standard pickling, with a plain CPU tensor written as its bytes. torch's own reduction
    writes each tensor through torch.save (a small archive apiece): moving a parity test's
    gradients from the ranks cost five to seven times what this does, most of it in the caller,
    while the ranks waited. Such tensors come back as copies that share no storage with each
    other (the same tensor object twice stays one); anything else pickles as torch does."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is not torch.Tensor or obj.device.type != "cpu" or obj.layout != torch.strided \
                or obj.is_quantized or (obj.requires_grad and not obj.is_leaf):
            return NotImplemented
        flat = obj.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
        return _tensor_from_bytes, (flat.view(torch.uint8).numpy().tobytes(), obj.dtype, tuple(obj.shape),
                                    obj.requires_grad)


def _tensor_from_bytes(data: bytes, dtype: torch.dtype, shape: tuple, requires_grad: bool) -> torch.Tensor:
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(shape).requires_grad_(requires_grad)


def _dumps(obj: Any) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def _worker(rank, world_size, port, backend, collective_timeout, threads, call, results):
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    torch.set_num_threads(threads)
    # What the forkserver preloaded (torch, transformers: millions of objects) lives as long as
    # the worker: out of the cyclic collector's sight, each full collection (the interpreter's own,
    # or shardwise.activation_memory's) walks only what the function made.
    gc.freeze()
    faulthandler.enable(all_threads=True)  # a crash in native code prints every thread's Python stack
    try:
        if "nccl" in backend:
            torch.cuda.set_device(rank % torch.cuda.device_count())
        timeout = timedelta(seconds=collective_timeout)
        store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        fn, args, kwargs = pickle.loads(call)
        results.put((rank, True, _dumps(fn(*args, **kwargs))))
    except BaseException as exc:  # report everything, KeyboardInterrupt included, then exit
        results.put((rank, False, f"{type(exc).__name__}: {exc}\n\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
    collective_timeout: float | None = None,
    backend: str = "gloo",
    threads: int = 1,
    **kwargs: Any,
) -> list[Any]:
    """Call `fn(*args, **kwargs)` on `world_size` local ranks and return their results.

    `fn` must be importable by name (defined at module level) and its results picklable;
    tensors in them (and in the arguments) arrive as copies, two that shared storage no longer do.
    Each worker has torch.distributed initialized (`backend`, default gloo) with
    RANK/WORLD_SIZE/LOCAL_RANK set as torchrun would, so `sw.init_distributed()` is a no-op.
    Collectives time out after `collective_timeout` seconds (default: min(timeout, 120));
    the whole run after `timeout` seconds. Each rank runs torch with `threads` intra-op
    threads (default 1: ranks are processes on one machine, and results then do not depend on
    how many cores it has). Returns the results in rank order.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be at least 1")
    collective_timeout = collective_timeout or min(timeout, 120.0)
    # Standard pickling copies tensors; multiprocessing's own would share them through file
    # descriptors that die with the worker that sent them.
    call = _dumps((fn, args, kwargs))
    ctx = _context()
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False)
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, world_size, store.port, backend, collective_timeout, threads, call, results),
            name=f"shardwise-rank-{rank}",
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    finished = False
    try:
        out = _collect(procs, results, timeout)
        finished = True
    finally:
        for proc in procs:
            if finished:  # let workers that reported run their exit handlers
                proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join()
        results.close()
    crashed = [f"rank {r} with exit code {p.exitcode}" for r, p in enumerate(procs) if p.exitcode]
    if crashed:  # a user's script that crashes on its way out fails its job: so does this
        raise RankFailedError(f"{', '.join(crashed)} of {world_size} crashed or hung on exit after returning "
                              "its result")
    return out


def _collect(procs, results, timeout: float) -> list[Any]:
    world_size = len(procs)
    done: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(done) < world_size:
        try:
            rank, ok, payload = results.get(timeout=0.05)
        except queue.Empty:
            _check_alive(procs, done, results)
            if time.monotonic() > deadline:
                missing = [r for r in range(world_size) if r not in done]
                raise RankFailedError(
                    f"ranks {missing} of {world_size} did not finish within {timeout:g}s and were killed; "
                    "a collective is probably waiting on a peer that never joined it"
                ) from None
            continue
        if not ok:
            _raise_failure(procs, done, results, rank, payload)
        done[rank] = payload
    return [pickle.loads(done[r]) for r in range(world_size)]


def _raise_failure(procs, done, results, rank: int, payload: str, grace: float = 2.0) -> None:
    """Raise for rank `rank`'s error, unless a rank died without reporting: its peers' errors
    are then the consequence (a closed connection), and the dead rank is the cause."""
    deadline = time.monotonic() + grace
    reported = set(done) | {rank}
    while True:
        try:  # reports still queued: those ranks did not die silently
            while True:
                reported.add(results.get(timeout=0.05)[0])
        except queue.Empty:
            pass
        dead = [r for r, p in enumerate(procs) if r not in reported and p.exitcode is not None]
        if dead or len(reported) == len(procs) or time.monotonic() > deadline:
            break
    if dead:
        codes = ", ".join(f"rank {r} with exit code {procs[r].exitcode}" for r in dead)
        raise RankFailedError(f"{codes} of {len(procs)} died before returning a result; "
                              f"then rank {rank} raised:\n{payload}")
    raise RankFailedError(f"rank {rank} of {len(procs)} raised:\n{payload}")


def _check_alive(procs, done, results) -> None:
    """Raise if a worker exited without reporting (crash, signal, os._exit)."""
    for rank, proc in enumerate(procs):
        if rank in done or proc.exitcode is None:
            continue
        try:  # it may have reported just before exiting
            other, ok, payload = results.get(timeout=1.0)
        except queue.Empty:
            raise RankFailedError(
                f"rank {rank} of {len(procs)} died with exit code {proc.exitcode} before returning a result"
            ) from None
        if not ok:
            _raise_failure(procs, done, results, other, payload)
        done[other] = payload
        return
