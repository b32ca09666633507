"""State bytes per half of Muon-family optimizers (gefen-x issue #6, docs/algorithm.md#hybrid).

The expected byte counts are written from each optimizer's documented state layout, not
read back from the code under test: torch.optim.Muon keeps one fp32 ``momentum_buffer`` per
matrix; torch.optim.AdamW (for-loop/foreach) keeps fp32 ``exp_avg``/``exp_avg_sq`` and a
0-dim fp32 ``step`` per parameter; GefenMuon keeps uint8 codes (1 byte/element), one fp32
scale per block of ``period`` elements, a 0-dim fp32 ``step`` and, with NorMuon, an fp32
``[R, 1]`` row EMA and a 0-dim fp32 ``normuon_step``, plus one fp32 ``[256]`` codebook and,
once it has stepped, its step count as a 0-dim int64 CPU tensor (docs/compile.md).
"""

from __future__ import annotations

import json

import pytest
import torch

from gefen_bench import optimizers as registry
from gefen_bench.cli import main
from gefen_bench.param_sets import build_param_set, shapes_for
from gefen_bench.state_bytes import (
    optimizer_halves,
    state_bytes,
    state_bytes_by_half,
    state_bytes_per_param,
)

_CPU = torch.device("cpu")


def _named(dtype: torch.dtype = torch.float32) -> list[tuple[str, torch.nn.Parameter]]:
    return build_param_set(shapes_for("llama", "tiny"), device=_CPU, dtype=dtype)


def _numel(named: list[tuple[str, torch.nn.Parameter]]) -> int:
    return sum(p.numel() for _, p in named)


def _adamw_bytes(named: list[tuple[str, torch.nn.Parameter]]) -> int:
    return sum(2 * 4 * p.numel() + 4 for _, p in named)


def _step(opts: list[torch.optim.Optimizer], steps: int = 2) -> None:
    for _ in range(steps):
        for o in opts:
            o.step()


HAS_TORCH_MUON = hasattr(torch.optim, "Muon")
needs_torch_muon = pytest.mark.skipif(not HAS_TORCH_MUON,
                                      reason="torch.optim.Muon needs torch >= 2.9")


@needs_torch_muon
def test_torch_muon_halves_match_their_definitions_and_sum_to_the_whole() -> None:
    named = _named()
    params = [p for _, p in named]
    opts = registry.build("muon", named, lr=1e-3, weight_decay=0.0, device=_CPU)
    _step(opts)
    muon_named, rest = registry.split_for_muon(named)
    halves = state_bytes_by_half(opts, params)
    assert halves is not None
    assert halves["muon"]["numel"] == _numel(muon_named)
    assert halves["backup"]["numel"] == _numel(rest)
    assert halves["muon"]["state_bytes"] == 4 * _numel(muon_named)
    assert halves["muon"]["bytes_per_param"] == pytest.approx(4.0)
    # The bench's AdamW is fused on CPU; its state layout is the same as the for-loop one.
    assert halves["backup"]["state_bytes"] == _adamw_bytes(rest)
    assert halves["whole"]["state_bytes"] == state_bytes(opts, params)
    assert halves["muon"]["state_bytes"] + halves["backup"]["state_bytes"] \
        == halves["whole"]["state_bytes"]
    assert halves["halves_sum_bytes"] == halves["whole"]["state_bytes"]
    assert halves["unattributed_bytes"] == 0
    assert halves["whole"]["numel"] == _numel(named)


def _gefen_muon_bytes(muon) -> int:  # type: ignore[no-untyped-def]
    total = 256 * 4 + 8  # the codebook, the step count
    for group in muon.param_groups:
        for p in group["params"]:
            st = muon.state[p]
            period = int(st["period"])
            assert p.numel() % period == 0
            total += p.numel() + 4 * (p.numel() // period) + 4  # codes, scales, step
            if group["normuon"]:
                total += 4 * p.shape[0] + 4  # row EMA, normuon_step
    return total


def test_adamw_backup_hybrid_is_exactly_the_sum_of_its_halves() -> None:
    named = _named()
    params = [p for _, p in named]
    opts = registry.build("gefen-muon-hybrid-adamw", named, lr=1e-3, weight_decay=0.0,
                          device=_CPU)
    _step(opts)
    (hybrid,) = opts
    halves = state_bytes_by_half(opts, params)
    assert halves is not None
    muon_named, rest = registry.split_for_muon(named)
    # The hybrid's own routing sends the same tensors to each half as the bench's torch-Muon
    # split, so the two rows of the report compare like with like.
    assert {id(p) for g in hybrid.muon.param_groups for p in g["params"]} \
        == {id(p) for _, p in muon_named}
    assert halves["muon"]["state_bytes"] == _gefen_muon_bytes(hybrid.muon)
    assert halves["backup"]["state_bytes"] == _adamw_bytes(rest)
    assert halves["muon"]["state_bytes"] + halves["backup"]["state_bytes"] \
        == state_bytes(opts, params)
    assert halves["unattributed_bytes"] == 0
    whole_bpp = halves["whole"]["state_bytes"] / _numel(named)
    assert halves["whole"]["bytes_per_param"] == pytest.approx(whole_bpp, rel=1e-12)


def test_gefen_backup_hybrid_halves_sum_to_the_whole() -> None:
    named = _named()
    params = [p for _, p in named]
    opts = registry.build("gefen-muon-hybrid", named, lr=1e-3, weight_decay=0.0, device=_CPU)
    _step(opts)
    halves = state_bytes_by_half(opts, params)
    assert halves is not None
    (hybrid,) = opts
    assert halves["muon"]["state_bytes"] == _gefen_muon_bytes(hybrid.muon)
    assert halves["backup"]["state_bytes"] == state_bytes([hybrid.backup], params)
    assert halves["backup"]["state_bytes"] > 0
    assert halves["muon"]["state_bytes"] + halves["backup"]["state_bytes"] \
        == halves["whole"]["state_bytes"] == state_bytes(opts, params)


def test_non_muon_optimizers_have_no_halves() -> None:
    named = _named()
    params = [p for _, p in named]
    opts = registry.build("adamw", named, lr=1e-3, weight_decay=0.0, device=_CPU)
    _step(opts, 1)
    assert optimizer_halves(opts) is None
    assert state_bytes_by_half(opts, params) is None
    assert "halves" not in state_bytes_per_param(opts, params)


@needs_torch_muon
def test_halves_report_storage_shared_across_halves() -> None:
    a = torch.nn.Parameter(torch.zeros(4, 4))
    b = torch.nn.Parameter(torch.zeros(3))
    muon = torch.optim.Muon([a], lr=0.1)
    adamw = torch.optim.AdamW([b], lr=0.1)
    shared = torch.zeros(5, dtype=torch.float64)  # 40 bytes, held by both halves
    muon.state[a] = {"momentum_buffer": shared}
    adamw.state[b] = {"exp_avg": shared}
    halves = state_bytes_by_half([muon, adamw], [a, b])
    assert halves is not None
    assert halves["halves_sum_bytes"] == 80
    assert halves["whole"]["state_bytes"] == 40
    assert halves["unattributed_bytes"] == -40


@pytest.mark.timeout(300)
def test_step_cli_reports_state_per_half(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    main(["step", "--device", "cpu", "--scale", "tiny", "--models", "llama",
          "--optimizers", "muon,gefen-muon-hybrid-adamw", "--dtype", "float32",
          "--steps", "1", "--warmup", "0", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "state by half" in out
    report = json.loads((tmp_path / "step.json").read_text())
    rows = {r["optimizer"]: r for r in report["rows"]}
    names = ["muon", "gefen-muon-hybrid-adamw"] if HAS_TORCH_MUON else ["gefen-muon-hybrid-adamw"]
    assert set(rows) == set(names), report["failed"]
    if not HAS_TORCH_MUON:  # the floor torch: reported as skipped, not crashed
        assert "muon" in report["skipped"], report
    muon_named, rest = registry.split_for_muon(_named())
    for name in names:
        h = rows[name]["state_halves"]
        assert h["muon"]["numel"] == _numel(muon_named)
        assert h["backup"]["numel"] == _numel(rest)
        assert h["muon"]["state_bytes"] + h["backup"]["state_bytes"] \
            == h["whole"]["state_bytes"] == rows[name]["state_bytes"]
        assert rows[name]["state_bytes_per_param"] == pytest.approx(
            h["whole"]["state_bytes"] / rows[name]["params"], rel=1e-12)
    # Same backup tensors, same torch AdamW: the backup halves are byte-identical.
    assert rows["gefen-muon-hybrid-adamw"]["state_halves"]["backup"]["state_bytes"] \
        == _adamw_bytes(rest)
    if HAS_TORCH_MUON:
        assert rows["muon"]["state_halves"]["backup"]["state_bytes"] \
            == rows["gefen-muon-hybrid-adamw"]["state_halves"]["backup"]["state_bytes"]


def test_step_replot_draws_a_chart_from_saved_json(tmp_path) -> None:
    """``--replot`` measures nothing: it reads a saved ``step.json`` and writes ``step.png``;
    a JSON without measured rows is refused with an error naming the option."""
    row = {"model": "llama", "optimizer": "gefen", "step_ms_median": 19.5,
           "host_issue_ms_median": 6.3, "device_name": "test"}
    saved = {"device": "cuda", "dtype": "bfloat16", "scale": "full", "steps": 50,
             "rows": [row, {**row, "optimizer": "adamw-fused", "step_ms_median": 8.1}]}
    path = tmp_path / "step.json"
    path.write_text(json.dumps(saved))
    main(["step", "--replot", str(path)])
    png = (tmp_path / "step.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({**saved, "rows": []}))
    with pytest.raises(SystemExit):
        main(["step", "--replot", str(empty)])
    assert not (tmp_path / "empty.png").exists()


@pytest.mark.timeout(300)
def test_step_cold_cache_first_step_builds_its_kernels_in_a_fresh_process(tmp_path) -> None:
    """``--first-step cold-cache`` gives each (optimizer, model) its own process on new, empty
    kernel caches: Gefen's first step on the CPU finds no native step built and builds it
    (where this machine builds one), torch's AdamW writes nothing; ``warm-cache`` runs the same
    processes on the caches as they are and counts nothing."""
    import gefen_kernels

    native = gefen_kernels.cpu_step_status() == "native"
    main(["step", "--device", "cpu", "--scale", "tiny", "--models", "gpt2,llama",
          "--optimizers", "gefen,adamw-default", "--steps", "1", "--warmup", "0",
          "--first-step", "cold-cache", "--out", str(tmp_path / "cold")])
    report = json.loads((tmp_path / "cold" / "step.json").read_text())
    assert report["first_step"] == "cold-cache" and not report["failed"], report["failed"]
    rows = {(r["optimizer"], r["model"]): r for r in report["rows"]}
    assert set(rows) == {(o, m) for o in ("gefen", "adamw-default") for m in ("gpt2", "llama")}
    for (optimizer, _), row in rows.items():
        assert row["first_step_mode"] == "cold-cache"
        # Each model's process starts on empty caches, the second model's too.
        assert row["kernel_cache_files_before_first_step"] == 0
        built = row["kernel_cache_files_after_first_step"]
        assert built >= 1 if optimizer == "gefen" and native else built == 0
    main(["step", "--device", "cpu", "--scale", "tiny", "--models", "gpt2",
          "--optimizers", "gefen", "--steps", "1", "--warmup", "0",
          "--first-step", "warm-cache", "--out", str(tmp_path / "warm")])
    (row,) = json.loads((tmp_path / "warm" / "step.json").read_text())["rows"]
    assert row["first_step_mode"] == "warm-cache"
    assert row["kernel_cache_files_before_first_step"] is None
