"""Building blocks: state counting, data splits, parameter sets, worker failures."""

from __future__ import annotations

import argparse
import zlib
from typing import Any

import pytest
import torch

from gefen_bench import optimizers as registry
from gefen_bench.data import eval_offsets, gather_windows, split_of, stdlib_corpus, window_offsets
from gefen_bench.jobs import run_job
from gefen_bench.param_sets import numel, shapes_for
from gefen_bench.state_bytes import state_bytes
from gefen_bench.train import parse_lr_overrides


def test_state_bytes_counts_each_storage_once_and_excludes_params() -> None:
    p = torch.nn.Parameter(torch.zeros(10))
    p.grad = torch.zeros(10)
    opt = torch.optim.SGD([p], lr=0.1)
    shared = torch.zeros(6, dtype=torch.float64)  # 48 bytes
    opt.state[p] = {"a": shared, "b": shared[2:], "c": torch.zeros(3, dtype=torch.uint8),
                    "param_alias": p.detach(), "grad_alias": p.grad.view(2, 5),
                    "nested": [{"d": torch.zeros(2, dtype=torch.int16)}]}
    assert state_bytes([opt], [p]) == 48 + 3 + 4


def test_state_bytes_of_torch_adamw_matches_its_definition() -> None:
    params = [torch.nn.Parameter(torch.randn(7, 3)), torch.nn.Parameter(torch.randn(5))]
    opt = torch.optim.AdamW(params, foreach=False)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    # exp_avg and exp_avg_sq in fp32 and a 0-dim fp32 `step` per parameter.
    assert state_bytes([opt], params) == 2 * 4 * 26 + 2 * 4


def test_split_is_by_file_and_stable() -> None:
    assert split_of("os.py") == split_of("os.py")
    # The rule, restated: CRC-32 of the POSIX relative path, 5% test, 5% validation.
    for path in ("os.py", "json/decoder.py", "email/_header_value_parser.py", "ast.py"):
        bucket = zlib.crc32(path.encode()) % 100
        expected = "test" if bucket < 5 else "val" if bucket < 10 else "train"
        assert split_of(path) == expected


def test_stdlib_corpus_has_disjoint_nonempty_splits() -> None:
    corpus = stdlib_corpus(max_train_bytes=50_000)
    assert len(corpus.train) == 50_000
    assert len(corpus.val) > 10_000 and len(corpus.test) > 10_000
    assert corpus.files["test"] > 0 and corpus.files["val"] > 0
    assert corpus.train.dtype == torch.uint8
    assert bytes(corpus.test[:200].tolist()).isascii() or len(corpus.test) > 0


def test_windows_are_deterministic_and_in_range() -> None:
    a = window_offsets(1000, 16, 64, seed=3)
    assert torch.equal(a, window_offsets(1000, 16, 64, seed=3))
    assert not torch.equal(a, window_offsets(1000, 16, 64, seed=4))
    assert int(a.max()) + 17 <= 1000
    stream = torch.arange(100, dtype=torch.uint8)
    w = gather_windows(stream, torch.tensor([0, 10]), 4)
    assert w.tolist() == [[0, 1, 2, 3, 4], [10, 11, 12, 13, 14]]
    e = eval_offsets(100, 4, 5)
    assert e[0] == 0 and e[-1] == 95


def test_param_sets_match_the_published_model_sizes() -> None:
    # The published sizes (GPT-2 small; Llama-3.2-1B with an untied head).
    gpt2, llama = shapes_for("gpt2"), shapes_for("llama")
    assert (len(gpt2), numel(gpt2)) == (148, 124_439_808)
    assert (len(llama), numel(llama)) == (147, 1_498_482_688)
    assert {len(s) for _, s in shapes_for("llama", "tiny")} == {1, 2}
    assert len(shapes_for("gpt2", "tiny")) == 4 + 12 * 2


def test_lora_set_holds_rank_16_adapters_of_every_projection() -> None:
    lora = shapes_for("llama-lora")
    d, q, kv, mlp, r = 2048, 2048, 512, 8192, 16  # Llama-3.2-1B's projection widths
    # Per projection r * (in + out): q, k, v, o, then gate, up, down.
    per_layer = r * ((d + q) + 2 * (d + kv) + (q + d) + 2 * (d + mlp) + (mlp + d))
    assert (len(lora), numel(lora)) == (16 * 7 * 2, 16 * per_layer)
    names = dict(lora)
    assert names["model.layers.0.mlp.down_proj.lora_A.weight"] == (r, mlp)
    assert names["model.layers.15.self_attn.k_proj.lora_B.weight"] == (kv, r)
    assert not any("embed" in n or "norm" in n or "lm_head" in n for n in names)
    tiny = shapes_for("llama-lora", "tiny")
    assert len(tiny) == 2 * 7 * 2 and all(4 in s for _, s in tiny)


def test_lr_overrides() -> None:
    assert parse_lr_overrides(["gefen=3e-3", "digits:adamw=1e-3"]) == {
        (None, "gefen"): 3e-3, ("digits", "adamw"): 1e-3}
    with pytest.raises(registry.UnknownOptimizerError, match="available: adamw"):
        parse_lr_overrides(["sgdx=1"])
    with pytest.raises(argparse.ArgumentTypeError):
        parse_lr_overrides(["gefen=0"])


def test_muon_routing_follows_the_hybrid_rule() -> None:
    emb = torch.nn.Embedding(10, 4)
    lin = torch.nn.Linear(4, 4)
    model = torch.nn.ModuleDict({"tok": emb, "body": lin, "lm_head": torch.nn.Linear(4, 10)})
    muon, rest = registry.split_for_muon(list(model.named_parameters()), model)
    assert [n for n, _ in muon] == ["body.weight"]
    assert {n for n, _ in rest} == {"tok.weight", "body.bias", "lm_head.weight",
                                    "lm_head.bias"}


def test_external_peer_without_target_is_skipped_with_instructions(tmp_path) -> None:
    reason = registry.availability("gefenx-0.5")
    assert reason is not None and "pip install --no-deps --target" in reason
    reason = registry.availability("gefenx-0.5", {"gefen-x": str(tmp_path)})
    assert reason is not None and "no gefen/__init__.py" in reason


def test_graph_entries_run_only_in_the_step_command_on_cuda() -> None:
    graphs = [n for n, spec in registry.REGISTRY.items() if spec.graph]
    assert set(graphs) == {"gefen-graph", "gefen-blockv-graph", "adamw-fused-graph"}
    for name in graphs:
        assert registry.get_spec(name).options.get("capturable") is True
        assert "only gefen-bench step" in (registry.availability(name) or "")
        assert "needs a CUDA device" in (
            registry.availability(name, device=torch.device("cpu")) or "")
        assert registry.availability(name, device=torch.device("cuda")) is None
    assert not set(graphs) & set(registry.TRAIN_DEFAULT)


def test_compiled_entries_run_only_in_the_step_command() -> None:
    compiled = {n for n, spec in registry.REGISTRY.items() if spec.compiled}
    assert compiled == {"gefen-compiled", "gefen-blockv-compiled", "gefen-muon-hybrid-compiled",
                        "adamw-foreach-compiled"}
    for name in compiled:
        assert not registry.get_spec(name).graph
        assert "only gefen-bench step" in (registry.availability(name) or "")
        assert registry.availability(name, device=torch.device("cpu")) is None
    assert not compiled & set(registry.TRAIN_DEFAULT)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["adamw-fused-graph", "gefen-graph", "gefen-blockv-graph"])
def test_captured_step_replays_the_eager_steps(name: str) -> None:
    """The step command's capture: the capture itself steps nothing, each replay one step,
    bit for bit as the same optimizer stepped eagerly (both ``capturable=True``)."""
    from gefen_bench.param_sets import build_param_set
    from gefen_bench.step import _captured

    device = torch.device("cuda")
    results = []
    for graphed in (False, True):
        named = build_param_set(shapes_for("gpt2", "tiny"), device=device,
                                dtype=torch.bfloat16, seed=0)
        opts = registry.build(name, named, lr=1e-2, weight_decay=0.0, device=device)

        def step(opts: list[torch.optim.Optimizer] = opts) -> None:
            for o in opts:
                o.step()

        step()  # the first step is eager in both (period search, codebook, state)
        if graphed:
            replay = _captured(step, device, warmup=2)
        else:
            for _ in range(2):
                step()
            replay = step
        for _ in range(3):
            replay()
        torch.cuda.synchronize()
        results.append([p.detach().clone() for _, p in named])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_worker_failure_is_reported_verbatim() -> None:
    out = run_job({"kind": "nonsense"}, timeout_s=60)
    assert out.status == "failed"
    assert out.error == ("ValueError: unknown job kind 'nonsense'; expected lm, digits, arch, "
                         "step, sweep or fit")


def test_digits_mlp_shapes_and_size() -> None:
    from gefen_bench.presets import DigitsConfig
    from gefen_bench.train_digits import DigitsMLP, build_digits_model

    cfg = DigitsConfig(model="mlp", hidden=24)
    model = build_digits_model(cfg)
    assert isinstance(model, DigitsMLP)
    assert model(torch.zeros(5, 1, 8, 8)).shape == (5, 10)
    # 64 -> 24 -> 24 -> 10, weights and biases.
    assert sum(p.numel() for p in model.parameters()) == (64 * 24 + 24) + (24 * 24 + 24) + (
        24 * 10 + 10)
    # The head keeps the name that routes it away from Muon (docs/algorithm.md#hybrid).
    muon, rest = registry.split_for_muon(list(model.named_parameters()), model)
    assert {n for n, _ in rest} >= {"classifier.weight", "classifier.bias"}
    assert len(muon) == 2
    with pytest.raises(ValueError, match="DigitsConfig.model must be one of cnn, mlp"):
        build_digits_model(DigitsConfig(model="resnet"))


def test_digits_job_is_deterministic_and_reports_curves() -> None:
    from gefen_bench.presets import DigitsConfig, as_dict
    from gefen_bench.train_digits import run_digits_job

    cfg = DigitsConfig(model="mlp", hidden=16, epochs=2, batch=256, seeds=(0,))
    job = {"optimizer": "adamw", "lr": 3e-3, "config": as_dict(cfg), "device": "cpu",
           "task": "digits-mlp", "eval_split": "val"}
    a = run_digits_job(job, lambda event: None)
    b = run_digits_job(job, lambda event: None)
    assert a["task"] == "digits-mlp" and a["model"] == "mlp"
    # 1797 digits: 60% train (1077) in batches of 256 -> 5 steps an epoch.
    assert a["steps"] == 2 * 5 and a["eval_examples"] == 270
    curve = a["runs"][0]["eval_curve"]
    assert [row[0] for row in curve] == [1, 2] and all(len(row) == 4 for row in curve)
    assert curve[-1][3] < curve[0][3]  # the training loss falls
    assert a["runs"][0]["eval_curve"] == b["runs"][0]["eval_curve"]
    c = run_digits_job({**job, "lr": 1e-2}, lambda event: None)
    assert c["runs"][0]["eval_curve"] != a["runs"][0]["eval_curve"]


def _digits_result(loss: float, accuracy: float, lr: float = 1e-2) -> dict[str, object]:
    return {"final_eval_loss_mean": loss, "accuracy_mean": accuracy, "lr": lr}


def test_verdict_is_the_two_percent_loss_bar_at_tuned_lrs_on_every_task() -> None:
    from gefen_bench.train import _verdicts

    lm = {"adamw": {"final_eval_loss": 2.0, "lr": 3e-3, "state": {"bytes_per_param": 8.0}},
          "gefen": {"final_eval_loss": 2.03, "lr": 6e-3, "state": {"bytes_per_param": 1.1}},
          "gefen-blockv": {"final_eval_loss": 2.05, "lr": 3e-3,
                           "state": {"bytes_per_param": 1.1}}}
    results = {"lm": lm,
               "digits": {"adamw": _digits_result(0.050, 0.98),
                          "gefen": _digits_result(0.0509, 0.979, 3e-3)},
               "digits-mlp": {"adamw": _digits_result(0.100, 0.97),
                              "gefen": _digits_result(0.1019, 0.968),
                              "gefen-blockv": _digits_result(0.1021, 0.975),
                              "muon": _digits_result(0.5, 0.5)}}
    sweeps = {"lm": {"equal_lr": {"gefen": [{"lr": 3e-3, "vs_ref": -0.01},
                                            {"lr": 6e-3, "vs_ref": 0.2}]}}}
    verdicts = {(v["task"], v["optimizer"]): v for v in _verdicts(results, sweeps, True)}
    # Gefen variants only, against AdamW, on every task.
    assert set(verdicts) == {("lm", "gefen"), ("lm", "gefen-blockv"), ("digits", "gefen"),
                             ("digits-mlp", "gefen"), ("digits-mlp", "gefen-blockv")}
    v = verdicts[("lm", "gefen")]
    assert v["pass"] is True and v["held_out_loss_vs_adamw"] == pytest.approx(0.015)
    assert v["lr"] == 6e-3 and v["adamw_lr"] == 3e-3
    assert v["state_vs_adamw"] == pytest.approx(1.1 / 8)
    # The equal-LR gap is the sweep's at AdamW's tuned LR.
    assert v["equal_lr_val_loss_vs_adamw"] == -0.01
    assert "own tuned LR" in v["bar"]
    assert verdicts[("lm", "gefen-blockv")]["pass"] is False  # +2.5%
    assert verdicts[("digits", "gefen")]["held_out_loss_vs_adamw"] == pytest.approx(0.018)
    assert verdicts[("digits", "gefen")]["pass"] is True
    assert verdicts[("digits-mlp", "gefen")]["accuracy_vs_adamw"] == pytest.approx(-0.002)
    assert verdicts[("digits-mlp", "gefen-blockv")]["pass"] is False  # +2.1%
    assert _verdicts({"digits-mlp": {"gefen": _digits_result(0.1, 0.9)}}, {}, True) == []
    untuned = _verdicts({"digits": results["digits"]}, {}, False)
    assert "at the LRs given" in untuned[0]["bar"]


def test_sweep_choice_and_equal_lr_rows() -> None:
    import math

    from gefen_bench.train_sweep import choose, equal_lr, grid_lrs

    grid = grid_lrs(3e-3, (0.5, 1.0, 2.0))
    assert grid == pytest.approx([1.5e-3, 3e-3, 6e-3])
    points = [{"optimizer": "adamw", "lr": grid[0], "score": 2.2},
              {"optimizer": "adamw", "lr": grid[1], "score": 2.0},
              {"optimizer": "adamw", "lr": grid[2], "score": 2.1},
              {"optimizer": "gefen", "lr": grid[0], "score": 2.3},
              {"optimizer": "gefen", "lr": grid[1], "score": 1.9},
              {"optimizer": "gefen", "lr": grid[2], "score": 1.9},  # tie: the smaller LR
              {"optimizer": "muon", "lr": grid[0], "score": math.inf},
              {"optimizer": "muon", "lr": grid[1], "score": math.inf}]
    assert choose(points, "adamw", 1.0) == {"lr": grid[1], "score": 2.0, "chosen": True,
                                            "at_edge": False}
    assert choose(points, "gefen", 1.0)["lr"] == grid[1]
    assert choose(points, "muon", 7.0) == {"lr": 7.0, "score": math.inf, "at_edge": False,
                                           "chosen": False}
    rows = equal_lr(points, "gefen")
    assert [r["lr"] for r in rows] == grid
    assert rows[1]["vs_ref"] == pytest.approx(1.9 / 2.0 - 1)
    assert equal_lr(points, "muon")[0]["vs_ref"] is None


def test_presets_without_a_digits_task_refuse_it() -> None:
    from gefen_bench import cli

    parser, _, _ = cli.build_parser()
    from gefen_bench.train import _check_args

    args = parser.parse_args(["train", "--preset", "h200-1b", "--tasks", "digits-mlp"])
    with pytest.raises(argparse.ArgumentTypeError, match="h200-1b has no digits-mlp task"):
        _check_args(args)
    _, tasks, _, _ = _check_args(parser.parse_args(["train", "--preset", "h200-1b"]))
    assert tasks == ["lm"]
    _, tasks, _, _ = _check_args(parser.parse_args(["train"]))
    assert tasks == ["lm", "digits", "digits-mlp"]


def test_digits_splits_file_round_trip(tmp_path) -> None:
    from gefen_bench.data import digits_splits, load_digits_splits, save_digits_splits

    direct = digits_splits()
    loaded = load_digits_splits(save_digits_splits(tmp_path / "d.pt"))
    for name in ("x_train", "y_train", "x_val", "y_val", "x_test", "y_test"):
        assert torch.equal(getattr(direct, name), getattr(loaded, name)), name
    # 1797 images, stratified 60 / 15 / 25 (scikit-learn rounds the test share up).
    assert (len(loaded.y_train), len(loaded.y_val), len(loaded.y_test)) == (1077, 270, 450)
    torch.save({"x_train": torch.zeros(1)}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="does not hold digits splits"):
        load_digits_splits(tmp_path / "bad.pt")


def test_memory_meter_has_no_steady_peak_on_cpu() -> None:
    from gefen_bench.measure import MemoryMeter

    meter = MemoryMeter(torch.device("cpu"))
    meter.start()
    meter.mark_steady()
    out = meter.stop()
    assert out["steady_peak_bytes"] is None and out["peak_bytes"] >= out["peak_over_start_bytes"]


def _started_cuda_meter() -> tuple[Any, int]:
    """A started CUDA MemoryMeter and the bytes allocated before it started."""
    from gefen_bench.measure import MemoryMeter

    device = torch.device("cuda")
    base = torch.cuda.memory_allocated(device)
    meter = MemoryMeter(device)
    meter.start()
    return meter, base


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_memory_meter_steady_peak_excludes_the_first_step() -> None:
    """The steady peak is what the steps after mark_steady() allocate; the peak is the whole
    region's."""
    meter, base = _started_cuda_meter()
    device = torch.device("cuda")
    first = torch.empty(64 << 20, dtype=torch.uint8, device=device)
    del first
    meter.mark_steady()
    later = torch.empty(16 << 20, dtype=torch.uint8, device=device)
    out = meter.stop()
    del later
    assert out["peak_over_start_bytes"] >= 64 << 20
    assert 16 << 20 <= out["steady_peak_bytes"] - base < 64 << 20


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_memory_meter_leaves_paused_regions_out_of_both_peaks() -> None:
    """What runs inside paused() (evaluation) counts in neither peak; what ran before a pause
    still does."""
    meter, base = _started_cuda_meter()
    device = torch.device("cuda")
    first = torch.empty(32 << 20, dtype=torch.uint8, device=device)
    del first
    with meter.paused():
        big = torch.empty(256 << 20, dtype=torch.uint8, device=device)
        del big
    meter.mark_steady()
    steady = torch.empty(16 << 20, dtype=torch.uint8, device=device)
    del steady
    with meter.paused():
        big = torch.empty(256 << 20, dtype=torch.uint8, device=device)
        del big
    out = meter.stop()
    assert 32 << 20 <= out["peak_bytes"] - base < 256 << 20
    assert 16 << 20 <= out["steady_peak_bytes"] - base < 32 << 20


def test_reports_record_the_variables_that_change_what_they_measure(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Graph replay (``GEFEN_CUDA_GRAPHS``) and the kernel caches change a step's figures
    without appearing on the command line, so ``meta`` records them; other variables stay out."""
    from gefen_bench.report import run_metadata

    monkeypatch.setenv("GEFEN_CUDA_GRAPHS", "1")
    monkeypatch.setenv("TRITON_CACHE_DIR", "/tmp/cold")
    monkeypatch.setenv("CC", "gcc-13")
    monkeypatch.setenv("CCACHE_DIR", "/tmp/ccache")
    monkeypatch.setenv("HOME_TOKEN_NOT_RECORDED", "y")
    env = run_metadata(argv=["gefen-bench", "step"])["environment"]
    assert env["GEFEN_CUDA_GRAPHS"] == "1" and env["TRITON_CACHE_DIR"] == "/tmp/cold"
    assert env["CC"] == "gcc-13"
    assert "HOME_TOKEN_NOT_RECORDED" not in env and "CCACHE_DIR" not in env


def test_checkpointing_is_enabled_through_the_api_that_does_not_warn() -> None:
    """``enable_checkpointing`` turns activation checkpointing on with the transformers API
    that has no deprecation warning (``activation_checkpointing_enable`` in 5.x, whose older
    name warns that v6 removes it)."""
    import warnings

    from gefen_bench.models import byte_llama, enable_checkpointing
    from gefen_bench.presets import get_preset

    model = byte_llama(get_preset("tiny").lm)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        enable_checkpointing(model)
    flag = getattr(model, "is_activation_checkpointing", None)
    assert flag if flag is not None else model.is_gradient_checkpointing
