"""The gefen facade: lazy re-exports, install hints for missing extras, clear errors."""

from __future__ import annotations

import importlib
import subprocess
import sys
import types

import pytest

import gefen
from gefen import _exports


@pytest.fixture
def fresh_gefen(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """A gefen module whose lazy-resolution cache is empty (restored after the test)."""
    for name in _exports.EXPORTS:
        monkeypatch.delitem(vars(gefen), name, raising=False)
    return gefen


def test_version_is_single_sourced() -> None:
    from importlib import metadata

    from gefen._version import __version__

    assert gefen.__version__ == __version__
    assert metadata.version("gefen-x") == __version__


def test_gefen_optimizer_is_gefen_core_object(fresh_gefen: types.ModuleType) -> None:
    import gefen_core

    assert fresh_gefen.Gefen is gefen_core.Gefen
    assert fresh_gefen.gefen is gefen_core.gefen
    from gefen import Gefen

    assert Gefen is gefen_core.Gefen


def test_every_installed_export_resolves_to_its_module(fresh_gefen: types.ModuleType) -> None:
    for name, (module_name, _extra) in _exports.EXPORTS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError:
            continue
        assert getattr(fresh_gefen, name) is getattr(module, name), name


@pytest.mark.parametrize(
    ("name", "module_name", "extra"),
    [(n, m, e) for n, (m, e) in _exports.EXPORTS.items() if e is not None],
)
def test_missing_distribution_names_the_pip_line(
    fresh_gefen: types.ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    module_name: str,
    extra: str,
) -> None:
    # None in sys.modules makes `import module_name` fail exactly as if it were absent.
    monkeypatch.setitem(sys.modules, module_name, None)
    with pytest.raises(ImportError) as info:
        getattr(fresh_gefen, name)
    assert f'pip install "gefen-x[{extra}]"' in str(info.value)
    assert _exports.DISTRIBUTIONS[module_name] in str(info.value)


def test_dcp_state_without_dist_names_dist_extra(
    fresh_gefen: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "gefen_dist", None)
    with pytest.raises(ImportError, match=r'pip install "gefen-x\[dist\]"'):
        fresh_gefen.GefenDCPState  # noqa: B018


def test_missing_core_distribution_asks_for_reinstall(
    fresh_gefen: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "gefen_core", None)
    with pytest.raises(ImportError, match=r'pip install --force-reinstall "gefen-x"'):
        fresh_gefen.Gefen  # noqa: B018


def test_broken_dependency_inside_installed_distribution_is_not_masked(
    fresh_gefen: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A distribution that is installed but fails on its own missing dependency must show
    # that dependency, not an install hint for gefen-x.
    def broken_import(name: str, package: str | None = None) -> types.ModuleType:
        raise ModuleNotFoundError("No module named 'deepspeed'", name="deepspeed")

    monkeypatch.setattr(importlib, "import_module", broken_import)
    with pytest.raises(ModuleNotFoundError) as info:
        fresh_gefen.GefenDCPState  # noqa: B018
    assert info.value.name == "deepspeed"
    assert "gefen-x[" not in str(info.value)


def test_name_missing_from_installed_distribution_is_attribute_error(
    fresh_gefen: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = dict(_exports.EXPORTS)
    table["GefenFromTheFuture"] = ("gefen_core", None)
    monkeypatch.setattr(gefen, "EXPORTS", table)
    with pytest.raises(AttributeError) as info:
        fresh_gefen.GefenFromTheFuture  # noqa: B018
    message = str(info.value)
    assert "gefen-core" in message
    assert "does not define it" in message
    assert "pip install --upgrade" in message


def test_unknown_name_is_plain_attribute_error(fresh_gefen: types.ModuleType) -> None:
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchOptimizer'"):
        fresh_gefen.NoSuchOptimizer  # noqa: B018
    assert not hasattr(fresh_gefen, "NoSuchOptimizer")


def test_dir_lists_every_export(fresh_gefen: types.ModuleType) -> None:
    listed = dir(fresh_gefen)
    for name in _exports.EXPORTS:
        assert name in listed


def test_star_import_needs_no_extra() -> None:
    # In a child process with every optional distribution blocked, `import *` must succeed.
    optional = sorted({m for m, e in _exports.EXPORTS.values() if e is not None})
    code = (
        "import sys\n"
        f"for m in {optional!r}: sys.modules[m] = None\n"
        "from gefen import *\n"
        "print(Gefen.__module__.split('.')[0])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.strip() == "gefen_core"


def test_import_gefen_does_not_import_optional_distributions() -> None:
    optional = sorted({m for m, e in _exports.EXPORTS.values() if e is not None})
    code = f"import sys, gefen\nprint([m for m in {optional!r} if m in sys.modules])\n"
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.strip() == "[]"
