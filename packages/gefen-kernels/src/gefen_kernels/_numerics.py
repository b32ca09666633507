"""The canonical arithmetic shared by every Gefen op: one definition, used by every path.

Rounding sequence (docs/algorithm.md#block-second-moment, docs/algorithm.md#factored-second-moment;
chosen once, used by the PyTorch references and the Triton kernels alike). ``f32(.)`` rounds to
binary32; every binary operation is rounded on its own (no fused multiply-add anywhere: the Triton
launches pass ``enable_fp_fusion=False``):

* host scalars: ``b1 = f32(beta1)``, ``omb1 = f32(1 - b1)`` (formed in fp32), likewise
  ``b2``/``omb2``; ``eps = f32(eps)``; ``lr``, ``bc1_recip``, ``bc2_rsqrt``/``bc2_recip`` and
  ``decay`` are the host fp64 values rounded to fp32 (or read from the fp32 ``hyper`` tensor).
* momentum EMA on the dequantised state::

      m = f32( f32(b1 * f32(s * c[q])) + f32(omb1 * g) )

* block second moment: ``mean = f32(f32(sum g^2) / f32(P))`` (fp32 accumulation, squares of the
  fp32-converted gradient), ``v' = f32(f32(b2 * v) + f32(omb2 * mean))``.
* factored second moment: ``r' = f32(f32(b2 * r) + f32(omb2 * f32(rowsum * f32(1/C))))``,
  likewise ``k'`` with ``1/R``; ``rbar = max(f32(f32(sum r') / f32(R)), FLT_MIN)``;
  ``V = f32(f32(r_i * k_j) * f32(1/rbar))``. (The r/k EMA uses separately rounded products too,
  not an fma, so a single rule holds everywhere and the PyTorch reference, which cannot promise
  an fma on every device, matches the kernels bit for bit.)
* denominator: block ``h = f32(sqrt(v))``, ``h = f32(h * bc2_rsqrt)``; factored
  ``h = f32(sqrt(f32(V * bc2_recip)))``; then ``h = f32(h + eps)``,
  ``sigma = f32(f32(1/h) * bc1_recip)``. Square roots and divisions are IEEE round-to-nearest.
* re-quantisation: ``s' = max |m|`` over the block, ``z = m / s'`` if ``s' > 0`` else 0,
  ``q' = quantize(z)`` (docs/algorithm.md#quantizer), ``mhat = f32(c[q'] * s')``.
* parameter: ``u = f32(f32(mhat * sigma) * lr)``; ``p = fp(fp(p * decay) - u)`` (fp = the
  parameter dtype; ``decay == 1`` gives the same bits as skipping the multiply).

Non-finite policy (open choice O9, the same on every path):

* NaN and Inf are propagated, never laundered into finite values. The per-block max is
  NaN-propagating (a NaN anywhere in a block's momentum makes ``s' = NaN``), so a NaN gradient
  turns its whole block's scale, second moment and parameters into NaN, and they stay NaN, as
  ``torch.optim.AdamW`` keeps a NaN it has absorbed; an Inf gradient likewise makes the block's
  parameters NaN (``Inf * 0``). No path maps a NaN to code 0 with a finite scale (the reference
  kernel did: a silent large negative momentum).
* Quantising a NaN gives code 0 on every path (its scale already carries the NaN).
* A NaN's sign and payload are not specified: GPU arithmetic returns ``0x7fffffff``, a
  kernel's NaN constant is ``0x7fc00000``, and the paths are not required to agree on them.
* The histogram skips every element of a block whose max-abs is not finite, so the counts sum
  to fewer than ``N``; the optimizer checks first-step gradients for non-finite values and
  defers codebook learning (O9) rather than relying on the histogram.
* Factored mode: an element whose reconstructed second moment ``V`` is exactly 0 (its row or
  its column has never had a non-zero gradient, so its exact momentum is 0) gets a zero update
  instead of ``sigma = 1/eps`` times the codeword nearest zero, which is not exactly zero in a
  learned codebook and would otherwise move the parameter every step. ``V = NaN`` is not 0 and
  still propagates.
"""

from __future__ import annotations

import struct

from torch import Tensor

__all__ = [
    "CHUNK_ELEMENTS",
    "FLT_MIN",
    "HISTOGRAM_BINS",
    "HISTOGRAM_SIZE",
    "NUM_CODEWORDS",
    "SR_MUL0",
    "SR_MUL1",
    "SR_MUL2",
    "ZERO_BIN",
    "f32",
    "momentum_ema",
    "to_signed64",
]

NUM_CODEWORDS = 256
HISTOGRAM_BINS = 4096
# The histogram's exact-zero bin (docs/algorithm.md#histogram): index 4096 of the
# HISTOGRAM_SIZE counts, for elements whose normalised value is exactly 0.
ZERO_BIN = HISTOGRAM_BINS
HISTOGRAM_SIZE = HISTOGRAM_BINS + 1
# smallest normal binary32, the factored-mean floor (docs/algorithm.md#factored-second-moment)
FLT_MIN = 1.1754943508222875e-38

# Elements per chunk of the PyTorch references. Each element of a chunk costs at most ~56 bytes
# of temporaries (fp32 values, int64 search indices), so 2**20 elements keep the scratch of one
# step under 64 MiB whatever the tensor size. Tests patch it down to exercise the chunk logic.
CHUNK_ELEMENTS = 1 << 20

# splitmix64 constants of the stochastic-rounding hash (docs/algorithm.md#stochastic-rounding), as
# unsigned values.
SR_MUL0 = 0x9E3779B97F4A7C15
SR_MUL1 = 0xBF58476D1CE4E5B9
SR_MUL2 = 0x94D049BB133111EB


def to_signed64(value: int) -> int:
    """The two's-complement int64 whose bits equal ``value mod 2**64``."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= (1 << 63) else value


def f32(value: float) -> float:
    """Round a host float to binary32 (and back to a Python float)."""
    return struct.unpack("f", struct.pack("f", float(value)))[0]


def momentum_ema(beta1: float | Tensor, one_minus_beta1: float | Tensor, scale: Tensor,
                 codeword: Tensor, grad: Tensor) -> Tensor:
    """The one definition of the momentum EMA on dequantised state
    (docs/algorithm.md#block-second-moment step 5).

    ``m = beta1 * (scale * codeword) + (1 - beta1) * grad`` with every product rounded on its
    own and one final add, in the dtype of the operands (fp32; fp64 on the fp64 reference).
    Each torch operation below is a separate kernel, so nothing is contracted into an fma.
    """
    dequant = scale * codeword
    return (beta1 * dequant).add_(one_minus_beta1 * grad)
