"""DeepSpeed ZeRO 0-3 with plain Gefen as the client optimizer (docs/algorithm.md#distributed).

The config checks run without DeepSpeed. The training tests run DeepSpeed on its CPU
accelerator with 2 gloo ranks: stages 0-3, CPU ``offload_optimizer`` at stages 2/3 and
``offload_param`` at stage 3, and a ``save_checkpoint``/``load_checkpoint`` round trip. The first
``deepspeed.initialize`` JIT-builds a small extension with ninja (~70 s); it is cached in
``$TORCH_EXTENSIONS_DIR`` (default: ``<venv>/torch_extensions``, which a reused nox environment
keeps).
"""

from __future__ import annotations

import copy
import os
import sys
import tempfile

import pytest
import torch
from _dist_models import batches, lm_loss, make_model

from gefen_core import Gefen
from gefen_core.hybrid import GefenMuonHybrid
from gefen_core.muon import GefenMuon
from gefen_dist.capabilities import UnsupportedCombinationError
from gefen_dist.deepspeed import (
    DeepSpeedConfigError,
    initialize,
    validate_deepspeed_config,
    zero_config_keys,
)
from gefen_dist.testing import run_distributed

EXT_DIR = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(sys.prefix, "torch_extensions")
MODEL_KW = dict(dim=32, layers=1, heads=2, seq=16, extra_rows=3)
STEPS, SPLIT, BATCH = 4, 2, 4


def _zero(stage: int, *, off_opt: bool = False, off_param: bool = False,
          bf16: bool = False) -> dict:
    zero: dict = {"stage": stage}
    if off_opt:
        zero["offload_optimizer"] = {"device": "cpu"}
    if off_param:
        zero["offload_param"] = {"device": "cpu"}
    cfg = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
    cfg.update(zero_config_keys(offload=off_opt or off_param))
    return cfg


# ----------------------------------------------------------------- config checks (no engine)


def test_required_keys():
    assert zero_config_keys() == {"zero_allow_untested_optimizer": True}
    assert zero_config_keys(offload=True) == {
        "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False}


@pytest.mark.parametrize(
    ("cfg", "needle"),
    [
        ({"zero_optimization": {"stage": 2}}, '"zero_allow_untested_optimizer": true'),
        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
          "zero_allow_untested_optimizer": True}, '"zero_force_ds_cpu_optimizer": false'),
        ({"zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}, "remove the 'optimizer'"),
        ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}},
          "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False},
         "offload_param needs stage 3"),
        ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}},
          "zero_allow_untested_optimizer": True}, "NVMe offload is not supported"),
        ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}},
          "zero_force_ds_cpu_optimizer": False}, "offload_optimizer needs stage >= 1"),
        ({"zero_optimization": {"stage": 2, "elastic_checkpoint": True},
          "zero_allow_untested_optimizer": True}, "elastic_checkpoint must be false"),
        ({"zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": False},
         '"zero_allow_untested_optimizer" must be true'),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
          "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": True},
         '"zero_force_ds_cpu_optimizer" must be false'),
    ],
)
def test_config_errors_name_key_and_fix(cfg, needle):
    before = copy.deepcopy(cfg)
    with pytest.raises(DeepSpeedConfigError) as info:
        validate_deepspeed_config(cfg)
    assert needle in str(info.value)
    assert cfg == before  # the user's dict is never modified


@pytest.mark.parametrize("stage", [4, -1, "2", True, 1.0])
def test_bad_stage(stage):
    with pytest.raises(DeepSpeedConfigError, match="zero_optimization.stage must be an int"):
        validate_deepspeed_config({"zero_optimization": {"stage": stage}})


def test_every_problem_reported_at_once():
    cfg = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
           "optimizer": {"type": "Adam"}}
    msg = str(pytest.raises(DeepSpeedConfigError, validate_deepspeed_config, cfg).value)
    for needle in ("'optimizer'", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer"):
        assert needle in msg


def test_fix_adds_missing_keys_only(tmp_path):
    cfg = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                 "offload_param": {"device": "cpu"}}}
    fixed = validate_deepspeed_config(cfg, fix=True)
    assert fixed["zero_allow_untested_optimizer"] is True
    assert fixed["zero_force_ds_cpu_optimizer"] is False
    assert "zero_allow_untested_optimizer" not in cfg
    # A path to a JSON file is accepted as DeepSpeed accepts it.
    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": true}')
    assert validate_deepspeed_config(path)["zero_optimization"]["stage"] == 1
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(DeepSpeedConfigError, match="cannot read DeepSpeed JSON"):
        validate_deepspeed_config(bad)


def _muon_family():
    model = make_model(**MODEL_KW)
    hybrid = GefenMuonHybrid(model, lr=1e-3)
    muon = GefenMuon([p for p in model.parameters() if p.ndim == 2], lr=1e-3)
    return model, [hybrid, muon]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_muon_family_refused_under_zero(stage):
    model, optimizers = _muon_family()
    for opt in optimizers:
        with pytest.raises(UnsupportedCombinationError) as info:
            validate_deepspeed_config(_zero(stage), opt)
        msg = str(info.value)
        assert type(opt).__name__ in msg
        assert "gefen_core.Gefen as the ZeRO client optimizer" in msg
        assert "FSDP2" in msg
        # initialize() refuses before DeepSpeed touches the model.
        with pytest.raises(UnsupportedCombinationError):
            initialize(model=model, optimizer=opt, config=_zero(stage))


def test_muon_family_refused_with_mixed_precision_stage0():
    # DeepSpeed's bf16/fp16 wrappers flatten the parameters into fp32 masters even at stage 0.
    _, optimizers = _muon_family()
    cfg = {"zero_optimization": {"stage": 0}, "bf16": {"enabled": True}}
    for opt in optimizers:
        with pytest.raises(UnsupportedCombinationError, match="zero_flat"):
            validate_deepspeed_config(cfg, opt)
    # fp32 stage 0 keeps the module's own tensors: nothing to refuse.
    validate_deepspeed_config({"zero_optimization": {"stage": 0}}, optimizers[0])


def test_plain_gefen_accepted_at_every_stage():
    opt = Gefen(make_model(**MODEL_KW).parameters())
    for stage in range(4):
        validate_deepspeed_config(_zero(stage), opt)
    validate_deepspeed_config(_zero(3, off_opt=True, off_param=True), opt)


def test_initialize_needs_an_instance():
    with pytest.raises(TypeError, match="instantiated torch.optim.Optimizer"):
        initialize(model=make_model(**MODEL_KW), optimizer=Gefen, config=_zero(1))


# ----------------------------------------------------------------- ZeRO training on 2 ranks

CASES = {
    "stage0": dict(stage=0),
    "stage1": dict(stage=1),
    "stage2": dict(stage=2),
    "stage3": dict(stage=3),
    "stage2+offload_optimizer": dict(stage=2, off_opt=True),
    "stage3+offload_optimizer+offload_param": dict(stage=3, off_opt=True, off_param=True),
}
RESUME = ("stage1", "stage2+offload_optimizer", "stage3+offload_optimizer+offload_param")


def _engine(case: str, bf16: bool = False):
    import deepspeed  # noqa: F401 - imported here so the config tests never need it

    model = make_model(seed=0, **MODEL_KW)
    opt = Gefen(model.parameters(), lr=3e-3, weight_decay=0.01)
    engine, ds_opt, _, _ = initialize(model=model, optimizer=opt,
                                      config=_zero(**CASES[case], bf16=bf16))
    return engine, opt


def _full_params(engine) -> list[torch.Tensor]:
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
        # Copies on the CPU: ranks return these to the parent, which compares ranks with each
        # other (and a CPU fp32 parameter must not be aliased by a no-op .cpu()).
        return [p.detach().to("cpu", torch.float32, copy=True) for p in params]


def _train(engine, data) -> list[float]:
    losses = []
    for x, y in data:
        loss = lm_loss(engine, x.to(engine.device), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _eval(engine, batch) -> float:
    # Collective under ZeRO-3 (parameters are gathered): every rank calls it.
    with torch.no_grad():
        return lm_loss(engine, *(t.to(engine.device) for t in batch)).item()


def _zero_worker(rank: int, world: int, ckpt_root: str, cases: tuple[str, ...] = tuple(CASES),
                 bf16: bool = False) -> dict:
    torch.manual_seed(0)
    data = batches(STEPS, batch=BATCH, seq=MODEL_KW["seq"], seed=100 + rank)
    held_out = batches(1, batch=16, seq=MODEL_KW["seq"], seed=7)[0]  # same on every rank
    out: dict = {}
    for case in cases:
        engine, opt = _engine(case, bf16)
        assert engine.basic_optimizer is opt, "DeepSpeed did not use the Gefen instance"
        before = _eval(engine, held_out)
        first_grads: list[torch.Tensor] = []
        handle = opt.register_step_pre_hook(lambda o, a, k, sink=first_grads: sink.extend(
            p.grad.detach().clone().reshape(-1) for g in o.param_groups for p in g["params"]))
        losses = _train(engine, data[:1])
        handle.remove()
        losses += _train(engine, data[1:])
        after = _eval(engine, held_out)
        state = [s for s in opt.state.values() if "exp_avg_codes" in s]
        shapes = [tuple(p.shape) for g in opt.param_groups for p in g["params"]]
        dev = {str(p.device) for g in opt.param_groups for p in g["params"]}
        out[case] = {
            "losses": losses,
            "eval": (before, after),
            "first_grad": torch.cat(first_grads),
            "params": _full_params(engine),
            "state_entries": len(state),
            "global_step": opt.state_dict()["gefen_meta"]["global_step"],
            "flat": all(len(s) == 1 for s in shapes),
            "devices": sorted(dev),
        }
        if case in RESUME:
            path = os.path.join(ckpt_root, case)
            engine2, _ = _engine(case, bf16)
            _train(engine2, data[:SPLIT])
            engine2.save_checkpoint(path, tag="split")
            del engine2
            engine3, opt3 = _engine(case, bf16)
            engine3.load_checkpoint(path, tag="split")
            resumed = _train(engine3, data[SPLIT:])
            out[case]["resumed_losses"] = resumed
            out[case]["resumed_params"] = _full_params(engine3)
            out[case]["resumed_step"] = opt3.state_dict()["gefen_meta"]["global_step"]
    return out


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_zero_stages_two_ranks():
    os.makedirs(EXT_DIR, exist_ok=True)
    env = {"TORCH_EXTENSIONS_DIR": EXT_DIR, "DS_ACCELERATOR": "cpu",
           "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533"}
    with tempfile.TemporaryDirectory() as tmp:
        # Generous: a cold cache JIT-builds DeepSpeed's extension (~70 s) in each rank.
        res = run_distributed(_zero_worker, 2, tmp, timeout=400, collective_timeout=240,
                              env=env)
    lines = ["case                                     rank  losses (per update, this rank's data)"]
    for case in CASES:
        for rank, r in enumerate(res):
            curve = " ".join(f"{v:.6f}" for v in r[case]["losses"])
            lines.append(f"{case:40s} {rank:4d}  {curve}")
    print("\n".join(lines))
    for r in res:
        for case, c in r.items():
            assert c["global_step"] == STEPS, case
            assert c["state_entries"] > 0, f"{case}: Gefen holds no momentum codes"
            # Held-out loss, same batch on both ranks (per-rank training losses are noisy).
            assert c["eval"][1] < c["eval"][0], f"{case}: held-out loss did not decrease"
            # Stages 1-3 hand Gefen ZeRO's flat 1-D partitions (the layout of
            # docs/algorithm.md#distributed).
            assert c["flat"] == (case != "stage0"), case
        # ZeRO-1 and ZeRO-2 partition the same flat buffer: equal to the bit.
        assert r["stage1"]["losses"] == r["stage2"]["losses"]
        # Offload: DeepSpeed reduces and averages the gradients on another path (measured: the
        # flat gradient reaching Gefen differs by a few fp32 ulps at step 1), so the curves
        # agree to fp32 rounding, not bitwise. First show the inputs differ only by rounding,
        # then that the run with offload follows the run without it.
        for base, off in (("stage2", "stage2+offload_optimizer"),
                          ("stage3", "stage3+offload_optimizer+offload_param")):
            g0, g1 = r[base]["first_grad"], r[off]["first_grad"]
            assert g0.shape == g1.shape
            assert float((g0 - g1).abs().max()) <= 8 * torch.finfo(torch.float32).eps * float(
                g0.abs().max()), f"{off}: gradients reaching Gefen differ beyond rounding"
            torch.testing.assert_close(r[off]["losses"], r[base]["losses"], rtol=1e-5, atol=0)
            for a, b in zip(r[off]["params"], r[base]["params"], strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        for case in RESUME:
            c = r[case]
            assert c["resumed_losses"] == c["losses"][SPLIT:], f"{case}: resume diverged"
            assert c["resumed_step"] == STEPS
            for a, b in zip(c["resumed_params"], c["params"], strict=True):
                assert torch.equal(a, b), f"{case}: resumed weights differ"
    # Replicas agree across ranks after every stage.
    for case in CASES:
        for a, b in zip(res[0][case]["params"], res[1][case]["params"], strict=True):
            assert torch.equal(a, b), f"{case}: ranks disagree"
    # Different data per rank: equal replicas are the all-reduce's doing, not an accident.
    assert res[0]["stage2"]["losses"] != res[1]["stage2"]["losses"]


GPU_CASES = ("stage2", "stage2+offload_optimizer", "stage3",
             "stage3+offload_optimizer+offload_param")


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_zero_stage2_3_on_cuda_bf16():
    """ZeRO-2/3 on one GPU (bf16, NCCL, world size 1): offload follows the run without it,
    and save/load continues bit-identically."""
    env = {"TORCH_EXTENSIONS_DIR": EXT_DIR, "LOCAL_RANK": "0"}
    with tempfile.TemporaryDirectory() as tmp:
        (r,) = run_distributed(_zero_worker, 1, tmp, GPU_CASES, True, backend="nccl",
                               timeout=560, collective_timeout=400, env=env)
    for case in GPU_CASES:
        print(f"{case:40s} " + " ".join(f"{v:.6f}" for v in r[case]["losses"]))
        c = r[case]
        assert c["global_step"] == STEPS and c["state_entries"] > 0 and c["flat"]
        assert c["eval"][1] < c["eval"][0], case
    for base, off in (("stage2", "stage2+offload_optimizer"),
                      ("stage3", "stage3+offload_optimizer+offload_param")):
        # bf16 activations: the offloaded run follows within bf16 forward rounding.
        torch.testing.assert_close(r[off]["losses"], r[base]["losses"], rtol=2e-3, atol=0)
    for case in set(RESUME) & set(GPU_CASES):
        c = r[case]
        assert c["resumed_losses"] == c["losses"][SPLIT:], f"{case}: resume diverged"
        for a, b in zip(c["resumed_params"], c["params"], strict=True):
            assert torch.equal(a, b), f"{case}: resumed weights differ"
