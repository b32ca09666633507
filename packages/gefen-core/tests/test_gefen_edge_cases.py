"""Required edge-case behaviour (docs/algorithm.md#step) and the structural preflight
(docs/algorithm.md#step C)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from gefen_core import Gefen


def _grad_like(p: torch.Tensor, seed: int) -> torch.Tensor:
    return torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)).to(p.dtype)


def _assert_unchanged(opt: Gefen, params: list[torch.Tensor], before: dict) -> None:
    assert opt._global_step == before["T"]
    assert (opt._codebook is None) == (before["codebook"] is None)
    for p, ref in zip(params, before["params"]):
        assert torch.equal(p.detach(), ref)
    assert {id(p): {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()}
            for p, s in opt.state.items()}.keys() == before["state"].keys()


def _capture(opt: Gefen, params: list[torch.Tensor]) -> dict:
    return {"T": opt._global_step, "codebook": opt._codebook,
            "params": [p.detach().clone() for p in params],
            "state": {id(p): dict(s) for p, s in opt.state.items()}}


def test_zero_numel_is_skipped_forever_and_numel_one_gets_period_one() -> None:
    empty = torch.zeros(0, 5, requires_grad=True)
    one = torch.ones(1, requires_grad=True)
    other = torch.randn(12, requires_grad=True)
    opt = Gefen([("empty", empty), ("one", one), ("other", other)], lr=0.1)
    for step in range(3):
        for p in (empty, one, other):
            p.grad = _grad_like(p, step)
        opt.step()
    assert empty not in opt.state or not opt.state[empty]
    assert opt.state[one]["period"] == 1 and opt.state[one]["exp_avg_codes"].shape == (1, 1)
    # numel 1: the momentum is exact (codes are +-1 times the element's own scale).
    assert opt.state[one]["exp_avg_codes"].item() in (0, 255)
    assert not torch.equal(one.detach(), torch.ones(1))


@pytest.mark.parametrize("shape", [(), (7,), (13,), (3, 5), (2, 3, 4), (2, 3, 2, 2),
                                   (1, 2, 3, 2, 2), (101,)],
                         ids=lambda s: f"{len(s)}d_{'x'.join(map(str, s)) or 'scalar'}")
def test_every_rank_and_prime_numel(shape: tuple[int, ...]) -> None:
    p = torch.randn(shape, requires_grad=True)
    start = p.detach().clone()
    opt = Gefen([p], lr=0.05)
    for step in range(3):
        p.grad = _grad_like(p, step)
        opt.step()
    st = opt.state[p]
    n = p.numel()
    assert n % st["period"] == 0
    assert st["exp_avg_codes"].shape == (n // st["period"], st["period"])
    # docs/algorithm.md#factoring-rule: matrices with a side below 128 keep the per-block form.
    assert ("exp_avg_sq_row" in st) == (len(shape) == 2 and min(shape) >= 128)
    assert p.shape == shape and not torch.equal(p.detach(), start)


def _twin_runs(make_param, make_grad, steps: int = 3):
    """Run a layout-quirky parameter and a plain contiguous twin; return both."""
    quirky = make_param()
    plain = quirky.detach().clone().contiguous().requires_grad_()
    opt_q = Gefen([("w", quirky)], lr=0.05)
    opt_p = Gefen([("w", plain)], lr=0.05)
    for step in range(steps):
        g = make_grad(step)
        quirky.grad = g
        plain.grad = g.contiguous().clone()
        opt_q.step()
        opt_p.step()
    return quirky, plain, opt_q, opt_p


def test_channels_last_parameter_follows_logical_order() -> None:
    def make() -> torch.Tensor:
        w = torch.randn(4, 3, 2, 2).to(memory_format=torch.channels_last)
        return w.requires_grad_()

    def grad(step: int) -> torch.Tensor:
        g = torch.randn(4, 3, 2, 2, generator=torch.Generator().manual_seed(step))
        return g.to(memory_format=torch.channels_last)

    quirky, plain, opt_q, opt_p = _twin_runs(make, grad)
    assert quirky.is_contiguous(memory_format=torch.channels_last)  # layout preserved
    assert torch.equal(quirky.detach(), plain.detach())
    assert torch.equal(opt_q.state[quirky]["exp_avg_codes"], opt_p.state[plain]["exp_avg_codes"])


def test_non_contiguous_parameter_and_gradient() -> None:
    base = torch.randn(6, 10)

    def make() -> torch.Tensor:
        return base.clone().t().requires_grad_()  # [10, 6] transposed view of its storage

    def grad(step: int) -> torch.Tensor:
        return torch.randn(6, 10, generator=torch.Generator().manual_seed(step)).t()

    quirky, plain, _, _ = _twin_runs(make, grad)
    assert not quirky.is_contiguous()
    assert torch.equal(quirky.detach(), plain.detach())


def test_stride_zero_gradient() -> None:
    def make() -> torch.Tensor:
        return torch.randn(8, 16).requires_grad_()

    def grad(step: int) -> torch.Tensor:
        row = torch.randn(16, generator=torch.Generator().manual_seed(step))
        return row.expand(8, 16)  # stride (0, 1)

    quirky, plain, _, _ = _twin_runs(make, grad)
    assert torch.equal(quirky.detach(), plain.detach())


def test_tied_parameters_are_stepped_once() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight

    model = Tied()
    opt = Gefen(model.named_parameters(), lr=0.05)
    assert opt.param_groups[0]["param_names"] == ["emb.weight"]
    x = torch.tensor([1, 2, 3])
    model.head(model.emb(x)).sum().backward()
    opt.step()
    assert int(opt.state[model.emb.weight]["step"]) == 1
    with pytest.raises(ValueError, match="twice"):
        Gefen(list(model.named_parameters(remove_duplicate=False)))


def test_absent_gradients_skip_the_parameter_entirely() -> None:
    a = torch.randn(8, requires_grad=True)
    b = torch.randn(8, requires_grad=True)
    opt = Gefen([("a", a), ("b", b)], lr=0.05, weight_decay=0.5)
    a.grad, b.grad = _grad_like(a, 0), _grad_like(b, 0)
    opt.step()
    b_after_first = b.detach().clone()
    b_state = {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[b].items()}
    b.grad = None
    for step in range(1, 4):
        a.grad = _grad_like(a, step)
        opt.step()
    assert torch.equal(b.detach(), b_after_first)  # no decay, no update
    for k, v in opt.state[b].items():
        assert torch.equal(torch.as_tensor(v), torch.as_tensor(b_state[k])), k
    assert int(opt.state[a]["step"]) == 4 and int(opt.state[b]["step"]) == 1
    assert opt._global_step == 4


def test_frozen_then_unfrozen_parameter_gets_its_period_later() -> None:
    a = torch.randn(16, requires_grad=True)
    frozen = torch.randn(4, 8, requires_grad=False)
    opt = Gefen([("a", a), ("late", frozen)], lr=0.05)
    a.grad = _grad_like(a, 0)
    opt.step()
    codebook = opt._codebook.clone()
    assert frozen not in opt.state or not opt.state[frozen]
    frozen.requires_grad_(True)
    frozen.grad = _grad_like(frozen, 1)
    a.grad = _grad_like(a, 1)
    opt.step()
    assert torch.equal(opt._codebook, codebook)  # not relearned for the late parameter
    st = opt.state[frozen]
    assert st["period"] >= 1 and int(st["step"]) == 1 and int(opt.state[a]["step"]) == 2


def test_step_without_any_gradient() -> None:
    w = torch.randn(5, requires_grad=True)
    opt = Gefen([w])
    start = w.detach().clone()
    assert opt.step() is None
    assert torch.equal(w.detach(), start) and opt._codebook is None and not opt.state[w]
    w.grad = _grad_like(w, 0)
    opt.step()
    assert opt._codebook is not None and int(opt.state[w]["step"]) == 1


def test_mixed_dtypes_in_one_optimizer_keep_fp32_state() -> None:
    ps = [torch.randn(8, 4, dtype=dt, requires_grad=True)
          for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float64)]
    opt = Gefen(ps, lr=0.05, factored_v_2d=False)
    for step in range(2):
        for p in ps:
            p.grad = _grad_like(p, step)
        opt.step()
    for p in ps:
        st = opt.state[p]
        assert st["exp_avg_codes"].dtype == torch.uint8
        assert st["exp_avg_scale"].dtype == st["exp_avg_sq"].dtype == torch.float32
        assert st["step"].dtype == torch.float32 and st["step"].device.type == "cpu"


def test_non_finite_first_gradient_defers_codebook_learning() -> None:
    w = torch.randn(8, 4, requires_grad=True)
    opt = Gefen([w], lr=0.05)
    before = _capture(opt, [w])
    w.grad = _grad_like(w, 0)
    w.grad[1, 2] = float("inf")
    with pytest.warns(RuntimeWarning, match="deferred"):
        opt.step()
    _assert_unchanged(opt, [w], before)
    assert opt._codebook is None
    w.grad = _grad_like(w, 1)
    opt.step()
    assert opt._codebook is not None and opt._global_step == 1


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_finiteness_check_finds_every_non_finite_value(device: str, bad: float) -> None:
    # The check is a multi-tensor inf-norm per (device, dtype) on CUDA; its verdict must be
    # isfinite().all() over every tensor, wherever the value sits, for every float dtype,
    # with empty gradients in the list and finite values near each dtype's largest.
    gen = torch.Generator().manual_seed(0)
    grads = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for n in (0, 1, 4097, 100_003):
            grads.append((torch.randn(n, generator=gen) * 100).to(device, dtype))
        grads.append(torch.full((7,), torch.finfo(dtype).max, dtype=dtype, device=device))
    assert Gefen._all_finite(grads)
    for t, g in enumerate(grads):
        for pos in sorted({0, g.numel() // 2, g.numel() - 1}) if g.numel() else ():
            saved = g.view(-1)[pos].clone()
            g.view(-1)[pos] = bad
            assert not Gefen._all_finite(grads), (t, g.dtype, g.numel(), pos)
            assert not all(bool(torch.isfinite(x).all()) for x in grads)  # the reference
            g.view(-1)[pos] = saved
    assert Gefen._all_finite(grads)


class _GradOverride(torch.Tensor):
    """A parameter whose ``.grad`` reads a stored tensor, to feed the preflight gradients that
    autograd's own ``.grad`` setter would refuse (wrong dtype, shape or device)."""

    fake_grad: torch.Tensor | None = None

    @property
    def grad(self):  # noqa: ANN201
        return self.fake_grad


def _override(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.Tensor._make_subclass(_GradOverride, torch.randn(shape), True)


@pytest.mark.parametrize("bad,match", [
    (lambda: torch.zeros(4, 3, dtype=torch.complex64), "complex gradient"),
    (lambda: torch.zeros(3, 4), r"shape \(3, 4\) but the parameter has \(4, 3\)"),
    (lambda: torch.zeros(4, 3, device="meta"), "is on meta but the parameter is on cpu"),
    (lambda: torch.zeros(4, 3).to_sparse(), "sparse_coo gradient"),
])
def test_preflight_refuses_bad_gradients_before_any_mutation(bad, match: str) -> None:  # noqa: ANN001
    good = torch.randn(16, requires_grad=True)
    odd = _override((4, 3))
    opt = Gefen([("good", good), ("odd.weight", odd)], lr=0.05)
    good.grad = _grad_like(good, 0)
    odd.fake_grad = torch.randn(4, 3)
    opt.step()
    before = _capture(opt, [good, odd])
    snapshot = copy.deepcopy({id(p): s for p, s in opt.state.items()})
    good.grad = _grad_like(good, 1)
    odd.fake_grad = bad()
    with pytest.raises(RuntimeError, match=r"'odd\.weight'.*" + match):
        opt.step()
    _assert_unchanged(opt, [good, odd], before)
    for p, s in opt.state.items():
        for k, v in s.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(snapshot[id(p)][k]))


def test_sparse_gradient_through_autograd() -> None:
    emb = nn.Embedding(10, 4, sparse=True)
    opt = Gefen(emb.named_parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="'weight' has a torch.sparse_coo gradient"):
        opt.step()
    assert not opt.state[emb.weight]


def test_no_warnings_in_a_plain_step() -> None:
    w = torch.randn(8, 8, requires_grad=True)
    opt = Gefen([w])
    w.grad = _grad_like(w, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()


def test_period_one_gates() -> None:
    def periods(**kwargs) -> dict[str, int]:  # noqa: ANN003
        shapes = {"layer.Bias": (64,), "w": (32, 64), "conv": (8, 4, 4, 4)}
        ps = {n: torch.randn(s, requires_grad=True) for n, s in shapes.items()}
        opt = Gefen(list(ps.items()), **kwargs)
        for i, p in enumerate(ps.values()):
            p.grad = _grad_like(p, i)
        opt.step()
        return {n.lower(): opt.state[p]["period"] for n, p in ps.items()}

    free = periods()
    assert all(p > 1 for p in free.values())  # the memory-safe fallback never leaves P = 1
    assert periods(force_1d_period_one=True) == {**free, "layer.bias": 1}
    assert periods(force_2d_period_one=True) == {**free, "w": 1}
    assert periods(period_one_substrings=("BIAS", "conv")) == {**free, "layer.bias": 1, "conv": 1}


def test_period_search_error_names_the_parameter_and_changes_nothing() -> None:
    # A finite gradient whose squares overflow fp32 has no log-contrast period
    # (docs/algorithm.md#period-search): the first step's batched search refuses it by the
    # parameter's name, before any state.
    ps = {n: torch.randn(s, requires_grad=True) for n, s in
          {"a.weight": (16, 32), "b.weight": (16, 32), "c.bias": (32,)}.items()}
    opt = Gefen(list(ps.items()))
    for i, p in enumerate(ps.values()):
        p.grad = _grad_like(p, i)
    ps["b.weight"].grad[3, 5] = 1e30
    before = {n: p.detach().clone() for n, p in ps.items()}
    with pytest.raises(ValueError, match=r"^b\.weight: grad has NaN or Inf values"):
        opt.step()
    assert not opt.state and opt._codebook is None
    assert all(torch.equal(before[n], p) for n, p in ps.items())


def test_period_search_variant_reaches_the_search() -> None:
    # Appendix B: a 64x512 matrix of normals with log-normal (sigma 1.5) row scales: the
    # log-contrast search finds the rows (512); the variance search finds nothing and the
    # memory-safe fallback picks the largest divisor <= 2048.
    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(64, 512, generator=gen) * torch.exp(1.5 * torch.randn(64, 1, generator=gen))
    found = {}
    for variant in ("log_contrast", "variance"):
        w = torch.zeros(64, 512, requires_grad=True)
        opt = Gefen([w], period_search=variant)
        w.grad = grad.clone()
        opt.step()
        found[variant] = opt.state[w]["period"]
    assert found == {"log_contrast": 512, "variance": 2048}
