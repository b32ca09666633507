"""scripts/check_extras_sync.py: accepts the tree on main, rejects each kind of drift."""

from __future__ import annotations

from pathlib import Path

import check_extras_sync
import pytest
from conftest import ROOT, edit


def test_tree_on_main_is_in_sync() -> None:
    assert check_extras_sync.check(ROOT) == []


def test_scratch_copy_is_in_sync(repo: Path) -> None:
    assert check_extras_sync.check(repo) == []
    assert check_extras_sync.main(["--root", str(repo)]) == 0


def _meta(repo: Path) -> Path:
    return repo / "packages/gefen-x/pyproject.toml"


@pytest.mark.parametrize(
    ("old", "new", "expect"),
    [
        # meta pin drifts from the sibling's version
        ('"gefen-core==0.1.0"', '"gefen-core==0.0.9"', "must pin exactly gefen-core==0.1.0"),
        # meta pin loosened to a range
        ('"gefen-kernels==0.1.0"', '"gefen-kernels>=0.1.0"', "must pin exactly"),
        # extra pointing at the wrong sibling
        ('dist = ["gefen-dist==0.1.0"]', 'dist = ["gefen-bench==0.1.0"]', "[dist] must be"),
        # extra removed
        ('hf = ["gefen-dist[hf]==0.1.0"]\n', "", "extras must be exactly"),
        # [all] misses an extra
        (
            '"gefen-dist[deepspeed,megatron,hf]==0.1.0"',
            '"gefen-dist[deepspeed,hf]==0.1.0"',
            "[all] misses",
        ),
    ],
)
def test_meta_drift_is_reported(repo: Path, old: str, new: str, expect: str) -> None:
    edit(_meta(repo), old, new)
    errors = check_extras_sync.check(repo)
    assert any(expect in e for e in errors), errors
    assert check_extras_sync.main(["--root", str(repo)]) == 1


def test_meta_extra_naming_missing_dist_extra(repo: Path) -> None:
    edit(repo / "packages/gefen-dist/pyproject.toml", 'megatron = ["megatron-core>=0.12"]\n', "")
    errors = check_extras_sync.check(repo)
    assert any("does not define" in e and "megatron" in e for e in errors), errors


def test_sibling_version_bump_without_meta_repin(repo: Path) -> None:
    edit(repo / "packages/gefen-core/src/gefen_core/_version.py", '"0.1.0"', '"0.1.1"')
    edit(repo / "release/versions.toml", 'gefen-core = "0.1.0"', 'gefen-core = "0.1.1"')
    errors = check_extras_sync.check(repo)
    assert any("gefen-core==0.1.1" in e for e in errors), errors


def test_manifest_drift(repo: Path) -> None:
    edit(repo / "release/versions.toml", 'gefen-dist = "0.1.0"', 'gefen-dist = "0.2.0"')
    errors = check_extras_sync.check(repo)
    assert any("versions.toml" in e and "gefen-dist" in e for e in errors), errors


def test_sibling_range_excluding_main(repo: Path) -> None:
    edit(repo / "packages/gefen-kernels/src/gefen_kernels/_version.py", '"0.1.0"', '"0.2.0"')
    edit(repo / "release/versions.toml", 'gefen-kernels = "0.1.0"', 'gefen-kernels = "0.2.0"')
    errors = check_extras_sync.check(repo)
    assert any("excludes gefen-kernels 0.2.0" in e for e in errors), errors


def test_exact_sibling_pin_is_refused(repo: Path) -> None:
    edit(
        repo / "packages/gefen-core/pyproject.toml",
        '"gefen-kernels>=0.1.0,<0.2"',
        '"gefen-kernels==0.1.0"',
    )
    errors = check_extras_sync.check(repo)
    assert any("compatible range" in e for e in errors), errors


def test_untested_lower_bound(repo: Path) -> None:
    edit(
        repo / "packages/gefen-dist/pyproject.toml",
        '"gefen-core>=0.1.0,<0.2"',
        '"gefen-core>=0.0.5,<0.2"',
    )
    errors = check_extras_sync.check(repo)
    assert any("lower bound is 0.0.5" in e for e in errors), errors


def test_backward_dependency_is_refused(repo: Path) -> None:
    edit(
        repo / "packages/gefen-kernels/pyproject.toml",
        '  "torch>=2.7",\n',
        '  "torch>=2.7",\n  "gefen-core>=0.1.0,<0.2",\n',
    )
    errors = check_extras_sync.check(repo)
    assert any("must not depend on gefen-core" in e for e in errors), errors


def test_torch_floor_not_tested(repo: Path) -> None:
    edit(
        repo / "packages/gefen-core/testing/constraints-lowest.txt", "torch==2.7.1", "torch==2.13.0"
    )
    errors = check_extras_sync.check(repo)
    assert any("does not test the declared floor" in e for e in errors), errors


def test_meta_version_must_exceed_earlier_project(repo: Path) -> None:
    edit(repo / "packages/gefen-x/src/gefen/_version.py", '"0.6.0"', '"0.5.0"')
    edit(repo / "release/versions.toml", 'gefen-x = "0.6.0"', 'gefen-x = "0.5.0"')
    errors = check_extras_sync.check(repo)
    assert any("must be newer than 0.5.0" in e for e in errors), errors


def test_facade_extra_must_exist(repo: Path) -> None:
    edit(
        repo / "packages/gefen-x/src/gefen/_exports.py",
        '"GefenDCPState": ("gefen_dist", "dist")',
        '"GefenDCPState": ("gefen_dist", "distributed")',
    )
    errors = check_extras_sync.check(repo)
    assert any("names extra [distributed]" in e for e in errors), errors
