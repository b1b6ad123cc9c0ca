"""Deferred initialization: build a module without memory, materialize only this rank's shards.

`deferred_init(factory)` runs the factory under torch's FakeTensorMode (tensors with
shapes and devices but no storage) and a dispatch mode that records every operation (allocations, `normal_`, `uniform_`, copies, ...). `parallelize`
then replays the record on real CPU tensors, starting from the random-number state the
factory started from, so every value is exactly what eager construction with the same seed
computes. A parameter is cut to this rank's shard as soon as the last operation touching
its storage has run, and its full tensor is freed; temporaries are freed after their last
use. At any moment only the tensors still being initialized are whole, so peak parameter
memory is about one model divided by tp plus the largest tensor in flight (measured in
`DeferredInit.peak_bytes`).

While recording, each seeded operation also runs once on a scratch tensor (one at a time),
so the global generator advances exactly as eager construction advances it, reseeding
inside the factory included, and code that draws random numbers afterwards sees the same
stream either way.

Why fake tensors rather than the meta device: libraries check the ambient device and skip
their initialization on meta (Hugging Face does), so the record would miss it. Why our own:
torchdistx's deferred_init is not part of torch, and `to_empty` followed by
`reset_parameters()` does not reproduce eager values.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._mode_utils import no_dispatch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from .errors import ModelError
from .tensors import op_name, shard_of, storage_id

_ATTR = "_shardwise_deferred"


def _key(t: torch.Tensor) -> tuple:
    """A tensor's identity as a value: its storage and geometry (views of one storage differ)."""
    return (storage_id(t.untyped_storage()), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def _storage(t: torch.Tensor) -> int:
    return storage_id(t.untyped_storage())


def is_deferred(t: Any) -> bool:
    """A tensor recorded by `deferred_init`, not yet materialized."""
    return isinstance(t, FakeTensor)


def release_freed_memory() -> None:
    """Give memory freed by many large temporaries back to the system. glibc keeps freed
    blocks below its (growing) mmap threshold in the heap, so after replaying a model's
    initialization a rank would show about twice its shards resident though it holds only
    them; `malloc_trim` returns them. A no-op where the C library has no such call."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


class FreedMemory:
    """Bytes of large temporaries freed since memory was last given back; past `every` bytes
    it is given back (`release_freed_memory`), so what a rank holds follows what it uses."""

    def __init__(self, every: int = 128 << 20):
        self.every, self.bytes = every, 0

    def add(self, nbytes: int) -> None:
        self.bytes += nbytes
        if self.bytes >= self.every:
            self.bytes = 0
            release_freed_memory()


class _Recorder(TorchDispatchMode):
    """Records ops on fake tensors; runs each seeded op once on a real scratch tensor so the
    global generator advances exactly as eager construction advances it (seeding inside the
    factory included), noting the generator state each seeded op started from."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, tuple, dict, Any, tuple | None]] = []
        self.freed = FreedMemory()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        rng_state = None
        if torch.Tag.nondeterministic_seeded in func.tags:
            # the global stream's state, and that of a generator passed to the op (torch.randn(...,
            # generator=g)): the scratch run below advances it as eager construction does, so the
            # replay must start it again from here
            rng_state = (torch.get_rng_state(), [(g, g.get_state()) for g in _generators(args, kwargs)])
            with no_dispatch():  # a real op on real scratch tensors, past the fake mode
                scratch = tree_map(_scratch, (args, kwargs))
                func(*scratch[0], **scratch[1])
            self.freed.add(sum(t.untyped_storage().nbytes() for t in tree_flatten(scratch)[0]
                               if isinstance(t, torch.Tensor) and not is_deferred(t)))
        self.ops.append((func, args, kwargs, out, rng_state))  # holds the fake tensors: storages stay unique
        return out


def _generators(args: tuple, kwargs: dict) -> list[torch.Generator]:
    return [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Generator)]


def _scratch(x: Any) -> Any:
    if is_deferred(x):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
    return x


@dataclass
class DeferredInit:
    """The recorded construction of one module."""

    ops: list[tuple[Any, tuple, dict, Any, tuple | None]]
    peak_bytes: int = 0  # largest total of real tensors alive during replay
    materialized_bytes: int = 0  # parameter and buffer bytes kept by this rank
    done: bool = field(default=False, repr=False)  # replayed (materialized) already

    def replay(self, finals: dict[tuple, list[str]], cut: Callable[[str, torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run the record on CPU; return `cut(name, full)` for every name in `finals` (recorded
        tensor key -> the names it is known by)."""
        replay = _Replay(self.ops, finals, cut)
        values = replay.run()
        self.peak_bytes, self.materialized_bytes = replay.peak_bytes, replay.kept_bytes
        # Played once: the record goes now, with any real tensor its ops captured. Fake
        # tensors of a Hugging Face Llama's record left alive until interpreter exit corrupt
        # the heap there (glibc's "corrupted double-linked list", every pp run on torch 2.13).
        self.ops = []
        return values


class _Replay:
    """One run of a record on real tensors.

    A storage is real only while its contents matter: it is freed after its last use
    (parameters are cut to their shard first), and also whenever the next op on it
    overwrites it whole (`normal_`, `zero_`, `copy_`, ...), to be allocated afresh there.
    So a parameter built in `__init__` and re-initialized at the end costs nothing between.
    """

    def __init__(self, ops: list, finals: dict[tuple, list[str]], cut: Callable[[str, torch.Tensor], torch.Tensor]):
        self.ops, self.finals, self.cut = ops, finals, cut
        self.uses: dict[int, list[tuple[int, tuple]]] = {}  # storage -> (op index, key) of each use
        self.created_at: dict[tuple, int] = {}  # key -> the op that made it
        for i, (_, args, kwargs, out, _) in enumerate(ops):
            for t in tree_flatten((args, kwargs))[0] + tree_flatten(out)[0]:
                if is_deferred(t):
                    self.uses.setdefault(_storage(t), []).append((i, _key(t)))
            for t in tree_flatten(out)[0]:
                if is_deferred(t):
                    self.created_at.setdefault(_key(t), i)
        self.targets = [_overwrite_target(func, args) for func, args, *_ in ops]
        self.final_storages = {k[0] for k in finals}
        self.real: dict[tuple, torch.Tensor] = {}  # recorded key -> its real tensor, while alive
        self.by_storage: dict[int, list[tuple]] = {}
        self.values: dict[str, torch.Tensor] = {}  # name -> kept (cut) tensor
        self.alive = self.peak_bytes = self.kept_bytes = 0
        self.freed = FreedMemory()

    def run(self) -> dict[str, torch.Tensor]:
        saved = torch.get_rng_state()
        generators = {id(g): (g, g.get_state()) for *_, rng in self.ops if rng is not None for g, _ in rng[1]}
        try:
            for i, op in enumerate(self.ops):
                self.step(i, *op)
        finally:
            torch.set_rng_state(saved)
            for generator, state in generators.values():  # as the factory left them
                generator.set_state(state)
        return self.values

    def step(self, i: int, func: Any, args: tuple, kwargs: dict, out: Any, rng_state: tuple | None) -> None:
        if rng_state is not None:
            torch.set_rng_state(rng_state[0])
            for generator, state in rng_state[1]:
                generator.set_state(state)
        target = self.targets[i]
        if target is not None and _key(target) not in self.real:
            self.register(_key(target), torch.empty_strided(target.shape, target.stride(), dtype=target.dtype,
                                                            device=target.device))
        to_real = lambda x: self.real[_key(x)] if is_deferred(x) else x  # noqa: E731
        with torch.no_grad(), no_dispatch():
            result = func(*tree_map(to_real, args), **tree_map(to_real, kwargs))
        for recorded, made in zip(tree_flatten(out)[0], tree_flatten(result)[0]):
            if is_deferred(recorded) and _key(recorded) not in self.real:
                self.register(_key(recorded), made)
        self.peak_bytes = max(self.peak_bytes, self.alive + self.kept_bytes)
        for storage in {_storage(t) for t in tree_flatten((args, kwargs, out))[0] if is_deferred(t)}:
            later = [u for u, _ in self.uses[storage] if u > i]
            if not later:
                self.release(storage, finalize=True)
            elif self.overwritten_at(storage, later[0]):
                self.release(storage, finalize=False)

    def register(self, key: tuple, tensor: torch.Tensor) -> None:
        if key[0] not in self.by_storage:
            self.alive += tensor.untyped_storage().nbytes()
        self.real[key] = tensor
        self.by_storage.setdefault(key[0], []).append(key)

    def release(self, storage: int, finalize: bool) -> None:
        """Free a storage's real tensors; `finalize`: its last use, so final tensors are kept (cut)."""
        keys = self.by_storage.pop(storage, [])
        for key in keys if finalize and storage in self.final_storages else ():
            names = self.finals.get(key, [])
            if names:  # tied names share one tensor
                kept = self.cut(names[0], self.real[key])
                self.kept_bytes += kept.numel() * kept.element_size()
                self.values.update(dict.fromkeys(names, kept))
        if keys:
            nbytes = self.real[keys[0]].untyped_storage().nbytes()
            self.alive -= nbytes
        for key in keys:
            self.real.pop(key)
        if keys:
            self.freed.add(nbytes)  # what the process holds stays near peak_bytes

    def overwritten_at(self, storage: int, j: int) -> bool:
        """Op j overwrites the storage whole and nothing after it uses an older view."""
        target = self.targets[j]
        if target is None or _storage(target) != storage:
            return False
        fresh = _key(target)
        return all(key == fresh or self.created_at.get(key, -1) > j for i, key in self.uses[storage] if i > j)


_OVERWRITES = {"normal_", "uniform_", "zero_", "fill_", "random_", "exponential_", "geometric_",
               "log_normal_", "cauchy_", "bernoulli_", "copy_"}


def _overwrite_target(func: Any, args: tuple) -> torch.Tensor | None:
    """The recorded tensor an op fills whole without reading its old values, if any."""
    if op_name(func) not in _OVERWRITES or not args:
        return None
    t = args[0]
    if not (is_deferred(t) and t.storage_offset() == 0):
        return None
    covered = 1  # dense and non-overlapping: sorted strides are the running products of sizes
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride != covered:
            return None
        covered *= size
    return t if t.numel() * t.element_size() == t.untyped_storage().nbytes() else None


def deferred_init(factory: Callable[..., nn.Module], *args: Any, **kwargs: Any) -> nn.Module:
    """`factory(*args, **kwargs)` built without memory; `parallelize` materializes it.

    The module allocates no parameter memory until `sw.parallelize`, which gives each rank
    only its shards, with the values eager construction on CPU would have produced.
    """
    recorder = _Recorder()
    with FakeTensorMode(allow_non_fake_inputs=True), recorder:
        module = factory(*args, **kwargs)
    if not isinstance(module, nn.Module):
        raise ModelError(f"deferred_init's factory returned {type(module).__name__}, not a torch.nn.Module")
    module.__dict__[_ATTR] = DeferredInit(recorder.ops)
    release_freed_memory()  # the scratch tensors that advanced the generator
    return module


def deferred_record(module: nn.Module) -> DeferredInit | None:
    """The record of a module built by `deferred_init`, if it was."""
    return module.__dict__.get(_ATTR)


def check_materializable(module: nn.Module) -> None:
    """`ModelError` unless every tensor of `module` has data or a deferred record to replay."""
    record = deferred_record(module)
    if record is None:
        named = list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False))
        meta = [n for n, t in named if t.is_meta or is_deferred(t)]
        if meta:
            raise ModelError(
                f"{meta[0]!r} has no data (meta or fake tensor) and the module was not built with sw.deferred_init; "
                "build it with sw.deferred_init(factory) so parallelize can materialize it"
            )
    elif record.done:
        raise ModelError("this deferred module was already materialized by an earlier parallelize call; "
                         "build a new one with sw.deferred_init for each parallelize")


def materialize(module: nn.Module, resolved, topology,
                experts: dict[str, nn.Module] | None = None) -> Callable[[str, Placement], torch.Tensor] | None:
    """Materialize a deferred module on this rank: replicated tensors in place, sharded ones
    returned by the callback for tensor parallelism to wrap, expert tensors (of the `experts`
    modules, ep > 1) as this rank's experts. None for an ordinary module."""
    check_materializable(module)
    record = deferred_record(module)
    if record is None:
        return None
    named = list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False))
    tp, rank = topology.sizes["tp"], topology.tp_rank
    sharded = {n: p for n, p in resolved.params.items() if not isinstance(p, Replicate)} if tp > 1 else {}
    by_expert = {f"{path}.{leaf}": Shard(0) for path, mod in (experts or {}).items()
                 for leaf, _ in mod.named_parameters(recurse=False)}
    finals: dict[tuple, list[str]] = {}
    for name, tensor in named:
        finals.setdefault(_key(tensor), []).append(name)

    def cut(name: str, full: torch.Tensor) -> torch.Tensor:
        if name in by_expert:
            return shard_of(full, by_expert[name], topology.ep_rank, topology.config.ep).clone().to(topology.device)
        placement = sharded.get(name)
        kept = shard_of(full, placement, rank, tp).clone() if placement is not None else full
        return kept.to(topology.device)

    values = record.replay(finals, cut)
    made: dict[int, nn.Parameter] = {}
    for path, mod in module.named_modules():
        prefix = f"{path}." if path else ""
        for leaf, param in list(mod.named_parameters(recurse=False, remove_duplicate=False)):
            if not is_deferred(param) or prefix + leaf in sharded:
                continue  # tensor parallelism takes sharded ones through the callback
            if id(param) not in made:
                made[id(param)] = nn.Parameter(values[prefix + leaf], requires_grad=param.requires_grad)
            setattr(mod, leaf, made[id(param)])
        for leaf, buffer in list(mod.named_buffers(recurse=False, remove_duplicate=False)):
            if is_deferred(buffer):
                setattr(mod, leaf, values[prefix + leaf])
    record.done = True
    release_freed_memory()  # the whole tensors each shard was cut from
    return lambda name, placement: values[name]
