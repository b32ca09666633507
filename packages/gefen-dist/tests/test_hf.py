"""Gefen with the Hugging Face Trainer and the axolotl-style names (docs/algorithm.md#distributed).

Tiny Llama / Qwen3 models are built from configs (no download) with tied embeddings and trained
for a few updates on real text (the standard library's ``os.py`` bytes) on the CPU.
"""

from __future__ import annotations

import os

import pytest
import torch

from gefen_core import Gefen
from gefen_core.hybrid import GefenMuonHybrid
from gefen_dist.hf import (
    RECIPES,
    GefenMuonHybridFactory,
    create_optimizer,
    gefen_kwargs,
    gefen_optimizer_cls_and_kwargs,
    hybrid_kwargs,
    parse_optim_args,
    recipe,
)

transformers = pytest.importorskip("transformers")  # a test requirement: never skipped in CI
STEPS = 3


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=2,
                gradient_accumulation_steps=2, learning_rate=2e-3, adam_beta1=0.85,
                adam_beta2=0.97, adam_epsilon=1e-7, weight_decay=0.05, logging_steps=1,
                save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
                lr_scheduler_type="constant", seed=0, dataloader_num_workers=0)
    base.update(kw)
    return transformers.TrainingArguments(**base)


def _model(family: str):
    common = dict(vocab_size=258, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  tie_word_embeddings=True, pad_token_id=257, bos_token_id=256, eos_token_id=257)
    torch.manual_seed(0)
    if family == "qwen3":
        cfg = transformers.Qwen3Config(head_dim=8, **common)
    else:
        cfg = transformers.LlamaConfig(**common)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    return model


class _Text(torch.utils.data.Dataset):
    def __init__(self, n: int = 24, seq: int = 32) -> None:
        with open(os.__file__, "rb") as fh:
            data = torch.tensor(list(fh.read(n * seq)), dtype=torch.int64)
        self.rows = data.view(n, seq)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i].clone()}


def _train(trainer) -> list[float]:
    trainer.train()
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


def _count_steps(opt) -> dict:
    n = {"steps": 0}
    opt.register_step_post_hook(lambda *_: n.__setitem__("steps", n["steps"] + 1))
    return n


# ------------------------------------------------------------------ TrainingArguments mapping


def test_training_args_mapping(tmp_path):
    args = _args(tmp_path)
    kw = gefen_kwargs(args)
    assert kw == {"lr": 2e-3, "betas": (0.85, 0.97), "eps": 1e-7, "weight_decay": 0.05,
                  "fused": None}
    assert gefen_kwargs(args, fused=False, deterministic=True)["deterministic"] is True
    assert hybrid_kwargs(args, backup_optimizer="adamw")["backup_optimizer"] == "adamw"
    cls, kw2 = gefen_optimizer_cls_and_kwargs(args, factored_v_2d=False)
    assert cls is Gefen and kw2["factored_v_2d"] is False and kw2["lr"] == 2e-3
    opt = Gefen(_model("llama").parameters(), **kw)
    g = opt.param_groups[0]
    assert (g["lr"], g["betas"], g["eps"], g["weight_decay"]) == (2e-3, (0.85, 0.97), 1e-7, 0.05)
    with pytest.raises(TypeError, match="adam_beta1"):
        gefen_kwargs(type("A", (), {"learning_rate": 1e-3})())


# ------------------------------------------------------------------ Trainer integration


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trainer_optimizer_cls_and_kwargs_qwen3(tmp_path):
    args = _args(tmp_path)
    model = _model("qwen3")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Text(),
                                   optimizer_cls_and_kwargs=gefen_optimizer_cls_and_kwargs(args))
    opt = trainer.create_optimizer()
    assert isinstance(opt, Gefen)
    # The Trainer's decay / no-decay split reaches Gefen as two groups.
    assert sorted(g["weight_decay"] for g in opt.param_groups) == [0.0, 0.05]
    ids = [id(p) for g in opt.param_groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    steps = _count_steps(opt)
    before = model.get_input_embeddings().weight.detach().clone()
    losses = _train(trainer)
    assert steps["steps"] == STEPS  # once per accumulated update
    assert len(losses) == STEPS and losses[-1] < losses[0]
    assert not torch.equal(before, model.get_input_embeddings().weight)
    meta = opt.state_dict()["gefen_meta"]
    assert meta["global_step"] == STEPS and meta["codebook"] is not None


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["optimizers", "factory"])
def test_trainer_with_hybrid_llama(tmp_path, how):
    args = _args(tmp_path)
    model = _model("llama")
    kw = hybrid_kwargs(args, backup_optimizer="gefen", backup_lr=1e-3)
    if how == "optimizers":
        hybrid = GefenMuonHybrid(model, **kw)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=_Text(),
                                       optimizers=(hybrid, None))
    else:
        trainer = transformers.Trainer(model=model, args=args, train_dataset=_Text(),
                                       optimizer_cls_and_kwargs=(GefenMuonHybridFactory, kw))
        hybrid = trainer.create_optimizer()
        assert isinstance(hybrid, GefenMuonHybrid)
    steps = _count_steps(hybrid)
    losses = _train(trainer)
    assert trainer.optimizer.optimizer is hybrid  # wrapped once by Accelerate
    assert steps["steps"] == STEPS and losses[-1] < losses[0]
    tied = model.get_input_embeddings().weight
    muon_ids = [id(p) for g in hybrid.muon.param_groups for p in g["params"]]
    backup_ids = [id(p) for g in hybrid.backup.param_groups for p in g["params"]]
    assert backup_ids.count(id(tied)) == 1 and id(tied) not in muon_ids
    assert muon_ids and all(p.ndim == 2 for g in hybrid.muon.param_groups for p in g["params"])
    assert {g["lr"] for g in hybrid.backup.param_groups} == {1e-3}
    assert {g["lr"] for g in hybrid.muon.param_groups} == {2e-3}


def test_factory_refuses_the_old_class_protocol():
    with pytest.raises(TypeError, match="optimizers=\\(GefenMuonHybrid"):
        GefenMuonHybridFactory([{"params": []}], lr=1e-3)
    with pytest.raises(TypeError, match="needs the model"):
        GefenMuonHybridFactory()([torch.zeros(2, 2)])


# ------------------------------------------------------------------ axolotl-style factory


def test_parse_optim_args_coerces_strings():
    assert parse_optim_args("gefenx", "fused=false, deterministic=1,factored_v_2d=False") == {
        "fused": False, "deterministic": True, "factored_v_2d": False}
    assert parse_optim_args("gefenx", "gefen_deterministic=yes") == {"deterministic": True}
    got = parse_optim_args("gefenx_muon", "backup_optimizer=adamw,backup_lr=5e-4,"
                                          "ns_schedule=standard,normuon=0,sharded_mode=exact")
    assert got == {"backup_optimizer": "adamw", "backup_lr": 5e-4, "ns_schedule": "standard",
                   "normuon": False, "sharded_mode": "exact"}
    assert parse_optim_args("gefenx_muon", {"backup_lr": "1e-3"}) == {"backup_lr": 1e-3}
    assert parse_optim_args("gefenx", None) == {} == parse_optim_args("gefenx", "")


@pytest.mark.parametrize(
    ("name", "optim_args", "needle"),
    [
        ("gefenx_muon", "factored_v_2d=true", "not accepted for 'gefenx_muon'"),
        ("gefenx", "backup_lr=1e-3", "not accepted for 'gefenx'"),
        ("gefenx", "fused=maybe", "must be a boolean"),
        ("gefenx_muon", "backup_lr=fast", "must be a number"),
        ("gefenx", "fused", "expected key=value"),
        ("gefenx", "deterministic=1,gefen_deterministic=0", "twice"),
        ("adamw", None, "must be one of"),
    ],
)
def test_parse_optim_args_errors(name, optim_args, needle):
    with pytest.raises(ValueError, match=needle):
        parse_optim_args(name, optim_args)


def test_factory_gefenx(tmp_path):
    model = _model("llama")
    opt = create_optimizer("gefenx", model, _args(tmp_path),
                           "fused=false,deterministic=true,factored_v_2d=false")
    assert type(opt) is Gefen
    (g,) = opt.param_groups
    assert (g["lr"], g["betas"], g["weight_decay"]) == (2e-3, (0.85, 0.97), 0.05)
    assert g["fused"] is False and g["factored_v_2d"] is False
    assert opt.state_dict()["gefen_meta"]["deterministic"] is True  # optimizer-level flag
    # Named parameters: the checkpoint carries real names, the tied tensor once.
    assert len(g["params"]) == len(list(model.parameters()))
    assert "model.embed_tokens.weight" in g["param_names"]


def test_factory_gefenx_muon_defaults_and_overrides(tmp_path):
    args = _args(tmp_path)
    opt = create_optimizer("gefenx_muon", _model("llama"), args)
    assert isinstance(opt, GefenMuonHybrid) and isinstance(opt.backup, Gefen)
    # The low-memory recipe: Gefen backup at half the learning rate (docs/algorithm.md#distributed).
    assert {g["lr"] for g in opt.backup.param_groups} == {0.5 * 2e-3}
    assert {g["lr"] for g in opt.muon.param_groups} == {2e-3}
    assert all(g["force_1d_period_one"] for g in opt.backup.param_groups)
    opt2 = create_optimizer("gefenx_muon", _model("llama"), args,
                            "backup_optimizer=adamw,normuon=false")
    assert isinstance(opt2.backup, torch.optim.AdamW)
    assert {g["lr"] for g in opt2.backup.param_groups} == {2e-3}
    assert {g["betas"] for g in opt2.backup.param_groups} == {(0.85, 0.97)}
    opt3 = create_optimizer("gefenx_muon", _model("llama"), args, {"backup_lr": "3e-4"})
    assert {g["lr"] for g in opt3.backup.param_groups} == {3e-4}


def test_recipes_resolve():
    assert set(RECIPES) == {"gefen_sft", "muon_balanced_sft", "muon_quality_pretraining",
                            "muon_lowest_memory"}
    kind, kw = recipe("gefen_sft", 1e-3, weight_decay=0.06)
    assert kind == "gefen" and kw["lr"] == pytest.approx(6e-4)
    assert kw["weight_decay"] == pytest.approx(0.1)
    kind, kw = recipe("muon_lowest_memory", 1e-3)
    assert kind == "gefen_muon_hybrid"
    assert kw == {"lr": 1e-3, "weight_decay": 0.0, "backup_lr": 5e-4, "backup_optimizer": "gefen",
                  "backup_1d_period_one": True, "ns_schedule": "tuned3", "normuon": True}
    for name in RECIPES:
        kind, kw = recipe(name, 1e-3)
        if kind == "gefen_muon_hybrid":
            GefenMuonHybrid(_model("llama"), **kw)  # every recipe is a valid constructor call
        else:
            Gefen(_model("llama").parameters(), **kw)
    with pytest.raises(ValueError, match="unknown recipe"):
        recipe("fast", 1e-3)
