"""Codeword search (docs/algorithm.md#stochastic-rounding): nearest and stochastic rounding into the
codebook.

``codebook`` is fp32 ``[256]``, sorted ascending, ``c[0] = -1``, ``c[255] = +1``. Inputs are
converted to fp32. Nearest: ``j = lower_bound(c, x)``, ``R = clamp(j, 0, 255)``,
``L = max(R - 1, 0)``, ``L`` if ``|x - c_L| <= |x - c_R|`` (fp32 distances) else ``R``; values
below -1 give 0, above +1 give 255, NaN gives 0. Stochastic: ``R`` with probability
``(clamp(x, c_L, c_R) - c_L) / (c_R - c_L)`` using the counter-based splitmix64 uniform
``U(seed, offset + flat index)`` (24 random bits), so ``E[c_q] = x`` inside ``[-1, 1]``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _numerics
from .. import _validation as V
from .._numerics import to_signed64
from .._triton import jit, program_elements, require_triton, tl, triton
from ._decision_table import kernel_table
from ._device import check_device_for_triton, on_tensor_device, use_triton
from ._quant_ref import nearest_codes, sr_uniform_int64, stochastic_codes
from ._triton_helpers import LAUNCH_OPTIONS, tl_quantize_nearest, tl_quantize_stochastic

__all__ = [
    "quantize_nearest",
    "quantize_nearest_reference",
    "quantize_nearest_triton",
    "quantize_stochastic",
    "quantize_stochastic_reference",
    "quantize_stochastic_triton",
    "sr_uniform_reference",
]


def _check(x: Tensor, codebook: Tensor) -> None:
    V.check_tensor("x", x)
    V.check_float("x", x)
    V.check_codebook(codebook, x.device)


def quantize_nearest_reference(x: Tensor, codebook: Tensor) -> Tensor:
    """Nearest codeword indices of ``x`` (any float dtype, any shape); uint8, ``x.shape``.

    Raises:
        TypeError, ValueError: non-float ``x``; codebook not fp32 ``[256]`` on ``x``'s device.
    """
    _check(x, codebook)
    flat = x.reshape(-1)
    out = torch.empty(flat.shape, dtype=torch.uint8, device=x.device)
    chunk = _numerics.CHUNK_ELEMENTS
    for start in range(0, flat.numel(), chunk):
        part = flat[start:start + chunk].to(torch.float32)
        out[start:start + chunk] = nearest_codes(part, codebook).to(torch.uint8)
    return out.view(x.shape)


def sr_uniform_reference(seed: int, index: Tensor) -> Tensor:
    """The docs/algorithm.md#stochastic-rounding counter-based uniform: fp32 in ``[0, 1)``
    (multiples of 2**-24), ``index.shape``.

    Args:
        seed: the already-salted 64-bit seed, a Python int in ``[-2**63, 2**63)``.
        index: integer tensor of element counters (converted to int64).
    """
    V.check_seed(seed)
    V.check_tensor("index", index)
    if index.is_floating_point() or index.is_complex() or index.dtype == torch.bool:
        raise TypeError(f"index must be an integer tensor, got {index.dtype}")
    return sr_uniform_int64(seed, index.to(torch.int64))


def quantize_stochastic_reference(x: Tensor, codebook: Tensor, seed: int,
                                  offset: int = 0) -> Tensor:
    """Stochastically rounded codeword indices of ``x``; uint8, ``x.shape``.

    Element ``i`` of the row-major flattening uses ``U(seed, offset + i)``.

    Raises:
        TypeError, ValueError: as :func:`quantize_nearest_reference`, or a seed/offset outside
            the int64 range.
    """
    _check(x, codebook)
    V.check_seed(seed)
    V.check_seed(offset)
    flat = x.reshape(-1)
    out = torch.empty(flat.shape, dtype=torch.uint8, device=x.device)
    chunk = _numerics.CHUNK_ELEMENTS
    for start in range(0, flat.numel(), chunk):
        part = flat[start:start + chunk].to(torch.float32)
        index = torch.arange(start, start + part.numel(), dtype=torch.int64, device=x.device)
        u = sr_uniform_int64(seed, index + offset)
        out[start:start + chunk] = stochastic_codes(part, codebook, u).to(torch.uint8)
    return out.view(x.shape)


# --------------------------------------------------------------------------------------------
# Triton kernel and launchers
# --------------------------------------------------------------------------------------------

_QUANT_BLOCK = 1024


@jit(do_not_specialize=["seed", "offset"])
def _quantize_kernel(x_ptr, cb_ptr, table_ptr, out_ptr, numel, seed, offset,  # type: ignore[no-untyped-def]
                     STOCHASTIC: tl.constexpr, BLOCK: tl.constexpr, STEPS: tl.constexpr,
                     TOWARD_ZERO: tl.constexpr):
    """Codeword search over a flat tensor.

    x_ptr: ``[numel]`` contiguous, fp32/bf16/fp16 (converted to fp32); cb_ptr: fp32 ``[256]``;
    table_ptr: int64 ``[4353]`` packed search table (:func:`._decision_table.kernel_table`;
    ``STEPS`` probes; 0: full search, table unused);
    out_ptr: uint8 ``[numel]``. seed, offset: int64 (two's complement of the 64-bit key).
    STOCHASTIC: stochastic rounding with ``U(seed, offset + i)``, else nearest. TOWARD_ZERO:
    every element rounds as a zero-gradient element of a step does
    (docs/algorithm.md#toward-zero-rounding; the tests' window on the step kernels' lookup).
    BLOCK: elements per program. Offsets are int64 (tensors may exceed 2**31 elements).
    """
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = offs < numel
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    zero = (offs >= 0) if TOWARD_ZERO else (offs < 0)
    if STOCHASTIC:
        seed_u = seed.to(tl.int64).to(tl.uint64, bitcast=True)
        q, _ = tl_quantize_stochastic(x, cb_ptr, table_ptr, STEPS, seed_u,
                                   offs + offset.to(tl.int64), zero)
    else:
        q, _ = tl_quantize_nearest(x, cb_ptr, table_ptr, STEPS, zero)
    tl.store(out_ptr + offs, q.to(tl.uint8), mask=mask)


def _triton_input(x: Tensor) -> Tensor:
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        x = x.to(torch.float32)  # fp64 inputs: the kernel computes in fp32 anyway
    return x.contiguous().view(-1)


def _launch_quantize(x: Tensor, codebook: Tensor, seed: int, offset: int,
                     stochastic: bool, use_table: bool = True, toward_zero: bool = False) -> Tensor:
    require_triton("quantize (Triton path)")
    check_device_for_triton(x)
    flat = _triton_input(x)
    out = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    n = flat.numel()
    if n:
        block = program_elements(_QUANT_BLOCK)
        grid = (triton.cdiv(n, block),)
        table, steps = (kernel_table(codebook, stochastic=stochastic) if use_table
                        else (codebook, 0))
        _quantize_kernel[grid](flat, codebook, table, out.view(-1), n, to_signed64(seed),
                               to_signed64(offset), STOCHASTIC=stochastic, BLOCK=block,
                               STEPS=steps, TOWARD_ZERO=toward_zero,
                               num_warps=4, **LAUNCH_OPTIONS)
    return out


@on_tensor_device
def quantize_nearest_triton(x: Tensor, codebook: Tensor) -> Tensor:
    """Triton twin of :func:`quantize_nearest_reference` (same signature, same codes).

    Raises:
        ImportError: Triton is not installed (the message says how to get it).
        ValueError: ``x`` is not on a CUDA device (outside ``TRITON_INTERPRET=1``).
    """
    _check(x, codebook)
    return _launch_quantize(x, codebook, 0, 0, False)


@on_tensor_device
def quantize_stochastic_triton(x: Tensor, codebook: Tensor, seed: int, offset: int = 0) -> Tensor:
    """Triton twin of :func:`quantize_stochastic_reference` (same hash, same codes)."""
    _check(x, codebook)
    V.check_seed(seed)
    V.check_seed(offset)
    return _launch_quantize(x, codebook, seed, offset, True)


# --------------------------------------------------------------------------------------------
# torch.library custom ops: CUDA -> Triton (when available), everything else -> reference
# --------------------------------------------------------------------------------------------


@torch.library.custom_op("gefen::quantize_nearest", mutates_args=())
def _quantize_nearest_op(x: Tensor, codebook: Tensor) -> Tensor:
    return quantize_nearest_reference(x, codebook)


@_quantize_nearest_op.register_kernel("cuda")
def _quantize_nearest_cuda(x: Tensor, codebook: Tensor) -> Tensor:
    if use_triton(x):
        return quantize_nearest_triton(x, codebook)
    return quantize_nearest_reference(x, codebook)


@_quantize_nearest_op.register_fake
def _quantize_nearest_fake(x: Tensor, codebook: Tensor) -> Tensor:
    return torch.empty(x.shape, dtype=torch.uint8, device=x.device)


@torch.library.custom_op("gefen::quantize_stochastic", mutates_args=())
def _quantize_stochastic_op(x: Tensor, codebook: Tensor, seed: int, offset: int) -> Tensor:
    return quantize_stochastic_reference(x, codebook, seed, offset)


@_quantize_stochastic_op.register_kernel("cuda")
def _quantize_stochastic_cuda(x: Tensor, codebook: Tensor, seed: int, offset: int) -> Tensor:
    if use_triton(x):
        return quantize_stochastic_triton(x, codebook, seed, offset)
    return quantize_stochastic_reference(x, codebook, seed, offset)


@_quantize_stochastic_op.register_fake
def _quantize_stochastic_fake(x: Tensor, codebook: Tensor, seed: int, offset: int) -> Tensor:
    return torch.empty(x.shape, dtype=torch.uint8, device=x.device)


def quantize_nearest(x: Tensor, codebook: Tensor) -> Tensor:
    """Nearest codeword indices (uint8, ``x.shape``) through ``torch.ops.gefen.quantize_nearest``.

    CUDA tensors run the Triton kernel when Triton is available, others the reference; both
    give identical codes. Works under ``torch.compile(fullgraph=True)``.
    """
    _check(x, codebook)
    return torch.ops.gefen.quantize_nearest(x, codebook)


def quantize_stochastic(x: Tensor, codebook: Tensor, seed: int, offset: int = 0) -> Tensor:
    """Stochastically rounded codes through ``torch.ops.gefen.quantize_stochastic``."""
    _check(x, codebook)
    V.check_seed(seed)
    V.check_seed(offset)
    return torch.ops.gefen.quantize_stochastic(x, codebook, seed, offset)
