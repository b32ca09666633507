#!/usr/bin/env python3
"""Check an installed set of gefen distributions: imports, public names, facade, no pre-releases.

Run with the venv's own interpreter after installing built wheels:

    python scripts/check_installed.py --expect gefen-x gefen-core gefen-kernels

Checks, each failure printed, exit status 1 on any:

* exactly the expected gefen distributions are installed (so "without extras" is real);
* each one imports, its ``__version__`` equals its installed metadata version, it ships
  ``py.typed``, and every name in its ``__all__`` resolves;
* through the ``gefen`` facade, every name of ``gefen._exports.EXPORTS`` whose
  distribution is installed resolves to the very object its module defines, and every other
  one raises ImportError naming the exact ``pip install "gefen-x[<extra>]"`` line;
* no installed distribution (ours or a dependency) is a pre-release, and no requirement of
  ours admits one (``--allow-prerelease`` lifts this for local experiments).

Uses only the standard library plus ``packaging`` when present (vendored by pip otherwise).
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from importlib import metadata
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.version import Version
except ImportError:  # pragma: no cover - fresh venvs have pip's vendored copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.version import Version

OURS = {
    "gefen-kernels": "gefen_kernels",
    "gefen-core": "gefen_core",
    "gefen-dist": "gefen_dist",
    "gefen-bench": "gefen_bench",
    "gefen-x": "gefen",
}


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed() -> dict[str, str]:
    return {_canonical(d.metadata["Name"]): d.version for d in metadata.distributions()}


def check(expect: set[str], allow_prerelease: bool) -> list[str]:
    errors: list[str] = []
    have = installed()
    ours = {name for name in OURS if name in have}
    if ours != expect:
        errors.append(f"installed gefen distributions {sorted(ours)}, expected {sorted(expect)}")
    for name in sorted(ours):
        module_name = OURS[name]
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # noqa: BLE001 - report every failure, keep checking
            errors.append(f"import {module_name}: {type(exc).__name__}: {exc}")
            continue
        if getattr(module, "__version__", None) != have[name]:
            errors.append(
                f"{module_name}.__version__ = {getattr(module, '__version__', None)!r}, "
                f"metadata says {have[name]}"
            )
        if not (Path(module.__file__).parent / "py.typed").is_file():
            errors.append(f"{module_name} ships no py.typed")
        for public in getattr(module, "__all__", []):
            if module_name == "gefen":
                continue  # checked below with the facade rules
            try:
                getattr(module, public)
            except Exception as exc:  # noqa: BLE001
                errors.append(f"{module_name}.{public}: {type(exc).__name__}: {exc}")
        print(f"ok: {name} {have[name]} ({len(getattr(module, '__all__', []))} public names)")
    if "gefen-x" in ours:
        errors.extend(_check_facade(ours))
    if not allow_prerelease:
        errors.extend(_check_no_prerelease(have, ours))
    return errors


def _check_facade(ours: set[str]) -> list[str]:
    errors: list[str] = []
    import gefen
    from gefen._exports import DISTRIBUTIONS, EXPORTS

    for public, (module_name, extra) in EXPORTS.items():
        dist = DISTRIBUTIONS[module_name]
        if dist in ours:
            try:
                value = getattr(gefen, public)
            except Exception as exc:  # noqa: BLE001
                errors.append(f"gefen.{public}: {type(exc).__name__}: {exc}")
                continue
            if value is not getattr(importlib.import_module(module_name), public):
                errors.append(f"gefen.{public} is not {module_name}.{public}")
            else:
                print(f"ok: gefen.{public} -> {module_name}.{public}")
            continue
        want = f'pip install "gefen-x[{extra}]"'
        try:
            getattr(gefen, public)
        except ImportError as exc:
            if want not in str(exc):
                errors.append(f"gefen.{public}: ImportError does not name {want!r}: {exc}")
            else:
                print(f"ok: gefen.{public} without {dist} -> ImportError naming {want}")
        except Exception as exc:  # noqa: BLE001
            errors.append(f"gefen.{public}: expected ImportError, got {type(exc).__name__}: {exc}")
        else:
            errors.append(f"gefen.{public} resolved although {dist} is not installed")
    return errors


def _check_no_prerelease(have: dict[str, str], ours: set[str]) -> list[str]:
    errors = [
        f"pre-release installed: {name} {version}"
        for name, version in sorted(have.items())
        if Version(version).is_prerelease
    ]
    for name in sorted(ours):
        for text in metadata.requires(name) or []:
            req = Requirement(text)
            if req.specifier.prereleases or any(
                Version(s.version.rstrip(".*")).is_prerelease for s in req.specifier
            ):
                errors.append(f"{name} requires a pre-release: {text}")
    return errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--expect", nargs="+", required=True, choices=sorted(OURS))
    parser.add_argument("--allow-prerelease", action="store_true")
    args = parser.parse_args(argv)
    errors = check(set(args.expect), args.allow_prerelease)
    for error in errors:
        print(f"error: {error}", file=sys.stderr)
    if errors:
        return 1
    print(f"check_installed: {sorted(args.expect)} import cleanly; no pre-releases")
    return 0


if __name__ == "__main__":
    sys.exit(main())
