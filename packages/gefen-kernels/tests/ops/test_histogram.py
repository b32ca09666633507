"""histogram reference (docs/algorithm.md#histogram): exact counts against a naive per-block
loop."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch
from kernels_oracle import histogram_naive

from gefen_kernels import _numerics
from gefen_kernels.ops.histogram import (
    histogram,
    histogram_reference,
    histogram_sum,
    histogram_triton,
)

CASES = [(1, 1), (4097, 1), (4097, 4097), (8191, 1), (2 * 7, 7), (64 * 5, 64), (1024 * 3, 1024),
         (2048 * 2, 2048), (4096 * 2, 4096), (8192 * 3, 8192), (65521, 65521)]


@pytest.mark.parametrize("numel,period", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_counts_match_naive_loop(numel: int, period: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(numel + period)
    scales = torch.exp(torch.randn(numel // period, 1, generator=gen) * 2)
    g = (torch.randn(numel // period, period, generator=gen) * scales).reshape(-1).to(dtype)
    counts = histogram_reference(g, period)
    assert counts.dtype == torch.int64 and counts.shape == (4096,)
    assert np.array_equal(counts.numpy(), histogram_naive(g.float().numpy(), period))
    assert int(counts.sum()) == numel


def test_landmarks_and_zero_blocks() -> None:
    g = torch.tensor([-2.0, 2.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    counts = histogram_reference(g, 4)
    assert counts[0] == 1 and counts[4095] == 1  # -1 -> bin 0, +1 -> bin 4095
    assert counts[2048] == 5  # zeros, including the all-zero block
    assert counts[3072] == 1  # 0.5 -> floor(1.5 * 2048)
    assert int(counts.sum()) == 8


def test_non_finite_blocks_are_skipped() -> None:
    g = torch.randn(4, 16)
    g[1, 2] = float("nan")
    g[3, 0] = float("inf")
    counts = histogram_reference(g.reshape(-1), 16)
    assert int(counts.sum()) == 32
    assert np.array_equal(counts.numpy(), histogram_naive(g.numpy(), 16))


@pytest.mark.parametrize("period,chunk", [(7, 20), (1000, 300), (5, 5)])
def test_chunked_equals_whole(monkeypatch: pytest.MonkeyPatch, period: int, chunk: int) -> None:
    g = torch.randn(period * 9)
    whole = histogram_reference(g, period)
    monkeypatch.setattr(_numerics, "CHUNK_ELEMENTS", chunk)
    assert torch.equal(histogram_reference(g, period), whole)


def test_empty_and_errors() -> None:
    assert torch.equal(histogram_reference(torch.empty(0), 3), torch.zeros(4096, dtype=torch.long))
    with pytest.raises(ValueError, match="does not divide"):
        histogram_reference(torch.zeros(10), 3)
    with pytest.raises(ValueError, match="period"):
        histogram_reference(torch.zeros(10), 0)
    with pytest.raises(ValueError, match="contiguous"):
        histogram_reference(torch.zeros(10, 2).t(), 2)


# --------------------------------------------------------------------------------------------
# Triton kernel vs reference: integer counts, so exactly equal on every route.
# --------------------------------------------------------------------------------------------


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("numel,period", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_matches_reference(numel: int, period: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(numel)
    scales = torch.exp(torch.randn(numel // period, 1, generator=gen) * 2)
    g = (torch.randn(numel // period, period, generator=gen) * scales).reshape(-1).to(dtype)
    if numel > 3 * period:
        g[period + 1] = float("nan")
        g[2 * period] = float("inf")
    g = g.to(_device())
    assert torch.equal(histogram_triton(g, period), histogram_reference(g, period))


@pytest.mark.parametrize("period,split", [(1000, 256), (4099, 1024), (7, 2)])
def test_triton_split_route(period: int, split: int) -> None:
    g = torch.randn(period * 3, generator=torch.Generator().manual_seed(period))
    g[period + 5] = float("nan")
    g = g.to(_device())
    assert torch.equal(histogram_triton(g, period, _route="split", _split_elements=split),
                       histogram_reference(g, period))


@pytest.mark.parametrize("period,route", [(16, "tile"), (7, "tile"), (1000, "split"),
                                          (250, "split")])
def test_triton_counts_chunk_by_chunk(monkeypatch: pytest.MonkeyPatch, period: int,
                                      route: str) -> None:
    # Several count chunks of whole blocks (one block per chunk when P exceeds the chunk),
    # with a non-finite block among them.
    # gefen_kernels.ops.histogram is also the name of the op function: import the module.
    monkeypatch.setattr(importlib.import_module("gefen_kernels.ops.histogram"), "_HIST_CHUNK",
                        100)
    gen = torch.Generator().manual_seed(period)
    g = (torch.randn(9, period, generator=gen) * torch.exp(torch.randn(9, 1, generator=gen)))
    g = g.reshape(-1)
    g[3 * period + 1] = float("inf")
    g = g.to(_device())
    got = histogram_triton(g, period, _route=route, _split_elements=128)
    assert torch.equal(got, histogram_reference(g, period))
    assert int(got.sum()) == 8 * period


@pytest.mark.parametrize("chunk", [100, 1000, 1 << 24])
def test_triton_counts_share_bin_buffers(monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    # histogram_sum's batched Triton path: bins of several tensors (both routes, three
    # dtypes, a non-finite block, a block longer than the buffer) in shared buffers.
    mod = importlib.import_module("gefen_kernels.ops.histogram")
    monkeypatch.setattr(mod, "_HIST_CHUNK", chunk)
    gen = torch.Generator().manual_seed(chunk)
    items = [(torch.randn(12, 48, generator=gen).reshape(-1), 48),
             (torch.randn(3 * 5003, generator=gen).to(torch.bfloat16), 5003),
             (torch.randn(70, generator=gen).to(torch.float16), 7),
             (torch.randn(2 * 4099, generator=gen), 4099)]
    items[0][0][50] = float("nan")
    items = [(g.to(_device()), p) for g, p in items]
    got = mod._triton_counts(items, torch.device(_device()), split_elements=1024)
    want = sum(histogram_reference(g, p) for g, p in items)
    assert torch.equal(got, want)


@pytest.mark.parametrize("deterministic", [False, True])
def test_counts_with_and_without_deterministic_algorithms(deterministic: bool) -> None:
    # Under torch.use_deterministic_algorithms the counts come from bincount (CUDA's histc
    # would raise there); both must give the reference's counts, dropped elements included.
    mod = importlib.import_module("gefen_kernels.ops.histogram")
    gen = torch.Generator().manual_seed(7)
    g = torch.randn(40, 64, generator=gen) * torch.exp(torch.randn(40, 1, generator=gen))
    g[3, 5] = float("nan")
    g[7] = 0.0  # a zero block: all in bin 2048
    g = g.reshape(-1).to(_device())
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        got = mod._triton_counts([(g, 64)], torch.device(_device()))
    finally:
        torch.use_deterministic_algorithms(was)
    assert torch.equal(got, histogram_reference(g, 64))
    assert int(got.sum()) == 39 * 64 and int(got[2048]) >= 64


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp32_counts_stay_exact_at_the_chunk_size() -> None:
    # Every element of a zero gradient lands in bin 2048: a full chunk (2**24) and a block
    # longer than the chunk (split in _count) put 2**24 counts into one fp32 bin, the largest
    # count fp32 still holds exactly; adding one more would round.
    mod = importlib.import_module("gefen_kernels.ops.histogram")
    for n, period in (((1 << 25) + 2048, 2048), (3 << 24, 3 << 24)):
        got = histogram_triton(torch.zeros(n, device="cuda", dtype=torch.bfloat16), period)
        assert int(got[2048]) == n and int(got.sum()) == n, (n, period)
    assert mod._HIST_CHUNK <= 1 << 24


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_counts_take_no_host_sync() -> None:
    # The counts stay on the device (the caller reads them once per device): no kernel or
    # count of the Triton path may synchronise, over several chunks and both routes.
    mod = importlib.import_module("gefen_kernels.ops.histogram")
    items = [(torch.randn(3 << 20, device="cuda", dtype=torch.bfloat16), 768),
             (torch.randn(4 * 20000, device="cuda"), 20000)]
    want = sum(histogram_reference(g, p) for g, p in items)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = mod._triton_counts(items, torch.device("cuda"), split_elements=4096)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got, want)


@pytest.mark.gpu
def test_histogram_sum_batches_cuda_tensors_gpu() -> None:
    grads = [torch.randn(n, device="cuda").to(dt) for n, dt in
             ((768 * 2304, torch.bfloat16), (768, torch.float32), (50257 * 768, torch.bfloat16),
              (4096 * 3, torch.float16))]
    periods = [768, 768, 768, 4096]
    grads[1][3] = float("inf")
    want = sum(histogram_reference(g, p).cpu() for g, p in zip(grads, periods))
    assert torch.equal(histogram_sum(grads, periods), want)


def test_public_op() -> None:
    g = torch.randn(640)
    assert torch.equal(histogram(g, 64), histogram_reference(g, 64))
    torch.library.opcheck(torch.ops.gefen.histogram.default, (g, 64),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.gpu
@pytest.mark.parametrize("period", [1, 7 * 64, 2048, 4096, 1 << 16, 1 << 26])
def test_triton_matches_reference_large_gpu(period: int) -> None:
    n = (1 << 26) // period * period
    g = torch.randn(n, device="cuda").to(torch.bfloat16)
    assert torch.equal(histogram(g, period), histogram_reference(g, period))


@pytest.mark.gpu
def test_compile_fullgraph_gpu() -> None:
    g = torch.randn(4096 * 8, device="cuda")
    fn = torch.compile(lambda t: histogram(t * 2.0, 4096), fullgraph=True)
    assert torch.equal(fn(g), histogram_reference(g * 2.0, 4096))


def test_histogram_sum_adds_every_tensor_with_its_own_period() -> None:
    gen = torch.Generator().manual_seed(5)
    specs = [((64, 48), 48), ((4097,), 1), ((30, 7), 7), ((1,), 1), ((8, 2048), 4096)]
    grads = [torch.randn(*shape, generator=gen) * torch.exp(torch.randn(1, generator=gen))
             for shape, _ in specs]
    grads[0] = grads[0].t()  # non-contiguous: binned in logical row-major order
    grads[2] = grads[2].to(torch.bfloat16)
    periods = [p for _, p in specs]
    expected = sum(histogram_naive(g.contiguous().float().numpy().reshape(-1), p)
                   for g, p in zip(grads, periods))
    for reference in (False, True, [True, False, True, False, True]):
        total = histogram_sum(grads, periods, reference=reference)
        assert total.dtype == torch.int64 and total.device.type == "cpu"
        assert np.array_equal(total.numpy(), expected)
    assert int(histogram_sum([], []).sum()) == 0


def test_histogram_sum_errors_name_the_position() -> None:
    with pytest.raises(ValueError, match=r"grads\[1\]: period 5 does not divide"):
        histogram_sum([torch.randn(8), torch.randn(8)], [4, 5])
    with pytest.raises(TypeError, match=r"grads\[0\]"):
        histogram_sum([torch.ones(4, dtype=torch.int64)], [1])
    with pytest.raises(ValueError, match="same length"):
        histogram_sum([torch.randn(8)], [4, 4])
