"""The gefen-bench command line: errors, skipped peers, and tiny end-to-end runs."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch

from gefen_bench import cli
from gefen_bench import optimizers as registry
from gefen_bench.param_sets import numel, shapes_for


def _run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str, str]:
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["train", "--lr", "gefen"], "--lr expects NAME=VALUE"),
        (["train", "--lr", "gefen=fast"], "'fast' is not a number"),
        (["train", "--lr", "gefen=-1"], "must be a positive number"),
        (["train", "--lr", "vision:gefen=1e-3"], "unknown task 'vision'"),
        (["train", "--tasks", "lm,speech"], "unknown task 'speech'"),
        (["train", "--steps", "0"], "--steps must be >= 1"),
        (["train", "--grad-clip", "-1"], "--grad-clip must be >= 0"),
        (["train", "--target", "torch=/tmp"], "--target torch=...: unknown package"),
        (["train", "--sweep-grid", "1,x"], "is not a list of numbers"),
        (["train", "--preset", "h100"], "invalid choice: 'h100'"),
        (["train", "--device", "cuda:7"], "--device cuda:7"),
        (["arch", "--families", "llama,resnet"], "unknown family 'resnet'"),
        (["step", "--models", "gpt3"], "unknown model 'gpt3'"),
        (["memory", "--models", "bert"], "unknown model 'bert'"),
        (["profile", "--modes", "adam"], "--modes: unknown value 'adam'"),
        (["profile", "--models", "bert"], "--models: unknown value 'bert'"),
        (["profile", "--steps", "0"], "--steps and --top must be >= 1"),
    ],
)
def test_argument_errors_are_clear(capsys: pytest.CaptureFixture[str], argv: list[str],
                                   needle: str) -> None:
    if argv[-1] == "cuda:7":
        import torch

        if torch.cuda.is_available():
            pytest.skip("the machine has CUDA; the error is about a missing CUDA device")
    code, _, err = _run(capsys, argv)
    assert code == 2
    assert needle in err
    assert f"gefen-bench {argv[0]}" in err  # the usage line of the subcommand


@pytest.mark.parametrize("command", ["train", "arch", "step", "memory"])
def test_unknown_optimizer_lists_the_available_ones(capsys: pytest.CaptureFixture[str],
                                                    command: str) -> None:
    code, _, err = _run(capsys, [command, "--optimizers", "adamw,sgd-deluxe"])
    assert code == 2
    assert "unknown optimizer 'sgd-deluxe'" in err
    for name in ("adamw", "gefen", "adafactor", "muon", "torchao-adamw8bit", "gefenx-0.5"):
        assert name in err


def test_every_subcommand_is_registered() -> None:
    parser, modules, _ = cli.build_parser()
    assert set(modules) == {"train", "arch", "step", "memory", "codebook",
                            "resume", "profile", "fit", "digest"}
    assert parser.parse_args(["train"]).command == "train"


def test_train_tiny_writes_json_and_png_and_skips_missing_peers(
        tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # Make torchao look absent whatever this machine has installed.
    real = registry._module_present
    monkeypatch.setattr(registry, "_module_present",
                        lambda name: False if name == "torchao" else real(name))
    code, out, err = _run(capsys, [
        "train", "--preset", "tiny", "--optimizers", "adamw,torchao-adamw8bit,gefenx-0.5",
        "--out", str(tmp_path), "--threads", "1"])
    assert code == 0, err
    report = json.loads((tmp_path / "train.json").read_text())
    assert (tmp_path / "train.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"JSON: {tmp_path / 'train.json'}" in out.replace("\n", "")
    assert "PNG:" in out
    assert "torchao not installed" in report["skipped"]["torchao-adamw8bit"]
    assert "--target gefen-x=DIR" in report["skipped"]["gefenx-0.5"]
    assert "skipped" in out and "torchao-adamw8bit" in out
    assert report["failed"] == {}
    lm = report["results"]["lm"]["adamw"]
    steps = report["tasks"]["lm"]["config"]["steps"]
    assert len(lm["train_loss"]) == steps
    assert math.isfinite(lm["final_eval_loss"])
    # AdamW's fp32 state is exp_avg + exp_avg_sq (8 B/param) plus a 4-byte step per tensor
    # (the tiny Llama has 2 layers x 9 tensors + embedding, final norm and head = 21).
    assert lm["state"]["state_bytes"] == 8 * lm["state"]["numel"] + 4 * 21
    assert lm["memory"]["peak_bytes"] > 0
    digits = report["results"]["digits"]["adamw"]
    assert len(digits["runs"]) == len(report["tasks"]["digits"]["config"]["seeds"])
    assert 0.0 <= digits["accuracy_mean"] <= 1.0
    mlp = report["results"]["digits-mlp"]["adamw"]
    assert mlp["task"] == "digits-mlp" and mlp["model"] == "mlp"
    assert len(mlp["runs"]) == len(report["tasks"]["digits-mlp"]["config"]["seeds"])
    assert math.isfinite(mlp["final_eval_loss_mean"])
    assert "digits MLP (held-out split)" in out
    assert (tmp_path / "digits.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["meta"]["command"].startswith("gefen-bench train")
    assert report["meta"]["versions"]["torch"]
    # The default LR sweep: AdamW on the shared grid, validation split, its tuned LR used.
    sweep = report["lr_sweep"]["lm"]
    assert sweep["grid"] == pytest.approx([x * 3e-3 for x in (0.5, 1.0, 2.0)])
    assert {p["optimizer"] for p in sweep["points"]} == {"adamw"}
    assert all(p["result"]["eval_split"] == "val" for p in sweep["points"])
    assert report["lr"]["lm"]["adamw"] == sweep["tuned"]["adamw"]["lr"]
    assert report["lr_source"]["lm"]["adamw"].startswith("--lr-sweep")
    assert "LR sweep" in out


def test_arch_two_families(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, [
        "arch", "--families", "llama,conv3d", "--optimizers", "gefen,adamw", "--steps", "20",
        "--out", str(tmp_path)])
    assert code == 0, err
    report = json.loads((tmp_path / "arch.json").read_text())
    runs = {(r["family"], r["optimizer"]): r for r in report["runs"]}
    assert set(runs) == {(f, o) for f in ("llama", "conv3d") for o in ("gefen", "adamw")}
    for r in runs.values():
        assert r["status"] == "ok", r
        assert r["pass"] is (r["finite"] and r["final_loss"] < 0.7 * r["initial_loss"])
        assert r["pass"], r
    assert 5 in runs[("conv3d", "gefen")]["ranks"]
    assert runs[("llama", "gefen")]["ranks"] == [1, 2]
    assert "PASS" in out


def test_step_keeps_measured_rows_when_cut_short(tmp_path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """An outer timeout (the GPU runs are bounded) must not lose the optimizers measured so
    far: step.json is rewritten after each one, marked incomplete until the end."""
    from gefen_bench import step as step_mod

    real = step_mod.run_job
    calls = []

    def cut_after_first_optimizer(job, **kw):  # type: ignore[no-untyped-def]
        if job.get("optimizer") is not None:
            calls.append(job["optimizer"])
            if len(calls) == 2:
                raise KeyboardInterrupt  # what the outer timeout's signal amounts to
        return real(job, **kw)

    monkeypatch.setattr(step_mod, "run_job", cut_after_first_optimizer)
    code, _, _ = _run(capsys, [
        "step", "--device", "cpu", "--scale", "tiny", "--models", "gpt2",
        "--optimizers", "adamw-foreach,gefen", "--steps", "2", "--warmup", "0",
        "--out", str(tmp_path)])
    assert code != 0
    report = json.loads((tmp_path / "step.json").read_text())
    assert report["complete"] is False
    assert [r["optimizer"] for r in report["rows"]] == ["adamw-foreach"]


def test_step_cpu_tiny(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, [
        "step", "--device", "cpu", "--scale", "tiny", "--models", "gpt2",
        "--optimizers", "adamw-foreach,gefen", "--steps", "3", "--warmup", "1",
        "--out", str(tmp_path)])
    assert code == 0, err
    report = json.loads((tmp_path / "step.json").read_text())
    assert report["failed"] == {}
    assert report["complete"] is True
    rows = {r["optimizer"]: r for r in report["rows"]}
    shapes = shapes_for("gpt2", "tiny")
    adamw = rows["adamw-foreach"]
    assert adamw["tensors"] == len(shapes) and adamw["params"] == numel(shapes)
    # CPU steps default to fp32 (the offloaded step's master weights): fp32 exp_avg +
    # exp_avg_sq (2 x 4 bytes/element) + one fp32 scalar `step` per tensor.
    assert report["dtype"] == "float32"
    expected = (8 * numel(shapes) + 4 * len(shapes)) / numel(shapes)
    assert adamw["state_bytes_per_param"] == pytest.approx(expected)
    assert rows["gefen"]["state_bytes_per_param"] < adamw["state_bytes_per_param"]
    for r in rows.values():
        assert r["step_ms_median"] > 0 and r["first_step_ms"] > 0
        assert r["step_ms_p90"] >= r["step_ms_median"]
        assert r["first_step_warm_ms"] > 0
        assert r["timer"] == "host-wall"
        if sys.platform.startswith("linux") and os.access("/proc/self/clear_refs", os.W_OK):
            # CPU peak extra: peak resident set over the resident set before a step.
            assert r["peak_extra_mib"] is not None and r["peak_extra_mib"] >= 0
    assert report["copy_bandwidth"]["gb_per_s"] > 0


@pytest.mark.slow
def test_step_times_the_compiled_step_next_to_the_eager_one(
        tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, [
        "step", "--device", "cpu", "--scale", "tiny", "--models", "gpt2",
        "--optimizers", "gefen,gefen-compiled", "--steps", "3", "--warmup", "1",
        "--out", str(tmp_path)])
    assert code == 0, err
    report = json.loads((tmp_path / "step.json").read_text())
    assert report["failed"] == {}
    rows = {r["optimizer"]: r for r in report["rows"]}
    eager, compiled = rows["gefen"], rows["gefen-compiled"]
    assert eager["compiled"] is False and eager["compile_ms"] is None
    assert compiled["compiled"] is True and compiled["compile_ms"] > 0
    assert compiled["step_ms_median"] > 0
    # The same optimizer: compiling changes no state.
    assert compiled["state_bytes"] == eager["state_bytes"]


def test_step_skips_graph_entries_off_cuda(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, [
        "step", "--device", "cpu", "--scale", "tiny", "--models", "gpt2",
        "--optimizers", "gefen-graph,adamw-foreach", "--steps", "1", "--warmup", "0",
        "--out", str(tmp_path)])
    assert code == 0, err
    report = json.loads((tmp_path / "step.json").read_text())
    assert report["skipped"] == {
        "gefen-graph": "CUDA graph capture needs a CUDA device, not cpu"}
    assert [r["optimizer"] for r in report["rows"]] == ["adamw-foreach"]
    assert report["rows"][0]["cuda_graph"] is False


def test_memory_tiny(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, ["memory", "--scale", "tiny", "--optimizers", "adamw",
                                 "--out", str(tmp_path)])
    assert code == 0, err
    rows = json.loads((tmp_path / "memory.json").read_text())["rows"]
    assert {r["model"] for r in rows} == {"gpt2", "llama"}
    for r in rows:
        shapes = shapes_for(r["model"], "tiny")
        # fused AdamW on CPU: bf16 exp_avg + exp_avg_sq and an fp32 `step` per tensor.
        assert r["state_bytes"] == 4 * numel(shapes) + 4 * len(shapes)


def _check_profile_case(case: dict, device: str) -> None:
    shapes = dict(shapes_for(case["model"], "tiny"))
    # Every tensor is stepped and appears in the census with a period dividing its numel.
    assert sum(c["count"] for c in case["census"]) == len(shapes)
    for c in case["census"]:
        n = math.prod(c["shape"])
        assert n % c["period"] == 0
        if c["factored"]:
            assert case["mode"] == "factored" and len(c["shape"]) == 2
    assert case["first_step_ms"] > 0 and case["step_ms"] > 0 and case["host_issue_ms"] > 0
    assert case["timer"] == ("cuda-events" if device == "cuda" else "host-wall")
    assert case["kernels"], "no kernel or operator time was recorded"
    for k in case["kernels"]:
        assert k["us_per_step"] > 0 and k["calls_per_step"] > 0
    times = [k["us_per_step"] for k in case["kernels"]]
    assert times == sorted(times, reverse=True)


def test_profile_cpu_tiny(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, ["profile", "--device", "cpu", "--scale", "tiny",
                                   "--models", "gpt2", "--steps", "2", "--warmup", "1",
                                   "--top", "5", "--out", str(tmp_path)])
    assert code == 0, err
    report = json.loads((tmp_path / "profile.json").read_text())
    assert report["meta"]["command"].startswith("gefen-bench profile")
    cases = {c["mode"]: c for c in report["cases"]}
    assert set(cases) == {"factored", "block"}
    for case in cases.values():
        _check_profile_case(case, "cpu")
        assert len(case["kernels"]) <= 5
    assert not any(c["factored"] for c in cases["block"]["census"])
    assert "state census" in out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_profile_cuda_tiny(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """``gefen-bench profile`` on CUDA: the fused path's kernels, timed with CUDA events."""
    code, _, err = _run(capsys, ["profile", "--device", "cuda", "--scale", "tiny",
                                 "--models", "llama", "--modes", "factored", "--steps", "3",
                                 "--out", str(tmp_path)])
    assert code == 0, err
    (case,) = json.loads((tmp_path / "profile.json").read_text())["cases"]
    _check_profile_case(case, "cuda")
    assert case["paths"] == ["fused"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_step_cuda_tiny(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """``gefen-bench step`` on CUDA: valid JSON, timed with CUDA events, memory measured."""
    code, _, err = _run(capsys, [
        "step", "--device", "cuda", "--scale", "tiny", "--models", "gpt2",
        "--optimizers", "adamw-fused,gefen,gefen-graph,adamw-fused-graph", "--steps", "5",
        "--warmup", "2", "--out", str(tmp_path)])
    assert code == 0, err
    report = json.loads((tmp_path / "step.json").read_text())
    assert report["device"].startswith("cuda") and report["failed"] == {}
    assert "GiB buffer" in report["copy_bandwidth"]["method"]
    assert report["copy_bandwidth"]["gb_per_s"] > 0
    rows = {r["optimizer"]: r for r in report["rows"]}
    assert set(rows) == {"adamw-fused", "gefen", "gefen-graph", "adamw-fused-graph"}
    assert {n for n, r in rows.items() if r["cuda_graph"]} == {"gefen-graph",
                                                                "adamw-fused-graph"}
    shapes = shapes_for("gpt2", "tiny")
    for r in rows.values():
        assert r["timer"] == "cuda-events"
        assert r["params"] == numel(shapes)
        assert math.isfinite(r["step_ms_median"]) and r["step_ms_median"] > 0
        assert r["peak_extra_mib"] is not None and r["alloc_delta_bytes_per_param"] is not None
    # Gefen's ~1 byte/param of state against fused AdamW's bf16 pair (4 bytes/param).
    assert rows["gefen"]["state_bytes_per_param"] < rows["adamw-fused"]["state_bytes_per_param"]
