"""Pipeline parallelism: the forward captured once as a program, split into stage modules,
run by a schedule (GPipe, 1F1B, interleaved 1F1B).

    program.py   the captured program and its split into `StageModule`s
    stages.py    `Pipeline`: this rank's stages, the schedule, gradients of tied parameters
    runner.py    our executor of a schedule's order of actions
"""
