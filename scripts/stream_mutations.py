"""Plant each stream-ordering fault in a copy of the tree and check that the GPU tests catch it.

Each mutation removes one wait of ``StepGroups.launch_staged`` (or moves the joins out of its
``finally``); the tests of ``tests/ops/test_step_groups.py`` named for it must then fail, and
pass on the unmutated tree. Run on a CUDA machine from the repository root::

    python3 scripts/stream_mutations.py --out results.json

A mutation whose text is not found fails the run (the script would otherwise test nothing),
and so does a test run that collects nothing or errors before running a test (pytest's exit
statuses 2-5), which would otherwise read as "the test failed".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = Path("packages/gefen-kernels/src/gefen_kernels/ops/step_groups.py")
TESTS = "tests/ops/test_step_groups.py"
ORDERED, JOINED = "ordered_with_the_current", "joined_when_a_launch_raises"

# name -> (text in launch_staged, its replacement, the tests (-k) that must fail)
MUTATIONS: dict[str, tuple[str, str, str]] = {
    "no start wait": (
        "                stream.wait_stream(current)  # type: ignore[arg-type]\n",
        "",
        ORDERED,
    ),
    "no end wait": (
        "            for stream in forked:\n                current.wait_stream(stream)",
        "            for stream in forked:\n                pass",
        f"{ORDERED} or {JOINED}",
    ),
    "no end wait for the side stream": (
        "            for stream in forked:\n                current.wait_stream(stream)",
        "            for stream in forked[1:]:\n                current.wait_stream(stream)",
        f"{ORDERED} or {JOINED}",
    ),
    "no end wait for the chain stream": (
        "            for stream in forked:\n                current.wait_stream(stream)",
        "            for stream in forked[:1]:\n                current.wait_stream(stream)",
        f"{ORDERED} or {JOINED}",
    ),
    "joins not in finally": (
        "        finally:\n            for stream in forked:",
        "        except BaseException:\n            raise\n        else:\n"
        "            for stream in forked:",
        JOINED,
    ),
}


def _pytest(tree: Path, select: str, log: Path) -> int:
    env = dict(os.environ)
    sources = [str(p) for p in sorted((tree / "packages").glob("*/src"))]
    env["PYTHONPATH"] = os.pathsep.join([*sources, str(tree / "scripts")])
    with log.open("a") as f:
        f.write(f"\n=== {tree} -k '{select}'\n")
        f.flush()
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                TESTS,
                "-q",
                "-p",
                "gefen_pytest_gates",
                "--gefen-fail-on-skip",
                "-k",
                select,
            ],
            cwd=tree / "packages" / "gefen-kernels",
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=600,
        ).returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON results path")
    parser.add_argument("--log", type=Path, help="pytest output (default: OUT with .log)")
    args = parser.parse_args()
    log = args.log or args.out.with_suffix(".log")
    log.write_text("")
    results: dict[str, dict[str, object]] = {}
    ok = True
    baseline = _pytest(ROOT, f"{ORDERED} or {JOINED}", log)
    results["unmutated"] = {"exit": baseline, "expected": 0}
    ok &= baseline == 0
    source = (ROOT / TARGET).read_text()
    for name, (old, new, select) in MUTATIONS.items():
        if source.count(old) != 1:
            results[name] = {"error": "mutation text not found exactly once"}
            ok = False
            continue
        with tempfile.TemporaryDirectory() as tmp:
            tree = Path(tmp) / "tree"
            skip = shutil.ignore_patterns(".git", ".nox", ".gpu", "dist")
            shutil.copytree(ROOT, tree, ignore=skip)
            (tree / TARGET).write_text(source.replace(old, new))
            code = _pytest(tree, select, log)
        # 1: tests ran and failed. Anything else (0 passed, 2-5 errors or nothing collected).
        results[name] = {"exit": code, "expected": 1, "tests": select}
        ok &= code == 1
    results["ok"] = {"all as expected": ok}
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
