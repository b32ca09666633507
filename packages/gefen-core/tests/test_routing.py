"""Muon/backup routing (docs/algorithm.md#hybrid)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gefen_core.routing import (
    DEFAULT_BACKUP_SUBSTRINGS,
    describe_split,
    split_params_for_muon,
    validate_split,
)


class MyEmbedding(nn.Embedding):
    """A subclass: still an embedding table."""


class ManyRanks(nn.Module):
    """Parameters of every rank 0..5, a zero-size matrix, a frozen layer, and a head tied to
    an embedding that is registered *after* the head, so the tied tensor's first (and only)
    name is the head's, which no name rule would catch."""

    def __init__(self) -> None:
        super().__init__()
        self.out_proj = nn.Linear(16, 50, bias=False)  # tied below; named first
        self.tok = nn.Embedding(50, 16)
        self.out_proj.weight = self.tok.weight
        self.bag = nn.EmbeddingBag(10, 16)
        self.sub = MyEmbedding(7, 16)
        self.mlp = nn.Linear(16, 32)  # weight -> muon, bias (1-D) -> backup
        self.norm = nn.LayerNorm(32)
        self.gain = nn.Parameter(torch.ones(()))  # 0-D
        self.conv1 = nn.Conv1d(4, 8, 3)  # 3-D kernel
        self.conv2 = nn.Conv2d(4, 8, 3)  # 4-D kernel
        self.conv3 = nn.Conv3d(2, 4, 3)  # 5-D kernel
        self.empty = nn.Parameter(torch.zeros(0, 16))  # 2-D but zero-size
        self.frozen = nn.Linear(32, 32)
        self.frozen.requires_grad_(False)
        self.classifier = nn.Linear(32, 3)
        self.Score = nn.Linear(32, 1, bias=False)  # name rule is case-insensitive
        self.attn_head_proj = nn.Linear(32, 32, bias=False)  # "head" alone is not a rule


def names(items):
    return [n for n, _ in items]


def test_routing_rules_on_every_rank():
    model = ManyRanks()
    muon, backup = split_params_for_muon(model)
    assert names(muon) == ["mlp.weight", "attn_head_proj.weight"]
    assert set(names(backup)) == {
        "out_proj.weight",  # the tied head/embedding tensor, caught by identity
        "bag.weight",
        "sub.weight",
        "mlp.bias",
        "norm.weight",
        "norm.bias",
        "gain",
        "conv1.weight",
        "conv1.bias",
        "conv2.weight",
        "conv2.bias",
        "conv3.weight",
        "conv3.bias",
        "empty",
        "classifier.weight",
        "classifier.bias",
        "Score.weight",
    }
    for _, p in muon:
        assert p.ndim == 2 and p.numel() > 0


def test_every_trainable_parameter_lands_in_exactly_one_list():
    model = ManyRanks()
    muon, backup = split_params_for_muon(model)
    ids = [id(p) for _, p in muon + backup]
    assert len(ids) == len(set(ids))
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert set(ids) == trainable
    frozen = {id(p) for p in model.frozen.parameters()}
    assert not frozen & set(ids)
    validate_split(muon, backup, model)  # the library's own check agrees


def test_tied_head_under_a_non_embedding_name_goes_to_backup():
    model = ManyRanks()
    assert model.out_proj.weight is model.tok.weight
    muon, backup = split_params_for_muon(model)
    assert any(p is model.tok.weight for _, p in backup)
    assert not any(p is model.tok.weight for _, p in muon)


def test_named_iterable_routes_by_name_and_shape_only():
    w = nn.Parameter(torch.randn(8, 8))
    emb = nn.Parameter(torch.randn(8, 8))
    head = nn.Parameter(torch.randn(8, 8))
    b = nn.Parameter(torch.randn(8))
    items = [("Block.W", w), ("tok_table", emb), ("Model.LM_Head.weight", head), ("b", b)]
    muon, backup = split_params_for_muon(iter(items))
    # No module types here: "tok_table" has no backup word, so it is a Muon matrix.
    assert names(muon) == ["Block.W", "tok_table"]
    assert names(backup) == ["Model.LM_Head.weight", "b"]


def test_backup_substrings_replace_the_defaults():
    model = ManyRanks()
    muon, backup = split_params_for_muon(model, backup_substrings=("MLP",))
    assert "mlp.weight" in names(backup)
    # The defaults are replaced, so classifier/score are Muon matrices now...
    assert {"classifier.weight", "Score.weight", "attn_head_proj.weight"} <= set(names(muon))
    # ...but the structural rules (embedding identity, ndim, zero size) still hold.
    assert {"out_proj.weight", "empty", "norm.weight"} <= set(names(backup))
    muon2, _ = split_params_for_muon(
        model, backup_substrings=(*DEFAULT_BACKUP_SUBSTRINGS, "attn_head")
    )
    assert names(muon2) == ["mlp.weight"]


@pytest.mark.parametrize(
    "bad",
    [
        torch.zeros(2, 2),
        [torch.zeros(2, 2)],
        [("w",)],
        [(1, torch.zeros(2, 2))],
    ],
)
def test_bad_sources_are_type_errors(bad):
    with pytest.raises(TypeError, match=r"\(name, tensor\)|bare tensor"):
        split_params_for_muon(bad)


def test_bad_backup_substrings():
    with pytest.raises(TypeError, match="single string"):
        split_params_for_muon(ManyRanks(), backup_substrings="embed")
    with pytest.raises(TypeError, match="non-empty strings"):
        split_params_for_muon(ManyRanks(), backup_substrings=("embed", ""))


def test_validate_split_errors():
    a = nn.Parameter(torch.randn(4, 4))
    b = nn.Parameter(torch.randn(4))
    with pytest.raises(TypeError, match=r"muon\[0\]"):
        validate_split([a], [])
    with pytest.raises(TypeError, match=r"backup\[1\]"):
        validate_split([], [("b", b), ("x", 3)])
    with pytest.raises(ValueError, match="same tensor"):
        validate_split([("a", a), ("a2", a)], [])
    with pytest.raises(ValueError, match="same tensor"):
        validate_split([("a", a)], [("a_again", a)])
    with pytest.raises(ValueError, match="case-insensitive"):
        validate_split([("Layer.W", a)], [("layer.w", b)])
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    muon, backup = split_params_for_muon(model)
    with pytest.raises(ValueError, match=r"neither list: '1\.bias'"):
        validate_split(muon, [x for x in backup if x[0] != "1.bias"], model)
    model[1].bias.requires_grad_(False)  # frozen parameters may be absent
    validate_split(muon, [x for x in backup if x[0] != "1.bias"], model)


def test_describe_split_counts():
    model = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6))
    muon, backup = split_params_for_muon(model)
    assert describe_split(muon, backup) == (
        "muon: 1 tensors, 24 elements; backup: 3 tensors, 18 elements"
    )
