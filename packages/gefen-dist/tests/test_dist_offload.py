"""State offload (docs/algorithm.md#distributed): fail-closed checks and all-or-nothing moves.

The CPU tests move state to the ``meta`` device as a stand-in for a second device and inject
copy failures; the GPU test checks offloaded stepping is bit-identical to ordinary stepping.
"""

from __future__ import annotations

import pytest
import torch

import gefen_dist.offload as offload
from gefen_dist import move_state_, offload_state_, restore_state_, state_offload_active


def _stepped_optimizer(device: str = "cpu", steps: int = 2, **kwargs):
    from gefen_core import Gefen

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    model.to(device)
    opt = Gefen(model.named_parameters(), lr=1e-2, **kwargs)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        x = torch.randn(8, 16, generator=gen).to(device)
        model(x).square().mean().backward()
        opt.step()
    return model, opt


def _snapshot(opt):
    return {id(p): {k: (v, v.clone() if isinstance(v, torch.Tensor) and not v.is_meta else v)
                    for k, v in st.items()} for p, st in opt.state.items()}


def _assert_unchanged(opt, snap):
    for p, st in opt.state.items():
        before = snap[id(p)]
        assert set(st) == set(before)
        for k, v in st.items():
            obj, value = before[k]
            assert v is obj, f"{k} was replaced"
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, value)


def test_move_state_is_all_or_nothing(monkeypatch):
    _, opt = _stepped_optimizer()
    snap = _snapshot(opt)
    real = offload._copy_to
    calls = {"n": 0}

    def failing(t, device, pin):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected copy failure")
        return real(t, device, pin)

    monkeypatch.setattr(offload, "_copy_to", failing)
    with pytest.raises(RuntimeError, match="injected"):
        move_state_(opt, "meta")
    assert calls["n"] == 3
    _assert_unchanged(opt, snap)
    monkeypatch.setattr(offload, "_copy_to", real)
    move_state_(opt, "meta")
    moved = [v for st in opt.state.values() for v in st.values()
             if isinstance(v, torch.Tensor) and v.ndim > 0]
    assert moved and all(v.is_meta for v in moved)
    # Counters stay host tensors (docs/algorithm.md#state-layout), only the state tensors move.
    assert all(st["step"].device.type == "cpu" for st in opt.state.values())


def test_offload_fails_closed_before_any_change():
    _, opt = _stepped_optimizer()
    snap = _snapshot(opt)
    with pytest.raises(ValueError, match="CUDA parameters"):
        offload_state_(opt)
    _assert_unchanged(opt, snap)
    assert not state_offload_active(opt)
    with pytest.raises(ValueError, match="not active"):
        restore_state_(opt)
    with pytest.raises(TypeError):
        move_state_(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))


def test_unknown_state_and_aliasing_are_refused():
    _, opt = _stepped_optimizer()
    p = next(iter(opt.state))
    opt.state[p]["my_buffer"] = torch.zeros(3)
    with pytest.raises(ValueError, match="does not define"):
        move_state_(opt)
    del opt.state[p]["my_buffer"]
    base = torch.zeros(2 * opt.state[p]["exp_avg_scale"].numel(), 1)
    opt.state[p]["exp_avg_scale"] = base[: base.shape[0] // 2]
    with pytest.raises(ValueError, match="larger storage"):
        move_state_(opt)


def test_capturable_is_refused():
    from gefen_core import Gefen

    opt = Gefen([torch.nn.Parameter(torch.zeros(4))], capturable=True)
    with pytest.raises(ValueError, match="capturable"):
        move_state_(opt)


def test_failed_copy_back_poisons_until_a_checkpoint_is_loaded():
    _, opt = _stepped_optimizer()
    good = opt.state_dict()
    # Activate the controller on CPU state (its hooks are device-agnostic), then make the
    # post-step copy-back fail by leaving a state tensor on the meta device.
    ctl = offload._Offload(pin=False)
    ctl.handles = [
        opt.register_step_pre_hook(offload._pre_step),
        opt.register_step_post_hook(offload._post_step),
        opt.register_state_dict_pre_hook(offload._pre_state_dict),
        opt.register_load_state_dict_post_hook(offload._post_load),
    ]
    opt._gefen_offload = ctl
    p = next(iter(opt.state))
    opt.state[p]["exp_avg_scale"] = opt.state[p]["exp_avg_scale"].to("meta")
    with pytest.raises(NotImplementedError, match="meta"):
        offload._post_step(opt, (), {})
    assert ctl.poisoned
    with pytest.raises(RuntimeError, match="poisoned"):
        opt.step()
    with pytest.raises(RuntimeError, match="poisoned"):
        opt.state_dict()
    with pytest.raises(ValueError, match="poisoned"):
        restore_state_(opt)
    opt.load_state_dict(good)
    assert ctl.poisoned is None
    assert all(v.device.type == "cpu" for st in opt.state.values() for v in st.values()
               if isinstance(v, torch.Tensor))
    restore_state_(opt)
    assert not state_offload_active(opt)


@pytest.mark.gpu
def test_gpu_offload_is_bit_identical_and_frees_device_memory():
    torch.manual_seed(0)
    model_a, opt_a = _stepped_optimizer("cuda", steps=1, factored_v_2d=False)
    model_b, opt_b = _stepped_optimizer("cuda", steps=1, factored_v_2d=False)
    offload_state_(opt_b)
    assert state_offload_active(opt_b)
    on_cuda = [v for st in opt_b.state.values() for v in st.values()
               if isinstance(v, torch.Tensor) and v.device.type == "cuda"]
    assert on_cuda == []
    gen = torch.Generator().manual_seed(7)
    for _ in range(3):
        x = torch.randn(8, 16, generator=gen).cuda()
        for model, opt in ((model_a, opt_a), (model_b, opt_b)):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(pa, pb)
    restore_state_(opt_b)
    sa, sb = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    for i in sa:
        for k, v in sa[i].items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v.cpu(), sb[i][k].cpu()), k
