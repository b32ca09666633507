"""The docs check: the tree passes, and each kind of planted problem makes it fail."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import check_docs
import pytest
from conftest import ROOT


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of every tracked file (no .git, so the check walks the directory)."""
    out = tmp_path_factory.mktemp("tree")
    for rel in subprocess.check_output(check_docs.GIT_FILES, cwd=ROOT, text=True).splitlines():
        if (ROOT / rel).is_file():
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, out / rel)
    return out


def _planted(tree: Path, rel: str, line: str) -> list[str]:
    """The check's findings after appending ``line`` to ``rel`` (restored afterwards)."""
    path = tree / rel
    before = path.read_text(encoding="utf-8")
    path.write_text(before + "\n" + line + "\n", encoding="utf-8")
    try:
        return check_docs.check(tree, only=[rel])
    finally:
        path.write_text(before, encoding="utf-8")


def test_the_tree_passes(tree: Path) -> None:
    assert check_docs.check(ROOT) == []
    assert check_docs.check(tree) == []


CORE = "packages/gefen-core/src/gefen_core/"
PLANTED = [  # (file, line appended to it, what the finding must say)
    ("README.md", "See [the notes](docs/no-such-page.md).", "dead link"),
    ("docs/guide.md", "See [options](algorithm.md#nope).", "no heading #nope"),
    ("packages/gefen-core/README.md", "[old](../../docs/results/h200-run9/)", "dead link"),
    (CORE + "codebook.py", "# math: docs/algorithm.md#nowhere", "is not a section"),
    ("scripts/monorepo.py", "# written by scripts/probe_gone.py", "does not exist"),
    ("docs/benchmarks.md", "Figures in `docs/results/h200-run2/`.", "does not exist"),
    (CORE + "period.py", "# ALGORITHM.md §1.10", "outside the repository"),
    ("README.md", "Measured in session 20, call 5 (the H200 was slow).", "work-log"),
    ("docs/decisions.md", "## Open for the owner: the Llama target", "work-log"),
    ("packages/gefen-x/CHANGELOG.md", "- The seventeenth session's tile.", "work-log"),
    (CORE + "optimizer.py", "# 12.6 ms in run 8.", "work-log"),
]


@pytest.mark.parametrize(("rel", "line", "needle"), PLANTED)
def test_a_planted_problem_fails(tree: Path, rel: str, line: str, needle: str) -> None:
    problems = _planted(tree, rel, line)
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{rel}:") and needle in problems[0]


LEGITIMATE = [
    "Launch with `python -m torch.distributed.run --nproc-per-node 2 train.py`.",
    "A dry run prints the plan; run 2 ranks with gloo to test it.",
    "Each matrix has an owner; the owner rank broadcasts its update, on the owner only.",
    "The test session itself interprets; this call returns the scores.",
    "Between runs 1 and 3 the weights must be equal.",
    "See [the method](algorithm.md#factoring-rule) and [the guide](guide.md).",
]


@pytest.mark.parametrize("line", LEGITIMATE)
def test_legitimate_wording_passes(tree: Path, line: str) -> None:
    assert _planted(tree, "docs/guide.md", line) == []


def test_github_slugs() -> None:
    assert check_docs.slug("`gefen-bench train` — the job") == "gefen-bench-train--the-job"
    assert check_docs.slug("O1 — keys: `betas`, not `beta1`") == "o1--keys-betas-not-beta1"
    assert check_docs.slug("Toward-zero rounding") == "toward-zero-rounding"
    text = "# A\n## Step\n```\n## Not a heading\n```\n### Step\n"
    assert check_docs.anchors(text) == {"a", "step", "step-1"}
