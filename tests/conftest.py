"""The single-process reference runs with one intra-op thread, as every rank of
`run_on_ranks` does: summation order inside a kernel then does not depend on the machine's
core count, on either side of a parity comparison."""

import torch

torch.set_num_threads(1)
