"""``gefen-bench digest``: repeatable fingerprints, and a comparison that fails on any change."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from gefen_bench import cli

TINY = ["digest", "--scale", "tiny", "--device", "cpu", "--models", "gpt2,llama-lora",
        "--steps", "3"]


def _run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str]:
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out + err


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("digest") / "a.json"
    assert cli.main([*TINY, "--out", str(path)]) == 0
    return path


def _count(word: str, out: str) -> int:
    return len(re.findall(rf"[│|] +{word} [│|]", out))


def _write(path: Path, doc: dict) -> Path:
    path.write_text(json.dumps(doc))
    return path


def test_same_tree_twice_is_identical_and_compares_equal(
        baseline: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    again = tmp_path / "b.json"
    code, out = _run(capsys, [*TINY, "--out", str(again), "--repeat"])
    assert code == 0
    a, b = json.loads(baseline.read_text()), json.loads(again.read_text())
    assert a["schema"] == "gefen-bench/digest/1"
    assert sorted(a["results"]) == ["gpt2/eager/nearest", "gpt2/eager/stochastic",
                                    "llama-lora/eager/nearest", "llama-lora/eager/stochastic"]
    assert sorted(a["skipped"]) == ["gpt2/captured/nearest", "gpt2/captured/stochastic",
                                    "llama-lora/captured/nearest", "llama-lora/captured/stochastic"]
    assert "the captured route needs CUDA" in out
    for key, r in a["results"].items():
        s = b["results"][key]
        assert b["results"][key]["repeatable"] is True
        assert (r["digest"], r["entries"], r["tensors"], r["bytes"]) == (
            s["digest"], s["entries"], s["tensors"], s["bytes"])
    code, out = _run(capsys, ["digest", "--compare", str(baseline), str(again)])
    assert code == 0
    assert _count("equal", out) == 4 and _count("differ", out) == 0


def test_entries_cover_every_parameter_and_state_tensor(baseline: Path) -> None:
    r = json.loads(baseline.read_text())["results"]["gpt2/eager/nearest"]
    names = list(r["entries"])
    params = [n for n in names if ":" not in n]
    assert len(params) == 28 and names[0] == "transformer.wte.weight"
    # Parameter order, each parameter followed by its state keys sorted.
    assert names[1:1 + 6] == [f"transformer.wte.weight:{k}" for k in sorted(
        n.split(":")[1] for n in names if n.startswith("transformer.wte.weight:"))]
    tensors = [e for e in r["entries"].values() if "sha256" in e]
    assert r["tensors"] == len(tensors) > len(params)
    assert r["entries"]["transformer.wte.weight:exp_avg_codes"]["dtype"] == "uint8"
    assert r["bytes"] >= sum(2 * _numel(r["entries"][n]["shape"]) for n in params)


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def test_rounding_changes_the_state_digests(baseline: Path) -> None:
    results = json.loads(baseline.read_text())["results"]
    for model in ("gpt2", "llama-lora"):
        near, sto = results[f"{model}/eager/nearest"], results[f"{model}/eager/stochastic"]
        assert near["digest"] != sto["digest"]
        differing = [n for n in near["entries"]
                     if near["entries"][n] != sto["entries"][n]]
        assert any(n.endswith(":exp_avg_codes") for n in differing)


def test_an_edited_entry_fails_the_comparison_and_is_named(
        baseline: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = json.loads(baseline.read_text())
    case = doc["results"]["gpt2/eager/stochastic"]
    entry = case["entries"]["transformer.ln_f.bias:exp_avg_codes"]
    entry["sha256"] = "0" * 64
    # The combined digest as a tree with that one tensor changed would have written it.
    case["digest"] = "1" * 64
    code, out = _run(capsys, ["digest", "--compare", str(baseline),
                              str(_write(tmp_path / "b.json", doc))])
    assert code == 1
    assert _count("differ", out) == 1 and "transformer.ln_f.bias:exp_avg_codes" in out
    assert _count("equal", out) == 3


def test_a_different_step_count_differs(baseline: Path, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    other = tmp_path / "b.json"
    argv = [a if a != "3" else "2" for a in TINY]
    assert cli.main([*argv, "--models", "gpt2", "--rounding", "nearest", "--out",
                     str(other)]) == 0
    code, out = _run(capsys, ["digest", "--compare", str(baseline), str(other)])
    assert code == 1
    assert "setups differ: steps 3 vs 2" in out
    assert _count("differ", out) == 1 and "transformer.wte.weight" in out and "more)" in out
    assert _count("missing in B", out) == 3  # the cases the second run left out


def test_a_missing_case_fails_the_comparison(baseline: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    doc = json.loads(baseline.read_text())
    del doc["results"]["llama-lora/eager/nearest"]
    code, out = _run(capsys, ["digest", "--compare", str(_write(tmp_path / "b.json", doc)),
                              str(baseline)])
    assert code == 1
    assert _count("missing in A", out) == 1 and _count("equal", out) == 3


@pytest.mark.parametrize(("argv", "needle"), [
    (["--routes", "eager,graph"], "--routes: unknown value 'graph'; available: eager, captured"),
    (["--rounding", ""], "--rounding: unknown value ''"),
    (["--models", "bert"], "--models: unknown value 'bert'"),
    (["--steps", "0"], "--steps must be >= 1"),
])
def test_bad_options_are_usage_errors(capsys: pytest.CaptureFixture[str], argv: list[str],
                                      needle: str) -> None:
    code, out = _run(capsys, ["digest", "--device", "cpu", *argv])
    assert code == 2 and needle in out and "gefen-bench digest" in out


def test_compare_refuses_a_file_that_is_not_a_digest(
        baseline: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = _write(tmp_path / "step.json", {"schema": "gefen-bench/step/1"})
    code, out = _run(capsys, ["digest", "--compare", str(baseline), str(other)])
    assert code == 2 and "not a digest JSON" in out


def test_source_commit_only_for_files_git_tracks(tmp_path, monkeypatch) -> None:
    """A package that git tracks gets its checkout's commit; a copy that git does not track
    inside that checkout (e.g. a ``git archive`` of another commit) gets none, not the
    enclosing checkout's."""
    import shutil
    import subprocess
    import sys

    from gefen_bench.digest import _source

    if shutil.which("git") is None:
        pytest.fail("git is needed to build the checkout this test inspects")

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tmp_path), *args], check=True,
                              capture_output=True, text=True).stdout.strip()

    for name in ("tracked_pkg_for_digest", "untracked_pkg_for_digest"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
    git("init", "-q")
    git("add", "tracked_pkg_for_digest")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "t")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert _source("tracked_pkg_for_digest")["commit"] == git("rev-parse", "HEAD")
        assert _source("untracked_pkg_for_digest")["commit"] is None
    finally:
        for name in ("tracked_pkg_for_digest", "untracked_pkg_for_digest"):
            sys.modules.pop(name, None)
