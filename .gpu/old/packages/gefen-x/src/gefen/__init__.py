"""gefen: one import for the Gefen optimizers and their integrations.

``from gefen import Gefen`` works with a plain ``pip install gefen-x``. Names that live in
an optional distribution (for example ``gefen.GefenDCPState`` from ``gefen-dist``) are
imported lazily on first access (PEP 562 ``__getattr__``), so ``import gefen`` stays cheap
and never imports an engine the user did not install.

Errors:
    ImportError: the name's distribution is not installed; the message is the exact
        ``pip install "gefen-x[<extra>]"`` line that installs it.
    AttributeError: the name is unknown, or the installed distribution is too old to define
        it; the message names the installed version and the upgrade.

The table of re-exported names is ``gefen._exports.EXPORTS``.
"""

from __future__ import annotations

import importlib
from importlib import metadata
from typing import Any

from ._exports import DISTRIBUTIONS, EXPORTS
from ._version import __version__

# Star-imports take only the names every install has, so `from gefen import *` never
# raises for an extra that is not installed.
__all__ = ["__version__", *(name for name, (_, extra) in EXPORTS.items() if extra is None)]


def _install_line(extra: str | None) -> str:
    return f'pip install "gefen-x[{extra}]"' if extra else 'pip install --force-reinstall "gefen-x"'


def _installed_version(module: str) -> str:
    try:
        return metadata.version(DISTRIBUTIONS[module])
    except metadata.PackageNotFoundError:
        return "unknown"


def __getattr__(name: str) -> Any:
    try:
        module_name, extra = EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'gefen' has no attribute {name!r}") from None
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        # Only a missing distribution gets the install hint; a broken dependency *inside*
        # an installed distribution must surface as itself.
        if exc.name != module_name:
            raise
        distribution = DISTRIBUTIONS[module_name]
        raise ImportError(
            f"gefen.{name} lives in the {distribution} distribution, which is not installed. "
            f"Install it with: {_install_line(extra)}",
            name=module_name,
        ) from exc
    try:
        value = getattr(module, name)
    except AttributeError:
        distribution = DISTRIBUTIONS[module_name]
        raise AttributeError(
            f"gefen.{name} is provided by {distribution}, but the installed {distribution} "
            f"{_installed_version(module_name)} does not define it. Upgrade with: "
            f'pip install --upgrade "gefen-x{f"[{extra}]" if extra else ""}"'
        ) from None
    # Cache so later lookups are plain module attribute reads.
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(EXPORTS))
