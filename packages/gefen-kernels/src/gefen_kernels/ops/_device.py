"""Which implementation an op runs, and the device check of the Triton launchers."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
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


_TRANSIENT = threading.local()


@contextlib.contextmanager
def transient_tables() -> Iterator[None]:
    """Within this scope the fused step keeps none of the device tables it builds (launch
    tables, gradient-offset tables, graph-replay buffers): it uses the ones an earlier eager
    step kept and frees what it builds itself when the step returns.

    For a caller whose allocations may land in a memory pool it does not own: under
    ``torch.compile(mode="reduce-overhead")`` the step's warm-up and recording allocate from
    the CUDA-graph trees' private pool, which refuses any tensor that outlives the recorded
    call ("tensors in the cudagraph pool not tracked as outputs"). A step that finds no kept
    table builds one for the call; inside a CUDA-graph capture, where none can be built, it
    takes the per-tensor launches, which give the grouped launches' bits. Nests; applies to
    the current thread.
    """
    depth = getattr(_TRANSIENT, "depth", 0)
    _TRANSIENT.depth = depth + 1
    try:
        yield
    finally:
        _TRANSIENT.depth = depth


def keeps_tables() -> bool:
    """Whether a device table built now may be kept for later steps (not inside
    :func:`transient_tables`)."""
    return getattr(_TRANSIENT, "depth", 0) == 0
