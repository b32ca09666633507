"""Gefen ops: one module per op, each holding its PyTorch reference, its Triton kernel and its
``torch.ops.gefen`` custom-op registration.

``gefen_kernels.ops.<op>`` is the dispatching public function for the step, quantize and
histogram ops. :func:`fused_step` steps a list of tensors (planning, grouping, streams,
CUDA-graph replay, steady-state records behind it): the one entry gefen-core's optimizers step
through; :func:`reference_step` is the same step through the reference ops. ``period_scores``
is exported from the package root only, so ``gefen_kernels.ops.period_scores`` stays the module
(its tests patch module constants through it).
"""

from ._device import transient_tables
from .block_step import block_step, block_step_reference, block_step_triton
from .factored_step import factored_step, factored_step_reference, factored_step_triton
from .fused_step import FusedStepRecord, fused_step, op_step, reference_step
from .histogram import histogram, histogram_reference, histogram_sum, histogram_triton
from .multi_block_step import (
    multi_block_step,
    multi_block_step_reference,
    multi_block_step_triton,
)
from .muon_momentum import muon_momentum, muon_momentum_reference, muon_momentum_triton
from .period_scores import (
    multi_period_scores,
    multi_period_scores_reference,
    multi_period_scores_triton,
)
from .quantize import (
    quantize_nearest,
    quantize_nearest_reference,
    quantize_nearest_triton,
    quantize_stochastic,
    quantize_stochastic_reference,
    quantize_stochastic_triton,
    sr_uniform_reference,
)
from .step_scalars import StepScalars, step_scalars

# After the op modules: registers the CPU kernels of their custom ops (the native CPU step).
from . import _cpu_step  # noqa: E402,F401  isort: skip

__all__ = [
    "FusedStepRecord",
    "StepScalars",
    "block_step",
    "block_step_reference",
    "block_step_triton",
    "factored_step",
    "factored_step_reference",
    "factored_step_triton",
    "fused_step",
    "histogram",
    "histogram_reference",
    "histogram_sum",
    "histogram_triton",
    "multi_block_step",
    "multi_block_step_reference",
    "multi_block_step_triton",
    "multi_period_scores",
    "multi_period_scores_reference",
    "multi_period_scores_triton",
    "muon_momentum",
    "muon_momentum_reference",
    "muon_momentum_triton",
    "quantize_nearest",
    "quantize_nearest_reference",
    "quantize_nearest_triton",
    "quantize_stochastic",
    "quantize_stochastic_reference",
    "quantize_stochastic_triton",
    "op_step",
    "reference_step",
    "transient_tables",
    "sr_uniform_reference",
    "step_scalars",
]
