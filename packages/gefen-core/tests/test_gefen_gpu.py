"""Gefen on CUDA: dispatch to the fused kernels, parity with the reference ops, CUDA-graph
capture with ``capturable=True``, and same-device resume. Skipped only when CUDA is absent."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch

from gefen_core import Gefen

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _params(dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    shapes = {"proj.weight": (256, 384), "norm.weight": (384,), "conv.weight": (32, 16, 3, 3),
              "odd": (4097,)}
    return [(n, torch.randn(s, generator=gen).to("cuda", dtype).requires_grad_())
            for n, s in shapes.items()]


def _feed(params: list[tuple[str, torch.Tensor]], step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for _, p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.device, p.dtype)


def _assert_runs_equal(runs: list[tuple[list[tuple[str, torch.Tensor]], Gefen]]) -> None:
    """Two runs end with the same parameters and state, bit for bit."""
    (pa, oa), (pb, ob) = runs
    for (name, a), (_, b) in zip(pa, pb):
        assert torch.equal(a, b), name
        for key, value in oa.state[a].items():
            other = ob.state[b][key]
            same = torch.equal(value, other) if isinstance(value, torch.Tensor) else \
                value == other
            assert same, f"{name} {key}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_path_is_taken_and_matches_the_reference(dtype: torch.dtype) -> None:
    import gefen_kernels

    if not gefen_kernels.triton_available():
        pytest.fail("CUDA is present but Triton is not: the fused path cannot be tested")
    fused_params = _params(dtype)
    ref_params = [(n, p.detach().clone().requires_grad_()) for n, p in fused_params]
    fused = Gefen(fused_params, lr=1e-2, weight_decay=0.1)
    ref = Gefen(ref_params, lr=1e-2, weight_decay=0.1, fused=False)
    assert set(fused.step_paths().values()) == {"fused"}
    assert set(ref.step_paths().values()) == {"foreach"}
    for step in range(3):
        _feed(fused_params, step)
        _feed(ref_params, step)
        fused.step()
        ref.step()
    assert torch.equal(fused._codebook, ref._codebook)
    for (name, a), (_, b) in zip(fused_params, ref_params):
        qa = fused.state[a]["exp_avg_codes"].long()
        qb = ref.state[b]["exp_avg_codes"].long()
        assert int((qa - qb).abs().max()) <= 1, name  # Appendix B: equal or adjacent
        assert int((qa != qb).sum()) <= max(1, qa.numel() // 100), name
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_explicit_fused_on_cuda_constructs() -> None:
    params = _params(torch.float32)
    opt = Gefen(params, fused=True)
    assert set(opt.step_paths().values()) == {"fused"}
    with pytest.raises(RuntimeError, match="fused=True cannot be honoured"):
        Gefen([torch.zeros(3, dtype=torch.float64, device="cuda", requires_grad=True)],
              fused=True)


def test_cuda_graph_capture_matches_eager_capturable_steps() -> None:
    eager_params = _params(torch.float32)
    graph_params = [(n, p.detach().clone().requires_grad_()) for n, p in eager_params]
    eager = Gefen(eager_params, lr=torch.tensor(1e-2, device="cuda"), capturable=True)
    graphed = Gefen(graph_params, lr=torch.tensor(1e-2, device="cuda"), capturable=True)
    _feed(eager_params, 0)
    _feed(graph_params, 0)
    eager.step()
    graphed.step()  # period search and codebook learning happen eagerly, before capture
    static = [p.grad for _, p in graph_params]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        graphed.step()  # warm-up on the side stream, as torch's graph recipe asks
    torch.cuda.current_stream().wait_stream(side)
    for (_, p), g in zip(eager_params, static):  # the eager twin repeats the warm-up step
        p.grad = g.clone()
    eager.step()
    from gefen_kernels.ops.step_groups import StepGroups

    captured = []
    real = StepGroups.launch_staged

    def spy(self, grads, buffer, scalars, seeds, *, device_scalars=False):  # type: ignore[no-untyped-def]
        captured.append((self, device_scalars))
        return real(self, grads, buffer, scalars, seeds, device_scalars=device_scalars)

    graph = torch.cuda.CUDAGraph()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(StepGroups, "launch_staged", spy)
        with torch.cuda.graph(graph):
            graphed.step()
    # The capture took the grouped launches, and keeps their tables for the replays.
    assert [flag for _, flag in captured] == [True]
    codes0 = graphed.state[graph_params[0][1]]["exp_avg_codes"]
    kept = importlib.import_module("gefen_kernels.ops.fused_step")._CAPTURED_GROUPS[codes0]
    assert any(g is captured[0][0] for g in kept)
    for step in range(2, 5):
        _feed(eager_params, step)
        for (_, p), (_, q) in zip(eager_params, graph_params):
            q.grad.copy_(p.grad)
        eager.step()
        graph.replay()
    torch.cuda.synchronize()
    for (_, a), (_, b) in zip(eager_params, graph_params):
        assert torch.equal(a, b)
    assert graphed.state_dict()["gefen_meta"]["global_step"] == eager._global_step


@pytest.mark.parametrize("stochastic_round", [False, True])
def test_capturable_steps_take_grouped_launches_bit_identical_to_per_tensor(
        monkeypatch: pytest.MonkeyPatch, stochastic_round: bool) -> None:
    """capturable=True steps assemble their scalars and seeds on the device and take the
    grouped launches (a few launches for the list, which a captured graph then replays), with
    the bits of the per-tensor capturable launches."""
    from gefen_kernels.ops.step_groups import StepGroups

    grouped_calls = []
    real = StepGroups.launch_staged

    def spy(self, grads, buffer, scalars, seeds, *, device_scalars=False):  # type: ignore[no-untyped-def]
        grouped_calls.append(device_scalars)
        return real(self, grads, buffer, scalars, seeds, device_scalars=device_scalars)

    monkeypatch.setattr(StepGroups, "launch_staged", spy)
    runs = []
    for grouped in (True, False):
        if not grouped:
            monkeypatch.setattr(importlib.import_module("gefen_kernels.ops.fused_step"),
                                "_grouped_capturable", lambda *a, **k: False)
        params = _params(torch.bfloat16)
        opt = Gefen(params, lr=1e-2, weight_decay=0.1, capturable=True,
                    stochastic_round=stochastic_round)
        for step in range(4):
            _feed(params, step)
            opt.step()
        runs.append((params, opt))
        if grouped:
            assert grouped_calls == [True] * 4
    assert grouped_calls == [True] * 4  # the per-tensor run launched no group
    _assert_runs_equal(runs)


def test_same_device_resume_is_bit_identical_on_cuda() -> None:
    params = _params(torch.bfloat16)
    opt = Gefen(params, lr=1e-2)
    for step in range(2):
        _feed(params, step)
        opt.step()
    saved = [p.detach().clone() for _, p in params]
    sd = copy.deepcopy(opt.state_dict())
    for step in range(2, 4):
        _feed(params, step)
        opt.step()
    resumed = [(n, s.clone().requires_grad_()) for (n, _), s in zip(params, saved)]
    opt2 = Gefen(resumed, lr=1e-2)
    opt2.load_state_dict(sd)
    for step in range(2, 4):
        _feed(resumed, step)
        opt2.step()
    for (_, a), (_, b) in zip(params, resumed):
        assert torch.equal(a, b)


def test_deterministic_runs_are_bit_identical() -> None:
    results = []
    for _ in range(2):
        params = _params(torch.float32)
        opt = Gefen(params, lr=1e-2, deterministic=True)
        for step in range(3):
            _feed(params, step)
            opt.step()
        results.append([p.detach().clone() for _, p in params])
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("stochastic_round", [False, True])
def test_grouped_launches_equal_one_launch_per_tensor(stochastic_round: bool,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The eager fused step launches whole classes of tensors at once
    (``gefen_kernels.ops.step_groups``); with that replaced by one plan launch per tensor the
    optimizer ends bit-identical (parameters and state), mixed dtypes and modes included."""
    from gefen_core import _steady_step

    fused = importlib.import_module("gefen_kernels.ops.fused_step")

    # Every step through the full path, so that every step takes the launcher under test.
    monkeypatch.setattr(_steady_step, "build", lambda *args: None)

    def per_tensor(grouped, host, seeds, *, anchor):  # type: ignore[no-untyped-def]
        for plan, g, i in grouped:
            lr, bc1, bc2, decay = host[i].lr, host[i].bc1_recip, host[i].bc2, host[i].decay
            plan.launch(g, lr=lr, bc1_recip=bc1, bc2=bc2, decay=decay,
                        seed=0 if seeds is None else seeds[i])

    calls = []
    grouped_launch = fused._grouped_launch

    def spy(grouped, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(len(grouped))
        grouped_launch(grouped, *args, **kwargs)

    runs = []
    for launcher in (spy, per_tensor):
        monkeypatch.setattr(fused, "_grouped_launch", launcher)
        gen = torch.Generator().manual_seed(7)
        params = _params(torch.bfloat16) + [
            ("head", torch.randn(96, 256, generator=gen).cuda().requires_grad_()),
            ("bias", torch.randn(96, generator=gen).to("cuda", torch.float16).requires_grad_())]
        opt = Gefen(params, lr=1e-2, weight_decay=0.1, stochastic_round=stochastic_round)
        for step in range(4):
            _feed(params, step)
            opt.step()
        runs.append((params, opt))
    assert calls and min(calls) >= 4, calls  # the first run did group its tensors
    _assert_runs_equal(runs)


@pytest.mark.parametrize("stochastic_round", [False, True])
def test_steady_steps_equal_full_steps_on_cuda(stochastic_round: bool,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The steady-state step (``gefen_core._steady_step``) repeats the full step's grouped
    launches without rebuilding them: bit-identical parameters and state to an optimizer that
    takes the full step every time, with gradients freed and re-allocated every step."""
    from gefen_core import _steady_step

    hits = []
    run = _steady_step.SteadyStep.run

    def counted(self, opt):  # type: ignore[no-untyped-def]
        hits.append(run(self, opt))
        return hits[-1]

    monkeypatch.setattr(_steady_step.SteadyStep, "run", counted)
    runs = []
    for steady in (True, False):
        gen = torch.Generator().manual_seed(7)
        params = _params(torch.bfloat16) + [
            ("bias", torch.randn(96, generator=gen).to("cuda", torch.float16).requires_grad_())]
        opt = Gefen(params, lr=1e-2, weight_decay=0.1, stochastic_round=stochastic_round)
        for step in range(6):
            _feed(params, step)
            if not steady:
                opt._steady = None
            opt.step()
            opt.zero_grad(set_to_none=True)
        runs.append((params, opt))
    assert hits == [True] * 5, hits
    _assert_runs_equal(runs)


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("factored_v_2d", [True, False])
def test_model_on_a_device_other_than_the_current_one(factored_v_2d: bool) -> None:
    """``model.to("cuda:1")`` without ``set_device``: the first step (period search,
    histogram, first update) and the steady steps launch on the parameters' device and give
    the bits of the same run on ``cuda:0``."""
    assert torch.cuda.current_device() == 0
    runs = []
    for dev in ("cuda:0", "cuda:1"):
        params = [(n, p.detach().to(dev).requires_grad_()) for n, p in _params(torch.bfloat16)]
        opt = Gefen(params, lr=1e-3, factored_v_2d=factored_v_2d)
        for step in range(4):
            _feed(params, step)
            opt.step()
        assert torch.cuda.current_device() == 0
        runs.append((params, opt))
    (pa, oa), (pb, ob) = runs
    for (name, a), (_, b) in zip(pa, pb):
        assert b.device == torch.device("cuda:1") and torch.equal(a.cpu(), b.cpu()), name
        for key, value in oa.state[a].items():
            other = ob.state[b][key]
            same = torch.equal(value.cpu(), other.cpu()) if isinstance(value, torch.Tensor) \
                else value == other
            assert same, f"{name} {key}"
