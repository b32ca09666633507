"""Import of checkpoints written by the published gefen 1.2.3 and gefen-x 0.5.0.

The fixtures under ``fixtures/legacy/`` are real files written by those packages
(``make_legacy_fixtures.py`` beside this file; ``fixtures/legacy/README.md`` has the commands).
Three kinds of test:

1. conversion of the fixtures: every legacy key lands under its native name with the same
   dtype, shape and bits (expectations written here from the legacy layout,
   docs/algorithm.md#legacy-import, and contracts.md);
2. malformed or unimportable legacy inputs are refused with a ValueError that says why;
3. end to end: ``gefen_core.Gefen`` loads the raw checkpoint file, replays the saved
   continuation gradients, and lands within a tolerance derived below of the parameters the
   original package reached from the same checkpoint.
"""

from __future__ import annotations

import copy
import io
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from gefen_core.legacy import (
    LegacyCheckpointError,
    convert_legacy_state_dict,
    is_legacy_state_dict,
)

FIXTURES = Path(__file__).parent / "fixtures" / "legacy"
CASES = [
    "gefen-1.2.3",
    "gefen-x-0.5.0-factored",
    "gefen-x-0.5.0-block",
    "gefen-x-0.5.0-fsdp2-world1",
]
U = 2.0**-24  # unit roundoff of fp32


def _manifest(case: str) -> dict[str, Any]:
    return json.loads((FIXTURES / case / "manifest.json").read_text())


def _load(case: str, name: str, weights_only: bool = True) -> Any:
    return torch.load(FIXTURES / case / name, weights_only=weights_only, map_location="cpu")


def _saved_state(case: str) -> dict[str, Any]:
    m = _manifest(case)
    return _load(case, f"state_step{m['save_step']}.pt")


def _plain_view(sd: dict[str, Any]) -> tuple[dict[Any, Any], torch.Tensor | None, int]:
    """(per-parameter states, codebook, global step) of a legacy dict.

    gefen-x 0.5.x with FSDP2 writes the rank-local form (docs/algorithm.md#legacy-import): the
    states of rank r are ``torch.save`` bytes in ``state[first]["_gefen_rank_local_payload_<r>"]``,
    in the order of the saved ids. Decoded here independently of the code under test.
    """
    first = next(iter(sd["state"].values()), {})
    if "_gefen_rank_local_payload_0" in first:
        blob = first["_gefen_rank_local_payload_0"]
        payload = torch.load(io.BytesIO(blob.numpy().tobytes()), weights_only=True)
        states = dict(zip(sd["state"], payload["states"]))
        return states, payload["codebook"], payload["global_step"]
    return sd["state"], sd["gefen_codebook"], sd["gefen_global_step"]


def _snapshot(obj: Any) -> Any:
    """A deep copy that compares tensors by value, to prove the input is not mutated."""
    return copy.deepcopy(obj)


def _assert_same_tree(a: Any, b: Any, path: str = "sd") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), path
        for k in a:
            _assert_same_tree(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same_tree(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def _is_count_tensor(t: Any, value: int) -> bool:
    return (
        isinstance(t, torch.Tensor)
        and t.dtype == torch.float32
        and t.dim() == 0
        and t.device.type == "cpu"
        and float(t) == float(value)
    )


# ------------------------------------------------------------------------ 1. conversion
@pytest.mark.parametrize("case", [*CASES, "gefen-x-0.5.0-fsdp2-world2"])
def test_fixture_files_are_small_and_load_with_weights_only(case: str) -> None:
    m = _manifest(case)
    for name in m["files"]:
        path = FIXTURES / case / name
        assert path.stat().st_size < 200_000, name
        # Both releases save only tensors, ints, floats, bools, strings, tuples, lists and
        # dicts, so torch's safe loader accepts the raw files; the unrestricted loader must
        # give the same content.
        safe = torch.load(path, weights_only=True)
        _assert_same_tree(safe, torch.load(path, weights_only=False))
    assert m["weights_only_load_ok"] is True


@pytest.mark.parametrize("case", CASES)
def test_fixtures_are_recognised_as_legacy(case: str) -> None:
    assert is_legacy_state_dict(_saved_state(case))
    m = _manifest(case)
    assert is_legacy_state_dict(_load(case, f"state_step{m['save_step'] + m['continue_steps']}.pt"))


def test_native_and_foreign_dicts_are_not_legacy() -> None:
    native = {
        "state": {
            0: {
                "step": torch.tensor(1.0),
                "period": 4,
                "exp_avg_codes": torch.zeros(2, 4, dtype=torch.uint8),
                "exp_avg_scale": torch.zeros(2, 1),
                "exp_avg_sq": torch.zeros(2, 1),
                "exp_avg_sq_step": torch.tensor(1.0),
            }
        },
        "param_groups": [{"params": [0], "lr": 1e-3, "betas": (0.9, 0.999)}],
        "gefen_meta": {
            "format_version": 1,
            "global_step": 1,
            "codebook": None,
            "deterministic": False,
        },
    }
    assert not is_legacy_state_dict(native)
    p = torch.nn.Parameter(torch.ones(3))
    adamw = torch.optim.AdamW([p])
    p.grad = torch.ones(3)
    adamw.step()
    assert not is_legacy_state_dict(adamw.state_dict())
    assert not is_legacy_state_dict(None)
    assert not is_legacy_state_dict([1, 2])


@pytest.mark.parametrize("case", CASES)
def test_conversion_preserves_every_value(case: str) -> None:
    m = _manifest(case)
    sd = _saved_state(case)
    before = _snapshot(sd)
    out = convert_legacy_state_dict(sd)
    _assert_same_tree(sd, before)  # the input is not mutated

    legacy_state, codebook, global_step = _plain_view(sd)
    meta = out["gefen_meta"]
    assert meta["format_version"] == 1
    assert meta["global_step"] == m["save_step"] == global_step == sd["gefen_global_step"]
    assert meta["deterministic"] is False
    assert meta["codebook"].dtype == torch.float32 and torch.equal(meta["codebook"], codebook)
    assert not {"gefen_codebook", "gefen_global_step", "gefen_deterministic"} & set(out)

    assert set(out["state"]) == {i for i, e in legacy_state.items() if set(e) - {"name"}}, (
        "name-only entries are dropped"
    )
    for i, old in legacy_state.items():
        if set(old) == {"name"}:
            continue
        new = out["state"][i]
        expected_keys = {"period", "step", "exp_avg_codes", "exp_avg_scale", "exp_avg_sq_step"}
        expected_keys |= {"exp_avg_sq_row", "exp_avg_sq_col"} if "v_row" in old else {"exp_avg_sq"}
        assert set(new) == expected_keys, i
        assert new["period"] == old["automatic_period"] and type(new["period"]) is int
        assert _is_count_tensor(new["step"], old["step"])
        age = old.get("vmean_step", old.get("factored_step", old["step"]))
        assert _is_count_tensor(new["exp_avg_sq_step"], age)
        codes = new["exp_avg_codes"]
        assert codes.dtype == torch.uint8 and torch.equal(codes, old["m_codebook"])
        blocks = codes.numel() // new["period"]
        assert tuple(codes.shape) == (blocks, new["period"])
        scale = new["exp_avg_scale"]
        assert scale.dtype == torch.float32 and tuple(scale.shape) == (blocks, 1)
        d = old.get("period_one_divisor", 1) if old["automatic_period"] == 1 else 1
        for b in range(blocks):  # gefen 1.2.x P = 1: one legacy scale per d elements
            assert scale[b, 0].item() == old["m_magnitude"][b // d, 0].item()
        # The dequantised momentum c[q] * s is bit-identical to the legacy one.
        legacy_scale = old["m_magnitude"].repeat_interleave(d, dim=0)
        assert torch.equal(
            codebook[codes.long()] * scale, codebook[old["m_codebook"].long()] * legacy_scale
        )
        for legacy_key, native_key in (
            ("vmean", "exp_avg_sq"),
            ("v_row", "exp_avg_sq_row"),
            ("v_col", "exp_avg_sq_col"),
        ):
            if legacy_key in old:
                assert new[native_key].dtype == torch.float32
                assert torch.equal(new[native_key], old[legacy_key])

    assert len(out["param_groups"]) == len(sd["param_groups"])
    for old_g, new_g in zip(sd["param_groups"], out["param_groups"]):
        assert new_g["betas"] == (old_g["beta1"], old_g["beta2"])
        assert not {"beta1", "beta2", "_gefen_checkpoint_metadata"} & set(new_g)
        for key in ("params", "lr", "eps", "weight_decay"):
            assert new_g[key] == old_g[key]
        assert new_g["param_names"] == old_g.get("param_names", [old_g.get("name")])
        _assert_same_tree(new_g["gefen_meta"], meta)


def test_gefen_123_layout_is_one_group_per_parameter() -> None:
    m = _manifest("gefen-1.2.3")
    out = convert_legacy_state_dict(_saved_state("gefen-1.2.3"))
    groups = out["param_groups"]
    assert [g["params"] for g in groups] == [[i] for i in range(len(m["param_order"]))]
    assert [g["name"] for g in groups] == m["param_order"]
    # gefen 1.2.x kept P = 1 momentum scales in groups of d (docs/algorithm.md#legacy-import);
    # fc1.bias is one group.
    old = _saved_state("gefen-1.2.3")["state"][1]
    assert old["automatic_period"] == 1 and old["period_one_divisor"] == 16
    assert tuple(out["state"][1]["exp_avg_scale"].shape) == (16, 1)


def _legacy_entry(dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    return {
        "automatic_period": 4,
        "step": 2,
        "m_codebook_shape": (2, 4),
        "m_codebook": torch.tensor([[0, 255, 3, 7], [9, 1, 0, 128]], dtype=torch.uint8),
        "m_magnitude": torch.tensor([[0.5], [0.25]], dtype=dtype),
        "vmean": torch.tensor([[1e-3], [3e-4]], dtype=dtype),
    }


def _codebook() -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, 256, dtype=torch.float32)


def _legacy_123(entry: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "state": {0: entry if entry is not None else _legacy_entry()},
        "param_groups": [
            {
                "name": "w",
                "lr": 1e-3,
                "beta1": 0.9,
                "beta2": 0.999,
                "eps": 1e-8,
                "weight_decay": 0.0,
                "params": [0],
            }
        ],
        "gefen_global_step": 2,
        "gefen_codebook": _codebook(),
    }


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_statistics_of_gefen_123_are_widened_exactly(dtype: torch.dtype) -> None:
    sd = _legacy_123(_legacy_entry(dtype))
    out = convert_legacy_state_dict(sd)
    new = out["state"][0]
    for old_key, key in (("m_magnitude", "exp_avg_scale"), ("vmean", "exp_avg_sq")):
        assert new[key].dtype == torch.float32
        assert torch.equal(new[key].to(dtype), sd["state"][0][old_key])
    assert sd["state"][0]["m_magnitude"].dtype == dtype
    assert _is_count_tensor(new["exp_avg_sq_step"], 2)  # 1.2.x: vmean is as old as step
    assert out["gefen_meta"]["deterministic"] is False  # untagged: the default
    untagged = convert_legacy_state_dict(sd, deterministic_if_untagged=True)
    assert untagged["gefen_meta"]["deterministic"] is True


def test_capturable_tensor_counters_become_cpu_fp32() -> None:
    entry = _legacy_entry()
    entry["step"] = torch.tensor(7.0)
    entry["vmean_step"] = torch.tensor(5.0)
    new = convert_legacy_state_dict(_legacy_123(entry))["state"][0]
    assert _is_count_tensor(new["step"], 7) and _is_count_tensor(new["exp_avg_sq_step"], 5)


@pytest.mark.parametrize("prefer_factored", [True, False])
def test_both_second_moments_keep_one_complete_form(prefer_factored: bool) -> None:
    entry = _legacy_entry()
    entry.update(
        {
            "v_row": torch.ones(2),
            "v_col": torch.full((4,), 2.0),
            "factored_step": 3,
            "vmean_step": 9,
        }
    )
    new = convert_legacy_state_dict(_legacy_123(entry), prefer_factored=prefer_factored)
    new = new["state"][0]
    if prefer_factored:
        assert {"exp_avg_sq_row", "exp_avg_sq_col"} <= set(new) and "exp_avg_sq" not in new
        assert _is_count_tensor(new["exp_avg_sq_step"], 3)
    else:
        assert "exp_avg_sq" in new and "exp_avg_sq_row" not in new
        assert _is_count_tensor(new["exp_avg_sq_step"], 9)


# ------------------------------------------------------------------ 2. refused inputs
def _gefenx_sd() -> dict[str, Any]:
    return _saved_state("gefen-x-0.5.0-factored")


WORLD2 = "gefen-x-0.5.0-fsdp2-world2"


def _fsdp2_world2() -> dict[str, Any]:
    """A real two-rank FSDP2 checkpoint of gefen-x 0.5.0 (rank-local form,
    docs/algorithm.md#legacy-import)."""
    return _load(WORLD2, f"state_step{_manifest(WORLD2)['save_step']}.pt")


def _with_group_meta(sd: dict[str, Any], **changes: Any) -> dict[str, Any]:
    groups = []
    for g in sd["param_groups"]:
        g = dict(g)
        g["_gefen_checkpoint_metadata"] = {**g["_gefen_checkpoint_metadata"], **changes}
        groups.append(g)
    return {**sd, "param_groups": groups}


def _with_entry(sd: dict[str, Any], index: int, **changes: Any) -> dict[str, Any]:
    state = dict(sd["state"])
    entry = dict(state[index])
    for k, v in changes.items():
        if v is None:
            entry.pop(k, None)
        else:
            entry[k] = v
    state[index] = entry
    return {**sd, "state": state}


def _bad_inputs() -> list[tuple[str, Any, str]]:
    sd = _gefenx_sd()
    old = _saved_state("gefen-1.2.3")
    two_groups = {
        **sd,
        "param_groups": [dict(sd["param_groups"][0]), dict(sd["param_groups"][0], params=[])],
    }
    del two_groups["param_groups"][1]["_gefen_checkpoint_metadata"]
    other_codebook = _with_group_meta(sd, codebook=_codebook())
    return [
        ("not a dict", [1, 2], "expected a dict"),
        ("no param_groups", {"state": {}, "gefen_global_step": 0}, "missing"),
        ("two-rank FSDP2 payload", _fsdp2_world2(), "same topology"),
        (
            "distributed Muon manifest",
            {**sd, "gefen_muon_distributed": {"version": 2}},
            "GefenMuon",
        ),
        (
            "distributed Muon marker in groups",
            _with_group_meta(sd, muon_distributed_state={"version": 2}),
            "GefenMuon",
        ),
        (
            "NorMuon state",
            _with_entry(sd, 1, normuon_v=torch.zeros(1, 1), normuon_step=1),
            "GefenMuon",
        ),
        (
            "unknown format_version",
            _with_group_meta(sd, format_version=4),
            "unknown metadata format_version 4",
        ),
        ("metadata on some groups only", two_groups, "present on 1 of 2"),
        ("top-level and group codebooks disagree", other_codebook, "disagree"),
        ("top-level and group steps disagree", {**sd, "gefen_global_step": 99}, "disagree"),
        ("codes without a codebook", {**old, "gefen_codebook": None}, "no codebook"),
        ("negative step", _with_entry(old, 0, step=-1), "integer >= 0"),
        ("fractional step", _with_entry(old, 0, step=torch.tensor(1.5)), "integer >= 0"),
        ("bool step", _with_entry(old, 0, step=True), "must be a number"),
        ("zero period", _with_entry(old, 0, automatic_period=0), "positive int"),
        (
            "inconsistent period_one_divisor",
            _with_entry(old, 1, period_one_divisor=3),
            "period_one_divisor",
        ),
        ("unknown state key", _with_entry(old, 0, exp_avg=torch.zeros(3)), "neither"),
        (
            "native key mixed in",
            _with_entry(old, 0, exp_avg_codes=torch.zeros(1)),
            "mixes native keys",
        ),
        ("native meta mixed in", {**old, "gefen_meta": {}}, "mixes the native"),
        (
            "beta1 without beta2",
            {
                **old,
                "param_groups": [
                    {k: v for k, v in g.items() if k != "beta2"} for g in old["param_groups"]
                ],
            },
            "beta1/beta2",
        ),
        ("vmean_step without vmean", _with_entry(sd, 1, vmean=None), "without vmean"),
        (
            "GefenDCPState payload",
            {"format_version": torch.tensor(2), "slot_count": 1},
            "GefenDCPState",
        ),
        (
            "GefenMuonHybrid dict",
            {"muon": None, "backup": sd, "backup_optimizer": "gefen"},
            "GefenMuonHybrid",
        ),
    ]


@pytest.mark.parametrize("label,sd,match", _bad_inputs(), ids=[b[0] for b in _bad_inputs()])
def test_unimportable_legacy_inputs_are_refused(label: str, sd: Any, match: str) -> None:
    before = _snapshot(sd)
    with pytest.raises(LegacyCheckpointError, match=match) as info:
        convert_legacy_state_dict(sd)
    assert isinstance(info.value, ValueError)
    _assert_same_tree(sd, before)


def test_rank_local_refusal_says_how_to_migrate() -> None:
    sd = _fsdp2_world2()
    md = sd["param_groups"][0]["_gefen_checkpoint_metadata"]
    assert md["rank_local_sharded_state"]["world_size"] == 2
    with pytest.raises(ValueError) as info:
        convert_legacy_state_dict(sd)
    msg = str(info.value)
    assert "rank-local" in msg and "same topology" in msg and "single process" in msg
    assert "GefenDCPState" in msg


def test_the_migration_route_for_multi_rank_checkpoints_imports() -> None:
    """The route the refusal names, run with gefen-x 0.5.0 itself (see the fixture script):
    GefenDCPState save on 2 ranks, load in one process, state_dict(). gefen-core imports the
    result, and its momentum is the two ranks' momentum up to one re-quantisation."""
    from gefen_core import Gefen

    m = _manifest(WORLD2)
    start = _load(WORLD2, f"params_step{m['save_step']}.pt")
    params = {n: torch.nn.Parameter(start[n].clone()) for n in m["param_order"]}
    kwargs = dict(m["hyperparameters"], betas=tuple(m["hyperparameters"]["betas"]))
    opt = Gefen(list(params.items()), **kwargs)
    opt.load_state_dict(_load(WORLD2, "state_world1_from_dcp.pt"))
    codebook = opt.state_dict()["gefen_meta"]["codebook"].double()
    max_gap = (codebook[1:] - codebook[:-1]).max().item()

    # The two ranks' dense momentum c[q] * s, shard by shard along dim 0 (Shard(0)).
    sd = _fsdp2_world2()
    shards = []
    for key in ("_gefen_rank_local_payload_0", "_gefen_rank_local_payload_1"):
        blob = sd["state"][0][key]
        shards.append(torch.load(io.BytesIO(blob.numpy().tobytes()), weights_only=True))
    for i, name in enumerate(m["param_order"]):
        parts = []
        for payload in shards:
            st = payload["states"][i]
            assert st["name"] == name
            c = payload["codebook"].double()
            dense = c[st["m_codebook"].long()] * st["m_magnitude"].double()
            assert payload["signature"][i]["name"] == name
            rows = payload["signature"][i]["local_shape"]
            parts.append(dense.reshape(rows))
        expected = torch.cat(parts, dim=0).reshape(-1)
        st = opt.state[params[name]]
        scale = st["exp_avg_scale"].double()
        got = (codebook[st["exp_avg_codes"].long()] * scale).reshape(-1)
        # Re-blocking quantises each new block once: error <= half the largest gap times
        # the new block's scale (plus fp32 rounding of the dequantised inputs).
        bound = (max_gap / 2 + 4 * U) * scale.expand(-1, st["period"]).reshape(-1) + 4 * U * (
            expected.abs()
        )
        assert ((got - expected).abs() <= bound).all(), name


# ------------------------------------------------------------------ 3. end to end
#
# Tolerance. Both runs start from bit-identical state (the converted checkpoint) and see
# bit-identical gradients, so they differ only through floating-point rounding and through
# whatever the rounding does to the nearest-codeword choice. The bound below propagates
# those differences step by step, per element, from quantities of the gefen-core run
# (recomputed here in float64 from its state, which the test reads under the contract's
# keys), the codebook and fp32's unit roundoff u = 2^-24:
#
# * Second moment. Both runs compute the same EMA of mean squares; they differ by the order
#   of the fp32 sums (at most n·u relative for n positive terms: n = P per block, R + C per
#   factored row/column) and by how 1 - beta2 is formed: the published packages pass
#   f32(1 - beta2), gefen-core forms 1 - f32(beta2) in fp32 (docs/algorithm.md#block-second-moment's
#   canonical rounding). delta(beta) below is that relative coefficient difference (1.3e-5 for beta2
#   = 0.999, i.e. ~200 ulp: the largest systematic term). A convex EMA keeps a relative error, so
#   |dv|/v <= k·delta(beta2) + (n + 3m)u (k = 3 for the factored r·k/mean(r), n = P per
#   block or 2(R + C) factored, over m steps), and the step size sigma ~ v^-1/2 gets half
#   of it plus the roundings of the bias corrections, root, reciprocal and products:
#   rho_sigma = k·delta(beta2)/2 + (n + 9m + 40)u (deliberately generous, still ~1e-5).
# * Momentum before quantisation, m = beta1·(s·c[q]) + (1 - beta1)·g: the two runs differ by
#   beta1 times the previous re-quantised momentum difference E plus (4u + delta(beta1))
#   times the magnitude of the terms (lerp versus the separately rounded form). The block
#   scale s' = max|m| then differs by at most the largest of those (|max|a| - max|b|| <=
#   max|a - b|).
# * Nearest codeword: where z = m / s' is farther from every decision boundary (codeword
#   midpoint) than its possible difference between the runs, both pick the same code and
#   m_hat = c[q]·s' differs only through s'. Otherwise (a near tie) the codes may differ,
#   and |m_hat - m_hat'| <= |m - m'| + half the largest codebook gap over the uncertainty
#   interval times each side's scale.
# * gefen 1.2.x at P = 1 kept one momentum scale per d elements (docs/algorithm.md#legacy-import);
# gefen-core keeps
#   that parameter's momentum per element after import (exact at P = 1), so from the first
#   continuation step the difference is the package's own quantisation error, bounded as
#   for a near tie (scale: the legacy group's max |m|, gefen-core side exact).
# * Parameter: theta <- f(theta·omega) - lr·sigma·m_hat with omega = 1 - lr·wd, two fp32
#   roundings per run (<= 4u|theta| apart) plus lr·|sigma·m_hat - sigma'·m_hat'|.
#
# Steps without a gradient change nothing in either run. The bound is checked element by
# element; a separate check proves it is tight enough to catch a wrong hyperparameter. On
# the fixtures it comes out 2-50x the measured differences (at most 2.7e-7 where the block
# geometry is shared, after parameters moved by ~1e-2).


def _delta(beta: float) -> float:
    """Relative difference of the EMA coefficients between f32(1-beta) and 1-f32(beta)."""
    f = torch.tensor
    b32 = f(beta, dtype=torch.float32).double().item()
    one_minus_b32 = f(1.0 - b32, dtype=torch.float32).double().item()  # gefen-core
    w = f(1.0 - beta, dtype=torch.float32).double().item()  # the published packages
    return max(abs(one_minus_b32 - w) / w, abs(b32 - (1.0 - w)) / beta)


def _boundaries(codebook: torch.Tensor) -> torch.Tensor:
    c = codebook.double()
    return (c[1:] + c[:-1]) / 2


def _max_gap_near(z: torch.Tensor, r: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Largest codebook gap among the brackets that [z - r, z + r] touches (float64)."""
    c = codebook.double()
    gaps = c[1:] - c[:-1]
    lo = torch.searchsorted(c, (z - r).clamp(-1, 1), right=True).clamp(1, 255) - 1
    hi = torch.searchsorted(c, (z + r).clamp(-1, 1), right=False).clamp(1, 255) - 1
    idx = torch.arange(255, dtype=torch.long)
    mask = (idx[None, :] >= lo.reshape(-1, 1)) & (idx[None, :] <= hi.reshape(-1, 1))
    return torch.where(mask, gaps[None, :], torch.zeros(())).amax(dim=1).reshape(z.shape)


class _BoundTracker:
    """Propagates the per-element bound on |theta_gefen_core - theta_package| (see above)."""

    def __init__(
        self,
        name: str,
        shape: tuple[int, ...],
        legacy_entry: dict[str, Any] | None,
        codebook: torch.Tensor,
        hyper: dict[str, Any],
        factored: bool,
        continue_steps: int,
    ) -> None:
        self.name, self.shape, self.numel = name, shape, math.prod(shape)
        self.codebook = codebook
        self.lr, self.wd, self.eps = hyper["lr"], hyper["weight_decay"], hyper["eps"]
        self.beta1, self.beta2 = hyper["betas"]
        self.factored = factored and len(shape) == 2
        self.m = continue_steps
        self.E = torch.zeros(self.numel, dtype=torch.float64)  # |m_hat - m_hat'|
        self.D = torch.zeros(self.numel, dtype=torch.float64)  # |theta - theta'|
        self.group = 0  # legacy scale group size when it differs from gefen-core's (1.2.x)
        if legacy_entry is not None and legacy_entry.get("automatic_period") == 1:
            d = legacy_entry.get("period_one_divisor", 1)
            self.group = d if d > 1 else 0
        self.near_tie_elements = 0

    def rho_sigma(self, period: int) -> float:
        if self.factored:
            n, k = 2 * sum(self.shape), 3
        else:
            n, k = period, 1
        return k * _delta(self.beta2) / 2 + (n + 9 * self.m + 40) * U

    def step(
        self,
        pre: dict[str, Any] | None,
        post: dict[str, Any],
        grad: torch.Tensor,
        theta: torch.Tensor,
    ) -> None:
        c = self.codebook.double()
        period = post["period"]
        g = grad.double().reshape(-1)
        if pre is not None and "exp_avg_codes" in pre:
            old = (c[pre["exp_avg_codes"].long()] * pre["exp_avg_scale"].double()).reshape(-1)
        else:
            old = torch.zeros_like(g)
        b1 = self.beta1
        m = b1 * old + (1 - b1) * g  # this step's momentum before quantisation (float64)
        terms = b1 * old.abs() + (1 - b1) * g.abs()
        dm = b1 * self.E + (4 * U + _delta(b1)) * terms
        new_side_exact = self.group > 0 or period == 1
        geo = self.group if self.group > 0 else period  # blocks in which a scale is shared
        mb, dmb = m.reshape(-1, geo), dm.reshape(-1, geo)
        s = mb.abs().amax(dim=1, keepdim=True)
        ds = dmb.amax(dim=1, keepdim=True)
        safe = torch.where(s > ds, s - ds, torch.full_like(s, float("inf")))
        z = torch.where(s > 0, mb / torch.where(s > 0, s, 1.0), 0.0)
        r = (dmb + z.abs() * ds) / safe + 4 * U * terms.reshape(-1, geo) / safe
        r = torch.where(s > ds, r, torch.full_like(r, 2.0))  # scale itself uncertain: anything
        dist = (z.reshape(-1, 1) - _boundaries(self.codebook)[None, :]).abs().amin(dim=1)
        tie = (dist.reshape(z.shape) <= r) | (self.group > 0)
        if period == 1 and self.group == 0:
            tie = torch.zeros_like(tie)  # both runs exact at P = 1: codes are +-1 (or 0)
        gap = _max_gap_near(z, r, self.codebook)
        q_new = torch.zeros_like(gap) if new_side_exact else gap / 2 * s
        q_old = gap / 2 * (s + ds)
        e_tie = dmb + q_new + q_old
        mhat = (c[post["exp_avg_codes"].long()] * post["exp_avg_scale"].double()).reshape(-1)
        e_clean = (
            (mhat.abs().reshape(-1, geo) / torch.where(s > 0, s, 1.0)) * ds
            + U * mhat.abs().reshape(-1, geo)
            + dmb * (s == 0)
        )
        self.E = torch.where(tie, e_tie, e_clean).reshape(-1)
        self.near_tie_elements += int(tie.sum())

        sigma = self._sigma(post)
        rho = self.rho_sigma(period)
        omega = 1.0 - self.lr * self.wd
        self.D = (
            omega * self.D
            + self.lr * (sigma * self.E + rho * sigma * (mhat.abs() + self.E))
            + 3 * U * self.lr * sigma * mhat.abs()
            + 4 * U * theta.double().abs().reshape(-1)
        )

    def _sigma(self, post: dict[str, Any]) -> torch.Tensor:
        b1 = 1 - self.beta1 ** float(post["step"])
        b2 = 1 - self.beta2 ** float(post["exp_avg_sq_step"])
        if self.factored:
            row = post["exp_avg_sq_row"].double()
            col = post["exp_avg_sq_col"].double()
            rbar = max(row.mean().item(), torch.finfo(torch.float32).tiny)
            v = (row[:, None] * col[None, :] / rbar).reshape(-1)
        else:
            v = post["exp_avg_sq"].double().expand(-1, post["period"]).reshape(-1)
        return (1 / b1) / ((v / b2).sqrt() + self.eps)


def _snapshot_state(st: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in st.items()}


def _run_continuation(case: str, **group_override: Any) -> dict[str, Any]:
    """Load the raw legacy file into gefen_core.Gefen and replay the saved gradients.

    ``group_override`` is written into every parameter group after the load (a load restores
    the checkpoint's hyperparameters, as in torch.optim), to run deliberately wrong settings.
    """
    from gefen_core import Gefen

    m = _manifest(case)
    k, steps = m["save_step"], m["continue_steps"]
    start = _load(case, f"params_step{k}.pt")
    grads = _load(case, "grads.pt")
    kwargs = dict(m["gefen_core_kwargs"])
    kwargs["betas"] = tuple(kwargs["betas"])
    params = {n: torch.nn.Parameter(start[n].clone()) for n in m["param_order"]}
    opt = Gefen(list(params.items()), **kwargs)
    raw = _load(case, f"state_step{k}.pt")
    opt.load_state_dict(raw)

    # Right after the load, gefen-core holds exactly the converted legacy state.
    converted = convert_legacy_state_dict(_load(case, f"state_step{k}.pt"))
    loaded = opt.state_dict()
    for i, entry in converted["state"].items():
        for key, value in entry.items():
            got = loaded["state"][i][key]
            if isinstance(value, torch.Tensor):
                assert got.dtype == value.dtype and torch.equal(got.cpu(), value), (i, key)
            else:
                assert got == value, (i, key)
    raw_state, codebook, global_step = _plain_view(raw)
    assert torch.equal(loaded["gefen_meta"]["codebook"], codebook)
    assert loaded["gefen_meta"]["global_step"] == global_step

    for group in opt.param_groups:
        group.update(group_override)
    live_group = {id(p): g for g in opt.param_groups for p in g["params"]}
    trackers = {}
    for i, n in enumerate(m["param_order"]):
        g = live_group[id(params[n])]
        hyper = {key: g[key] for key in ("lr", "weight_decay", "eps", "betas")}
        assert hyper == {key: kwargs[key] for key in hyper} | group_override
        trackers[n] = _BoundTracker(
            n,
            tuple(params[n].shape),
            raw_state.get(i),
            codebook,
            hyper,
            kwargs["factored_v_2d"],
            steps,
        )
    for t in range(k, k + steps):
        step_grads = grads["steps"][t]
        pre = {
            n: _snapshot_state(opt.state[p]) if p in opt.state else None for n, p in params.items()
        }
        for n, p in params.items():
            p.grad = step_grads[n].clone() if n in step_grads else None
        opt.step()
        for n, p in params.items():
            if n in step_grads:
                trackers[n].step(pre[n], opt.state[p], step_grads[n], p.detach())
    return {
        "params": {n: p.detach().clone() for n, p in params.items()},
        "state": {n: opt.state[p] for n, p in params.items()},
        "trackers": trackers,
        "manifest": m,
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", CASES)
def test_continuation_matches_the_published_package(case: str) -> None:
    run = _run_continuation(case)
    m = run["manifest"]
    end = m["save_step"] + m["continue_steps"]
    reference = _load(case, f"params_step{end}.pt")
    reference_state = _plain_view(_load(case, f"state_step{end}.pt"))[0]
    start = _load(case, f"params_step{m['save_step']}.pt")
    tight_movement = tight_bound = 0.0
    for i, name in enumerate(m["param_order"]):
        got, want = run["params"][name], reference[name]
        tracker = run["trackers"][name]
        bound = tracker.D.reshape(want.shape)
        diff = (got.double() - want.double()).abs()
        worst = (diff - bound).max().item()
        assert worst <= 0, (
            f"{case} {name}: |gefen-core - package| exceeds the derived bound by {worst:.3e} "
            f"(max diff {diff.max().item():.3e}, max bound {bound.max().item():.3e})"
        )
        # Same block geometry as the package chose (also for a parameter whose first
        # gradient came after the checkpoint).
        legacy = reference_state[i]
        live = run["state"][name]
        assert tuple(live["exp_avg_codes"].shape) == tuple(legacy["m_codebook"].shape), name
        if tracker.group == 0:
            assert tuple(live["exp_avg_scale"].shape) == tuple(legacy["m_magnitude"].shape)
            tight_movement += (want.double() - start[name].double()).abs().sum().item()
            tight_bound += bound.sum().item()
        # The second moments depend on gradients only: the derived relative bound applies.
        for old_key, new_key in (
            ("vmean", "exp_avg_sq"),
            ("v_row", "exp_avg_sq_row"),
            ("v_col", "exp_avg_sq_col"),
        ):
            if old_key in legacy:
                k = 3 if tracker.factored else 1
                n = 2 * sum(tracker.shape) if tracker.factored else live["period"]
                rel = k * _delta(tracker.beta2) + (n + 3 * m["continue_steps"]) * U
                a, b = live[new_key].double(), legacy[old_key].double()
                assert ((a - b).abs() <= rel * b.abs()).all(), (case, name, new_key)
    # The bound has teeth: where both runs share a block geometry it is a small fraction of
    # how far the parameters moved, far below the effect of e.g. a wrong weight decay.
    assert tight_bound < 1e-3 * tight_movement, (tight_bound, tight_movement)


@pytest.mark.timeout(120)
def test_continuation_bound_catches_a_wrong_hyperparameter() -> None:
    """The same comparison fails when gefen-core runs with the wrong weight decay."""
    case = "gefen-1.2.3"
    m = _manifest(case)
    assert m["gefen_core_kwargs"]["weight_decay"] > 0
    run = _run_continuation(case, weight_decay=0.0)
    end = m["save_step"] + m["continue_steps"]
    reference = _load(case, f"params_step{end}.pt")
    exceeded = 0
    for name in m["param_order"]:
        bound = run["trackers"][name].D.reshape(reference[name].shape)
        diff = (run["params"][name].double() - reference[name].double()).abs()
        exceeded += int((diff > bound).sum())
    assert exceeded > 0


def test_untagged_gefen_123_checkpoint_loads_under_the_live_deterministic_flag() -> None:
    """docs/algorithm.md#deterministic: a checkpoint without a deterministic tag loads under the
    live optimizer's value."""
    from gefen_core import Gefen

    case = "gefen-1.2.3"
    m = _manifest(case)
    start = _load(case, f"params_step{m['save_step']}.pt")
    params = [(n, torch.nn.Parameter(start[n].clone())) for n in m["param_order"]]
    kwargs = dict(m["gefen_core_kwargs"], betas=tuple(m["gefen_core_kwargs"]["betas"]))
    opt = Gefen(params, deterministic=True, **kwargs)
    opt.load_state_dict(_saved_state(case))
    assert opt.state_dict()["gefen_meta"]["deterministic"] is True


def test_refused_legacy_load_leaves_the_optimizer_unchanged() -> None:
    from gefen_core import Gefen

    case = "gefen-x-0.5.0-factored"
    m = _manifest(case)
    start = _load(case, f"params_step{m['save_step']}.pt")
    params = [(n, torch.nn.Parameter(start[n].clone())) for n in m["param_order"]]
    kwargs = dict(m["gefen_core_kwargs"], betas=tuple(m["gefen_core_kwargs"]["betas"]))
    opt = Gefen(params, **kwargs)
    opt.load_state_dict(_saved_state(case))
    before = _snapshot(opt.state_dict())
    with pytest.raises(ValueError, match="rank-local"):
        opt.load_state_dict(_fsdp2_world2())
    _assert_same_tree(opt.state_dict(), before)


def _fsdp2_world1() -> dict[str, Any]:
    return _saved_state("gefen-x-0.5.0-fsdp2-world1")


def _repack_payload(sd: dict[str, Any], edit: Any) -> dict[str, Any]:
    """The one-rank checkpoint with its payload decoded, edited and re-encoded."""
    first = next(iter(sd["state"]))
    blob = sd["state"][first]["_gefen_rank_local_payload_0"]
    payload = torch.load(io.BytesIO(blob.numpy().tobytes()), weights_only=True)
    edit(payload)
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    new_blob = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8).clone()
    state = dict(sd["state"])
    state[first] = {**state[first], "_gefen_rank_local_payload_0": new_blob}
    return {**sd, "state": state}


def test_one_rank_fsdp2_checkpoint_is_a_real_rank_local_payload() -> None:
    sd = _fsdp2_world1()
    assert sd["gefen_codebook"] is None
    md = sd["param_groups"][0]["_gefen_checkpoint_metadata"]
    assert md["format_version"] == 3 and md["rank_local_sharded_state"]["world_size"] == 1
    states, codebook, _ = _plain_view(sd)
    assert codebook is not None and states[0]["name"] == "fc1.weight"
    assert all(
        set(e) <= {"name", "_gefen_rank_local_member", "_gefen_rank_local_payload_0"}
        for e in sd["state"].values()
    )


def test_unreadable_one_rank_payload_is_refused() -> None:
    sd = _fsdp2_world1()
    state = dict(sd["state"])
    state[0] = {**state[0], "_gefen_rank_local_payload_0": torch.arange(64, dtype=torch.uint8)}
    with pytest.raises(LegacyCheckpointError, match="cannot be read"):
        convert_legacy_state_dict({**sd, "state": state})


def test_one_rank_payload_in_the_wrong_order_is_refused() -> None:
    sd = _repack_payload(_fsdp2_world1(), lambda p: p["states"].reverse())
    with pytest.raises(LegacyCheckpointError, match="does not belong to parameter id"):
        convert_legacy_state_dict(sd)


def test_one_rank_payload_of_a_partial_shard_is_refused() -> None:
    def shrink(payload: dict[str, Any]) -> None:
        payload["signature"][0]["local_shape"] = [8, 32]

    with pytest.raises(LegacyCheckpointError, match="not the whole tensor"):
        convert_legacy_state_dict(_repack_payload(_fsdp2_world1(), shrink))
