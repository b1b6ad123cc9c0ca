"""Tensor and sequence parallelism: parameters as DTensors sharded over the tp group, each
sharded module computing on its local shards by a rule, activations moved by collectives.

    sharding.py     `apply_tensor_parallel` -> `TensorParallel`: the module changed, its hooks
    conversions.py  the plan's activation keys (`X.input`, `X.output`) as forward hooks
    rules.py        the rules (column, row, embeddings, registered ones) and `register_rule`
    check.py        the first forward's check that sharded features only reach modules that take them
"""
