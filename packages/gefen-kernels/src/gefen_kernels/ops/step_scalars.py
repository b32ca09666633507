"""The per-step scalars of the fused Gefen step, named once from the optimizer to the kernels
(docs/algorithm.md#block-second-moment step 2, docs/algorithm.md#factored-second-moment step 2).

:class:`StepScalars` is the one type and order: :func:`gefen_kernels.ops.fused_step` computes
them, :class:`~gefen_kernels.ops.step_groups.StepGroups` stages them, and the kernels' ``HYPER``
variants read them from device memory as fp32 ``[n, 4]`` in the same order.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from .._numerics import f32

__all__ = ["StepScalars", "step_scalars"]


class StepScalars(NamedTuple):
    """The per-step scalars of one tensor (docs/algorithm.md#block-second-moment step 2,
    docs/algorithm.md#factored-second-moment step 2), in the kernels' order.

    ``lr``: the learning rate; ``bc2``: ``1 / sqrt(1 - beta2**tv)`` in block mode
    (``bc2_rsqrt`` of ``block_step``), ``1 / (1 - beta2**tv)`` in factored mode (``bc2_recip``
    of ``factored_step``); ``bc1_recip``: ``1 / (1 - beta1**t)``; ``decay``:
    ``1 - lr * weight_decay``. Python floats: fp64 from :func:`step_scalars`, fp32-rounded
    from :meth:`rounded` (what the launches take).
    """

    lr: float
    bc2: float
    bc1_recip: float
    decay: float

    def rounded(self) -> StepScalars:
        """Each value rounded to fp32 (still a Python float)."""
        return StepScalars(f32(self.lr), f32(self.bc2), f32(self.bc1_recip), f32(self.decay))


def step_scalars(step: float, exp_avg_sq_step: float, *, lr: float, beta1: float, beta2: float,
                 weight_decay: float, factored: bool) -> StepScalars:
    """The :class:`StepScalars` of a tensor whose momentum age is ``step`` (``t``) and whose
    second-moment age is ``exp_avg_sq_step`` (``tv``), both already advanced, in fp64 on the
    host (docs/algorithm.md#block-second-moment step 2,
    docs/algorithm.md#factored-second-moment step 2)."""
    bc1_recip = 1.0 / (1.0 - beta1 ** step)
    b2 = 1.0 - beta2 ** exp_avg_sq_step
    bc2 = 1.0 / b2 if factored else 1.0 / math.sqrt(b2)
    return StepScalars(lr, bc2, bc1_recip, 1.0 - lr * weight_decay)
