"""torch's global hooks (module registration, optimizer steps) that live as long as a ParallelModule.

torch calls every global hook of a kind by iterating one ordered dict, and removing a hook
deletes from that dict. The cyclic collector can free a ParallelModule inside any such
iteration (any allocation, in any hook, can start a collection), so a finalizer that removed
the ParallelModule's hooks raised "OrderedDict mutated during iteration" from an unrelated
`nn.Linear(...)` or `optimizer.step()`. A hook whose owner is gone is retired instead: its
value becomes a no-op (changing a value is allowed during iteration), and the no-ops are
deleted the next time hooks are tied to an owner, outside any iteration.
"""

from __future__ import annotations

import weakref
from typing import Sequence

from torch.utils.hooks import RemovableHandle


def _retired(*args: object, **kwargs: object) -> None:
    """A global hook whose ParallelModule is gone: does nothing until it is swept."""


def _retire(handles: Sequence[RemovableHandle]) -> None:
    for handle in handles:
        hooks = handle.hooks_dict_ref()
        if hooks is not None and handle.id in hooks:
            hooks[handle.id] = _retired


def hooks_while_alive(owner: object, handles: Sequence[RemovableHandle]) -> None:
    """Retire the global hooks `handles` when `owner` is collected; first delete the hooks
    retired so far from the dicts these live in."""
    for hooks in {id(d): d for d in (h.hooks_dict_ref() for h in handles) if d is not None}.values():
        for key in [key for key, hook in hooks.items() if hook is _retired]:
            del hooks[key]
    weakref.finalize(owner, _retire, list(handles))
