"""Optional Triton: detection, the interpreter switch, and a loud error when it is missing.

Importing :mod:`gefen_kernels` never imports Triton eagerly enough to fail: if Triton is not
installed (CPU-only wheels, macOS, Windows) every op still runs through its PyTorch reference.
Asking explicitly for a Triton path without Triton raises :class:`ImportError` naming the fix.

The kernels are ``@triton.jit`` functions defined at import time of each op module. Triton reads
``TRITON_INTERPRET`` when a function is decorated, so the variable must be set *before*
``gefen_kernels.ops`` is imported (``tests/conftest.py`` does it for the CPU test suite).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

__all__ = [
    "TRITON_AVAILABLE",
    "gather_supported",
    "interpret_mode",
    "jit",
    "program_elements",
    "require_triton",
    "tl",
    "triton",
    "triton_available",
]

_INSTALL_HINT = (
    "Triton is not installed. It ships with PyTorch's Linux CUDA wheels; otherwise install it "
    "with `pip install triton` (Linux), or call the `<op>_reference` functions, which need only "
    "PyTorch."
)

triton: Any = None
tl: Any = None
_IMPORT_ERROR: BaseException | None = None
try:  # pragma: no cover - which branch runs depends on the environment
    import triton as _triton_module
    import triton.language as _tl_module

    triton, tl = _triton_module, _tl_module
    TRITON_AVAILABLE = True
except Exception as exc:  # ImportError, or a broken install raising something else
    TRITON_AVAILABLE = False
    _IMPORT_ERROR = exc


def triton_available() -> bool:
    """Whether Triton imported successfully (it may still lack a GPU; see interpret_mode)."""
    return TRITON_AVAILABLE


def gather_supported() -> bool:
    """Whether ``tl.gather`` compiles in the step kernels. Triton 3.3's compiler stops on an
    assertion (``OptimizeThreadLocality``: the gather is not warp-local) for sm_90; 3.6 (on
    the H200) and 3.9 (``tests/compile_check.py --stage ttgir``) compile it. Versions in
    between were not tried and take the global load instead."""
    if triton is None:
        return False
    try:
        major, minor = (int(x) for x in str(triton.__version__).split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (3, 6)


def interpret_mode() -> bool:
    """Whether Triton kernels run in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def program_elements(gpu: int) -> int:
    """Elements per program: ``gpu`` when compiling, 16384 in the interpreter.

    The interpreter's cost is per operation, nearly independent of the tile width, so it runs
    fastest with few, wide programs. Results do not depend on the tile width.
    """
    return max(gpu, 16384) if interpret_mode() else gpu


def require_triton(what: str) -> None:
    """Raise an :class:`ImportError` explaining how to get Triton when it is absent."""
    if not TRITON_AVAILABLE:
        raise ImportError(f"{what} needs Triton. {_INSTALL_HINT}") from _IMPORT_ERROR


def jit(fn: Callable[..., Any] | None = None, **kwargs: Any) -> Any:
    """``triton.jit`` when Triton is importable; otherwise a stub that raises on launch.

    Usable bare (``@jit``) or with ``triton.jit`` keyword arguments (``@jit(do_not_specialize=
    ["seed"])``).
    """
    if fn is None:
        return lambda f: jit(f, **kwargs)
    if TRITON_AVAILABLE:
        return triton.jit(fn, **kwargs) if kwargs else triton.jit(fn)
    name = fn.__name__

    class _MissingTritonKernel:
        __name__ = name
        __doc__ = fn.__doc__

        def __getitem__(self, grid: Any) -> Callable[..., Any]:
            require_triton(f"the Triton kernel {name}")
            raise AssertionError("unreachable")  # require_triton raised

    return _MissingTritonKernel()
