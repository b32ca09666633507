"""period_scores (docs/algorithm.md#period-search): one-pass scores against a naive per-candidate
loop.

The naive reference is written here from the formulas: for each candidate it reshapes the
gradient into ``[B, p]`` and computes block means and variances directly in float64.
"""

from __future__ import annotations

import importlib
import math
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
from kernels_inputs import count_launches

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
    # tiles' parts, each more than one iteration; the offsets kernel's loop over blocks of
    # tile totals; an fp64 gradient converted chunk by chunk.
    pk = importlib.import_module("gefen_kernels.ops._period_kernels")
    monkeypatch.setattr(pk, "ENDS_PER_PROGRAM", 2)
    monkeypatch.setattr(pk, "CARRY_LANES", 2)
    monkeypatch.setattr(pk, "SCAN_LANES", 2)
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
    """S(p) with exactly rounded block sums (math.fsum), from the docs/algorithm.md#period-search
    formula."""
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


# --------------------------------------------------------------------------------------------
# Many tensors at once (multi_period_scores)
# --------------------------------------------------------------------------------------------
def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _mix(variant: str, dev: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Sizes 1, a prime and several spanning two chunks of 2500 elements; fp32, bf16, fp16 and
    fp64; an unaligned view; candidate lists that are full, a subset, p = 1 only or empty."""
    unaligned = _grad(1, 5001, seed=41, kind="iid").to(dev)[1:]  # 5000 elements, 4-byte offset
    grads = [_grad(1, 1, seed=31, kind="iid"), _grad(1, 997, seed=32, kind="iid"),
             _grad(12, 250, seed=33, kind="row_scaled", dtype=torch.bfloat16),
             _grad(3, 1031, seed=34, kind="row_scaled", dtype=torch.float16),
             _grad(8, 300, seed=35, kind="zeros"),
             _grad(16, 160, seed=36, kind="row_scaled", dtype=torch.float64),
             _grad(5, 64, seed=37, kind="row_scaled", dtype=torch.bfloat16),
             _grad(7, 143, seed=38, kind="iid", dtype=torch.float16)]
    grads = [g.to(dev) for g in grads] + [unaligned]
    cands = [divisors(g.numel(), variant) for g in grads]
    cands[0] = [1] if variant == "variance" else []  # one element: no p has 2 blocks
    cands[4] = [1]
    cands[6] = [p for p in cands[6] if p % 5 == 0]  # a subset without p = 1
    cands[7] = []
    return grads, [torch.tensor(c, dtype=torch.int64) for c in cands]


def _assert_same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == torch.float64 and a.shape == b.shape, i
        assert torch.equal(a, b), (i, a, b)


@pytest.mark.parametrize("variant", ["log_contrast", "variance"])
def test_multi_reference_equals_per_tensor_reference(variant: str) -> None:
    grads, cands = _mix(variant, "cpu")
    got = ps_mod.multi_period_scores_reference(grads, cands, variant)
    _assert_same(got, [period_scores_reference(g, c, variant) for g, c in zip(grads, cands)])
    for g, c, s in zip(grads, cands, got):
        np.testing.assert_allclose(s.numpy(), naive_scores(g, c.tolist(), variant), rtol=1e-9,
                                   atol=1e-12)
    # The public op on CPU is the reference.
    _assert_same(ps_mod.multi_period_scores(grads, cands, variant), got)


@needs_triton
@pytest.mark.parametrize("variant", ["log_contrast", "variance"])
@pytest.mark.parametrize("round_chunks", [1, 6])
def test_multi_triton_equals_per_tensor_triton(monkeypatch: pytest.MonkeyPatch, variant: str,
                                               round_chunks: int) -> None:
    # Chunks of 2500 elements: carries cross chunks (and rounds); a round holds one chunk's
    # tiles or several tensors' chunks; the offsets kernel scans 3 tiles in blocks of 2.
    monkeypatch.setattr(ps_mod, "_CHUNK_TRITON", 2500)
    monkeypatch.setattr(ps_mod, "_ROUND_SHARE", 1)
    monkeypatch.setattr(ps_mod, "_ROUND_CHUNKS", round_chunks)
    monkeypatch.setattr(importlib.import_module("gefen_kernels.ops._period_kernels"),
                        "SCAN_LANES", 2)
    grads, cands = _mix(variant, _device())
    got = ps_mod.multi_period_scores_triton(grads, cands, variant)
    # Bit for bit the one-tensor Triton path (fp64 and the unaligned view included).
    _assert_same(got, [period_scores_triton(g, c, variant) for g, c in zip(grads, cands)])
    for g, c, s in zip(grads, cands, got):
        assert s.device == g.device
        np.testing.assert_allclose(s.cpu().numpy(), period_scores_reference(g, c, variant)
                                   .cpu().numpy(), rtol=1e-9, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["log_contrast", "variance"])
def test_multi_full_size_on_gpu_equals_per_tensor(variant: str) -> None:
    """Compiled for the GPU, with the production chunk and round sizes: Llama-like shapes
    (an 11M-element matrix spans two 8M chunks, hence two rounds), vectors and bf16/fp32
    mixed. Bit for bit the one-tensor Triton path, and within fp64 rounding of the
    reference."""
    shapes = [(2048, 5504), (512, 2048), (1, 2048), (1336, 8), (4096, 1024), (1, 1)]
    grads = [_grad(r, c, seed=50 + i, kind="row_scaled",
                   dtype=torch.bfloat16 if i % 2 == 0 else torch.float32).cuda()
             for i, (r, c) in enumerate(shapes)]
    cands = [torch.tensor(divisors(g.numel(), variant), dtype=torch.int64) for g in grads]
    got = ps_mod.multi_period_scores(grads, cands, variant)  # the custom op: Triton on CUDA
    _assert_same(got, [period_scores_triton(g, c, variant) for g, c in zip(grads, cands)])
    for g, c, s in zip(grads, cands, got):
        np.testing.assert_allclose(s.cpu().numpy(), period_scores_reference(g, c, variant)
                                   .cpu().numpy(), rtol=1e-9, atol=1e-12)


@needs_triton
@pytest.mark.parametrize("variant", ["log_contrast", "variance"])
def test_multi_triton_scores_do_not_depend_on_the_other_tensors(
        monkeypatch: pytest.MonkeyPatch, variant: str) -> None:
    # A NaN in one tensor stays there; a tensor's scores are the same alone, with others in
    # its rounds, and in another position.
    monkeypatch.setattr(ps_mod, "_CHUNK_TRITON", 1500)
    monkeypatch.setattr(ps_mod, "_ROUND_SHARE", 1)
    dev = _device()
    a = _grad(6, 500, seed=51, kind="row_scaled").to(dev)
    bad = _grad(4, 700, seed=52, kind="iid").to(dev)
    bad[1234] = float("nan")
    b = _grad(10, 100, seed=53, kind="row_scaled", dtype=torch.bfloat16).to(dev)
    ca, cbad, cb = (torch.tensor(divisors(t.numel(), variant)) for t in (a, bad, b))
    alone = [ps_mod.multi_period_scores_triton([t], [c], variant)[0]
             for t, c in ((a, ca), (b, cb))]
    got = ps_mod.multi_period_scores_triton([b, bad, a], [cb, cbad, ca], variant)
    assert torch.equal(got[0], alone[1]) and torch.equal(got[2], alone[0])
    assert not torch.isfinite(got[1][1:]).any()  # variance's E(1) = 0 * NaN as well
    assert not torch.isfinite(got[1][0])


def _count_launches(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Count each period kernel's launches (the launchers index ``kernel[grid]`` through the
    module, so a wrapper there sees every launch)."""
    pk = importlib.import_module("gefen_kernels.ops._period_kernels")
    counts = count_launches(monkeypatch, pk, (
        "_period_prefix_kernel", "_period_offsets_kernel", "_period_terms_kernel",
        "_period_carry_kernel", "_multi_prefix_kernel", "_multi_terms_kernel",
        "_multi_carry_kernel"))
    real = pk.host_to_device

    def copying(values: Any, device: torch.device) -> torch.Tensor:
        counts["host_to_device"] += 1
        return real(values, device)

    monkeypatch.setattr(pk, "host_to_device", copying)
    return counts


@needs_triton
@pytest.mark.parametrize("variant", ["log_contrast", "variance"])
def test_multi_triton_launches_do_not_grow_with_the_tensors(monkeypatch: pytest.MonkeyPatch,
                                                            variant: str) -> None:
    counts = _count_launches(monkeypatch)
    dev = _device()

    def launches(num: int, dtypes: tuple[torch.dtype, ...]) -> Counter:
        counts.clear()
        grads = [_grad(4, 96, seed=60 + i, kind="row_scaled", dtype=dtypes[i % len(dtypes)])
                 .to(dev) for i in range(num)]
        ps_mod.multi_period_scores_triton(
            grads, [torch.tensor(divisors(384, variant)) for _ in grads], variant)
        return Counter(counts)

    # All tensors in one round (the default 8M-element chunk): one launch of each kernel and
    # one host-to-device copy, for 2 tensors as for 24.
    one_round = {"_multi_prefix_kernel": 1, "_period_offsets_kernel": 1,
                 "_multi_terms_kernel": 1, "_multi_carry_kernel": 1, "host_to_device": 1}
    assert launches(2, (torch.float32,)) == one_round
    assert launches(24, (torch.float32,)) == one_round
    # One prefix launch per gradient dtype present, whatever the number of tensors.
    three = {**one_round, "_multi_prefix_kernel": 3}
    assert launches(3, (torch.float32, torch.bfloat16, torch.float16)) == three
    assert launches(24, (torch.float32, torch.bfloat16, torch.float16)) == three
    # The per-tensor path for comparison: four launches per tensor and chunk.
    counts.clear()
    for i in range(3):
        period_scores_triton(_grad(4, 96, seed=i, kind="iid").to(dev),
                             torch.tensor(divisors(384, variant)), variant)
    assert counts["_period_prefix_kernel"] == 3 and counts["host_to_device"] == 3


@needs_triton
def test_multi_triton_rounds_follow_the_total_size(monkeypatch: pytest.MonkeyPatch) -> None:
    # Rounds of at most 4 chunks of 2048 elements (2 tiles; a chunk takes an even number of
    # tiles): 12 tensors of 2048 elements need 3 rounds, 4 launches each; a tensor of 5 chunks
    # needs 5 rounds, the others fill them (most chunks left first, ties: lower index).
    pk = importlib.import_module("gefen_kernels.ops._period_kernels")
    assert pk.plan_rounds([2048] * 12, 2048, 8192) == [[0, 1, 2, 3], [4, 5, 6, 7],
                                                        [8, 9, 10, 11]]
    assert pk.plan_rounds([2048, 5 * 2048, 4096], 2048, 4096) == [[1, 2], [1, 0], [1, 2], [1],
                                                                  [1]]
    assert pk.plan_rounds([1, 1024, 1], 1024, 1) == [[0], [1], [2]]  # the first always fits
    monkeypatch.setattr(ps_mod, "_CHUNK_TRITON", 2048)
    monkeypatch.setattr(ps_mod, "_ROUND_SHARE", 1)
    monkeypatch.setattr(ps_mod, "_ROUND_CHUNKS", 4)
    counts = _count_launches(monkeypatch)
    dev = _device()
    grads = [_grad(8, 256, seed=70 + i, kind="iid").to(dev) for i in range(12)]
    got = ps_mod.multi_period_scores_triton(grads, [torch.tensor([1, 2, 512])] * 12, "variance")
    assert counts == {"_multi_prefix_kernel": 3, "_period_offsets_kernel": 3,
                      "_multi_terms_kernel": 3, "_multi_carry_kernel": 3, "host_to_device": 1}
    for g, s in zip(grads, got):
        np.testing.assert_allclose(s.cpu().numpy(), naive_scores(g, [1, 2, 512], "variance"),
                                   rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("fn", ["multi_period_scores", "multi_period_scores_reference"]
                         + (["multi_period_scores_triton"] if triton_available() else []))
def test_multi_errors_name_the_tensor(fn: str) -> None:
    call = getattr(ps_mod, fn)
    good, c = torch.randn(12), torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match=r"^grads\[1\] must be contiguous"):
        call([good, torch.randn(4, 3).t()], [c, c], "variance")
    with pytest.raises(TypeError, match=r"^grads\[2\] must be a floating-point tensor"):
        call([good, good, torch.ones(12, dtype=torch.int64)], [c, c, c], "variance")
    with pytest.raises(ValueError, match=r"^candidates\[1\] must be a 1-D int64 tensor"):
        call([good, good], [c, c.float()], "variance")
    with pytest.raises(ValueError, match=r"divisor of grads\[1\]\.numel\(\) = 10, got 3"):
        call([good, torch.randn(10)], [c, c], "variance")
    with pytest.raises(ValueError, match=r"^candidates\[0\] must be strictly ascending"):
        call([good], [torch.tensor([3, 2])], "variance")
    with pytest.raises(ValueError, match=r"2 blocks.*grads\[1\]\.numel\(\) = 12"):
        call([good, good], [c, torch.tensor([12 // 2, 12])], "log_contrast")
    with pytest.raises(ValueError, match=r"^grads\[1\] is on meta, grads\[0\] on cpu"):
        call([good, torch.empty(12, device="meta")], [c, c], "variance")
    with pytest.raises(ValueError, match="candidates has 1 tensors but grads has 2"):
        call([good, good], [c], "variance")
    with pytest.raises(ValueError, match="variant"):
        call([good], [c], "other")


def test_multi_empty_inputs_and_custom_op() -> None:
    for fn in (ps_mod.multi_period_scores, ps_mod.multi_period_scores_reference):
        assert fn([], [], "variance") == []
        got = fn([torch.randn(6), torch.randn(4)], [torch.tensor([], dtype=torch.int64)] * 2,
                 "log_contrast")
        assert [s.shape for s in got] == [(0,), (0,)]
    if triton_available():
        assert ps_mod.multi_period_scores_triton([], [], "variance") == []
        got = ps_mod.multi_period_scores_triton(
            [torch.randn(6).to(_device())], [torch.tensor([], dtype=torch.int64)], "variance")
        assert [s.shape for s in got] == [(0,)]
    g = [_grad(8, 64, seed=81, kind="row_scaled"), _grad(3, 5, seed=82, kind="iid")]
    c = [torch.tensor(divisors(512, "variance")), torch.tensor([1, 3, 5])]
    torch.library.opcheck(torch.ops.gefen.multi_period_scores.default, (g, c, "variance"))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        assert torch.ops.gefen.multi_period_scores([], [], "variance").shape == (0,)


@needs_triton
@pytest.mark.parametrize("variant", ["log_contrast", "variance"])
def test_block_counts_divide_exactly(variant: str) -> None:
    """``N / p`` must be the exact block count on every path: PyTorch's ``int / tensor``
    multiplies by the reciprocal, which gives 98 / 49 = 1.9999999999999998, and the batched
    path (which divides two tensors) then differs from the one-tensor path in the last bit."""
    g = _grad(1, 98, seed=91, kind="row_scaled").to(_device())
    c = torch.tensor(divisors(98, variant), dtype=torch.int64)
    assert 49 in c.tolist()
    one = period_scores_triton(g, c, variant)
    _assert_same(ps_mod.multi_period_scores_triton([g], [c], variant), [one])


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs two CUDA devices")
@pytest.mark.parametrize("variant", ["log_contrast", "variance"])
def test_gradients_on_a_device_other_than_the_current_one(variant: str) -> None:
    """Custom ops get no device guard: the ops must launch on their tensors' device."""
    assert torch.cuda.current_device() == 0
    g0 = _grad(64, 96, seed=92, kind="row_scaled").cuda(0)
    g1 = g0.cuda(1)
    c = torch.tensor(divisors(g0.numel(), variant), dtype=torch.int64)
    want = period_scores(g0, c, variant).cpu()
    assert torch.equal(period_scores(g1, c, variant).cpu(), want)
    got = ps_mod.multi_period_scores([g1, g1], [c, c], variant)
    assert all(s.device == g1.device and torch.equal(s.cpu(), want) for s in got)
