"""Which pipeline rank holds which module's states: each rank keeps only the parameters and
buffers of the stages it runs, and parameters shared by stages on several ranks (an input
embedding tied to the output head) are named so that their gradients can be summed. A
dropped unit refuses a direct call of the model, which would reach it."""

from __future__ import annotations

import functools

from torch import nn

from ...errors import ModelError
from ...plan.stages import StageLayout


def prune_to_stages(module: nn.Module, layout: StageLayout, pp_rank: int) -> dict[str, int]:
    """Drop the parameters and buffers of modules this pipeline rank never runs.

    Returns the full state dict's keys -> the stage holding each, for gathering it.
    """
    mine = set(layout.stages_of_rank(pp_rank))
    unit_of = {}
    for path in layout.stage_of:
        for sub, _ in module.get_submodule(path).named_modules():
            unit_of[f"{path}.{sub}" if sub else path] = path
    stage_of_key = {}
    for key in module.state_dict(keep_vars=True):
        owner_path = key.rpartition(".")[0]
        stage_of_key[key] = layout.stage_of[unit_of[owner_path]]
    kept = {id(p) for path in layout.stage_of if layout.stage_of[path] in mine
            for p in module.get_submodule(path).parameters()}
    for path, stage in layout.stage_of.items():
        if stage in mine:
            continue
        module.get_submodule(path).register_forward_pre_hook(functools.partial(_held_elsewhere, pp=layout.pp))
        for mod in module.get_submodule(path).modules():
            for name, param in list(mod.named_parameters(recurse=False, remove_duplicate=False)):
                if id(param) not in kept:
                    setattr(mod, name, None)  # stays registered, as None: this rank never runs it
            for name, _ in list(mod.named_buffers(recurse=False, remove_duplicate=False)):
                setattr(mod, name, None)
    return stage_of_key


def _held_elsewhere(mod: nn.Module, args: tuple, *, pp: int) -> None:
    """Forward pre-hook on a pruned unit, which the pipeline never runs on this rank: a direct
    call of the model (transformers' `generate`) reached it, and would fail on its missing
    weights (`weight` None) deep inside torch. The message is every rank's (each reaches a
    different unit)."""
    raise ModelError(
        f"a direct call of the model under pp={pp} (model(...), transformers' generate) reached layers whose weights "
        "another pipeline rank holds: each rank keeps only its stages. Run it through pmodel.train_step(batch) or "
        "pmodel.infer_step(batch), which pass activations between the stages")


def tied_across_ranks(module: nn.Module, layout: StageLayout) -> dict[str, list[int]]:
    """Parameter name -> the pipeline ranks holding it, for parameters held on more than one
    (an input embedding tied to the output head). Call before pruning."""
    holders: dict[int, set[int]] = {}
    for path, stage in layout.stage_of.items():
        for param in module.get_submodule(path).parameters():
            holders.setdefault(id(param), set()).add(stage % layout.pp)
    return {name: sorted(holders[id(p)]) for name, p in module.named_parameters(remove_duplicate=False)
            if len(holders.get(id(p), ())) > 1}
