"""period_scores (§1.7.2, §1.7.3, §8.2): one-pass scores against a naive per-candidate loop.

The naive reference is written here from the formulas: for each candidate it reshapes the
gradient into ``[B, p]`` and computes block means and variances directly in float64.
"""

from __future__ import annotations

import importlib
import math

import numpy as np
import pytest
import torch

from gefen_kernels._triton import triton_available
from gefen_kernels.ops import period_scores as ps_mod
from gefen_kernels.ops.period_scores import (
    period_scores,
    period_scores_reference,
    period_scores_triton,
)


def naive_scores(g: torch.Tensor, cands: list[int], variant: str) -> np.ndarray:
    g32 = g.detach().reshape(-1).to(torch.float32).cpu()
    n = g32.numel()
    out = []
    for p in cands:
        b = n // p
        if variant == "log_contrast":
            x = np.log((g32 * g32).numpy().astype(np.float64) + 1e-12).reshape(b, p)
            mu = x.mean(axis=1)
            out.append(np.abs(np.diff(mu)).sum() / (b - 1))
        else:
            y = g32.numpy().astype(np.float64) ** 2
            if p == 1:
                out.append(0.0)
                continue
            var = y.reshape(b, p).var(axis=1)  # population variance, two-pass
            out.append(math.sqrt(var.mean()))
    return np.array(out)


def divisors(n: int, variant: str) -> list[int]:
    ds = [p for p in range(1, n) if n % p == 0]
    return [p for p in ds if n // p >= 2] if variant == "log_contrast" else ds


def _grad(rows: int, cols: int, seed: int, kind: str, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(rows, cols, generator=gen)
    if kind == "row_scaled":
        g = g * torch.exp(1.5 * torch.randn(rows, 1, generator=gen))
    elif kind == "zeros":
        g[::3] = 0.0
    return g.reshape(-1).to(dtype)


SHAPES = [(1, 2), (1, 7), (3, 5), (64, 48), (16, 96), (1, 997), (7, 143), (32, 1024), (5, 4096)]


@pytest.mark.parametrize("variant", ["log_contrast", "variance"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", ["iid", "row_scaled", "zeros"])
def test_reference_matches_naive(variant: str, shape: tuple[int, int], kind: str) -> None:
    g = _grad(*shape, seed=sum(shape), kind=kind)
    cands = divisors(g.numel(), variant)
    got = period_scores_reference(g, torch.tensor(cands, dtype=torch.int64), variant)
    assert got.dtype == torch.float64 and got.shape == (len(cands),)
    np.testing.assert_allclose(got.numpy(), naive_scores(g, cands, variant), rtol=1e-9,
                               atol=1e-12)


@pytest.mark.parametrize("variant", ["log_contrast", "variance"])
@pytest.mark.parametrize("chunk", [1, 5, 7, 64, 100])
def test_chunking_does_not_change_scores(monkeypatch: pytest.MonkeyPatch, variant: str,
                                         chunk: int) -> None:
    # Blocks straddling chunk boundaries, blocks longer than a chunk, chunk of one element.
    g = _grad(12, 30, seed=3, kind="row_scaled")
    cands = divisors(g.numel(), variant)
    monkeypatch.setattr(ps_mod, "_CHUNK_REFERENCE", chunk)
    got = period_scores_reference(g, torch.tensor(cands), variant)
    np.testing.assert_allclose(got.numpy(), naive_scores(g, cands, variant), rtol=1e-9,
                               atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_dtypes_square_the_fp32_value(dtype: torch.dtype) -> None:
    g = _grad(16, 64, seed=5, kind="row_scaled", dtype=dtype)
    for variant in ("log_contrast", "variance"):
        cands = divisors(g.numel(), variant)
        got = period_scores_reference(g, torch.tensor(cands), variant)
        np.testing.assert_allclose(got.numpy(), naive_scores(g, cands, variant), rtol=1e-9,
                                   atol=1e-12)


def test_subset_of_candidates_and_non_finite_input() -> None:
    g = _grad(8, 30, seed=9, kind="iid")
    cands = [2, 3, 24, 40]
    got = period_scores_reference(g, torch.tensor(cands), "log_contrast")
    np.testing.assert_allclose(got.numpy(), naive_scores(g, cands, "log_contrast"), rtol=1e-9)
    assert period_scores_reference(g, torch.tensor([], dtype=torch.int64), "variance").numel() == 0
    g[100] = float("nan")
    for variant in ("log_contrast", "variance"):
        c = torch.tensor([1, 2, 5, 60])
        assert not torch.isfinite(period_scores_reference(g, c, variant)).any()
    g[100] = float("inf")
    assert not torch.isfinite(period_scores_reference(g, torch.tensor([1]), "variance")).any()


def test_errors_name_the_argument() -> None:
    g = torch.randn(12)
    with pytest.raises(ValueError, match="variant"):
        period_scores_reference(g, torch.tensor([1]), "other")
    with pytest.raises(ValueError, match="divisor"):
        period_scores_reference(g, torch.tensor([5]), "variance")
    with pytest.raises(ValueError, match="ascending"):
        period_scores_reference(g, torch.tensor([3, 2]), "variance")
    with pytest.raises(ValueError, match="2 blocks"):
        period_scores_reference(g, torch.tensor([12]), "log_contrast")
    with pytest.raises(ValueError, match="int64"):
        period_scores_reference(g, torch.tensor([1.0]), "variance")
    with pytest.raises(ValueError, match="contiguous"):
        period_scores_reference(torch.randn(4, 3).t(), torch.tensor([1]), "variance")
    with pytest.raises(TypeError, match="floating"):
        period_scores_reference(torch.ones(4, dtype=torch.int64), torch.tensor([1]), "variance")


def test_custom_op_on_cpu_and_fake() -> None:
    g = _grad(8, 64, seed=11, kind="row_scaled")
    c = torch.tensor(divisors(g.numel(), "log_contrast"))
    assert torch.equal(period_scores(g, c, "log_contrast"),
                       period_scores_reference(g, c, "log_contrast"))
    torch.library.opcheck(torch.ops.gefen.period_scores.default, (g, c, "variance"))


needs_triton = pytest.mark.skipif(not triton_available(), reason="needs Triton")


@needs_triton
@pytest.mark.parametrize("variant", ["log_contrast", "variance"])
@pytest.mark.parametrize("shape,dtype", [((1, 7), torch.float32), ((64, 48), torch.bfloat16),
                                         ((3, 1031), torch.float16), ((8, 4096), torch.float32),
                                         ((3, 1030), torch.float32)])  # a 1-element last chunk
def test_triton_matches_reference(monkeypatch: pytest.MonkeyPatch, variant: str,
                                  shape: tuple[int, int], dtype: torch.dtype) -> None:
    # <= 64K elements in the interpreter; a small chunk exercises the cross-chunk carries.
    monkeypatch.setattr(ps_mod, "_CHUNK_TRITON", 3 * 1024 + 17)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = _grad(*shape, seed=13, kind="row_scaled", dtype=dtype).to(dev)
    c = torch.tensor(divisors(g.numel(), variant))
    got = period_scores_triton(g, c, variant)
    ref = period_scores_reference(g, c, variant)
    assert got.device == g.device and got.dtype == torch.float64
    np.testing.assert_allclose(got.cpu().numpy(), ref.cpu().numpy(), rtol=1e-9, atol=1e-12)


@needs_triton
@pytest.mark.parametrize("variant", ["log_contrast", "variance"])
@pytest.mark.parametrize("chunk,cols", [(1, 5), (7, 10), (64, 30), (100, 30), (1500, 250)])
def test_triton_chunking_does_not_change_scores(monkeypatch: pytest.MonkeyPatch, variant: str,
                                                chunk: int, cols: int) -> None:
    # The carries of the Triton path: blocks straddling chunks, blocks longer than a chunk,
    # chunks of one element, chunks that end inside a tile and span several tiles.
    g = _grad(12, cols, seed=3, kind="row_scaled")
    cands = divisors(g.numel(), variant)
    monkeypatch.setattr(ps_mod, "_CHUNK_TRITON", chunk)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    got = period_scores_triton(g.to(dev), torch.tensor(cands), variant)
    np.testing.assert_allclose(got.cpu().numpy(), naive_scores(g, cands, variant), rtol=1e-9,
                               atol=1e-12)


@needs_triton
@pytest.mark.parametrize("variant", ["log_contrast", "variance"])
def test_triton_loops_over_many_programs(monkeypatch: pytest.MonkeyPatch, variant: str) -> None:
    # The carry kernel's loops: over a candidate's many terms programs, and (p = 1) over the
    # tiles' parts, each more than one iteration; an fp64 gradient converted chunk by chunk.
    pk = importlib.import_module("gefen_kernels.ops._period_kernels")
    monkeypatch.setattr(pk, "ENDS_PER_PROGRAM", 2)
    monkeypatch.setattr(pk, "CARRY_LANES", 2)
    monkeypatch.setattr(ps_mod, "_CHUNK_TRITON", 2500)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for dtype in (torch.float32, torch.float64):
        g = _grad(16, 160, seed=23, kind="row_scaled", dtype=dtype)  # 3 tiles of p = 1 parts
        cands = [1, 160, 320, 640]  # 8, 4 and 2 terms programs per candidate
        got = period_scores_triton(g.to(dev), torch.tensor(cands), variant)
        np.testing.assert_allclose(got.cpu().numpy(), naive_scores(g, cands, variant),
                                   rtol=1e-9, atol=1e-12)


@needs_triton
def test_triton_empty_gradient_matches_reference() -> None:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for cands in ([1], [3], [1, 3]):
        c = torch.tensor(cands)
        got = period_scores_triton(torch.zeros(0, device=dev), c, "variance")
        ref = period_scores_reference(torch.zeros(0), c, "variance")
        np.testing.assert_array_equal(got.cpu().numpy(), ref.numpy())


@needs_triton
def test_triton_subsets_and_non_finite_input(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ps_mod, "_CHUNK_TRITON", 100)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = _grad(8, 30, seed=9, kind="iid").to(dev)
    for variant, cands in (("log_contrast", [2, 3, 24, 40]), ("log_contrast", [1]),
                           ("variance", [1]), ("variance", [5, 6, 240]), ("variance", [])):
        got = period_scores_triton(g, torch.tensor(cands, dtype=torch.int64), variant)
        np.testing.assert_allclose(got.cpu().numpy(), naive_scores(g, cands, variant),
                                   rtol=1e-9, atol=1e-12)
    g[100] = float("nan")
    for variant in ("log_contrast", "variance"):
        for cands in ([1, 2, 5, 60], [1], [3]):
            got = period_scores_triton(g, torch.tensor(cands), variant)
            if variant == "variance" and cands == [3]:
                assert torch.isnan(got).all()
            else:
                assert not torch.isfinite(got).any(), (variant, cands, got)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["log_contrast", "variance"])
def test_triton_full_size_on_gpu(variant: str) -> None:
    g = _grad(4096, 4096, seed=17, kind="row_scaled", dtype=torch.bfloat16).cuda()
    c = torch.tensor([2**i for i in range(24)])  # every divisor of 2**24 with >= 2 blocks
    got = period_scores(g, c, variant)  # the custom op takes Triton on CUDA
    np.testing.assert_allclose(got.cpu().numpy(), naive_scores(g, c.tolist(), variant),
                               rtol=1e-8, atol=1e-12)
    np.testing.assert_allclose(got.cpu().numpy(),
                               period_scores_reference(g, c, variant).cpu().numpy(),
                               rtol=1e-9, atol=1e-12)


def _exact_log_contrast(g: torch.Tensor, cands: list[int]) -> list[float]:
    """S(p) with exactly rounded block sums (math.fsum), from the §1.7.2 formula."""
    x = np.log((g.float() * g.float()).numpy().astype(np.float64) + 1e-12)
    out = []
    for p in cands:
        mu = [math.fsum(x[b * p:(b + 1) * p]) / p for b in range(x.size // p)]
        out.append(math.fsum(abs(mu[i + 1] - mu[i]) for i in range(len(mu) - 1)) / (len(mu) - 1))
    return out


def test_large_period_scores_keep_full_fp64_precision() -> None:
    # The H200 failure: in one chunk, ~chunk/2 block ends of p = 2 and the one or two of the
    # largest p share a running sum; the large p's small score must not inherit its rounding
    # error. Exactly rounded block sums give the reference figures (rtol 1e-12, fp64 has 1e-16).
    g = _grad(512, 2048, seed=17, kind="row_scaled", dtype=torch.bfloat16)
    cands = [2**i for i in range(19)]  # every divisor of 2**20 with >= 4 blocks
    got = period_scores_reference(g, torch.tensor(cands), "log_contrast").numpy()
    big = [p for p in cands if p >= 2**14]
    np.testing.assert_allclose(got[-len(big):], _exact_log_contrast(g, big), rtol=1e-12, atol=0)
