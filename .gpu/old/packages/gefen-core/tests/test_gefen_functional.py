"""The functional API ``gefen_core.gefen``: one signature, three implementations."""

from __future__ import annotations

import pytest
import torch

from gefen_core import gefen


def _state(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    codebook = torch.sort(torch.rand(256, generator=gen) * 2 - 1).values
    codebook[0], codebook[-1] = -1.0, 1.0
    p_block = torch.randn(6, 8, generator=gen)
    p_fact = torch.randn(8, 12, generator=gen)
    return {
        "params": [p_block, p_fact],
        "grads": [torch.randn(6, 8, generator=gen), torch.randn(8, 12, generator=gen)],
        "codes": [torch.randint(0, 256, (3, 16), generator=gen, dtype=torch.uint8),
                  torch.randint(0, 256, (4, 24), generator=gen, dtype=torch.uint8)],
        "scales": [torch.rand(3, 1, generator=gen), torch.rand(4, 1, generator=gen)],
        "sqs": [torch.rand(3, 1, generator=gen), None],
        "rows": [None, torch.rand(8, generator=gen)],
        "cols": [None, torch.rand(12, generator=gen)],
        "steps": [torch.tensor(3.0), torch.tensor(5.0)],
        "sq_steps": [torch.tensor(3.0), torch.tensor(2.0)],
        "codebook": codebook,
    }


def _call(st: dict, **kwargs) -> None:  # noqa: ANN003
    gefen(st["params"], st["grads"], st["codes"], st["scales"], st["sqs"], st["rows"],
          st["cols"], st["steps"], st["sq_steps"], codebook=st["codebook"], lr=1e-2, beta1=0.9,
          beta2=0.99, eps=1e-8, weight_decay=0.1, seeds=[11, 12], **kwargs)


@pytest.mark.parametrize("stochastic_round", [False, True])
def test_implementations_agree_bit_for_bit_on_cpu(stochastic_round: bool) -> None:
    results = []
    for kwargs in ({}, {"foreach": True}, {"fused": True}):
        st = _state(0)
        _call(st, stochastic_round=stochastic_round, **kwargs)
        results.append(st)
    for other in results[1:]:
        for key in ("params", "codes", "scales", "sqs", "rows", "cols", "steps", "sq_steps"):
            for a, b in zip(results[0][key], other[key]):
                assert (a is None and b is None) or torch.equal(a, b), key
    assert [float(t) for t in results[0]["steps"]] == [4.0, 6.0]
    assert [float(t) for t in results[0]["sq_steps"]] == [4.0, 3.0]
    assert not torch.equal(results[0]["params"][0], _state(0)["params"][0])


def test_functional_argument_errors() -> None:
    st = _state(0)
    with pytest.raises(RuntimeError, match="differentiable"):
        _call(st, differentiable=True)
    with pytest.raises(RuntimeError, match="cannot both"):
        _call(st, fused=True, foreach=True)
    st["grads"] = st["grads"][:1]
    with pytest.raises(ValueError, match="one entry per parameter"):
        _call(st)
