"""Which implementation an op runs, and the device check of the Triton launchers."""

from __future__ import annotations

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
