"""gefen-bench train at scale: one job runner for sweep and reported runs, a train.json that
survives a cut-off invocation, LM seeds, and plots of the tasks that ran."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gefen_bench import jobs
from gefen_bench.jobs import JobOutcome, JobQueue


def _fake_outcome(job: dict) -> JobOutcome:
    return JobOutcome("ok", {"job": job["name"]}, None, "", 0.0, time.monotonic())


def test_queue_runs_jobs_side_by_side(monkeypatch: pytest.MonkeyPatch) -> None:
    # Both jobs must be inside run_job at once to pass the barrier; run one after the
    # other, the first waits alone and the barrier breaks.
    barrier = threading.Barrier(2, timeout=20)

    def fake(job, **_kw):
        barrier.wait()
        return _fake_outcome(job)

    monkeypatch.setattr(jobs, "run_job", fake)
    done: list[str] = []
    queue = JobQueue(2, on_done=lambda job, out: done.append(out.result["job"]))
    queue.submit({"name": "sweep a"})
    queue.submit({"name": "sweep b"})
    queue.run()
    assert sorted(done) == ["sweep a", "sweep b"]


def test_queue_runs_follow_up_jobs_first_and_reraises(monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[str] = []

    def fake(job, **_kw):
        order.append(job["name"])
        return _fake_outcome(job)

    monkeypatch.setattr(jobs, "run_job", fake)

    def on_done(job, out):
        return [({"name": "final a"}, 1.0)] if job["name"] == "sweep a" else None

    queue = JobQueue(1, on_done=on_done)
    for name in ("sweep a", "sweep b", "sweep c"):
        queue.submit({"name": name})
    queue.run()
    assert order == ["sweep a", "final a", "sweep b", "sweep c"]

    def broken(job, out):
        raise RuntimeError("report writer broke")

    queue = JobQueue(2, on_done=broken)
    queue.submit({"name": "x"})
    with pytest.raises(RuntimeError, match="report writer broke"):
        queue.run()
    with pytest.raises(ValueError, match="parallel must be >= 1"):
        JobQueue(0)


def test_aggregate_seeds_mean_spread_and_verdict_within_spread() -> None:
    from gefen_bench.train_report import aggregate_seeds, verdicts

    def run(seed: int, loss: float, bpp: float) -> dict:
        return {"seed": seed, "final_eval_loss": loss, "lr": 1e-3, "tokens_per_s": 1.0,
                "steps": 10, "diverged": False, "state": {"bytes_per_param": bpp},
                "train_loss": [loss]}

    adamw = aggregate_seeds([run(0, 0.80, 8.0), run(1, 0.82, 8.0)])
    assert adamw["final_eval_loss"] == pytest.approx(0.81)
    assert adamw["final_eval_loss_runs"] == [0.80, 0.82]
    assert adamw["final_eval_loss_std"] == pytest.approx(math.sqrt(2 * 0.01 ** 2))
    assert adamw["seed_spread"] == pytest.approx(0.02 / 0.81)
    assert adamw["train_loss"] == [0.80] and adamw["seeds"] == [0, 1]
    one = aggregate_seeds([run(0, 0.9, 1.0)])
    assert one["seed_spread"] == 0.0 and one["final_eval_loss_std"] == 0.0
    gefen = aggregate_seeds([run(0, 0.815, 1.0), run(1, 0.817, 1.0)])
    (v,) = verdicts({"lm": {"adamw": adamw, "gefen": gefen}}, {}, True)
    gap = 0.816 / 0.81 - 1
    assert v["held_out_loss_vs_adamw"] == pytest.approx(gap)
    assert v["seed_spread"] == pytest.approx(0.02 / 0.81)  # the larger of the two
    assert v["within_seed_spread"] is True and v["within_1pct_or_spread"] is True
    assert v["seeds"] == {"adamw": 2, "gefen": 2}
    worse = aggregate_seeds([run(0, 0.86, 1.0), run(1, 0.86, 1.0)])
    (w,) = verdicts({"lm": {"adamw": adamw, "gefen": worse}}, {}, True)
    assert w["within_seed_spread"] is False and w["within_1pct_or_spread"] is False
    (u,) = verdicts({"lm": {"adamw": one, "gefen": aggregate_seeds([run(0, 0.9, 1.0)])}},
                    {}, True)
    assert u["seed_spread"] is None and u["within_seed_spread"] is None


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def test_sweep_points_run_in_parallel_and_seeds_aggregate(tmp_path: Path) -> None:
    out = tmp_path / "train"
    proc = subprocess.run(
        [sys.executable, "-m", "gefen_bench.cli", "train", "--preset", "tiny", "--tasks", "lm",
         "--optimizers", "adamw,gefen", "--jobs", "2", "--threads", "1", "--seeds", "0,1",
         "--seeds-for", "adamw", "--out", str(out)],
        capture_output=True, text=True, env=_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "train.json").read_text())
    assert report["complete"] is True and report["parallel_jobs"] == 2
    points = report["lr_sweep"]["lm"]["points"]
    assert len(points) == 6  # 2 optimizers x 3 grid LRs, each a process of its own
    spans = sorted((p["process"]["started_s"], p["process"]["started_s"] + p["process"]["wall_s"])
                   for p in points)
    # Two sweep processes overlapped in time: the sweep ran side by side under --jobs 2.
    assert any(b[0] < a[1] for a, b in zip(spans, spans[1:]))
    lm = report["results"]["lm"]
    assert report["lm_seeds"] == {"adamw": [0, 1], "gefen": [0]}
    assert [r["seed"] for r in lm["adamw"]["runs"]] == [0, 1]
    runs = lm["adamw"]["final_eval_loss_runs"]
    assert lm["adamw"]["final_eval_loss"] == pytest.approx(sum(runs) / 2)
    assert runs[0] != runs[1]  # another initialisation, another loss
    assert len(lm["gefen"]["runs"]) == 1
    assert report["lr"]["lm"]["gefen"] == report["lr_sweep"]["lm"]["tuned"]["gefen"]["lr"]
    assert set(report["wall_s"]["per_process"]) == {"lm/adamw/seed0", "lm/adamw/seed1",
                                                    "lm/gefen"}


def test_cut_off_invocation_keeps_a_valid_partial_train_json(tmp_path: Path) -> None:
    out = tmp_path / "train"
    # The sweep points are 4 steps; the reported runs are long, so the kill lands in them.
    proc = subprocess.Popen(
        [sys.executable, "-m", "gefen_bench.cli", "train", "--preset", "tiny", "--tasks", "lm",
         "--optimizers", "adamw,gefen", "--jobs", "1", "--threads", "1", "--steps", "5000",
         "--out", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env(),
        start_new_session=True)
    path = out / "train.json"
    points: list = []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            if path.exists():
                points = json.loads(path.read_text())["lr_sweep"]["lm"]["points"]
                if len(points) >= 4:
                    break
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert len(points) >= 4, "the sweep points never reached train.json"
    report = json.loads(path.read_text())
    assert report["complete"] is False
    kept = report["lr_sweep"]["lm"]["points"]
    assert len(kept) >= 4
    for p in kept:
        assert p["result"]["eval_split"] == "val" and math.isfinite(p["score"])
    assert report["meta"]["command"].startswith("gefen-bench train")


def test_plot_of_an_lm_only_run_has_no_digits_panel(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from gefen_bench import report

    figures = []
    real = report.save_figure
    monkeypatch.setattr(report, "save_figure",
                        lambda fig, title, path: (figures.append(fig), real(fig, title, path))[1])

    def lm(loss: float, runs: list[float]) -> dict:
        return {"lr": 1e-3, "train_loss": [3.0, 2.0, loss], "eval_loss": [[2, 2.5], [3, loss]],
                "final_eval_loss": loss, "final_eval_loss_runs": runs, "tokens_per_s": 10.0,
                "memory": {"peak_over_start_bytes": 2 ** 20}, "state": {"bytes_per_param": 8.0}}

    report.plot_train(tmp_path / "lm.png", {"adamw": lm(1.0, [0.99, 1.01]),
                                            "gefen": lm(1.0, [1.0])}, {}, "lm only")
    titles = [ax.get_title() for ax in figures[0].axes if ax.axison]
    assert not any("digits" in t for t in titles)
    assert len(titles) == 6 and all(titles)
    assert "LM: final held-out loss (mean; bars: range over seeds)" in titles


def _train(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gefen_bench.cli", "train", "--preset", "tiny", "--tasks", "lm",
         "--optimizers", "adamw,gefen", "--jobs", "2", "--threads", "1", "--seeds", "0,1",
         "--seeds-for", "adamw", "--out", str(out), *extra],
        capture_output=True, text=True, env=_env(), timeout=600)


def test_resume_keeps_finished_runs_and_runs_only_the_rest(tmp_path: Path) -> None:
    out = tmp_path / "train"
    assert _train(out).returncode == 0
    path = out / "train.json"
    full = json.loads(path.read_text())
    # Cut the report back to what a cut-off invocation would have left: one sweep point
    # failed, Gefen's reported run and AdamW's second seed unfinished.
    cut = json.loads(path.read_text())
    cut["complete"] = False
    points = cut["lr_sweep"]["lm"]["points"]
    failed = next(p for p in points if p["optimizer"] == "gefen")
    failed["error"], failed["score"] = "timeout: killed", "inf"
    del cut["results"]["lm"]["gefen"]
    cut["results"]["lm"]["adamw"]["runs"] = cut["results"]["lm"]["adamw"]["runs"][:1]
    path.write_text(json.dumps(cut))

    proc = _train(out, "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = json.loads(path.read_text())
    assert resumed["complete"] is True
    assert [h["command"] for h in resumed["resumed"]] == [full["meta"]["command"]]
    before = {(p["optimizer"], p["lr"]): p for p in full["lr_sweep"]["lm"]["points"]}
    after = {(p["optimizer"], p["lr"]): p for p in resumed["lr_sweep"]["lm"]["points"]}
    assert after.keys() == before.keys()
    rerun = (failed["optimizer"], failed["lr"])
    for key, point in after.items():
        assert "error" not in point and math.isfinite(point["score"])
        # A kept point is the earlier invocation's (same process time line); the failed one
        # ran again in this invocation and scored the same (CPU runs are deterministic).
        assert (point["process"] == before[key]["process"]) is (key != rerun)
        assert point["score"] == before[key]["score"]
    lm, lm_before = resumed["results"]["lm"], full["results"]["lm"]
    assert lm["adamw"]["runs"][0] == lm_before["adamw"]["runs"][0]  # kept
    assert [r["seed"] for r in lm["adamw"]["runs"]] == [0, 1]
    assert lm["adamw"]["runs"][1]["final_eval_loss"] == lm_before["adamw"]["runs"][1][
        "final_eval_loss"]
    assert lm["adamw"]["process"] == lm_before["adamw"]["process"]
    assert lm["gefen"]["final_eval_loss"] == lm_before["gefen"]["final_eval_loss"]
    assert lm["gefen"]["process"] != lm_before["gefen"]["process"]


def test_resume_refuses_another_plan_and_a_missing_report(tmp_path: Path) -> None:
    out = tmp_path / "train"
    proc = _train(out, "--resume")
    assert proc.returncode == 2 and "no train.json" in proc.stderr
    out.mkdir(parents=True)
    (out / "train.json").write_text(json.dumps(
        {"schema": "gefen-bench/train/1", "plan": {"preset": "tiny", "seeds": [0]}}))
    before = (out / "train.json").read_text()
    proc = _train(out, "--resume")
    assert proc.returncode == 2 and "another plan" in proc.stderr
    assert "configs" in proc.stderr and "seeds" in proc.stderr
    assert (out / "train.json").read_text() == before  # nothing written


def test_resume_reads_diverged_points_and_runs_back_as_numbers(tmp_path: Path) -> None:
    from gefen_bench.train_resume import load, plan

    expected = plan("tiny", "cpu", {"lm": {"steps": 8}}, (0.5, 1.0), {}, (0, 1), None, 1234)
    path = tmp_path / "train.json"
    # As write_json stores them: an infinite score as "inf", a NaN loss as null.
    path.write_text(json.dumps({
        "schema": "gefen-bench/train/1", "plan": expected, "meta": {"command": "c"},
        "lr_sweep": {"lm": {"points": [
            {"optimizer": "gefen", "lr": 1e-3, "score": "inf"},
            {"optimizer": "gefen", "lr": 2e-3, "score": "inf", "error": "timeout"},
            {"optimizer": "muon", "lr": 1e-3, "score": 2.0}]}},
        "results": {"lm": {"gefen": {"lr": 1e-3, "final_eval_loss": None, "x": 1, "runs": [
            {"seed": 0, "final_eval_loss": None}, {"seed": 1, "final_eval_loss": 2.5}]}}}}))
    prev = load(path, expected, ["adamw", "gefen"])
    assert prev.points["lm"] == [{"optimizer": "gefen", "lr": 1e-3, "score": math.inf}]
    runs = prev.take_runs("lm", "gefen", 1e-3)
    assert math.isnan(runs[0]["final_eval_loss"]) and runs[0]["x"] == 1
    assert runs[1]["final_eval_loss"] == 2.5 and runs[1]["lr"] == 1e-3
    assert prev.take_runs("lm", "gefen", 1e-3) == {}  # handed out once


def test_digits_seeds_set_the_reported_runs_of_both_digits_tasks(tmp_path: Path) -> None:
    out = tmp_path / "train"
    proc = subprocess.run(
        [sys.executable, "-m", "gefen_bench.cli", "train", "--preset", "tiny", "--tasks",
         "digits,digits-mlp", "--optimizers", "adamw,gefen-factor-all", "--no-lr-sweep",
         "--digits-seeds", "3,5", "--threads", "1", "--out", str(out)],
        capture_output=True, text=True, env=_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "train.json").read_text())
    for task in ("digits", "digits-mlp"):
        assert report["tasks"][task]["config"]["seeds"] == [3, 5]
        for name in ("adamw", "gefen-factor-all"):
            assert [r["seed"] for r in report["results"][task][name]["runs"]] == [3, 5]
    assert report["plan"]["configs"]["digits-mlp"]["seeds"] == [3, 5]  # --resume compares it


def test_gefen_factor_all_factors_the_matrices_the_factoring_rule_keeps_per_block() -> None:
    import torch

    from gefen_bench import optimizers as registry

    def layout(name: str) -> set[str]:
        p = torch.nn.Parameter(torch.randn(10, 16))
        (opt,) = registry.build(name, [("w", p)], lr=1e-3, weight_decay=0.0,
                                device=torch.device("cpu"))
        p.grad = torch.randn(10, 16)
        opt.step()
        return set(opt.state[p])

    # [10, 16] is below the rule's min_dim_size_to_factor=128 (docs/algorithm.md#factoring-rule).
    assert "exp_avg_sq" in layout("gefen") and "exp_avg_sq_row" not in layout("gefen")
    assert {"exp_avg_sq_row", "exp_avg_sq_col"} <= layout("gefen-factor-all")
