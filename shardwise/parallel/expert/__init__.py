"""Expert parallelism: mixture-of-experts layers sharded by expert over data-parallel ranks."""

from .experts import ExpertParallel, apply_expert_parallel, check_expert_parallel, grouped_experts

__all__ = ["ExpertParallel", "apply_expert_parallel", "check_expert_parallel", "grouped_experts"]
