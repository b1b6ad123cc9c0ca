"""shardwise: train a single-device torch.nn.Module across many devices, computing what it computes on one."""

from . import plan, testing
from .activations import ActivationMemory, activation_memory
from .parity_check import CheckReport, check
from .checkpoint import load_checkpoint, load_pretrained, merge_checkpoint, save_checkpoint, save_pretrained
from .checkpoint.dcp import dcp_state
from .config import ParallelConfig
from .deferred import deferred_init
from .groups import current_topology, gather, reduce, split
from .errors import (
    BatchError,
    CheckpointError,
    CommunicationError,
    ConfigError,
    ModelError,
    PlanError,
    RankFailedError,
    ShardwiseError,
)
from .build import parallelize
from .loggers import ConsoleLogger, JsonlLogger, TensorBoardLogger, WandbLogger, get_logger
from .loss_scale import LossScaler
from .metrics import StepMetrics
from .module import DataParallelInfo, ParallelModule, data_parallel_info
from .optim import build_optimizer
from .plan import Plan
from .step_output import StepOutput
from .planner import Cluster
from .topology import Topology, init_distributed

# the plan namespace's entries from the layers above it (see plan/__init__.py)
from .parallel.expert.experts import register_experts as _register_experts
from .parallel.tensor.rules import RuleContext as _RuleContext, register_rule as _register_rule
from .planner.search import evaluate as _evaluate
from .planner.search import search as _search

plan.RuleContext, plan.register_rule, plan.search, plan.evaluate = _RuleContext, _register_rule, _search, _evaluate
plan.register_experts = _register_experts

__version__ = "0.1.0"

__all__ = [
    "ActivationMemory",
    "BatchError",
    "CheckReport",
    "CheckpointError",
    "Cluster",
    "CommunicationError",
    "ConfigError",
    "ConsoleLogger",
    "DataParallelInfo",
    "JsonlLogger",
    "LossScaler",
    "ModelError",
    "ParallelConfig",
    "ParallelModule",
    "Plan",
    "PlanError",
    "RankFailedError",
    "ShardwiseError",
    "StepMetrics",
    "StepOutput",
    "TensorBoardLogger",
    "Topology",
    "WandbLogger",
    "activation_memory",
    "build_optimizer",
    "check",
    "current_topology",
    "data_parallel_info",
    "dcp_state",
    "deferred_init",
    "gather",
    "get_logger",
    "init_distributed",
    "load_checkpoint",
    "load_pretrained",
    "merge_checkpoint",
    "parallelize",
    "plan",
    "reduce",
    "save_checkpoint",
    "save_pretrained",
    "split",
    "testing",
]
