"""Megatron-Core integration on the CPU: import, configuration errors, and the torch optimizers
the three recipes of docs/algorithm.md#distributed build. Megatron's forward and its optimizer
wrappers need CUDA: the wrapped GPT training is ``benchmarks/megatron_gpt_smoke.py`` of this
package (H200) and the ``gpu`` test below."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gefen_core import Gefen
from gefen_core.muon import GefenMuon
from gefen_dist.megatron import (
    MEGATRON_BACKUP_SUBSTRINGS,
    RECIPES,
    MegatronConfigError,
    build_gefen_optimizers,
    check_megatron_config,
    get_gefen_megatron_optimizer,
)

optimizer_mod = pytest.importorskip("megatron.core.optimizer")  # a test requirement
OptimizerConfig = optimizer_mod.OptimizerConfig


def _config(**kw):
    base = dict(lr=1e-3, min_lr=1e-4, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95,
                adam_eps=1e-8, clip_grad=1.0)
    base.update(kw)
    return OptimizerConfig(**base)


class MegatronLikeGPT(nn.Module):
    """Parameter names and kinds of a Megatron GPTModel (embedding, layers, untied output)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Module()
        self.embedding.word_embeddings = nn.Module()
        self.embedding.word_embeddings.weight = nn.Parameter(torch.randn(64, 16))
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList()
        for _ in range(2):
            layer = nn.Module()
            layer.self_attention = nn.Module()
            layer.self_attention.linear_qkv = nn.Linear(16, 48)
            layer.self_attention.linear_proj = nn.Linear(16, 16)
            layer.mlp = nn.Module()
            layer.mlp.linear_fc1 = nn.Linear(16, 64)
            layer.mlp.linear_fc2 = nn.Linear(64, 16)
            layer.input_layernorm = nn.LayerNorm(16)
            self.decoder.layers.append(layer)
        self.decoder.final_layernorm = nn.LayerNorm(16)
        self.output_layer = nn.Linear(16, 64, bias=False)


def test_import_and_recipes():
    assert RECIPES == ("gefen", "muon_adamw", "muon_gefen")
    assert "output_layer" in MEGATRON_BACKUP_SUBSTRINGS and "embed" in MEGATRON_BACKUP_SUBSTRINGS


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        (dict(fp16=True), "fp16=True is not supported"),
        (dict(use_distributed_optimizer=True), "use_distributed_optimizer=True"),
        (dict(optimizer_cpu_offload=True), "optimizer_cpu_offload=True"),
        (dict(use_precision_aware_optimizer=True), "use_precision_aware_optimizer=True"),
    ],
)
def test_unsupported_config_is_refused(kw, needle):
    cfg = _config()
    for key, value in kw.items():  # set after construction: some combinations fail __post_init__
        setattr(cfg, key, value)
    with pytest.raises(MegatronConfigError, match=needle):
        check_megatron_config(cfg)
    with pytest.raises(MegatronConfigError, match=needle):
        build_gefen_optimizers(cfg, MegatronLikeGPT())


def test_config_errors():
    with pytest.raises(TypeError, match="OptimizerConfig"):
        check_megatron_config({"lr": 1e-3})
    with pytest.raises(MegatronConfigError, match="recipe must be one of"):
        check_megatron_config(_config(), "muon")
    # Muon on a tensor-parallel shard would orthogonalise a piece of the matrix.
    with pytest.raises(MegatronConfigError, match="tensor_model_parallel_size=1"):
        check_megatron_config(_config(), "muon_gefen", tensor_model_parallel_size=2)
    check_megatron_config(_config(), "gefen", tensor_model_parallel_size=2)
    cfg = _config()
    cfg.fp16, cfg.use_distributed_optimizer = True, True
    msg = str(pytest.raises(MegatronConfigError, check_megatron_config, cfg).value)
    assert "fp16" in msg and "use_distributed_optimizer" in msg  # all problems at once
    with pytest.raises(TypeError, match="model_chunks"):
        build_gefen_optimizers(_config(), [])
    frozen = nn.Linear(4, 4).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_gefen_optimizers(_config(), [frozen])
    with pytest.raises(ValueError, match="no hidden 2-D matrix"):
        build_gefen_optimizers(_config(), [nn.LayerNorm(8)], "muon_adamw")


def test_plain_recipe_groups():
    model = MegatronLikeGPT()
    (opt,) = build_gefen_optimizers(_config(), [model], gefen_kwargs={"deterministic": True})
    assert type(opt) is Gefen
    decay, no_decay = opt.param_groups
    # Megatron's rule: biases and 1-D norm weights get no decay; the scheduler keys are set.
    assert all(p.ndim == 2 for p in decay["params"])
    assert all(p.ndim == 1 for p in no_decay["params"])
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert (decay["wd_mult"], no_decay["wd_mult"]) == (1.0, 0.0)
    assert decay["max_lr"] == 1e-3 and decay["min_lr"] == 1e-4 and decay["default_config"]
    assert decay["betas"] == (0.9, 0.95) and decay["eps"] == 1e-8
    assert "output_layer.weight" in decay["param_names"]
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


@pytest.mark.parametrize("recipe", ["muon_adamw", "muon_gefen"])
def test_muon_recipes_route_and_scale(recipe):
    model = MegatronLikeGPT()
    muon, backup = build_gefen_optimizers(_config(), [model], recipe)
    assert type(muon) is GefenMuon
    assert isinstance(backup, torch.optim.AdamW if recipe == "muon_adamw" else Gefen)
    muon_names = [n for g in muon.param_groups for n in g["param_names"]]
    assert sorted(muon_names) == sorted(
        f"decoder.layers.{i}.{m}.weight" for i in range(2)
        for m in ("self_attention.linear_qkv", "self_attention.linear_proj",
                  "mlp.linear_fc1", "mlp.linear_fc2"))
    backup_ids = {id(p) for g in backup.param_groups for p in g["params"]}
    assert id(model.output_layer.weight) in backup_ids
    assert id(model.embedding.word_embeddings.weight) in backup_ids
    assert len(backup_ids) + len(muon_names) == len(list(model.parameters()))
    blr = 1e-3 if recipe == "muon_adamw" else 5e-4
    for g in backup.param_groups:
        assert g["lr"] == blr and g["max_lr"] == blr
        assert g["min_lr"] == pytest.approx(1e-4 * blr / 1e-3)
        assert not g["default_config"]
    # A Megatron scheduler step keeps the backup/Muon lr ratio (per-group max_lr/min_lr).
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    class Both:
        param_groups = muon.param_groups + backup.param_groups

    sched = OptimizerParamScheduler(Both(), init_lr=0.0, max_lr=1e-3, min_lr=1e-4,
                                    lr_warmup_steps=2, lr_decay_steps=10,
                                    lr_decay_style="cosine", start_wd=0.1, end_wd=0.1,
                                    wd_incr_steps=10, wd_incr_style="constant")
    sched.step(5)
    mlr = muon.param_groups[0]["lr"]
    assert backup.param_groups[0]["lr"] == pytest.approx(mlr * blr / 1e-3, rel=1e-6)
    assert [g["weight_decay"] for g in backup.param_groups] == [0.1, 0.0]
    # One step on the CPU: the Muon half only ever sees whole 2-D matrices.
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    muon.step()
    backup.step()


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES)
def test_wrapped_optimizer_steps_on_cuda(recipe, tmp_path):
    import torch.distributed as dist
    from megatron.core import parallel_state

    # Megatron's grad-norm reduction needs a process group, even with one rank.
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        parallel_state.initialize_model_parallel(1, 1)
        model = MegatronLikeGPT().cuda()
        opt = get_gefen_megatron_optimizer(_config(), [model], recipe)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        before = [p.detach().clone() for p in model.parameters()]
        ok, grad_norm, _ = opt.step()
        assert ok and grad_norm > 0
        assert all(not torch.equal(a, b)
                   for a, b in zip(before, model.parameters(), strict=True))
        sd = opt.state_dict()
        opt.load_state_dict(sd)  # the legacy torch checkpoint format round-trips
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
