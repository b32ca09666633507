"""gefen-bench fit: the model family, the bisection, and a CPU run on an accounted budget."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gefen_bench import cli
from gefen_bench import optimizers as registry
from gefen_bench.fit import build_model, family_config, largest_fit, param_count


def test_family_rule_and_parameter_count() -> None:
    # Size 32 is Llama-3.2-1B's body with an untied head: its published shapes and count.
    c = family_config(32)
    assert (c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"],
            c["num_key_value_heads"], c["intermediate_size"]) == (2048, 16, 32, 8, 8192)
    assert param_count(c) == 1_498_482_688
    assert family_config(64)["hidden_size"] == 4096
    assert family_config(64)["num_hidden_layers"] == 32
    # The count from shapes equals the built model's, on small sizes of the same rule.
    for size in (2, 3, 5, 6):
        cfg = family_config(size, vocab=256)
        model = build_model(cfg, seq_len=16)
        assert sum(p.numel() for p in model.parameters()) == param_count(cfg), size
        assert cfg["num_attention_heads"] % cfg["num_key_value_heads"] == 0
    with pytest.raises(ValueError, match="size must be >= 2"):
        family_config(1)


def _fake_probe(need: dict[int, int], budget: int, calls: list[int]):
    def probe(size: int) -> dict:
        calls.append(size)
        fits = need[size] <= budget
        cfg = family_config(size, vocab=256)
        params = param_count(cfg)
        return {"size": size, "params": params, "config": cfg, "fits": fits,
                "peak_bytes": need[size],
                "breakdown": {"params": 2 * params, "grads": 2 * params,
                              "optimizer_state": need[size] - 4 * params - 1000,
                              "activations_other": 1000}}
    return probe


@pytest.mark.parametrize("start", [2, 7, 40])
def test_largest_fit_matches_an_exhaustive_scan(start: int) -> None:
    sizes = range(2, 61)
    # A monotone memory model: 10 bytes/param plus a per-size overhead.
    need = {s: 10 * param_count(family_config(s, vocab=256)) + 5000 * s for s in sizes}
    for budget in (need[2] - 1, need[2], need[9] + 1, need[30], need[60] + 10**9):
        calls: list[int] = []
        best, probes = largest_fit(_fake_probe(need, budget, calls), start=start,
                                   max_size=60, budget=budget)
        expected = max((s for s in sizes if need[s] <= budget), default=None)
        assert (best["size"] if best else None) == expected, (budget, calls)
        assert len(set(calls)) == len(calls)  # no size probed twice
        assert len(calls) <= 2 * 6 + 2  # about twice bisection's log2(59) probes at most
        if expected is not None and expected < 60:
            assert expected + 1 in calls  # the boundary is shown, not assumed
    with pytest.raises(ValueError, match="outside"):
        largest_fit(_fake_probe(need, 0, []), start=70, max_size=60, budget=0)


def test_adamw_fp32_state_matches_torch_adamw_in_float32() -> None:
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(7, 5))
    b = torch.nn.Parameter(a.detach().clone())
    ours = registry.AdamWFP32State([a], lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW([b], lr=1e-2, weight_decay=0.1, foreach=False)
    for _ in range(5):
        g = torch.randn(7, 5)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    bf = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.bfloat16))
    opt = registry.AdamWFP32State([bf], lr=1e-3)
    bf.grad = torch.ones_like(bf)
    opt.step()
    assert bf.dtype == torch.bfloat16 and opt.state[bf]["exp_avg"].dtype == torch.float32
    with pytest.raises(ValueError, match="betas"):
        registry.AdamWFP32State([bf], betas=(0.9, 1.0))


def test_steps_in_backward_entries_are_refused_by_plain_step_commands() -> None:
    assert registry.get_spec("gefen-in-backward").steps_in_backward
    assert "backward" in (registry.availability("gefen-in-backward", plain_step=True) or "")
    assert registry.availability("gefen", plain_step=True) is None


@pytest.mark.parametrize("jobs", [1, 2])
def test_fit_cli_on_an_accounted_cpu_budget(tmp_path: Path, capsys, jobs: int) -> None:
    budget_gib = 0.012
    # The ratio to AdamW comes from the same invocation, whichever search finishes first.
    code = cli.main(["fit", "--device", "cpu", "--budget-gib", str(budget_gib), "--vocab",
                     "256", "--batch", "2", "--seq-len", "16", "--max-size", "8",
                     "--start", "3", "--optimizers", "gefen,adamw", "--jobs", str(jobs),
                     "--out", str(tmp_path)])
    assert code == 0
    report = json.loads((tmp_path / "fit.json").read_text())
    assert list(report["results"]) == ["gefen", "adamw"] and report["setup"]["jobs"] == jobs
    assert report["complete"] is True and report["schema"] == "gefen-bench/fit/1"
    budget = int(budget_gib * 2**30)
    for name in ("adamw", "gefen"):
        r = report["results"][name]
        best = r["largest"]
        assert best is not None and best["fits"] and best["peak_bytes"] <= budget
        b = best["breakdown"]
        assert sum(b.values()) == best["peak_bytes"]
        assert b["params"] == 2 * best["params"] == b["grads"]  # bf16 parameters, gradients
        above = [p for p in r["probes"] if p["size"] == best["size"] + 1]
        assert above and not above[0]["fits"] and above[0]["peak_bytes"] > budget
    adamw = report["results"]["adamw"]["largest"]
    gefen = report["results"]["gefen"]["largest"]
    # bf16 AdamW state is 4 B/param; Gefen's is about 1: Gefen fits a larger model.
    assert adamw["breakdown"]["optimizer_state"] >= 4 * adamw["params"]
    assert gefen["breakdown"]["optimizer_state"] < 2 * gefen["params"]
    assert gefen["size"] > adamw["size"]
    assert report["results"]["gefen"]["ratio_to"]["adamw"] == pytest.approx(
        gefen["params"] / adamw["params"])
    md = (tmp_path / "fit.md").read_text()
    assert "| gefen |" in md and "activation checkpointing on" in md


def test_fit_rejects_a_cpu_run_without_a_budget(capsys) -> None:
    try:
        code = cli.main(["fit", "--device", "cpu"])
    except SystemExit as exc:
        code = int(exc.code or 0)
    assert code == 2
    assert "--budget-gib is required off CUDA" in capsys.readouterr().err
