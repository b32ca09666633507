"""Native checkpoints (docs/algorithm.md#checkpoint-format, contracts.md): bit-exact resume,
weights_only and map_location loads, every malformed case of docs/algorithm.md#checkpoint-format
with zero mutation, migrations, copies."""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from gefen_core import Gefen
from gefen_core.checkpoint import CheckpointError


class Net(nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.w1 = nn.Parameter(torch.randn(24, 16, generator=gen).to(dtype))
        self.b1 = nn.Parameter(torch.randn(24, generator=gen).to(dtype))
        self.w2 = nn.Parameter(torch.randn(4, 3, 2, 2, generator=gen).to(dtype))
        self.s = nn.Parameter(torch.randn((), generator=gen).to(dtype))


def _feed(model: nn.Module, step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


def _train(model: nn.Module, opt: Gefen, steps: range) -> None:
    for step in steps:
        _feed(model, step)
        opt.step()


def _roundtrip(sd: dict, **load_kwargs: Any) -> dict:
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, **load_kwargs)


def _same_tree(a: Any, b: Any, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device, path
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (path, a.keys(), b.keys())
        for k in a:
            _same_tree(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same_tree(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


def _deep_snapshot(model: nn.Module, opt: Gefen) -> dict:
    return copy.deepcopy({
        "params": [p.detach() for p in model.parameters()],
        "state": {i: dict(opt.state[p]) for i, p in enumerate(model.parameters())
                  if p in opt.state},
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        "group_param_ids": [[id(p) for p in g["params"]] for g in opt.param_groups],
        "T": opt._global_step,
        "codebook": opt._codebook,
        "det": opt._deterministic,
    })


def _states_equal(o1: Gefen, m1: nn.Module, o2: Gefen, m2: nn.Module) -> None:
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p1, p2)
        assert o1.state[p1].keys() == o2.state[p2].keys()
        for k, v in o1.state[p1].items():
            _same_tree(v, o2.state[p2][k], k)
    assert o1._global_step == o2._global_step
    assert torch.equal(o1._codebook, o2._codebook)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("options", [{}, {"factored_v_2d": False, "stochastic_round": True},
                                     {"lr": torch.tensor(3e-3)}],
                         ids=["factored", "block_sr", "tensor_lr"])
def test_resume_is_bit_identical(dtype: torch.dtype, options: dict) -> None:
    model = Net(dtype)
    opt = Gefen(model.named_parameters(), **{"lr": 1e-2, "weight_decay": 0.1,
                                             **copy.deepcopy(options)})
    _train(model, opt, range(3))
    saved_model = copy.deepcopy(model.state_dict())
    sd = _roundtrip(opt.state_dict(), weights_only=True, map_location="cpu")

    _train(model, opt, range(3, 6))  # the uninterrupted run

    resumed = Net(dtype)
    resumed.load_state_dict(saved_model)
    opt2 = Gefen(resumed.named_parameters(), **{"lr": 0.5, **copy.deepcopy(options)})
    opt2.load_state_dict(sd)
    for p in resumed.parameters():  # saved dtypes survive: never cast to the param dtype
        st = opt2.state[p]
        assert st["exp_avg_codes"].dtype == torch.uint8
        assert st["exp_avg_scale"].dtype == torch.float32
        assert st["step"].dtype == torch.float32 and st["step"].device.type == "cpu"
    assert opt2.param_groups[0]["weight_decay"] == 0.1
    _train(resumed, opt2, range(3, 6))
    _states_equal(opt, model, opt2, resumed)


def test_state_dict_layout_matches_the_contract() -> None:
    model = Net()
    # w1 ([24, 16]) is factored only with min_dim_size_to_factor = 0.
    opt = Gefen([{"params": list(model.named_parameters()), "my_extra": "kept"}], lr=1e-2,
                min_dim_size_to_factor=0)
    _train(model, opt, range(2))
    sd = opt.state_dict()
    assert set(sd) == {"state", "param_groups", "gefen_meta"}
    meta = sd["gefen_meta"]
    assert meta["format_version"] == 1 and meta["global_step"] == 2
    assert meta["deterministic"] is False and meta["codebook"].dtype == torch.float32
    group = sd["param_groups"][0]
    assert group["params"] == [0, 1, 2, 3]
    assert group["param_names"] == ["w1", "b1", "w2", "s"]
    assert group["my_extra"] == "kept" and group["betas"] == (0.9, 0.999)
    assert group["min_dim_size_to_factor"] == 0
    assert torch.equal(group["gefen_meta"]["codebook"], meta["codebook"])
    w1 = sd["state"][0]
    assert set(w1) == {"step", "period", "exp_avg_codes", "exp_avg_scale", "exp_avg_sq_row",
                       "exp_avg_sq_col", "exp_avg_sq_step"}
    assert set(sd["state"][1]) == {"step", "period", "exp_avg_codes", "exp_avg_scale",
                                   "exp_avg_sq", "exp_avg_sq_step"}
    assert isinstance(w1["period"], int) and w1["step"].shape == ()
    # Repeated loads of the same dict work and never alias it.
    opt.load_state_dict(sd)
    opt.load_state_dict(sd)
    _train(model, opt, range(2, 3))
    assert int(sd["state"][0]["step"]) == 2


def _stepped() -> tuple[nn.Module, Gefen, dict]:
    model = Net()
    named = list(model.named_parameters())
    # min_dim_size_to_factor = 0: w1 ([24, 16]) takes the factored second moment.
    opt = Gefen([{"params": named[:2]}, {"params": named[2:], "lr": 5e-3}], lr=1e-2,
                min_dim_size_to_factor=0)
    _train(model, opt, range(2))
    return model, opt, copy.deepcopy(opt.state_dict())


def _set(path: tuple, value: Any) -> Callable[[dict], None]:
    def mutate(sd: dict) -> None:
        node = sd
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return mutate


def _delete(path: tuple) -> Callable[[dict], None]:
    def mutate(sd: dict) -> None:
        node = sd
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]
    return mutate


def _all_metas(key: str, value: Any) -> Callable[[dict], None]:
    def mutate(sd: dict) -> None:
        sd["gefen_meta"][key] = value
        for g in sd["param_groups"]:
            g["gefen_meta"][key] = value
    return mutate


def _codebook(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict], None]:
    def mutate(sd: dict) -> None:
        c = fn(sd["gefen_meta"]["codebook"].clone())
        _all_metas("codebook", c)(sd)
    return mutate


def _both(*fns: Callable[[dict], None]) -> Callable[[dict], None]:
    def mutate(sd: dict) -> None:
        for fn in fns:
            fn(sd)
    return mutate


def _swap_second_moment(sd: dict) -> None:
    st = sd["state"][1]  # b1, a 1-D block-mode parameter
    st["exp_avg_sq_row"] = torch.zeros(24)
    st["exp_avg_sq_col"] = torch.zeros(1)
    del st["exp_avg_sq"]


def _replace(sd: dict, new: Any) -> None:
    sd.clear()
    sd.update(new)


MALFORMED: dict[str, tuple[Callable[[dict], None], str]] = {
    "missing_state": (_delete(("state",)), "needs 'state'"),
    "groups_not_list": (_set(("param_groups",), {"a": 1}), "list of dicts"),
    "meta_in_some_groups": (_delete(("param_groups", 0, "gefen_meta")), "some parameter groups"),
    "no_meta_anywhere": (_both(_delete(("gefen_meta",)), _delete(("param_groups", 0, "gefen_meta")),
                               _delete(("param_groups", 1, "gefen_meta"))),
                         "not a Gefen checkpoint"),
    "format_version": (_all_metas("format_version", 7), "format_version 7"),
    "global_step_negative": (_all_metas("global_step", -1), "global_step"),
    "meta_disagree_step": (_set(("param_groups", 0, "gefen_meta", "global_step"), 99),
                           "disagree"),
    "top_vs_group_codebook": (_set(("gefen_meta", "codebook"), None), "disagree"),
    "deterministic_mismatch": (_all_metas("deterministic", True), "deterministic=True"),
    "codes_without_codebook": (_all_metas("codebook", None), "no codebook"),
    "codebook_dtype": (_codebook(lambda c: c.double()), "fp32 \\[256\\]"),
    "codebook_length": (_codebook(lambda c: c[:128]), "fp32 \\[256\\]"),
    "codebook_unsorted": (_codebook(lambda c: c.flip(0)), "(sorted|start at -1)"),
    "codebook_nan": (_codebook(lambda c: c.index_fill(0, torch.tensor([5]), float("nan"))),
                     "non-finite"),
    "codebook_endpoint": (_codebook(lambda c: c.index_fill(0, torch.tensor([255]), 0.999)),
                          "end at \\+1"),
    "group_count": (lambda sd: sd["param_groups"].append(copy.deepcopy(sd["param_groups"][0])),
                    "parameter groups"),
    "group_size": (lambda sd: sd["param_groups"][0]["params"].pop(), "parameters"),
    "unknown_state_id": (_set(("state", 17), {"period": 1}), "parameter id 17"),
    "unknown_state_key": (_set(("state", 0, "exp_avg"), torch.zeros(3)), "unknown keys"),
    "period_not_divisor": (_set(("state", 0, "period"), 7), "dividing"),
    "period_zero": (_set(("state", 0, "period"), 0), "period"),
    "period_bool": (_set(("state", 0, "period"), True), "period"),
    "codes_without_period": (_delete(("state", 0, "period")), "no period"),
    "sq_without_codes": (_both(_delete(("state", 1, "exp_avg_codes"))), "without both"),
    "scale_without_codes": (_delete(("state", 1, "exp_avg_scale")), "without both"),
    "missing_step": (_delete(("state", 1, "step")), "no step"),
    "step_zero": (_set(("state", 1, "step"), torch.tensor(0.0)), "integer >= 1"),
    "step_fraction": (_set(("state", 1, "step"), 1.5), "integer >= 1"),
    "step_nan": (_set(("state", 1, "step"), torch.tensor(float("nan"))), "integer >= 1"),
    "step_string": (_set(("state", 1, "step"), "2"), "number"),
    "codes_dtype": (lambda sd: sd["state"][1].update(
        exp_avg_codes=sd["state"][1]["exp_avg_codes"].float()), "uint8"),
    "codes_shape": (lambda sd: sd["state"][1].update(
        exp_avg_codes=sd["state"][1]["exp_avg_codes"].reshape(-1)), "uint8"),
    "scale_dtype": (lambda sd: sd["state"][1].update(
        exp_avg_scale=sd["state"][1]["exp_avg_scale"].bfloat16()), "fp32"),
    "scale_negative": (lambda sd: sd["state"][1].update(
        exp_avg_scale=-sd["state"][1]["exp_avg_scale"] - 1), ">= 0"),
    "scale_nan": (lambda sd: sd["state"][1]["exp_avg_scale"].fill_(float("nan")), "finite"),
    "sq_negative": (lambda sd: sd["state"][1]["exp_avg_sq"].fill_(-1.0), ">= 0"),
    "sq_shape": (lambda sd: sd["state"][1].update(exp_avg_sq=torch.zeros(3, 1)), "fp32"),
    "both_second_moments": (_set(("state", 0, "exp_avg_sq"), torch.zeros(1, 1)), "both"),
    "no_second_moment": (_both(_delete(("state", 1, "exp_avg_sq"))), "no second moment"),
    "factored_on_1d": (_swap_second_moment, "factored but the parameter is 1-D"),
    "row_without_col": (_delete(("state", 0, "exp_avg_sq_col")), "both exp_avg_sq_row"),
    "row_shape": (_set(("state", 0, "exp_avg_sq_row"), torch.zeros(16)), "fp32 \\[24\\]"),
    "factored_without_age": (_delete(("state", 0, "exp_avg_sq_step")), "exp_avg_sq_step"),
    "sq_step_zero": (_set(("state", 0, "exp_avg_sq_step"), torch.tensor(0.0)), "integer >= 1"),
    "bad_lr": (_set(("param_groups", 0, "lr"), -1.0), "learning rate"),
    "bad_betas": (_set(("param_groups", 0, "betas"), (0.9, 1.5)), "beta"),
    "bad_period_search": (_set(("param_groups", 0, "period_search"), "x"), "period_search"),
    "param_names_length": (_set(("param_groups", 0, "param_names"), ["a"]), "param_names"),
    "param_names_duplicate": (_set(("param_groups", 0, "param_names"), ["a", "a"]),
                              "not unique"),
    "torch_adamw_dict": (lambda sd: _replace(sd, {"state": {}, "param_groups": [
        {"params": [0, 1], "lr": 1e-3}, {"params": [2, 3], "lr": 1e-3}]}),
                         "not a Gefen checkpoint"),
    "not_a_dict": (None, "expected a dict"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_checkpoint_is_rejected_with_zero_mutation(case: str) -> None:
    model, opt, good = _stepped()
    mutate, match = MALFORMED[case]
    bad: Any = copy.deepcopy(good)
    if mutate is None:
        bad = ["state", "param_groups"]
    else:
        mutate(bad)
    before = _deep_snapshot(model, opt)
    with pytest.raises(CheckpointError, match=match):
        opt.load_state_dict(bad)
    _same_tree(before, _deep_snapshot(model, opt))
    # The rejected optimizer still loads the good checkpoint and steps.
    opt.load_state_dict(good)
    _train(model, opt, range(2, 3))


def test_hooks_run_around_a_successful_load_only() -> None:
    model, opt, good = _stepped()
    calls: list[str] = []
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append("pre"))
    opt.register_load_state_dict_post_hook(lambda o: calls.append("post"))
    bad = copy.deepcopy(good)
    bad["state"][0]["period"] = 5
    with pytest.raises(CheckpointError):
        opt.load_state_dict(bad)
    assert calls == ["pre"]
    opt.load_state_dict(good)
    assert calls == ["pre", "pre", "post"]


def test_capturable_and_eager_checkpoints_are_interchangeable() -> None:
    model = Net()
    opt = Gefen(model.named_parameters(), lr=1e-2)
    _train(model, opt, range(2))
    saved_model = copy.deepcopy(model.state_dict())
    sd = copy.deepcopy(opt.state_dict())
    _train(model, opt, range(2, 4))

    for live_capturable, saved_from in ((True, sd), (False, None)):
        resumed = Net()
        resumed.load_state_dict(saved_model)
        opt2 = Gefen(resumed.named_parameters(), lr=1e-2, capturable=live_capturable)
        if saved_from is None:
            # capturable -> eager: save from a capturable optimizer, load into an eager one.
            cap_model = Net()
            cap_model.load_state_dict(saved_model)
            cap = Gefen(cap_model.named_parameters(), lr=1e-2, capturable=True)
            cap.load_state_dict(sd)
            saved_from = copy.deepcopy(cap.state_dict())
            assert saved_from["param_groups"][0]["capturable"] is True
        opt2.load_state_dict(saved_from)
        assert opt2.param_groups[0]["capturable"] is live_capturable  # live flag kept
        _train(resumed, opt2, range(2, 4))
        _states_equal(opt, model, opt2, resumed)


def test_factored_and_block_migrations() -> None:
    model = Net()
    opt = Gefen(model.named_parameters(), lr=1e-2, factored_v_2d=True, min_dim_size_to_factor=0)
    _train(model, opt, range(3))
    sd = copy.deepcopy(opt.state_dict())
    block = Gefen(model.named_parameters(), lr=1e-2, factored_v_2d=False)
    block.load_state_dict(sd)
    _train(model, block, range(3, 5))
    st = block.state[model.w1]
    # O8: the stale factored statistics are dropped; the momentum and its age carry over.
    assert "exp_avg_sq_row" not in st and "exp_avg_sq" in st
    assert int(st["step"]) == 5 and int(st["exp_avg_sq_step"]) == 2
    back = Gefen(model.named_parameters(), lr=1e-2, factored_v_2d=True, min_dim_size_to_factor=0)
    back.load_state_dict(copy.deepcopy(block.state_dict()))
    _train(model, back, range(5, 6))
    st = back.state[model.w1]
    assert "exp_avg_sq" not in st and "exp_avg_sq_row" in st and int(st["step"]) == 6
    assert int(st["exp_avg_sq_step"]) == 1


def test_one_group_per_parameter_layout_is_packed() -> None:
    model = Net()
    per_param = Gefen([{"params": [(n, p)]} for n, p in model.named_parameters()], lr=1e-2)
    _train(model, per_param, range(2))
    sd = copy.deepcopy(per_param.state_dict())
    for g in sd["param_groups"]:
        g["name"] = g.pop("param_names")[0]
        del g["param_names_synthesized"]
    packed = Gefen(model.named_parameters(), lr=1e-2)
    packed.load_state_dict(sd)
    assert packed.param_groups[0]["param_names"] == ["w1", "b1", "w2", "s"]
    assert int(packed.state[model.w2]["step"]) == 2
    sd["param_groups"][1]["lr"] = 0.5
    with pytest.raises(CheckpointError, match="identical hyperparameters"):
        Gefen(model.named_parameters(), lr=1e-2).load_state_dict(sd)


def test_deepcopy_and_pickle_give_working_independent_copies() -> None:
    model, opt, _ = _stepped()
    for clone in (lambda x: copy.deepcopy(x), lambda x: pickle.loads(pickle.dumps(x))):
        m2, o2 = clone((model, opt))
        assert o2.param_groups[0]["params"][0] is m2.w1
        ref = copy.deepcopy((model, opt))
        _train(m2, o2, range(2, 4))
        _train(ref[0], ref[1], range(2, 4))
        _states_equal(ref[1], ref[0], o2, m2)
        assert opt._global_step == 2 and int(opt.state[model.w1]["step"]) == 2
