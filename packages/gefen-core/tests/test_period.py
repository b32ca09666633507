"""Block-period search (docs/algorithm.md#period-search).

``naive_period`` below is an independent float64 implementation written from the spec: for
every candidate it reshapes the gradient into ``[B, p]`` and computes the score directly, then
applies the decision rules. ``search_period`` (one pass of prefix sums through the
``period_scores`` op) must make the same decisions.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gefen_core import period as period_mod
from gefen_core.period import (
    memory_safe_fallback,
    period_candidates,
    search_period,
    search_periods,
)
from gefen_kernels._triton import interpret_mode, triton_available
from gefen_kernels.ops.period_scores import multi_period_scores_triton


# ------------------------------------------------------------------------------------------
# Independent implementation from docs/algorithm.md#period-search
# ------------------------------------------------------------------------------------------
def brute_divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def naive_scores(g: np.ndarray, cands: list[int], variant: str) -> list[float]:
    n = g.size
    x = np.log((g * g).astype(np.float64) + 1e-12)  # square in fp32, log in fp64
    y = g.astype(np.float64) ** 2
    out = []
    for p in cands:
        b = n // p
        if variant == "log_contrast":
            mu = x.reshape(b, p).mean(axis=1)
            out.append(float(np.abs(np.diff(mu)).mean()))
        else:
            out.append(0.0 if p == 1 else math.sqrt(y.reshape(b, p).var(axis=1).mean()))
    return out


def naive_fallback(n: int, shape: tuple[int, ...]) -> int:
    if n < 8:
        return 1
    opts = []
    if len(shape) >= 2 and shape[-1] >= 8 and n % shape[-1] == 0:
        opts.append(shape[-1])
    c = max(d for d in brute_divisors(n) if d <= 2048)
    if c >= 8:
        opts.append(c)
    return max(opts) if opts else 1


def naive_period(g: torch.Tensor, shape: tuple[int, ...], variant: str,
                 fallback: bool = True) -> int:
    a = g.detach().reshape(-1).float().numpy()
    n = a.size
    cands = [d for d in brute_divisors(n) if d < n]
    if variant == "log_contrast":
        cands = [p for p in cands if n // p >= 4]
        s = naive_scores(a, cands, variant)
        peaks = [(s[j], cands[j]) for j in range(1, len(cands) - 1)
                 if cands[j] > 8 and s[j] > s[j - 1] and s[j] > s[j + 1]]
        result = max(peaks)[1] if peaks else 1  # largest score, ties -> larger p
        if result > 1024:
            result = min(d for d in brute_divisors(result) if d > 1024)
    else:
        e = naive_scores(a, cands, variant)
        inc = [1e-12] + [e[j] - e[j - 1] for j in range(1, len(e))]
        result = cands[int(np.argmin(inc))]  # first minimum: ties -> smaller p
        if result < 8:
            result = 1
    if result == 1 and fallback:
        result = naive_fallback(n, shape)
    return result


def make_grad(shape: tuple[int, ...], seed: int, kind: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(*shape, generator=gen)
    if kind == "row_scaled" and len(shape) >= 2:
        g = g * torch.exp(1.5 * torch.randn(shape[0], *([1] * (len(shape) - 1)), generator=gen))
    elif kind == "col_scaled" and len(shape) >= 2:
        g = g * torch.exp(torch.randn(shape[-1], generator=gen))
    elif kind == "heavy":
        g = g / torch.rand(*shape, generator=gen).clamp_min(1e-3)
    return g


# ------------------------------------------------------------------------------------------
# Appendix B
# ------------------------------------------------------------------------------------------
APPENDIX_B = [
    # (shape, kind, variant, decision before the fallback, final)
    ((64, 512), "row_scaled", "log_contrast", 512, 512),
    ((64, 512), "row_scaled", "variance", 1, 2048),
    ((16, 4096), "row_scaled", "log_contrast", 2048, 2048),  # 4096 rounded by the >1024 rule
    ((64, 512), "iid", "log_contrast", 1, 2048),
    ((64, 512), "iid", "variance", 1, 2048),
    ((128, 2048), "row_scaled", "log_contrast", 2048, 2048),  # no divisor in (1024, 2048)
]


@pytest.mark.parametrize("shape,kind,variant,raw,final", APPENDIX_B)
def test_appendix_b(shape, kind, variant, raw, final) -> None:
    g = make_grad(shape, seed=0, kind=kind)
    # The independent implementation reproduces the documented outcome ...
    assert naive_period(g, shape, variant, fallback=False) == raw
    assert (raw if raw > 1 else naive_fallback(g.numel(), shape)) == final
    # ... and so does the one-pass search, on the tensor and on a non-contiguous view of it.
    assert search_period(g, shape, variant=variant, fallback=False) == raw
    assert search_period(g, shape, variant=variant) == final
    assert search_period(g.t().contiguous().t(), shape, variant=variant) == final


def test_large_period_rounding() -> None:
    assert period_mod._round_large_period(4096) == 2048
    assert period_mod._round_large_period(3072) == 1536
    assert period_mod._round_large_period(2048) == 2048
    assert period_mod._round_large_period(1024) == 1024
    assert period_mod._round_large_period(1031 * 2) == 1031  # prime factor just above 1024
    # Through the search: rows of 3072 are found, then rounded to 1536.
    g = make_grad((16, 3072), seed=0, kind="row_scaled")
    assert naive_period(g, (16, 3072), "log_contrast") == 1536
    assert search_period(g, (16, 3072)) == 1536


# ------------------------------------------------------------------------------------------
# Both variants against the independent implementation on many tensors
# ------------------------------------------------------------------------------------------
RANDOM_SHAPES = [(2,), (3,), (5,), (7,), (1, 7), (13,), (97,), (1009,), (4099,), (8, 8),
                 (12, 30), (48, 64), (24, 96), (96, 24), (3, 5, 7), (2, 3, 4, 40), (256, 64),
                 (2, 2, 2, 2, 2, 8), (17, 51), (32, 1024)]


@pytest.mark.parametrize("variant", ["log_contrast", "variance"])
@pytest.mark.parametrize("kind", ["iid", "row_scaled", "col_scaled", "heavy"])
@pytest.mark.parametrize("shape", RANDOM_SHAPES)
def test_matches_naive(variant: str, kind: str, shape: tuple[int, ...]) -> None:
    g = make_grad(shape, seed=len(shape) * 1000 + sum(shape), kind=kind)
    assert search_period(g, shape, variant=variant) == naive_period(g, shape, variant)
    assert (search_period(g, shape, variant=variant, fallback=False)
            == naive_period(g, shape, variant, fallback=False))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_low_precision_and_fp64_gradients(dtype: torch.dtype) -> None:
    g = make_grad((64, 512), seed=0, kind="row_scaled").to(dtype)
    for variant in ("log_contrast", "variance"):
        assert search_period(g, (64, 512), variant=variant) == naive_period(g, (64, 512),
                                                                             variant)


def test_zero_rows_give_a_variance_period() -> None:
    # Unused embedding rows: blocks that straddle a zero row and a used row (p = 64) have a
    # large within-block variance, row-aligned blocks (p = 96) a small one: E drops at 96.
    g = torch.randn(32, 96, generator=torch.Generator().manual_seed(0))
    g[1::2] = 0.0
    assert naive_period(g, (32, 96), "variance", fallback=False) == 96
    assert search_period(g, (32, 96), variant="variance", fallback=False) == 96


def test_one_period_scores_call_and_one_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = period_mod.multi_period_scores

    def counting(grads, candidates, variant):
        out = real(grads, candidates, variant)
        calls.append(([c.tolist() for c in candidates], variant))
        return out

    monkeypatch.setattr(period_mod, "multi_period_scores", counting)
    g = make_grad((48, 64), seed=1, kind="row_scaled")
    search_period(g, (48, 64), variant="log_contrast")
    search_period(g, (48, 64), variant="variance")
    assert len(calls) == 2
    # Variant L scores, in the one call, exactly the candidates rules 2-3 read: every
    # interior candidate above 8 (with >= 4 blocks) and its two neighbours.
    cands = [p for p in brute_divisors(3072) if 3072 // p >= 4]
    read = {cands[j + d] for j in range(1, len(cands) - 1) if cands[j] > 8 for d in (-1, 0, 1)}
    assert calls[0][0] == [sorted(read)] and 1 not in read and 8 in read
    assert calls[1][0] == [[p for p in brute_divisors(3072) if p < 3072]]


@pytest.mark.parametrize("n,scored", [(64, [1]), (11 * 13 * 4, None)])
def test_log_contrast_scores_p1_only_where_needed(monkeypatch: pytest.MonkeyPatch, n: int,
                                                  scored: list[int] | None) -> None:
    # 64: candidates 1..16, no interior one above 8, so the period is 1 whatever the scores
    # and p = 1 alone is scored (to refuse a non-finite gradient). 572 = 4 * 11 * 13: the
    # first candidate above 8 (11) follows 4, so 4 is read as its neighbour; p = 1 is not.
    calls = []
    real = period_mod.multi_period_scores

    def counting(grads, candidates, variant):
        calls.append([c.tolist() for c in candidates])
        return real(grads, candidates, variant)

    monkeypatch.setattr(period_mod, "multi_period_scores", counting)
    g = make_grad((n,), seed=2, kind="heavy")
    assert search_period(g, (n,), fallback=False) == naive_period(g, (n,), "log_contrast",
                                                                  fallback=False)
    cands = [p for p in brute_divisors(n) if n // p >= 4]
    assert calls == [[scored if scored is not None else cands[cands.index(4):]]]


# ------------------------------------------------------------------------------------------
# Many tensors at once (a model's first step)
# ------------------------------------------------------------------------------------------
BATCH = [((64, 512), "row_scaled"), ((64, 512), "iid"), ((1,), "iid"), ((7,), "iid"),
         ((16, 4096), "row_scaled"), ((48, 64), "col_scaled"), ((997,), "heavy"),
         ((32, 96), "row_scaled")]


@pytest.mark.parametrize("variant", ["log_contrast", "variance"])
def test_search_periods_equals_naive_per_tensor_with_one_readback(
        monkeypatch: pytest.MonkeyPatch, variant: str) -> None:
    grads = [make_grad(shape, seed=i, kind=kind) for i, (shape, kind) in enumerate(BATCH)]
    shapes = [shape for shape, _ in BATCH]
    cats = []
    real_cat = torch.cat

    def counting_cat(tensors, *args, **kwargs):
        cats.append(len(tensors))
        return real_cat(tensors, *args, **kwargs)

    monkeypatch.setattr(torch, "cat", counting_cat)
    got = search_periods(grads, shapes, variant=variant)
    monkeypatch.undo()
    # numel 1 has period 1 (docs/algorithm.md#period-search gate 2); the rest as the naive search.
    assert got == [1 if g.numel() == 1 else naive_period(g, s, variant)
                   for g, s in zip(grads, shapes)]
    # One concatenation of every scored tensor's scores (numel 1 needs none): one host read.
    assert cats == [len(BATCH) - 1]
    # A non-contiguous view is searched in logical order.
    t = make_grad((96, 32), seed=3, kind="row_scaled").t()
    assert search_periods([t], [(32, 96)], variant=variant) == [
        naive_period(t.contiguous(), (32, 96), variant)]


# The op as dispatched (CPU: the reference) and, where Triton runs here (CUDA, or its CPU
# interpreter), the batched Triton path on the same tensors.
SCORE_PATHS = ["op"] + (["triton"] if triton_available() and (
    torch.cuda.is_available() or interpret_mode()) else [])


@pytest.mark.parametrize("path", SCORE_PATHS)
@pytest.mark.parametrize("variant", ["log_contrast", "variance"])
def test_search_periods_equals_search_period_per_tensor(monkeypatch: pytest.MonkeyPatch,
                                                        path: str, variant: str) -> None:
    dev = "cuda" if path == "triton" and torch.cuda.is_available() else "cpu"
    if path == "triton":
        monkeypatch.setattr(period_mod, "multi_period_scores", multi_period_scores_triton)
    calls: list[int] = []
    real = period_mod.multi_period_scores

    def counting(grads, candidates, variant):
        calls.append(len(grads))
        return real(grads, candidates, variant)

    monkeypatch.setattr(period_mod, "multi_period_scores", counting)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
    grads = [make_grad(shape, seed=10 + i, kind=kind).to(dev, dtypes[i % 4])
             for i, (shape, kind) in enumerate(BATCH)]
    grads.append(make_grad((96, 32), seed=3, kind="row_scaled").to(dev).t())  # strided
    shapes = [shape for shape, _ in BATCH] + [(32, 96)]
    got = search_periods(grads, shapes, variant=variant)
    # One call for the contiguous tensors that need a search (numel 1 does not), one for the
    # strided one, whose copy is made for that call alone.
    assert calls == [len(BATCH) - 1, 1]
    calls.clear()
    assert got == [search_period(g, s, variant=variant) for g, s in zip(grads, shapes)]
    assert calls == [1] * (len(grads) - 1)
    assert got == [1 if g.numel() == 1 else naive_period(g.float().cpu(), s, variant)
                   for g, s in zip(grads, shapes)]


def test_search_periods_errors_name_the_position() -> None:
    good = torch.randn(64)
    bad = torch.randn(64)
    bad[5] = float("nan")
    with pytest.raises(ValueError, match=r"grads\[1\]: grad has NaN"):
        search_periods([good, bad], [(64,), (64,)])
    with pytest.raises(TypeError, match=r"grads\[1\]: grad must be a real floating"):
        search_periods([good, torch.ones(4, dtype=torch.int64)], [(64,), (4,)])
    with pytest.raises(ValueError, match="same length"):
        search_periods([good], [(64,), (64,)])
    with pytest.raises(ValueError, match="same length"):
        search_periods([good], [(64,)], names=["a", "b"])
    assert search_periods([], []) == []
    # With names (the optimizer passes its parameter names), errors use them, one tensor too.
    with pytest.raises(ValueError, match=r"^layer\.weight: grad has NaN"):
        search_periods([good, bad], [(64,), (64,)], names=["layer.bias", "layer.weight"])
    with pytest.raises(ValueError, match=r"^only: grad has NaN"):
        search_periods([bad], [(64,)], names=["only"])


def test_dtensor_gradient_is_refused_with_the_fix(tmp_path) -> None:
    # Under FSDP2 the caller must pass the local shard; the op layer cannot mix DTensor and
    # plain tensors. A one-rank gloo group on the CPU builds a real DTensor.
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed is not built")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                                rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        g = distribute_tensor(make_grad((16, 64), seed=2, kind="row_scaled"), mesh,
                              [Replicate()])
        with pytest.raises(TypeError, match=r"to_local\(\)"):
            search_period(g, (16, 64))
        assert search_period(g.to_local(), (16, 64)) == naive_period(g.to_local(), (16, 64),
                                                                     "log_contrast")
    finally:
        if owns_group:
            dist.destroy_process_group()


# ------------------------------------------------------------------------------------------
# Fallback, candidates, errors
# ------------------------------------------------------------------------------------------
def test_fallback_examples() -> None:
    assert memory_safe_fallback(1024, (1024,)) == 1024
    assert memory_safe_fallback(4096 * 4096, (4096, 4096)) == 4096
    assert memory_safe_fallback(151936 * 1024, (151936, 1024)) == 2048
    for n, shape in [(7, (7,)), (1, (1,)), (8, (8,)), (13, (13,)), (91, (7, 13)),
                     (2 * 4099, (2, 4099)), (4099 * 3, (4099 * 3,)), (96, (96, 1)),
                     (60, (6, 10)), (4096, ()), (1 << 20, (1 << 20,)), (12, (2, 2, 3))]:
        assert memory_safe_fallback(n, shape) == naive_fallback(n, shape), (n, shape)


def test_fallback_applies_inside_the_search_only_when_the_search_gives_one() -> None:
    g = make_grad((64, 512), seed=0, kind="iid")
    assert search_period(g, (64, 512), fallback=False) == 1
    assert search_period(g, (64, 512)) == 2048
    # A local shard: numel from the shard, the row-length candidate from the global shape.
    shard = g.reshape(-1)[: 64 * 512 // 4]
    assert search_period(shard, (64, 512)) == naive_fallback(shard.numel(), (64, 512))


@pytest.mark.parametrize("n", [1, 2, 12, 97, 360, 1024, 65521, 4096 * 3, 2 * 3 * 5 * 7 * 11 * 13])
def test_period_candidates(n: int) -> None:
    assert period_candidates(n) == [d for d in brute_divisors(n) if d < n]


def test_numel_one_and_errors() -> None:
    assert search_period(torch.randn(1), (1,)) == 1
    assert search_period(torch.randn(()), ()) == 1
    with pytest.raises(ValueError, match="numel"):
        search_period(torch.randn(0), (0,))
    with pytest.raises(ValueError, match="variant"):
        search_period(torch.randn(8), (8,), variant="peaks")
    with pytest.raises(TypeError, match="floating"):
        search_period(torch.ones(8, dtype=torch.int64), (8,))
    with pytest.raises(TypeError, match="shape"):
        search_period(torch.randn(8), 8)
    with pytest.raises(ValueError, match="numel"):
        period_candidates(0)


@pytest.mark.parametrize("variant", ["log_contrast", "variance"])
@pytest.mark.parametrize("n", [2, 3, 7, 64 * 512])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_non_finite_gradient_is_refused(variant: str, n: int, bad: float, where: str) -> None:
    # At 64 * 512 Variant L does not score p = 1 (the smallest scored candidate is 8): the
    # first and last blocks must still carry a non-finite value into a score.
    g = torch.randn(n)
    g[{"first": 0, "middle": n // 2, "last": n - 1}[where]] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        search_period(g, (n,), variant=variant)
