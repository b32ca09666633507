"""scripts/gefen_pytest_gates.py: under the GPU gate a skip fails the run; counts are exact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent

SUITE = """
import pytest

def test_ok():
    assert 1 + 1 == 2

@pytest.mark.skipif(True, reason="CUDA is not available")
def test_needs_gpu():
    assert False

@pytest.mark.xfail(reason="known")
def test_known():
    assert False
"""


def _run(tmp_path: Path, source: str, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_suite.py").write_text(source)
    env = {**os.environ, "PYTHONPATH": str(SCRIPTS)}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "gefen_pytest_gates",
            "-p",
            "no:cacheprovider",
            *args,
            str(tmp_path),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_skip_is_a_failure_under_the_gate(tmp_path: Path) -> None:
    summary = tmp_path / "summary.json"
    out = _run(tmp_path, SUITE, "--gefen-fail-on-skip", "--gefen-summary", str(summary))
    assert out.returncode == 1, out.stdout
    assert "gefen gate: FAILED" in out.stdout
    assert "CUDA is not available" in out.stdout
    counts = json.loads(summary.read_text())
    assert (counts["passed"], counts["skipped"], counts["xfailed"], counts["failed"]) == (
        1,
        1,
        1,
        0,
    )


def test_skip_is_allowed_without_the_gate(tmp_path: Path) -> None:
    out = _run(tmp_path, SUITE)
    assert out.returncode == 0, out.stdout


def test_clean_suite_passes_the_gate(tmp_path: Path) -> None:
    out = _run(tmp_path, "def test_ok():\n    assert True\n", "--gefen-fail-on-skip")
    assert out.returncode == 0, out.stdout


def test_module_level_skip_counts(tmp_path: Path) -> None:
    source = "import pytest\npytest.importorskip('no_such_module_xyz')\n\ndef test_x():\n    pass\n"
    out = _run(tmp_path, source, "--gefen-fail-on-skip")
    assert out.returncode == 1, out.stdout


def test_no_tests_is_not_success(tmp_path: Path) -> None:
    out = _run(tmp_path, "def helper():\n    pass\n", "--gefen-fail-on-skip")
    assert out.returncode == pytest.ExitCode.NO_TESTS_COLLECTED


def test_require_installed_rejects_source_tree(tmp_path: Path) -> None:
    # A source-tree copy of one of the distributions' packages shadows the installed one.
    pkg = tmp_path / "src" / "gefen_core"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    source = (
        f"import sys\nsys.path.insert(0, {str(tmp_path / 'src')!r})\nimport gefen_core\n\n"
        "def test_x():\n    pass\n"
    )
    out = _run(tmp_path, source, "--gefen-require-installed")
    assert out.returncode == 1, out.stdout
    assert "gefen_core was imported from" in out.stdout
    # The plugin itself (gefen_pytest_gates, from scripts/) is not a distribution package.
    assert "gefen_pytest_gates was imported" not in out.stdout


@pytest.mark.skipif(sys.platform != "linux", reason="bash script")
def test_gpu_runner_refuses_a_machine_without_gpu(tmp_path: Path) -> None:
    # A fake torch that reports no CUDA: the GPU list must fail, never skip.
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        "class cuda:\n    @staticmethod\n    def is_available():\n        return False\n"
    )
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run(
        ["bash", str(SCRIPTS / "run_gpu_tests.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "no CUDA GPU visible" in out.stderr
