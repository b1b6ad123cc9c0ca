"""The single-process reference runs with one intra-op thread, as every rank of
`run_on_ranks` does: summation order inside a kernel then does not depend on the machine's
core count, on either side of a parity comparison."""

import gc
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

# The compiler stack the compile and float8 tests reach (torch.compile's AOT autograd; torchao's
# float8 patches inductor's code generation): preloaded the same way, about half a second a rank.
for module in ("torch._functorch.aot_autograd", "torch._inductor.codegen.triton"):
    importlib.import_module(module)

# Everything imported so far lives as long as the session: out of the cyclic collector's sight,
# each full collection (the interpreter's own, activation_memory's) walks only what tests make.
gc.freeze()


def pytest_unconfigure(config):
    """Hand the frozen objects back before the interpreter's shutdown, which then frees them as
    it would have (extension modules check at exit that their objects were)."""
    gc.unfreeze()


def pytest_runtest_logreport(report):
    """A test rerun after a rank died in native code (pyproject's `--only-rerun`): print what the
    dead rank left on stderr (faulthandler's stacks, glibc's message) and the failure, so the crash
    stays in the log even when the rerun passes."""
    if report.outcome != "rerun":
        return
    lines = [f"\n=== RERUN of {report.nodeid} after a rank died in native code; the first attempt's output ==="]
    lines += [report.capstderr[-6000:], report.longreprtext[-3000:], "=== end of the first attempt ==="]
    print("\n".join(lines), flush=True)
