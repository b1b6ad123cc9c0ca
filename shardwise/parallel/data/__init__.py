"""Data parallelism and ZeRO: gradients averaged over replicas in flat buckets, optimizer
state (ZeRO-1), gradients (ZeRO-2) and parameters (ZeRO-3) sharded over them.

    buckets.py    `Bucket` and the storages each ZeRO stage keeps (`ZeroStage`)
    replicas.py   `apply_data_parallel`: replicas start equal, each parameter's reduce group
    gradients.py  `GradientBuckets`: reduction during backward
    step_gradients.py  `StepGradients`: one train_step's microbatches and pipeline over them
    zero.py       `OptimizerParams`: what the optimizer updates and how it reaches the model
    zero3.py      `ParameterShards`: parameters gathered per unit around their use
    buffers.py    buffers broadcast across replicas, SyncBatchNorm
"""
