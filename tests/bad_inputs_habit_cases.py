"""The catalogue's two-rank cases of users' habits with the model and its optimizer
(merged into `RANKS2` of bad_inputs_rank_cases.py): an optimizer that is not element-wise where
it would see parts of parameters, a head trained on a ParallelModule's outputs, and the model
changed after parallelize (a parameter unfrozen or frozen, a new head or parameter assigned,
resize_token_embeddings), a ParallelModule left to the cyclic collector, and one converted with
`.to(dtype)` or `.half()` or by torch.compile whole, or called directly under pp, and a
tokenizer's BatchEncoding as the batch."""

from __future__ import annotations

import functools
import gc

import torch
from torch import nn

import shardwise as sw
from parity import ADAMW, gpt_batches, make_gpt, replica_slice
from bad_inputs import Case


def _optimizer_in(cls, elementwise=None, **config):
    """A non-element-wise optimizer where parameters are sharded (it trained 4% off, or raised raw)."""
    plan = "gpt" if config.get("tp", 1) > 1 else None
    pm = sw.parallelize(make_gpt(0), sw.ParallelConfig(**config), plan=plan)
    extra = {} if elementwise is None else {"elementwise": elementwise}
    opt = sw.build_optimizer(pm, cls, lr=1e-3, **extra)
    pm.train_step(gpt_batches(1, 4)[0])
    opt.step()
    return "stepped"


def _trainable_set_changed(unfreeze: bool, **config):
    """wpe frozen before parallelize and unfrozen after it (it trained on nothing, silently: the
    gradient buckets and the optimizer hold the parameters trainable at parallelize), or lm_head
    (tied to wte) frozen after it, which trains as one process does: it keeps its values."""
    model = make_gpt(0)
    model.wpe.weight.requires_grad_(not unfreeze)
    pm = sw.parallelize(model, sw.ParallelConfig(**config))
    opt = sw.build_optimizer(pm, torch.optim.AdamW, **ADAMW)  # its moments would move a zero gradient's parameter
    index, count = sw.data_parallel_info(pm)
    for step, batch in enumerate(gpt_batches(2, 4)):
        if step == 1:
            (model.wpe.weight if unfreeze else model.lm_head.weight).requires_grad_(unfreeze)
            before = {k: v.clone() for k, v in pm.full_state_dict().items()}
        pm.train_step(replica_slice(batch, index, count))
        opt.step()
        opt.zero_grad()
    after = pm.full_state_dict()
    moved = {k for k in after if not torch.equal(after[k], before[k])}
    return sorted(set(after) - moved)


def _changed_after_parallelize(change: str):
    """The model changed after parallelize (it trained without the new head, silently: the
    buckets and the optimizer hold the parameters the model had then); assigning a slot what it
    already holds changes nothing and trains."""
    from test_zoo import batches, make

    model = make("llama") if change == "resize_token_embeddings" else make_gpt(0)
    pm = sw.parallelize(model)
    if change == "a new head":
        model.lm_head = nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=False)
    elif change == "a new parameter":
        model.wpe.weight = nn.Parameter(torch.zeros_like(model.wpe.weight))
    elif change == "resize_token_embeddings":
        model.lm.resize_token_embeddings(80)
    else:  # the same objects again
        model.lm_head, model.wpe.weight = model.lm_head, model.wpe.weight
    index, count = sw.data_parallel_info(pm)
    pm.train_step(replica_slice(batches("llama", 1)[0] if change == "resize_token_embeddings"
                                else gpt_batches(1, 4)[0], index, count))
    return "trained"


def _freed_by_the_collector(during: str):
    """A ParallelModule in a reference cycle, freed by the collector while torch runs the global
    hooks of an unrelated model being built, or of a plain optimizer's step (any allocation there
    can start a collection; here a hook registered first collects). Its retired hooks once deleted
    themselves from the dict torch was iterating: "OrderedDict mutated during iteration" from
    nn.Linear or optimizer.step(). A later parallelize sweeps them; returns how many are left."""
    from torch.nn.modules.module import register_module_parameter_registration_hook
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    armed = []

    def collect_once(*args):
        if armed:
            armed.clear()
            gc.collect()

    register = register_module_parameter_registration_hook if during == "build" else register_optimizer_step_pre_hook
    collecting = register(collect_once)
    enabled = gc.isenabled()
    gc.disable()  # nothing frees the cycle before the armed hook does
    try:
        other = torch.nn.Linear(2, 2)
        optimizer = torch.optim.SGD(other.parameters(), lr=0.1)
        cycle: list = [sw.parallelize(make_gpt(0), sw.ParallelConfig(zero=1))]  # ZeRO: an optimizer hook too
        cycle.append(cycle)
        del cycle
        armed.append(True)
        if during == "build":
            make_gpt(0)
        else:
            other(torch.ones(2)).sum().backward()
            optimizer.step()
        sw.parallelize(make_gpt(0), sw.ParallelConfig(zero=1))
        return sum(getattr(hook, "__name__", "") == "_retired" for hook in collecting.hooks_dict_ref().values())
    finally:
        collecting.remove()
        if enabled:
            gc.enable()


def _converted(conversion: str, **config):
    """The ParallelModule converted after parallelize (a raw error in backward under dp, a
    RuntimeError on ZeRO-3's storage-less parameters, a crash in torch for .double() there);
    a conversion that changes nothing runs as torch runs it, and the model trains."""
    plan = "gpt" if config.get("tp", 1) > 1 else None
    pm = sw.parallelize(make_gpt(0), sw.ParallelConfig(**config), plan=plan)
    device = next(pm.parameters()).device
    {"to bfloat16": lambda: pm.to(torch.bfloat16), "half": pm.half, "double": pm.double,
     "to its own device": lambda: pm.to(device), "float": pm.float}[conversion]()
    index, count = sw.data_parallel_info(pm)
    pm.train_step(replica_slice(gpt_batches(1, 4)[0], index, count))
    return "trained"


def _compiled_whole(call: str, **config):
    """torch.compile on the ParallelModule itself (DDP's and FSDP2's habit): it traced
    shardwise's step with the model (under tp a raw AssertionError from Dynamo's set_stance);
    a compiled function calling train_step, the same."""
    plan = "gpt" if config.get("tp", 1) > 1 else None
    pm = sw.parallelize(make_gpt(0), sw.ParallelConfig(**config), plan=plan)
    index, count = sw.data_parallel_info(pm)
    batch = replica_slice(gpt_batches(1, 4)[0], index, count)
    if call == "forward":
        out = torch.compile(pm, backend="eager")(batch)
        (out[0] if isinstance(out, tuple) else out).backward()
    else:
        torch.compile(lambda b: pm.train_step(b), backend="eager")(batch)
    return "compiled"


def _called_directly_under_pp(how: str):
    """The model called directly under pp (it failed deep in torch on a dropped unit's `weight`
    None): transformers' generate on a Hugging Face Llama, or the model's own forward."""
    from test_zoo import batches, make

    model = make("llama")
    batch = batches("llama", 1)[0]
    sw.parallelize(model, sw.ParallelConfig(pp=2, microbatches=2), sample=batch)
    with torch.no_grad():
        if how == "generate":
            model.lm.generate(batch["input_ids"][:1, :4], max_new_tokens=2, do_sample=False)
        else:
            model(batch)
    return "ran"


def _under_autocast(**config):
    """train_step inside torch.autocast(bf16), the way users write mixed precision. Data
    parallel computes what one process does under autocast (the replicas' mean of its losses,
    exactly); pp was refused (its stages replay the forward's glue as captured without autocast,
    and Hugging Face's loss ran in bf16: 4.15625 for one process's 4.15729)."""
    from test_zoo import batches, make

    batch = batches("llama", 1)[0]
    pm = sw.parallelize(make("llama"), sw.ParallelConfig(**config), sample=batch if config.get("pp", 1) > 1 else None)
    index, count = sw.data_parallel_info(pm)
    device = pm.topology.device.type
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = pm.train_step({k: v.chunk(count)[index] for k, v in batch.items()})
    model = make("llama")
    with torch.autocast(device, dtype=torch.bfloat16):
        want = torch.stack([model({k: v.chunk(count)[i] for k, v in batch.items()}) for i in range(count)]).mean()
    return bool(torch.equal(loss, want.detach().float()))


class _ReadsByAttribute(nn.Module):
    """An end2end module reading a tokenizer's BatchEncoding by attribute (or by key) and
    returning transformers' own output."""

    def __init__(self, lm: nn.Module, by_key: bool):
        super().__init__()
        self.lm, self.by_key = lm, by_key

    def forward(self, batch):
        if self.by_key:
            return self.lm(input_ids=batch["input_ids"], labels=batch["labels"])
        return self.lm(input_ids=batch.input_ids, labels=batch.labels)


def _batch_encoding(by_key: bool = False, **config):
    """A tokenizer's BatchEncoding as the batch: it reached the forward as a dict (an
    AttributeError from `batch.input_ids`), and infer_step gave transformers' output as a dict
    (no `.logits`); under pp the stages get dicts, as before (a BatchEncoding kept whole there
    hid its tensors from the pipeline's program, and the stages waited for ever). Returns the
    outputs' type and logits' shape, and whether the user's batch still holds its own tensors."""
    import transformers
    from test_zoo import batches, make

    batch = transformers.BatchEncoding(batches("llama", 1)[0])
    held = dict(batch)
    pm = sw.parallelize(_ReadsByAttribute(make("llama").lm, by_key), sw.ParallelConfig(**config),
                        sample=batch if config.get("pp", 1) > 1 else None)
    index, count = sw.data_parallel_info(pm)
    mine = transformers.BatchEncoding({k: v.chunk(count)[index] for k, v in batch.items()})
    pm.train_step(mine)
    out = pm.infer_step(mine)
    return type(out).__name__, tuple(out["logits"].shape), all(batch[k] is held[k] for k in held)


class _Headed(nn.Module):
    """A plain module applying its own trainable head to a ParallelModule's outputs."""

    def __init__(self):
        super().__init__()
        self.body = sw.parallelize(nn.Sequential(nn.Linear(4, 4)))
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.body(x))


def _headed(frozen: bool):
    outer = _Headed()
    outer.head.requires_grad_(not frozen)
    outer(torch.randn(4, 4)).sum().backward()  # the head's gradient would be this replica's alone
    return "trained"


HABITS = {
    "Adafactor under ZeRO-1": Case(lambda: _optimizer_in(torch.optim.Adafactor, zero=1), "ConfigError",
                                   "Adafactor is not an element-wise optimizer"),
    "Adafactor under tp": Case(lambda: _optimizer_in(torch.optim.Adafactor, tp=2), "ConfigError",
                               "in this layout (zero=0, tp=2) it would get parts of"),
    "Muon under ZeRO-2": Case(lambda: _optimizer_in(functools.partial(torch.optim.Muon, adjust_lr_fn="original"),
                                                    zero=2), "ConfigError", "Muon is not an element-wise optimizer"),
    "Adafactor with whole parameters": Case(lambda: _optimizer_in(torch.optim.Adafactor), None,
                                            check=lambda v: v == "stepped"),
    "an element-wise optimizer vouched for": Case(lambda: _optimizer_in(torch.optim.Adafactor, elementwise=True,
                                                                        zero=1), None, check=lambda v: v == "stepped"),
    "a head trained on a ParallelModule's outputs": Case(lambda: _headed(frozen=False), "ModelError",
                                                         "is trained together with Sequential's ParallelModule"),
    "a frozen head on a ParallelModule's outputs": Case(lambda: _headed(frozen=True), None,
                                                        check=lambda v: v == "trained"),
    "a parameter unfrozen after parallelize": Case(lambda: _trainable_set_changed(True), "ConfigError",
                                                   "parameter 'wpe.weight' was frozen (requires_grad=False) when "
                                                   "sw.parallelize ran and has a gradient now"),
    "a parameter unfrozen after parallelize, ZeRO-3": Case(lambda: _trainable_set_changed(True, zero=3),
                                                           "ConfigError", "'wpe.weight' was frozen"),
    "a new head after parallelize": Case(lambda: _changed_after_parallelize("a new head"), "ModelError",
                                         "GPT.lm_head was assigned a new Linear after sw.parallelize"),
    "a new parameter after parallelize": Case(lambda: _changed_after_parallelize("a new parameter"), "ModelError",
                                              "GPT.wpe.weight was assigned a new Parameter after sw.parallelize"),
    "resize_token_embeddings after parallelize": Case(lambda: _changed_after_parallelize("resize_token_embeddings"),
                                                      "ModelError", "was assigned a new"),
    "the same head assigned again after parallelize": Case(lambda: _changed_after_parallelize("the same"), None,
                                                           check=lambda v: v == "trained"),
    "a ParallelModule freed by the collector while a model is built": Case(
        lambda: _freed_by_the_collector("build"), None, check=lambda v: v == 0),
    "a ParallelModule freed by the collector while an optimizer steps": Case(
        lambda: _freed_by_the_collector("step"), None, check=lambda v: v == 0),
    "pmodel.to(torch.bfloat16) after parallelize": Case(lambda: _converted("to bfloat16"), "ConfigError",
                                                        "would move its tensors from torch.float32 on"),
    "pmodel.half() after parallelize, ZeRO-3": Case(lambda: _converted("half", zero=3), "ConfigError",
                                                    "to torch.float16 on"),
    "pmodel.double() after parallelize, tp": Case(lambda: _converted("double", tp=2), "ConfigError",
                                                  "set ParallelConfig(param_dtype=torch.bfloat16)"),
    "pmodel.to(its own device) after parallelize, ZeRO-3": Case(lambda: _converted("to its own device", zero=3),
                                                                None, check=lambda v: v == "trained"),
    "pmodel.float() on a float32 model after parallelize": Case(lambda: _converted("float"), None,
                                                                check=lambda v: v == "trained"),
    "a tokenizer's BatchEncoding read by attribute": Case(
        lambda: _batch_encoding(microbatches=2), None,
        check=lambda v: v == ("CausalLMOutputWithPast", (2, 16, 64), True)),
    "a tokenizer's BatchEncoding read by key, pp": Case(
        lambda: _batch_encoding(by_key=True, pp=2, microbatches=2), None,
        check=lambda v: v == ("CausalLMOutputWithPast", (4, 16, 64), True)),
    "a tokenizer's BatchEncoding read by attribute, pp": Case(
        lambda: _batch_encoding(pp=2, microbatches=2), "ModelError",
        "'dict' object has no attribute 'input_ids' (pipeline stages get a mapping batch as a dict"),
    "torch.compile(pmodel)": Case(lambda: _compiled_whole("forward"), "ConfigError",
                                  "torch.compile traced pmodel's forward (torch.compile(pmodel))"),
    "torch.compile(pmodel) under tp": Case(lambda: _compiled_whole("forward", tp=2), "ConfigError",
                                           "Compile the model's blocks with pmodel.compile(...) instead"),
    "torch.compile of a function calling train_step": Case(lambda: _compiled_whole("train_step"), "ConfigError",
                                                           "torch.compile traced pmodel.train_step"),
    "train_step under torch.autocast": Case(lambda: _under_autocast(), None, check=lambda v: v is True),
    "train_step under torch.autocast, pp": Case(lambda: _under_autocast(pp=2, microbatches=2), "ConfigError",
                                                "Cast the model instead: ParallelConfig(param_dtype=torch.bfloat16)"),
    "transformers' generate under pp": Case(lambda: _called_directly_under_pp("generate"), "ModelError",
                                            "a direct call of the model under pp=2"),
    "the model's own forward under pp": Case(lambda: _called_directly_under_pp("forward"), "ModelError",
                                             "Run it through pmodel.train_step(batch) or pmodel.infer_step(batch)"),
    "a parameter frozen after parallelize": Case(lambda: _trainable_set_changed(False, zero=1), None,
                                                 check=lambda v: v == ["lm_head.weight", "wte.weight"]),
}
