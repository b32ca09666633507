"""The bucket-table search of the PyTorch references (docs/algorithm.md#quantizer) equals the full
binary search.

The table path of ``_quant_ref`` must never change a code: its lower bound is compared with
``torch.searchsorted`` and its nearest / stochastic codes with a direct float64 oracle, on
codebooks with sparse and with dense buckets and on inputs at and next to every codeword.
"""

from __future__ import annotations

import pytest
import torch

from gefen_kernels.ops import _quant_ref as Q
from gefen_kernels.ops._search_table import build_search_table


def _codebook(kind: str) -> torch.Tensor:
    t = torch.linspace(-1.0, 1.0, 256, dtype=torch.float64)
    if kind == "uniform":
        c = t
    elif kind == "cubic":  # dozens of codewords share the buckets next to 0
        c = t**3
    else:  # random sorted interior with a tight cluster inside one bucket
        g = torch.Generator().manual_seed(3)
        inner = torch.rand(254, generator=g, dtype=torch.float64) * 2 - 1
        inner[:20] = 0.25 + torch.arange(20, dtype=torch.float64) * 1e-6
        c = torch.cat([torch.tensor([-1.0, 1.0], dtype=torch.float64), inner]).sort().values
    c = c.to(torch.float32)
    c[0], c[-1] = -1.0, 1.0
    return c.sort().values.contiguous()


def _inputs(cb: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    up = torch.full_like(cb, 2.0)
    parts = [
        torch.tensor([float("nan"), float("inf"), -float("inf"), 3e38, -3e38, 1.5, -1.5,
                      0.0, -0.0, 1.0, -1.0, 1e-30, -1e-30]),
        cb, torch.nextafter(cb, up), torch.nextafter(cb, -up),
        # bucket edges: (x + 1) * 2048 an integer, and their neighbours
        torch.arange(0, 4097, dtype=torch.float32) / 2048 - 1,
        torch.nextafter(torch.arange(0, 4097, dtype=torch.float32) / 2048 - 1, torch.tensor(2.0)),
        torch.randn(20000, generator=g) * 0.2,
        torch.rand(20000, generator=g) * 2.2 - 1.1,
    ]
    return torch.cat(parts).contiguous()


@pytest.mark.parametrize("kind", ["uniform", "cubic", "clustered"])
def test_table_lower_bound_equals_binary_search(kind: str) -> None:
    cb = _codebook(kind)
    _, steps = build_search_table(cb)
    assert steps >= 1
    x = _inputs(cb)
    ok = ~torch.isnan(x)
    got = Q._lower_bound(x, cb)
    want = torch.searchsorted(cb, x, right=False)
    assert torch.equal(got.long()[ok], want[ok])


@pytest.mark.parametrize("kind", ["uniform", "cubic", "clustered"])
def test_nearest_codes_match_float64_oracle(kind: str) -> None:
    cb = _codebook(kind)
    x = _inputs(cb)
    got = Q.nearest_codes(x, cb)
    assert got.dtype == torch.int64
    # Oracle from the definition: argmin |x - c| over fp32 distances, lowest index on ties,
    # 255 above +1, 0 for NaN.
    d = (x.view(-1, 1) - cb.view(1, -1)).abs()
    want = (d == d.min(dim=1, keepdim=True).values).int().argmax(dim=1)
    want = torch.where(x > 1.0, 255, want)
    want = torch.where(torch.isnan(x), 0, want)
    assert torch.equal(got, want)


@pytest.mark.parametrize("kind", ["uniform", "cubic"])
def test_stochastic_codes_bracket_and_follow_the_probability(kind: str) -> None:
    cb = _codebook(kind)
    x = _inputs(cb)
    u = torch.rand(x.shape, generator=torch.Generator().manual_seed(1))
    got = Q.stochastic_codes(x, cb, u)
    j = torch.searchsorted(cb.double(), x.double(), right=False).clamp(max=255)
    left = (j - 1).clamp(min=0)
    cl, cr = cb[left], cb[j]
    width = cr - cl
    clamped = torch.minimum(torch.maximum(x, cl), cr)
    p_up = torch.where(width > 0, (clamped - cl) / torch.where(width > 0, width, 1.0), 0.0)
    want = torch.where(u < p_up, j, left)
    want = torch.where(torch.isnan(x), 0, want)
    assert torch.equal(got, want)


def test_multi_dim_input_keeps_shape() -> None:
    cb = _codebook("uniform")
    x = _inputs(cb)[:6000].view(60, 100)
    assert torch.equal(Q.nearest_codes(x, cb), Q.nearest_codes(x.reshape(-1), cb).view(60, 100))
