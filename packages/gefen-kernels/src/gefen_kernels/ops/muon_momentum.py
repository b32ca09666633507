"""Quantized Muon momentum: EMA on the codes, re-quantisation, dense output
(docs/algorithm.md#gefenmuon).

For one matrix viewed as ``B`` blocks of ``P`` consecutive elements (row-major flattening),
in place on ``codes`` and ``scale``, and returning the dense momentum ``U`` that Muon
orthogonalises (the parameter is not touched; Newton–Schulz and the update follow in the
optimizer):

1. ``m_i = beta * s_b * c[q_i] + (1 - beta) * g_i``   (fp32; the one EMA definition of
   :func:`gefen_kernels._numerics.momentum_ema`, separately rounded products)
2. ``s'_b = max_{i in b} |m_i|``; ``q'_i = quantize(m_i / s'_b)`` (0 where ``s'_b = 0``;
   nearest or stochastic rounding, docs/algorithm.md#stochastic-rounding)
3. ``u_i = fp( f32( fp(c[q'_i]) * s'_b ) )``: the codeword is rounded to the gradient dtype
   ``fp`` before scaling (docs/algorithm.md#gefenmuon), so the output is the *re-quantized* momentum
4. with ``nesterov``: ``u_i = fp( f32( f32((1 - beta) * g_i) + fp(f32(u_i * beta)) ) )``
   (no fma: every product is rounded separately, as everywhere in
   :mod:`gefen_kernels._numerics`). The state keeps the plain EMA.

The arithmetic is fp32 for fp32/bf16/fp16 gradients (decision O10: the reference
implementation computed this EMA in bf16) and fp64 for fp64 gradients; ``codes`` and ``scale``
are always uint8 and fp32. Non-finite values follow :mod:`gefen_kernels._numerics`.

Implementations: :func:`muon_momentum_reference` (PyTorch, any device, chunked),
:func:`muon_momentum_triton` (the kernels of :mod:`._muon_kernels`, bit-identical to the
reference for fp32/bf16/fp16 gradients), the custom op ``torch.ops.gefen.muon_momentum``
(CUDA -> Triton, else the reference; fake implementation for ``torch.compile``) and the
dispatching :func:`muon_momentum` that gefen-core calls.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _validation as V
from .._numerics import f32, momentum_ema
from ._chunks import block_groups
from ._device import on_tensor_device, use_triton
from ._muon_kernels import launch_muon_momentum
from ._quant_ref import round_codes, sr_uniform_int64

__all__ = ["muon_momentum", "muon_momentum_reference", "muon_momentum_triton"]


def _check(grad: Tensor, codes: Tensor, scale: Tensor, codebook: Tensor, beta: float,
           seed: int, seed_tensor: Tensor | None, out: Tensor | None) -> None:
    V.check_tensor("grad", grad)
    V.check_float("grad", grad)
    if grad.is_complex():
        raise TypeError("grad must be real")
    V.check_contiguous("grad", grad)
    num_blocks, period = V.check_blocks(codes, grad.numel())
    dev = grad.device
    V.check_state("codes", codes, torch.uint8, (num_blocks, period), dev)
    V.check_state("scale", scale, torch.float32, (num_blocks, 1), dev)
    V.check_codebook(codebook, dev)
    if not isinstance(beta, (int, float)) or isinstance(beta, bool) or not 0.0 <= beta < 1.0:
        raise ValueError(f"beta (the Muon momentum) must be a float in [0, 1), got {beta!r}")
    V.check_seed(seed)
    V.check_hyper(None, seed_tensor, dev)
    if out is not None:
        V.check_state("out", out, grad.dtype, tuple(grad.shape), dev)


def muon_momentum_reference(
    grad: Tensor,
    codes: Tensor,
    scale: Tensor,
    codebook: Tensor,
    *,
    beta: float,
    nesterov: bool,
    maximize: bool = False,
    stochastic_round: bool = False,
    seed: int = 0,
    seed_tensor: Tensor | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """PyTorch reference of the quantized Muon momentum step (docs/algorithm.md#gefenmuon),
    codes/scale in place.

    Args:
        grad: contiguous, ``N`` elements, fp32/bf16/fp16/fp64 (fp64: fp64 arithmetic).
        codes: uint8 ``[B, P]`` (``exp_avg_codes``), ``B * P == N``, updated in place.
        scale: fp32 ``[B, 1]`` (``exp_avg_scale``), updated in place.
        codebook: fp32 ``[256]``, sorted, ``c[0] = -1``, ``c[255] = +1``.
        beta: the momentum ``β`` in ``[0, 1)``.
        nesterov: return the Nesterov look-ahead ``β·U + (1 - β)·g`` instead of ``U``.
        maximize: use ``-grad``.
        stochastic_round: stochastic rounding of the new codes
            (docs/algorithm.md#stochastic-rounding) with ``seed`` (the salted 64-bit seed) or
            ``seed_tensor`` (int64 ``[1]`` on the device, capturable), and ``idx`` = flat element
            index.
        out: optional preallocated result (``grad``'s dtype, shape and device, contiguous).

    Returns:
        The dense momentum, ``grad``'s dtype and shape (``out`` when given). Temporaries are
        bounded (chunks of whole blocks), apart from the output itself.

    Raises:
        TypeError, ValueError: wrong dtype, shape, device, contiguity, ``beta`` or seed,
            before anything is modified.
    """
    _check(grad, codes, scale, codebook, beta, seed, seed_tensor, out)
    result = torch.empty_like(grad) if out is None else out
    if grad.numel() == 0:
        return result
    gdt = grad.dtype
    cdt = torch.float64 if gdt == torch.float64 else torch.float32
    if cdt == torch.float32:
        b, omb = f32(beta), f32(1.0 - f32(beta))
    else:
        b, omb = float(beta), 1.0 - float(beta)
    # torch.full is a fill kernel, not a host-to-device copy, so a CUDA-graph capture of the
    # optimizer step can contain it.
    b_t = torch.full((), b, dtype=cdt, device=grad.device)
    omb_t = torch.full((), omb, dtype=cdt, device=grad.device)
    seed_value: int | Tensor = seed_tensor.view(()) if seed_tensor is not None else seed
    num_blocks, period = codes.shape
    flat_g = grad.view(-1)
    flat_q = codes.view(-1)
    flat_u = result.view(-1)
    cb = codebook.to(cdt)
    # The codeword as the gradient dtype sees it (docs/algorithm.md#gefenmuon: rounded before
    # scaling).
    cb_out = codebook.to(gdt).to(cdt)
    for group in block_groups(num_blocks, period):
        nb = group.stop - group.first
        single = len(group.tiles) == 1
        rows = nb if single else 1
        s_old = scale[group.first:group.stop].to(cdt)

        def ema(start: int, end: int, s_old: Tensor = s_old,
                rows: int = rows) -> tuple[Tensor, Tensor]:
            g = flat_g[start:end].view(rows, -1).to(cdt)
            if maximize:
                g = g.neg()
            return g, momentum_ema(b_t, omb_t, s_old,
                                   cb[flat_q[start:end].view(rows, -1).long()], g)

        amax: Tensor | None = None
        kept: tuple[Tensor, Tensor] | None = None
        for start, end in group.tiles:
            g, m = ema(start, end)
            tile_max = m.abs().amax(dim=1, keepdim=True)  # NaN-propagating, like the kernels
            amax = tile_max if amax is None else torch.maximum(amax, tile_max)
            kept = (g, m) if single else None
        assert amax is not None
        s_new = amax.to(torch.float32).to(cdt)
        positive = s_new > 0
        s_div = torch.where(positive, s_new, torch.ones_like(s_new))
        for start, end in group.tiles:
            g, m = kept if kept is not None else ema(start, end)
            z = torch.where(positive, m / s_div, torch.zeros_like(m)).to(torch.float32).view(-1)
            uniform = None
            if stochastic_round:
                index = torch.arange(start, end, device=grad.device, dtype=torch.int64)
                uniform = sr_uniform_int64(seed_value, index)
            # An exactly-zero gradient rounds toward zero (docs/algorithm.md#toward-zero-rounding).
            q = round_codes(z, codebook, g.view(-1) == 0, stochastic=stochastic_round, u=uniform)
            flat_q[start:end].copy_(q.view(-1))
            u = (cb_out[q].view(s_new.shape[0], -1) * s_new).to(gdt)
            if nesterov:
                g = flat_g[start:end].view(u.shape).to(cdt)
                if maximize:
                    g = g.neg()
                look = (u.to(cdt) * b_t).to(gdt).to(cdt)
                u = ((omb_t * g) + look).to(gdt)
            flat_u[start:end].copy_(u.view(-1))
            del g, m, z, q, u
        scale[group.first:group.stop].copy_(s_new)
    return result


# --------------------------------------------------------------------------------------------
# Triton launcher (kernels in _muon_kernels.py)
# --------------------------------------------------------------------------------------------


@on_tensor_device
def muon_momentum_triton(
    grad: Tensor,
    codes: Tensor,
    scale: Tensor,
    codebook: Tensor,
    *,
    beta: float,
    nesterov: bool,
    maximize: bool = False,
    stochastic_round: bool = False,
    seed: int = 0,
    seed_tensor: Tensor | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """Triton Muon momentum step; same signature and contract as the reference.

    Codes, scales and the dense output equal :func:`muon_momentum_reference`'s bit for bit
    (the only reduction, the block max, is order-independent; every other operation is the
    same IEEE fp32 operation in the same order). One launch for ``P <= 4096`` (``tile``
    route) or for many long blocks (``loop``); few long blocks take two launches and a torch
    ``amax`` (``split``). No host synchronisation once the codebook's search table is cached:
    capturable in a CUDA graph with ``seed_tensor``.

    Raises:
        ImportError: Triton is not installed (the message says how to get it).
        TypeError, ValueError: as the reference; an fp64 ``grad`` (the reference handles it);
            non-CUDA tensors outside the Triton interpreter.
    """
    _check(grad, codes, scale, codebook, beta, seed, seed_tensor, out)
    if grad.dtype not in _KERNEL_DTYPES:
        raise TypeError(f"grad dtype {grad.dtype} is not supported by the Triton kernel; "
                        "expected fp32, bf16 or fp16 (fp64 gradients take the PyTorch "
                        "reference path: call muon_momentum or muon_momentum_reference)")
    result = torch.empty_like(grad) if out is None else out
    launch_muon_momentum(grad, codes, scale, codebook, result, beta=beta, nesterov=nesterov,
                         maximize=maximize, stochastic_round=stochastic_round, seed=seed,
                         seed_tensor=seed_tensor)
    return result


_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------------------------
# torch.library custom op: CUDA -> Triton (when available, non-fp64), else the reference.
# The op writes the preallocated ``out`` (a custom op may not return an alias of an input).
# --------------------------------------------------------------------------------------------


@torch.library.custom_op("gefen::muon_momentum", mutates_args=("codes", "scale", "out"))
def _muon_momentum_op(grad: Tensor, codes: Tensor, scale: Tensor, codebook: Tensor,
                      seed_tensor: Tensor | None, out: Tensor, beta: float, nesterov: bool,
                      maximize: bool, stochastic_round: bool, seed: int) -> None:
    muon_momentum_reference(grad, codes, scale, codebook, beta=beta, nesterov=nesterov,
                            maximize=maximize, stochastic_round=stochastic_round, seed=seed,
                            seed_tensor=seed_tensor, out=out)


@_muon_momentum_op.register_kernel("cuda")
def _muon_momentum_cuda(grad: Tensor, codes: Tensor, scale: Tensor, codebook: Tensor,
                        seed_tensor: Tensor | None, out: Tensor, beta: float, nesterov: bool,
                        maximize: bool, stochastic_round: bool, seed: int) -> None:
    impl = muon_momentum_triton if use_triton(grad) and grad.dtype in _KERNEL_DTYPES else (
        muon_momentum_reference)
    impl(grad, codes, scale, codebook, beta=beta, nesterov=nesterov, maximize=maximize,
         stochastic_round=stochastic_round, seed=seed, seed_tensor=seed_tensor, out=out)


@_muon_momentum_op.register_fake
def _muon_momentum_fake(grad: Tensor, codes: Tensor, scale: Tensor, codebook: Tensor,
                        seed_tensor: Tensor | None, out: Tensor, beta: float, nesterov: bool,
                        maximize: bool, stochastic_round: bool, seed: int) -> None:
    return None


def muon_momentum(
    grad: Tensor,
    codes: Tensor,
    scale: Tensor,
    codebook: Tensor,
    *,
    beta: float,
    nesterov: bool,
    maximize: bool = False,
    stochastic_round: bool = False,
    seed: int = 0,
    seed_tensor: Tensor | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """The quantized Muon momentum step through ``torch.ops.gefen.muon_momentum``.

    Same arguments, result and errors as :func:`muon_momentum_reference`. CUDA tensors run
    the Triton kernel when Triton is available (fp64 gradients: the reference); CPU tensors
    run the native CPU step (``gefen_kernels.ops._cpu_step``, the reference's bits).
    Arguments are validated here, before the op mutates anything.
    Traceable by ``torch.compile(fullgraph=True)``; with ``seed_tensor`` the CUDA path does no
    host synchronisation (CUDA-graph capturable once the codebook's search table is cached).
    """
    _check(grad, codes, scale, codebook, beta, seed, seed_tensor, out)
    result = torch.empty_like(grad) if out is None else out
    torch.ops.gefen.muon_momentum(grad, codes, scale, codebook, seed_tensor, result,
                                  float(beta), bool(nesterov), bool(maximize),
                                  bool(stochastic_round), int(seed))
    return result
