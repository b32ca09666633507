"""Fixtures for the release scripts' tests: a scratch copy of the files they read."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent
ROOT = SCRIPTS.parent
sys.path.insert(0, str(SCRIPTS))

import monorepo  # noqa: E402


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A copy of the metadata the scripts read (pyproject, versions, changelogs, manifest)."""
    for name, dist in monorepo.distributions(ROOT).items():
        target = tmp_path / "packages" / name
        for rel in (
            "pyproject.toml",
            "CHANGELOG.md",
            "testing/constraints-lowest.txt",
            f"src/{dist.import_name}/_version.py",
        ):
            (target / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(dist.path / rel, target / rel)
    exports = Path("packages/gefen-x/src/gefen/_exports.py")
    shutil.copy2(ROOT / exports, tmp_path / exports)
    (tmp_path / "release").mkdir()
    shutil.copy2(monorepo.manifest_path(ROOT), monorepo.manifest_path(tmp_path))
    return tmp_path


def edit(path: Path, old: str, new: str) -> None:
    """Replace exactly one occurrence of ``old`` (so a test cannot silently edit nothing)."""
    text = path.read_text(encoding="utf-8")
    assert text.count(old) == 1, f"{old!r} occurs {text.count(old)} times in {path}"
    path.write_text(text.replace(old, new), encoding="utf-8")
