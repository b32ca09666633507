"""GefenDCPState in one process (no process group): round trip, planner, async save,
validation. Fast; the multi-rank resharding tests are in test_dist_dcp.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _dist_models import batches, make_model, train

from gefen_dist import CollectiveCheckError, GefenDCPState, UnsupportedCombinationError
from gefen_dist.dcp import async_stager_supported

LR = 3e-3


def _trained(steps: int = 3):
    from gefen_core import Gefen

    model = make_model(seed=0)
    opt = Gefen(model.named_parameters(), lr=LR, factored_v_2d=False)
    data = batches(steps + 2, batch=2, seq=16, seed=5)
    train(model, opt, data[:steps])
    return model, opt, data[steps:]


def _fresh():
    from gefen_core import Gefen

    model = make_model(seed=0)
    return model, Gefen(model.named_parameters(), lr=LR, factored_v_2d=False)


def _state_bytes(opt) -> dict:
    sd = opt.state_dict()
    out = {}
    for i, st in sd["state"].items():
        for k, v in st.items():
            out[(i, k)] = v.clone() if isinstance(v, torch.Tensor) else v
    out["codebook"] = sd["gefen_meta"]["codebook"].clone()
    out["T"] = sd["gefen_meta"]["global_step"]
    return out


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


@pytest.mark.parametrize("mode", ["eager", "planner", "async"])
def test_round_trip_is_bit_exact_and_continues_identically(tmp_path, mode):
    model, opt, rest = _trained()
    before = _state_bytes(opt)
    state = GefenDCPState(model, opt)
    sd = {"model": model.state_dict(), "optim": state}
    if mode == "eager":
        dcp.save(sd, checkpoint_id=str(tmp_path))
    elif mode == "planner":
        planner = state.save_planner()
        dcp.save(sd, checkpoint_id=str(tmp_path), planner=planner)
        biggest = max(p.numel() for p in model.parameters())
        assert 0 < planner.max_materialized_bytes <= 4 * biggest
    elif not async_stager_supported():
        # This torch's async_save takes no stager: the feature must refuse clearly, not
        # fall back to the default stager (which cannot copy the placeholders).
        with pytest.raises(RuntimeError, match="async_stager"):
            state.async_stager()
        return
    else:
        planner = state.save_planner()
        fut = dcp.async_save(sd, checkpoint_id=str(tmp_path), planner=planner,
                             async_stager=state.async_stager())
        # Training continues while the write runs: the checkpoint must hold the state at
        # save time, not the post-step state.
        train(model, opt, rest[:1])
        fut.result()
        model, opt, _ = _trained()
    model2, opt2 = _fresh()
    target = {"model": model2.state_dict(), "optim": GefenDCPState(model2, opt2)}
    dcp.load(target, checkpoint_id=str(tmp_path))
    model2.load_state_dict(target["model"])
    _assert_same(before, _state_bytes(opt2))
    train(model, opt, rest)
    train(model2, opt2, rest)
    for (n, a), b in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(a, b), n


def test_step_count_of_compiled_steps_is_saved() -> None:
    # A compiled step advances the step-count tensors, not the Python count: the header must
    # read them (docs/compile.md), as the native state_dict does.
    model, opt, _ = _trained(1)
    step = torch.compile(opt.step, backend="eager")
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        step()
    torch._dynamo.reset()
    assert GefenDCPState(model, opt).state_dict()["header"]["global_step"] == 3
    assert opt.state_dict()["gefen_meta"]["global_step"] == 3


def test_default_stager_cannot_copy_placeholders(tmp_path):
    model, opt, _ = _trained()
    state = GefenDCPState(model, opt)
    planner = state.save_planner()
    with pytest.raises(NotImplementedError, match="meta"):
        dcp.async_save({"optim": state}, checkpoint_id=str(tmp_path), planner=planner).result()


def test_malformed_checkpoint_changes_nothing(tmp_path):
    model, opt, _ = _trained()
    dcp.save({"optim": GefenDCPState(model, opt)}, checkpoint_id=str(tmp_path))
    model2, opt2, _ = _trained(steps=1)
    before = _state_bytes(opt2)
    state = GefenDCPState(model2, opt2)
    sd = state.state_dict()
    dcp.load({"optim": sd}, checkpoint_id=str(tmp_path))
    name = next(iter(sd["slots"]))
    sd["slots"][name]["exp_avg_sq"].view(-1)[0] = -1.0
    with pytest.raises((ValueError, CollectiveCheckError), match="negative second moment"):
        state.load_state_dict(sd)
    _assert_same(before, _state_bytes(opt2))
    sd["slots"][name]["exp_avg_sq"].view(-1)[0] = 0.0
    sd["header"]["format_version"] = 99
    with pytest.raises((ValueError, CollectiveCheckError), match="format_version"):
        state.load_state_dict(sd)
    _assert_same(before, _state_bytes(opt2))


def test_scope_is_checked_at_construction():
    from gefen_core import Gefen

    model = make_model(seed=0)
    with pytest.raises(ValueError, match="factored"):
        GefenDCPState(model, Gefen(model.named_parameters()))
    other = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="not a parameter of the given model"):
        GefenDCPState(other, Gefen(model.named_parameters(), factored_v_2d=False))
    with pytest.raises(TypeError):
        GefenDCPState(model, torch.optim.AdamW(model.parameters()))
    assert UnsupportedCombinationError  # raised for plain Gefen on DTensors (multi-rank tests)
