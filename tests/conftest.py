"""The single-process reference runs with one intra-op thread, as every rank of
`run_on_ranks` does: summation order inside a kernel then does not depend on the machine's
core count, on either side of a parity comparison."""

import importlib

import torch

torch.set_num_threads(1)

# Hugging Face's model code costs a process seconds of CPU to import (mixtral's and what it
# pulls in: 3-6 s). Imported here, before the first `run_on_ranks` starts its forkserver, it is
# imported once, there (shardwise.testing preloads the transformers modules its caller has),
# instead of in every rank of every spawn that builds one of these models.
HUGGING_FACE_FAMILIES = ("llama", "qwen2", "mistral", "gpt2", "bert", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe",
                         "deepseek_v3")
for family in HUGGING_FACE_FAMILIES:
    importlib.import_module(f"transformers.models.{family}.modeling_{family}")
