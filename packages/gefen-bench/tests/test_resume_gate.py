"""The Trainer-resume gate (docs/algorithm.md#distributed): it passes for the three recipes on one
process and on 2-process DDP (gloo), and it fails when the checkpoint is damaged."""

from __future__ import annotations

import json

import pytest
import torch

from gefen_bench import resume
from gefen_bench.resume import compare_trees, default_options, run_gate, state_digest

# Small but complete: warmup + cosine over 4 updates of 2 micro-batches, checkpoint after 2.
FAST = dict(steps=4, split=2, grad_accum=2, batch=2, seq=32, windows=48)


def _explain(results) -> str:
    return "\n".join(f"{r.recipe} rank {r.rank}: {r.errors + r.differences}" for r in results)


# ----------------------------------------------------------------------- the comparison itself


def test_compare_trees_is_exact():
    a = {"state": {0: {"step": torch.tensor(3.0),
                       "codes": torch.tensor([1, 2], dtype=torch.uint8)}},
         "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.99)}]}
    same = {"state": {0: {"step": torch.tensor(3.0),
                          "codes": torch.tensor([1, 2], dtype=torch.uint8)}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.99)}]}
    assert compare_trees(a, same, "optimizer") == []
    assert state_digest(a) == state_digest(same)
    # One ulp of a float, a dtype change, a changed code, a missing key: all caught.
    cases = [
        ("param_groups", [{"lr": float(torch.nextafter(torch.tensor(1e-3, dtype=torch.float64),
                                                         torch.tensor(1.0, dtype=torch.float64))),
                           "betas": (0.9, 0.99)}], "lr"),
        ("state", {0: {"step": torch.tensor(3.0, dtype=torch.float64),
                       "codes": torch.tensor([1, 2], dtype=torch.uint8)}}, "step"),
        ("state", {0: {"step": torch.tensor(3.0),
                       "codes": torch.tensor([1, 3], dtype=torch.uint8)}}, "codes"),
        ("state", {0: {"step": torch.tensor(3.0)}}, "codes"),
    ]
    for key, value, needle in cases:
        other = {**same, key: value}
        diffs = compare_trees(a, other, "optimizer")
        assert diffs and needle in diffs[0], (key, diffs)
        assert state_digest(a) != state_digest(other)
    # An int is not a float of the same value (a counter that changed type on load).
    assert compare_trees({"step": 3}, {"step": 3.0}, "x")


def test_rejects_bad_options():
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match="--split"):
        run_gate(["gefen"], default_options(steps=4, split=4))
    with pytest.raises(argparse.ArgumentTypeError, match="unknown recipe"):
        run_gate(["adamw"], default_options())


# ----------------------------------------------------------------------- the gate


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_gate_passes_single_process():
    results = run_gate(list(resume.RECIPES), default_options(**FAST))
    assert [r.recipe for r in results] == list(resume.RECIPES)
    assert all(r.passed for r in results), _explain(results)
    for r in results:
        assert r.optimizer_steps == FAST["steps"]
        assert len(r.losses) == FAST["steps"] and r.losses[-1] < r.losses[0]
        # The schedule really changes, also across the split (warmup, then cosine decay).
        assert len(set(r.lrs)) >= 3 and r.lrs[FAST["split"] - 1] != r.lrs[FAST["split"]]
    # The three recipes are different optimizers, not one path under three names.
    assert len({tuple(r.losses[2:]) for r in results}) == 3


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_gate_passes_two_process_ddp():
    results = run_gate(list(resume.RECIPES),
                       default_options(world_size=2, timeout=450.0, **FAST))
    assert all(r.passed for r in results), _explain(results)
    assert all(r.world_size == 2 and r.optimizer_steps == FAST["steps"] for r in results)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dropped_codebook_fails_the_gate():
    (r,) = run_gate(["muon_gefen"], default_options(break_="drop_codebook", **FAST))
    assert not r.passed
    assert r.broken.startswith("removed the codebook")
    assert any("codebook" in e and "resume failed" in e for e in r.errors), r.errors


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_flipped_code_fails_the_command(tmp_path):
    out = tmp_path / "gate.json"
    args = default_options(recipes="gefen", break_="flip_code", out=out, **FAST)
    with pytest.raises(SystemExit) as info:
        resume.run(args)
    assert info.value.code == 1
    doc = json.loads(out.read_text())
    assert doc["schema"] == "gefen-bench/resume/1" and doc["passed"] is False
    (r,) = doc["results"]
    assert r["broken"].startswith("changed one momentum code")
    # The damaged code loads (it is a valid code), so only the exact comparison can catch it.
    assert not any("resume failed" in e for e in r["errors"]), r["errors"]
    assert any(d.startswith("optimizer:") for d in r["differences"]), r["differences"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.timeout(900)
def test_gate_passes_on_cuda_bf16_fused():
    """The gate on one GPU with fused kernels in bf16 (issue: resume gate on the H200), and a
    damaged checkpoint still fails it there."""
    results = run_gate(list(resume.RECIPES), default_options(device="cuda", bf16=True, **FAST))
    assert [r.recipe for r in results] == list(resume.RECIPES)
    assert all(r.passed for r in results), _explain(results)
    assert all(r.optimizer_steps == FAST["steps"] and r.losses[-1] < r.losses[0]
               for r in results)
    (broken,) = run_gate(["gefen"], default_options(device="cuda", bf16=True,
                                                    break_="flip_code", **FAST))
    assert not broken.passed and broken.differences
