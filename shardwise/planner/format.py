"""Printing predictions: the ranked table, one candidate's breakdown, JSON."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .search import Candidate, SearchResult

GIB = 2.0 ** 30
MEMORY_LABELS = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer", "activations": "activations",
                 "buffers": "buffers", "step_temporaries": "optimizer step"}
TIME_LABELS = {"compute": "compute", "recompute": "recompute", "tp_comm": "tp collectives", "cp_comm": "cp K/V exchange",
               "ep_comm": "ep all-to-all",
               "pp_comm": "pipeline p2p", "bubble": "pipeline bubble", "dp_comm": "dp/ZeRO exposed",
               "optimizer_step": "optimizer step"}


def table(result: "SearchResult") -> str:
    head = (f"{'#':>2}  {'layout':<62} {'mem GiB':>8} {'par+grad+opt':>13} {'act':>6} "
            f"{'step s':>8} {'MFU':>6} {'tok/s/gpu':>10}")
    lines = [head]
    for i, c in enumerate(result, 1):
        m = c.memory_terms
        states = (m["params"] + m["grads"] + m["optimizer"]) / GIB
        lines.append(f"{i:>2}  {c.layout():<62} {c.memory / GIB:>8.1f} {states:>13.1f} "
                     f"{m['activations'] / GIB:>6.1f} {c.step_seconds:>8.3f} {c.mfu:>6.1%} "
                     f"{c.tokens_per_second_per_gpu:>10.0f}")
    lines.append(f"{result.evaluated} layouts evaluated ({result.fitting} fit) in {result.seconds:.2f} s, "
                 f"{result.per_second:,.0f} per second")
    return "\n".join(lines)


def explain(c: "Candidate") -> str:
    """The breakdown of one prediction, and each term against the runner-up's."""
    other = c.runner_up
    lines = [f"{c.layout()}  ({c.spec.name} on {c.cluster.gpus} x {c.cluster.device}, seq {c.seq_len}, "
             f"{c.tokens_per_step} tokens per step, {c.optimizer} optimizer"
             + (", compiled blocks)" if c.cluster.compiled else ")"),
             f"memory on the busiest rank: {c.memory / GIB:.2f} GiB of {c.cluster.usable_bytes / GIB:.1f} usable"]
    for key, label in MEMORY_LABELS.items():
        diff = f"   runner-up {other.memory_terms[key] / GIB:8.2f}" if other else ""
        lines.append(f"  {label:<18} {c.memory_terms[key] / GIB:8.2f} GiB{diff}")
    lines.append(f"step time: {c.step_seconds:.4f} s, MFU {c.mfu:.1%}, {c.tokens_per_second_per_gpu:,.0f} tokens/s per GPU")
    for key, label in TIME_LABELS.items():
        diff = f"   runner-up {other.time_terms[key]:9.4f}" if other else ""
        lines.append(f"  {label:<18} {c.time_terms[key]:9.4f} s{diff}")
    if other:
        mine, theirs = c.step_seconds / c.tokens_per_step, other.step_seconds / other.tokens_per_step
        gains = sorted(((other.time_terms[k] / other.tokens_per_step - c.time_terms[k] / c.tokens_per_step, k)
                        for k in TIME_LABELS), reverse=True)
        why = ", ".join(f"{TIME_LABELS[k]} {gain * c.tokens_per_step:+.4f} s" for gain, k in gains[:2] if gain > 0)
        lines.append(f"beats the runner-up ({other.layout()}) by {(theirs - mine) / theirs:.1%} per token"
                     + (f": less {why}" if why else ""))
    return "\n".join(lines)


def as_json(result: "SearchResult") -> list[dict]:
    return [{"layout": c.layout(), "dp": c.config.dp, "tp": c.config.tp, "pp": c.config.pp, "cp": c.config.cp,
             "zero": c.config.zero, "sequence_parallel": c.config.sequence_parallel, "micro_batch": c.micro_batch,
             "microbatches": c.config.microbatches, "schedule": c.config.schedule, "virtual_stages": c.virtual,
             "recompute": c.config.recompute, "dtype": "bf16" if c.config.param_dtype is not None else "fp32",
             "optimizer": c.optimizer, "compiled": c.cluster.compiled,
             "memory_bytes": c.memory_terms, "step_seconds": c.step_seconds, "time_seconds": c.time_terms,
             "mfu": c.mfu, "tokens_per_second_per_gpu": c.tokens_per_second_per_gpu} for c in result]
