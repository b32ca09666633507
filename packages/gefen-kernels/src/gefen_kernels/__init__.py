"""gefen-kernels: the fused ops of the Gefen optimizer (arXiv:2606.13894).

Each op has a PyTorch reference (CPU and CUDA; the specification), a Triton kernel with the
same signature, and a ``torch.ops.gefen`` custom op behind the public name: CUDA tensors take
the Triton kernel when Triton is available, everything else the reference. Importing this
package never needs Triton. Signatures: ``docs/internals/contracts.md``; math:
docs/algorithm.md#codebook, docs/algorithm.md#factored-second-moment, docs/algorithm.md#step.
"""

from ._triton import triton_available
from ._version import __version__
from .ops import (
    FusedStepRecord,
    StepScalars,
    block_step,
    block_step_reference,
    block_step_triton,
    factored_step,
    factored_step_reference,
    factored_step_triton,
    fused_step,
    histogram,
    histogram_reference,
    histogram_triton,
    multi_block_step,
    multi_block_step_reference,
    multi_block_step_triton,
    muon_momentum,
    muon_momentum_reference,
    op_step,
    quantize_nearest,
    quantize_nearest_reference,
    quantize_nearest_triton,
    quantize_stochastic,
    quantize_stochastic_reference,
    quantize_stochastic_triton,
    reference_step,
    sr_uniform_reference,
    step_scalars,
)
from .ops._cpu_native import status as cpu_step_status
from .ops.period_scores import (
    multi_period_scores,
    multi_period_scores_reference,
    multi_period_scores_triton,
    period_scores,
    period_scores_reference,
    period_scores_triton,
)

#: Version of the op signatures in docs/internals/contracts.md; gefen-core checks it at import.
KERNEL_API_VERSION = 1

__all__ = [
    "FusedStepRecord",
    "cpu_step_status",
    "KERNEL_API_VERSION",
    "StepScalars",
    "__version__",
    "block_step",
    "block_step_reference",
    "block_step_triton",
    "factored_step",
    "factored_step_reference",
    "factored_step_triton",
    "fused_step",
    "histogram",
    "histogram_reference",
    "histogram_triton",
    "multi_block_step",
    "multi_block_step_reference",
    "multi_block_step_triton",
    "multi_period_scores",
    "multi_period_scores_reference",
    "multi_period_scores_triton",
    "muon_momentum",
    "muon_momentum_reference",
    "period_scores",
    "period_scores_reference",
    "period_scores_triton",
    "quantize_nearest",
    "quantize_nearest_reference",
    "quantize_nearest_triton",
    "quantize_stochastic",
    "quantize_stochastic_reference",
    "quantize_stochastic_triton",
    "op_step",
    "reference_step",
    "sr_uniform_reference",
    "step_scalars",
    "triton_available",
]
