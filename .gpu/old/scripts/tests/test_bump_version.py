"""scripts/bump_version.py: one distribution's version, changelog and manifest move together."""

from __future__ import annotations

from pathlib import Path

import bump_version
import check_extras_sync
import monorepo
import pytest
from conftest import edit


def _dist(repo: Path, name: str) -> monorepo.Distribution:
    return monorepo.distributions(repo)[name]


def test_bump_unreleased_version_folds_its_notes(repo: Path) -> None:
    core = _dist(repo, "gefen-core")
    before = core.changelog_path.read_text(encoding="utf-8")
    assert "## 0.1.0 — unreleased" in before
    follow = bump_version.bump(repo, "gefen-core", "0.1.1", ["Faster period search."])
    assert core.version() == "0.1.1"
    assert monorepo.read_manifest(repo)["gefen-core"] == "0.1.1"
    text = core.changelog_path.read_text(encoding="utf-8")
    assert "## 0.1.0" not in text
    section = text.split("## 0.1.1 — unreleased\n", 1)[1]
    assert "- First release of `gefen-core`" in section
    assert "- Faster period search." in section
    assert any("bump_version.py gefen-x" in line for line in follow)
    # gefen-x still pins 0.1.0: lint must now fail until gefen-x is re-pinned.
    assert any("gefen-core==0.1.1" in e for e in check_extras_sync.check(repo))


def test_bump_after_release_adds_new_section(repo: Path) -> None:
    assert (
        bump_version.main(["gefen-kernels", "--released", "2026-12-01", "--root", str(repo)]) == 0
    )
    kernels = _dist(repo, "gefen-kernels")
    assert "## 0.1.0 — 2026-12-01" in kernels.changelog_path.read_text(encoding="utf-8")
    bump_version.bump(repo, "gefen-kernels", "0.1.1", ["Fix odd sizes."])
    text = kernels.changelog_path.read_text(encoding="utf-8")
    assert text.index("## 0.1.1 — unreleased") < text.index("## 0.1.0 — 2026-12-01")


def test_meta_bump_repins_tested_set(repo: Path) -> None:
    bump_version.bump(repo, "gefen-core", "0.1.1", ["Fix."])
    bump_version.bump(repo, "gefen-dist", "0.1.2", ["Fix."])
    bump_version.bump(repo, "gefen-x", "0.6.1", ["Pin gefen-core 0.1.1, gefen-dist 0.1.2."])
    meta = (repo / "packages/gefen-x/pyproject.toml").read_text(encoding="utf-8")
    assert '"gefen-core==0.1.1"' in meta
    assert '"gefen-dist[deepspeed]==0.1.2"' in meta
    assert '"gefen-kernels==0.1.0"' in meta
    assert check_extras_sync.check(repo) == []


def test_minor_bump_outside_dependent_range_is_reported(repo: Path) -> None:
    follow = bump_version.bump(repo, "gefen-kernels", "0.2.0", ["Break the op API."])
    assert any("gefen-core" in line and "excludes 0.2.0" in line for line in follow)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["gefen-core", "0.0.9", "-m", "x"], "not newer"),
        (["gefen-core", "0.1.0", "-m", "x"], "not newer"),
        (["gefen-core", "0.2", "-m", "x"], "not X.Y.Z"),
        (["gefen-core", "0.2.0rc1", "-m", "x"], "not X.Y.Z"),
        (["gefen-core", "0.2.0"], "at least one changelog note"),
    ],
)
def test_refused_bumps_write_nothing(
    repo: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    core = _dist(repo, "gefen-core")
    before = (
        core.version_path.read_bytes(),
        core.changelog_path.read_bytes(),
        monorepo.manifest_path(repo).read_bytes(),
    )
    assert bump_version.main([*args, "--root", str(repo)]) == 2
    assert message in capsys.readouterr().err
    after = (
        core.version_path.read_bytes(),
        core.changelog_path.read_bytes(),
        monorepo.manifest_path(repo).read_bytes(),
    )
    assert after == before


def test_released_needs_unreleased_heading(repo: Path) -> None:
    edit(repo / "packages/gefen-bench/CHANGELOG.md", "0.1.0 — unreleased", "0.1.0 — 2026-11-01")
    assert bump_version.main(["gefen-bench", "--released", "2026-12-01", "--root", str(repo)]) == 2
