"""Facts about the five distributions, read from the tree (shared by the release scripts).

Nothing here imports the packages: versions come from ``src/<import>/_version.py``,
requirements from ``pyproject.toml``, so the scripts run in a venv without torch.
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent

#: distribution -> import name, in dependency order (each may depend only on earlier ones).
SIBLINGS: dict[str, str] = {
    "gefen-kernels": "gefen_kernels",
    "gefen-core": "gefen_core",
    "gefen-dist": "gefen_dist",
    "gefen-bench": "gefen_bench",
}
META = "gefen-x"
META_IMPORT = "gefen"
DISTRIBUTIONS: dict[str, str] = {**SIBLINGS, META: META_IMPORT}

#: gefen-x extra -> the sibling requirements it must hold (the names, extras aside).
META_EXTRAS: dict[str, list[tuple[str, str]]] = {
    "dist": [("gefen-dist", "")],
    "deepspeed": [("gefen-dist", "deepspeed")],
    "megatron": [("gefen-dist", "megatron")],
    "hf": [("gefen-dist", "hf")],
    "bench": [("gefen-bench", "")],
}
#: gefen-x's base requirements.
META_BASE = ["gefen-core", "gefen-kernels"]

#: PyPI already holds gefen-x <= this from an earlier project; ours must be newer.
META_PREVIOUS_PROJECT_LAST = "0.5.0"

_VERSION_RE = re.compile(r'^__version__\s*=\s*"(?P<version>[^"]+)"\s*$', re.MULTILINE)
SEMVER_RE = re.compile(r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)$")


@dataclass(frozen=True)
class Distribution:
    """One distribution as the tree describes it."""

    name: str
    import_name: str
    path: Path

    @property
    def pyproject_path(self) -> Path:
        return self.path / "pyproject.toml"

    @property
    def version_path(self) -> Path:
        return self.path / "src" / self.import_name / "_version.py"

    @property
    def changelog_path(self) -> Path:
        return self.path / "CHANGELOG.md"

    @property
    def constraints_lowest_path(self) -> Path:
        return self.path / "testing" / "constraints-lowest.txt"

    def pyproject(self) -> dict:
        return tomllib.loads(self.pyproject_path.read_text(encoding="utf-8"))

    def version(self) -> str:
        match = _VERSION_RE.search(self.version_path.read_text(encoding="utf-8"))
        if match is None:
            raise ValueError(f'{self.version_path}: no line `__version__ = "X.Y.Z"`')
        return match.group("version")

    def constraints_lowest(self) -> dict[str, str]:
        """``name -> version`` from ``testing/constraints-lowest.txt`` (``==`` pins only)."""
        pins: dict[str, str] = {}
        for raw in self.constraints_lowest_path.read_text(encoding="utf-8").splitlines():
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            name, sep, version = line.partition("==")
            if not sep:
                raise ValueError(f"{self.constraints_lowest_path}: {line!r} is not a `name==X` pin")
            pins[canonical(name)] = version.strip()
        return pins


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def distributions(root: Path = ROOT) -> dict[str, Distribution]:
    return {
        name: Distribution(name, import_name, root / "packages" / name)
        for name, import_name in DISTRIBUTIONS.items()
    }


def manifest_path(root: Path = ROOT) -> Path:
    return root / "release" / "versions.toml"


def read_manifest(root: Path = ROOT) -> dict[str, str]:
    data = tomllib.loads(manifest_path(root).read_text(encoding="utf-8"))
    return dict(data.get("versions", {}))


def facade_exports(root: Path = ROOT) -> dict[str, tuple[str, str | None]]:
    """The ``EXPORTS`` table of ``gefen/_exports.py``, read without importing it."""
    path = root / "packages" / META / "src" / META_IMPORT / "_exports.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign | ast.Assign):
            targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
            if any(isinstance(t, ast.Name) and t.id == "EXPORTS" for t in targets):
                assert node.value is not None
                return ast.literal_eval(node.value)
    raise ValueError(f"{path}: no EXPORTS table")


def semver_key(version: str) -> tuple[int, int, int]:
    match = SEMVER_RE.match(version)
    if match is None:
        raise ValueError(f"{version!r} is not a release version X.Y.Z")
    return (int(match.group(1)), int(match.group(2)), int(match.group(3)))
