"""The `shardwise` command.

`shardwise demo` trains the reference GPT on local processes (gloo on CPU by default) and
then the same steps on one process, and prints both losses side by side with whether
they agree: the product's promise, shown in a minute on a laptop.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import click
import torch
from safetensors.torch import load_file

from .checkpoint import merge_checkpoint
from .config import SCHEDULES, ParallelConfig
from .errors import ShardwiseError


@dataclass
class DemoSettings:
    ranks: int
    tp: int
    pp: int
    cp: int
    schedule: str
    steps: int
    batch: int
    microbatches: int
    lr: float
    seed: int
    backend: str
    checkpoint: str


def _demo_data(settings: DemoSettings):
    from .models import CharTokenizer, GPTConfig, tiny_corpus, token_batches

    text = tiny_corpus(seed=settings.seed)
    tokenizer = CharTokenizer(text)
    vocab = -(-tokenizer.vocab_size // 8) * 8  # padded so tensor parallelism can split it
    gpt_config = GPTConfig(vocab_size=vocab, block_size=32, n_layer=2, n_head=4, d_model=64)
    batches = [{"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}  # pre-shifted labels (as cp needs)
               for tokens in token_batches(tokenizer.encode(text), settings.batch, 32, settings.steps, seed=settings.seed)]
    return gpt_config, batches


def _samples(batch: dict, start: int, stop: int) -> dict:
    return {key: value[start:stop] for key, value in batch.items()}


def _demo_model(gpt_config, seed: int):
    from .models import GPT

    torch.manual_seed(seed)
    return GPT(gpt_config)


def _demo_rank(settings: DemoSettings):
    """One rank of the parallel run: train half the steps, save, resume in a fresh model from
    the checkpoint, train the rest, save again. Rank 0 draws the progress bar."""
    from tqdm import tqdm

    import shardwise as sw

    gpt_config, batches = _demo_data(settings)
    config = ParallelConfig(tp=settings.tp, pp=settings.pp, cp=settings.cp, microbatches=settings.microbatches,
                            schedule=settings.schedule)
    replicas = settings.ranks // (settings.tp * settings.pp * settings.cp)
    per = settings.batch // replicas
    plan = "gpt" if settings.tp > 1 else None

    def build(seed: int):
        pmodel = sw.parallelize(_demo_model(gpt_config, seed), config, plan=plan, sample=_samples(batches[0], 0, per))
        return pmodel, sw.build_optimizer(pmodel, torch.optim.AdamW, lr=settings.lr)

    pmodel, optimizer = build(settings.seed)
    replica, replicas = sw.data_parallel_info(pmodel)
    first = pmodel.topology.rank == 0
    half = settings.steps // 2
    losses = []
    start = time.perf_counter()
    with tqdm(total=settings.steps, desc=f"parallel ({settings.ranks} ranks)", disable=not first, leave=True) as bar:
        for step, batch in enumerate(batches):
            if step == half:  # save, then carry on in a fresh model resumed from the checkpoint
                sw.save_checkpoint(settings.checkpoint, pmodel, optimizer)
                pmodel, optimizer = build(settings.seed + 1)
                sw.load_checkpoint(settings.checkpoint, pmodel, optimizer)
                bar.write(f"step {step}: saved and resumed from {settings.checkpoint}")
            loss = pmodel.train_step(_samples(batch, replica * per, (replica + 1) * per))
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss))
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
            bar.update()
    elapsed = time.perf_counter() - start
    sw.save_checkpoint(settings.checkpoint, pmodel, optimizer)
    if not first:
        return None
    return {"losses": losses, "summary": pmodel.summary(), "seconds": elapsed}


def _single_process(settings: DemoSettings):
    from tqdm import tqdm

    gpt_config, batches = _demo_data(settings)
    model = _demo_model(gpt_config, settings.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr)
    losses = []
    for batch in tqdm(batches, desc="single process", leave=True):
        loss = model(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses, model.state_dict()


class _Commands(click.Group):
    """Commands whose ShardwiseErrors print as one line and exit with status 1."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except ShardwiseError as exc:
            raise click.ClickException(str(exc)) from None


POSITIVE = click.IntRange(min=1)


@click.group(cls=_Commands)
@click.version_option(package_name="shardwise")
def main() -> None:
    """shardwise: train one torch.nn.Module across many devices."""


@main.command()
@click.option("--ranks", default=4, show_default=True, type=POSITIVE, help="Local processes to train on.")
@click.option("--tp", default=1, show_default=True, type=POSITIVE, help="Tensor-parallel degree (the zoo 'gpt' plan).")
@click.option("--pp", default=1, show_default=True, type=POSITIVE,
              help="Pipeline-parallel degree.")
@click.option("--cp", default=1, show_default=True, type=POSITIVE,
              help="Context-parallel degree: each sequence split over cp ranks; dp = ranks / (tp * pp * cp).")
@click.option("--schedule", default="1f1b", show_default=True,
              type=click.Choice(list(SCHEDULES)), help="Pipeline schedule.")
@click.option("--steps", default=40, show_default=True, type=POSITIVE, help="Optimizer steps.")
@click.option("--batch", default=16, show_default=True, type=POSITIVE, help="Global batch size (split across replicas).")
@click.option("--microbatches", default=2, show_default=True, type=POSITIVE, help="Microbatches per replica per step.")
@click.option("--lr", default=3e-3, show_default=True, type=click.FloatRange(min=0.0, min_open=True),
              help="AdamW learning rate.")
@click.option("--seed", default=0, show_default=True)
@click.option("--backend", default="gloo", show_default=True, type=click.Choice(["gloo", "nccl"]),
              help="torch.distributed backend for the ranks (nccl: one GPU per rank).")
@click.option("--checkpoint", default=None, help="Checkpoint directory (default: a temporary one).")
def demo(ranks: int, tp: int, pp: int, cp: int, schedule: str, steps: int, batch: int, microbatches: int, lr: float,
         seed: int, backend: str, checkpoint: str | None) -> None:
    """Train the reference GPT on local ranks (data, tensor, pipeline, context parallel), then on one process, and compare."""
    from .testing import run_on_ranks

    if ranks % (tp * pp * cp):
        raise click.BadParameter(f"--tp {tp} x --pp {pp} x --cp {cp} must divide --ranks {ranks}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "nccl" and gpus < ranks:
        raise click.BadParameter(f"--backend nccl needs a GPU per rank: --ranks {ranks}, {gpus} GPU(s) here; use "
                                 "--backend gloo or fewer --ranks")
    replicas = ranks // (tp * pp * cp)
    if batch % (replicas * microbatches):
        raise click.BadParameter(f"--batch {batch} must be a multiple of replicas*microbatches = {replicas * microbatches}")
    with tempfile.TemporaryDirectory() as scratch:
        settings = DemoSettings(ranks, tp, pp, cp, schedule, steps, batch, microbatches, lr, seed, backend,
                                checkpoint or str(Path(scratch) / "checkpoint"))
        click.echo(f"shardwise demo: {asdict(settings)}")
        result = run_on_ranks(_demo_rank, ranks, settings, backend=backend, timeout=1800)[0]
        click.echo(result["summary"])
        merged = Path(scratch) / "gpt.safetensors"
        merge_checkpoint(settings.checkpoint, merged)
        model = _demo_model(_demo_data(settings)[0], seed + 2)
        model.load_state_dict(load_file(str(merged)), strict=True)  # the plain module, from one file
        merged_state = model.state_dict()
    click.echo("merged the last checkpoint into one file and loaded it into a plain GPT (strict=True)")
    single_losses, single_state = _single_process(settings)

    losses = result["losses"]
    shown = sorted(i for i in {0, 1, 2, *range(4, steps, max(1, steps // 8)), steps - 1} if i < steps)
    click.echo(f"\n{'step':>5}  {'parallel':>10}  {'single':>10}  {'|diff|':>9}")
    for i in shown:
        click.echo(f"{i:>5}  {losses[i]:>10.6f}  {single_losses[i]:>10.6f}  {abs(losses[i] - single_losses[i]):>9.2e}")
    loss_diff = max(abs(a - b) for a, b in zip(losses, single_losses))
    param_diff = max(float((single_state[k] - merged_state[k]).abs().max()) for k in single_state)
    agree = loss_diff <= 1e-4 * max(1.0, abs(single_losses[0]))
    click.echo(
        f"\nmax |loss diff| {loss_diff:.2e}, max |parameter diff| {param_diff:.2e} after {steps} AdamW steps "
        f"({result['seconds']:.1f}s on {ranks} ranks)"
    )
    click.echo("agree: yes — the parallel run computes what one process computes" if agree
               else "agree: NO — the parallel run diverged from one process")
    if not agree:
        raise SystemExit(1)


@main.command()
@click.argument("checkpoint", type=click.Path(exists=True, file_okay=False))
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--optimizer", is_flag=True, help="Also write OUT.optimizer.pt, the merged optimizer state.")
def merge(checkpoint: str, out: str, optimizer: bool) -> None:
    """Merge CHECKPOINT (saved by sw.save_checkpoint in any layout) into one state dict OUT
    (.safetensors or .pt) that the original module loads with load_state_dict."""
    path = merge_checkpoint(checkpoint, out, optimizer=optimizer)
    click.echo(f"wrote {path}" + (f" and {path}.optimizer.pt" if optimizer else ""))


@main.command()
@click.argument("checkpoint", type=click.Path(exists=True, file_okay=False))
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--hf", "hugging_face", is_flag=True, required=True,
              help="Write a Hugging Face directory (config.json, safetensors) that from_pretrained reads.")
@click.option("--model", "model_name", required=True,
              help="pkg.module:factory building the module the checkpoint was saved from (config and key names).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
              help="Cast floating tensors to this dtype (default: as saved).")
def export(checkpoint: str, out: str, hugging_face: bool, model_name: str, dtype: str | None) -> None:
    """Export CHECKPOINT (saved by sw.save_checkpoint in any layout) as a Hugging Face model in OUT."""
    import os
    import sys

    from .checkpoint import export_pretrained
    from .parity_check import resolve

    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    factory = resolve(model_name)
    try:
        with torch.device("meta"):  # config and names only: nothing is allocated
            module = factory()
    except Exception as exc:  # noqa: BLE001 - the user's factory: its failure, named
        raise click.BadParameter(f"{model_name}() raised {type(exc).__name__}: {exc}") from None
    path = export_pretrained(checkpoint, out, module, getattr(torch, dtype) if dtype else None)
    click.echo(f"wrote {path} (from_pretrained reads it)")


def _count(text: str) -> int:
    """'16M', '512K', '2G' or a plain integer."""
    scale = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}.get(text[-1:].upper(), 1)
    digits = text[:-1] if scale > 1 else text
    try:
        value = int(digits) * scale
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a count like 16M, 512K or 4096") from None
    if value < 1:
        raise click.BadParameter(f"{text!r} must be positive")
    return value


def _plan_model(name: str):
    """A name from the planner's table, or `package.module:factory` built on the meta device."""
    from .planner import MODELS

    if name in MODELS or ":" not in name:
        return name
    import importlib

    module_name, _, attr = name.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise click.BadParameter(f"cannot import {name!r}: {exc}") from None
    try:
        with torch.device("meta"):  # shapes only: nothing is allocated
            built = factory()
    except Exception as exc:  # noqa: BLE001 - the user's factory: its failure, named
        raise click.BadParameter(f"{name}() raised {type(exc).__name__}: {exc}; give a function that builds the "
                                 "model with no arguments") from None
    if not isinstance(built, torch.nn.Module) and not hasattr(built, "model_type"):
        raise click.BadParameter(f"{name}() returned a {type(built).__name__}, not a torch.nn.Module or a "
                                 "transformers config")
    return built


@main.command()
@click.option("--model", "model_name", required=True,
              help="A known model (llama3-8b, llama3-70b, llama3-405b, qwen2-7b, mistral-7b, gpt2) or pkg.module:factory.")
@click.option("--gpus", required=True, type=POSITIVE, help="GPUs (or local ranks with --device local).")
@click.option("--device", default="h100", show_default=True, help="h100, h200, a100, b200 or local.")
@click.option("--gpus-per-node", default=8, show_default=True, type=POSITIVE)
@click.option("--nics-per-node", default=None, type=POSITIVE,
              help="NICs a node's cross-node collectives spread over. [default: one per GPU]")
@click.option("--seq", "seq_len", required=True, type=POSITIVE, help="Tokens per sequence.")
@click.option("--optimizer", default=None, type=click.Choice(["fused", "foreach", "for-loop"]),
              help="How the optimizer runs (fused: torch's fused=True). [default: torch's for the device]")
@click.option("--compiled", is_flag=True, help="The blocks will run under pmodel.compile() (fused elementwise kernels).")
@click.option("--global-tokens", default=None, help="Tokens per optimizer step, e.g. 16M.")
@click.option("--global-batch", default=None, type=POSITIVE, help="Sequences per optimizer step.")
@click.option("--top", default=10, show_default=True, type=POSITIVE)
@click.option("--json", "as_json", is_flag=True, help="Print the candidates as JSON.")
@click.option("--explain", "explain_first", is_flag=True, help="Also print the best candidate's breakdown.")
def plan(model_name: str, gpus: int, device: str, gpus_per_node: int, nics_per_node: int | None, seq_len: int,
         optimizer: str | None, compiled: bool, global_tokens: str | None, global_batch: int | None, top: int,
         as_json: bool, explain_first: bool) -> None:
    """Rank the layouts of a model on a cluster by predicted step time, among those predicted to fit."""
    import dataclasses
    import json

    from .planner import Cluster, search
    from .planner.format import as_json as to_json
    from .planner.format import table

    if (global_tokens is None) == (global_batch is None):
        raise click.UsageError("give one of --global-tokens and --global-batch")
    cluster = Cluster.local(gpus) if device == "local" else Cluster(gpus, gpus_per_node=gpus_per_node, device=device,
                                                                    nics_per_node=nics_per_node)
    cluster = dataclasses.replace(cluster, compiled=compiled)
    result = search(_plan_model(model_name), cluster, global_batch=global_batch, seq_len=seq_len,
                    global_tokens=_count(global_tokens) if global_tokens else None, top=top, progress=not as_json,
                    optimizer=optimizer)
    if as_json:
        click.echo(json.dumps(to_json(result), indent=1))
        return
    if not result:
        raise click.ClickException(f"no layout of {model_name} fits {gpus} x {device} at seq {seq_len} "
                                   f"({result.evaluated} evaluated); add GPUs or shorten the sequence")
    click.echo(table(result))
    if explain_first:
        click.echo("\n" + result[0].explain())


@main.command()
@click.argument("model")
@click.argument("batches")
@click.option("--ranks", required=True, type=POSITIVE, help="Local processes to run the layout on.")
@click.option("--tp", default=1, show_default=True, type=POSITIVE)
@click.option("--pp", default=1, show_default=True, type=POSITIVE)
@click.option("--cp", default=1, show_default=True, type=POSITIVE)
@click.option("--ep", default=1, show_default=True, type=POSITIVE, help="Experts split over this many dp ranks.")
@click.option("--zero", default=0, show_default=True, type=click.IntRange(0, 3))
@click.option("--microbatches", default=1, show_default=True, type=POSITIVE)
@click.option("--schedule", default="1f1b", show_default=True, type=click.Choice(list(SCHEDULES)))
@click.option("--sequence-parallel", is_flag=True)
@click.option("--plan", "plan_name", default=None, help="A zoo plan name, a plan .json file, or auto.")
@click.option("--steps", default=3, show_default=True, type=POSITIVE, help="SGD steps compared.")
@click.option("--lr", default=1e-2, show_default=True, type=click.FloatRange(min=0.0, min_open=True))
@click.option("--tolerance", default=None, type=click.FloatRange(min=0.0, min_open=True),
              help="Largest relative difference accepted (default 1e-2; 5e-2 under half precision).")
def check(model: str, batches: str, ranks: int, tp: int, pp: int, cp: int, ep: int, zero: int, microbatches: int,
          schedule: str, sequence_parallel: bool, plan_name: str | None, steps: int, lr: float,
          tolerance: float | None) -> None:
    """Train MODEL (pkg.module:factory) on one process and in the layout on local ranks, on the
    global batches BATCHES (pkg.module:factory returning a list) gives; compare gradients,
    parameters and losses per module. Exit status 1 when they disagree."""
    import os
    import sys

    from .parity_check import check as run_check

    if os.getcwd() not in sys.path:  # the user's package, as `python -m` would find it (the ranks inherit it)
        sys.path.insert(0, os.getcwd())
    config = ParallelConfig(tp=tp, pp=pp, cp=cp, ep=ep, zero=zero, microbatches=microbatches, schedule=schedule,
                            sequence_parallel=sequence_parallel)
    report = run_check(model, batches, config, ranks=ranks, plan=plan_name, steps=steps, lr=lr, tolerance=tolerance)
    click.echo(f"shardwise check: {config.describe()} on {ranks} ranks, plan {plan_name or 'none'}, {steps} steps")
    click.echo(report.table())
    if not report.ok:
        sys.exit(1)
