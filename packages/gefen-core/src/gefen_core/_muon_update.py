"""GefenMuon's update after Newton–Schulz (docs/algorithm.md#gefenmuon): NorMuon, cautious
masking, decoupled decay and the parameter write, on explicit tensors; and the whole step of
one matrix as an opaque op.

:class:`gefen_core.GefenMuon` calls these functions from its methods, which own the state.
Under ``torch.compile`` the same functions run inside opaque ops, so a compiled step writes
the eager step's bits: traced, the compiler would fuse the bf16 Newton–Schulz epilogues, the
row norms and the ``add_(o, alpha=...)`` of the write and round them differently
(docs/algorithm.md#compiled-stepping). ``torch.ops.gefen.muon_matrices_step``
(:func:`matrices_step_opaque`) is the whole step of a group's matrices, one dispatch;
``torch.ops.gefen.muon_update`` (:func:`update_opaque`) the update of a matrix whose
Newton–Schulz ran batched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["cautious", "matrices_step_opaque", "normuon", "update_opaque", "write_update"]

_FLT_MIN = 1.1754943508222875e-38


def normuon(o: Tensor, exp_avg_sq: Tensor, step: Tensor, *, beta2: float, eps: float,
            capturable: bool) -> Tensor:
    """NorMuon's per-row normalisation of ``o`` (in place), keeping ``‖O‖_F``.

    Args:
        o: ``[R, C]`` orthogonalised momentum (bf16, fp32 or fp64), modified and returned.
        exp_avg_sq: fp32 ``[R, 1]`` EMA of the rows' mean squares (in/out).
        step: fp32 0-d age of ``exp_avg_sq``, advanced by one (CPU, or ``o``'s device when
            ``capturable``).
        beta2, eps: ``normuon_beta2`` and ``normuon_eps``.
        capturable: read ``step`` on the device (no host synchronisation).
    """
    cols = o.shape[1]
    acc = torch.float64 if o.dtype == torch.float64 else torch.float32
    rho = torch.linalg.vector_norm(o, dim=1, keepdim=True, dtype=acc)  # [R, 1]
    rho_sq = rho.square()
    exp_avg_sq.mul_(beta2).add_((rho_sq / cols).to(exp_avg_sq.dtype), alpha=1.0 - beta2)
    step.add_(1)
    if capturable:
        # On device, no host sync: scalar base, tensor exponent.
        bc = 1.0 - torch.pow(beta2, step.to(torch.float64))
    else:
        bc = 1.0 - beta2 ** float(step)
    d = (exp_avg_sq.to(acc) / bc).sqrt_().add_(eps)
    gamma = rho_sq.sum().sqrt() / (rho / d).square().sum().sqrt().clamp_min(_FLT_MIN)
    return o.mul_((gamma / d).to(o.dtype))


def cautious(o: Tensor, grad: Tensor, *, maximize: bool) -> Tensor:
    """Cautious masking of ``o`` (in place): zero where it disagrees in sign with the step
    direction ``-grad`` (``+grad`` if ``maximize``), rescaled to keep the mean magnitude."""
    g = grad.neg() if maximize else grad
    keep = (o.sign() * g.sign()) > 0
    acc = torch.float64 if o.dtype == torch.float64 else torch.float32
    # The rescale factor in fp32 (a bf16 count would be inexact above 256), applied in O's
    # dtype.
    return o.mul_(keep).mul_(o.numel() / keep.sum().clamp_min(1).to(acc))


def write_update(p: Tensor, o: Tensor, lr: float | Tensor, weight_decay: float,
                 alpha: float) -> None:
    """``θ ← θ(1 − η·λ)``, then ``θ ← θ − η·α·O``, in place on ``p``. ``lr`` (η) is a host
    float, or a tensor read on the device (``capturable``); ``alpha`` is ``α(R, C)``."""
    if isinstance(lr, Tensor):
        lr_t = lr.to(device=p.device)
        if weight_decay != 0:
            p.mul_(1 - lr_t * weight_decay)
        p.sub_(o.to(p.dtype) * (lr_t * alpha).to(p.dtype))
        return
    if lr == 0:
        return
    if weight_decay != 0:
        p.mul_(1.0 - lr * weight_decay)
    p.add_(o, alpha=-(lr * alpha))


def _update(param: Tensor, grad: Tensor, o: Tensor, normuon_state: list[Tensor],
            lr_tensor: Tensor | None, lr: float, weight_decay: float, alpha: float,
            normuon_beta2: float, normuon_eps: float, use_cautious: bool, maximize: bool,
            capturable: bool) -> None:
    if normuon_state:
        o = normuon(o, normuon_state[0], normuon_state[1], beta2=normuon_beta2,
                    eps=normuon_eps, capturable=capturable)
    if use_cautious:
        o = cautious(o, grad, maximize=maximize)
    lr_value: float | Tensor = lr
    if lr_tensor is not None:
        # As the eager step: a capturable group reads it on the device, any other reads it
        # once on the host.
        lr_value = lr_tensor if capturable else float(lr_tensor.detach().reshape(()).item())
    write_update(param, o, lr_value, weight_decay, alpha)


# The ops take their scalars packed in lists: torch's custom-op dispatch costs time quadratic
# in the number of schema arguments (about 0.3 ms a call at 26 arguments).


@torch.library.custom_op("gefen::muon_update", mutates_args=("param", "o", "normuon_state"))
def _muon_update_op(param: Tensor, grad: Tensor, o: Tensor, normuon_state: list[Tensor],
                    lr_tensor: Tensor | None, scalars: list[float], flags: list[bool]) -> None:
    lr, weight_decay, alpha, normuon_beta2, normuon_eps = scalars
    use_cautious, maximize, capturable = flags
    _update(param, grad, o, normuon_state, lr_tensor, lr, weight_decay, alpha, normuon_beta2,
            normuon_eps, use_cautious, maximize, capturable)


@_muon_update_op.register_fake
def _muon_update_fake(param: Tensor, grad: Tensor, o: Tensor, normuon_state: list[Tensor],
                      lr_tensor: Tensor | None, scalars: list[float], flags: list[bool]) -> None:
    return None


def update_opaque(param: Tensor, grad: Tensor, o: Tensor, normuon_state: list[Tensor], *,
                  lr: float | Tensor, weight_decay: float, alpha: float, normuon_beta2: float,
                  normuon_eps: float, use_cautious: bool, maximize: bool,
                  capturable: bool) -> None:
    """:func:`normuon` (when ``normuon_state`` is ``[exp_avg_sq, step]``), :func:`cautious`
    (when ``use_cautious``) and :func:`write_update` as one ``torch.ops.gefen.muon_update``
    call, in place on ``param``, ``o`` and ``normuon_state``."""
    lr_tensor = lr if isinstance(lr, Tensor) else None
    scalars = [0.0 if lr_tensor is not None else float(lr), float(weight_decay), float(alpha),
               float(normuon_beta2), float(normuon_eps)]
    torch.ops.gefen.muon_update(param, grad, o, normuon_state, lr_tensor, scalars,
                                [bool(use_cautious), bool(maximize), bool(capturable)])


@torch.library.custom_op(
    "gefen::muon_matrices_step",
    mutates_args=("params", "exp_avg_codes", "exp_avg_scales", "state_steps",
                  "normuon_exp_avg_sqs", "normuon_steps"),
)
def _muon_matrices_step_op(
    params: list[Tensor], grads: list[Tensor], exp_avg_codes: list[Tensor],
    exp_avg_scales: list[Tensor], state_steps: list[Tensor], normuon_exp_avg_sqs: list[Tensor],
    normuon_steps: list[Tensor], seed_tensors: list[Tensor], codebook: Tensor,
    lr_tensor: Tensor | None, coefficients: list[float], alphas: list[float],
    scalars: list[float], flags: list[bool], ns_dtype: torch.dtype,
) -> None:
    from gefen_kernels.ops.muon_momentum import muon_momentum, muon_momentum_reference

    from .newton_schulz import newton_schulz

    lr, beta, ns_eps, weight_decay, normuon_beta2, normuon_eps = scalars
    (nesterov, maximize, stochastic_round, fused_momentum, fp8, fp8_compile, use_cautious,
     capturable) = flags
    momentum = muon_momentum if fused_momentum else muon_momentum_reference
    schedule = [(coefficients[i], coefficients[i + 1], coefficients[i + 2])
                for i in range(0, len(coefficients), 3)]
    for i, (param, grad) in enumerate(zip(params, grads)):
        u = momentum(grad.contiguous(), exp_avg_codes[i], exp_avg_scales[i], codebook,
                     beta=beta, nesterov=nesterov, maximize=maximize,
                     stochastic_round=stochastic_round, seed=0,
                     seed_tensor=seed_tensors[i] if seed_tensors else None)
        state_steps[i].add_(1)
        o = newton_schulz(u.view(grad.shape), schedule, eps=ns_eps, dtype=ns_dtype, fp8=fp8,
                          fp8_compile=fp8_compile)
        _update(param, grad, o,
                [normuon_exp_avg_sqs[i], normuon_steps[i]] if normuon_steps else [],
                lr_tensor, lr, weight_decay, alphas[i], normuon_beta2, normuon_eps,
                use_cautious, maximize, capturable)


@_muon_matrices_step_op.register_fake
def _muon_matrices_step_fake(
    params: list[Tensor], grads: list[Tensor], exp_avg_codes: list[Tensor],
    exp_avg_scales: list[Tensor], state_steps: list[Tensor], normuon_exp_avg_sqs: list[Tensor],
    normuon_steps: list[Tensor], seed_tensors: list[Tensor], codebook: Tensor,
    lr_tensor: Tensor | None, coefficients: list[float], alphas: list[float],
    scalars: list[float], flags: list[bool], ns_dtype: torch.dtype,
) -> None:
    return None


def matrices_step_opaque(
    params: list[Tensor], grads: list[Tensor], exp_avg_codes: list[Tensor],
    exp_avg_scales: list[Tensor], state_steps: list[Tensor], normuon_exp_avg_sqs: list[Tensor],
    normuon_steps: list[Tensor], seed_tensors: list[Tensor], codebook: Tensor, *,
    lr: float | Tensor, alphas: list[float], schedule: Sequence[Any], beta: float,
    nesterov: bool, maximize: bool, stochastic_round: bool, fused_momentum: bool,
    ns_eps: float, ns_dtype: torch.dtype, fp8: bool, fp8_compile: bool, weight_decay: float,
    normuon_beta2: float, normuon_eps: float, use_cautious: bool, capturable: bool,
) -> None:
    """The GefenMuon step of several initialised matrices of one group and device as one
    ``torch.ops.gefen.muon_matrices_step`` call, each in turn as the eager step does it: the
    quantized momentum (``gefen_kernels.ops.muon_momentum``, or its reference unless
    ``fused_momentum``) on its codes and scales, ``step + 1``, Newton–Schulz (``schedule``,
    ``ns_eps``, ``ns_dtype``, ``fp8``, ``fp8_compile``) and :func:`update_opaque`'s update
    with its ``alphas[i]``. ``normuon_exp_avg_sqs``/``normuon_steps`` are empty without
    NorMuon, ``seed_tensors`` (int64 ``[1]`` each, on the gradients' device) without
    stochastic rounding. In place on the parameters and the state."""
    lr_tensor = lr if isinstance(lr, Tensor) else None
    flat = [float(c) for triple in schedule for c in triple]
    scalars = [0.0 if lr_tensor is not None else float(lr), float(beta), float(ns_eps),
               float(weight_decay), float(normuon_beta2), float(normuon_eps)]
    flags = [bool(nesterov), bool(maximize), bool(stochastic_round), bool(fused_momentum),
             bool(fp8), bool(fp8_compile), bool(use_cautious), bool(capturable)]
    torch.ops.gefen.muon_matrices_step(
        params, grads, exp_avg_codes, exp_avg_scales, state_steps, normuon_exp_avg_sqs,
        normuon_steps, seed_tensors, codebook, lr_tensor, flat, alphas, scalars, flags,
        ns_dtype)
