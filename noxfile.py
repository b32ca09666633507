"""Every repeatable job of the gefen-x monorepo, for developers, CI and release managers.

    nox -s tests                              every package's CPU suite, latest torch
    nox -s "tests(package='gefen-core')"      one package
    nox -s tests_floor                        the same on the torch floor + lowest siblings
    nox -s lint typecheck                     ruff, pin/extras sync, docs check, workflows; mypy
    nox -s build                              reproducible sdists + wheels into dist/
    nox -s demo                               the main job: gefen-bench train
    nox -s gpu                                the GPU test list (accelerator machine only)
    nox -s release_check release_rehearsal    release gates on the artifacts in dist/

Sessions that need torch share one environment per torch version (``.nox/_torch-*``):
torch is installed first from an exact pin, and every later install is constrained to it,
so no requirement can pull a different (multi-GB CUDA) build. Each test session changes
into ``packages/<name>`` itself, because nox runs in the noxfile's directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import nox

nox.options.default_venv_backend = "virtualenv"
nox.options.sessions = ["lint", "typecheck", "tests"]
nox.options.error_on_external_run = True

ROOT = Path(__file__).resolve().parent
DIST_DIR = ROOT / "dist"
SCRIPTS = ROOT / "scripts"

#: distribution -> import name, in dependency order.
PACKAGES: dict[str, str] = {
    "gefen-kernels": "gefen_kernels",
    "gefen-core": "gefen_core",
    "gefen-dist": "gefen_dist",
    "gefen-bench": "gefen_bench",
    "gefen-x": "gefen",
}
TORCH_LATEST = "2.13.0"
#: The oldest torch whose FSDP2 runs on CPU with gloo (see README).
TORCH_FLOOR = "2.7.1"
#: What the CPU suites need beyond the packages' own requirements.
TEST_REQUIREMENTS = [
    "numpy",
    "triton",
    "pytest",
    "pytest-timeout",
    "pytest-xdist",
    "transformers",
    "accelerate",
    "scikit-learn",
    "matplotlib",
    "rich",
    # gefen-dist's engine tests (issue 8): ZeRO 0-3 on CPU with gloo, Megatron-Core config.
    "deepspeed==0.19.8",
    "megatron-core==0.16.1",
]
#: Seconds any single test may take before pytest-timeout kills it (nothing may hang CI).
TEST_TIMEOUT_S = 600
#: pytest-xdist workers of the CPU suites: the interpreter-bound kernel tests are CPU-bound and
#: independent, so the CI machine's two cores halve their time. ``GEFEN_TEST_WORKERS=0`` runs
#: them in one process (as the release gate does); more than 4 mostly adds memory (each worker
#: imports torch and Triton's interpreter).
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
TEST_WORKERS = os.environ.get("GEFEN_TEST_WORKERS", str(min(_CORES or 1, 4)))
#: The wheels a release_check case installs: requirement -> gefen distributions it must yield.
RELEASE_CASES: dict[str, list[str]] = {
    "gefen-x": ["gefen-x", "gefen-core", "gefen-kernels"],
    "gefen-x[dist]": ["gefen-x", "gefen-dist", "gefen-core", "gefen-kernels"],
    "gefen-x[bench]": ["gefen-x", "gefen-bench", "gefen-dist", "gefen-core", "gefen-kernels"],
    "gefen-x[all]": list(PACKAGES),
    "gefen-kernels": ["gefen-kernels"],
    "gefen-core": ["gefen-core", "gefen-kernels"],
    "gefen-dist": ["gefen-dist", "gefen-core", "gefen-kernels"],
    "gefen-bench": ["gefen-bench", "gefen-dist", "gefen-core", "gefen-kernels"],
}


# --------------------------------------------------------------------------- helpers


class Env:
    """A virtual environment outside nox's own, driven through ``session.run``."""

    def __init__(self, path: Path) -> None:
        # Absolute: sessions chdir (e.g. into an unpacked sdist) and still run this python.
        self.path = path.resolve()
        self.bin = self.path / ("Scripts" if os.name == "nt" else "bin")
        self.python = str(self.bin / "python")

    @property
    def vars(self) -> dict[str, str]:
        return {
            "VIRTUAL_ENV": str(self.path),
            "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONNOUSERSITE": "1",
        }

    def run(self, session: nox.Session, *args: str, **kwargs: object) -> object:
        env = {**self.vars, **kwargs.pop("env", {})}  # type: ignore[dict-item]
        return session.run(*args, env=env, external=True, **kwargs)  # type: ignore[arg-type]

    def pip(self, session: nox.Session, *args: str, **kwargs: object) -> object:
        return self.run(session, self.python, "-m", "pip", *args, **kwargs)


def _new_env(session: nox.Session, path: Path, *, system_site: bool = False) -> Env:
    if path.exists():
        shutil.rmtree(path)
    args = [sys.executable, "-m", "virtualenv", "--quiet", str(path)]
    if system_site:
        args.append("--system-site-packages")
    session.run(*args, external=True)
    return Env(path)


def _write_constraints(path: Path, lines: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _install_torch_first(session: nox.Session, env: Env, torch_version: str) -> Path:
    """Install torch from its exact pin; return a constraints file that keeps it there."""
    constraints = _write_constraints(
        env.path / "torch-constraints.txt", [f"torch=={torch_version}"]
    )
    env.pip(session, "install", "--quiet", f"torch=={torch_version}")
    return constraints


def _lowest_pins(packages: list[str]) -> dict[str, str]:
    """Merged ``testing/constraints-lowest.txt`` of ``packages`` (sibling or third-party)."""
    pins: dict[str, str] = {}
    for name in packages:
        path = ROOT / "packages" / name / "testing" / "constraints-lowest.txt"
        for raw in path.read_text(encoding="utf-8").splitlines():
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            dep, _, version = line.partition("==")
            dep = dep.strip().lower().replace("_", "-")
            if pins.get(dep, version.strip()) != version.strip():
                raise RuntimeError(
                    f"lowest constraints disagree on {dep} ({pins[dep]} vs {version.strip()}); "
                    "run the packages one at a time: nox -s \"tests_floor(package='...')\""
                )
            pins[dep] = version.strip()
    return pins


def _declared_requirements(name: str) -> object:
    """What a package's pyproject.toml asks to install (the part that shapes the env)."""
    text = (ROOT / "packages" / name / "pyproject.toml").read_text(encoding="utf-8")
    try:
        import tomllib
    except ImportError:  # Python 3.10: any edit to the file rebuilds the env
        return hashlib.sha256(text.encode()).hexdigest()
    project = tomllib.loads(text)["project"]
    return [
        project.get("dependencies", []),
        project.get("optional-dependencies", {}),
        project.get("scripts", {}),
    ]


def _tree_version(name: str) -> str:
    text = (ROOT / "packages" / name / "src" / PACKAGES[name] / "_version.py").read_text()
    return text.split('__version__ = "', 1)[1].split('"', 1)[0]


def _torch_env(session: nox.Session, torch_version: str, floor: bool, package: str = "") -> Env:
    """The shared test environment for one torch version (created or reused).

    Holds torch (installed first, exact pin), TEST_REQUIREMENTS and every package of the
    tree in editable mode. On the floor, the lowest versions of ``testing/constraints-
    lowest.txt`` are applied (one environment for all packages while their lowest sets
    agree, else one for ``package``); a sibling pinned to a version other than the tree's
    comes from the index instead of the tree. The environment is rebuilt when any input
    (requirements, declared dependencies, versions, constraints) changes.
    """
    name = f"_torch-{torch_version}"
    if not floor:
        pins = {"torch": torch_version}
    else:
        try:
            pins = _lowest_pins(list(PACKAGES))
        except RuntimeError as exc:
            # The packages' lowest sets disagree: this package gets an environment of its own.
            session.log(f"{exc}; using {package}'s lowest set alone")
            pins = _lowest_pins([package])
            name += f"-{package}"
    if pins.get("torch") != torch_version:
        session.error(f"constraints-lowest pins torch {pins.get('torch')}, not {torch_version}")
    stamp_inputs = {
        "python": sys.version,
        "torch": torch_version,
        "requirements": TEST_REQUIREMENTS,
        "pins": pins,
        "requires": {n: _declared_requirements(n) for n in PACKAGES},
        "versions": {n: _tree_version(n) for n in PACKAGES},
    }
    stamp = json.dumps(stamp_inputs, sort_keys=True)
    env = Env(ROOT / ".nox" / name)
    stamp_path = env.path / "gefen-env.json"
    if stamp_path.is_file() and stamp_path.read_text() == stamp and Path(env.python).exists():
        session.log(f"reusing {env.path}")
        return env
    env = _new_env(session, env.path)
    _install_torch_first(session, env, torch_version)
    third_party = [f"{k}=={v}" for k, v in pins.items() if k not in PACKAGES]
    constraints = _write_constraints(env.path / "constraints.txt", third_party)
    from_tree, from_index = [], []
    for name in PACKAGES:
        wanted = pins.get(name, _tree_version(name))
        if wanted == _tree_version(name):
            from_tree += ["-e", str(ROOT / "packages" / name)]
        else:
            from_index.append(f"{name}=={wanted}")
    env.pip(
        session,
        "install",
        "--quiet",
        "-c",
        str(constraints),
        *TEST_REQUIREMENTS,
        *from_index,
        *from_tree,
    )
    env.pip(session, "list", "--format=freeze", silent=False)
    stamp_path.write_text(stamp)
    return env


def _pytest_args(*extra: str) -> list[str]:
    return [
        "-m",
        "pytest",
        "tests",
        "-ra",
        "-q",
        "-p",
        "gefen_pytest_gates",
        "-o",
        f"timeout={TEST_TIMEOUT_S}",
        "--strict-markers",
        *extra,
    ]


def _run_suite(session: nox.Session, env: Env, package: str, *extra: str) -> None:
    """Run one package's CPU suite from inside its directory ("no tests" fails: exit 5)."""
    session.chdir(ROOT / "packages" / package)
    env.run(
        session,
        env.python,
        *_pytest_args("-n", TEST_WORKERS, "--dist", "worksteal", *extra, *session.posargs),
        env={"TRITON_INTERPRET": "1", "PYTHONPATH": str(SCRIPTS), "CUDA_VISIBLE_DEVICES": ""},
    )
    session.chdir(ROOT)


def _git_epoch(path: Path) -> str:
    """SOURCE_DATE_EPOCH: the time of the last commit that touched ``path``."""
    out = subprocess.run(
        ["git", "log", "-1", "--format=%ct", "--", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not out:
        raise RuntimeError(f"no git commit touches {path}; commit before building")
    return out


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _artifacts() -> dict[str, Path]:
    """The built files in dist/, verified against dist/SHA256SUMS."""
    sums = DIST_DIR / "SHA256SUMS"
    if not sums.is_file():
        raise RuntimeError("dist/SHA256SUMS is missing: run `nox -s build` first")
    files = {}
    for line in sums.read_text().splitlines():
        digest, name = line.split()
        path = DIST_DIR / name
        if _sha256(path) != digest:
            raise RuntimeError(f"{path} does not match dist/SHA256SUMS: rebuild with nox -s build")
        files[name] = path
    return files


def _wheel_for(name: str, files: dict[str, Path]) -> Path:
    prefix = name.replace("-", "_") + "-"
    matches = [p for n, p in files.items() if n.startswith(prefix) and n.endswith(".whl")]
    if len(matches) != 1:
        raise RuntimeError(f"expected one wheel for {name} in dist/, found {matches}")
    return matches[0]


def _install_wheels(
    session: nox.Session,
    env: Env,
    requirement: str,
    siblings: list[str],
    files: dict[str, Path],
    torch_version: str = TORCH_LATEST,
) -> None:
    """Install ``requirement`` from the built wheels (siblings by file, the rest from PyPI)."""
    constraints = _install_torch_first(session, env, torch_version)
    top, _, extras = requirement.partition("[")
    wheels = [str(_wheel_for(top, files)) + (f"[{extras}" if extras else "")]
    wheels += [str(_wheel_for(s, files)) for s in siblings if s != top]
    env.pip(session, "install", "--quiet", "-c", str(constraints), *wheels)


# --------------------------------------------------------------------------- sessions


@nox.session(venv_backend="none")
@nox.parametrize("package", list(PACKAGES))
def tests(session: nox.Session, package: str) -> None:
    """One package's CPU suite on the latest supported torch (``torch==2.13.0``)."""
    env = _torch_env(session, TORCH_LATEST, floor=False)
    _run_suite(session, env, package)


@nox.session(venv_backend="none")
@nox.parametrize("package", list(PACKAGES))
def tests_floor(session: nox.Session, package: str) -> None:
    """The same suite on the torch floor (2.7.1, ~3 GB) with the lowest sibling versions."""
    env = _torch_env(session, TORCH_FLOOR, floor=True, package=package)
    _run_suite(session, env, package)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff; pins/extras/manifest sync; the docs check (links, anchors, citations, work-log
    wording); the source check (no private cross-package import, no import cycle, no file over
    900 lines); the scripts' tests; GitHub workflow schema validation."""
    session.install(
        "ruff", "packaging", "pytest", "pyyaml", "check-jsonschema", "tomli; python_version<'3.11'"
    )
    session.run("python", "scripts/check_extras_sync.py")
    session.run("python", "scripts/check_docs.py")
    session.run("python", "scripts/check_imports.py")
    workflows = sorted(str(p) for p in (ROOT / ".github" / "workflows").glob("*.yml"))
    session.run("check-jsonschema", "--builtin-schema", "vendor.github-workflows", *workflows)
    session.run("python", "scripts/check_workflows.py", *workflows)
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "scripts/tests")
    session.run("ruff", "format", "--check", "noxfile.py", "scripts", "packages/gefen-x")
    session.run("ruff", "check", ".")


@nox.session(venv_backend="none")
def typecheck(session: nox.Session) -> None:
    """mypy over every package's public API (mypy.ini), in the latest-torch environment."""
    env = _torch_env(session, TORCH_LATEST, floor=False)
    env.pip(session, "install", "--quiet", "mypy")
    targets = [arg for name in PACKAGES.values() for arg in ("-p", name)]
    env.run(session, env.python, "-m", "mypy", "--config-file", str(ROOT / "mypy.ini"), *targets)


@nox.session
def build(session: nox.Session) -> None:
    """Build every sdist and wheel twice, require identical sha256, twine check, smoke-install.

    SOURCE_DATE_EPOCH is the time of the last commit touching each package. The builders
    (build, hatchling) come from release/build-requirements.txt, hash-pinned. Results go to
    dist/ with dist/SHA256SUMS, which release_check, release_rehearsal and the GPU gate use.
    """
    session.install(
        "--require-hashes", "--only-binary=:all:", "-r", "release/build-requirements.txt"
    )
    session.install("twine")
    rounds = {}
    scratch = Path(session.create_tmp()) / "rounds"
    shutil.rmtree(scratch, ignore_errors=True)
    for label in ("a", "b"):
        out = scratch / label
        for name in PACKAGES:
            epoch = _git_epoch(ROOT / "packages" / name)
            session.run(
                "python",
                "-m",
                "build",
                "--no-isolation",
                "--outdir",
                str(out),
                str(ROOT / "packages" / name),
                env={"SOURCE_DATE_EPOCH": epoch},
                silent=True,
            )
        rounds[label] = {p.name: _sha256(p) for p in sorted(out.iterdir())}
    if rounds["a"] != rounds["b"]:
        for name in sorted(set(rounds["a"]) | set(rounds["b"])):
            a, b = rounds["a"].get(name), rounds["b"].get(name)
            session.log(f"{'ok  ' if a == b else 'DIFF'} {name} {a} {b}")
        session.error("the two builds differ: the artifacts are not reproducible")
    expected = 2 * len(PACKAGES)
    if len(rounds["a"]) != expected:
        session.error(f"expected {expected} artifacts, got {sorted(rounds['a'])}")
    shutil.rmtree(DIST_DIR, ignore_errors=True)
    shutil.copytree(scratch / "a", DIST_DIR)
    sums = "".join(f"{digest}  {name}\n" for name, digest in sorted(rounds["a"].items()))
    (DIST_DIR / "SHA256SUMS").write_text(sums)
    session.log("reproducible: both builds give\n" + sums)
    artifacts = sorted(str(p) for p in DIST_DIR.iterdir() if p.name != "SHA256SUMS")
    session.run("twine", "check", "--strict", *artifacts)

    files = _artifacts()
    venvs = Path(session.create_tmp()) / "smoke"
    for requirement in ("gefen-x", "gefen-x[dist]"):
        env = _new_env(session, venvs / requirement.replace("[", "-").rstrip("]"))
        siblings = RELEASE_CASES[requirement]
        _install_wheels(session, env, requirement, siblings, files)
        env.run(session, env.python, str(SCRIPTS / "check_installed.py"), "--expect", *siblings)
        env.run(
            session,
            env.python,
            "-c",
            "from gefen import Gefen; print('from gefen import Gefen:', Gefen)",
        )
    session.log(f"artifacts in {DIST_DIR} (sha256 in dist/SHA256SUMS)")


@nox.session(venv_backend="none")
def demo(session: nox.Session) -> None:
    """The main job: ``gefen-bench train`` on its embedded default (CPU is enough)."""
    env = _torch_env(session, TORCH_LATEST, floor=False)
    out = ROOT / "out" / "demo"
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    env.run(session, str(env.bin / "gefen-bench"), "train", "--out", str(out), *session.posargs)
    made = sorted(p for p in out.rglob("*") if p.suffix in {".json", ".png"})
    if not made:
        session.error(f"gefen-bench train wrote no JSON/PNG report under {out}")
    session.log(f"demo finished in {time.monotonic() - started:.0f} s; reports:")
    for path in made:
        session.log(f"  {path}")


@nox.session(venv_backend="none")
def gpu(session: nox.Session) -> None:
    """The GPU test list (release/gpu-test-list.txt); a GPU test that cannot run FAILS.

    For the accelerator machine, with its own CUDA torch: this runs
    scripts/run_gpu_tests.sh, the same runner the release gate uses, against the source
    tree. Pass ``-- --single-gpu`` on a one-GPU machine (the multi-GPU part is then
    reported as not run, and the run fails).
    """
    session.run("bash", str(SCRIPTS / "run_gpu_tests.sh"), *session.posargs, external=True)


@nox.session
def release_check(session: nox.Session) -> None:
    """Fresh venvs per install case, from the wheels in dist/; then the suites on the wheels.

    Cases: gefen-x, gefen-x[dist], gefen-x[bench], gefen-x[all], and each distribution alone.
    Each imports every public name, checks the facade's hints and refuses pre-releases
    (scripts/check_installed.py). The CPU suites then run from the sdists' own tests/
    against the installed wheels of the [all] case (the plugin fails any gefen* module
    loaded from a source tree).
    """
    files = _artifacts()
    venvs = Path(session.create_tmp()) / "release"
    last_env = None
    for requirement, siblings in RELEASE_CASES.items():
        session.log(f"--- case {requirement}")
        env = _new_env(session, venvs / requirement.replace("[", "-").rstrip("]"))
        _install_wheels(session, env, requirement, siblings, files)
        env.run(session, env.python, str(SCRIPTS / "check_installed.py"), "--expect", *siblings)
        if requirement == "gefen-x[all]":
            last_env = env
    assert last_env is not None
    env = last_env
    env.pip(
        session,
        "install",
        "--quiet",
        "-c",
        str(env.path / "torch-constraints.txt"),
        *TEST_REQUIREMENTS,
    )
    unpacked = Path(session.create_tmp()) / "sdists"
    shutil.rmtree(unpacked, ignore_errors=True)
    for name in PACKAGES:
        sdist = [
            p
            for n, p in files.items()
            if n.startswith(name.replace("-", "_") + "-") and n.endswith(".tar.gz")
        ]
        if len(sdist) != 1:
            session.error(f"expected one sdist for {name}, found {sdist}")
        with tarfile.open(sdist[0]) as archive:
            archive.extractall(unpacked, filter="data")
        root = unpacked / sdist[0].name.removesuffix(".tar.gz")
        session.chdir(root)
        env.run(
            session,
            env.python,
            *_pytest_args("--gefen-require-installed", "-m", "not gpu and not multigpu"),
            env={"TRITON_INTERPRET": "1", "PYTHONPATH": str(SCRIPTS), "CUDA_VISIBLE_DEVICES": ""},
        )
    session.chdir(ROOT)


@nox.session
def release_rehearsal(session: nox.Session) -> None:
    """Upload dist/ to a real index on 127.0.0.1 (pypiserver), install gefen-x[dist] from it.

    torch is installed first from its exact pin (the normal index, as on any user machine);
    everything else, our five distributions and their third-party dependencies alike,
    resolves through the local index, which falls back to PyPI only for names it does not
    hold (pypiserver's redirect), so our distributions can only come from the upload.
    Then: import every public name, one real training step, stop the server.
    """
    files = _artifacts()
    session.install("pypiserver==2.4.2", "twine", "passlib")
    tmp = Path(session.create_tmp()) / "rehearsal"
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "packages").mkdir(parents=True)
    port = _free_port()
    log = (tmp / "pypiserver.log").open("w")
    server = subprocess.Popen(
        [
            str(Path(session.bin) / "pypi-server"),
            "run",
            "-i",
            "127.0.0.1",
            "-p",
            str(port),
            "-a",
            ".",
            "-P",
            ".",
            str(tmp / "packages"),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        index = f"http://127.0.0.1:{port}"
        _wait_for(f"{index}/simple/", server)
        artifacts = [str(p) for n, p in sorted(files.items())]
        session.run(
            "twine",
            "upload",
            "--non-interactive",
            "--repository-url",
            index,
            "-u",
            "rehearsal",
            "-p",
            "rehearsal",
            *artifacts,
        )
        env = _new_env(session, tmp / "venv")
        constraints = _install_torch_first(session, env, TORCH_LATEST)
        # Index only: no find-links, no extra indexes from pip's config files.
        env.pip(
            session,
            "install",
            "--quiet",
            "--index-url",
            f"{index}/simple/",
            "-c",
            str(constraints),
            "gefen-x[dist]",
            env={
                "PIP_CONFIG_FILE": os.devnull,
                "PIP_FIND_LINKS": None,
                "PIP_EXTRA_INDEX_URL": None,
            },
        )
        expected = RELEASE_CASES["gefen-x[dist]"]
        env.run(session, env.python, str(SCRIPTS / "check_installed.py"), "--expect", *expected)
        env.run(session, env.python, str(SCRIPTS / "rehearsal_smoke.py"))
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()
    session.log(f"rehearsal passed against {index}; server stopped")


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_for(url: str, server: subprocess.Popen[bytes]) -> None:
    import urllib.request

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"pypiserver exited with {server.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer within 60 s")
