"""Plans: placements by module-path pattern, stages, ZeRO stage and recompute, as data."""

from .plan import Plan, as_plan, parse_placement, placement_str

__all__ = ["Plan", "as_plan", "parse_placement", "placement_str"]
