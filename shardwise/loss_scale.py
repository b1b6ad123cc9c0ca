"""Dynamic loss scaling for float16 training, as `torch.amp.GradScaler` does it.

`train_step` multiplies each microbatch loss, in float32, by `scale` before backward, so
gradients too small for float16 survive; the optimizer then, once the gradients are synchronized, checks
every rank's gradients (each shard, each stage) for inf/NaN in one all-reduce: if any is
found the step is skipped and the scale multiplied by `backoff_factor`, otherwise the
gradients are multiplied by 1/scale and the step taken, and after `growth_interval` steps
in a row without inf/NaN the scale grows by `growth_factor`. The scale is a power of two,
so scaling and unscaling are exact: without overflow the update is bit for bit the unscaled
one, as under torch's GradScaler on one process (`tests/test_loss_scale.py`).

`build_optimizer` attaches a `LossScaler()` when `param_dtype=torch.float16` (pass
`loss_scaler=None` to train without, or your own `LossScaler(...)` for any dtype). When the
loss itself is float16 its gradient, the scale, must fit float16 (≤ 65504): with the default
2^16 the first step is skipped and the scale halves, as it does under torch whenever the
initial scale is too large.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError, ModelError

SMALLEST_SCALE = 2.0 ** -126  # float32's smallest normal number: below it 1/scale overflows


@dataclass
class LossScaler:
    """torch.amp.GradScaler's defaults and rules; `scale` is the current factor."""

    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    scale: float = field(init=False)
    growth_tracker: int = field(init=False, default=0)  # steps in a row without inf/NaN

    def __post_init__(self) -> None:
        for name, ok in (("init_scale", self.init_scale > 0), ("growth_factor", self.growth_factor > 1),
                         ("backoff_factor", 0 < self.backoff_factor < 1)):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and ok):
                raise ConfigError(f"LossScaler({name}={value!r}): init_scale > 0, growth_factor > 1 and "
                                  "0 < backoff_factor < 1, as torch.amp.GradScaler requires")
        if isinstance(self.growth_interval, bool) or not isinstance(self.growth_interval, int) or \
                self.growth_interval < 1:
            raise ConfigError(f"LossScaler(growth_interval={self.growth_interval!r}) must be an integer >= 1")
        self.scale = float(self.init_scale)

    def update(self, found_inf: bool) -> None:
        """After a step: back off on inf/NaN, grow after `growth_interval` clean steps."""
        if found_inf:
            if self.scale * self.backoff_factor < SMALLEST_SCALE:
                raise ModelError(
                    f"the loss scale fell to {self.scale:.3g}: every recent step had inf/NaN gradients at every scale, "
                    "so the model itself produces them (a diverged model, an inf/NaN input, a bad learning rate). "
                    "Load the last good checkpoint and lower the learning rate or check the data")
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale, self.growth_tracker = float(state["scale"]), int(state["growth_tracker"])
