"""The kept loop: one helper for every flow-matching or denoising loop that stays a loop in the compiled module.

    x = kept_loop(steps, lambda i, x: x + dt * velocity(x, t_of(i)), noise)

is `x_{i+1} = step(i, x_i)` for i = 0 .. steps-1, traced as one `torch._higher_order_ops.while_loop` whose
trip count is the 0-d int64 tensor `steps`: a runtime input of the compiled module (one vmfb serves any step
count), and one loop body in the IR instead of `steps` unrolled copies. The step function may close over
tensors and parameters (loop invariants: a KV cache, a conditioning vector); IREE's FX importer needs
dsa/stages/importer_fixes.py for those, which the export stage installs.
"""

from __future__ import annotations

from typing import Callable

import torch


def kept_loop(steps: torch.Tensor, step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
              init: torch.Tensor) -> torch.Tensor:
    """`step` applied `steps` times to `init`; `step(i, x)` gets the 0-d int64 iteration index `i`."""
    from torch._higher_order_ops.while_loop import while_loop

    def cond(i, x):
        return i < steps

    def body(i, x):
        return i + 1, step(i, x)

    _, out = while_loop(cond, body, (torch.zeros((), dtype=torch.int64), init))
    return out
