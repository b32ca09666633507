"""Fused Gefen step, block second-moment mode (docs/algorithm.md#block-second-moment).

For one parameter viewed as ``B`` blocks of ``P`` consecutive elements (row-major flattening),
in place on ``param``, ``codes``, ``scale`` and ``exp_avg_sq``:

1. ``v_b <- beta2 * v_b + (1 - beta2) * mean_{i in b} g_i^2``
2. ``sigma_b = bc1_recip / (sqrt(v_b) * bc2_rsqrt + eps)``
3. ``m_i = beta1 * s_b * c[q_i] + (1 - beta1) * g_i``; ``s'_b = max |m_i|``;
   ``q'_i = quantize(m_i / s'_b)``; ``p_i <- fp(fp(p_i * decay) - lr * sigma_b * c[q'_i] * s'_b)``

with the rounding sequence and non-finite policy of :mod:`gefen_kernels._numerics`.
The caller (the optimizer) has advanced the step counters and computed the bias corrections.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _validation as V
from ._device import on_tensor_device, use_triton
from ._step_kernels import launch_step
from ._step_ref import ComputeScalars, denominator, make_scalars, run_step

__all__ = ["block_step", "block_step_reference", "block_step_triton"]


def _check(param: Tensor, grad: Tensor, codes: Tensor, scale: Tensor, exp_avg_sq: Tensor,
           codebook: Tensor, beta1: float, beta2: float, eps: float, seed: int,
           hyper: Tensor | None, seed_tensor: Tensor | None, *, allow_fp64: bool) -> None:
    V.check_param_grad(param, grad, allow_fp64=allow_fp64)
    num_blocks, period = V.check_blocks(codes, param.numel())
    dev = param.device
    V.check_state("codes", codes, torch.uint8, (num_blocks, period), dev)
    V.check_state("scale", scale, torch.float32, (num_blocks, 1), dev)
    V.check_state("exp_avg_sq", exp_avg_sq, torch.float32, (num_blocks, 1), dev)
    V.check_codebook(codebook, dev)
    V.check_betas(beta1, beta2, eps)
    V.check_seed(seed)
    V.check_hyper(hyper, seed_tensor, dev)


def block_step_reference(
    param: Tensor,
    grad: Tensor,
    codes: Tensor,
    scale: Tensor,
    exp_avg_sq: Tensor,
    codebook: Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    bc1_recip: float,
    bc2_rsqrt: float,
    decay: float,
    maximize: bool = False,
    stochastic_round: bool = False,
    seed: int = 0,
    hyper: Tensor | None = None,
    seed_tensor: Tensor | None = None,
) -> None:
    """PyTorch reference of the block-mode step (docs/algorithm.md#block-second-moment steps 1, 3,
    4, 5), in place.

    Args:
        param: contiguous, ``N`` elements, fp32/bf16/fp16, or fp64 (then the momentum and
            denominator arithmetic is fp64 and the state is stored in fp32).
        grad: contiguous, ``N`` elements, any float dtype, on ``param``'s device.
        codes: uint8 ``[B, P]`` (``exp_avg_codes``), ``B * P == N``.
        scale: fp32 ``[B, 1]`` (``exp_avg_scale``).
        exp_avg_sq: fp32 ``[B, 1]``.
        codebook: fp32 ``[256]``, sorted, ``c[0] = -1``, ``c[255] = +1``.
        lr, beta1, beta2, eps: the group's hyperparameters.
        bc1_recip: ``1 / (1 - beta1**step)``; bc2_rsqrt: ``1 / sqrt(1 - beta2**step_v)``;
            decay: ``1 - lr * weight_decay`` (host fp64, rounded to fp32 here).
        maximize: step along ``+grad``.
        stochastic_round: stochastic rounding of the new codes
            (docs/algorithm.md#stochastic-rounding) with ``seed`` (the salted 64-bit seed) or
            ``seed_tensor`` and ``idx`` = flat element index.
        hyper: optional fp32 ``[4]`` ``[lr, bc2_rsqrt, bc1_recip, decay]`` on the device,
            replacing the four floats (capturable; no host synchronisation).
        seed_tensor: optional int64 ``[1]`` on the device replacing ``seed``.

    Temporaries are bounded (chunks of whole blocks, at most ~64 MiB whatever ``N``).
    ``lr == 0`` leaves ``param`` bit-for-bit untouched.

    Raises:
        TypeError, ValueError: wrong dtype, shape, device, contiguity or hyperparameter,
            before anything is modified.
    """
    _check(param, grad, codes, scale, exp_avg_sq, codebook, beta1, beta2, eps, seed, hyper,
           seed_tensor, allow_fp64=True)
    if param.numel() == 0:
        return
    cdt = torch.float64 if param.dtype == torch.float64 else torch.float32
    sc = make_scalars(dtype=cdt, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                      bc1_recip=bc1_recip, bc2=bc2_rsqrt, decay=decay, hyper=hyper)
    period = codes.shape[1]

    def block_sigma(first: int, stop: int, sumsq: Tensor | None) -> Tensor:
        assert sumsq is not None
        v_slot = exp_avg_sq[first:stop]
        v_new = _second_moment(v_slot.to(cdt), sumsq, period, sc)
        v_slot.copy_(v_new)
        h = torch.sqrt(v_slot.to(cdt)) * sc.bc2
        return denominator(h, sc)

    run_step(param, grad, codes, scale, codebook, sc, maximize=maximize,
             stochastic_round=stochastic_round,
             seed=seed_tensor.view(()) if seed_tensor is not None else seed,
             block_sigma=block_sigma, element_sigma=None)


def _second_moment(v: Tensor, sumsq: Tensor, period: int, sc: ComputeScalars) -> Tensor:
    # mean = f32(sum / f32(P)); v' = f32(f32(b2 * v) + f32((1 - b2) * mean)).
    mean = sumsq / float(period)
    return (sc.beta2 * v) + (sc.one_minus_beta2 * mean)


# --------------------------------------------------------------------------------------------
# Triton launcher (kernels in _step_kernels.py, shared with factored_step)
# --------------------------------------------------------------------------------------------


@on_tensor_device
def block_step_triton(
    param: Tensor,
    grad: Tensor,
    codes: Tensor,
    scale: Tensor,
    exp_avg_sq: Tensor,
    codebook: Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    bc1_recip: float,
    bc2_rsqrt: float,
    decay: float,
    maximize: bool = False,
    stochastic_round: bool = False,
    seed: int = 0,
    hyper: Tensor | None = None,
    seed_tensor: Tensor | None = None,
) -> None:
    """Triton block-mode step; same signature and contract as :func:`block_step_reference`.

    Codes and scales equal the reference's bit for bit; the second moment may differ by a few
    fp32 ulps (the sum of squares is reduced in another order) and the parameters by what
    that changes in ``sigma`` (at most one ulp of the parameter dtype in practice).
    fp64 parameters are rejected (the reference handles them). No host synchronisation:
    capturable in a CUDA graph with ``hyper``/``seed_tensor``.

    Raises:
        ImportError: Triton is not installed (the message says how to get it).
        TypeError, ValueError: as the reference, plus non-CUDA tensors outside the interpreter.
    """
    _check(param, grad, codes, scale, exp_avg_sq, codebook, beta1, beta2, eps, seed, hyper,
           seed_tensor, allow_fp64=False)
    if grad.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        grad = grad.to(torch.float32)
    launch_step(param, grad, codes, scale, exp_avg_sq=exp_avg_sq, row=None, col=None,
                inv_rbar=None, ncols=1, codebook=codebook, lr=lr, beta1=beta1, beta2=beta2,
                eps=eps, bc1_recip=bc1_recip, bc2=bc2_rsqrt, decay=decay, maximize=maximize,
                stochastic_round=stochastic_round, seed=seed, hyper=hyper,
                seed_tensor=seed_tensor)


# --------------------------------------------------------------------------------------------
# torch.library custom op: CUDA -> Triton (when available, non-fp64), else the reference
# --------------------------------------------------------------------------------------------


@torch.library.custom_op("gefen::block_step",
                         mutates_args=("param", "codes", "scale", "exp_avg_sq"))
def _block_step_op(param: Tensor, grad: Tensor, codes: Tensor, scale: Tensor,
                   exp_avg_sq: Tensor, codebook: Tensor, hyper: Tensor | None,
                   seed_tensor: Tensor | None, lr: float, beta1: float, beta2: float,
                   eps: float, bc1_recip: float, bc2_rsqrt: float, decay: float,
                   maximize: bool, stochastic_round: bool, seed: int) -> None:
    block_step_reference(param, grad, codes, scale, exp_avg_sq, codebook, lr=lr, beta1=beta1,
                         beta2=beta2, eps=eps, bc1_recip=bc1_recip, bc2_rsqrt=bc2_rsqrt,
                         decay=decay, maximize=maximize, stochastic_round=stochastic_round,
                         seed=seed, hyper=hyper, seed_tensor=seed_tensor)


@_block_step_op.register_kernel("cuda")
def _block_step_cuda(param: Tensor, grad: Tensor, codes: Tensor, scale: Tensor,
                     exp_avg_sq: Tensor, codebook: Tensor, hyper: Tensor | None,
                     seed_tensor: Tensor | None, lr: float, beta1: float, beta2: float,
                     eps: float, bc1_recip: float, bc2_rsqrt: float, decay: float,
                     maximize: bool, stochastic_round: bool, seed: int) -> None:
    impl = block_step_triton if use_triton(param) and param.dtype != torch.float64 else (
        block_step_reference)
    impl(param, grad, codes, scale, exp_avg_sq, codebook, lr=lr, beta1=beta1, beta2=beta2,
         eps=eps, bc1_recip=bc1_recip, bc2_rsqrt=bc2_rsqrt, decay=decay, maximize=maximize,
         stochastic_round=stochastic_round, seed=seed, hyper=hyper, seed_tensor=seed_tensor)


@_block_step_op.register_fake
def _block_step_fake(param: Tensor, grad: Tensor, codes: Tensor, scale: Tensor,
                     exp_avg_sq: Tensor, codebook: Tensor, hyper: Tensor | None,
                     seed_tensor: Tensor | None, lr: float, beta1: float, beta2: float,
                     eps: float, bc1_recip: float, bc2_rsqrt: float, decay: float,
                     maximize: bool, stochastic_round: bool, seed: int) -> None:
    return None


def block_step(
    param: Tensor,
    grad: Tensor,
    codes: Tensor,
    scale: Tensor,
    exp_avg_sq: Tensor,
    codebook: Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    bc1_recip: float,
    bc2_rsqrt: float,
    decay: float,
    maximize: bool = False,
    stochastic_round: bool = False,
    seed: int = 0,
    hyper: Tensor | None = None,
    seed_tensor: Tensor | None = None,
) -> None:
    """Block-mode step through ``torch.ops.gefen.block_step`` (arguments as the reference).

    CUDA tensors run the Triton kernel when Triton is available (fp64 params: the reference);
    CPU tensors run the native CPU step (``gefen_kernels.ops._cpu_step``: the reference's
    bits; fp64 params and builds without a C compiler take the reference itself). Arguments
    are validated here, before the op mutates anything. Traceable by
    ``torch.compile(fullgraph=True)``; with ``hyper`` and ``seed_tensor`` the CUDA path does no
    host synchronisation (CUDA-graph capturable).
    """
    _check(param, grad, codes, scale, exp_avg_sq, codebook, beta1, beta2, eps, seed, hyper,
           seed_tensor, allow_fp64=True)
    torch.ops.gefen.block_step(param, grad, codes, scale, exp_avg_sq, codebook, hyper,
                               seed_tensor, float(lr), float(beta1), float(beta2), float(eps),
                               float(bc1_recip), float(bc2_rsqrt), float(decay),
                               bool(maximize), bool(stochastic_round), int(seed))
