"""The row-shard seam of the factored second moment (docs/algorithm.md#factored-second-moment):
``gefen(..., factored_stats=...)`` and ``Gefen._factored_statistics``.

Unreduced statistics of a whole matrix must reproduce the one-call step bit for bit on every
implementation; statistics of two row shards summed by hand must give each shard the step the
whole matrix gets (``r`` exact, ``k`` and the parameters to fp32 reordering).
"""

from __future__ import annotations

import pytest
import torch

from gefen_core import Gefen, gefen


def _state(seed: int, rows: int = 8, cols: int = 12, period: int = 24) -> dict:
    gen = torch.Generator().manual_seed(seed)
    codebook = torch.sort(torch.rand(256, generator=gen) * 2 - 1).values
    codebook[0], codebook[-1] = -1.0, 1.0
    blocks = rows * cols // period
    return {
        "param": torch.randn(rows, cols, generator=gen),
        "grad": torch.randn(rows, cols, generator=gen) * torch.logspace(-3, 0, cols),
        "codes": torch.randint(0, 256, (blocks, period), generator=gen, dtype=torch.uint8),
        "scale": torch.rand(blocks, 1, generator=gen),
        "row": torch.rand(rows, generator=gen),
        "col": torch.rand(cols, generator=gen),
        "step": torch.tensor(5.0), "sq_step": torch.tensor(2.0), "codebook": codebook,
    }


def _step(st: dict, stats=None, **kwargs) -> None:  # noqa: ANN001, ANN003
    gefen([st["param"]], [st["grad"]], [st["codes"]], [st["scale"]], [None], [st["row"]],
          [st["col"]], [st["step"]], [st["sq_step"]], codebook=st["codebook"], lr=1e-2,
          beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, seeds=[7],
          factored_stats=None if stats is None else [stats], **kwargs)


def _partial(st: dict) -> torch.Tensor:
    from gefen_kernels.ops.factored_step import factored_partial_stats_reference

    return factored_partial_stats_reference(st["param"], st["grad"], st["row"], st["col"],
                                            beta2=0.99)


@pytest.mark.parametrize("kwargs", [{}, {"foreach": True}, {"fused": True}])
def test_unreduced_stats_equal_one_call(kwargs: dict) -> None:
    a, b = _state(0), _state(0)
    _step(a, **kwargs)
    _step(b, stats=(_partial(b), 8), **kwargs)
    for key in ("param", "codes", "scale", "row", "col", "step", "sq_step"):
        assert torch.equal(a[key], b[key]), key


def test_two_row_shards_equal_the_whole_matrix() -> None:
    whole = _state(1)
    halves = []
    for lo, hi in ((0, 3), (3, 8)):
        st = _state(1)
        for key in ("param", "grad", "row"):
            st[key] = st[key][lo:hi].clone()
        st["codes"] = st["codes"].reshape(8, 12)[lo:hi].reshape(-1, 24 // 2).clone()
        st["scale"] = st["scale"].repeat_interleave(2, dim=0)[lo:hi]
        halves.append(st)
    # Blocks of 12 (one row) so every shard holds whole blocks: give the whole matrix the same.
    whole["codes"] = whole["codes"].reshape(-1, 12).clone()
    whole["scale"] = whole["scale"].repeat_interleave(2, dim=0)
    _step(whole)
    stats = [_partial(st) for st in halves]
    total = stats[0][3:] + stats[1][5:]
    for st, s, n in zip(halves, stats, (3, 5)):
        s = s.clone()
        s[n:] = total
        _step(st, stats=(s, 8))
    assert torch.equal(torch.cat([h["row"] for h in halves]), whole["row"])
    assert torch.equal(halves[0]["col"], halves[1]["col"])
    torch.testing.assert_close(halves[0]["col"], whole["col"], rtol=8 * 2**-24, atol=0)
    assert torch.equal(torch.cat([h["codes"] for h in halves]), whole["codes"])
    torch.testing.assert_close(torch.cat([h["param"] for h in halves]), whole["param"],
                               rtol=1e-6, atol=1e-9)


def test_plain_gefen_never_calls_the_hook() -> None:
    class Spy(Gefen):
        calls = 0

        def _factored_statistics(self, entries):  # noqa: ANN001, ANN202
            Spy.calls += 1
            return super()._factored_statistics(entries)

    p = torch.nn.Parameter(torch.randn(4, 6))
    opt = Spy([p], lr=1e-2, min_dim_size_to_factor=0)
    p.grad = torch.randn(4, 6)
    opt.step()
    assert Spy.calls == 0 and "exp_avg_sq_row" in opt.state[p]
    assert Gefen._reduces_factored_stats is False
