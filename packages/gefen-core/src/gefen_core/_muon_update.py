"""GefenMuon's update after Newton–Schulz (docs/algorithm.md#gefenmuon): NorMuon, cautious
masking, decoupled decay and the parameter write, on explicit tensors.

:class:`gefen_core.GefenMuon` calls these functions from its methods, which own the state;
under ``torch.compile`` the same functions run as the opaque op ``torch.ops.gefen.muon_update``
(:func:`update_opaque`), so a compiled step writes the eager step's bits: traced, the
compiler would fuse the row norms and the ``add_(o, alpha=...)`` of the write and round them
differently (docs/algorithm.md#compiled-stepping).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["cautious", "normuon", "update_opaque", "write_update"]

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


@torch.library.custom_op("gefen::muon_update", mutates_args=("param", "o", "normuon_state"))
def _muon_update_op(param: Tensor, grad: Tensor, o: Tensor, normuon_state: list[Tensor],
                    lr_tensor: Tensor | None, lr: float, weight_decay: float, alpha: float,
                    normuon_beta2: float, normuon_eps: float, use_cautious: bool,
                    maximize: bool, capturable: bool) -> None:
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


@_muon_update_op.register_fake
def _muon_update_fake(param: Tensor, grad: Tensor, o: Tensor, normuon_state: list[Tensor],
                      lr_tensor: Tensor | None, lr: float, weight_decay: float, alpha: float,
                      normuon_beta2: float, normuon_eps: float, use_cautious: bool,
                      maximize: bool, capturable: bool) -> None:
    return None


def update_opaque(param: Tensor, grad: Tensor, o: Tensor, normuon_state: list[Tensor], *,
                  lr: float | Tensor, weight_decay: float, alpha: float, normuon_beta2: float,
                  normuon_eps: float, use_cautious: bool, maximize: bool,
                  capturable: bool) -> None:
    """:func:`normuon` (when ``normuon_state`` is ``[exp_avg_sq, step]``), :func:`cautious`
    (when ``use_cautious``) and :func:`write_update` as one ``torch.ops.gefen.muon_update``
    call, in place on ``param``, ``o`` and ``normuon_state``."""
    lr_tensor = lr if isinstance(lr, Tensor) else None
    torch.ops.gefen.muon_update(param, grad, o, normuon_state, lr_tensor,
                                0.0 if lr_tensor is not None else float(lr),
                                float(weight_decay), float(alpha), float(normuon_beta2),
                                float(normuon_eps), bool(use_cautious), bool(maximize),
                                bool(capturable))
