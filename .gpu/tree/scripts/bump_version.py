#!/usr/bin/env python3
"""Bump one distribution's version and record it in its changelog and the manifest.

    python scripts/bump_version.py gefen-core 0.1.1 -m "Fix ..." [-m "..."]
    python scripts/bump_version.py gefen-x 0.6.1 -m "Pin gefen-core 0.1.1."
    python scripts/bump_version.py gefen-core --released 2026-12-01

A bump rewrites ``src/<import>/_version.py`` (the single source hatchling reads), the
``release/versions.toml`` manifest and ``CHANGELOG.md``: the notes go under a new
``## <version> — unreleased`` heading, or are added to the top heading when the current
version was never released (its heading still says "unreleased"; it is renamed). Bumping
``gefen-x`` re-pins its dependencies and extras to the sibling versions on main, which is
how the meta package records the exact set it is released with (release/POLICY.md).
``--released DATE`` stamps the top "unreleased" heading with the release date.

Errors (exit status 2, nothing written): unknown distribution, a version that is not
``X.Y.Z`` or not newer than the current one, no ``-m`` note, a changelog without headings.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import re
import sys
from pathlib import Path

import monorepo
from packaging.requirements import Requirement

_HEADING_RE = re.compile(r"^## (?P<version>\S+) — (?P<status>.+)$", re.MULTILINE)


class BumpError(ValueError):
    """A bump that was refused before anything was written."""


def _write_version(dist: monorepo.Distribution, version: str) -> None:
    path = dist.version_path
    text = path.read_text(encoding="utf-8")
    new, count = re.subn(
        r'^__version__\s*=\s*"[^"]+"\s*$', f'__version__ = "{version}"', text, flags=re.MULTILINE
    )
    if count != 1:
        raise BumpError(f'{path}: expected one `__version__ = "..."` line')
    path.write_text(new, encoding="utf-8")


def _write_manifest(root: Path, name: str, version: str) -> None:
    path = monorepo.manifest_path(root)
    text = path.read_text(encoding="utf-8")
    new, count = re.subn(
        rf'^{re.escape(name)}\s*=\s*"[^"]*"\s*$', f'{name} = "{version}"', text, flags=re.MULTILINE
    )
    if count != 1:
        raise BumpError(f'{path}: expected one line `{name} = "..."`')
    path.write_text(new, encoding="utf-8")


def changelog_with_entry(text: str, current: str, version: str, notes: list[str]) -> str:
    """Return ``text`` with ``notes`` recorded under ``version`` (see the module docstring)."""
    first = _HEADING_RE.search(text)
    if first is None:
        raise BumpError("CHANGELOG.md has no '## <version> — <date|unreleased>' heading")
    bullets = "".join(f"- {note.strip()}\n" for note in notes)
    if first.group("version") == current and first.group("status") == "unreleased":
        # The current version never shipped: fold its notes into the new version.
        body_start = first.end() + 1
        following = _HEADING_RE.search(text, body_start)
        body_end = following.start() if following else len(text)
        body = text[body_start:body_end].rstrip("\n")
        section = f"## {version} — unreleased\n{body}\n{bullets}\n"
        return text[: first.start()] + section + text[body_end:].lstrip("\n")
    section = f"## {version} — unreleased\n\n{bullets}\n"
    return text[: first.start()] + section + text[first.start() :]


def changelog_released(text: str, date: str) -> str:
    first = _HEADING_RE.search(text)
    if first is None or first.group("status") != "unreleased":
        raise BumpError("the top CHANGELOG.md heading is not 'unreleased'")
    return text[: first.start()] + f"## {first.group('version')} — {date}" + text[first.end() :]


def _repin_meta(root: Path) -> list[str]:
    """Pin gefen-x's requirements to the sibling versions on main; return what changed."""
    dists = monorepo.distributions(root)
    versions = {name: d.version() for name, d in dists.items()}
    path = dists[monorepo.META].pyproject_path
    text = path.read_text(encoding="utf-8")
    changed = []

    def repin(match: re.Match[str]) -> str:
        req = Requirement(match.group(1))
        name = monorepo.canonical(req.name)
        if name not in monorepo.SIBLINGS:
            return match.group(0)
        extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
        new = f"{name}{extras}=={versions[name]}"
        if new != match.group(1):
            changed.append(f"{match.group(1)} -> {new}")
        return f'"{new}"'

    text = re.sub(r'"(gefen-[a-z]+(?:\[[a-z,]+\])?==[^"]+)"', repin, text)
    path.write_text(text, encoding="utf-8")
    lowest = dists[monorepo.META].constraints_lowest_path
    lines = []
    for line in lowest.read_text(encoding="utf-8").splitlines():
        name = monorepo.canonical(line.partition("==")[0].strip())
        if name in monorepo.SIBLINGS and not line.lstrip().startswith("#"):
            line = f"{name}=={versions[name]}"
        lines.append(line)
    lowest.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return changed


def bump(root: Path, name: str, version: str, notes: list[str]) -> list[str]:
    """Bump ``name`` to ``version``; return human-readable follow-ups. Raises BumpError."""
    dists = monorepo.distributions(root)
    if name not in dists:
        raise BumpError(f"unknown distribution {name!r}; choose one of {sorted(dists)}")
    if not notes:
        raise BumpError("give at least one changelog note with -m")
    dist = dists[name]
    current = dist.version()
    new_key = monorepo.semver_key(version) if monorepo.SEMVER_RE.match(version) else None
    if new_key is None:
        raise BumpError(f"version {version!r} is not X.Y.Z")
    if new_key <= monorepo.semver_key(current):
        raise BumpError(f"{name}: {version} is not newer than {current}")
    changelog = changelog_with_entry(
        dist.changelog_path.read_text(encoding="utf-8"), current, version, notes
    )
    # Everything is validated; now write.
    _write_version(dist, version)
    _write_manifest(root, name, version)
    dist.changelog_path.write_text(changelog, encoding="utf-8")
    follow_ups = []
    if name == monorepo.META:
        for change in _repin_meta(root):
            follow_ups.append(f"gefen-x now pins {change}")
    else:
        follow_ups.append(
            f"release gefen-x last: python scripts/bump_version.py gefen-x <X.Y.Z> "
            f'-m "Pin {name} {version}."'
        )
        for other, other_dist in dists.items():
            deps = other_dist.pyproject()["project"].get("dependencies", [])
            for text in deps:
                req = Requirement(text)
                if monorepo.canonical(req.name) == name and other != monorepo.META:
                    if version not in req.specifier:
                        follow_ups.append(
                            f"{other}: its range {req} excludes {version}; widen it and its "
                            "testing/constraints-lowest.txt"
                        )
    return follow_ups


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("distribution", choices=sorted(monorepo.DISTRIBUTIONS))
    parser.add_argument("version", nargs="?", help="the new version, X.Y.Z")
    parser.add_argument("-m", "--message", action="append", default=[], help="changelog note")
    parser.add_argument(
        "--released",
        metavar="YYYY-MM-DD",
        help="stamp the top 'unreleased' changelog heading with this date instead of bumping",
    )
    parser.add_argument("--root", type=Path, default=monorepo.ROOT, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        if args.released:
            if args.version:
                raise BumpError("--released takes no version")
            _dt.date.fromisoformat(args.released)
            dist = monorepo.distributions(args.root)[args.distribution]
            text = changelog_released(
                dist.changelog_path.read_text(encoding="utf-8"), args.released
            )
            dist.changelog_path.write_text(text, encoding="utf-8")
            print(f"{args.distribution}: {dist.version()} released {args.released}")
            return 0
        if not args.version:
            raise BumpError("give the new version (or --released DATE)")
        follow_ups = bump(args.root, args.distribution, args.version, args.message)
    except (BumpError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.distribution}: now {args.version}")
    for line in follow_ups:
        print(f"  next: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
