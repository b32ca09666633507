"""The exact optimal 1-D quantizer's dynamic program (docs/algorithm.md#codebook-solver) on the GPU.

Twin of ``gefen_core.codebook.optimal_quantizer_endpoints`` for ``M >= K`` points (the
problem with the two endpoints forced, as the codebook was before the zero codeword; its
``_LayeredDP``):
the same codewords, cost and tie choices, bit for bit, as the textbook recurrence. The numpy
solver spends 70-110 ms of host time per call, bound by Python overhead over its 254 sequential
layers; here each layer is one launch of many programs, and nothing is read back. The codebook
itself, with the zero codeword forced (docs/algorithm.md#codebook-solver), is solved on the host
by ``gefen_core.codebook.optimal_codebook``, which does not call this kernel.

The recurrence (docs/algorithm.md#codebook-solver). Points ``1..M`` with fp64 prefix sums ``W, S1,
S2`` (index 0 = 0, accumulated left to right on the host: :func:`quantizer_prefix`). Segment
``[i..j]`` has ``w = W[j] - W[i-1]`` (likewise ``s1``, ``s2``), free cost ``s2 - s1*s1/w`` and, with
the fixed centre ``f``, ``(s2 - 2f*s1) + f*f*w``. Layer 1 is ``D1[j] = (S2[j] + 2*S1[j]) + W[j]``
(``f = -1``); layers ``k = 2..K-1`` are ``D_k[j] = min_i D_{k-1}[i-1] + (s2 - s1*s1/w)`` over
``i = k..j``, the leftmost minimiser (the textbook scans ``i`` upward and replaces only on strict
improvement), for the rows ``j = k .. k + R - 1`` (``R = M - K + 1``; other rows cannot lead to a
``K``-segment partition); layer ``K`` is the one row ``j = M`` with ``f = +1``. Backtracking the
argmins gives the segments; codeword ``t`` is the mean ``(S1[end] - S1[start-1]) /
(W[end] - W[start-1])`` of segment ``t + 1``, codeword 0 is -1, codeword ``K - 1`` is +1.

Which candidates a row looks at: the leftmost argmin is monotone across layers (fact 2 of
``gefen_core.codebook``'s module docstring, Knuth's bound: ``a_{k-1}(j) <= a_k(j)``), so row
``j`` of layer ``k`` scans its window ``[max(a_{k-1}(j), k), j]`` in full. The top row, which
layer ``k - 1`` lacks, takes ``a_{k-1}(j - 1)`` (row monotonicity, fact 1, then fact 2). A window
is about one segment wide (``j / (k - 1)`` points), so a layer costs ``O(M^2 / k)`` candidates,
about ``4e7`` for all of ``M = 4096``, ``K = 256``; no other fact is used, and no window depends
on another row of the same layer.

Launches (:func:`optimal_quantizer_dp_triton`; the kernels are in :mod:`._quantizer_dp_kernels`):

1. ``_dp_first_layer_kernel``: ``D_1`` and ``a_1 = 1`` on every row.
2. ``_dp_layer_kernel``, once per free layer ``k = 2..K-1``: a program takes ``BR``
   consecutive rows and walks the union of their windows in ``[BR, BC]`` tiles, left to right;
   within a tile, each row's leftmost minimum (the minimum, then the smallest ``i`` holding
   it), and across tiles a replacement only on strict improvement. The winner's value is
   computed once more and stored, so ``D_k[j]`` holds the bits of the leftmost minimiser's
   candidate even where ``+0.0`` and ``-0.0`` tie.
3. ``_dp_last_layer_kernel`` (one program): layer ``K``'s row and the backtracking.

Exactness: every candidate value is computed with the expressions and operation order of the
textbook (``_LayeredDP._values``): three prefix subtractions, ``s1 * s1``, the division by
``w``, ``s2 - q``, then ``D + cost``, in fp64, round to nearest. A division of fp64 tensors
lowers to ``div.rn.f64`` (correctly rounded; Triton's approximate division is fp32-only) and
every launch passes ``enable_fp_fusion=False``, so no multiply-add is contracted into an fma.
Within a window the leftmost minimum is the textbook's choice, and fact 2 puts the textbook's
argmin in the window. Fact 2 holds in exact arithmetic; the computed costs carry rounding.
So this kernel and the textbook can choose differently where two candidates are equal up to
rounding, or where the weights span about ten orders of magnitude or more (the free cost's
rounding, about ``W * 2**-52``, then exceeds the differences between costs). There the numpy
solver, which also uses row monotonicity, can differ from both.
``tests/ops/test_quantizer_dp.py`` compares codewords and cost with the textbook recurrence
on exact ties, integer counts and float weights (and, on a GPU, with ``gefen_core``'s solver
at ``M = 4096``, ``K = 256``).

Cost: for ``M = 4096``, ``K = 256``, 254 layer launches of about 120 programs, most of them a
single ``[32, 64]`` tile after the first few layers: bound by launch latency, not arithmetic.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from .._triton import interpret_mode, require_triton, triton
from ._device import check_device_for_triton, on_tensor_device
from ._quantizer_dp_kernels import _dp_first_layer_kernel, _dp_last_layer_kernel, _dp_layer_kernel
from ._triton_helpers import LAUNCH_OPTIONS

__all__ = ["optimal_quantizer_dp_triton", "quantizer_prefix"]

# Rows per program of a layer launch and candidates per row and tile. Compiled: [32, 64] tiles
# over 8 warps (8 fp64 values per thread; 4 warps spill). In the interpreter a program's cost
# is per operation, so one program takes every row.
_ROWS = 32
_COLS = 64
_NUM_WARPS = 8

def quantizer_prefix(points: Tensor | np.ndarray | Sequence[float],
                     weights: Tensor | np.ndarray | Sequence[float]) -> Tensor:
    """The fp64 prefix sums ``W, S1, S2`` of docs/algorithm.md#codebook-solver as one CPU tensor
    ``[3, M + 1]``.

    Built exactly as ``gefen_core.codebook._LayeredDP`` builds them: column 0 is 0 and the
    sums accumulate left to right on the host (``np.cumsum`` of ``w``, ``w*x`` and
    ``(w*x)*x``), so :func:`optimal_quantizer_dp_triton` sees the textbook's sums bit for bit
    (a parallel scan would round differently). Move it to the device with ``.to(device)``.

    Args:
        points: 1-D, ``M`` strictly increasing values in ``[-1, 1]`` (converted to fp64).
        weights: 1-D, ``M`` finite weights ``> 0`` (converted to fp64). Neither is checked
            beyond shape: ``gefen_core.codebook.optimal_quantizer_endpoints`` validates its
            inputs.

    Raises:
        ValueError: ``points`` or ``weights`` not 1-D, or of different lengths.
    """
    x = _as_float64(points)
    w = _as_float64(weights)
    if x.ndim != 1 or w.ndim != 1:
        raise ValueError(f"points and weights must be 1-D, got shapes {list(x.shape)} and "
                         f"{list(w.shape)}")
    if x.size != w.size:
        raise ValueError(f"points and weights must have the same length, got {x.size} and "
                         f"{w.size}")
    out = np.zeros((3, x.size + 1))
    wx = w * x
    np.cumsum(w, out=out[0, 1:])
    np.cumsum(wx, out=out[1, 1:])
    np.cumsum(wx * x, out=out[2, 1:])
    return torch.from_numpy(out)


def _as_float64(values: Tensor | np.ndarray | Sequence[float]) -> np.ndarray:
    if isinstance(values, Tensor):
        return values.detach().to("cpu", torch.float64).numpy()
    return np.asarray(values, dtype=np.float64)


@on_tensor_device
def optimal_quantizer_dp_triton(prefix: Tensor, k: int, *,
                                _block: int | None = None) -> tuple[Tensor, Tensor]:
    """Exact optimal ``k``-level quantizer with forced endpoints -1 and +1, on the device.

    docs/algorithm.md#codebook-solver for ``M >= k`` points: the codewords and cost of
    ``gefen_core.codebook.optimal_quantizer_endpoints`` (the textbook recurrence's, tie choices
    included), computed on the device in ``k`` launches (module docstring). Asynchronous: no
    host sync; the scratch (about ``4 k (M - k)`` bytes of argmins plus ``O(M)``) is allocated
    per call on ``prefix``'s device.

    Args:
        prefix: fp64 ``[3, M + 1]`` prefix sums ``W, S1, S2`` from :func:`quantizer_prefix`
            (column 0 zero, accumulated left to right; ``W`` strictly increasing, i.e. every
            weight positive), on a CUDA device (or the CPU under ``TRITON_INTERPRET=1``).
        k: number of codewords, ``2 <= k <= M`` (the caller handles fewer points, open choice
            O5).
        _block: rows per program of a layer launch (a power of two >= 16); tests only.

    Returns:
        ``(codewords, cost)`` on ``prefix``'s device: fp64 ``[k]``, ascending, ``-1`` first and
        ``+1`` last; fp64 ``[]``, the minimal total weighted squared error.

    Raises:
        ImportError: Triton is not installed.
        TypeError: ``prefix`` is not an fp64 tensor, or ``k`` is not an int.
        ValueError: ``prefix`` is not ``[3, M + 1]`` with ``M >= k``; ``k < 2``; a problem too
            large for int32 indices; a CPU tensor outside the interpreter.
    """
    if not isinstance(prefix, Tensor):
        raise TypeError(f"prefix must be a torch.Tensor, got {type(prefix).__name__}")
    if prefix.dtype != torch.float64:
        raise TypeError(f"prefix must be float64 (the fp64 prefix sums W, S1, S2), got "
                        f"{prefix.dtype}")
    if not isinstance(k, int) or isinstance(k, bool):
        raise TypeError(f"k must be an int, got {type(k).__name__}")
    if k < 2:
        raise ValueError(f"k must be >= 2 (the endpoints -1 and +1 are forced), got {k}")
    if prefix.dim() != 2 or prefix.shape[0] != 3 or prefix.shape[1] < 2:
        raise ValueError(f"prefix must have shape [3, M + 1] with M >= 1, got "
                         f"{list(prefix.shape)}")
    m = prefix.shape[1] - 1
    if m < k:
        raise ValueError(f"prefix holds M = {m} points, fewer than k = {k} codewords (handle "
                         "M < k on the host, open choice O5)")
    rows = m - k + 1
    if k * rows >= 2**31 or 3 * (m + 1) >= 2**31:
        raise ValueError(f"M = {m}, k = {k} is too large for the kernel's int32 indices")
    require_triton("the Triton quantizer DP")
    check_device_for_triton(prefix)
    rows_per_program = _block if _block is not None else _default_rows(rows)
    if rows_per_program < 16 or rows_per_program & (rows_per_program - 1):
        raise ValueError(f"_block must be a power of two >= 16, got {rows_per_program}")
    prefix = prefix.contiguous()
    dev = prefix.device
    d = torch.empty(2, m + 1, dtype=torch.float64, device=dev)
    args = torch.empty(k, rows, dtype=torch.int32, device=dev)
    codewords = torch.empty(k, dtype=torch.float64, device=dev)
    cost = torch.empty((), dtype=torch.float64, device=dev)
    grid = (triton.cdiv(rows, rows_per_program),)
    _dp_first_layer_kernel[grid](prefix, d, args, m, rows, BLOCK=rows_per_program,
                                 **LAUNCH_OPTIONS)
    for layer in range(2, k):
        _dp_layer_kernel[grid](prefix, d, args, m, layer, rows, BR=rows_per_program, BC=_COLS,
                               num_warps=_NUM_WARPS, **LAUNCH_OPTIONS)
    _dp_last_layer_kernel[(1,)](prefix, d, args, codewords, cost, m, k, rows, BLOCK=1024,
                                **LAUNCH_OPTIONS)
    return codewords, cost


def _default_rows(rows: int) -> int:
    """``_ROWS`` rows per program when compiled; in the interpreter one program for all rows
    (its cost is per operation, nearly independent of the width)."""
    return max(16, 1 << max(0, (rows - 1).bit_length())) if interpret_mode() else _ROWS
