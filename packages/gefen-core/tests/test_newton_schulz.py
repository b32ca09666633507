"""Newton–Schulz orthogonalisation (docs/algorithm.md#gefenmuon) against float64 math written
here."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gefen_core import newton_schulz as ns

# The schedules as printed in docs/algorithm.md#gefenmuon, typed in independently of the module.
SPEC = {
    "standard": [(3.4445, -4.7750, 2.0315)] * 5,
    "tuned3": [
        (5.0067, -14.4125, 10.6001),
        (3.7534, -6.8083, 3.3840),
        (3.2080, -4.3501, 2.0330),
    ],
    "tuned4": [
        (5.4261, -15.5285, 11.2657),
        (3.0766, -4.9701, 2.1297),
        (3.0008, -6.4486, 4.3696),
        (2.8386, -4.1421, 2.5758),
    ],
}

# bf16 keeps 8 significant bits (unit round-off 2**-9 ≈ 0.002). Each iteration rounds its
# GEMM results once (fused a·X + B·X), so singular values near 1 carry a few such roundings,
# amplified by the polynomial's slope; 0.02 is ~5 bf16 ulps at 1.0. (Rounding b·A and c·A·A
# separately pushes tuned4 to ~1.3 and fails this.)
BF16_SV_ALLOWANCE = 0.02


def compose(schedule, s):
    """Apply the scalar quintics of ``schedule`` to an array of singular values (float64)."""
    s = np.asarray(s, dtype=np.float64)
    for a, b, c in schedule:
        s = a * s + b * s**3 + c * s**5
    return s


def svd_reference(x: torch.Tensor, schedule, eps: float = 1e-7) -> torch.Tensor:
    """NS(x) from its definition on singular values: U · p(Σ / ‖x‖_F) · Vᵀ, in float64."""
    x = x.double()
    u, s, vh = torch.linalg.svd(x, full_matrices=False)
    norm = max(torch.linalg.norm(x).item(), eps)
    p = torch.from_numpy(compose(schedule, (s / norm).numpy()))
    return u @ torch.diag(p) @ vh


def band(schedule, lo=1e-2):
    """Range of the composed polynomial over normalised singular values in [lo, 1]."""
    out = compose(schedule, np.geomspace(lo, 1.0, 200_001))
    return out.min(), out.max()


def matrix_with_singular_values(rows, cols, s, seed=0):
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(rows, len(s), generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(cols, len(s), generator=g, dtype=torch.float64))
    return u @ torch.diag(torch.as_tensor(s, dtype=torch.float64)) @ v.T


# ---------------------------------------------------------------- schedule resolution


@pytest.mark.parametrize("name", ["tuned3", "tuned4"])
def test_named_schedules_have_the_specified_coefficients(name):
    assert ns.resolve_ns_schedule(name) == tuple(SPEC[name])


def test_standard_schedule_repeats_the_triple_ns_steps_times():
    assert ns.resolve_ns_schedule("standard") == tuple(SPEC["standard"])
    assert ns.resolve_ns_schedule(None) == tuple(SPEC["standard"])
    assert ns.resolve_ns_schedule("standard", ns_steps=3) == tuple(SPEC["standard"][:3])
    assert ns.resolve_ns_schedule(ns_coefficients=(1.5, -0.5, 0.0), ns_steps=2) == (
        (1.5, -0.5, 0.0),
    ) * 2


def test_explicit_lists_are_used_as_given():
    sched = [(1.5, -0.5, 0), (2, -1.5, 0.5)]
    expect = ((1.5, -0.5, 0.0), (2.0, -1.5, 0.5))
    assert ns.resolve_ns_schedule(sched) == expect
    # A list given as ns_coefficients ignores ns_steps.
    assert ns.resolve_ns_schedule(ns_coefficients=sched, ns_steps=7) == expect


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"ns_schedule": "tuned5"}, "Unknown ns_schedule"),
        ({"ns_schedule": [(1.0, 2.0)]}, "exactly 3"),
        ({"ns_schedule": [(1.0, 2.0, 3.0, 4.0)]}, "exactly 3"),
        ({"ns_schedule": []}, "between 1 and 99"),
        ({"ns_schedule": [(1.0, 0.0, 0.0)] * 100}, "between 1 and 99"),
        ({"ns_schedule": [(1.0, float("nan"), 0.0)]}, "finite"),
        ({"ns_schedule": [(1.0, True, 0.0)]}, "finite real"),
        ({"ns_steps": 0}, r"\[1, 100\)"),
        ({"ns_steps": 100}, r"\[1, 100\)"),
        ({"ns_schedule": "standard", "ns_steps": 0}, r"\[1, 100\)"),
    ],
)
def test_bad_schedules_raise_value_error(kwargs, match):
    schedule = kwargs.pop("ns_schedule", None)
    with pytest.raises(ValueError, match=match):
        ns.resolve_ns_schedule(schedule, **kwargs)


def test_non_int_ns_steps_is_a_type_error():
    with pytest.raises(TypeError, match="ns_steps"):
        ns.resolve_ns_schedule(ns_steps=True)
    with pytest.raises(TypeError, match="ns_steps"):
        ns.resolve_ns_schedule(ns_steps=2.0)


# ---------------------------------------------------------------- numerics


@pytest.mark.parametrize("name", list(SPEC))
@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (32, 32)])
def test_float64_path_equals_the_singular_value_definition(name, shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = ns.newton_schulz(x, ns.resolve_ns_schedule(name), dtype=torch.float64)
    assert got.dtype == torch.float64 and got.shape == shape
    torch.testing.assert_close(got, svd_reference(x, SPEC[name]), rtol=0, atol=1e-11)


@pytest.mark.parametrize("name", list(SPEC))
def test_bf16_default_is_close_to_float64(name):
    x = torch.randn(48, 96, generator=torch.Generator().manual_seed(2))
    got = ns.newton_schulz(x, ns.resolve_ns_schedule(name))
    assert got.dtype == torch.bfloat16
    ref = svd_reference(x, SPEC[name])
    # Individual singular values can move by the bf16 round-off times the (large) slope of
    # the composed polynomial, so compare directions: the same polar factor up to a few %.
    cos = (got.double() * ref).sum() / (got.double().norm() * ref.norm())
    assert cos.item() > 0.99
    wrong = svd_reference(x, SPEC["tuned4" if name != "tuned4" else "standard"])
    assert (got.double() - ref).norm() < (got.double() - wrong).norm()


def test_spec_peaks_of_the_tuned_schedules_hold():
    # docs/algorithm.md#gefenmuon: robust for σ ∈ [1e-2, 1] with peak ≤ 1.15 (tuned3) / ≤ 1.01
    # (tuned4).
    assert band(SPEC["tuned3"])[1] <= 1.15
    assert band(SPEC["tuned4"])[1] <= 1.01
    for name in SPEC:
        assert band(SPEC[name])[0] > 0.5, name


@pytest.mark.parametrize("name", list(SPEC))
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_result_is_orthogonal_within_the_schedule_band(name, dtype):
    # 32 singular values log-spaced so that after Frobenius normalisation they fill
    # [1e-2 · a bit, 1]: the band of docs/algorithm.md#gefenmuon applies to every one of them.
    s = np.geomspace(1.0, 0.03, 32)
    x = matrix_with_singular_values(32, 80, s, seed=3)
    normalised = s / np.linalg.norm(s)
    assert normalised.min() >= 1e-2
    lo, hi = band(SPEC[name])
    out = ns.newton_schulz(x, ns.resolve_ns_schedule(name), dtype=dtype).double()
    sv = torch.linalg.svdvals(out).numpy()
    slack = 1e-9 if dtype == torch.float64 else BF16_SV_ALLOWANCE
    assert sv.min() >= lo - slack and sv.max() <= hi + slack, (sv.min(), sv.max(), lo, hi)
    if dtype == torch.float64:
        # Exactly the composed polynomial of each normalised input singular value (as
        # multisets: the standard composition is not monotone, so the order may change).
        np.testing.assert_allclose(
            np.sort(sv), np.sort(compose(SPEC[name], normalised)), atol=1e-10, rtol=0
        )


def test_tall_input_is_the_transpose_of_the_wide_computation():
    x = torch.randn(40, 24, generator=torch.Generator().manual_seed(4))
    sched = ns.resolve_ns_schedule("tuned3")
    assert torch.equal(ns.newton_schulz(x, sched), ns.newton_schulz(x.T, sched).T)


def test_input_is_not_modified_and_zero_matrix_stays_finite():
    x = torch.randn(8, 16)
    before = x.clone()
    ns.newton_schulz(x, ns.resolve_ns_schedule())
    assert torch.equal(x, before)
    z = ns.newton_schulz(torch.zeros(8, 16), ns.resolve_ns_schedule())
    assert torch.equal(z, torch.zeros(8, 16, dtype=torch.bfloat16))


def test_eps_floors_the_normalisation():
    # A matrix with ‖x‖_F far below eps is scaled by 1/eps, not by 1/‖x‖_F.
    x = torch.full((4, 4), 1e-12, dtype=torch.float64)
    got = ns.newton_schulz(x, [(1.0, 0.0, 0.0)], eps=1e-7, dtype=torch.float64)
    torch.testing.assert_close(got, x / 1e-7, rtol=1e-15, atol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_batched_equals_serial(dtype):
    g = torch.Generator().manual_seed(5)
    xs = torch.randn(6, 16, 40, generator=g) * torch.logspace(-3, 1, 6).view(6, 1, 1)
    sched = ns.resolve_ns_schedule("tuned4")
    batched = ns.newton_schulz(xs, sched, dtype=dtype)
    for i in range(6):
        serial = ns.newton_schulz(xs[i], sched, dtype=dtype)
        if dtype == torch.float64:
            torch.testing.assert_close(batched[i], serial, rtol=0, atol=1e-12)
        else:  # same math, possibly another GEMM blocking: within bf16 round-off
            assert (batched[i].double() - serial.double()).abs().max() < 2 * 2**-8
    tall = ns.newton_schulz(xs.mT, sched, dtype=torch.float64)
    torch.testing.assert_close(tall, ns.newton_schulz(xs, sched, dtype=torch.float64).mT)


def test_rejects_other_ranks():
    with pytest.raises(ValueError, match=r"\[R, C\]"):
        ns.newton_schulz(torch.zeros(3), ns.resolve_ns_schedule())


# ---------------------------------------------------------------- fp8 path and its gates


def test_fp8_falls_back_silently_on_cpu(recwarn):
    x = torch.randn(64, 128)
    sched = ns.resolve_ns_schedule("tuned3")
    assert not ns.fp8_ns_supported("cpu")
    assert not ns.fp8_ns_eligible(torch.empty(2048, 2048))  # big enough, but a CPU tensor
    assert torch.equal(ns.newton_schulz(x, sched, fp8=True), ns.newton_schulz(x, sched))
    assert len(recwarn) == 0


def test_fp8_size_gate(monkeypatch):
    monkeypatch.setattr(ns, "fp8_ns_supported", lambda device: True)
    assert ns.fp8_ns_eligible(torch.empty(1536, 4096))
    assert ns.fp8_ns_eligible(torch.empty(4096, 1536))
    assert not ns.fp8_ns_eligible(torch.empty(1520, 4096))  # min dim below 1536
    assert not ns.fp8_ns_eligible(torch.empty(1544, 4104))  # large, but not a multiple of 16
    assert not ns.fp8_ns_eligible(torch.empty(4, 1536, 1536))  # batches are never fp8
    # Below the gate the bf16 path runs even though the "device" is fp8-capable.
    x = torch.randn(64, 128)
    sched = ns.resolve_ns_schedule("tuned3")
    assert torch.equal(ns.newton_schulz(x, sched, fp8=True), ns.newton_schulz(x, sched))


def scaled_mm_reference(a, b, *, scale_a, scale_b, out_dtype):
    """``torch._scaled_mm`` from its definition: (a·scale_a) @ (b·scale_b) in float64, rounded
    once to ``out_dtype`` (row-wise ``scale_a`` ``[M, 1]``, column-wise ``scale_b`` ``[1, N]``)."""
    return ((a.double() * scale_a.double()) @ (b.double() * scale_b.double())).to(out_dtype)


def cpu_scaled_mm_available():
    # torch < 2.8 registers aten::_scaled_mm for CUDA only (NotImplementedError on CPU).
    q = torch.ones(16, 16).to(torch.float8_e4m3fn)
    one = torch.ones(16, 1)
    try:
        torch._scaled_mm(q, q.t(), scale_a=one, scale_b=one.t(), out_dtype=torch.bfloat16)
    except (NotImplementedError, RuntimeError):
        return False
    return True


@pytest.mark.skipif(not cpu_scaled_mm_available(),
                    reason="this torch has no CPU kernel for torch._scaled_mm to compare with")
def test_scaled_mm_reference_matches_torch_on_cpu():
    g = torch.Generator().manual_seed(7)
    a = (torch.randn(32, 64, generator=g) * 8).to(torch.float8_e4m3fn)
    b = (torch.randn(48, 64, generator=g) * 8).to(torch.float8_e4m3fn)
    sa = torch.rand(32, 1, generator=g) + 0.5
    sb = torch.rand(1, 48, generator=g) + 0.5
    got = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    ref = scaled_mm_reference(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.float64)
    # fp32 accumulation, then one bf16 rounding (unit round-off 2**-9) relative to the row size.
    err = (got.double() - ref).abs().max().item()
    assert err <= 2**-8 * ref.abs().max().item(), err


def test_fp8_core_approximates_the_orthogonalisation(monkeypatch):
    # The fp8 recipe itself (row-wise e4m3 quantization, scale layout, the composed quintic)
    # is checked here with the gates opened: e4m3 keeps 3 significand bits (unit round-off
    # 2**-4), so the result must be within a few of those of the float64 answer, and must
    # differ from the bf16 path. Where torch has no CPU torch._scaled_mm (torch < 2.8), the
    # GEMM is its float64 definition above (checked against torch's where both exist).
    if not cpu_scaled_mm_available():
        monkeypatch.setattr(torch, "_scaled_mm", scaled_mm_reference)
    monkeypatch.setattr(ns, "fp8_ns_supported", lambda device: True)
    monkeypatch.setattr(ns, "FP8_MIN_DIM", 32)
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(6))
    for name in ("tuned3", "tuned4"):
        sched = ns.resolve_ns_schedule(name)
        got = ns.newton_schulz(x, sched, fp8=True, fp8_compile=False)
        assert got.dtype == torch.bfloat16
        assert not torch.equal(got, ns.newton_schulz(x, sched))
        ref = svd_reference(x, SPEC[name])
        rel = ((got.double() - ref).norm() / ref.norm()).item()
        assert rel < 4 * 2**-4, rel
    tall = ns.newton_schulz(x.T, sched, fp8=True, fp8_compile=False)
    assert torch.equal(tall, ns.newton_schulz(x, sched, fp8=True, fp8_compile=False).T)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_on_gpu_matches_float64_within_fp8_error():
    x = torch.randn(2048, 2048, device="cuda")
    sched = ns.resolve_ns_schedule("standard")
    got = ns.newton_schulz(x, sched, fp8=True)
    ref = ns.newton_schulz(x.double(), sched, dtype=torch.float64)
    rel = ((got.double() - ref).norm() / ref.norm()).item()
    assert rel < 4 * 2**-4, rel
    if ns.fp8_ns_supported(x.device):
        assert not torch.equal(got, ns.newton_schulz(x, sched))


# ---------------------------------------------------------------- batch planning


def test_workspace_model():
    assert ns.ns_workspace_bytes(512, 2048) == 2 * (3 * 512 * 2048 + 2 * 512 * 512)
    assert ns.ns_workspace_bytes(2048, 512) == ns.ns_workspace_bytes(512, 2048)


@pytest.mark.parametrize(
    ("count", "cap", "expect"),
    [
        (5, 100, ([], 5)),  # fewer than 8 matrices: serial
        (30, 7, ([], 30)),  # budget fits fewer than 8: serial
        (20, 100, ([20], 0)),
        (20, 10, ([10, 10], 0)),
        (23, 10, ([10, 10], 3)),  # 10+3 can't split into two halves of >= 8
        (26, 10, ([10, 8, 8], 0)),  # 10+6 -> 8+8
        (29, 10, ([10, 10, 9], 0)),  # remainder 9 >= 8 stays its own batch
    ],
)
def test_batch_plan(count, cap, expect):
    per = ns.ns_workspace_bytes(16, 64)
    sizes, serial = ns.plan_ns_batches(count, 16, 64, cap * per + per // 2)
    assert (sizes, serial) == expect
    assert sum(sizes) + serial == count
    assert all(8 <= s <= cap for s in sizes)
    assert math.isclose(sum(sizes) + serial, count)
