"""Executors, one subpackage per parallelism, each taking a module, the Topology and the Plan
and returning the module changed (and the object that runs it). `build.py` composes them.

    data/       data parallelism and ZeRO: gradient buckets, sharded optimizer tensors,
                parameter shards, buffers across replicas
    tensor/     tensor and sequence parallelism: DTensor parameters, rules, first-forward checks
    pipeline/   pipeline parallelism: the captured forward split into stages, schedules
    context/    context parallelism: the sequence split and attention over it
    collectives.py  differentiable collectives every parallelism uses
    recompute.py    activation recompute (it composes with each of them)
"""
