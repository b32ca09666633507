"""scripts/stream_mutations.py: its mutations still apply to step_groups.py, and it reads each
test's outcome from a JUnit report (a skip or a non-assertion failure is not "caught")."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import stream_mutations


def test_every_mutation_applies_once_and_compiles() -> None:
    source = (stream_mutations.ROOT / stream_mutations.TARGET).read_text()
    assert len(stream_mutations.MUTATIONS) == 7
    for name, (old, new, must_fail) in stream_mutations.MUTATIONS.items():
        assert source.count(old) == 1, name
        mutated = source.replace(old, new)
        assert mutated != source, name
        compile(mutated, name, "exec")
        assert must_fail and must_fail <= set(stream_mutations.SELECTED), name


def test_outcomes_tell_assertions_from_other_failures(tmp_path: Path) -> None:
    (tmp_path / "test_cases.py").write_text(
        "import pytest\n"
        "def test_passes():\n    assert True\n"
        "def test_asserts():\n    assert [1] == [2], 'tensor 1 param: 1 elements differ'\n"
        "def test_raises():\n    raise RuntimeError('planted failure')\n"
        "def test_skips():\n    pytest.skip('needs CUDA')\n"
        "@pytest.fixture\ndef broken():\n    raise OSError('setup')\n"
        "def test_errors(broken):\n    pass\n"
    )
    report = tmp_path / "report.xml"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={report}",
            "test_cases.py",
        ],
        cwd=tmp_path,
        capture_output=True,
        check=False,
    )
    assert stream_mutations._outcomes(report) == {
        "test_passes": "passed",
        "test_asserts": "assertion",
        "test_raises": "failed",
        "test_skips": "skipped",
        "test_errors": "error",
    }


def test_check_wants_exactly_the_expected_failures() -> None:
    first, second, *rest = stream_mutations.SELECTED
    outcomes = {name: "passed" for name in stream_mutations.SELECTED}
    assert stream_mutations._check(outcomes, set())
    outcomes[first] = "assertion"
    assert stream_mutations._check(outcomes, {first})
    assert not stream_mutations._check(outcomes, {first, second})  # one expected failure missing
    assert not stream_mutations._check(outcomes, set())  # an unexpected failure
    outcomes[first] = "failed"  # failed, but not with an AssertionError
    assert not stream_mutations._check(outcomes, {first})
    outcomes[first] = "skipped"
    assert not stream_mutations._check(outcomes, {first})
    del outcomes[second]  # a test missing from the report
    outcomes[first] = "assertion"
    assert not stream_mutations._check(outcomes, {first})
