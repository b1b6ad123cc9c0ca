"""Expert parallelism: mixture-of-experts layers sharded by expert over data-parallel ranks,
and their load-balancing loss taken over the whole batch."""

from .experts import (ExpertParallel, apply_expert_parallel, check_expert_parallel, grouped_experts,
                      register_experts)
from .router import RouterLogitsOverReplicas, apply_router_logits_over_replicas

__all__ = ["ExpertParallel", "RouterLogitsOverReplicas", "apply_expert_parallel", "apply_router_logits_over_replicas",
           "check_expert_parallel", "grouped_experts", "register_experts"]
