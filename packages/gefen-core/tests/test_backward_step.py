"""Gefen stepped in the backward pass (gefen_core.step_in_backward,
docs/algorithm.md#step-in-backward): bit-identical to normal stepping on a small Llama, checkpoints
that cross between the two modes, and the combinations that are refused."""

from __future__ import annotations

import functools
import io
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gefen_core import Gefen, GefenMuonHybrid, step_in_backward

VOCAB, DIM, HEADS, HIDDEN, SEQ = 64, 32, 4, 64, 12


class _RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn_norm = _RMSNorm(DIM)
        self.q_proj = nn.Linear(DIM, DIM, bias=False)
        self.k_proj = nn.Linear(DIM, DIM, bias=False)
        self.v_proj = nn.Linear(DIM, DIM, bias=False)
        self.o_proj = nn.Linear(DIM, DIM, bias=False)
        self.mlp_norm = _RMSNorm(DIM)
        self.gate_proj = nn.Linear(DIM, HIDDEN, bias=False)
        self.up_proj = nn.Linear(DIM, HIDDEN, bias=False)
        self.down_proj = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.attn_norm(x)
        q, k, v = (proj(h).view(b, t, HEADS, DIM // HEADS).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, t, DIM))
        h = self.mlp_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class TinyLlama(nn.Module):
    """Llama's layout (RMSNorm, causal attention, SwiGLU MLP) at toy size, optionally with the
    LM head tied to the embedding."""

    def __init__(self, layers: int = 2, tie: bool = False) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(_Block() for _ in range(layers))
        self.norm = _RMSNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        if tie:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def _batch(step: int, rows: int = 4, device: str = "cpu") -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, SEQ + 1),
                         generator=torch.Generator().manual_seed(step)).to(device)


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def _schedule(i: int) -> float:
    return min(1.0, (i + 1) / 4) * (0.5 + 0.5 * math.cos(math.pi * i / 40))


def _build(options: dict, *, tie: bool = False, hybrid: bool = False, device: str = "cpu",
           dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    model = TinyLlama(tie=tie).to(device=device, dtype=dtype)
    if hybrid:
        opt = GefenMuonHybrid(model, lr=3e-3, weight_decay=0.1, backup_optimizer="gefen",
                              **options)
    else:
        opt = Gefen(model.named_parameters(), lr=3e-3, weight_decay=0.1, **options)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule)
    return model, opt, sched


def _same(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _step_count(opt: Gefen, p: torch.Tensor) -> float | None:
    """The parameter's step counter ``t`` in ``opt``'s state (``None`` before its first step)."""
    state = opt.state.get(p, {})
    return float(state["step"]) if "step" in state else None


def _smallest_of_each_group(params: list[torch.Tensor], opt) -> set[int]:  # noqa: ANN001
    groups = (opt.backup if isinstance(opt, GefenMuonHybrid) else opt).param_groups
    hooked = {id(p) for p in params}
    kept = set()
    for group in groups:
        sizes = [(p.numel(), i, p) for i, p in enumerate(group["params"]) if id(p) in hooked]
        if sizes:
            kept.add(id(min(sizes, key=lambda t: t[:2])[2]))
    return kept


def _train(modes: str, options: dict, *, steps: int = 20, switch_at: int = 10,
           tie: bool = False, hybrid: bool = False, accumulate: int = 1,
           clip_per_param: float | None = None, device: str = "cpu",
           dtype: torch.dtype = torch.float32, offload: bool | None = None,
           bucket_cap_mb: float = 25.0):
    """``modes``: two letters, the stepping before and after a save/load at ``switch_at``
    (``n`` normal, ``b`` in backward). Returns losses, parameters and the final state_dict."""
    model, opt, sched = _build(options, tie=tie, hybrid=hybrid, device=device, dtype=dtype)
    handle = None
    losses = []
    for i in range(steps):
        mode = modes[0] if i < switch_at else modes[1]
        if i == switch_at:
            if handle is not None:
                handle.remove()
                handle = None
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict()}, buf)
            buf.seek(0)
            saved = torch.load(buf, weights_only=True)
            model, opt, sched = _build(options, tie=tie, hybrid=hybrid, device=device,
                                       dtype=dtype)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            sched.load_state_dict(saved["sched"])
        if mode == "b" and handle is None:
            handle = step_in_backward(model, opt, max_grad_norm_per_param=clip_per_param,
                                      offload_first_step=offload, bucket_cap_mb=bucket_cap_mb)
        gefen = opt.backup if isinstance(opt, GefenMuonHybrid) else opt
        before = {id(p): _step_count(gefen, p) for p in model.parameters()}
        for m in range(accumulate):
            tokens = _batch(i * accumulate + m, device=device)
            loss = _loss(model, tokens) / accumulate
            if handle is not None and m < accumulate - 1:
                with handle.no_step():
                    loss.backward()
            else:
                loss.backward()
        every = options.get("codebook_refresh_every", 0)
        full = i in (0, switch_at) or (every and i % every == 0)  # full steps keep gradients
        offloaded = i == 0 and (device != "cpu" if offload is None else offload)
        if mode == "b" and handle is not None and offloaded:
            # The codebook-learning step moved every hooked gradient off its parameter but
            # the kept ones; all of them step in optimizer.step().
            kept = _smallest_of_each_group(handle.params, opt)
            for p in handle.params:
                assert (p.grad is not None) == (id(p) in kept)
                assert _step_count(gefen, p) is None
        elif mode == "b" and handle is not None and not full:
            # Stepped in backward: every hooked gradient released, every parameter moved
            # before optimizer.step(), but the smallest hooked parameter of each group, which
            # keeps its gradient for optimizer.step().
            backup = {id(p) for p in handle.params}
            kept = _smallest_of_each_group(handle.params, opt)
            # Stepped or not is read from the step counters: a bf16 parameter's update can
            # round to no change.
            for p in model.parameters():
                if id(p) in kept:
                    assert p.grad is not None and _step_count(gefen, p) == before[id(p)]
                elif id(p) in backup:
                    assert p.grad is None and _step_count(gefen, p) == before[id(p)] + 1
        if mode == "n" and clip_per_param is not None:
            for p in model.parameters():
                torch.nn.utils.clip_grad_norm_(p, clip_per_param, foreach=False)
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    params = [p.detach().clone() for p in model.parameters()]
    return losses, params, opt.state_dict()


OPTIONS = {
    "block-nearest": dict(factored_v_2d=False),
    "factored-nearest": dict(factored_v_2d=True, min_dim_size_to_factor=8),
    "block-stochastic": dict(factored_v_2d=False, stochastic_round=True),
    "factored-stochastic": dict(factored_v_2d=True, min_dim_size_to_factor=8,
                                stochastic_round=True),
}


# MiB: every gradient in one bucket per group; a few gradients per bucket; one per hook.
BUCKET_CAPS = (25.0, 12 / 1024, 0.0)


@pytest.mark.parametrize("kind", sorted(OPTIONS))
def test_in_backward_is_bit_identical_to_normal_stepping_across_checkpoints(kind: str) -> None:
    options = OPTIONS[kind]
    reference = _train("nn", options)
    for modes, cap in (("bb", BUCKET_CAPS[0]), ("bb", BUCKET_CAPS[1]), ("bb", BUCKET_CAPS[2]),
                       ("nb", BUCKET_CAPS[1]), ("bn", BUCKET_CAPS[2])):
        got = _train(modes, options, bucket_cap_mb=cap)
        _same(got[0], reference[0], f"{modes} losses")
        _same(got[1], reference[1], f"{modes} params")
        _same(got[2], reference[2], f"{modes} state_dict")
    # Enough happened for the comparison to mean something: the loss fell, and the state
    # covers both second-moment modes asked for.
    assert reference[0][-1] < reference[0][0]
    keys = {k for st in reference[2]["state"].values() for k in st}
    assert ("exp_avg_sq_row" in keys) == options["factored_v_2d"]


@pytest.mark.parametrize("cap", BUCKET_CAPS)
def test_buckets_step_gradients_together_and_hold_at_most_the_cap(cap: float,
                                                                  monkeypatch) -> None:  # noqa: ANN001
    """Each in-backward update steps one bucket: its gradients' bytes reach the cap only with
    its last gradient, so at most the cap plus one gradient waits; every bucket has stepped
    before backward returns."""
    model, opt, _ = _build(OPTIONS["factored-nearest"])
    handle = step_in_backward(model, opt, bucket_cap_mb=cap)
    buckets: list[list[int]] = []
    step_group = opt._step_group

    def counted(group, by_path):  # noqa: ANN001, ANN202
        buckets.append([g.numel() * g.element_size()
                        for lists in by_path.values() for g in lists["grads"]])
        return step_group(group, by_path)

    monkeypatch.setattr(opt, "_step_group", counted)
    for i in range(3):
        buckets.clear()
        _loss(model, _batch(i)).backward()
        in_backward = list(buckets)
        opt.step()
        opt.zero_grad()
    kept = _smallest_of_each_group(handle.params, opt)
    assert sum(len(b) for b in in_backward) == len(handle.params) - len(kept)
    limit = int(cap * 2**20)
    for sizes in in_backward:
        assert sum(sizes[:-1]) < limit or len(sizes) == 1
    if cap == 0:
        assert all(len(b) == 1 for b in in_backward)
    else:
        assert any(len(b) > 1 for b in in_backward)
        if cap < 1:
            assert len(in_backward) > 1  # the cap split the backward's gradients
    handle.remove()


def test_a_bucket_left_by_a_failed_backward_steps_in_optimizer_step() -> None:
    """A backward that raises after some hooks ran never reaches its final callback: the
    gradients waiting in the bucket step in the next ``optimizer.step()``, as the step would
    have stepped them without the handle, and no parameter steps twice."""
    model, opt, _ = _build(OPTIONS["block-nearest"])
    handle = step_in_backward(model, opt)
    for i in range(2):  # the handle's first step is a full step
        _loss(model, _batch(i)).backward()
        opt.step()
        opt.zero_grad()

    def fail(p: torch.Tensor) -> None:
        raise RuntimeError("hook failed")

    # The embedding's gradient is the backward's last: every other one is in the bucket.
    failing = model.embed_tokens.weight.register_post_accumulate_grad_hook(fail)
    before = {id(p): _step_count(opt, p) for p in model.parameters()}
    with pytest.raises(RuntimeError, match="hook failed"):
        _loss(model, _batch(2)).backward()
    waiting = [p for p in handle.params
               if p.grad is not None and _step_count(opt, p) == before[id(p)]]
    assert len(waiting) > 2  # the bucket's, and the kept ones
    opt.step()
    opt.zero_grad()
    for p in model.parameters():
        assert _step_count(opt, p) == before[id(p)] + 1
    failing.remove()
    _loss(model, _batch(3)).backward()  # nothing of the failed backward is left to step
    opt.step()
    for p in model.parameters():
        assert _step_count(opt, p) == before[id(p)] + 2
    handle.remove()


@pytest.mark.parametrize("kind", sorted(OPTIONS))
def test_offloaded_first_step_is_bit_identical_to_the_full_step(kind: str) -> None:
    options = OPTIONS[kind]
    reference = _train("nn", options, steps=6, switch_at=3)
    for modes in ("bb", "bn"):
        got = _train(modes, options, steps=6, switch_at=3, offload=True)
        _same(got, reference, modes)


def test_offloaded_first_step_with_a_nonfinite_gradient_skips_like_the_full_step() -> None:
    runs = []
    for offload in (None, True):
        model, opt, _ = _build(OPTIONS["block-nearest"])
        handle = step_in_backward(model, opt, offload_first_step=offload) if offload else None
        loss = _loss(model, _batch(0))
        # A non-finite gradient half-way through the backward: the hooks have already moved
        # the gradients before it.
        model.layers[0].up_proj.weight.register_hook(lambda g: g * float("nan"))
        loss.backward()
        seen: list[list[torch.Tensor]] = []
        # Registered after the handle's: sees what Gefen's step gets.
        params = list(model.parameters())

        def record(*_, seen=seen, params=params) -> None:
            seen.append([p.grad.clone() for p in params])

        opt.register_step_pre_hook(record)
        with pytest.warns(RuntimeWarning, match="non-finite gradients on the step that would "
                                                "learn the codebook"):
            opt.step()
        assert opt._codebook is None and opt._global_step == 0 and not opt.state
        runs.append(seen[0])
        if handle is not None:
            handle.remove()
    assert len(runs[1]) == len(runs[0])
    for got, want in zip(runs[1], runs[0]):  # the same bits, NaNs included
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_remove_before_step_hands_offloaded_gradients_back() -> None:
    model, opt, _ = _build(OPTIONS["block-nearest"])
    reference, ref_opt, _ = _build(OPTIONS["block-nearest"])
    handle = step_in_backward(model, opt, offload_first_step=True)
    for m in (model, reference):
        _loss(m, _batch(0)).backward()
    assert sum(p.grad is not None for p in model.parameters()) < len(list(model.parameters()))
    handle.remove()
    _same([p.grad for p in model.parameters()], [p.grad for p in reference.parameters()])
    opt.step()
    ref_opt.step()
    _same(opt.state_dict(), ref_opt.state_dict())


def test_tied_embedding_steps_once_per_backward() -> None:
    options = OPTIONS["factored-stochastic"]
    reference = _train("nn", options, steps=8, switch_at=4, tie=True)
    got = _train("bb", options, steps=8, switch_at=4, tie=True)
    _same(got, reference)
    assert int(got[2]["state"][0]["step"]) == 8  # the tied tensor: one step per backward


def test_accumulation_with_no_step_matches_normal_accumulation() -> None:
    options = OPTIONS["factored-nearest"]
    reference = _train("nn", options, steps=6, switch_at=3, accumulate=3)
    _same(_train("bb", options, steps=6, switch_at=3, accumulate=3), reference)


def test_per_parameter_clipping_matches_clipping_each_gradient() -> None:
    options = OPTIONS["block-nearest"]
    reference = _train("nn", options, steps=6, switch_at=3, clip_per_param=0.05)
    _same(_train("bb", options, steps=6, switch_at=3, clip_per_param=0.05), reference)
    unclipped = _train("nn", options, steps=6, switch_at=3)
    assert not torch.equal(unclipped[1][0], reference[1][0])  # the clip did bite


def test_codebook_refresh_steps_take_the_full_step() -> None:
    options = dict(OPTIONS["block-nearest"], codebook_refresh_every=3)
    reference = _train("nn", options, steps=8, switch_at=4)
    _same(_train("bb", options, steps=8, switch_at=4), reference)


def test_hybrid_gefen_backup_steps_in_backward() -> None:
    options = dict(stochastic_round=True)
    reference = _train("nn", options, steps=6, switch_at=3, hybrid=True)
    _same(_train("bb", options, steps=6, switch_at=3, hybrid=True), reference)
    _same(_train("bb", options, steps=6, switch_at=3, hybrid=True, offload=True), reference,
          "offloaded first step")
    model, opt, _ = _build(options, hybrid=True)
    handle = step_in_backward(model, opt)
    backup = {id(p) for p in handle.params}
    assert backup == {id(p) for g in opt.backup.param_groups for p in g["params"]}
    for i in range(2):
        _loss(model, _batch(i)).backward()
        if i == 1:  # the Muon half (and one backup parameter a group) keeps its gradients
            kept = _smallest_of_each_group(handle.params, opt)
            assert all((p.grad is None) == (id(p) in backup - kept)
                       for p in model.parameters())
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("offload", [False, True])
def test_a_parameter_outside_the_hooks_steps_in_optimizer_step(offload: bool) -> None:
    # Offloaded, the first step's codebook also counts the unhooked gradients.
    options = OPTIONS["block-nearest"]
    model, opt, _ = _build(options)
    twin, twin_opt, _ = _build(options)
    step_in_backward([model.lm_head.weight, model.norm.weight], opt, offload_first_step=offload)
    for i in range(4):
        for m, o in ((model, opt), (twin, twin_opt)):
            _loss(m, _batch(i)).backward()
            o.step()
            o.zero_grad()
    _same([p.detach() for p in model.parameters()], [p.detach() for p in twin.parameters()])
    _same(opt.state_dict(), twin_opt.state_dict())


def test_scheduler_does_not_warn_and_remove_restores_normal_stepping() -> None:
    import warnings

    model, opt, sched = _build(OPTIONS["block-nearest"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with step_in_backward(model, opt) as handle:
            for i in range(3):
                _loss(model, _batch(i)).backward()
                opt.step()
                sched.step()
    assert not handle._handles
    _loss(model, _batch(3)).backward()
    assert all(p.grad is not None for p in model.parameters())  # no hook any more
    step_in_backward(model, opt).remove()  # and a new handle may be made


# ---------------------------------------------------------------------- refusals
def _started(options: dict | None = None):
    model, opt, _ = _build(options or OPTIONS["block-nearest"])
    return model, opt


def _frozen(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_global_norm_clipping_is_refused_before_any_parameter_steps() -> None:
    model, opt = _started()
    step_in_backward(model, opt)
    before = _frozen(model)
    _loss(model, _batch(0)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(RuntimeError, match="changed between backward and optimizer.step.*"
                                           "max_grad_norm_per_param"):
        opt.step()
    _same(_frozen(model), before)
    assert opt._codebook is None and not opt.state


@pytest.mark.parametrize("hybrid", [False, True], ids=["gefen", "hybrid"])
@pytest.mark.parametrize("clip", ["norm", "value"])
def test_gradient_clipping_that_starts_on_a_later_step_is_refused(clip: str,
                                                                   hybrid: bool) -> None:
    # Clipping that starts after the handle's first (full) step: the hooks have stepped and
    # released almost every gradient, so clip_grad_norm_ over the model finds only the kept
    # one of each group. The changed kept gradient is refused at optimizer.step().
    model, opt, _ = _build({} if hybrid else OPTIONS["block-nearest"], hybrid=hybrid)
    handle = step_in_backward(model, opt)
    for i in range(3):
        _loss(model, _batch(i)).backward()
        opt.step()
        opt.zero_grad()
    kept = _smallest_of_each_group(handle.params, opt)
    _loss(model, _batch(3)).backward()
    # Not moved by the refused step: the kept parameters and the hybrid's Muon half.
    stepped = {id(p) for p in handle.params} - kept
    assert len(kept) == len(opt.param_groups if not hybrid else opt.backup.param_groups) > 0
    still = {id(p): p.detach().clone() for p in model.parameters() if id(p) not in stepped}
    if clip == "norm":
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        assert 0 < float(norm)  # only the kept gradients (and the hybrid's Muon half) count
    else:
        torch.nn.utils.clip_grad_value_(model.parameters(), 1e-6)
    with pytest.raises(RuntimeError, match="changed between backward and optimizer.step.*"
                                           "max_grad_norm_per_param.*already stepped"):
        opt.step()
    for p in model.parameters():
        if id(p) in still:
            _same(p.detach(), still[id(p)])


def test_grad_scaler_is_refused_before_any_parameter_steps() -> None:
    model, opt = _started()
    step_in_backward(model, opt)
    before = _frozen(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    scaler.scale(_loss(model, _batch(0))).backward()
    # The scaler unscales the kept gradients before stepping: refused as a gradient change,
    # naming the scaler's fix.
    with pytest.raises(RuntimeError, match="changed between backward and optimizer.step.*"
                                           "bf16 without a GradScaler"):
        scaler.step(opt)
    _same(_frozen(model), before)


def test_fp16_parameters_and_fp16_autocast_are_refused() -> None:
    model = TinyLlama().half()
    opt = Gefen(model.named_parameters())
    with pytest.raises(ValueError, match="fp16.*GradScaler"):
        step_in_backward(model, opt)
    model, opt = _started()
    step_in_backward(model, opt)
    with torch.autocast("cpu", dtype=torch.float16), \
            pytest.raises(RuntimeError, match="fp16 autocast"):
        _loss(model, _batch(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _loss(model, _batch(0))  # bf16 autocast is fine


def test_accumulation_without_no_step_is_refused() -> None:
    # With the module: at the second forward, on the handle's first (full) step.
    model, opt = _started()
    step_in_backward(model, opt)
    before = _frozen(model)
    _loss(model, _batch(0)).backward()
    with pytest.raises(RuntimeError, match="no_step"):
        _loss(model, _batch(1))
    _same(_frozen(model), before)
    # With parameters only: at the first hook of the second backward.
    model, opt = _started()
    step_in_backward(model.parameters(), opt)
    before = _frozen(model)
    _loss(model, _batch(0)).backward()
    with pytest.raises(RuntimeError, match="second gradient.*no_step"):
        _loss(model, _batch(1)).backward()
    _same(_frozen(model), before)


def test_a_gradient_accumulated_twice_in_one_backward_is_refused() -> None:
    # A tied weight used inside two reentrant checkpoints gets two accumulations.
    from torch.utils.checkpoint import checkpoint

    w = nn.Parameter(torch.randn(8, 8))
    opt = Gefen([("w", w)])
    step_in_backward([w], opt)
    x = torch.randn(2, 8, requires_grad=True)
    y = checkpoint(lambda t: t @ w, x, use_reentrant=True)
    z = checkpoint(lambda t: t @ w, y, use_reentrant=True)
    with pytest.raises(RuntimeError, match="second gradient.*use_reentrant=False"):
        z.sum().backward()
    assert opt._codebook is None  # the first step is a full step: nothing stepped yet


def test_hyperparameter_change_between_backward_and_step_is_refused() -> None:
    model, opt = _started()
    step_in_backward(model, opt)
    _loss(model, _batch(0)).backward()
    opt.param_groups[0]["lr"] = 1e-4
    with pytest.raises(RuntimeError, match="hyperparameter"):
        opt.step()


def test_closure_is_refused() -> None:
    model, opt = _started()
    step_in_backward(model, opt)

    def closure() -> torch.Tensor:
        loss = _loss(model, _batch(0))
        loss.backward()
        return loss

    with pytest.raises(RuntimeError, match="closure"):
        opt.step(closure)


def test_options_and_optimizers_that_cannot_step_in_backward_are_refused() -> None:
    model = TinyLlama()
    named = list(model.named_parameters())
    with pytest.raises(ValueError, match="skip_nonfinite"):
        step_in_backward(model, Gefen(named, skip_nonfinite=True))
    with pytest.raises(ValueError, match="capturable"):
        step_in_backward(model, Gefen(named, capturable=True))
    with pytest.raises(TypeError, match="Gefen or a GefenMuonHybrid"):
        step_in_backward(model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(TypeError, match="backup_optimizer='gefen'"):
        step_in_backward(model, GefenMuonHybrid(model, lr=1e-3, backup_optimizer="adamw"))
    from gefen_core import GefenMuon

    hidden = [(n, p) for n, p in named if p.ndim == 2 and "embed" not in n and "head" not in n]
    with pytest.raises(TypeError, match="GefenMuon cannot"):
        step_in_backward(model, GefenMuon(hidden))
    opt = Gefen(named[:3])
    with pytest.raises(ValueError, match="not in the optimizer"):
        step_in_backward([p for _, p in named[:4]], opt)
    with pytest.raises(ValueError, match="max_grad_norm_per_param"):
        step_in_backward(model, opt, max_grad_norm_per_param=0.0)
    for cap in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="bucket_cap_mb must be finite and >= 0"):
            step_in_backward(model, opt, bucket_cap_mb=cap)
    with pytest.raises(TypeError, match="bucket_cap_mb must be a number"):
        step_in_backward(model, opt, bucket_cap_mb="25")  # type: ignore[arg-type]
    handle = step_in_backward(model, opt)
    with pytest.raises(ValueError, match="already steps in backward"):
        step_in_backward(model, opt)
    handle.remove()


def test_data_parallel_and_dtensor_parameters_are_refused(monkeypatch) -> None:  # noqa: ANN001
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        model = TinyLlama()
        ddp = nn.parallel.DistributedDataParallel(model)
        with pytest.raises(ValueError, match="DistributedDataParallel"):
            step_in_backward(ddp, Gefen(ddp.named_parameters()))
        mesh = init_device_mesh("cpu", (1,))
        replicated = nn.Parameter(distribute_tensor(torch.randn(8), mesh, [Replicate()]))
        with pytest.raises(ValueError, match="DTensor"):
            step_in_backward([replicated], Gefen([("r", replicated)]))
        monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 2)
        with pytest.raises(ValueError, match="2 ranks"):
            step_in_backward(model, Gefen(model.named_parameters()))
    finally:
        dist.destroy_process_group()


def test_sharded_optimizer_is_refused() -> None:
    pytest.importorskip("gefen_dist")
    from gefen_dist import ShardedGefen

    model = TinyLlama()
    with pytest.raises(ValueError, match="reduces statistics over ranks"):
        step_in_backward(model, ShardedGefen(model.named_parameters()))


def _private_compiled_autograd(backward) -> None:  # noqa: ANN001
    from torch._dynamo import compiled_autograd

    with compiled_autograd._enable(functools.partial(torch.compile, backend="eager")):
        backward()


def _public_compiled_autograd(backward) -> None:  # noqa: ANN001
    with torch._dynamo.config.patch(compiled_autograd=True):
        torch.compile(backward, backend="eager")()


@pytest.mark.parametrize("route", [_private_compiled_autograd, _public_compiled_autograd],
                         ids=["private-enable", "config-flag"])
@pytest.mark.parametrize("in_backward_steps", [0, 1])
def test_compiled_autograd_is_refused(route, in_backward_steps: int) -> None:  # noqa: ANN001
    # Both ways into compiled autograd: torch._dynamo.compiled_autograd._enable(compiler)
    # around backward (what some frameworks use) and the config flag on a compiled backward.
    model, opt = _started()
    handle = step_in_backward(model, opt)
    for i in range(1 + in_backward_steps):  # the full first step, then steps in backward
        _loss(model, _batch(i)).backward()
        opt.step()
        opt.zero_grad()
    before, state = _frozen(model), opt.state_dict()
    loss = _loss(model, _batch(9))
    torch._dynamo.reset()
    try:
        with pytest.raises(RuntimeError, match="being traced \\(compiled autograd\\)"):
            route(loss.backward)
    finally:
        torch._dynamo.reset()
    _same(_frozen(model), before)
    _same(opt.state_dict(), state)
    assert not handle._open and not handle._seen
