"""The non-finite-gradient rule (docs/algorithm.md#non-finite-gradients) on every path.

* ``skip_nonfinite=True``: a step whose gradients hold a NaN or Inf changes nothing (parameters,
  state, counters, ``T``, codebook), is counted, and the run then continues exactly as a run
  that never saw that step (for-loop and foreach references here; the fused kernels and the
  steady fused step in ``_gpu`` tests below).
* without it, the documented blast radius: the block (block mode) or the row and column
  (factored mode) through the non-finite element become NaN, nothing else does.
* plain Gefen refuses DTensor parameters sharded over ranks, at construction and at ``step()``.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from gefen_core import Gefen, GefenMuon, GefenMuonHybrid

SHAPES = {"w": (128, 64), "u": (48, 40), "b": (96,)}


def _params(device: str = "cpu") -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [
        (n, torch.randn(s, generator=gen).to(device).requires_grad_()) for n, s in SHAPES.items()
    ]


def _grads(step: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(s, generator=gen).to(device) for n, s in SHAPES.items()}


def _snapshot(params, opt) -> dict:
    out = {
        "T": opt._global_step,
        "codebook": None if opt._codebook is None else opt._codebook.clone(),
    }
    for name, p in params:
        out[(name, "param")] = p.detach().clone()
        for key, value in opt.state[p].items():
            out[(name, key)] = value.clone() if isinstance(value, torch.Tensor) else value
    return out


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), key
        else:
            assert x == y, key


def _run(kwargs: dict, bad: dict[int, str] | None, steps: int = 6, device: str = "cpu"):
    """``steps`` steps; on step ``i`` in ``bad`` gradient ``w`` gets a NaN or Inf element.
    Returns the parameters, the optimizer and the snapshot taken before each bad step."""
    params = _params(device)
    opt = Gefen(params, lr=1e-2, **kwargs)
    before = {}
    for step in range(steps):
        grads = _grads(step, device)
        if bad and step in bad:
            grads["w"][3, 5] = float(bad[step])
            before[step] = _snapshot(params, opt)
        for name, p in params:
            p.grad = grads[name]
        opt.step()
        if bad and step in bad:
            assert opt.last_step_skipped
            _assert_same(before[step], _snapshot(params, opt))
        else:
            assert not opt.last_step_skipped
    return params, opt


@pytest.mark.parametrize("factored", [True, False], ids=["factored", "block"])
@pytest.mark.parametrize("foreach", [False, True], ids=["for_loop", "foreach"])
def test_skip_nonfinite_changes_nothing_and_the_run_continues_exactly(factored, foreach):
    kw = dict(
        skip_nonfinite=True, factored_v_2d=factored, min_dim_size_to_factor=0, foreach=foreach
    )
    # Step 0 would learn the codebook, step 3 is an ordinary step; NaN and Inf both skip.
    params, opt = _run(kw, bad={0: "nan", 3: "inf"}, steps=7)
    assert opt.skipped_steps == 2
    assert set(opt.step_paths().values()) == {"foreach" if foreach else "for_loop"}
    # The reference never sees the two bad steps: the same gradients otherwise, in order.
    ref_params = _params()
    ref = Gefen(
        ref_params, lr=1e-2, factored_v_2d=factored, min_dim_size_to_factor=0, foreach=foreach
    )
    for step in range(7):
        if step in (0, 3):
            continue
        grads = _grads(step)
        for name, p in ref_params:
            p.grad = grads[name]
        ref.step()
    assert opt._global_step == ref._global_step == 5
    _assert_same(_snapshot(ref_params, ref), _snapshot(params, opt))


def test_skip_nonfinite_option_is_validated():
    with pytest.raises(TypeError, match="skip_nonfinite must be a bool"):
        Gefen(_params(), skip_nonfinite=1)
    with pytest.raises(ValueError, match="capturable"):
        Gefen(_params(), skip_nonfinite=True, capturable=True)
    opt = Gefen(_params(), skip_nonfinite=True)
    with pytest.raises(ValueError, match="capturable"):
        opt.add_param_group({"params": [torch.zeros(3, requires_grad=True)], "capturable": True})
    with pytest.raises(ValueError, match="capturable"):
        GefenMuonHybrid(
            [("m", torch.zeros(8, 8, requires_grad=True))],
            [],
            lr=1e-3,
            skip_nonfinite=True,
            capturable=True,
        )


@pytest.mark.parametrize("foreach", [False, True], ids=["for_loop", "foreach"])
def test_without_skip_a_nonfinite_element_spreads_over_its_block(foreach):
    """Block mode: exactly the elements of the block holding the Inf become NaN."""
    params, opt = _run(
        dict(factored_v_2d=False, foreach=foreach, weight_decay=0.0), bad=None, steps=3
    )
    w = dict(params)["w"]
    period = opt.state[w]["period"]
    assert period < w.numel()  # several blocks, so "only its block" means something
    before = w.detach().clone()
    grads = _grads(3)
    grads["w"][3, 5] = float("inf")
    for name, p in params:
        p.grad = grads[name]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no skip, no warning once state exists
        opt.step()
    flat_bad = (~torch.isfinite(w.detach())).reshape(-1)
    block = (3 * w.shape[1] + 5) // period
    expect = torch.zeros_like(flat_bad)
    expect[block * period : (block + 1) * period] = True
    assert torch.equal(flat_bad, expect), (int(flat_bad.sum()), period)
    # Every other block took a finite step.
    moved = (w.detach() != before).reshape(-1)
    assert bool(moved[~expect].any())


@pytest.mark.parametrize("foreach", [False, True], ids=["for_loop", "foreach"])
def test_without_skip_a_factored_matrix_loses_the_row_and_column(foreach):
    """Factored mode: the row and the column through the Inf become NaN; the mean row
    statistic is then infinite, so every other element gets a zero update."""
    params, opt = _run(
        dict(factored_v_2d=True, min_dim_size_to_factor=0, foreach=foreach, weight_decay=0.0),
        bad=None,
        steps=3,
    )
    w = dict(params)["w"]
    before = w.detach().clone()
    grads = _grads(3)
    grads["w"][3, 5] = float("inf")
    for name, p in params:
        p.grad = grads[name]
    opt.step()
    bad = ~torch.isfinite(w.detach())
    expect = torch.zeros_like(bad)
    expect[3, :] = True
    expect[:, 5] = True
    assert torch.equal(bad, expect)
    assert torch.equal(w.detach()[~expect], before[~expect])
    assert torch.isinf(opt.state[w]["exp_avg_sq_row"][3])
    assert torch.isinf(opt.state[w]["exp_avg_sq_col"][5])


def test_gefen_muon_skips_the_same_way():
    def run(bad: bool):
        gen = torch.Generator().manual_seed(1)
        mats = [(f"m{i}", torch.randn(32, 48, generator=gen).requires_grad_()) for i in range(2)]
        opt = GefenMuon(mats, lr=0.02, skip_nonfinite=True)
        for step in range(4):
            gen = torch.Generator().manual_seed(10 + step)
            grads = [torch.randn(32, 48, generator=gen) for _ in mats]
            if step == 2:
                if not bad:
                    continue
                grads[1][0, 0] = float("nan")
            for (_, p), g in zip(mats, grads):
                p.grad = g
            snap = _snapshot(mats, opt)
            opt.step()
            if bad and step == 2:
                _assert_same(snap, _snapshot(mats, opt))
        return mats, opt

    mats, opt = run(bad=True)
    ref_mats, ref = run(bad=False)
    assert (opt.skipped_steps, ref.skipped_steps) == (1, 0)
    _assert_same(_snapshot(ref_mats, ref), _snapshot(mats, opt))


@pytest.mark.parametrize("backup", ["gefen", "adamw"])
def test_hybrid_skips_both_halves(backup):
    def run(bad: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)
        )
        hyb = GefenMuonHybrid(model, lr=1e-2, backup_optimizer=backup, skip_nonfinite=True)
        assert not hyb.muon._skip_nonfinite  # the hybrid decides for both halves
        gen = torch.Generator().manual_seed(3)
        for step in range(4):
            x = torch.randn(4, 16, generator=gen)
            if step == 2 and not bad:
                continue
            hyb.zero_grad()
            model(x).square().mean().backward()
            if step == 2:
                model[2].bias.grad[0] = float("inf")  # a backup (AdamW or Gefen) gradient
                before = [p.detach().clone() for p in model.parameters()]
                counters = [hyb.muon._global_step]
            hyb.step()
            if step == 2:
                assert hyb.last_step_skipped
                assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
                assert hyb.muon._global_step == counters[0]
        return model, hyb

    model, hyb = run(bad=True)
    ref_model, ref = run(bad=False)
    assert hyb.skipped_steps == 1 and not hyb.last_step_skipped
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)


def test_an_amp_overflow_counts_as_a_skipped_step():
    """The native GradScaler protocol's overflow (found_inf) skips the step first; under
    skip_nonfinite it is counted like any other non-finite step, by Gefen and the hybrid."""
    params = _params()
    opt = Gefen(params, lr=1e-2, skip_nonfinite=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    hyb = GefenMuonHybrid(model, lr=1e-2, skip_nonfinite=True)
    model(torch.randn(3, 8)).sum().backward()
    grads = _grads(0)
    for name, p in params:
        p.grad = grads[name]
        p.grad[0] = float("inf")  # what an overflowing scaled gradient holds
    for o in (opt, hyb):
        o.found_inf = torch.ones(1)
        o.grad_scale = torch.full((1,), 2.0**16)
        o.step()
        assert o.skipped_steps == 1 and o.last_step_skipped
        del o.found_inf, o.grad_scale
    assert opt._global_step == 0 and hyb.muon._global_step == 0


@pytest.mark.timeout(120)
def test_plain_gefen_refuses_sharded_dtensors_at_construction_and_step():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        mesh = init_device_mesh("cpu", (1,))
        sharded = torch.nn.Parameter(distribute_tensor(torch.randn(8, 16), mesh, [Shard(0)]))
        replicated = torch.nn.Parameter(distribute_tensor(torch.randn(8), mesh, [Replicate()]))
        plain = torch.nn.Parameter(torch.randn(8, 16))
        with pytest.raises(ValueError, match=r"'layer\.weight'.*Shard\(dim=0\).*ShardedGefen"):
            Gefen([("layer.weight", sharded), ("plain", plain)])
        with pytest.raises(ValueError, match=r"'layer\.weight'.*ShardedGefenMuonHybrid"):
            GefenMuonHybrid([("layer.weight", sharded)], [("plain", plain)], lr=1e-3)
        # A replicated DTensor is the global tensor on every rank: allowed.
        opt = Gefen([("rep", replicated), ("plain", plain)], lr=1e-2)
        replicated.grad = distribute_tensor(torch.randn(8), mesh, [Replicate()])
        plain.grad = torch.randn(8, 16)
        opt.step()
        # Parameters swapped for shards after construction (as a wrapper may do): refused at
        # the next step, before anything changes, even without a gradient on the shard.
        opt.param_groups[0]["params"][0] = sharded
        before = plain.detach().clone()
        plain.grad = torch.randn(8, 16)
        with pytest.raises(ValueError, match=r"'rep'.*ShardedGefen"):
            opt.step()
        assert torch.equal(plain, before)
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------ CUDA paths
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("factored", [True, False], ids=["factored", "block"])
def test_gpu_fused_and_steady_paths_skip_exactly(factored):
    """The fused kernels (and, from the third step, the steady fused step) under the same
    rule: the bad steps (1: full step; 5: a steady step) change nothing and the run ends
    bit-identical to one without them. ``deterministic=True`` so two runs can be compared
    bit for bit (the fused factored path uses float atomics otherwise)."""
    import gefen_kernels

    if not gefen_kernels.triton_available():
        pytest.fail("CUDA is present but Triton is not: the fused path cannot be tested")
    kw = dict(
        skip_nonfinite=True, factored_v_2d=factored, min_dim_size_to_factor=0, deterministic=True
    )
    params, opt = _run(kw, bad={1: "inf", 5: "nan"}, steps=8, device="cuda")
    assert opt.skipped_steps == 2
    assert "fused" in set(opt.step_paths().values())
    ref_params = _params("cuda")
    ref = Gefen(
        ref_params, lr=1e-2, factored_v_2d=factored, min_dim_size_to_factor=0, deterministic=True
    )
    for step in range(8):
        if step in (1, 5):
            continue
        grads = _grads(step, "cuda")
        for name, p in ref_params:
            p.grad = grads[name]
        ref.step()
    _assert_same(_snapshot(ref_params, ref), _snapshot(params, opt))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_fused_blast_radius_matches_the_reference():
    """Without the option, the fused kernels spread a non-finite element exactly as the
    references do: the same parameters become NaN (block mode and factored mode)."""
    for factored in (False, True):
        out = []
        for fused in (True, False):
            params, opt = _run(
                dict(
                    factored_v_2d=factored, min_dim_size_to_factor=0, fused=fused, weight_decay=0.0
                ),
                bad=None,
                steps=3,
                device="cuda",
            )
            grads = _grads(3, "cuda")
            grads["w"][3, 5] = float("inf")
            for name, p in params:
                p.grad = grads[name]
            opt.step()
            out.append({n: (~torch.isfinite(p.detach())).cpu() for n, p in params})
        for name in SHAPES:
            assert torch.equal(out[0][name], out[1][name]), (factored, name)
        assert int(out[0]["w"].sum()) > 1
