"""The steady-state step (``gefen_core._steady_step``) against the full step, on the CPU.

The eager fused path (plans and grouped launches) runs here on CPU tensors through Triton's
interpreter: the CUDA-only entry points are patched to their CPU meaning. Every test steps two
identical optimizers, one of which never takes the steady path, and requires the same bits;
each also checks which path the other one took, so a test cannot pass by never taking it.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import importlib
import io
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from gefen_core import Gefen, _compiled_step, _op_record, _steady_step
from gefen_core import dispatch as _dispatch

fused = importlib.import_module("gefen_kernels.ops.fused_step")

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available()
    or not __import__("gefen_kernels").ops._device.interpret_mode(),
    reason="runs the fused path on CPU tensors: needs TRITON_INTERPRET=1 and no CUDA")


@pytest.fixture
def fused_on_cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """Route CPU tensors through the planned fused path; count steady hits and misses."""
    monkeypatch.setattr(_dispatch, "fused_blocker", lambda p: None)
    monkeypatch.setattr(fused, "_plans_apply", lambda params: bool(params))
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    counts = {"hit": 0, "miss": 0}
    run = _steady_step.SteadyStep.run

    def counted(self: _steady_step.SteadyStep, opt: Any) -> bool:
        took = run(self, opt)
        counts["hit" if took else "miss"] += 1
        return took

    monkeypatch.setattr(_steady_step.SteadyStep, "run", counted)
    yield counts


def _model(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shapes = [("w1", (16, 32), torch.bfloat16), ("b1", (33,), torch.float32),
              ("w2", (8, 24), torch.float32), ("empty", (0,), torch.float32),
              ("frozen", (4, 4), torch.float32), ("w3", (24, 8), torch.bfloat16),
              ("square", (8, 8), torch.float32)]
    return [(n, torch.nn.Parameter((torch.randn(s, generator=g) * 0.1).to(d)))
            for n, s, d in shapes]


def _twins(stochastic: bool = False) -> tuple[Gefen, Gefen, list[torch.Tensor],
                                                list[torch.Tensor]]:
    def make() -> tuple[Gefen, list[torch.Tensor]]:
        named = _model()
        groups = [
            {"params": named[:4], "weight_decay": 0.0},
            {"params": named[4:], "lr": 3e-3, "maximize": True, "betas": (0.8, 0.99)},
        ]
        # The small matrices are factored, as the grouped-statistics routes need.
        opt = Gefen(groups, lr=1e-3, stochastic_round=stochastic, min_dim_size_to_factor=0)
        return opt, [p for _, p in named]
    a, pa = make()
    b, pb = make()
    return a, b, pa, pb


def _grads(params: list[torch.Tensor], step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for i, p in enumerate(params):
        if i == 4:  # "frozen": never a gradient
            continue
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def _full_step(opt: Gefen, closure: Callable[[], Any] | None = None) -> Any:
    opt._steady = None
    return opt.step(closure)


def _step_both(a: Gefen, b: Gefen, pa: list[torch.Tensor], pb: list[torch.Tensor],
               steps: range) -> None:
    """Both twins over ``steps`` with the same gradients, ``a`` as it chooses and ``b`` always
    through the full step; the same bits after every step."""
    for step in steps:
        _grads(pa, step)
        _grads(pb, step)
        a.step()
        _full_step(b)
        _assert_same(a, b, pa, pb)


def _assert_same(a: Gefen, b: Gefen, pa: list[torch.Tensor], pb: list[torch.Tensor]) -> None:
    for x, y in zip(pa, pb):
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
    for x, y in zip(pa, pb):
        sa, sb = a.state.get(x, {}), b.state.get(y, {})
        assert sa.keys() == sb.keys()
        for k in sa:
            if isinstance(sa[k], torch.Tensor):
                assert torch.equal(sa[k], sb[k]), k
            else:
                assert sa[k] == sb[k], k
    assert a._global_step == b._global_step
    if a._codebook is not None or b._codebook is not None:
        assert torch.equal(a._codebook, b._codebook)


@pytest.mark.parametrize("stochastic", [False, True])
def test_steady_steps_equal_full_steps(fused_on_cpu: dict[str, int], stochastic: bool) -> None:
    a, b, pa, pb = _twins(stochastic)
    _step_both(a, b, pa, pb, range(5))
    assert fused_on_cpu == {"hit": 4, "miss": 0}
    assert set(a.step_paths().values()) == {"fused"}


def _changes() -> dict[str, Callable[[Gefen, list[torch.Tensor]], None]]:
    def no_grad(opt: Gefen, ps: list[torch.Tensor]) -> None:
        ps[1].grad = None

    def grad_dtype(opt: Gefen, ps: list[torch.Tensor]) -> None:
        # Through .data: assigning an fp32 .grad to a bf16 parameter is refused by torch.
        grad = ps[0].grad
        grad.data = grad.data.float()

    def grad_strided(opt: Gefen, ps: list[torch.Tensor]) -> None:
        ps[2].grad = ps[2].grad.t().contiguous().t()

    def first_grad(opt: Gefen, ps: list[torch.Tensor]) -> None:
        ps[4].grad = torch.ones_like(ps[4])

    def betas(opt: Gefen, ps: list[torch.Tensor]) -> None:
        opt.param_groups[0]["betas"] = (0.85, 0.999)

    def state_tensor(opt: Gefen, ps: list[torch.Tensor]) -> None:
        st = opt.state[ps[0]]
        st["exp_avg_codes"] = st["exp_avg_codes"].clone()

    def param_storage(opt: Gefen, ps: list[torch.Tensor]) -> None:
        ps[2].data = ps[2].data.clone()

    def counter_storage(opt: Gefen, ps: list[torch.Tensor]) -> None:
        # The counter keeps its identity but leaves the buffer the steady step advances.
        step = opt.state[ps[0]]["step"]
        step.data = step.data.clone()

    def param_transposed(opt: Gefen, ps: list[torch.Tensor]) -> None:
        # Same address, shape and dtype; no longer contiguous.
        ps[6].data = ps[6].data.t()

    def codebook_storage(opt: Gefen, ps: list[torch.Tensor]) -> None:
        # Same tensor, same values, same version counter; another address (which a captured
        # graph of the launches would still read).
        assert opt._codebook is not None
        opt._codebook.data = opt._codebook.data.clone()

    def add_group(opt: Gefen, ps: list[torch.Tensor]) -> None:
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})

    def reload(opt: Gefen, ps: list[torch.Tensor]) -> None:
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))

    return {f.__name__: f for f in (no_grad, grad_dtype, grad_strided, first_grad, betas,
                                     state_tensor, param_storage, counter_storage,
                                     codebook_storage, param_transposed, add_group, reload)}


@pytest.mark.parametrize("change", sorted(_changes()))
def test_a_change_takes_the_full_step(fused_on_cpu: dict[str, int], change: str) -> None:
    """Each change the recorded launches depend on sends the step back to the full path,
    which then gives the same bits as an optimizer that never took the steady path (in
    particular, a replaced state tensor or parameter storage is the one updated)."""
    a, b, pa, pb = _twins()
    _step_both(a, b, pa, pb, range(2))
    assert fused_on_cpu == {"hit": 1, "miss": 0}
    _grads(pa, 2)
    _grads(pb, 2)
    _changes()[change](a, pa)
    _changes()[change](b, pb)
    a.step()
    _full_step(b)
    _assert_same(a, b, pa, pb)
    invalidated = change in ("add_group", "reload")  # the record is dropped, not consulted
    assert fused_on_cpu == {"hit": 1, "miss": 0 if invalidated else 1}


def test_a_counter_given_new_storage_keeps_counting_on_later_steady_steps(
        fused_on_cpu: dict[str, int]) -> None:
    """``.data =`` leaves a counter view's ``_base`` in place: the next record must not take
    it for a view of the buffer that steady steps advance."""
    a, b, pa, pb = _twins()
    _step_both(a, b, pa, pb, range(2))
    for opt, ps in ((a, pa), (b, pb)):
        _changes()["counter_storage"](opt, ps)
    _step_both(a, b, pa, pb, range(2, 5))
    assert fused_on_cpu == {"hit": 3, "miss": 1}


def test_lr_and_weight_decay_changes_keep_the_steady_step(
        fused_on_cpu: dict[str, int]) -> None:
    a, b, pa, pb = _twins()
    for step in range(4):
        _grads(pa, step)
        _grads(pb, step)
        for opt in (a, b):
            opt.param_groups[1]["lr"] = 1e-3 * (step + 1)
            opt.param_groups[0]["weight_decay"] = 0.01 * step
        a.step()
        _full_step(b)
        _assert_same(a, b, pa, pb)
    assert fused_on_cpu == {"hit": 3, "miss": 0}


def test_bad_gradient_on_a_steady_step_raises_before_any_change(
        fused_on_cpu: dict[str, int]) -> None:
    a, b, pa, pb = _twins()
    _step_both(a, b, pa, pb, range(2))
    before = copy.deepcopy(a.state_dict())
    params_before = [p.detach().clone() for p in pa]
    _grads(pa, 2)
    pa[2].grad = pa[2].grad.to_sparse()
    with pytest.raises(RuntimeError, match="sparse gradients"):
        a.step()
    assert fused_on_cpu["miss"] == 1
    after = a.state_dict()
    assert after["state"].keys() == before["state"].keys()
    for i, st in before["state"].items():
        for k, v in st.items():
            assert torch.equal(v, after["state"][i][k]) if isinstance(v, torch.Tensor) \
                else v == after["state"][i][k]
    assert all(torch.equal(x, y) for x, y in zip(params_before, pa))


def test_amp_overflow_on_a_steady_step_changes_nothing(fused_on_cpu: dict[str, int]) -> None:
    a, b, pa, pb = _twins()
    _step_both(a, b, pa, pb, range(2))
    _grads(pa, 2)
    _grads(pb, 2)
    for opt in (a, b):
        opt.found_inf = torch.ones(1)  # type: ignore[attr-defined]
    a.step()
    _full_step(b)
    assert fused_on_cpu == {"hit": 2, "miss": 0}
    _assert_same(a, b, pa, pb)
    assert a._global_step == 2
    for opt in (a, b):
        del opt.found_inf  # type: ignore[attr-defined]
        opt.grad_scale = torch.full((1,), 4.0)  # type: ignore[attr-defined]
    a.step()
    _full_step(b)
    assert fused_on_cpu["hit"] == 3
    _assert_same(a, b, pa, pb)


def test_codebook_refresh_step_takes_the_full_step(fused_on_cpu: dict[str, int]) -> None:
    def make() -> tuple[Gefen, list[torch.Tensor]]:
        named = _model()
        return Gefen(named, codebook_refresh_every=3), [p for _, p in named]
    (a, pa), (b, pb) = make(), make()
    _step_both(a, b, pa, pb, range(5))
    # Steps 1, 2 and 4 repeat the record; step 3 refreshes the codebook (a miss), after
    # which the new codebook's record is taken at step 4.
    assert fused_on_cpu == {"hit": 3, "miss": 1}


def test_the_record_does_not_keep_replaced_state_alive(fused_on_cpu: dict[str, int]) -> None:
    """The record holds weak references: state replaced or dropped between steps (as
    ``gefen_dist.offload_state_`` does after every step) is freed at once."""
    a, _, pa, _ = _twins()
    for step in range(2):
        _grads(pa, step)
        a.step()
    assert a._steady is not None and fused_on_cpu["hit"] == 1
    old = weakref.ref(a.state[pa[0]]["exp_avg_codes"])
    a.state[pa[0]]["exp_avg_codes"] = a.state[pa[0]]["exp_avg_codes"].clone()
    gc.collect()
    assert old() is None
    every = [weakref.ref(t) for st in a.state.values() for t in st.values()
             if isinstance(t, torch.Tensor)]
    a.state.clear()
    gc.collect()
    assert all(r() is None for r in every)


def test_a_failing_lr_read_leaves_the_counters_as_the_full_step_does(
        fused_on_cpu: dict[str, int]) -> None:
    a, b, pa, pb = _twins()
    _step_both(a, b, pa, pb, range(2))
    _grads(pa, 2)
    _grads(pb, 2)
    for opt in (a, b):
        opt.param_groups[1]["lr"] = torch.ones(2)  # not a scalar: the read raises
    with pytest.raises(RuntimeError) as steady_error:
        a.step()
    with pytest.raises(RuntimeError) as full_error:
        _full_step(b)
    assert str(steady_error.value) == str(full_error.value)
    assert fused_on_cpu == {"hit": 1, "miss": 0}  # the third step raised inside run()
    _assert_same(a, b, pa, pb)


def test_an_optimizer_reducing_factored_statistics_takes_the_full_step(
        fused_on_cpu: dict[str, int]) -> None:
    """``_factored_statistics`` is called on every step of such an optimizer (a collective
    in a distributed subclass), so its steps are never repeated from a record."""
    calls = []

    class Reducing(Gefen):
        _reduces_factored_stats = True

        def _factored_statistics(self, entries):  # type: ignore[no-untyped-def]
            calls.append(len(entries))
            return super()._factored_statistics(entries)

    named = _model()
    opt = Reducing(named)
    for step in range(3):
        _grads([p for _, p in named], step)
        opt.step()
    assert calls == [0, 0, 0] and opt._steady is None
    assert fused_on_cpu == {"hit": 0, "miss": 0}


def test_counters_step_as_one_buffer_and_checkpoint_as_separate_counters(
        fused_on_cpu: dict[str, int]) -> None:
    """The record moves each call's step counters into one buffer (one ``add_`` per steady
    step); a checkpoint of them loads like any other, and both twins go on equal."""
    a, b, pa, pb = _twins()
    _step_both(a, b, pa, pb, range(3))
    assert a._steady is not None
    buffers = [call.counters() for call in a._steady._calls]
    assert buffers and all(buf is not None for buf in buffers)
    stepped = [p for p in pa if p in a.state]
    counters = [a.state[p][k] for p in stepped for k in ("step", "exp_avg_sq_step")]
    assert all(any(t._base is buf for buf in buffers) for t in counters)
    assert all(t.item() == 3.0 and t.dtype == torch.float32 and t.dim() == 0 for t in counters)
    saved = io.BytesIO()
    torch.save(a.state_dict(), saved)
    saved.seek(0)
    b.load_state_dict(torch.load(saved, weights_only=True))
    hits = fused_on_cpu["hit"]
    _step_both(a, b, pa, pb, range(3, 6))
    assert fused_on_cpu["hit"] == hits + 3
    assert all(a.state[p]["step"].item() == 6.0 for p in stepped)


def test_a_new_record_of_the_same_counters_keeps_them(fused_on_cpu: dict[str, int]) -> None:
    """Counters already laid out in a record's buffer stay the same tensors when the next full
    step records again, so references to them keep following the state."""
    a, b, pa, pb = _twins()
    _step_both(a, b, pa, pb, range(2))
    step = a.state[pa[0]]["step"]
    _full_step(a)  # records again: the same counters, already in a buffer
    _full_step(b)
    assert a.state[pa[0]]["step"] is step
    _step_both(a, b, pa, pb, range(3, 5))
    assert step.item() == a.state[pa[0]]["step"].item() == 5.0


def test_off_tile_factored_tensors_share_grouped_statistics(
        fused_on_cpu: dict[str, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """Factored tensors whose blocks take the loop route (forced here for blocks of 16 or more
    elements: the route is speed-only) get their statistics in the grouped launches and their
    update alone. The optimizer's steps, steady ones included, equal one launch per plan."""
    step_plan = importlib.import_module("gefen_kernels.ops.step_plan")
    step_groups = importlib.import_module("gefen_kernels.ops.step_groups")
    monkeypatch.setattr(step_plan, "choose_route",
                        lambda num_blocks, period, device: "loop" if period >= 16 else "tile")
    stats_only = step_groups._stats_only
    seen: list[bool] = []
    monkeypatch.setattr(step_groups, "_stats_only",
                        lambda plan: seen.append(stats_only(plan)) or seen[-1])
    grouped_launch = fused._grouped_launch

    def per_plan(grouped: Any, host: Any, seeds: Any, *, anchor: torch.Tensor) -> None:
        for plan, grad, i in grouped:
            lr, bc1, bc2, decay = host[i].lr, host[i].bc1_recip, host[i].bc2, host[i].decay
            plan.launch(grad, lr=lr, bc1_recip=bc1, bc2=bc2, decay=decay,
                        seed=0 if seeds is None else seeds[i])

    a, b, pa, pb = _twins(stochastic=True)
    for step in range(4):
        _grads(pa, step)
        _grads(pb, step)
        a.step()
        monkeypatch.setattr(fused, "_grouped_launch", per_plan)
        _full_step(b)
        monkeypatch.setattr(fused, "_grouped_launch", grouped_launch)
        _assert_same(a, b, pa, pb)
    assert any(seen)  # a statistics-only class was built
    assert fused_on_cpu["hit"] == 3


# The compiled step's op (gefen_core._op_record): the traced step run eagerly issues the same
# `gefen::functional_step` calls a compiled steady step does.


@pytest.fixture
def op_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    counts = {"hit": 0, "miss": 0}
    run = _op_record.run

    def counted(*args: Any, **kwargs: Any) -> bool:
        took = run(*args, **kwargs)
        counts["hit" if took else "miss"] += 1
        return took

    monkeypatch.setattr(_op_record, "run", counted)
    return counts


def _op_step(opt: Gefen) -> None:
    _compiled_step.traced_step(opt, None)
    _compiled_step.sync_global_step(opt)


@pytest.mark.parametrize("stochastic", [False, True])
def test_the_compiled_steps_op_repeats_its_recorded_launches(
        fused_on_cpu: dict[str, int], op_calls: dict[str, int], stochastic: bool) -> None:
    a, b, pa, pb = _twins(stochastic)
    _step_both(a, b, pa, pb, range(1))
    for step in range(1, 5):
        _grads(pa, step)
        _grads(pb, step)
        _op_step(a)
        _full_step(b)
        _assert_same(a, b, pa, pb)
    # Two calls per step (one per param group): recorded on the first, repeated on the rest.
    assert op_calls == {"hit": 6, "miss": 2}


@pytest.mark.parametrize("change", ["betas", "codebook_storage", "counter_storage",
                                    "grad_dtype", "grad_strided", "no_grad", "param_storage",
                                    "param_transposed", "state_tensor"])
def test_a_change_sends_the_compiled_steps_op_to_the_full_path(
        fused_on_cpu: dict[str, int], op_calls: dict[str, int], change: str) -> None:
    a, b, pa, pb = _twins()
    _step_both(a, b, pa, pb, range(1))
    for step in (1, 2):
        _grads(pa, step)
        _grads(pb, step)
        _op_step(a)
        _full_step(b)
    assert op_calls == {"hit": 2, "miss": 2}
    for step in (3, 4):
        _grads(pa, step)
        _grads(pb, step)
        if step == 3:
            _changes()[change](a, pa)
            _changes()[change](b, pb)
        _op_step(a)
        _full_step(b)
        _assert_same(a, b, pa, pb)
    # The changed call misses, is recorded again and repeats; a second miss where the change
    # touches both calls (the codebook), is undone by the next step's gradients, or leaves a
    # parameter that cannot be recorded (not contiguous).
    misses = 3 if change in ("betas", "counter_storage", "param_storage", "state_tensor") else 4
    assert op_calls == {"hit": 8 - misses, "miss": misses}


def test_a_call_site_that_never_repeats_its_record_stops_recording_every_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """New tensors on every call (a backend that copies what the op mutates) never find a
    record: past RETRY such calls, only every RETRY-th one records."""
    builds: list[int] = []

    class Counted:
        @staticmethod
        def build(*args: Any, **kwargs: Any) -> None:
            builds.append(1)

    monkeypatch.setattr(_op_record, "FusedStepRecord", Counted)
    codebook = torch.zeros(256)
    retry = _op_record.RETRY
    for _ in range(3 * retry):
        p = torch.zeros(4)
        lists = ([p], [torch.zeros(4)], [torch.zeros(1, 4, dtype=torch.uint8)],
                 [torch.zeros(1, 1)], [torch.zeros(1, 1)], [None], [None], [torch.zeros(())],
                 [torch.zeros(())])
        assert not _op_record.run(*lists, codebook=codebook, lr=1e-3, beta1=0.9, beta2=0.999,
                                  eps=1e-8, weight_decay=0.0, maximize=False,
                                  stochastic_round=False, seeds=None)
        _op_record.record(*lists, codebook=codebook, beta1=0.9, beta2=0.999, eps=1e-8,
                          maximize=False, stochastic_round=False)
    assert len(builds) == retry + 2  # each of the first RETRY calls, then every RETRY-th


def _loss_backward(params: list[torch.Tensor], step: int) -> None:
    """A backward whose gradients are ``_grads``' (the "frozen" parameter gets none)."""
    g = torch.Generator().manual_seed(100 + step)
    loss = sum((p.float() * torch.randn(p.shape, generator=g)).sum()
               for i, p in enumerate(params) if i != 4)
    loss.backward()


def _backward_both(a: Gefen, b: Gefen, pa: list[torch.Tensor], pb: list[torch.Tensor],
                   step: int) -> None:
    """One backward and ``opt.step()`` of each twin, ``a`` stepping in backward and ``b``
    through the full step; the same bits after it."""
    _loss_backward(pa, step)
    _loss_backward(pb, step)
    a.step()
    _full_step(b)
    a.zero_grad()
    b.zero_grad()
    _assert_same(a, b, pa, pb)


@pytest.mark.parametrize("cap", [0.0, 0.002])
def test_in_backward_buckets_repeat_their_launches_with_the_full_steps_bits(
        fused_on_cpu: dict[str, int], monkeypatch: pytest.MonkeyPatch, cap: float) -> None:
    """``step_in_backward`` buckets (one tensor each, and several) take the recorded launches
    from their second in-backward step on, and every step gives the bits of an optimizer that
    only ever takes the full step; a replaced state tensor sends its bucket back to the full
    step once, which records it again."""
    from gefen_core import step_in_backward

    counts = {"hit": 0, "miss": 0}
    run = _steady_step.BucketStep.run

    def counted(self: _steady_step.BucketStep, *args: Any) -> bool:
        took = run(self, *args)
        counts["hit" if took else "miss"] += 1
        return took

    monkeypatch.setattr(_steady_step.BucketStep, "run", counted)
    a, b, pa, pb = _twins()
    handle = step_in_backward(pa, a, bucket_cap_mb=cap)
    hits = []
    for step in range(6):
        if step == 4:
            for opt, ps in ((a, pa), (b, pb)):
                _changes()["state_tensor"](opt, ps)
        _backward_both(a, b, pa, pb, step)
        hits.append(counts["hit"])
    handle.remove()
    # Step 0 is the handle's full step, step 1 records each bucket, steps 2 and 3 repeat
    # every bucket; at step 4 the bucket of the replaced codes misses once.
    per_step = hits[2] - hits[1]
    assert per_step >= (4 if cap == 0 else 2)
    assert hits[1] == 0 and hits[3] - hits[2] == per_step
    assert counts["miss"] == 1 and hits[4] - hits[3] == per_step - 1
    assert hits[5] - hits[4] == per_step


def test_in_backward_buckets_with_tensor_betas_take_the_full_step(
        fused_on_cpu: dict[str, int]) -> None:
    """Tensor betas changed in place between backwards (a scheduler's way) reach every
    bucket's step: buckets are not recorded while any group's betas are tensors, so the
    steps stay those of an optimizer that only ever takes the full step."""
    from gefen_core import step_in_backward

    def make() -> tuple[Gefen, list[torch.Tensor]]:
        named = _model()
        opt = Gefen(named, lr=1e-3, min_dim_size_to_factor=0,
                    betas=(torch.tensor(0.9), torch.tensor(0.999)))
        return opt, [p for _, p in named]

    (a, pa), (b, pb) = make(), make()
    handle = step_in_backward(pa, a, bucket_cap_mb=0.002)
    for step in range(5):
        if step == 3:
            for opt in (a, b):
                opt.param_groups[0]["betas"][0].fill_(0.5)
        _backward_both(a, b, pa, pb, step)
    handle.remove()
