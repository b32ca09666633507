"""Plant each stream-ordering fault in a copy of the tree and check that the GPU tests catch it.

Each mutation removes a wait of ``StepGroups.launch_staged`` (for every forked stream, or for
the side or the chain stream alone) or moves the joins out of its ``finally``. The four
ordering and join tests of ``tests/ops/test_step_groups.py`` (two tests, each for ``slow`` 0
and 1) run against each mutated copy and against the unmutated tree, with a JUnit XML report;
a mutation is caught only if exactly its expected tests fail with an ``AssertionError`` and the
others pass. Run on a CUDA machine from the repository root::

    python3 scripts/stream_mutations.py --out results.json

Fails the run: a mutation whose text is not found exactly once, a test that errors, is
skipped or fails any other way, a test missing from the report, and an unexpected outcome.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = Path("packages/gefen-kernels/src/gefen_kernels/ops/step_groups.py")
TESTS = "tests/ops/test_step_groups.py"
ORDERED = "test_side_stream_is_ordered_with_the_current_stream_gpu"
JOINED = "test_side_stream_is_joined_when_a_launch_raises_gpu"
SELECTED = [f"{test}[{slow}]" for test in (ORDERED, JOINED) for slow in (0, 1)]

START = "                stream.wait_stream(current)  # type: ignore[arg-type]\n"
END = "            for stream in forked:\n                current.wait_stream(stream)"
# name -> (text in launch_staged, its replacement, the tests that must fail). The side stream
# is forked first (``forked`` is empty when its start wait runs), the chain stream second.
MUTATIONS: dict[str, tuple[str, str, set[str]]] = {
    "no start wait": (START, "", {f"{ORDERED}[0]", f"{ORDERED}[1]"}),
    "no start wait for the side stream": (
        START,
        START.replace("stream.wait_stream", "if forked: stream.wait_stream"),
        {f"{ORDERED}[0]", f"{ORDERED}[1]"},
    ),
    "no start wait for the chain stream": (
        START,
        START.replace("stream.wait_stream", "if not forked: stream.wait_stream"),
        {f"{ORDERED}[0]", f"{ORDERED}[1]"},
    ),
    "no end wait": (END, END.replace("current.wait_stream(stream)", "pass"), set(SELECTED)),
    "no end wait for the side stream": (
        END,
        END.replace("in forked:", "in forked[1:]:"),
        {f"{ORDERED}[0]", f"{JOINED}[0]"},
    ),
    "no end wait for the chain stream": (
        END,
        END.replace("in forked:", "in forked[:1]:"),
        {f"{ORDERED}[1]", f"{JOINED}[1]"},
    ),
    "joins not in finally": (
        "        finally:\n            for stream in forked:",
        "        except BaseException:\n            raise\n        else:\n"
        "            for stream in forked:",
        {f"{JOINED}[0]", f"{JOINED}[1]"},
    ),
}


def _outcomes(report: Path) -> dict[str, str]:
    """Test name -> ``passed``, ``assertion`` (failed with an AssertionError), ``failed``
    (any other failure), ``error`` or ``skipped``, from a pytest JUnit XML report."""
    out: dict[str, str] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag == "failure":
                text = (child.get("message") or "") + (child.text or "")
                outcome = "assertion" if "AssertionError" in text else "failed"
            elif child.tag in ("error", "skipped"):
                outcome = child.tag
        out[case.get("name", "")] = outcome
    return out


def _run(tree: Path, log: Path, report: Path) -> tuple[int, dict[str, str]]:
    env = dict(os.environ)
    sources = [str(p) for p in sorted((tree / "packages").glob("*/src"))]
    # The copy's sources and the gates plugin, never the original tree's.
    env["PYTHONPATH"] = os.pathsep.join([*sources, str(tree / "scripts")])
    report.unlink(missing_ok=True)
    with log.open("a") as f:
        f.write(f"\n=== {tree}\n")
        f.flush()
        code = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                TESTS,
                "-q",
                "-p",
                "gefen_pytest_gates",
                "--gefen-fail-on-skip",
                f"--junitxml={report}",
                "-k",
                f"{ORDERED} or {JOINED}",
            ],
            cwd=tree / "packages" / "gefen-kernels",
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=600,
        ).returncode
    return code, (_outcomes(report) if report.is_file() else {})


def _check(outcomes: dict[str, str], must_fail: set[str]) -> bool:
    expected = {name: ("assertion" if name in must_fail else "passed") for name in SELECTED}
    return outcomes == expected


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON results path")
    parser.add_argument("--log", type=Path, help="pytest output (default: OUT with .log)")
    args = parser.parse_args()
    log = args.log or args.out.with_suffix(".log")
    log.write_text("")
    results: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        code, outcomes = _run(ROOT, log, report)
        results["unmutated"] = {
            "exit": code,
            "outcomes": outcomes,
            "must_fail": [],
            "as_expected": _check(outcomes, set()),
        }
        source = (ROOT / TARGET).read_text()
        for name, (old, new, must_fail) in MUTATIONS.items():
            if source.count(old) != 1:
                results[name] = {
                    "error": "mutation text not found exactly once",
                    "as_expected": False,
                }
                continue
            tree = Path(tmp) / "tree"
            shutil.rmtree(tree, ignore_errors=True)
            shutil.copytree(
                ROOT, tree, ignore=shutil.ignore_patterns(".git", ".nox", ".gpu", "dist")
            )
            (tree / TARGET).write_text(source.replace(old, new))
            code, outcomes = _run(tree, log, report)
            results[name] = {
                "exit": code,
                "outcomes": outcomes,
                "must_fail": sorted(must_fail),
                "as_expected": _check(outcomes, must_fail),
            }
    ok = all(r["as_expected"] for r in results.values())
    args.out.write_text(json.dumps({"all_as_expected": ok, "runs": results}, indent=2) + "\n")
    print(json.dumps({name: r["as_expected"] for name, r in results.items()}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
