"""Package surface: version constants, exports, and importing without Triton."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch

import gefen_kernels


def test_api_version_and_exports() -> None:
    assert gefen_kernels.KERNEL_API_VERSION == 1
    assert isinstance(gefen_kernels.__version__, str)
    assert isinstance(gefen_kernels.triton_available(), bool)
    for name in gefen_kernels.__all__:
        assert hasattr(gefen_kernels, name), name
    for op in ("block_step", "factored_step", "histogram", "quantize_nearest",
               "quantize_stochastic", "multi_block_step"):
        assert hasattr(torch.ops.gefen, op), op


def test_import_and_references_work_without_triton() -> None:
    """With Triton unimportable the package imports, the references and the public ops run
    (CPU -> reference), and a Triton path raises an ImportError that says how to get it."""
    code = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None  # makes `import triton` raise ImportError
        import torch
        import gefen_kernels as gk
        assert not gk.triton_available()
        cb = torch.linspace(-1, 1, 256)
        x = torch.randn(100) * 0.5
        assert torch.equal(gk.quantize_nearest(x, cb), gk.quantize_nearest_reference(x, cb))
        try:
            gk.quantize_nearest_triton(x, cb)
        except ImportError as exc:
            assert "pip install triton" in str(exc), exc
        else:
            raise AssertionError("no ImportError")
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")
