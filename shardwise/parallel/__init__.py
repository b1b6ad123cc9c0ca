"""Executors, one file per kind of parallelism; each takes a module, the Topology and the Plan."""
