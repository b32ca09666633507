"""GefenDCPState in one process (no process group): round trip, planner, async save,
validation. Fast; the multi-rank resharding tests are in test_dist_dcp.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _dist_models import batches, make_model, train

from gefen_dist import CollectiveCheckError, GefenDCPState, UnsupportedCombinationError
from gefen_dist.dcp import async_stager_supported

LR = 3e-3


def _trained(steps: int = 3, factored: bool = False):
    from gefen_core import Gefen

    model = make_model(seed=0)
    opt = Gefen(model.named_parameters(), lr=LR, factored_v_2d=factored,
                 min_dim_size_to_factor=0)
    data = batches(steps + 2, batch=2, seq=16, seed=5)
    train(model, opt, data[:steps])
    return model, opt, data[steps:]


def _fresh(factored: bool = False):
    from gefen_core import Gefen

    model = make_model(seed=0)
    return model, Gefen(model.named_parameters(), lr=LR, factored_v_2d=factored,
                 min_dim_size_to_factor=0)


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


@pytest.mark.parametrize("factored", [False, True], ids=["block", "factored"])
@pytest.mark.parametrize("mode", ["eager", "planner", "async"])
def test_round_trip_is_bit_exact_and_continues_identically(tmp_path, mode, factored):
    """``factored``: plain Gefen's default (factored 2-D second moment) saves and loads too."""
    model, opt, rest = _trained(factored=factored)
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
        model, opt, _ = _trained(factored=factored)
    model2, opt2 = _fresh(factored)
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
    from gefen_core import Gefen, GefenMuon

    model = make_model(seed=0)
    with pytest.raises(UnsupportedCombinationError, match="capturable=False"):
        GefenDCPState(model, Gefen(model.named_parameters(), capturable=True))
    blocks = model.blocks[0]
    with pytest.raises(UnsupportedCombinationError, match="dcp_reshard_exact"):
        GefenDCPState(model, GefenMuon([blocks.qkv.weight, blocks.proj.weight]))
    other = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="not a parameter of the given model"):
        GefenDCPState(other, Gefen(model.named_parameters()))
    with pytest.raises(TypeError):
        GefenDCPState(model, torch.optim.AdamW(model.parameters()))


def _factor_reference(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column means of a dense second moment (fp64, then one fp32 rounding)."""
    v = v.double()
    return v.mean(dim=1).float(), v.mean(dim=0).float()


@pytest.mark.parametrize("saved_factored", [True, False], ids=["factored_to_block",
                                                               "block_to_factored"])
def test_a_checkpoint_loads_into_the_other_mode(tmp_path, saved_factored):
    """Saved with one ``factored_v_2d``, loaded with the other: no missing key, a warning,
    the momentum exact (same period), and the second moment converted as documented,
    checked against the math computed here from the saved compact state."""
    model, opt, rest = _trained(factored=saved_factored)
    dcp.save({"optim": GefenDCPState(model, opt)}, checkpoint_id=str(tmp_path))
    model2, opt2 = _fresh(not saved_factored)
    with pytest.warns(RuntimeWarning, match="converted"):
        dcp.load({"optim": GefenDCPState(model2, opt2)}, checkpoint_id=str(tmp_path))
    flt_min = torch.finfo(torch.float32).tiny
    u = 2.0 ** -24
    matrices = 0
    for (name, p), q in zip(model.named_parameters(), model2.parameters()):
        a, b = opt.state[p], opt2.state[q]
        assert a["period"] == b["period"], name
        assert torch.equal(a["exp_avg_codes"], b["exp_avg_codes"]), name
        assert torch.equal(a["exp_avg_scale"], b["exp_avg_scale"]), name
        if p.ndim != 2:
            assert torch.equal(a["exp_avg_sq"], b["exp_avg_sq"]), name
            continue
        matrices += 1
        period = a["period"]
        if saved_factored:
            r, k = a["exp_avg_sq_row"].double(), a["exp_avg_sq_col"].double()
            rbar = max(float(r.mean()), flt_min)
            dense = torch.outer(r, k) / rbar
            ref = dense.reshape(-1, period).mean(dim=1, keepdim=True)
            # The loader forms each element in fp32 (product, times 1/rbar: three roundings
            # with that of 1/rbar) and averages in fp64 before one last fp32 rounding.
            torch.testing.assert_close(b["exp_avg_sq"].double(), ref, rtol=5 * u, atol=0)
        else:
            dense = a["exp_avg_sq"].expand(-1, period).reshape(p.shape)
            row, col = _factor_reference(dense)
            torch.testing.assert_close(b["exp_avg_sq_row"], row, rtol=u, atol=0)
            torch.testing.assert_close(b["exp_avg_sq_col"], col, rtol=u, atol=0)
    assert matrices >= 4
    losses = train(model2, opt2, rest)
    assert all(math.isfinite(x) for x in losses)


def test_sharded_period_rule():
    """The documented examples, and over a sweep: the period divides the search result,
    tiles the live layout, and tiles 2, 4 and 8 ranks whenever blocks of 8 or more can."""
    from gefen_dist import aligned_period, sharded_period
    from gefen_dist.sharded import period_tiles

    for world in (1, 2, 4, 8):
        assert sharded_period(64, (64,), world) == 8
        assert sharded_period(64, (256, 64), world) == 64
    assert sharded_period(100, (100,), 1) == 25
    assert sharded_period(100, (100,), 3) == 2  # the live layout (3 ranks) comes first

    def chunk(shape, world):
        return -(-shape[0] // world) * math.prod(shape[1:])

    for shape in [(64,), (100,), (3, 32), (6, 10), (16, 32), (256, 64), (24, 96), (7,)]:
        numel = math.prod(shape)
        for period in [d for d in range(1, numel + 1) if numel % d == 0]:
            for world in (1, 2, 3, 4, 6, 8):
                got = sharded_period(period, shape, world)
                assert period % got == 0 and chunk(shape, world) % got == 0
                assert period_tiles(got, shape, world)
                best = math.gcd(period, chunk(shape, world), *(chunk(shape, v) for v in (2, 4, 8)))
                if best >= 8 or best == aligned_period(period, shape, world):
                    assert got == best, (shape, period, world, got, best)
