"""Which 2-D parameters take the factored second moment (docs/algorithm.md#factoring-rule).

A matrix is factored only if ``factored_v_2d`` holds and both sides are at least
``min_dim_size_to_factor`` (default 128); ``0`` factors every matrix. Checkpoints carry the
rule with each group, and a group saved before it existed loads with ``0``, so a load keeps
every parameter's mode.
"""

from __future__ import annotations

import copy

import pytest
import torch

from gefen_core import Gefen
from gefen_core.checkpoint import CheckpointError


def _step(opt: Gefen, params: list[torch.Tensor], seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()


def _mode(opt: Gefen, p: torch.Tensor) -> str:
    st = opt.state[p]
    assert ("exp_avg_sq" in st) != ("exp_avg_sq_row" in st), sorted(st)
    return "factored" if "exp_avg_sq_row" in st else "block"


def test_small_matrices_keep_the_per_block_second_moment_by_default() -> None:
    head = torch.nn.Parameter(torch.zeros(10, 768))  # a classifier head: 10 rows
    hidden = torch.nn.Parameter(torch.zeros(256, 512))
    edge = torch.nn.Parameter(torch.zeros(128, 4096))  # exactly the threshold: factored
    below = torch.nn.Parameter(torch.zeros(127, 4096))
    params = [head, hidden, edge, below]
    opt = Gefen(params, lr=1e-3)
    assert opt.param_groups[0]["min_dim_size_to_factor"] == 128
    _step(opt, params)
    assert [_mode(opt, p) for p in params] == ["block", "factored", "factored", "block"]


def test_zero_factors_every_matrix_and_factored_v_2d_false_none() -> None:
    head = torch.nn.Parameter(torch.zeros(10, 768))
    opt = Gefen([head], min_dim_size_to_factor=0)
    _step(opt, [head])
    assert _mode(opt, head) == "factored"
    big = torch.nn.Parameter(torch.zeros(256, 512))
    opt = Gefen([big], factored_v_2d=False)
    _step(opt, [big])
    assert _mode(opt, big) == "block"


def test_groups_may_set_their_own_rule() -> None:
    a = torch.nn.Parameter(torch.zeros(64, 96))
    b = torch.nn.Parameter(torch.zeros(64, 96))
    opt = Gefen([{"params": [a]}, {"params": [b], "min_dim_size_to_factor": 64}])
    _step(opt, [a, b])
    assert (_mode(opt, a), _mode(opt, b)) == ("block", "factored")


@pytest.mark.parametrize("bad", [-1, 1.5, True, "128", None])
def test_invalid_values_are_refused_before_anything_is_registered(bad) -> None:  # noqa: ANN001
    p = torch.nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="min_dim_size_to_factor must be an int >= 0"):
        Gefen([p], min_dim_size_to_factor=bad)
    opt = Gefen([p])
    q = torch.nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="min_dim_size_to_factor"):
        opt.add_param_group({"params": [q], "min_dim_size_to_factor": bad})
    assert len(opt.param_groups) == 1 and q not in opt.state


def test_checkpoint_carries_the_rule_and_old_checkpoints_keep_their_modes() -> None:
    torch.manual_seed(0)
    head = torch.nn.Parameter(torch.randn(10, 768))
    params = [head]
    # Saved with every matrix factored, as before the rule existed.
    old = Gefen([("head", head)], lr=1e-3, min_dim_size_to_factor=0)
    for s in range(3):
        _step(old, params, s)
    sd = copy.deepcopy(old.state_dict())
    assert sd["param_groups"][0]["min_dim_size_to_factor"] == 0
    legacy = copy.deepcopy(sd)
    del legacy["param_groups"][0]["min_dim_size_to_factor"]  # a checkpoint from before
    for saved in (sd, legacy):
        new = Gefen([("head", head)], lr=1e-3)  # the live default is 128
        new.load_state_dict(copy.deepcopy(saved))
        assert new.param_groups[0]["min_dim_size_to_factor"] == 0
        row = new.state[head]["exp_avg_sq_row"].clone()
        _step(new, params, 9)
        st = new.state[head]
        # Still factored, the statistics continued (not restarted): age 4, row EMA moved on.
        assert _mode(new, head) == "factored" and int(st["exp_avg_sq_step"]) == 4
        assert not torch.equal(st["exp_avg_sq_row"], row)
    # A checkpoint saved with the default rule restores it, whatever the live value.
    fresh = Gefen([("head", head)], lr=1e-3)
    _step(fresh, params)
    back = Gefen([("head", head)], lr=1e-3, min_dim_size_to_factor=0)
    back.load_state_dict(copy.deepcopy(fresh.state_dict()))
    assert back.param_groups[0]["min_dim_size_to_factor"] == 128
    _step(back, params, 1)
    assert _mode(back, head) == "block" and int(back.state[head]["exp_avg_sq_step"]) == 2


def test_a_checkpoint_with_a_bad_rule_is_refused_and_changes_nothing() -> None:
    p = torch.nn.Parameter(torch.randn(4, 4))
    opt = Gefen([("p", p)])
    _step(opt, [p])
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0]["min_dim_size_to_factor"] = -3
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(CheckpointError, match="min_dim_size_to_factor"):
        opt.load_state_dict(sd)
    after = opt.state_dict()
    assert after["param_groups"][0]["min_dim_size_to_factor"] == 128
    assert torch.equal(after["state"][0]["exp_avg_codes"], before["state"][0]["exp_avg_codes"])
