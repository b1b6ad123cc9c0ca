"""Expert parallelism: each mixture-of-experts layer's experts split over the ep group.

An experts module is what transformers (>= 5) builds for Mixtral, Qwen2/Qwen3-MoE, OLMoE,
DeepSeek-V3 and others: grouped tensors whose first dimension indexes the experts
(`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`, ...), `num_experts`, and
`forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`. The
router before it stays replicated and runs on every rank's own tokens, so routing is exactly
one process's. `apply_expert_parallel` makes each such tensor a DTensor sharded on dim 0 over
the ep group (E/ep experts per rank; state dicts and checkpoints see the whole tensor) and
swaps the module's class for one whose forward dispatches the token slots to their experts'
ranks (dispatch.py), runs the module's own forward there on its local experts, and combines
the results, weighted by the router, on the token's rank.

Why not torch's or torchtitan's: torch has no expert-parallel style for transformers'
modules, and torchtitan's works on its own MoE module; this keeps the user's module and
its own expert computation (eager, grouped_mm, ...), changing only where tokens go.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from ...config import ParallelConfig
from ...errors import ConfigError, PlanError
from ...topology import Topology
from .dispatch import Routing, exchange, weighted_at_origin

MiB = 1 << 20


_REGISTERED = "shardwise_experts_count"  # class attribute set by register_experts: the count's attribute name


def register_experts(module_class: type | None = None, *, num_experts: str = "num_experts") -> Any:
    """Declare `module_class` an experts module for expert parallelism, where shardwise would
    not recognize it alone: its count under another attribute name (`num_experts=`), or a
    forward that takes more than the three tensors (optional arguments after them). The class
    must still hold each expert's weights as grouped tensors (every parameter of its own
    `[count, ...]`) and compute `forward(hidden_states [T, H], top_k_index [T, k],
    top_k_weights [T, k]) -> [T, H]`, reading the count from that attribute (under ep it reads
    this rank's count and gets local expert indices). Returns the class; also a decorator,
    `@register_experts(num_experts="n_experts")`. Like register_rule, it belongs to that class
    only."""
    if module_class is None:
        return functools.partial(register_experts, num_experts=num_experts)
    if not (isinstance(module_class, type) and issubclass(module_class, nn.Module)):
        raise PlanError(f"register_experts: {module_class!r} is not an nn.Module class")
    if not (isinstance(num_experts, str) and num_experts.isidentifier()):
        raise PlanError(f"register_experts({module_class.__name__}, num_experts={num_experts!r}): name the attribute "
                        "that holds the number of experts, e.g. num_experts='n_experts'")
    try:
        inspect.signature(module_class.forward).bind(None, None, None, None)
    except (TypeError, ValueError) as exc:
        raise PlanError(f"register_experts({module_class.__name__}): its forward cannot be called as forward("
                        f"hidden_states, top_k_index, top_k_weights) ({exc}); shardwise dispatches the experts' "
                        "token slots through that call") from exc
    setattr(module_class, _REGISTERED, num_experts)
    return module_class


def count_attribute(module: nn.Module) -> str | None:
    """The attribute holding `module`'s expert count when its class was registered (or is
    expert parallelism's subclass of a registered class), else None."""
    cls = type(module)
    if "_local_forward" in vars(cls):  # ExpertParallel's subclass: the user's class is its base
        cls = cls.__bases__[0]
    return vars(cls).get(_REGISTERED)


def expert_count(module: nn.Module) -> int:
    return getattr(module, count_attribute(module) or "num_experts")


def grouped_experts(module: nn.Module) -> dict[str, nn.Module]:
    """Path -> experts module: registered classes (register_experts), and modules holding
    experts as grouped tensors the way transformers builds them (`num_experts`, parameters
    `[num_experts, ...]`, forward(hidden_states, top_k_index, top_k_weights))."""
    found = {}
    for path, sub in module.named_modules():
        if count_attribute(sub) is not None:
            found[path] = sub
            continue
        count = getattr(sub, "num_experts", None)
        params = list(sub.parameters(recurse=False))
        if not isinstance(count, int) or count < 2 or not params or isinstance(sub, nn.Linear):
            continue
        if any(p.dim() < 2 or p.shape[0] != count for p in params):
            continue
        try:
            arguments = [a for a in inspect.signature(type(sub).forward).parameters.values()
                         if a.kind in (a.POSITIONAL_ONLY, a.POSITIONAL_OR_KEYWORD)]
        except (TypeError, ValueError):
            continue
        if len(arguments) == 4:  # self, hidden_states, top_k_index, top_k_weights
            found[path] = sub
    return found


def _check_registered(path: str, experts: nn.Module) -> None:
    """A registered experts module must hold what its registration promised."""
    name = type(experts).__name__
    attribute = count_attribute(experts)
    count = getattr(experts, attribute, None)
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ConfigError(f"{path!r} ({name}) is registered as experts with their count in .{attribute}, which is "
                          f"{count!r}: set it to the number of experts, or register the attribute that holds it")
    params = dict(experts.named_parameters(recurse=False))
    odd = [n for n, p in params.items() if p.dim() < 1 or p.shape[0] != count]
    if not params or odd:
        raise ConfigError(f"{path!r} ({name}) is registered as experts, but " + (
            f"its parameters {odd} are not [{attribute}={count}, ...]: each expert's weights are a slice of a grouped "
            "tensor, and a parameter shared by all experts would be summed over the wrong tokens. Move it out of the "
            "experts module" if odd else "it holds no parameters of its own (grouped [experts, ...] tensors)"))


def check_expert_parallel(module: nn.Module, config: ParallelConfig) -> None:
    """Refuse what expert parallelism (and a load-balancing loss over the whole batch, router.py)
    cannot run exactly, before any collective."""
    name = type(module).__name__
    if config.ep == 1:
        return
    found = grouped_experts(module)
    if not found:
        lists = [p for p, m in module.named_modules() if isinstance(m, nn.ModuleList) and p.split(".")[-1] == "experts"]
        what = (f"its experts at {lists[0]!r} are a list of modules (transformers 4.x); shardwise shards experts "
                "kept as grouped tensors (transformers >= 5): upgrade transformers" if lists else
                "no module holds experts as grouped tensors (parameters [num_experts, ...] and "
                "forward(hidden_states, top_k_index, top_k_weights), as transformers >= 5 builds them); declare your "
                "own experts class with sw.plan.register_experts(cls, num_experts='<count attribute>')")
        raise ConfigError(f"ep={config.ep} but {name} has no mixture-of-experts layer shardwise can shard: {what}; "
                          "or set ep=1")
    for path, experts in found.items():
        if count_attribute(experts) is not None:
            _check_registered(path, experts)
        if expert_count(experts) % config.ep:
            raise ConfigError(f"ep={config.ep} does not divide the {expert_count(experts)} experts of {path!r}: "
                              f"use an ep that divides {expert_count(experts)}")


class ExpertParallel:
    """The sharded experts modules of a model and their dispatch over the ep group."""

    def __init__(self, module: nn.Module, topology: Topology, modules: dict[str, nn.Module],
                 replica_weight: Callable[[], float] = lambda: 1.0):
        self.topology = topology
        ranks = topology.expert_ranks()
        self.group = topology.group_of(ranks)
        self.size = len(ranks)
        self.rank = topology.ep_rank
        self.mesh = DeviceMesh.from_group(self.group, topology.device.type, mesh=ranks, mesh_dim_names=("ep",))
        self.replica_weight = replica_weight  # set by build once the gradient buckets exist
        self.modules = modules  # `grouped_experts(module)`, found before deferred init cut them
        self.params: set[int] = set()  # ids of the sharded expert parameters
        self.replaced: dict[int, nn.Parameter] = {}  # id of each whole expert parameter -> its sharded replacement
        self.bytes_sent = 0  # all-to-all bytes this rank sent to other ranks since `reset_traffic`
        self.tokens_per_expert: dict[str, torch.Tensor] = {}  # per layer: token slots each local expert computed
        for path, experts in self.modules.items():
            self._shard(path, experts)

    def _shard(self, path: str, experts: nn.Module) -> None:
        for name, param in list(experts.named_parameters(recurse=False)):
            if param.shape[0] == expert_count(experts):  # whole: this rank's experts cut from the first rank's
                sharded = distribute_tensor(param.detach(), self.mesh, [Shard(0)], src_data_rank=0)
            else:  # deferred init materialized only this rank's experts
                sharded = DTensor.from_local(param.detach(), self.mesh, [Shard(0)], run_check=False)
            replaced = nn.Parameter(sharded, requires_grad=param.requires_grad)
            experts._parameters[name] = replaced
            self.params.add(id(replaced))
            self.replaced[id(param)] = replaced
        base = type(experts)
        experts.__class__ = type(f"ExpertParallel{base.__name__}", (base,), {"forward": _forward, "_local_forward": base.forward})
        experts._expert_parallel = (self, path)

    def reset_traffic(self) -> None:
        self.bytes_sent = 0

    def describe(self) -> list[str]:
        """Summary lines: the layers, the experts here, the last step's all-to-all bytes and
        how many token slots each local expert computed (its load)."""
        count = expert_count(next(iter(self.modules.values())))
        per = count // self.size
        first = self.rank * per
        lines = [f"  expert par. {len(self.modules)} MoE layer(s), {count} experts over ep ranks "
                 f"{self.topology.expert_ranks()}: experts {first}-{first + per - 1} here; "
                 + (f"{self.bytes_sent / MiB:.4f} MiB sent to other ranks by all-to-all in the last train_step's "
                    "forward (as many again in its backward)" if self.tokens_per_expert
                    else "traffic is counted from the first step")]
        for path, tokens in self.tokens_per_expert.items():
            lines.append(f"              {path}: token slots per local expert {tokens.tolist()}")
        return lines

    @contextlib.contextmanager
    def _local_experts(self, experts: nn.Module) -> Iterator[None]:
        """The module's parameters as this rank's shards (differentiable), num_experts its own count."""
        saved = dict(experts._parameters)
        attribute = count_attribute(experts) or "num_experts"
        count = getattr(experts, attribute)
        try:
            for name, param in saved.items():
                if id(param) in self.params:
                    experts._parameters[name] = param.to_local()
            setattr(experts, attribute, count // self.size)
            yield
        finally:
            experts._parameters.update(saved)
            setattr(experts, attribute, count)

    def run(self, experts: nn.Module, path: str, hidden: torch.Tensor, index: torch.Tensor,
            weights: torch.Tensor) -> torch.Tensor:
        """One experts forward over the ep group: dispatch, local experts, combine."""
        what = f"expert all-to-all of {path!r}"
        wait = self.topology.wait
        route = Routing(index, expert_count(experts), self.group, wait, what)
        sent = weighted_at_origin(hidden[route.token], self.replica_weight, divide=True)
        received = exchange(sent, route.send, route.receive, self.group, wait, what)
        with self._local_experts(experts):
            ones = torch.ones((received.shape[0], 1), dtype=weights.dtype, device=weights.device)
            computed = experts._local_forward(received, route.local_expert[:, None], ones)
        if received.requires_grad and not computed.requires_grad:  # no slot came here: keep the backward's
            computed = computed + received.sum()  # all-to-all in this rank's graph (an empty sum is 0)
        back = weighted_at_origin(exchange(computed, route.receive, route.send, self.group, wait, what),
                                  self.replica_weight)
        others = sum(route.send) - route.send[self.rank] + sum(route.receive) - route.receive[self.rank]
        self.bytes_sent += others * hidden.shape[-1] * hidden.element_size()  # rows that leave this rank
        self.tokens_per_expert[path] = route.received_per_expert
        slot_weights = weights.reshape(-1)[route.slots, None]
        out = torch.zeros_like(hidden)
        return out.index_add_(0, route.token, (back * slot_weights).to(out.dtype))


@torch.compiler.disable  # token counts decide the all-to-all's sizes on the host: eager inside a compiled block
def _forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
             top_k_weights: torch.Tensor) -> torch.Tensor:
    owner, path = self._expert_parallel
    return owner.run(self, path, hidden_states, top_k_index, top_k_weights)


def apply_expert_parallel(module: nn.Module, topology: Topology, modules: dict[str, nn.Module]) -> ExpertParallel | None:
    """Shard the experts `modules` of `module` over the ep group (None when ep == 1)."""
    return ExpertParallel(module, topology, modules) if topology.config.ep > 1 else None
