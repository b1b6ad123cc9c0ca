"""The planner's time and memory model against this machine's own device: matmuls, attention
and whole training steps measured here, next to what the planner predicts for them.

    python bench/planner_device.py [--steps 6] [--compile] [--fused] [--profile] [--only-steps] [--json out.json]

bench/planner_published.py meets the model with other people's runs; this meets it with a
device in front of us. On a GPU the planner's table entry is chosen from the device's name
(H100, H200, A100, B200); on a CPU the "local" entry and small shapes (a smoke run: the local
entry is rough and not calibrated).

1. Matmuls of the shapes the corpus's layouts run per GPU (Llama 3 1B, 8B, 70B at tp 8 and
   405B at tp 8; 4K-16K tokens per microbatch): forward (tokens x k @ k x n) and its two
   backward matmuls, timed with the device's events, against the planner's
   `matmul_seconds` for the forward times 3 (the model charges backward as twice the forward).
   Printed per shape: TFLOP/s reached, the share of the table's peak, the error. In bf16 and,
   for the small model, float32 (TF32 off, as torch leaves it).
2. Causal attention through torch's SDPA (flash on a GPU), forward and backward, against the
   planner's flash-attention charge.
3. Whole steps: Hugging Face Llama under shardwise at world 1 (bf16 parameters, float32 master
   weights, torch's AdamW: foreach on a GPU), with and without full recomputation, median step
   time (and apart: forward and backward, the optimizer step) and the peak of allocated memory
   inside the step, against `sw.plan.evaluate` for the same layout; with `--compile`, the
   decoder layers compiled too, against the planner's `Cluster(compiled=True)` (a compiled
   block's elementwise traffic, counted by bench/elementwise_count.py; the H200 run in the
   README charged 24 values and ran 10-12% over it); with `--fused`, torch's
   fused AdamW (`fused=True`) against the planner's fused optimizer. `--profile` adds the
   device's kernel time per step by kind (matmul, attention, optimizer, loss, other) and the
   longest kernels.

On an H200 (torch 2.11) this found the optimizer step 4.3x the planner's one fused pass
(torch's foreach Adam makes nine, with casts around them) and its float32 temporaries
putting a step's peak 20-27% above the prediction under full recompute, and, without
recompute, the peak at the start of backward with the loss's float32 gradients of the
logits (7.8 GiB for Llama 3's vocabulary at 8K tokens); all three are in the model now
(timing.optimizer_bytes, transients.step_temporaries, transients.loss_backward_bytes).

Nothing here is asserted: it prints, and `--json` keeps the numbers.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch
import transformers

import shardwise as sw
from llama import EndToEnd
from shardwise.planner.timing import ATTENTION, matmul_seconds

# name: hidden, layers, heads, kv heads, ffn, vocab (Llama 3's shapes; "tiny" for a CPU)
SHAPES = {
    "llama3-1b": (2048, 16, 32, 8, 8192, 128256),
    "llama3-3b": (3072, 28, 24, 8, 8192, 128256),
    "llama3-8b": (4096, 32, 32, 8, 14336, 128256),
    "llama3-70b": (8192, 80, 64, 8, 28672, 128256),
    "llama3-405b": (16384, 126, 128, 8, 53248, 128256),
    "tiny": (256, 2, 4, 2, 704, 1024),
}


def table_entry() -> tuple[str, torch.device]:
    """The planner's device table entry for this machine's accelerator, and the device."""
    if not torch.cuda.is_available():
        return "local", torch.device("cpu")
    name = torch.cuda.get_device_name().upper()
    for key in ("H200", "H100", "A100", "B200"):
        if key in name:
            return key.lower(), torch.device("cuda", torch.cuda.current_device())
    raise SystemExit(f"{name}: not in the planner's device table (h100, h200, a100, b200)")


def cluster_for(entry: str, **overrides) -> sw.Cluster:
    if entry == "local":
        return sw.Cluster(gpus=1, gpus_per_node=1, device="local", memory_bytes=sw.Cluster.local(1).spec.memory_bytes,
                          **overrides)
    return sw.Cluster(gpus=1, gpus_per_node=1, device=entry, **overrides)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_of(fn, device: torch.device, reps: int) -> float:
    """Median seconds of `fn()` over `reps` runs after two warm-ups (events on a GPU)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
    return statistics.median(times)


def matmul_shapes(entry: str) -> list[tuple[str, int, int, int]]:
    """(label, m, n, k) of the forward matmuls a GPU runs per block in the corpus's layouts."""
    if entry == "local":
        models, token_counts = [("tiny", 1)], [256, 1024]
    else:
        models, token_counts = [("llama3-1b", 1), ("llama3-8b", 1), ("llama3-70b", 8), ("llama3-405b", 8)], \
            [2048, 4096, 8192, 16384]
    shapes = []
    for name, tp in models:
        h, _, heads, kv_heads, ffn, _ = SHAPES[name]
        kv = kv_heads * h // heads
        for m in token_counts:
            shapes += [(f"{name} tp{tp} qkv", m, (h + 2 * kv) // tp, h), (f"{name} tp{tp} out", m, h, h // tp),
                       (f"{name} tp{tp} up", m, 2 * ffn // tp, h), (f"{name} tp{tp} down", m, h, ffn // tp)]
    return shapes


def measure_matmuls(entry: str, device: torch.device, dtype: torch.dtype, shapes, reps: int) -> list[dict]:
    cluster = cluster_for(entry)
    nbytes = torch.empty((), dtype=dtype).element_size()
    rows = []
    for label, m, n, k in shapes:
        x = torch.randn(m, k, device=device, dtype=dtype)
        w = torch.randn(k, n, device=device, dtype=dtype)
        dy = torch.randn(m, n, device=device, dtype=dtype)

        def fwd_bwd():
            x @ w  # forward
            dy @ w.T  # input gradient
            x.T @ dy  # weight gradient
        measured = seconds_of(fwd_bwd, device, reps)
        predicted = 3 * float(matmul_seconds(cluster, m, n, k, nbytes))
        flops = 3 * 2 * m * n * k
        peak = cluster.spec.peak_flops if nbytes < 4 else (cluster.spec.fp32_flops or cluster.spec.peak_flops)
        rows.append({"shape": label, "m": m, "n": n, "k": k, "dtype": str(dtype).replace("torch.", ""),
                     "measured_s": measured, "predicted_s": predicted, "tflops": flops / measured / 1e12,
                     "of_peak": flops / measured / peak, "error": predicted / measured - 1})
    return rows


def measure_attention(entry: str, device: torch.device, reps: int) -> list[dict]:
    """Causal SDPA forward and backward, bf16 (float32 on a CPU), against the planner's charge."""
    cluster = cluster_for(entry)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    nbytes = torch.empty((), dtype=dtype).element_size()
    cases = [(4, 256), (4, 512)] if entry == "local" else [(32, 2048), (32, 4096), (32, 8192), (64, 8192)]
    rows = []
    for heads, seq in cases:
        q, k, v = (torch.randn(1, heads, seq, 128 if entry != "local" else 64, device=device, dtype=dtype,
                               requires_grad=True) for _ in range(3))
        grad = torch.randn_like(q)

        def fwd_bwd():
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            torch.autograd.grad(out, (q, k, v), grad)
        measured = seconds_of(fwd_bwd, device, reps)
        hidden = heads * q.shape[-1]
        # the planner: 3 x (2 * tokens * seq * hidden) FLOPs at ATTENTION x a matmul's time (timing.block_seconds)
        predicted = 3 * ATTENTION * 2 * seq * seq * hidden / float(cluster.matmul_flops(nbytes))
        causal_flops = 3.5 * 2 * seq * seq * hidden  # forward 2 matmuls over half the square, backward 2.5x it
        rows.append({"heads": heads, "seq": seq, "head_dim": q.shape[-1], "measured_s": measured, "predicted_s": predicted,
                     "tflops": causal_flops / measured / 1e12, "error": predicted / measured - 1})
    return rows


def _llama(name: str, seq: int, device: torch.device) -> EndToEnd:
    h, layers, heads, kv_heads, ffn, vocab = SHAPES[name]
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=h, intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, max_position_embeddings=seq, tie_word_embeddings=False,
        attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    with torch.device(device):
        return EndToEnd(transformers.LlamaForCausalLM(config))


def measure_step(entry: str, device: torch.device, name: str, seq: int, batch: int, recompute: str | None,
                 compiled: bool, fused: bool = False, steps: int = 6, profile: bool = False) -> dict:
    """One shardwise step of `name` at world 1: median seconds and the in-step allocation peak,
    against sw.plan.evaluate."""
    held_before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    model = _llama(name, seq, device)
    config = sw.ParallelConfig(param_dtype=torch.bfloat16, recompute=recompute)
    cluster = cluster_for(entry, **({"compiled": True} if compiled else {}))
    predicted = sw.plan.evaluate(model, cluster, config, seq_len=seq, global_batch=batch,
                                 optimizer="fused" if fused else None)
    row = {"model": name, "seq": seq, "batch": batch, "recompute": recompute or "none", "compiled": compiled,
           "optimizer": predicted.optimizer,
           "held_before": held_before, "params": sum(p.numel() for p in model.parameters()), "predicted_s": predicted.step_seconds,
           "predicted_bytes": predicted.memory, "fits": predicted.fits,
           "predicted_terms": {k: v for k, v in predicted.time_terms.items() if v},
           "predicted_memory_terms": predicted.memory_terms}
    if not predicted.fits:
        row["skipped"] = "predicted not to fit"
        return row
    pm = sw.parallelize(model, config)
    if compiled:
        pm.compile()
    optimizer = sw.build_optimizer(pm, torch.optim.AdamW, lr=1e-5, **({"fused": True} if fused else {}))
    vocab = SHAPES[name][5]
    gen = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, vocab, (batch, seq), generator=gen)} for _ in range(steps)]

    def step(b):
        pm.train_step(b)
        optimizer.step()
        optimizer.zero_grad()
    for b in batches[:2]:  # warm-up (compile, allocator, optimizer state)
        step(b)
    _sync(device)
    times, passes, updates = [], [], []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for b in batches:
        _sync(device)
        begin = time.perf_counter()
        pm.train_step(b)
        _sync(device)
        middle = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad()
        _sync(device)
        end = time.perf_counter()
        times.append(end - begin)
        passes.append(middle - begin)
        updates.append(end - middle)
    row["forward_backward_s"], row["optimizer_s"] = statistics.median(passes), statistics.median(updates)
    if profile:
        row["kernels"] = kernel_time(lambda: step(batches[0]), device)
    row["measured_s"] = statistics.median(times)
    row["error"] = row["predicted_s"] / row["measured_s"] - 1
    row["tflops"] = predicted.model_flops / row["measured_s"] / 1e12
    row["mfu"] = predicted.model_flops / row["measured_s"] / cluster.spec.peak_flops
    if device.type == "cuda":
        row["measured_bytes"] = torch.cuda.max_memory_allocated(device)
        row["memory_error"] = row["predicted_bytes"] / row["measured_bytes"] - 1
        # what torchtitan publishes (max_reserved_gib): the allocator's cache at the steps' peak
        row["reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    return row


KERNEL_KINDS = (("matmul", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "sm90_", "sm80_", "aten::mm", "aten::addmm", "aten::bmm")),
                ("attention", ("flash", "fmha", "attention", "efficient")),
                ("optimizer", ("multi_tensor", "foreach", "adam")),
                ("loss", ("softmax", "nll", "cross_entropy")))


def kernel_time(step, device: torch.device, steps: int = 2) -> dict:
    """Seconds per step of the device's kernels by kind (matmul, attention, optimizer, loss,
    other: elementwise, norms, copies), the ten longest kernels, and the wall time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    _sync(device)
    begin = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        _sync(device)
    wall = (time.perf_counter() - begin) / steps
    kinds: dict[str, float] = {}
    kernels = []
    for event in prof.key_averages():
        if device.type == "cuda":
            micros = getattr(event, "self_device_time_total", 0) or getattr(event, "self_cuda_time_total", 0)
        else:  # the host's operators, their own time (a CPU runs them; names are aten ops, not kernels)
            micros = event.self_cpu_time_total
        seconds = micros / 1e6 / steps
        if not seconds:
            continue
        name = event.key.lower()
        kind = next((k for k, marks in KERNEL_KINDS if any(m in name for m in marks)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + seconds
        kernels.append((seconds, event.count // steps, event.key[:90]))
    kernels.sort(reverse=True)
    return {"wall_s": wall, "kinds": kinds, "top": kernels[:10]}


def _print(results: dict) -> None:
    print(f"device: {results['device']} (planner entry {results['entry']!r}), torch {results['torch']}")
    print("\nmatmuls, forward + both backward (planner: 3x its forward matmul_seconds)")
    print(f"{'shape':<24}{'m':>6}{'n':>7}{'k':>7} {'dtype':<9}{'ms':>8}{'TFLOP/s':>9}{'of peak':>8}{'pred ms':>9}{'error':>8}")
    for r in results["matmuls"]:
        print(f"{r['shape']:<24}{r['m']:>6}{r['n']:>7}{r['k']:>7} {r['dtype']:<9}{r['measured_s'] * 1e3:>8.3f}"
              f"{r['tflops']:>9.1f}{r['of_peak'] * 100:>7.1f}%{r['predicted_s'] * 1e3:>9.3f}{r['error'] * 100:>+7.1f}%")
    errors = [abs(r["error"]) for r in results["matmuls"]] or [0.0]
    print(f"|error| median {statistics.median(errors) * 100:.1f}%, max {max(errors) * 100:.1f}%")
    print("\ncausal attention (SDPA) forward + backward, one sequence")
    for r in results["attention"]:
        print(f"heads {r['heads']:>3}x{r['head_dim']} seq {r['seq']:>5}: {r['measured_s'] * 1e3:8.3f} ms, {r['tflops']:6.1f} TFLOP/s "
              f"(causal FLOPs); planner {r['predicted_s'] * 1e3:8.3f} ms ({r['error'] * 100:+.1f}%)")
    print("\nwhole steps, shardwise at world 1 (bf16 params, fp32 master weights, AdamW)", flush=True)


def _print_step(r: dict) -> None:
    label = (f"{r['model']} ({r['params'] / 1e9:.2f} B) {r['batch']}x{r['seq']} rc:{r['recompute']}"
             + (" compiled" if r["compiled"] else " eager") + f", {r['optimizer']} AdamW")
    if "skipped" in r:
        print(f"{label}: {r['skipped']} ({r['predicted_bytes'] / 2 ** 30:.1f} GiB)")
        return
    line = (f"{label}: {r['measured_s'] * 1e3:.1f} ms ({r['mfu'] * 100:.1f}% MFU), planner "
            f"{r['predicted_s'] * 1e3:.1f} ms ({r['error'] * 100:+.1f}%)")
    if "measured_bytes" in r:
        line += (f"; peak {r['measured_bytes'] / 2 ** 30:.2f} GiB, planner {r['predicted_bytes'] / 2 ** 30:.2f} "
                 f"GiB ({r['memory_error'] * 100:+.1f}%); reserved {r['reserved_bytes'] / 2 ** 30:.2f} GiB "
                 f"({r['reserved_bytes'] / r['measured_bytes'] - 1:+.1%} over the peak); held before the case "
                 f"{r['held_before'] / 2 ** 30:.2f} GiB")
    print(line)
    terms = r["predicted_terms"]
    passes = terms.get("compute", 0.0) + terms.get("recompute", 0.0)
    print(f"    forward+backward {r['forward_backward_s'] * 1e3:.1f} ms, planner {passes * 1e3:.1f} "
          f"({passes / r['forward_backward_s'] - 1:+.1%}); optimizer step {r['optimizer_s'] * 1e3:.1f} ms, planner "
          f"{terms.get('optimizer_step', 0.0) * 1e3:.1f} ({terms.get('optimizer_step', 0.0) / r['optimizer_s'] - 1:+.1%})")
    if "kernels" in r:
        k = r["kernels"]
        print(f"    kernels per step (profiled, wall {k['wall_s'] * 1e3:.1f} ms): "
              + ", ".join(f"{kind} {t * 1e3:.1f}" for kind, t in sorted(k["kinds"].items(), key=lambda kv: -kv[1]))
              + f"; sum {sum(k['kinds'].values()) * 1e3:.1f} ms")
        for seconds, count, name in k["top"]:
            print(f"      {seconds * 1e3:7.2f} ms  x{count:<4} {name}")
    print("    planner terms (ms): " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in r["predicted_terms"].items()),
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="timed steps per whole-step case")
    parser.add_argument("--reps", type=int, default=20, help="timed runs per matmul / attention case")
    parser.add_argument("--compile", action="store_true", help="also time compiled decoder layers")
    parser.add_argument("--fused", action="store_true", help="also time torch's fused AdamW (fused=True)")
    parser.add_argument("--profile", action="store_true", help="kernel time by kind for each whole-step case")
    parser.add_argument("--only-steps", action="store_true", help="skip the matmul and attention sweeps")
    parser.add_argument("--json", help="write the numbers here")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False  # torch's default; the planner charges float32 at float32's rate
    entry, device = table_entry()
    sw.init_distributed()
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "entry": entry,
               "torch": torch.__version__}
    shapes = [] if args.only_steps else matmul_shapes(entry)
    results["matmuls"] = measure_matmuls(entry, device, torch.bfloat16 if entry != "local" else torch.float32,
                                         shapes, args.reps)
    if entry != "local":
        results["matmuls"] += measure_matmuls(entry, device, torch.float32, [s for s in shapes if "1b" in s[0]], 5)
    results["attention"] = [] if args.only_steps else measure_attention(entry, device, args.reps)
    if entry == "local":
        cases = [("tiny", 256, 2, None, False), ("tiny", 256, 2, "full", False)]
    else:
        cases = [("llama3-1b", 4096, 2, None, False), ("llama3-1b", 4096, 2, "full", False),
                 ("llama3-1b", 8192, 1, None, False), ("llama3-3b", 4096, 2, None, False),
                 ("llama3-3b", 4096, 2, "full", False)]
    if args.compile:
        cases += [(name, seq, batch, recompute, True) for name, seq, batch, recompute, _ in cases[:2]]
    if args.fused:  # torch's fused AdamW (fused=True) on the first cases
        cases += [(name, seq, batch, recompute, compiled, True) for name, seq, batch, recompute, compiled in cases[:2]]
    _print(results)
    results["steps"] = []
    for case in cases:
        results["steps"].append(measure_step(entry, device, *case, steps=args.steps, profile=args.profile))
        _print_step(results["steps"][-1])
        gc.collect()  # the parallel module's hooks hold reference cycles: free the model before the next
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
