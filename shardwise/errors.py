"""The exceptions shardwise raises.

Every error a user can cause derives from `ShardwiseError`, and each message names the
offending value and the fix. Configuration, plan and model errors are raised before any
collective is issued, so every rank raises the same error instead of some ranks hanging.
"""

from __future__ import annotations


class ShardwiseError(Exception):
    """Base class of every error shardwise raises on purpose."""


class ConfigError(ShardwiseError, ValueError):
    """A `ParallelConfig` that cannot run on this world (degrees, zero stage, schedule...)."""


class PlanError(ShardwiseError, ValueError):
    """A sharding plan that does not fit the module it is applied to."""


class ModelError(ShardwiseError, TypeError):
    """A module that breaks the contract shardwise needs (no parameters, no loss first...)."""


class BatchError(ShardwiseError, ValueError):
    """A batch that cannot be split or routed as the config asks."""


class CommunicationError(ShardwiseError, RuntimeError):
    """A collective that failed or timed out; names the rank, the operation and the group."""


class RankFailedError(ShardwiseError, RuntimeError):
    """A worker process of `shardwise.testing.run_on_ranks` raised, died or timed out."""


class CheckpointError(ShardwiseError, ValueError):
    """A state dict or checkpoint that does not match the module it is loaded into."""
