"""Test configuration for gefen-kernels.

Triton decides between compiling and interpreting when a kernel is *decorated* (``triton.jit``
reads ``TRITON_INTERPRET`` through ``triton.knobs.runtime.interpret`` at that moment, i.e. when
``gefen_kernels.ops`` is imported), so the variable is set here, before any test module imports
the package. Without CUDA the Triton kernels run in the interpreter on CPU tensors; with CUDA
they compile for the GPU unless the caller exported ``TRITON_INTERPRET`` explicitly.
"""

from __future__ import annotations

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
