"""scripts/check_imports.py: private cross-package imports, import cycles (function-local
imports included) and oversized files each fail the check; the repository passes it."""

from __future__ import annotations

import shutil
from pathlib import Path

import check_imports
import pytest
from conftest import ROOT


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    """A scratch repository of ``packages/<dist>/src/<pkg>/...`` files."""
    for rel, text in files.items():
        path = tmp_path / "packages" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return tmp_path


CLEAN = {
    "a-dist/src/pkg_a/__init__.py": "from .core import run\n",
    "a-dist/src/pkg_a/core.py": "from . import _impl\n\ndef run():\n    return _impl.x\n",
    "a-dist/src/pkg_a/_impl.py": "x = 1\n",
    "b-dist/src/pkg_b/__init__.py": "",
    "b-dist/src/pkg_b/use.py": (
        "import pkg_a\nfrom pkg_a.core import run\nfrom pkg_a import __version__\n"
    ),
}


def test_clean_tree_passes(tmp_path: Path) -> None:
    assert check_imports.check(_tree(tmp_path, CLEAN)) == []
    assert check_imports.main([str(tmp_path)]) == 0


@pytest.mark.parametrize(
    "line",
    [
        "from pkg_a import _impl\n",
        "from pkg_a._impl import x\n",
        "import pkg_a._impl\n",
        "from pkg_a.core import _hidden\n",
        "def f():\n    from pkg_a._impl import x\n    return x\n",  # function-local
    ],
)
def test_private_cross_package_import_fails(tmp_path: Path, line: str) -> None:
    files = dict(CLEAN)
    files["b-dist/src/pkg_b/use.py"] = line
    errors = check_imports.check(_tree(tmp_path, files))
    assert len(errors) == 1 and "private name" in errors[0] and "pkg_b.use" in errors[0], errors
    assert check_imports.main([str(tmp_path)]) == 1


def test_private_import_inside_one_package_passes(tmp_path: Path) -> None:
    files = dict(CLEAN)
    files["a-dist/src/pkg_a/other.py"] = "from pkg_a._impl import x\nfrom ._impl import x as y\n"
    assert check_imports.check(_tree(tmp_path, files)) == []


@pytest.mark.parametrize(
    "back",
    [
        "from . import core\n",  # module level
        "def f():\n    from .core import run\n    return run\n",  # function-local
        "class C:\n    def m(self):\n        import pkg_a.core\n",  # method-local, absolute
    ],
)
def test_import_cycle_fails(tmp_path: Path, back: str) -> None:
    files = dict(CLEAN)
    files["a-dist/src/pkg_a/_impl.py"] = back
    errors = check_imports.check(_tree(tmp_path, files))
    assert errors == [
        "import cycle: pkg_a._impl -> pkg_a.core -> pkg_a._impl (modules in the "
        "cycle: pkg_a._impl, pkg_a.core)"
    ], errors
    assert check_imports.main([str(tmp_path)]) == 1


def test_cycle_through_three_modules_and_type_checking_exemption(tmp_path: Path) -> None:
    files = dict(CLEAN)
    files["a-dist/src/pkg_a/_impl.py"] = "from .third import y\nx = 1\n"
    files["a-dist/src/pkg_a/third.py"] = "def g():\n    from .core import run\n"
    errors = check_imports.check(_tree(tmp_path, files))
    assert (
        len(errors) == 1 and "pkg_a._impl -> pkg_a.third -> pkg_a.core -> pkg_a._impl" in errors[0]
    ), errors
    # An import only for type checkers never runs: not a cycle.
    files["a-dist/src/pkg_a/third.py"] = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .core import run\n"
    )
    assert check_imports.check(_tree(tmp_path / "tc", files)) == []


def test_oversized_files_fail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = dict(CLEAN)
    files["a-dist/src/pkg_a/big.py"] = "x = 1\n" * 6
    files["a-dist/src/pkg_a/thin.py"] = "x = 1\n" * 3
    monkeypatch.setattr(check_imports, "MAX_LINES", 5)
    monkeypatch.setattr(
        check_imports,
        "LINE_LIMITS",
        {"/".join(("packages", "a-dist", "src", "pkg_a", "thin.py")): 2},
    )
    errors = check_imports.check(_tree(tmp_path, files))
    assert [e.split(": ", 1)[1] for e in errors] == [
        "6 lines, over the limit of 5 (split it)",
        "3 lines, over the limit of 2 (split it)",
    ]


def test_repository_passes(tmp_path: Path) -> None:
    shutil.copytree(
        ROOT / "packages",
        tmp_path / "packages",
        ignore=shutil.ignore_patterns("tests", "__pycache__", "*.pyc"),
    )
    assert check_imports.check(tmp_path) == []
