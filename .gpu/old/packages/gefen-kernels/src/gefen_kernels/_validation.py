"""Argument checks shared by the ops: each error names the argument and the fix."""

from __future__ import annotations

import torch
from torch import Tensor

from ._numerics import NUM_CODEWORDS

_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_tensor(name: str, t: object) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def check_contiguous(name: str, t: Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() on it first)")


def check_float(name: str, t: Tensor) -> None:
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")


def check_codebook(codebook: Tensor, device: torch.device) -> None:
    check_tensor("codebook", codebook)
    if codebook.dtype != torch.float32 or codebook.shape != (NUM_CODEWORDS,):
        raise ValueError(
            f"codebook must be fp32 of shape [{NUM_CODEWORDS}], got {codebook.dtype} "
            f"{tuple(codebook.shape)}"
        )
    if codebook.device != device:
        raise ValueError(f"codebook is on {codebook.device} but the data is on {device}; "
                         "move it with codebook.to(device)")
    check_contiguous("codebook", codebook)


def check_state(name: str, t: Tensor, dtype: torch.dtype, shape: tuple[int, ...],
                device: torch.device) -> None:
    check_tensor(name, t)
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but param is on {device}")
    check_contiguous(name, t)


def check_param_grad(param: Tensor, grad: Tensor, *, allow_fp64: bool) -> None:
    check_tensor("param", param)
    check_tensor("grad", grad)
    allowed = _PARAM_DTYPES + ((torch.float64,) if allow_fp64 else ())
    if param.dtype not in allowed:
        hint = "" if allow_fp64 else " (fp64 parameters take the PyTorch reference path)"
        raise TypeError(f"param dtype {param.dtype} is not supported; expected one of "
                        f"{[str(d) for d in allowed]}{hint}")
    check_float("grad", grad)
    if grad.is_complex() or param.is_complex():
        raise TypeError("complex param/grad are not supported")
    if grad.numel() != param.numel():
        raise ValueError(f"grad has {grad.numel()} elements but param has {param.numel()}")
    if grad.device != param.device:
        raise ValueError(f"grad is on {grad.device} but param is on {param.device}")
    check_contiguous("param", param)
    check_contiguous("grad", grad)


def check_blocks(codes: Tensor, numel: int) -> tuple[int, int]:
    """Return (B, P) from the codes tensor, checking ``B * P == numel``."""
    check_tensor("codes", codes)
    if codes.dim() != 2:
        raise ValueError(f"codes must be 2-D [B, P], got shape {list(codes.shape)}")
    num_blocks, period = int(codes.shape[0]), int(codes.shape[1])
    if num_blocks * period != numel:
        raise ValueError(
            f"codes shape {list(codes.shape)} does not tile the parameter's {numel} elements "
            "(need B * P == numel)"
        )
    if numel > 0 and period < 1:
        raise ValueError("period (codes.shape[1]) must be >= 1")
    return num_blocks, period


def check_hyper(hyper: Tensor | None, seed_tensor: Tensor | None, device: torch.device) -> None:
    if hyper is not None:
        check_state("hyper", hyper, torch.float32, (4,), device)
    if seed_tensor is not None:
        check_tensor("seed_tensor", seed_tensor)
        if seed_tensor.dtype != torch.int64 or seed_tensor.numel() != 1:
            raise ValueError("seed_tensor must be an int64 tensor with one element")
        if seed_tensor.device != device:
            raise ValueError(f"seed_tensor is on {seed_tensor.device} but param is on {device}")


def check_betas(beta1: float, beta2: float, eps: float) -> None:
    if not 0.0 <= beta1 < 1.0:
        raise ValueError(f"beta1 must be in [0, 1), got {beta1}")
    if not 0.0 <= beta2 < 1.0:
        raise ValueError(f"beta2 must be in [0, 1), got {beta2}")
    if not eps >= 0.0:
        raise ValueError(f"eps must be >= 0, got {eps}")


def check_seed(seed: int) -> None:
    if not isinstance(seed, int) or not -(1 << 63) <= seed < (1 << 63):
        raise ValueError(f"seed must be a Python int in [-2**63, 2**63), got {seed!r}")
