"""Which implementation an op runs, and the device check of the Triton launchers."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch
from torch import Tensor

from .._triton import interpret_mode, triton_available


def use_triton(t: Tensor) -> bool:
    """Custom-op CUDA kernels take Triton when it is importable, else the PyTorch reference."""
    return t.device.type == "cuda" and triton_available()


def check_device_for_triton(t: Tensor) -> None:
    """The Triton launchers need CUDA tensors, except in the interpreter (CPU tensors)."""
    if t.device.type != "cuda" and not interpret_mode():
        raise ValueError(
            f"the Triton path needs CUDA tensors, got a tensor on {t.device}; call the "
            "`<op>` or `<op>_reference` function instead, or set TRITON_INTERPRET=1 before "
            "importing gefen_kernels to run the kernels in Triton's CPU interpreter"
        )


_F = TypeVar("_F", bound=Callable[..., Any])


def on_tensor_device(fn: _F) -> _F:
    """Run a Triton launcher with the current CUDA device set to its first argument's (a
    tensor, or the first tensor of a list).

    Triton launches on the *current* device, not on its arguments': without this, a tensor on
    ``cuda:1`` while ``cuda:0`` is current fails with "Pointer argument cannot be accessed from
    Triton". Custom ops get no device guard from the dispatcher, so the public ``*_triton``
    functions (which the ops' CUDA kernels call) set it themselves; the switch costs nothing
    when the device is already current."""

    @functools.wraps(fn)
    def launcher(*args: Any, **kwargs: Any) -> Any:
        t = args[0] if args else None
        if isinstance(t, (list, tuple)):
            t = t[0] if t else None
        if (isinstance(t, Tensor) and t.is_cuda
                and t.device.index != torch.cuda.current_device()):
            with torch.cuda.device(t.device):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return cast(_F, launcher)
