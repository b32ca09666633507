"""State size accounting (docs/algorithm.md#state-layout) and the bytes/param report for
model-shaped parameter sets."""

from __future__ import annotations

import torch

from gefen_core import Gefen
from gefen_core.state_size import (
    bytes_per_param,
    gpt2_124m_shapes,
    llama32_1b_shapes,
    main,
    state_bytes,
)


def test_state_bytes_matches_the_live_state() -> None:
    shapes = [(48, 64), (4096,), (3, 5, 7), (1,), (128, 130)]
    for factored, min_dim in ((True, 128), (True, 0), (False, 128)):
        params = [torch.randn(s, requires_grad=True) for s in shapes]
        opt = Gefen(params, factored_v_2d=factored, min_dim_size_to_factor=min_dim)
        for i, p in enumerate(params):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(i))
        opt.step()
        for p, shape in zip(params, shapes):
            st = opt.state[p]
            live = sum(v.numel() * v.element_size() for k, v in st.items()
                       if torch.is_tensor(v) and k not in ("step", "exp_avg_sq_step"))
            assert live == state_bytes(shape, st["period"], factored=factored,
                                       min_dim_size_to_factor=min_dim), shape


def test_model_shaped_sets_stay_near_one_byte_per_param(capsys) -> None:  # noqa: ANN001
    # The defaults (min_dim_size_to_factor = 128): no matrix of these sets is below 128 on a
    # side, so the rule leaves their state where it was.
    total, params = bytes_per_param(gpt2_124m_shapes(), factored=True)
    assert 124_000_000 < params < 125_000_000  # GPT-2 small with the tied head
    assert total / params <= 1.02
    assert total == bytes_per_param(gpt2_124m_shapes(), factored=True,
                                    min_dim_size_to_factor=0)[0]
    total, params = bytes_per_param(llama32_1b_shapes(), factored=True)
    assert 1_230_000_000 < params < 1_240_000_000
    assert total / params <= 1.02
    assert total == bytes_per_param(llama32_1b_shapes(), factored=True,
                                    min_dim_size_to_factor=0)[0]
    main([])
    out = capsys.readouterr().out
    assert "gpt2-124m" in out and "llama-3.2-1b" in out and "bytes/param" in out
