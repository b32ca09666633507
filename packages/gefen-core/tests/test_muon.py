"""GefenMuon (docs/algorithm.md#gefenmuon) against a full-precision Muon written here from the
math."""

from __future__ import annotations

import inspect
import io
import math
import warnings

import numpy as np
import pytest
import torch

from gefen_core.muon import GefenMuon, adjusted_lr_ratio

STANDARD = [(3.4445, -4.7750, 2.0315)] * 5
TUNED3 = [
    (5.0067, -14.4125, 10.6001),
    (3.7534, -6.8083, 3.3840),
    (3.2080, -4.3501, 2.0330),
]


# ------------------------------------------------------------------ independent reference


def ns_reference(u: torch.Tensor, schedule, eps: float = 1e-7) -> torch.Tensor:
    """Newton–Schulz from its action on singular values, float64: U · p(Σ/‖u‖_F) · Vᵀ."""
    u = u.double()
    left, s, right = torch.linalg.svd(u, full_matrices=False)
    s = s / max(torch.linalg.norm(u).item(), eps)
    for a, b, c in schedule:
        s = a * s + b * s**3 + c * s**5
    return left @ torch.diag(s) @ right


def alpha_reference(kind, rows, cols):
    if kind == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1.0, rows / cols))


def normuon_reference(o, v, t, beta2=0.95, eps=1e-8):
    """docs/algorithm.md#gefenmuon in float64; returns (new O, new v)."""
    rows, cols = o.shape
    rho = o.norm(dim=1, keepdim=True)
    v = beta2 * v + (1 - beta2) * rho**2 / cols
    d = torch.sqrt(v / (1 - beta2**t)) + eps
    gamma = torch.sqrt((rho**2).sum()) / torch.sqrt(((rho / d) ** 2).sum())
    return o * (gamma / d), v


class MuonReference:
    """Full-precision Muon (fp64 momentum buffer, exact NS), one matrix."""

    def __init__(self, theta, *, lr, wd, mu, nesterov, schedule, adjust=None, normuon=False,
                 cautious=False, maximize=False):
        self.theta = theta.detach().double().clone()
        self.buf = torch.zeros_like(self.theta)
        self.v = torch.zeros(theta.shape[0], 1, dtype=torch.float64)
        self.t = 0
        self.kw = dict(lr=lr, wd=wd, mu=mu, nesterov=nesterov, schedule=schedule,
                       adjust=adjust, normuon=normuon, cautious=cautious, maximize=maximize)

    def step(self, g):
        k = self.kw
        g = -g.double() if k["maximize"] else g.double()
        self.t += 1
        self.buf = k["mu"] * self.buf + (1 - k["mu"]) * g
        u = k["mu"] * self.buf + (1 - k["mu"]) * g if k["nesterov"] else self.buf
        o = ns_reference(u, k["schedule"])
        if k["normuon"]:
            o, self.v = normuon_reference(o, self.v, self.t)
        if k["cautious"]:
            mask = (o * g > 0).double()
            o = o * mask * (o.numel() / max(mask.sum().item(), 1.0))
        rows, cols = self.theta.shape
        self.theta = self.theta * (1 - k["lr"] * k["wd"]) \
            - k["lr"] * alpha_reference(k["adjust"], rows, cols) * o
        return self.theta


def dense(opt: GefenMuon) -> GefenMuon:
    """The test-only hook: full-precision momentum and float64 Newton–Schulz."""
    opt._dense_momentum_for_testing = True
    opt._ns_dtype = torch.float64
    return opt


def grads(shape, n, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    # Row-scaled gradients: realistic structure for the period search and the codebook.
    scales = torch.exp(torch.randn(shape[0], 1, generator=g))
    return [(torch.randn(*shape, generator=g) * scales).to(dtype) for _ in range(n)]


# ------------------------------------------------------------------ construction


#: ``torch.optim.Muon.__init__`` as documented since torch 2.9 (the class does not exist on
#: older torch): positional order and defaults, after ``self, params``.
TORCH_MUON_SIGNATURE = (
    ("lr", 1e-3),
    ("weight_decay", 0.1),
    ("momentum", 0.95),
    ("nesterov", True),
    ("ns_coefficients", (3.4445, -4.775, 2.0315)),
    ("eps", 1e-7),
    ("ns_steps", 5),
    ("adjust_lr_fn", None),
)


def _check_follows(ours, theirs):
    for name, default in theirs:
        assert name in ours, name
        assert ours[name].default == default, name
        assert ours[name].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, name
    names = [n for n in ours if n not in ("self", "params")]
    assert names[: len(theirs)] == [n for n, _ in theirs]  # same positional order
    assert list(ours)[:2] == ["self", "params"]


def test_signature_and_defaults_follow_documented_torch_muon():
    _check_follows(inspect.signature(GefenMuon.__init__).parameters, TORCH_MUON_SIGNATURE)


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"),
                    reason="torch.optim.Muon exists from torch 2.9 on; the documented "
                           "signature is checked by the test above")
def test_signature_and_defaults_follow_installed_torch_muon():
    theirs = inspect.signature(torch.optim.Muon.__init__).parameters
    expected = tuple((n, p.default) for n, p in theirs.items() if n not in ("self", "params"))
    _check_follows(inspect.signature(GefenMuon.__init__).parameters, expected)


def test_group_keys_and_gefen_view():
    w = torch.nn.Parameter(torch.randn(4, 8))
    opt = GefenMuon([w])
    g = opt.param_groups[0]
    assert g["lr"] == 1e-3 and g["weight_decay"] == 0.1 and g["eps"] == 1e-7
    assert g["momentum"] == 0.95 and g["nesterov"] is True
    # docs/algorithm.md#gefenmuon: a Gefen with betas = (momentum, 0)
    assert g["betas"] == (0.95, 0.0)
    assert g["factored_v_2d"] is False
    assert [tuple(t) for t in g["ns_coefficients"]] == STANDARD and g["ns_steps"] == 5
    assert g["normuon"] is False and g["cautious"] is False and g["sharded_mode"] == "exact"


def test_schedules_resolve_per_constructor_and_group():
    a, b = torch.nn.Parameter(torch.randn(4, 8)), torch.nn.Parameter(torch.randn(4, 8))
    opt = GefenMuon([{"params": [a]}, {"params": [b], "ns_schedule": "standard", "ns_steps": 2}],
                    ns_schedule="tuned3")
    assert [tuple(t) for t in opt.param_groups[0]["ns_coefficients"]] == TUNED3
    assert opt.param_groups[0]["ns_steps"] == 3
    assert [tuple(t) for t in opt.param_groups[1]["ns_coefficients"]] == STANDARD[:2]
    opt2 = GefenMuon([a], ns_coefficients=(1.5, -0.5, 0.0), ns_steps=7)
    assert [tuple(t) for t in opt2.param_groups[0]["ns_coefficients"]] == [(1.5, -0.5, 0.0)] * 7


def matrix():
    return [torch.nn.Parameter(torch.randn(4, 8))]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"lr": -1.0}, ValueError, r"^Learning rate should be >= 0 but is: -1\.0"),
        ({"lr": torch.tensor([1.0, 2.0])}, ValueError, "^Tensor lr must be 1-element"),
        ({"momentum": 1.0}, ValueError, "momentum"),
        ({"momentum": -0.1}, ValueError, "momentum"),
        ({"eps": 0.0}, ValueError, "eps"),
        ({"eps": float("inf")}, ValueError, "eps"),
        ({"weight_decay": -0.1}, ValueError, "weight_decay"),
        ({"adjust_lr_fn": "sqrt"}, ValueError, "adjust_lr_fn"),
        ({"sharded_mode": "zero"}, ValueError, "sharded_mode"),
        ({"ns_schedule": "tuned7"}, ValueError, "Unknown ns_schedule"),
        ({"ns_schedule": [(1.0, 2.0)]}, ValueError, "exactly 3"),
        ({"ns_steps": 0}, ValueError, "SGD"),
        ({"ns_steps": 100}, ValueError, r"\[1, 100\)"),
        ({"batched_ns_workspace_bytes": 0}, ValueError, "workspace"),
        ({"batched_ns_workspace_bytes": True}, ValueError, "workspace"),
        ({"normuon_beta2": 1.0}, ValueError, "normuon_beta2"),
        ({"normuon_eps": 0.0}, ValueError, "normuon_eps"),
        ({"nesterov": "yes"}, TypeError, "nesterov"),
        ({"normuon": 1}, TypeError, "normuon"),
        ({"deterministic": 1}, TypeError, "deterministic"),
    ],
)
def test_invalid_options(kwargs, error, match):
    with pytest.raises(error, match=match):
        GefenMuon(matrix(), **kwargs)


@pytest.mark.parametrize("shape", [(8,), (2, 3, 4), (), (2, 2, 2, 2, 2)])
def test_non_matrix_parameters_are_refused_at_construction(shape):
    ok = torch.nn.Parameter(torch.randn(4, 4))
    bad = torch.nn.Parameter(torch.randn(shape))
    with pytest.raises(ValueError, match=r"2-D weight matrices only.*GefenMuonHybrid"):
        GefenMuon([("ok", ok), ("norm.weight", bad)])


def test_add_param_group_is_validated_before_registration():
    opt = GefenMuon(matrix())
    with pytest.raises(ValueError, match="2-D"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(3))]})
    with pytest.raises(ValueError, match="momentum"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(3, 3))], "momentum": 2})
    with pytest.raises(ValueError, match="no 'betas'"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(3, 3))],
                             "betas": (0.9, 0.99)})
    with pytest.raises(ValueError, match="factored_v_2d"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(3, 3))],
                             "factored_v_2d": True})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(3, 3))], "normuon": True,
                         "ns_schedule": "tuned4"})
    assert opt.param_groups[1]["normuon"] is True and opt.param_groups[1]["ns_steps"] == 4


def test_fused_true_cannot_be_honoured_and_says_so():
    with pytest.raises(RuntimeError, match="fused=None"):
        GefenMuon(matrix(), fused=True)
    opt = GefenMuon([("w", torch.nn.Parameter(torch.randn(4, 4)))])
    assert opt.step_paths() == {"w": "for_loop"}


def test_fp8_request_without_capable_gpu_warns_once_and_runs_bf16():
    if torch.cuda.is_available():
        pytest.skip("the warning is for machines without an fp8-capable GPU")
    w1 = torch.nn.Parameter(torch.randn(8, 16))
    w2 = torch.nn.Parameter(w1.detach().clone())
    with pytest.warns(UserWarning, match="fp8_ns=True"):
        a = GefenMuon([w1], fp8_ns=True)
    b = GefenMuon([w2])
    for g in grads((8, 16), 2, dtype=torch.float32):
        w1.grad, w2.grad = g.clone(), g.clone()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            a.step()
        b.step()
    assert torch.equal(w1, w2)


# ------------------------------------------------------------------ the update itself


@pytest.mark.parametrize("shape", [(12, 20), (20, 12)])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust", [None, "original", "match_rms_adamw"])
def test_unquantized_equals_full_precision_muon(shape, nesterov, adjust):
    theta = torch.randn(*shape, dtype=torch.float64)
    w = torch.nn.Parameter(theta.clone())
    kw = dict(lr=0.05, wd=0.1, mu=0.9)
    opt = dense(GefenMuon([w], lr=kw["lr"], weight_decay=kw["wd"], momentum=kw["mu"],
                          nesterov=nesterov, adjust_lr_fn=adjust, ns_schedule="tuned3"))
    ref = MuonReference(theta, nesterov=nesterov, schedule=TUNED3, adjust=adjust, **kw)
    for g in grads(shape, 4, seed=1):
        w.grad = g.clone()
        opt.step()
        expect = ref.step(g)
        torch.testing.assert_close(w.detach(), expect, rtol=0, atol=1e-10)


@pytest.mark.parametrize("option", ["normuon", "cautious", "maximize"])
def test_unquantized_options_equal_reference(option):
    shape = (10, 24)
    theta = torch.randn(*shape, dtype=torch.float64)
    w = torch.nn.Parameter(theta.clone())
    opt = dense(GefenMuon([w], lr=0.03, weight_decay=0.0, **{option: True}))
    ref = MuonReference(theta, lr=0.03, wd=0.0, mu=0.95, nesterov=True, schedule=STANDARD,
                        **{option: True})
    for g in grads(shape, 4, seed=2):
        w.grad = g.clone()
        opt.step()
        expect = ref.step(g)
        # NorMuon's second moment is fp32 state (docs/algorithm.md#gefenmuon): float32 round-off,
        # not float64.
        tol = 1e-6 if option == "normuon" else 1e-10
        torch.testing.assert_close(w.detach(), expect, rtol=tol, atol=tol)


def test_weight_decay_uses_the_unadjusted_lr():
    theta = torch.randn(6, 30, dtype=torch.float64)
    w = torch.nn.Parameter(theta.clone())
    opt = dense(GefenMuon([w], lr=0.1, weight_decay=0.5, adjust_lr_fn="match_rms_adamw"))
    w.grad = torch.zeros_like(w)  # NS(0) = 0: only the decay moves the weights
    opt.step()
    torch.testing.assert_close(w.detach(), theta * (1 - 0.1 * 0.5), rtol=0, atol=0)


def test_normuon_equalises_row_norms_and_keeps_the_frobenius_norm():
    # First NorMuon step: ν/bc = ρ²/C, so every row is divided by ~its own RMS; the γ rescale
    # then restores ‖O‖_F. The update's rows therefore have equal norms ‖O‖_F / sqrt(R).
    g = grads((16, 32), 1, seed=3)[0]
    g[:4] *= 50.0  # rows of very different scale
    w1 = torch.nn.Parameter(torch.zeros(16, 32, dtype=torch.float64))
    w2 = torch.nn.Parameter(torch.zeros(16, 32, dtype=torch.float64))
    plain = dense(GefenMuon([w1], lr=1.0, weight_decay=0.0, adjust_lr_fn="original"))
    norm = dense(GefenMuon([w2], lr=1.0, weight_decay=0.0, adjust_lr_fn="original",
                           normuon=True))
    w1.grad, w2.grad = g.clone(), g.clone()
    plain.step()
    norm.step()
    rows = w2.detach().norm(dim=1)
    assert (rows.max() - rows.min()) / rows.mean() < 1e-6
    torch.testing.assert_close(w2.detach().norm(), w1.detach().norm(), rtol=1e-6, atol=0)
    assert rows.std() < w1.detach().norm(dim=1).std()  # not the same as the plain update
    st = norm.state[w2]
    assert st["normuon_exp_avg_sq"].dtype == torch.float32
    assert st["normuon_exp_avg_sq"].shape == (16, 1) and float(st["normuon_step"]) == 1.0


def test_cautious_zeroes_disagreeing_entries():
    w = torch.nn.Parameter(torch.zeros(12, 16, dtype=torch.float64))
    opt = dense(GefenMuon([w], lr=1.0, weight_decay=0.0, cautious=True, nesterov=False))
    g = grads((12, 16), 1, seed=4)[0]
    w.grad = g.clone()
    opt.step()
    delta = w.detach()
    o = ns_reference(g * 0.05, STANDARD)  # first momentum = (1 - β) g
    agree = o * g > 0
    assert torch.all(delta[~agree] == 0)
    assert torch.all(delta[agree] * g[agree] < 0)  # a descent direction where kept
    scale = o.numel() / agree.sum().item()
    # α = sqrt(max(1, 12/16)) = 1 for this wide matrix.
    torch.testing.assert_close(delta[agree], -(o * scale)[agree], rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------ quantized momentum


def codebook_gap(opt) -> float:
    c = opt._codebook.double()
    return float((c[1:] - c[:-1]).max())


def decoded(opt, p):
    st = opt.state[p]
    return (opt._codebook[st["exp_avg_codes"].long()].double()
            * st["exp_avg_scale"].double()).reshape(p.shape)


def test_quantized_momentum_stays_within_the_256_level_bound():
    """The stored momentum tracks the exact EMA within the quantizer's error bound.

    Derivation. With nearest rounding into a codebook ``c`` (``c_0 = -1``, ``c_255 = 1``,
    largest gap ``Δ``), each re-quantisation of a block with scale ``s_t = max|m|`` moves every
    element by at most ``δ_t = s_t · Δ / 2``. The stored momentum ``m̂_t`` and the exact EMA
    ``m_t = β m_{t-1} + (1-β) g_t`` then differ by ``e_t = β e_{t-1} + ε_t`` with
    ``|ε_t| ≤ δ_t``, so ``|e_t| ≤ Σ_k β^{t-k} s_k Δ/2``. For 256 evenly spaced levels
    ``Δ = 2/255`` (a per-step error of ``s/255``); a learned codebook is denser where the
    block-normalised momentum lives, so its ``Δ`` may be larger at the tails but its typical
    error smaller. fp32 arithmetic adds ~1e-7 relative slack per step.
    """
    shape = (32, 64)
    w = torch.nn.Parameter(torch.zeros(shape))
    beta = 0.9
    opt = GefenMuon([w], lr=0.0, weight_decay=0.0, momentum=beta)
    exact = torch.zeros(shape, dtype=torch.float64)
    bound = None
    for t, g in enumerate(grads(shape, 12, seed=5, dtype=torch.float32)):
        w.grad = g.clone()
        opt.step()
        exact = beta * exact + (1 - beta) * g.double()
        st = opt.state[w]
        period = st["period"]
        s = st["exp_avg_scale"].double()  # [B, 1]
        per_step = (s * codebook_gap(opt) / 2).expand(-1, period).reshape(shape)
        bound = per_step if bound is None else beta * bound + per_step
        err = (decoded(opt, w) - exact).abs()
        slack = 1e-6 * (t + 1) * exact.abs().max()
        assert torch.all(err <= bound + slack), (t, (err - bound).max().item())
    # Lossy but informative: the bound is not vacuous relative to the momentum itself.
    assert (bound.max() / exact.abs().max()).item() < 0.2
    assert w.detach().abs().max() == 0  # lr = 0 never touches the parameter


def test_one_step_requantisation_matches_the_quantizer():
    """One step from a known state, checked element by element in float64
    (docs/algorithm.md#block-second-moment step 5)."""
    shape = (16, 48)
    w = torch.nn.Parameter(torch.zeros(shape))
    opt = GefenMuon([w], lr=0.0, momentum=0.8, nesterov=False)
    gs = grads(shape, 2, seed=6, dtype=torch.float32)
    w.grad = gs[0].clone()
    opt.step()
    st = opt.state[w]
    prev = decoded(opt, w)
    period = st["period"]
    w.grad = gs[1].clone()
    opt.step()
    m = (0.8 * prev + 0.2 * gs[1].double()).reshape(-1, period)
    s_new = m.abs().amax(dim=1, keepdim=True)
    torch.testing.assert_close(st["exp_avg_scale"].double(), s_new, rtol=1e-6, atol=0)
    got = decoded(opt, w).reshape(-1, period)
    assert torch.all((got - m).abs() <= s_new * codebook_gap(opt) / 2 * (1 + 1e-5) + 1e-12)


def test_state_layout_and_bytes_per_param():
    w = torch.nn.Parameter(torch.zeros(64, 128))
    opt = GefenMuon([w], lr=0.01)
    w.grad = grads((64, 128), 1, seed=7, dtype=torch.float32)[0]
    opt.step()
    st = opt.state[w]
    period = st["period"]
    assert set(st) == {"step", "period", "exp_avg_codes", "exp_avg_scale"}
    assert st["exp_avg_codes"].dtype == torch.uint8
    assert st["exp_avg_codes"].shape == (w.numel() // period, period)
    assert st["exp_avg_scale"].dtype == torch.float32
    assert st["exp_avg_scale"].shape == (w.numel() // period, 1)
    assert float(st["step"]) == 1.0
    nbytes = sum(v.numel() * v.element_size() for v in st.values() if isinstance(v, torch.Tensor))
    assert nbytes / w.numel() <= 1 + 4 / period + 4 / w.numel()
    assert opt._codebook.shape == (256,)


def test_match_rms_adamw_update_has_adamw_scale():
    """``match_rms_adamw`` makes the update RMS ≈ 0.2·lr: AdamW's RMS on noisy gradients
    (``≈ lr·sqrt((1-β1)/(1+β1)) = 0.23·lr`` in steady state)."""
    shape = (32, 64)
    lr = 1e-2
    stream = grads(shape, 30, seed=8, dtype=torch.float32)
    wa = torch.nn.Parameter(torch.zeros(shape))
    adamw = torch.optim.AdamW([wa], lr=lr, weight_decay=0.0)
    wm = torch.nn.Parameter(torch.zeros(shape))
    muon = GefenMuon([wm], lr=lr, weight_decay=0.0, adjust_lr_fn="match_rms_adamw",
                     ns_schedule="tuned4")

    def last_rms(p, opt):
        before = None
        for g in stream:
            before = p.detach().clone()
            p.grad = g.clone()
            opt.step()
        return ((p.detach() - before).pow(2).mean().sqrt() / lr).item()

    rms_adamw = last_rms(wa, adamw)
    rms_muon = last_rms(wm, muon)
    # Orthogonalised update: RMS(O) = sqrt(Σσ²/(R·C)) with σ in tuned4's band [0.96, 1.01]
    # (bf16 adds ~0.02), times 0.2·sqrt(max(R, C)) / sqrt(max(R, C)) ... = 0.2 · RMS(σ).
    assert 0.2 * 0.93 <= rms_muon <= 0.2 * 1.03, rms_muon
    assert 0.15 <= rms_adamw <= 0.3, rms_adamw  # the scale being matched
    assert abs(rms_muon / rms_adamw - 1) < 0.25
    # The native scale of a wide matrix is sqrt(max(1, R/C)) = 1: 0.2·sqrt(64) times smaller.
    assert adjusted_lr_ratio(None, shape) == 1.0
    assert adjusted_lr_ratio("match_rms_adamw", shape) == pytest.approx(0.2 * math.sqrt(64))
    assert adjusted_lr_ratio("original", (64, 32)) == pytest.approx(math.sqrt(2))


def test_batched_newton_schulz_matches_serial(monkeypatch):
    import gefen_core.muon as muon_module

    calls = []
    real = muon_module.newton_schulz

    def spy(x, *a, **k):
        calls.append(x.ndim)
        return real(x, *a, **k)

    monkeypatch.setattr(muon_module, "newton_schulz", spy)
    params_a = [torch.nn.Parameter(torch.zeros(8, 16)) for _ in range(9)]
    params_b = [torch.nn.Parameter(torch.zeros(8, 16)) for _ in range(9)]
    a = GefenMuon(params_a, lr=0.01, batched_ns=True)
    b = GefenMuon(params_b, lr=0.01)
    stream = [grads((8, 16), 2, seed=10 + i, dtype=torch.float32) for i in range(9)]
    for step in range(2):
        for pa, pb, gs in zip(params_a, params_b, stream, strict=True):
            pa.grad, pb.grad = gs[step].clone(), gs[step].clone()
        a.step()
        b.step()
    assert 3 in calls  # the batched path really ran
    for pa, pb in zip(params_a, params_b, strict=True):
        # Same momentum codes; NS differs only by GEMM blocking (bf16 round-off).
        assert torch.equal(a.state[pa]["exp_avg_codes"], b.state[pb]["exp_avg_codes"])
        assert (pa - pb).abs().max() <= 0.01 * 2 * 2**-7


def test_capturable_and_tensor_lr_match_the_host_path():
    w1 = torch.nn.Parameter(torch.randn(8, 24))
    w2 = torch.nn.Parameter(w1.detach().clone())
    a = GefenMuon([w1], lr=0.02, normuon=True)
    b = GefenMuon([w2], lr=torch.tensor(0.02), normuon=True, capturable=True)
    for g in grads((8, 24), 3, seed=11, dtype=torch.float32):
        w1.grad, w2.grad = g.clone(), g.clone()
        a.step()
        b.step()
    assert b.state[w2]["step"].device == w2.device
    assert torch.equal(a.state[w1]["exp_avg_codes"], b.state[w2]["exp_avg_codes"])
    torch.testing.assert_close(w1, w2, rtol=1e-6, atol=1e-7)


def test_stochastic_round_stays_within_one_codeword():
    shape = (16, 32)
    w1 = torch.nn.Parameter(torch.zeros(shape))
    w2 = torch.nn.Parameter(torch.zeros(shape))
    a = GefenMuon([("w", w1)], lr=0.0)
    b = GefenMuon([("w", w2)], lr=0.0, stochastic_round=True)
    g = grads(shape, 1, seed=12, dtype=torch.float32)[0]
    w1.grad, w2.grad = g.clone(), g.clone()
    a.step()
    b._codebook = a._codebook.clone()  # same codebook, same first state: compare rounding
    b.state[w2]["period"] = a.state[w1]["period"]
    b.step()
    qa, qb = a.state[w1]["exp_avg_codes"].long(), b.state[w2]["exp_avg_codes"].long()
    assert (qa - qb).abs().max() <= 1 and not torch.equal(qa, qb)


# ------------------------------------------------------------------ wrappers and AMP


def test_flattened_parameters_at_step_time_explain_zero():
    w = torch.nn.Parameter(torch.randn(8, 8))
    opt = GefenMuon([w])
    flat = torch.nn.Parameter(torch.randn(64))
    flat.grad = torch.randn(64)
    opt.param_groups[0]["params"] = [flat]  # what a ZeRO wrapper does to the groups
    with pytest.raises(ValueError, match=r"DeepSpeed ZeRO.*plain Gefen.*FSDP2 or DDP"):
        opt.step()
    assert len(opt.state[flat]) == 0 and opt._global_step == 0


def test_overflow_step_mutates_nothing():
    w = torch.nn.Parameter(torch.randn(8, 16))
    opt = GefenMuon([w], lr=0.1)
    w.grad = torch.randn(8, 16)
    opt.step()
    before = {k: (v.clone() if isinstance(v, torch.Tensor) else v)
              for k, v in opt.state[w].items()}
    w_before = w.detach().clone()
    opt.found_inf = torch.ones(1)
    opt.grad_scale = torch.tensor(1024.0)
    w.grad = torch.randn(8, 16)
    opt.step()
    assert torch.equal(w, w_before) and opt._global_step == 1
    for k, v in before.items():
        assert torch.equal(opt.state[w][k], v) if isinstance(v, torch.Tensor) else \
            opt.state[w][k] == v


# ------------------------------------------------------------------ checkpoints


def trained(normuon=True, stochastic_round=True, seed=13):
    torch.manual_seed(seed)
    ws = [torch.nn.Parameter(torch.randn(16, 32)), torch.nn.Parameter(torch.randn(24, 8))]
    opt = GefenMuon([("a", ws[0]), ("b", ws[1])], lr=0.02, normuon=normuon,
                    stochastic_round=stochastic_round)
    for i in range(3):
        for j, w in enumerate(ws):
            w.grad = grads(tuple(w.shape), 1, seed=100 * i + j, dtype=torch.float32)[0]
        opt.step()
    return ws, opt


def test_checkpoint_round_trip_is_bit_identical():
    ws, opt = trained()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    assert "normuon_exp_avg_sq" in sd["state"][0]
    ws2 = [torch.nn.Parameter(w.detach().clone()) for w in ws]
    opt2 = GefenMuon([("a", ws2[0]), ("b", ws2[1])], lr=0.02, normuon=True,
                     stochastic_round=True)
    opt2.load_state_dict(sd)
    for i in range(2):
        for w, w2 in zip(ws, ws2, strict=True):
            g = grads(tuple(w.shape), 1, seed=999 + i, dtype=torch.float32)[0]
            w.grad, w2.grad = g.clone(), g.clone()
        opt.step()
        opt2.step()
    for w, w2 in zip(ws, ws2, strict=True):
        assert torch.equal(w, w2)
        for k, v in opt.state[w].items():
            v2 = opt2.state[w2][k]
            assert torch.equal(v, v2) if isinstance(v, torch.Tensor) else v == v2, k
    assert opt2._global_step == opt._global_step


def snapshot(opt):
    state = {id(p): {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                     for k, v in st.items()} for p, st in opt.state.items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return state, groups, opt._global_step, opt._codebook.clone()


def same(a, b):
    sa, ga, ta, ca = a
    sb, gb, tb, cb = b
    if ta != tb or not torch.equal(ca, cb) or ga != gb or sa.keys() != sb.keys():
        return False
    for pid in sa:
        if sa[pid].keys() != sb[pid].keys():
            return False
        for k in sa[pid]:
            x, y = sa[pid][k], sb[pid][k]
            if isinstance(x, torch.Tensor) and not torch.equal(x, y):
                return False
            if not isinstance(x, torch.Tensor) and x != y:
                return False
    return True


def corrupt(sd, fn):
    sd = {"state": {i: dict(e) for i, e in sd["state"].items()},
          "param_groups": [dict(g) for g in sd["param_groups"]],
          **{k: v for k, v in sd.items() if k not in ("state", "param_groups")}}
    fn(sd)
    return sd


@pytest.mark.parametrize(
    ("desc", "fn", "match"),
    [
        ("normuon_shape", lambda sd: sd["state"][0].update(
            normuon_exp_avg_sq=torch.zeros(3, 1)), "normuon_exp_avg_sq"),
        ("normuon_negative", lambda sd: sd["state"][0].update(
            normuon_exp_avg_sq=-torch.ones(16, 1)), "finite and >= 0"),
        ("normuon_step_zero", lambda sd: sd["state"][0].update(normuon_step=0), "normuon_step"),
        ("normuon_half", lambda sd: sd["state"][0].pop("normuon_step"), "needs both"),
        ("second_moment", lambda sd: sd["state"][0].update(
            exp_avg_sq=torch.zeros(1, 1)), "no second moment"),
        ("not_muon", lambda sd: sd["param_groups"][0].pop("ns_coefficients"),
         "not a GefenMuon checkpoint"),
        ("bad_schedule", lambda sd: sd["param_groups"][0].update(
            ns_coefficients=[(1.0, 2.0)]), "exactly 3"),
        ("bad_steps", lambda sd: sd["param_groups"][1].update(ns_steps=3), "ns_steps"),
        ("bad_mode", lambda sd: sd["param_groups"][0].update(sharded_mode="fsdp"),
         "sharded_mode"),
        ("codes_dtype", lambda sd: sd["state"][1].update(
            exp_avg_codes=sd["state"][1]["exp_avg_codes"].float()), "exp_avg_codes"),
    ],
)
def test_malformed_checkpoints_are_rejected_without_mutation(desc, fn, match):
    ws, opt = trained()
    sd = opt.state_dict()
    # two groups so per-group keys can be corrupted independently
    ws_b = [torch.nn.Parameter(w.detach().clone()) for w in ws]
    live = GefenMuon([{"params": [("a", ws_b[0])]}, {"params": [("b", ws_b[1])]}], lr=0.02,
                     normuon=True, stochastic_round=True)
    for w in ws_b:
        w.grad = torch.randn_like(w)
    live.step()
    good = live.state_dict()
    before = snapshot(live)
    bad = corrupt(good, fn)
    with pytest.raises(ValueError, match=match):
        live.load_state_dict(bad)
    assert same(before, snapshot(live)), desc
    assert sd  # the source optimizer's checkpoint is untouched by all this


# ------------------------------------------------------------------ misc


def test_zero_size_matrix_is_skipped():
    w = torch.nn.Parameter(torch.zeros(0, 8))
    v = torch.nn.Parameter(torch.randn(4, 8))
    opt = GefenMuon([w, v], lr=0.01)
    w.grad, v.grad = torch.zeros(0, 8), torch.randn(4, 8)
    opt.step()
    assert len(opt.state[w]) == 0 and "exp_avg_codes" in opt.state[v]


def test_adjusted_ratio_rejects_unknown():
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        adjusted_lr_ratio("bogus", (2, 3))
    assert np.isclose(adjusted_lr_ratio(None, (8, 2)), 2.0)


@pytest.mark.timeout(120)
def test_dtensor_parameters_raise_only_when_they_need_a_sharded_mode():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        mesh = init_device_mesh("cpu", (1,))
        sharded = torch.nn.Parameter(distribute_tensor(torch.randn(8, 16), mesh, [Shard(0)]))
        plain = torch.nn.Parameter(torch.randn(8, 16))
        opt = GefenMuon([("sharded", sharded), ("plain", plain)], lr=0.1,
                        sharded_mode="distributed")
        plain.grad = torch.randn(8, 16)
        opt.step()  # the DTensor has no gradient: nothing needs the sharded mode
        assert "exp_avg_codes" in opt.state[plain]
        sharded.grad = distribute_tensor(torch.randn(8, 16), mesh, [Shard(0)])
        before = plain.detach().clone()
        plain.grad = torch.randn(8, 16)
        with pytest.raises(ValueError, match=r"'sharded'.*sharded_mode='distributed'.*DDP"):
            opt.step()
        assert torch.equal(plain, before)  # refused before any mutation
    finally:
        dist.destroy_process_group()
