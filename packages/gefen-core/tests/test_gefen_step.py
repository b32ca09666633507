"""The step against an independent float64 implementation of docs/algorithm.md#histogram,
docs/algorithm.md#block-second-moment, docs/algorithm.md#factored-second-moment, and the properties
of the step paths (foreach == for-loop, capturable == eager, stochastic rounding)."""

from __future__ import annotations

import copy

import pytest
import torch
from gefen_core_refmath import gefen_step64, histogram

from gefen_core import Gefen
from gefen_core.codebook import optimal_codebook


def _tensors(dtype: torch.dtype = torch.float32, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = {"proj.weight": (16, 24), "rows.weight": (32, 64), "norm.weight": (24,),
              "conv.weight": (4, 6, 8), "scalar": ()}
    return {n: torch.randn(s, generator=gen).to(dtype).requires_grad_() for n, s in shapes.items()}


def _grads(params: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    out = {}
    for name, p in params.items():
        g = torch.randn(p.shape, generator=gen)
        if name == "rows.weight":  # per-row scales give the period search something to find
            g = g * torch.exp(1.5 * torch.randn(p.shape[0], 1, generator=gen))
        out[name] = g.to(p.dtype)
    return out


def _snapshot(opt: Gefen, p: torch.Tensor) -> dict[str, torch.Tensor]:
    return {k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()}


def _check_against_reference(opt: Gefen, params: dict[str, torch.Tensor],
                             pre: dict[str, dict], pre_params: dict[str, torch.Tensor],
                             grads: dict[str, torch.Tensor], group: dict) -> None:
    beta1, beta2 = group["betas"]
    for name, p in params.items():
        st = opt.state[p]
        before = pre[name]
        kwargs = {}
        if "exp_avg_sq_row" in st:
            kwargs["row"] = before.get("exp_avg_sq_row", torch.zeros(p.shape[0]))
            kwargs["col"] = before.get("exp_avg_sq_col", torch.zeros(p.shape[1]))
        else:
            kwargs["exp_avg_sq"] = before.get("exp_avg_sq", torch.zeros_like(st["exp_avg_scale"]))
        ref = gefen_step64(
            pre_params[name], grads[name],
            before.get("exp_avg_codes", torch.zeros_like(st["exp_avg_codes"])),
            before.get("exp_avg_scale", torch.zeros_like(st["exp_avg_scale"])),
            opt._codebook, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
            weight_decay=group["weight_decay"], step=int(st["step"]),
            sq_step=int(st["exp_avg_sq_step"]), maximize=group["maximize"], **kwargs)
        q, q_ref = st["exp_avg_codes"].long(), ref["exp_avg_codes"]
        diff = (q - q_ref).abs()
        # fp32 vs fp64 EMA can move a value sitting on a rounding boundary by one codeword
        # (Appendix B), never further, and only rarely.
        assert int(diff.max()) <= 1, name
        assert int((diff > 0).sum()) <= max(1, q.numel() // 200), name
        torch.testing.assert_close(st["exp_avg_scale"].double(), ref["exp_avg_scale"],
                                   rtol=2e-6, atol=1e-12)
        for key in ("exp_avg_sq", "exp_avg_sq_row", "exp_avg_sq_col"):
            if key in ref:
                torch.testing.assert_close(st[key].double(), ref[key], rtol=2e-6, atol=1e-12)
        same = (diff == 0).reshape(-1)
        got = p.detach().double().reshape(-1)[same]
        want = ref["param"].reshape(-1)[same]
        if p.dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        elif p.dtype == torch.float64:
            # fp64 arithmetic, but the stored state (scale, second moment) is fp32
            # (docs/algorithm.md#state-layout), so the update carries fp32 relative precision: ~1e-7
            # of an update of size ~lr.
            torch.testing.assert_close(got, want, rtol=0.0, atol=1e-8)
        else:  # one rounding of the decayed value and one of the result
            tol = 2 * torch.finfo(p.dtype).eps
            torch.testing.assert_close(got, want, rtol=tol, atol=1e-5)


@pytest.mark.parametrize("factored", [True, False], ids=["factored", "block"])
@pytest.mark.parametrize("maximize,weight_decay", [(False, 0.1), (True, 0.0)])
def test_step_matches_float64_reference(factored: bool, maximize: bool,
                                        weight_decay: float) -> None:
    params = _tensors()
    opt = Gefen(list(params.items()), lr=1e-2, betas=(0.9, 0.99), eps=1e-8,
                weight_decay=weight_decay, maximize=maximize, factored_v_2d=factored,
                min_dim_size_to_factor=0)
    group = opt.param_groups[0]
    for step in range(6):
        grads = _grads(params, step)
        for name, p in params.items():
            p.grad = grads[name]
        pre = {n: _snapshot(opt, p) for n, p in params.items()}
        pre_params = {n: p.detach().clone() for n, p in params.items()}
        opt.step()
        if step == 0:
            # The codebook comes from every tensor's first gradient, each binned with its
            # own period (docs/algorithm.md#codebook, docs/algorithm.md#histogram), through the
            # exact solver.
            counts = sum(histogram(grads[n], opt.state[p]["period"])
                         for n, p in params.items())
            assert torch.equal(opt._codebook, optimal_codebook(counts))
        _check_against_reference(opt, params, pre, pre_params, grads, group)
    assert opt._global_step == 6
    assert all(int(opt.state[p]["step"]) == 6 for p in params.values())
    modes = {n: "exp_avg_sq_row" in opt.state[p] for n, p in params.items()}
    assert modes["proj.weight"] is factored and modes["rows.weight"] is factored
    assert not modes["norm.weight"] and not modes["conv.weight"] and not modes["scalar"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_low_and_high_precision_parameters(dtype: torch.dtype) -> None:
    params = _tensors(dtype)
    opt = Gefen(list(params.items()), lr=1e-2, weight_decay=0.05)
    for step in range(3):
        grads = _grads(params, step)
        for name, p in params.items():
            p.grad = grads[name]
        pre = {n: _snapshot(opt, p) for n, p in params.items()}
        pre_params = {n: p.detach().clone() for n, p in params.items()}
        opt.step()
        _check_against_reference(opt, params, pre, pre_params, grads, opt.param_groups[0])
    for p in params.values():
        assert p.dtype == dtype
        st = opt.state[p]
        assert st["exp_avg_codes"].dtype == torch.uint8
        assert st["exp_avg_scale"].dtype == torch.float32


def test_always_zero_rows_and_columns_do_not_drift() -> None:
    w = torch.randn(8, 12, requires_grad=True)
    start = w.detach().clone()
    opt = Gefen([w], lr=1e-2, weight_decay=0.0, min_dim_size_to_factor=0)
    gen = torch.Generator().manual_seed(3)
    for _ in range(10):
        g = torch.randn(8, 12, generator=gen)
        g[3, :] = 0
        g[:, 5] = 0
        w.grad = g
        opt.step()
    assert "exp_avg_sq_row" in opt.state[w]
    assert torch.equal(w.detach()[3], start[3])
    assert torch.equal(w.detach()[:, 5], start[:, 5])
    assert not torch.equal(w.detach()[0], start[0])


def _run(kwargs: dict, steps: int = 4, seed: int = 0) -> tuple[dict, Gefen]:
    params = _tensors(seed=seed)
    opt = Gefen(list(params.items()), lr=1e-2, **kwargs)
    for step in range(steps):
        for name, g in _grads(params, step).items():
            params[name].grad = g
        opt.step()
    return params, opt


@pytest.mark.parametrize("stochastic_round", [False, True])
def test_foreach_and_capturable_are_bit_identical_to_the_for_loop(stochastic_round: bool) -> None:
    # Under capturable the seeds are computed on device from the int64 step mirror and the
    # bias corrections from device counters; both must give the host path's bits.
    sr = {"stochastic_round": stochastic_round}
    ref, ref_opt = _run({"foreach": False, **sr})
    for kwargs in ({"foreach": True}, {"capturable": True}, {"capturable": True, "foreach": True}):
        got, opt = _run({**kwargs, **sr})
        for name in ref:
            assert torch.equal(ref[name], got[name]), (kwargs, name)
            for key, value in ref_opt.state[ref[name]].items():
                other = opt.state[got[name]][key]
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(other).cpu()), key


def test_capturable_seeds_of_a_step_are_mixed_in_one_launch_with_the_host_values() -> None:
    # The per-tensor seeds (T * MIX) xor salt of a capturable step come from one device op
    # over a salts table; each slot gets a [1] view with the value the host formula gives.
    from gefen_core.optimizer import mix_seed, name_salt

    w = torch.zeros(8, 8, requires_grad=True)
    opt = Gefen([("w", w)], lr=1e-2, capturable=True)
    opt._global_step = 123456789
    names = ["a.weight", "b.bias", "c", "a.weight"]
    lists: tuple[list, list] = ([None, None], [None, None])
    slots = [(lists[i % 2], i // 2, name_salt(n)) for i, n in enumerate(names)]
    opt._fill_device_seeds(torch.device("cpu"), slots)
    for (seed_list, at, salt), name in zip(slots, names):
        assert seed_list[at].shape == (1,) and seed_list[at].dtype == torch.int64
        assert int(seed_list[at]) == mix_seed(opt._global_step, salt), name
    assert lists[0][0].data_ptr() != lists[0][1].data_ptr()  # views of one table, not aliases
    assert len(opt._salt_tensors) == 1  # kept for the same tensors' next step (a graph)
    opt._fill_device_seeds(torch.device("cpu"), slots)
    assert len(opt._salt_tensors) == 1
    # Other lists of stepped tensors: the first few get a table, the rest mix their seeds per
    # tensor (the same values), so the tables stay bounded.
    from gefen_core._seeds import _SALT_TABLES

    for extra in range(_SALT_TABLES + 3):
        more = [([None], 0, name_salt(f"t{extra}.{i}")) for i in range(3)]
        opt._fill_device_seeds(torch.device("cpu"), more)
        for seed_list, at, salt in more:
            assert int(seed_list[at]) == mix_seed(opt._global_step, salt)
    assert len(opt._salt_tensors) == _SALT_TABLES


def test_stochastic_rounding_is_seeded_salted_and_differs_from_nearest() -> None:
    nearest, _ = _run({})
    sr_a, opt_a = _run({"stochastic_round": True})
    sr_b, _ = _run({"stochastic_round": True})
    assert all(torch.equal(sr_a[n], sr_b[n]) for n in sr_a)  # same seeds, same result
    assert any(not torch.equal(sr_a[n], nearest[n]) for n in sr_a)
    # O7: two same-shaped tensors with identical gradients get different dither patterns.
    a = torch.zeros(64, 32, requires_grad=True)
    b = torch.zeros(64, 32, requires_grad=True)
    opt = Gefen([("a", a), ("b", b)], lr=1e-2, stochastic_round=True, factored_v_2d=False)
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        g = torch.randn(64, 32, generator=gen)
        a.grad, b.grad = g.clone(), g.clone()
        opt.step()
    assert not torch.equal(opt.state[a]["exp_avg_codes"], opt.state[b]["exp_avg_codes"])


def test_stochastic_rounding_is_unbiased_through_the_optimizer() -> None:
    # One step from zero state: m = (1 - beta1) g, z = m / max|m| per block. Over many salts
    # (one per parameter name) the mean dequantized code must equal z within the sampling error
    # of its codeword bracket [c_L, c_R] (docs/algorithm.md#quantizer: E[c_q] = z), and the samples
    # must vary.
    g = torch.randn(4, 64, generator=torch.Generator().manual_seed(9))
    n = 64
    samples = []
    for k in range(n):
        w = torch.zeros(4, 64, requires_grad=True)
        opt = Gefen([(f"w{k}", w)], lr=0.0, stochastic_round=True, factored_v_2d=False)
        w.grad = g.clone()
        opt.step()
        st = opt.state[w]
        samples.append(opt._codebook[st["exp_avg_codes"].long()].reshape(-1).double())
    c = opt._codebook.double()
    period = opt.state[w]["period"]
    omb1 = float(torch.tensor(1.0, dtype=torch.float32) - torch.tensor(0.9, dtype=torch.float32))
    m = (g.double() * omb1).reshape(-1, period)
    z = (m / m.abs().amax(dim=1, keepdim=True)).reshape(-1)
    right = torch.searchsorted(c, z).clamp(0, 255)
    left = (right - 1).clamp(min=0)
    width = c[right] - c[left]
    stack = torch.stack(samples)
    mean = stack.mean(0)
    assert ((stack == c[left]) | (stack == c[right])).all()  # always a bracket endpoint
    assert (mean - z).abs().le(4.0 * width / (2 * n ** 0.5) + 1e-6).all()
    assert (stack.std(0) > 0).float().mean() > 0.5  # salts give independent draws


def test_closure_runs_before_the_codebook_is_learned() -> None:
    w = torch.randn(16, 8, requires_grad=True)
    target = torch.randn(16, 8)
    seen = []

    def closure() -> torch.Tensor:
        seen.append(Gefen_codebook(opt))
        w.grad = None
        loss = ((w - target) ** 2).sum()
        loss.backward()
        return loss

    def Gefen_codebook(o: Gefen):  # noqa: N802 - helper reading private state
        return o._codebook

    opt = Gefen([w], lr=1e-2)
    w.grad = torch.full_like(w, float("nan"))  # stale: would defer learning if used
    loss = opt.step(closure)
    assert seen == [None] and opt._codebook is not None
    assert torch.isfinite(loss) and opt._global_step == 1
    copy.deepcopy(opt)  # a stepped optimizer stays copyable
