"""GefenMuonHybrid (docs/algorithm.md#hybrid): routing, groups, state view, AMP, checkpoints."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from torch import nn

from gefen_core.hybrid import GefenMuonHybrid
from gefen_core.muon import GefenMuon
from gefen_core.optimizer import Gefen
from gefen_core.routing import split_params_for_muon


class TinyLM(nn.Module):
    """Embedding with a tied head, an MLP, a norm, a conv, a frozen layer, a zero-size param."""

    def __init__(self, vocab: int = 32, d: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)
        self.norm = nn.LayerNorm(d)
        self.conv = nn.Conv1d(d, d, 3, padding=1)
        self.frozen = nn.Linear(d, d)
        self.frozen.requires_grad_(False)
        self.empty = nn.Parameter(torch.zeros(0, d))
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = h + self.conv(h.transpose(1, 2)).transpose(1, 2)
        h = h + self.down(torch.nn.functional.gelu(self.up(h))) + self.frozen(h)
        return self.lm_head(self.norm(h))


def make_model(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM()


def batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 32, (4, 12), generator=g)


def backward(model: nn.Module, seed: int) -> None:
    x = batch(seed)
    logits = model(x[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, 32), x[:, 1:].reshape(-1))
    loss.backward()


def train(model, opt, steps, start=0):
    for i in range(start, start + steps):
        opt.zero_grad()
        backward(model, i)
        opt.step()


def clone_model(model: TinyLM) -> TinyLM:
    other = make_model()
    other.load_state_dict(model.state_dict())
    return other


# ------------------------------------------------------------------ construction and routing


def test_model_form_routes_every_trainable_parameter_once():
    model = make_model()
    opt = GefenMuonHybrid(model, lr=1e-3)
    muon_ids = {id(p) for g in opt.muon.param_groups for p in g["params"]}
    backup_ids = {id(p) for g in opt.backup.param_groups for p in g["params"]}
    assert muon_ids == {id(model.up.weight), id(model.down.weight)}
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert muon_ids | backup_ids == trainable and not muon_ids & backup_ids
    assert id(model.embed.weight) in backup_ids  # and so the tied head
    assert not {id(p) for p in model.frozen.parameters()} & (muon_ids | backup_ids)
    assert isinstance(opt.muon, GefenMuon) and isinstance(opt.backup, Gefen)
    names = [n for g in opt.muon.param_groups for n in g["param_names"]]
    assert names == ["up.weight", "down.weight"]


def test_three_forms_agree():
    model = make_model()
    a = GefenMuonHybrid(model, lr=1e-3)
    b = GefenMuonHybrid(model.named_parameters(), lr=1e-3)
    muon, backup = split_params_for_muon(model)
    c = GefenMuonHybrid(muon, backup, lr=1e-3)
    d = GefenMuonHybrid.from_model(model, lr=1e-3)
    for opt in (b, c, d):
        assert [[id(p) for p in g["params"]] for g in opt.param_groups] == \
            [[id(p) for p in g["params"]] for g in a.param_groups]


def test_backup_substrings_and_their_restriction():
    model = make_model()
    opt = GefenMuonHybrid.from_model(model, lr=1e-3, backup_substrings=("up",))
    backup_ids = {id(p) for g in opt.backup.param_groups for p in g["params"]}
    assert id(model.up.weight) in backup_ids
    muon, backup = split_params_for_muon(model)
    with pytest.raises(TypeError, match="backup_substrings only applies"):
        GefenMuonHybrid(muon, backup, lr=1e-3, backup_substrings=("up",))


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        (lambda m: ([p for p in m.parameters()],), {}, TypeError, "bare tensor"),
        (lambda m: (torch.zeros(3, 3),), {}, TypeError, "bare tensor"),
        (lambda m: ([], []), {}, ValueError, "no trainable parameters"),
        (lambda m: ([("w", nn.Parameter(torch.zeros(0, 4)))], [("b", nn.Parameter(
            torch.zeros(0)))]), {}, ValueError, "ZeRO-3"),
        (lambda m: (m,), {"backup_optimizer": "sgd"}, ValueError, "backup_optimizer"),
        (lambda m: ([("w", m.up.weight)], [("w2", m.up.weight)]), {}, ValueError,
         "same tensor"),
        (lambda m: ([("w", m.up.weight)], [("W", m.down.weight)]), {}, ValueError,
         "case-insensitive"),
        (lambda m: ([("norm", m.norm.weight)], []), {}, ValueError, "2-D"),
    ],
)
def test_construction_errors(args, kwargs, error, match):
    model = make_model()
    with pytest.raises(error, match=match):
        GefenMuonHybrid(*args(model), lr=1e-3, **kwargs)


def test_hybrid_defaults():
    opt = GefenMuonHybrid(make_model(), lr=3e-3)
    mg = opt.muon.param_groups[0]
    assert mg["lr"] == 3e-3 and mg["weight_decay"] == 0.0 and mg["eps"] == 1e-7
    assert mg["adjust_lr_fn"] == "match_rms_adamw" and mg["normuon"] is True
    assert mg["ns_steps"] == 3  # tuned3
    assert mg["momentum"] == 0.95 and mg["nesterov"] is True
    bg = opt.backup.param_groups[0]
    assert bg["lr"] == 3e-3 and bg["weight_decay"] == 0.0 and bg["betas"] == (0.9, 0.999)
    assert bg["eps"] == 1e-8 and bg["factored_v_2d"] is False
    assert bg["force_1d_period_one"] is False and bg["force_2d_period_one"] is False
    # The backup's factored_v_2d is pinned off (docs/algorithm.md#hybrid): its matrices, large
    # (embedding, head) and small alike, take the per-block second moment, which is what the
    # factoring rule asks of the small ones (docs/algorithm.md#factoring-rule).
    assert bg["min_dim_size_to_factor"] == 128


def test_backup_gefen_keeps_every_matrix_per_block():
    backup = [("embed.weight", nn.Parameter(torch.randn(300, 256))),
              ("lm_head.weight", nn.Parameter(torch.randn(10, 256)))]
    hidden = [("layer.weight", nn.Parameter(torch.randn(32, 32)))]
    opt = GefenMuonHybrid(hidden, backup, lr=1e-3)
    for _, p in hidden + backup:
        p.grad = torch.randn(p.shape)
    opt.step()
    for _, p in backup:
        st = opt.backup.state[p]
        assert "exp_avg_sq" in st and "exp_avg_sq_row" not in st


def test_native_muon_scale_warns():
    with pytest.warns(UserWarning, match="match_rms_adamw"):
        GefenMuonHybrid(make_model(), lr=1e-3, adjust_lr_fn=None)


def test_per_half_overrides():
    model = make_model()
    opt = GefenMuonHybrid(model, lr=1e-3, muon_lr=0.02, backup_lr=4e-4, weight_decay=0.1,
                          backup_weight_decay=0.01, no_decay_substrings=("norm", "bias"),
                          backup_1d_period_one=True, backup_2d_period_one=True)
    assert opt.muon.param_groups[0]["lr"] == 0.02
    assert opt.muon.param_groups[0]["weight_decay"] == 0.1
    decayed, plain = opt.backup.param_groups
    assert decayed["lr"] == 4e-4 and decayed["weight_decay"] == 0.01
    assert plain["weight_decay"] == 0.0
    assert all("norm" in n or "bias" in n for n in plain["param_names"])
    assert decayed["force_1d_period_one"] and decayed["force_2d_period_one"]
    adamw = GefenMuonHybrid(model, lr=1e-3, backup_optimizer="adamw", backup_lr=5e-4,
                            backup_1d_period_one=True)
    assert isinstance(adamw.backup, torch.optim.AdamW)
    assert adamw.backup.param_groups[0]["lr"] == 5e-4
    assert "embed.weight" in adamw.backup.param_groups[0]["param_names"]


# ------------------------------------------------------------------ torch.optim surface


def test_param_groups_are_live_and_schedulers_keep_the_ratio():
    model = make_model()
    opt = GefenMuonHybrid(model, lr=1e-3, muon_lr=0.02, backup_lr=0.001)
    groups = opt.param_groups
    assert groups[0] is opt.muon.param_groups[0] and groups[1] is opt.backup.param_groups[0]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.5**epoch)
    for _ in range(2):
        train(model, opt, 1)
        sched.step()
    assert opt.muon.param_groups[0]["lr"] == pytest.approx(0.02 * 0.25)
    assert opt.backup.param_groups[0]["lr"] == pytest.approx(0.001 * 0.25)
    assert sched.get_last_lr() == pytest.approx([0.005, 0.00025])
    with pytest.raises(TypeError, match="cannot be assigned"):
        opt.param_groups = []


def test_state_view_routes_to_the_owner():
    model = make_model()
    opt = GefenMuonHybrid(model, lr=1e-3)
    train(model, opt, 1)
    assert opt.state[model.up.weight] is opt.muon.state[model.up.weight]
    assert opt.state[model.norm.weight] is opt.backup.state[model.norm.weight]
    assert model.up.weight in opt.state and "exp_avg_codes" in opt.state[model.up.weight]
    assert len(opt.state) == len(opt.muon.state) + len(opt.backup.state)
    opt.state[model.norm.bias] = {"marker": 1}
    assert opt.backup.state[model.norm.bias] == {"marker": 1}
    del opt.state[model.norm.bias]
    assert model.norm.bias not in opt.backup.state
    stranger = torch.zeros(3)
    assert stranger not in opt.state
    with pytest.raises(KeyError, match="DeepSpeed ZeRO"):
        opt.state[stranger]
    with pytest.raises(NotImplementedError, match="routed"):
        opt.add_param_group({"params": [stranger]})


def test_step_equals_the_two_children_stepped_alone():
    for backup in ("gefen", "adamw"):
        m1 = make_model()
        m2 = clone_model(m1)
        hybrid = GefenMuonHybrid(m1, lr=2e-3, backup_optimizer=backup, weight_decay=0.01)
        muon, rest = split_params_for_muon(m2)
        alone_muon = GefenMuon(muon, lr=2e-3, weight_decay=0.01, ns_schedule="tuned3",
                               adjust_lr_fn="match_rms_adamw", normuon=True)
        if backup == "gefen":
            alone_backup = Gefen([{"params": rest}], lr=2e-3, weight_decay=0.01,
                                 factored_v_2d=False)
        else:
            alone_backup = torch.optim.AdamW(rest, lr=2e-3, weight_decay=0.01)
        for i in range(3):
            hybrid.zero_grad()
            backward(m1, i)
            hybrid.step()
            alone_muon.zero_grad()
            alone_backup.zero_grad()
            backward(m2, i)
            alone_muon.step()
            alone_backup.step()
        for (n, a), b in zip(m1.named_parameters(), m2.parameters(), strict=True):
            assert torch.equal(a, b), (backup, n)


def test_zero_grad_delegates():
    model = make_model()
    opt = GefenMuonHybrid(model, lr=1e-3)
    backward(model, 0)
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


# ------------------------------------------------------------------ AMP and refusals


def snapshot(model, opt):
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {}
    for child in opt._children():
        for p, st in child.state.items():
            state[(type(child).__name__, id(p))] = {
                k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in st.items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    meta = [getattr(c, "_global_step", None) for c in opt._children()]
    codebooks = [getattr(c, "_codebook", None) for c in opt._children()]
    codebooks = [None if c is None else c.clone() for c in codebooks]
    return params, state, groups, meta, codebooks


def equal(a, b):
    if a.keys() != b.keys() if isinstance(a, dict) else len(a) != len(b):
        return False
    items = a.items() if isinstance(a, dict) else enumerate(a)
    for k, x in items:
        y = b[k]
        if isinstance(x, torch.Tensor):
            if not isinstance(y, torch.Tensor) or x.dtype != y.dtype or not torch.equal(x, y):
                return False
        elif isinstance(x, (dict, list, tuple)):
            if not isinstance(y, type(x)) or not equal(x if not isinstance(x, tuple) else list(x),
                                                       y if not isinstance(y, tuple) else list(y)):
                return False
        elif x != y:
            return False
    return True


@pytest.mark.parametrize("backup", ["gefen", "adamw"])
def test_grad_scaler_overflow_skips_both_halves(backup):
    model = make_model()
    opt = GefenMuonHybrid(model, lr=1e-3, backup_optimizer=backup)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    train(model, opt, 1)
    before = snapshot(model, opt)
    opt.zero_grad()
    x = batch(7)
    loss = nn.functional.cross_entropy(model(x[:, :-1]).reshape(-1, 32), x[:, 1:].reshape(-1))
    scaler.scale(loss).backward()
    model.norm.weight.grad[0] = float("inf")  # overflow in the backup half only
    scaler.step(opt)
    scaler.update()
    assert equal(before, snapshot(model, opt))
    assert scaler.get_scale() == 2.0**9
    # A clean scaled step then moves both halves, with unscaled gradients.
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x[:, :-1]).reshape(-1, 32), x[:, 1:].reshape(-1))
    scaler.scale(loss).backward()
    scaler.step(opt)
    after = snapshot(model, opt)[0]
    assert not torch.equal(after["up.weight"], before[0]["up.weight"])
    assert not torch.equal(after["norm.weight"], before[0]["norm.weight"])


def test_native_amp_protocol_is_one_decision():
    model = make_model()
    opt = GefenMuonHybrid(model, lr=1e-3, backup_optimizer="adamw")
    train(model, opt, 1)
    before = snapshot(model, opt)
    backward(model, 3)
    opt.found_inf = torch.ones(1)
    opt.grad_scale = torch.tensor(8.0)
    opt.step()
    assert equal(before, snapshot(model, opt))
    # grad_scale given and no overflow: both halves see gradients divided by the scale.
    m2 = clone_model(model)
    opt2 = GefenMuonHybrid(m2, lr=1e-3, backup_optimizer="adamw")
    opt2.load_state_dict(opt.state_dict())
    opt.zero_grad()
    opt2.zero_grad()
    backward(model, 4)
    backward(m2, 4)
    for p in m2.parameters():
        if p.grad is not None:
            p.grad.mul_(8.0)
    opt.found_inf = torch.zeros(1)
    opt.grad_scale = None
    opt2.found_inf = torch.zeros(1)
    opt2.grad_scale = torch.tensor(8.0)
    opt.step()
    opt2.step()
    for a, b in zip(model.parameters(), m2.parameters(), strict=True):
        assert torch.equal(a, b)


def test_bad_backup_gradient_fails_before_the_muon_half_moves():
    model = make_model()
    opt = GefenMuonHybrid(model, lr=1e-3, backup_optimizer="adamw")
    train(model, opt, 1)
    before = snapshot(model, opt)
    backward(model, 5)
    model.norm.weight.grad = torch.zeros(16).to_sparse()  # AdamW can't take it
    with pytest.raises(RuntimeError, match="dense gradients"):
        opt.step()
    assert equal(before, snapshot(model, opt))


def test_non_finite_first_step_skips_both_halves():
    model = make_model()
    opt = GefenMuonHybrid(model, lr=1e-3, backup_optimizer="adamw")
    before = snapshot(model, opt)
    backward(model, 0)
    model.norm.bias.grad[0] = float("nan")  # AdamW half; the Muon half would learn its codebook
    with pytest.warns(RuntimeWarning, match="both halves skip"):
        opt.step()
    assert equal(before, snapshot(model, opt))
    assert opt.muon._codebook is None


def test_flattened_muon_parameter_is_refused_for_both_halves():
    model = make_model()
    opt = GefenMuonHybrid(model, lr=1e-3)
    train(model, opt, 1)
    before = snapshot(model, opt)
    flat = nn.Parameter(torch.randn(model.up.weight.numel()))
    flat.grad = torch.randn_like(flat)
    opt.muon.param_groups[0]["params"][0] = flat  # what ZeRO does to the groups
    backward(model, 6)
    with pytest.raises(ValueError, match="DeepSpeed ZeRO"):
        opt.step()
    opt.muon.param_groups[0]["params"][0] = model.up.weight
    assert equal(before, snapshot(model, opt))


# ------------------------------------------------------------------ checkpoints


@pytest.mark.parametrize("backup", ["gefen", "adamw"])
def test_checkpoint_round_trip_is_bit_identical(backup):
    m1 = make_model()
    o1 = GefenMuonHybrid(m1, lr=2e-3, backup_optimizer=backup, stochastic_round=True)
    train(m1, o1, 3)
    buf = io.BytesIO()
    torch.save(o1.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    assert sd["backup_optimizer"] == backup and sd["hybrid_format_version"] == 1
    m2 = clone_model(m1)
    o2 = GefenMuonHybrid(m2, lr=2e-3, backup_optimizer=backup, stochastic_round=True)
    o2.load_state_dict(sd)
    train(m1, o1, 2, start=10)
    train(m2, o2, 2, start=10)
    for (n, a), b in zip(m1.named_parameters(), m2.parameters(), strict=True):
        assert torch.equal(a, b), n
    s1, s2 = snapshot(m1, o1), snapshot(m2, o2)
    assert equal(s1[2], s2[2]) and s1[3] == s2[3] and equal(s1[4], s2[4])


def _nested(sd):
    out = dict(sd)
    for half in ("muon", "backup"):
        if out.get(half) is not None:
            h = dict(out[half])
            h["state"] = {k: dict(v) for k, v in h["state"].items()}
            h["param_groups"] = [dict(g) for g in h["param_groups"]]
            out[half] = h
    return out


def _bad_codes(sd):
    sd["muon"]["state"][0]["exp_avg_codes"] = sd["muon"]["state"][0]["exp_avg_codes"][:, :1]


def _bad_codebook(sd):
    meta = dict(sd["backup"]["gefen_meta"])
    meta["codebook"] = torch.zeros(256)
    sd["backup"]["gefen_meta"] = meta


def _bad_exp_avg(sd):
    first = next(iter(sd["backup"]["state"]))
    sd["backup"]["state"][first]["exp_avg"] = torch.zeros(3)


def _adamw_group_count(sd):
    sd["backup"]["param_groups"] = sd["backup"]["param_groups"] + sd["backup"]["param_groups"]


def _adamw_bad_lr(sd):
    sd["backup"]["param_groups"][0]["lr"] = -1.0


CASES = [
    ("flat", "gefen", lambda sd: sd.clear() or sd.update(state={}, param_groups=[]),
     "not a GefenMuonHybrid checkpoint"),
    ("version", "gefen", lambda sd: sd.update(hybrid_format_version=2), "version"),
    ("type", "gefen", lambda sd: sd.update(backup_optimizer="adamw"), "backup optimizer"),
    ("type_default", "adamw", lambda sd: sd.pop("backup_optimizer"), "backup optimizer"),
    ("no_muon", "gefen", lambda sd: sd.update(muon=None), "lacks a muon half"),
    ("muon_codes", "gefen", _bad_codes, "exp_avg_codes"),
    ("gefen_codebook", "gefen", _bad_codebook, "codebook"),
    ("adamw_shape", "adamw", _bad_exp_avg, "exp_avg"),
    ("adamw_groups", "adamw", _adamw_group_count, "AdamW half"),
    ("adamw_lr", "adamw", _adamw_bad_lr, "lr"),
    ("muon_with_adamw", "adamw", _bad_codes, "exp_avg_codes"),
]


@pytest.mark.parametrize(("desc", "backup", "corrupt", "match"), CASES,
                         ids=[c[0] for c in CASES])
def test_malformed_checkpoints_change_nothing(desc, backup, corrupt, match):
    model = make_model()
    opt = GefenMuonHybrid(model, lr=2e-3, backup_optimizer=backup)
    train(model, opt, 2)
    sd = _nested(opt.state_dict())
    train(model, opt, 1, start=20)  # live state now differs from the checkpoint
    before = snapshot(model, opt)
    corrupt(sd)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(sd)
    assert equal(before, snapshot(model, opt)), desc


def test_backup_only_hybrid_and_half_mismatch():
    model = nn.Sequential(nn.LayerNorm(8))
    opt = GefenMuonHybrid(model, lr=1e-3)
    assert opt.muon is None and isinstance(opt.backup, Gefen)
    sd = opt.state_dict()
    assert sd["muon"] is None
    other = GefenMuonHybrid(make_model(), lr=1e-3)
    with pytest.raises(ValueError, match="has a muon half"):
        opt.load_state_dict(other.state_dict())


def test_load_hooks_run_after_both_commits():
    model = make_model()
    opt = GefenMuonHybrid(model, lr=1e-3)
    train(model, opt, 1)
    sd = opt.state_dict()
    seen = []
    opt.muon.register_load_state_dict_post_hook(
        lambda o: seen.append(("muon", len(opt.backup.state))))
    opt.backup.register_load_state_dict_post_hook(lambda o: seen.append(("backup", 0)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.load_state_dict(sd)
    assert [s[0] for s in seen] == ["muon", "backup"]
