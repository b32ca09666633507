#!/usr/bin/env python3
"""Fail when gefen-x's pins and extras, the sibling ranges and the version manifest drift.

Checks (each failure is printed with the file to fix):

1. Every distribution's version is a release ``X.Y.Z`` and equals ``release/versions.toml``;
   ``gefen-x`` is newer than the earlier project's last release on PyPI (0.5.0).
2. Sibling requirements point one way (kernels <- core <- dist <- bench), are compatible
   ranges ``>=L,<U`` (never exact pins), admit the sibling's version on main, and their lower
   bound ``L`` is the pin in that package's ``testing/constraints-lowest.txt``; each
   constraints file pins torch to the declared floor's release.
3. ``gefen-x`` pins ``gefen-core`` and ``gefen-kernels`` exactly to their versions on main;
   its extras map one-to-one (``[dist]``, ``[deepspeed]``, ``[megatron]``, ``[hf]``,
   ``[bench]``) to exactly-pinned siblings, every ``gefen-dist[...]`` extra it names exists,
   and ``[all]`` is the union of the others.
4. Every extra named in the facade table ``gefen/_exports.py`` exists.

Usage: ``python scripts/check_extras_sync.py [--root PATH]``; exit status 1 on any failure.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import monorepo
from monorepo import META, META_BASE, META_EXTRAS, SIBLINGS, canonical
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version


def _sibling_requirements(requirements: list[str]) -> dict[str, Requirement]:
    found = {}
    for text in requirements:
        req = Requirement(text)
        if canonical(req.name) in monorepo.DISTRIBUTIONS:
            found[canonical(req.name)] = req
    return found


def _lower_bound(spec: SpecifierSet) -> str | None:
    lows = [s.version for s in spec if s.operator == ">="]
    return lows[0] if len(lows) == 1 else None


def check_versions(root: Path) -> list[str]:
    errors = []
    dists = monorepo.distributions(root)
    manifest = monorepo.read_manifest(root)
    for name, dist in dists.items():
        version = dist.version()
        try:
            monorepo.semver_key(version)
        except ValueError as exc:
            errors.append(f"{dist.version_path}: {exc}")
        if manifest.get(name) != version:
            errors.append(
                f"{monorepo.manifest_path(root)}: {name} = {manifest.get(name)!r} but "
                f"{dist.version_path} says {version!r}; run scripts/bump_version.py"
            )
        dynamic = dist.pyproject()["project"].get("dynamic", [])
        if "version" not in dynamic:
            errors.append(f"{dist.pyproject_path}: version must be dynamic (single source)")
    extra_names = set(manifest) - set(dists)
    if extra_names:
        errors.append(
            f"{monorepo.manifest_path(root)}: unknown distributions {sorted(extra_names)}"
        )
    meta_version = dists[META].version()
    if Version(meta_version) <= Version(monorepo.META_PREVIOUS_PROJECT_LAST):
        errors.append(
            f"{dists[META].version_path}: gefen-x {meta_version} must be newer than "
            f"{monorepo.META_PREVIOUS_PROJECT_LAST} (already on PyPI from an earlier project)"
        )
    return errors


def check_sibling_ranges(root: Path) -> list[str]:
    errors = []
    dists = monorepo.distributions(root)
    order = list(SIBLINGS)
    for position, name in enumerate(order):
        dist = dists[name]
        project = dist.pyproject()["project"]
        lowest = dist.constraints_lowest()
        torch_reqs = [Requirement(r) for r in project.get("dependencies", [])]
        torch_reqs = [r for r in torch_reqs if canonical(r.name) == "torch"]
        if not torch_reqs:
            errors.append(f"{dist.pyproject_path}: no torch requirement")
        else:
            floor = _lower_bound(torch_reqs[0].specifier)
            pinned = lowest.get("torch")
            if (
                floor is None
                or pinned is None
                or Version(pinned).release[:2] != Version(floor).release[:2]
                or pinned not in torch_reqs[0].specifier
            ):
                errors.append(
                    f"{dist.constraints_lowest_path}: torch=={pinned} does not test the "
                    f"declared floor {torch_reqs[0].specifier}"
                )
        all_reqs = list(project.get("dependencies", []))
        for extra_reqs in project.get("optional-dependencies", {}).values():
            all_reqs.extend(extra_reqs)
        for dep_name, req in _sibling_requirements(all_reqs).items():
            if dep_name == META or dep_name not in order or order.index(dep_name) >= position:
                errors.append(
                    f"{dist.pyproject_path}: {name} must not depend on {dep_name} "
                    "(dependencies point kernels <- core <- dist <- bench)"
                )
                continue
            spec = req.specifier
            low = _lower_bound(spec)
            has_upper = any(s.operator == "<" for s in spec)
            if low is None or not has_upper or any(s.operator in ("==", "===") for s in spec):
                errors.append(f"{dist.pyproject_path}: {req} must be a compatible range '>=L,<U'")
                continue
            dep_version = dists[dep_name].version()
            if dep_version not in spec:
                errors.append(
                    f"{dist.pyproject_path}: {req} excludes {dep_name} {dep_version} on main; "
                    "widen the range (and test its lower bound)"
                )
            if lowest.get(dep_name) != low:
                errors.append(
                    f"{dist.constraints_lowest_path}: pins {dep_name}=={lowest.get(dep_name)} "
                    f"but the range's lower bound is {low}"
                )
    return errors


def check_meta(root: Path) -> list[str]:
    errors = []
    dists = monorepo.distributions(root)
    meta = dists[META]
    project = meta.pyproject()["project"]
    versions = {name: d.version() for name, d in dists.items()}

    def exact_pin(req: Requirement, where: str) -> None:
        pins = [s for s in req.specifier if s.operator == "=="]
        want = versions[canonical(req.name)]
        if len(pins) != 1 or len(req.specifier) != 1 or pins[0].version != want:
            errors.append(
                f"{meta.pyproject_path}: {where}: {req} must pin exactly "
                f"{canonical(req.name)}=={want} (the version on main)"
            )

    base = _sibling_requirements(project.get("dependencies", []))
    if sorted(base) != sorted(META_BASE):
        errors.append(
            f"{meta.pyproject_path}: dependencies must be exactly {META_BASE}, found {sorted(base)}"
        )
    for req in base.values():
        exact_pin(req, "dependencies")

    extras = project.get("optional-dependencies", {})
    expected = set(META_EXTRAS) | {"all"}
    if set(extras) != expected:
        errors.append(
            f"{meta.pyproject_path}: extras must be exactly {sorted(expected)}, "
            f"found {sorted(extras)}"
        )
    dist_extras = set(dists["gefen-dist"].pyproject()["project"].get("optional-dependencies", {}))
    union: set[tuple[str, str]] = set()
    for extra, wanted in META_EXTRAS.items():
        reqs = [Requirement(r) for r in extras.get(extra, [])]
        got = sorted((canonical(r.name), ",".join(sorted(r.extras))) for r in reqs)
        if got != sorted(wanted):
            errors.append(f"{meta.pyproject_path}: [{extra}] must be {wanted}, found {got}")
        for req in reqs:
            exact_pin(req, f"[{extra}]")
            if canonical(req.name) == "gefen-dist":
                missing = set(req.extras) - dist_extras
                if missing:
                    errors.append(
                        f"{meta.pyproject_path}: [{extra}] asks for gefen-dist{sorted(missing)}, "
                        f"which packages/gefen-dist/pyproject.toml does not define"
                    )
        union |= {(canonical(r.name), e) for r in reqs for e in (r.extras or {""})}
    all_reqs = [Requirement(r) for r in extras.get("all", [])]
    for req in all_reqs:
        exact_pin(req, "[all]")
    covered = {(canonical(r.name), e) for r in all_reqs for e in (r.extras or {""})}
    # gefen-dist[x] covers plain gefen-dist too.
    covered |= {(name, "") for name, _ in covered}
    if not union <= covered:
        errors.append(
            f"{meta.pyproject_path}: [all] misses {sorted(union - covered)}; it must hold "
            "every other extra"
        )
    if covered - union - {(name, "") for name, _ in union}:
        errors.append(f"{meta.pyproject_path}: [all] holds more than the other extras")

    lowest = meta.constraints_lowest()
    for name in SIBLINGS:
        if lowest.get(name) != versions[name]:
            errors.append(
                f"{meta.constraints_lowest_path}: pin {name}=={versions[name]} "
                f"(found {lowest.get(name)})"
            )

    for name, (module, extra) in monorepo.facade_exports(root).items():
        if extra is not None and extra not in extras:
            errors.append(
                f"packages/gefen-x/src/gefen/_exports.py: {name} names extra [{extra}], "
                "which gefen-x does not define"
            )
        if module not in SIBLINGS.values():
            errors.append(
                f"packages/gefen-x/src/gefen/_exports.py: {name} comes from {module}, "
                "which is not a sibling distribution"
            )
    return errors


def check(root: Path) -> list[str]:
    return check_versions(root) + check_sibling_ranges(root) + check_meta(root)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=monorepo.ROOT, help="repository root")
    args = parser.parse_args(argv)
    errors = check(args.root)
    for error in errors:
        print(f"error: {error}", file=sys.stderr)
    if errors:
        print(f"check_extras_sync: {len(errors)} problem(s)", file=sys.stderr)
        return 1
    print("check_extras_sync: pins, extras, ranges and manifest agree")
    return 0


if __name__ == "__main__":
    sys.exit(main())
