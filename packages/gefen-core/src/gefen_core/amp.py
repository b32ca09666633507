"""The native GradScaler protocol (docs/algorithm.md#mixed-precision).

``torch.amp.GradScaler.step`` checks ``optimizer._step_supports_amp_scaling``; when it is true
the scaler does not unscale or skip the step itself but sets two attributes on the optimizer
before calling ``step()`` and deletes them afterwards: ``found_inf`` (a 1-element float tensor,
non-zero on overflow) and ``grad_scale`` (the scale tensor, or ``None`` when the gradients were
already unscaled by ``scaler.unscale_``). Gefen advertises native support only when it holds
fp16 parameters, whose fp16 gradients the scaler refuses to unscale; otherwise the standard
scaler path (scaler unscales, skips ``step()`` on overflow) keeps schedulers and
"step was skipped" detection in Hugging Face Trainer/Accelerate aligned.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor


def _scalar(value: Any, attr: str) -> Tensor:
    if not isinstance(value, Tensor) or value.numel() != 1:
        raise RuntimeError(
            f"Gefen: optimizer.{attr} set by the grad scaler must be a 1-element tensor, got "
            f"{value!r}"
        )
    return value


def overflow_and_inverse_scale(optimizer: Any) -> tuple[bool, float | None]:
    """Read the scaler's attributes: (overflow?, inverse scale or None). One host read each."""
    found_inf = getattr(optimizer, "found_inf", None)
    grad_scale = getattr(optimizer, "grad_scale", None)
    if found_inf is not None and float(_scalar(found_inf, "found_inf").item()) != 0.0:
        return True, None
    if grad_scale is None:
        return False, None
    scale = float(_scalar(grad_scale, "grad_scale").double().item())
    if not math.isfinite(scale) or scale <= 0.0:
        raise RuntimeError(f"Gefen: grad_scale must be finite and > 0, got {scale}")
    # inv = f32(1 / f64(scale)), docs/algorithm.md#mixed-precision.
    return False, float(np.float32(1.0 / scale))


def unscale_(grads: Sequence[Tensor], inv_scale: float) -> None:
    """Multiply every gradient in place by ``inv_scale``: one multi-tensor multiply per
    (device, dtype) so each tensor rounds once in its own dtype."""
    buckets: dict[tuple[torch.device, torch.dtype], list[Tensor]] = defaultdict(list)
    for g in grads:
        buckets[(g.device, g.dtype)].append(g)
    for tensors in buckets.values():
        torch._foreach_mul_(tensors, inv_scale)
