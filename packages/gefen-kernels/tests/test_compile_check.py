"""Every Gefen Triton kernel compiles for sm_90 in every configuration its launchers pick.

The interpreter-based CPU tests cannot see front-end compile errors (an ``int`` argument equal
to 1 is specialised to a constant on a GPU; the first H200 run failed on exactly that). This
test runs ``compile_check.py`` in a fresh process (kernels must be decorated with
``TRITON_INTERPRET=0``, and this session interprets) through Triton's ahead-of-time API.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _compile_api_usable() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler.compiler import ASTSource, make_backend

        make_backend(GPUTarget("cuda", 90, 32))
        return callable(ASTSource)
    except Exception:
        return False


@pytest.mark.timeout(900)
@pytest.mark.skipif(not _compile_api_usable(),
                    reason="Triton's ahead-of-time compile API for CUDA is not importable here")
def test_every_kernel_compiles_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(HERE / "compile_check.py"), "--stage", "ir"],
                          capture_output=True, text=True, env=env, timeout=880)
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, report[-8000:]
    assert "0 failed" in report and "_step_tile_kernel" in report, report[-2000:]
    for kernel in ("_step_loop_kernel", "_step_partial_kernel", "_step_apply_kernel",
                   "_factored_stats_kernel", "_factored_finalize_kernel",
                   "_group_tile_kernel", "_group_stats_kernel", "_group_finalize_kernel",
                   "_step_update_kernel", "_group_update_kernel", "_quantize_kernel",
                   "_muon_tile_kernel", "_muon_loop_kernel",
                   "_muon_apply_kernel", "_period_prefix_kernel", "_period_offsets_kernel",
                   "_period_terms_kernel", "_period_carry_kernel", "_multi_prefix_kernel",
                   "_multi_terms_kernel", "_multi_carry_kernel", "_dp_first_layer_kernel",
                   "_dp_layer_kernel", "_dp_last_layer_kernel"):
        assert kernel in report, f"{kernel} was never launched by the scenarios:\n{report}"


@pytest.mark.timeout(600)
@pytest.mark.skipif(not _compile_api_usable(),
                    reason="Triton's ahead-of-time compile API for CUDA is not importable here")
def test_grouped_kernels_compile_to_the_one_tensor_layouts() -> None:
    """The grouped step kernels (ops/_group_kernels.py) and the batched period-score kernels
    (ops/_period_kernels.py) must sum in the one-tensor kernels' order to give the same bits,
    i.e. compile to the same load and reduction layouts: the interpreter cannot see layouts,
    the compiler can (``compile_check.py --compare-layouts``)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(HERE / "compile_check.py"), "--compare-layouts"],
                          capture_output=True, text=True, env=env, timeout=580)
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, report[-8000:]
    assert " 0 kernel pairs with different layouts" in report, report[-2000:]
    for kernel in ("_group_tile_kernel", "_group_stats_kernel", "_group_finalize_kernel",
                   "_group_update_kernel", "_multi_prefix_kernel", "_multi_terms_kernel",
                   "_multi_carry_kernel"):
        assert kernel in report, report[-2000:]


def test_resource_report_arithmetic(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--resources``' parsing of cuobjdump's text and its register-limited warps per SM
    (64K registers per SM, allocated per warp in units of 256, at most 64 warps)."""
    # Importing the script sets TRITON_INTERPRET=0 for its own process: undo it here.
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", ""))
    monkeypatch.syspath_prepend(str(HERE))
    import compile_check as cc
    text = ("Resource usage:\n Function _step_tile_kernel:\n  REG:111 STACK:0 SHARED:16 "
            "LOCAL:0 CONSTANT[0]:504 TEXTURE:0 SURFACE:0 SAMPLER:0\n")
    assert cc.parse_resource_usage(text) == {"reg": 111, "stack": 0, "shared": 16, "local": 0}
    assert cc.resident_warps(111, 4) == 16  # 112 * 32 * 4 = 14336 registers per program
    assert cc.resident_warps(80, 4) == 24
    assert cc.resident_warps(81, 4) == 20  # rounds up to 88 per thread
    assert cc.resident_warps(32, 4) == 64  # register file allows 128: the 64-warp cap binds
    assert cc.resident_warps(255, 8) == 8  # 256 * 32 * 8: the whole file, one program
