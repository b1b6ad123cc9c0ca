"""The machine's own device: a world of one process on it trains as one plain CPU process does.

Where CUDA is available the rank runs on the GPU with NCCL (its CPU agreements on a gloo
control group, as under `init_distributed`'s "cpu:gloo,cuda:nccl"), the tensors, streams and
communicators a GPU user's run goes through; elsewhere
on the CPU with gloo, so this test runs, and can fail, on every machine. One process: NCCL wants
a GPU per rank, and the suite's layouts of several ranks run on gloo (tests/parity.py).

Checked in one spawn, each against tests/parity.py's bounds:
- our GPT and Hugging Face Llama, eager and with `pmodel.compile()` (fullgraph blocks;
  inductor on the accelerator, the kernels its users run; Dynamo's eager backend on a CPU,
  where tests/test_compile.py already covers compiling and inductor's C++ build would cost
  the suite a minute);
- a checkpoint written from the device, and the whole state dicts, load into a fresh model bit
  for bit (model and AdamW state, each value on the device the optimizer keeps it: torch's
  AdamW keeps `step` on the CPU), and the step after matches the step the saved model takes;
- config="auto" plans on the device's own table entry and memory (the host's before: a CPU's
  rates and RAM on a GPU machine).

Tolerance. The reference runs on the CPU. A GPU's kernels sum in other orders (blocking,
split reductions, fused multiply-adds) and its exp, log and rsqrt differ from the CPU's by a
few units in the last place: per operation an error of a few u = 2^-24, the reordered float32
arithmetic the parity bounds are derived for. That holds only while float32 matmuls stay
float32: TF32 keeps 10 mantissa bits (u = 2^-11), far past the bounds, so the rank asserts it
is off. Faults: a run left on the CPU where an accelerator exists fails the device check; a
gradient not averaged, a missed step or a wrong load fails the parity or the equality.
"""

from __future__ import annotations

import functools

import torch

import shardwise as sw
from shardwise.planner.auto import job_cluster
from shardwise.planner.cluster import device_kind
from shardwise.topology import backend_device
from parity import EPS_LOSS, Run, assert_meaningful, assert_parity, gpt_batches, make_gpt, reference_run, \
    train_parallel
from test_zoo import batches as hf_batches, make as hf_model


def _device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


CASES = {  # name: (factory, batches, compile_kwargs)
    "gpt eager": (make_gpt, gpt_batches(3, 8), None),
    "gpt compiled": (make_gpt, gpt_batches(3, 8), {}),
    "llama eager": (functools.partial(hf_model, "llama"), hf_batches("llama", 4), None),
    "llama compiled": (functools.partial(hf_model, "llama"), hf_batches("llama", 4), {}),
}


def _on_cpu(run: Run) -> Run:
    run.grads = [{k: v.cpu() for k, v in grads.items()} for grads in run.grads]
    run.final = {k: v.cpu() for k, v in run.final.items()}
    return run


def _same_state(a: dict, b: dict) -> bool:
    """Equal optimizer states, each value on the same device (a loaded `step` on the GPU would make
    every update of a non-capturable optimizer read it back: a device sync per parameter)."""
    return a.keys() == b.keys() and all(
        a[k].keys() == b[k].keys() and all(a[k][f].device == b[k][f].device and torch.equal(a[k][f], b[k][f])
                                           for f in a[k]) for k in a)


def _checkpoint_round_trip(directory: str) -> dict:
    """Train 2 AdamW steps, save; load into models built from another seed, by `load_checkpoint`
    and by the optimizer's whole state dict; then one more step on each."""
    batches = gpt_batches(3, 8)
    models = []
    for seed in (0, 1, 2):
        pm = sw.parallelize(make_gpt(seed=seed), sw.ParallelConfig())
        models.append((pm, sw.build_optimizer(pm, torch.optim.AdamW, lr=1e-3)))
    (saved, saved_opt), (loaded, loaded_opt), (given, given_opt) = models
    for batch in batches[:2]:
        saved.train_step(batch)
        saved_opt.step()
        saved_opt.zero_grad()
    sw.save_checkpoint(directory, saved, saved_opt)
    sw.load_checkpoint(directory, loaded, loaded_opt)
    given.load_full_state_dict(saved.full_state_dict())
    given_opt.load_full_state_dict(saved_opt.full_state_dict())
    result = {"devices": {str(p.device) for pm, _ in models for p in pm.module.parameters()}}
    for name, (pm, opt) in (("load_checkpoint", (loaded, loaded_opt)), ("full state dicts", (given, given_opt))):
        same_model = all(torch.equal(a, b) for a, b in zip(saved.full_state_dict().values(),
                                                             pm.full_state_dict().values()))
        result[name] = same_model and _same_state(saved_opt.state_dict()["state"], opt.state_dict()["state"])
    result["losses"] = [float(pm.train_step(batches[2])) for pm, _ in models]
    return result


def _rank(directory: str) -> dict:
    assert not torch.backends.cuda.matmul.allow_tf32 and torch.get_float32_matmul_precision() == "highest"
    compile_backend = "inductor" if torch.cuda.is_available() else "eager"
    runs, devices = {}, {}
    for name, (factory, batches, compile_kwargs) in CASES.items():
        torch._dynamo.reset()
        kwargs = None if compile_kwargs is None else {"backend": compile_backend, **compile_kwargs}
        run = train_parallel({}, factory, batches, compile_kwargs=kwargs)
        devices[name] = {v.device.type for v in run.final.values()}
        runs[name] = _on_cpu(run)
    cluster = job_cluster(1, backend_device())  # what config="auto" plans on
    return {"runs": runs, "devices": devices, "checkpoint": _checkpoint_round_trip(directory),
            "cluster": (cluster.device, cluster.spec.memory_bytes)}


def test_one_process_on_the_machines_device_trains_as_the_cpu_does(tmp_path):
    result = sw.testing.run_on_ranks(_rank, 1, str(tmp_path / "ckpt"), backend=_backend(), timeout=900)[0]
    assert all(found == {_device_type()} for found in result["devices"].values()), result["devices"]
    for name, (factory, batches, _) in CASES.items():
        reference = reference_run(factory, batches)
        assert_meaningful(reference)
        try:
            assert_parity(reference, result["runs"][name])
        except AssertionError as exc:
            raise AssertionError(f"{name} on {_device_type()}: {exc}") from None
    if torch.cuda.is_available():  # "auto" plans on the GPU's entry and memory, not the host's
        kind = device_kind(torch.cuda.get_device_name(0)) or "h100"
        assert result["cluster"] == (kind, float(torch.cuda.get_device_properties(0).total_memory)), result["cluster"]
    else:
        assert result["cluster"][0] == "local", result["cluster"]
    checkpoint = result["checkpoint"]
    assert {d.split(":")[0] for d in checkpoint["devices"]} == {_device_type()}, checkpoint["devices"]
    assert checkpoint["load_checkpoint"] and checkpoint["full state dicts"], checkpoint
    saved, *loaded = checkpoint["losses"]
    assert all(abs(saved - other) <= EPS_LOSS * abs(saved) for other in loaded), checkpoint["losses"]
