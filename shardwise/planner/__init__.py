"""Automatic planning: a model's shapes, a cluster, an analytic cost model and a search.

`sw.plan.search(model, cluster, global_batch=..., seq_len=...)` ranks layouts by predicted
step time among those predicted to fit; `sw.plan.evaluate(model, cluster, config, ...)`
predicts one layout a user has; `sw.parallelize(model, "auto", sample=batch)` runs the best
one for this world.
"""

from .cluster import DEVICES, Cluster, Device
from .model import MODELS, ModelSpec, model_spec
from .search import Candidate, SearchResult, evaluate, search

__all__ = ["DEVICES", "MODELS", "Candidate", "Cluster", "Device", "ModelSpec", "SearchResult", "evaluate", "model_spec", "search"]
