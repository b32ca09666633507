"""Quantizer tests (docs/algorithm.md#stochastic-rounding): nearest rounding, stochastic rounding,
the counter-based hash."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernels_inputs import make_codebook
from kernels_oracle import (
    boundary_distance,
    nearest64,
    splitmix_uniform,
    stochastic64,
    toward_zero64,
)

from gefen_kernels import _numerics
from gefen_kernels.ops.quantize import (
    quantize_nearest,
    quantize_nearest_reference,
    quantize_nearest_triton,
    quantize_stochastic,
    quantize_stochastic_reference,
    quantize_stochastic_triton,
    sr_uniform_reference,
)

# Codes of the fp32 search must equal the float64 ones except where the float64 value lies
# within this distance of a decision boundary (a midpoint of adjacent codewords): there the
# fp32 rounding of x or of |x - c| may legitimately pick the other neighbour.
BOUNDARY_MARGIN = 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("numel", [0, 1, 4097, 65521])
def test_nearest_matches_float64(dtype: torch.dtype, numel: int) -> None:
    cb = make_codebook(1)
    x = (torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 0.4).to(dtype)
    q = quantize_nearest_reference(x, cb)
    assert q.dtype == torch.uint8 and q.shape == x.shape
    z = x.double().numpy()
    expect = nearest64(z.astype(np.float32).astype(np.float64), cb.double().numpy())
    near = boundary_distance(z, cb.double().numpy()) <= BOUNDARY_MARGIN
    assert np.array_equal(q.numpy()[~near], expect[~near])
    if near.any():  # near a boundary: one of the two neighbours
        assert np.all(np.abs(q.numpy()[near].astype(int) - expect[near]) <= 1)


def test_nearest_keeps_shape_and_any_layout() -> None:
    cb = make_codebook(2)
    x = torch.randn(3, 5, 7) * 0.3
    q = quantize_nearest_reference(x.transpose(0, 2), cb)
    assert q.shape == (7, 5, 3)
    assert torch.equal(q, quantize_nearest_reference(x, cb).transpose(0, 2))


def test_ties_go_to_the_lower_index() -> None:
    # Codewords on a dyadic grid make the midpoints exact in fp32.
    inner = torch.arange(1, 255, dtype=torch.float64) / 128.0 - 1.0
    cb = torch.cat([torch.tensor([-1.0]), inner, torch.tensor([1.0])]).float()
    cb = torch.sort(cb).values
    mids = (cb[1:] + cb[:-1]) / 2
    exact = (mids.double() == (cb[1:].double() + cb[:-1].double()) / 2)
    q = quantize_nearest_reference(mids[exact], cb)
    lower = torch.arange(255)[exact]
    assert torch.equal(q.long(), lower)


def test_out_of_range_and_endpoints() -> None:
    cb = make_codebook(3)
    x = torch.tensor([-5.0, -1.0000001, -1.0, 1.0, 1.0000001, 7.0, 3e38, float("inf"),
                      -float("inf"), float("nan")])
    q = quantize_nearest_reference(x, cb).tolist()
    assert q == [0, 0, 0, 255, 255, 255, 255, 255, 0, 0]


def test_exact_codewords_round_trip() -> None:
    cb = make_codebook(4)
    assert torch.equal(quantize_nearest_reference(cb, cb).long(), torch.arange(256))


def test_duplicate_codewords_pick_the_first() -> None:
    cb = make_codebook(5, duplicates=True)
    values, counts = torch.unique_consecutive(cb, return_counts=True)
    dup = values[counts > 1]
    assert dup.numel() == 1
    first = int(torch.nonzero(cb == dup).min())
    q = quantize_nearest_reference(dup.repeat(5), cb)
    assert torch.all(q == first)
    assert torch.all(quantize_stochastic_reference(dup.repeat(5), cb, 1) == first)


def test_hash_matches_exact_integer_arithmetic() -> None:
    seeds = [0, 1, -1, 2**63 - 1, -(2**63), 123456789123456789, -987654321987]
    idx = torch.tensor([0, 1, 2, 3, 1000, 2**31, 2**40 + 7, 2**62, -2, -1], dtype=torch.int64)
    for seed in seeds:
        got = sr_uniform_reference(seed, idx)
        want = [splitmix_uniform(seed & ((1 << 64) - 1), int(i) & ((1 << 64) - 1))
                for i in idx.tolist()]
        assert got.dtype == torch.float32
        assert got.tolist() == want, seed


def test_hash_is_uniform_in_unit_interval() -> None:
    u = sr_uniform_reference(42, torch.arange(200_000))
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert torch.all(u * 2**24 == torch.round(u * 2**24))  # 24-bit lattice, exact in fp32
    assert abs(float(u.mean()) - 0.5) < 0.005
    hist = torch.histc(u, bins=16, min=0, max=1)
    assert float(hist.min()) > 0.9 * 200_000 / 16


def test_stochastic_matches_float64_rule() -> None:
    cb = make_codebook(6)
    x = torch.randn(65536, generator=torch.Generator().manual_seed(6)) * 0.5
    seed, offset = -1234567890123, 77
    q = quantize_stochastic_reference(x, cb, seed, offset)
    u = np.array([splitmix_uniform(seed & ((1 << 64) - 1), offset + i) for i in range(x.numel())])
    expect, p_up = stochastic64(x.double().numpy(), cb.double().numpy(), u)
    # fp32 p_up differs from the float64 one by a few ulps: exempt draws that close to it.
    near = np.abs(u - p_up) <= 1e-6
    assert np.array_equal(q.numpy()[~near], expect[~near])
    assert near.sum() < 20


def test_stochastic_seed_determinism_and_offset() -> None:
    cb = make_codebook(7)
    x = torch.rand(5000, generator=torch.Generator().manual_seed(7)) * 2 - 1
    a = quantize_stochastic_reference(x, cb, 99)
    assert torch.equal(a, quantize_stochastic_reference(x, cb, 99))
    assert not torch.equal(a, quantize_stochastic_reference(x, cb, 100))
    assert torch.equal(quantize_stochastic_reference(x[123:], cb, 99, offset=123), a[123:])


def test_stochastic_stays_in_the_bracket() -> None:
    cb = make_codebook(8)
    x = torch.rand(20000, generator=torch.Generator().manual_seed(8)) * 2.4 - 1.2
    q = quantize_stochastic_reference(x, cb, 5).long()
    j = torch.searchsorted(cb, x).clamp(0, 255)
    assert torch.all((q == j) | (q == (j - 1).clamp(min=0)))
    assert torch.all(q[x < -1] == 0) and torch.all(q[x > 1] == 255)
    assert torch.equal(quantize_stochastic_reference(cb, cb, 3).long(), torch.arange(256))


def test_stochastic_rounding_is_unbiased_over_seeds() -> None:
    cb = make_codebook(9)
    gen = torch.Generator().manual_seed(9)
    x = torch.rand(64, generator=gen) * 1.8 - 0.9
    seeds = 4000
    total = torch.zeros(64, dtype=torch.float64)
    for s in range(seeds):
        total += cb[quantize_stochastic_reference(x, cb, s * 7919 + 1).long()].double()
    mean = total / seeds
    j = torch.searchsorted(cb, x).clamp(1, 255)
    width = (cb[j] - cb[j - 1]).double()
    # Bernoulli mean over `seeds` draws: std <= width / (2 sqrt(seeds)); 5 sigma bound.
    assert torch.all((mean - x.double()).abs() <= 5 * width / (2 * seeds**0.5) + 1e-7)


def test_large_input_is_chunked(monkeypatch: pytest.MonkeyPatch) -> None:
    cb = make_codebook(10)
    x = torch.randn(10_001) * 0.3
    whole_n = quantize_nearest_reference(x, cb)
    whole_s = quantize_stochastic_reference(x, cb, 17, 3)
    monkeypatch.setattr(_numerics, "CHUNK_ELEMENTS", 1000)
    assert torch.equal(quantize_nearest_reference(x, cb), whole_n)
    assert torch.equal(quantize_stochastic_reference(x, cb, 17, 3), whole_s)


def test_bad_arguments_raise() -> None:
    cb = make_codebook(0)
    with pytest.raises(ValueError, match="codebook"):
        quantize_nearest_reference(torch.zeros(3), cb[:10])
    with pytest.raises(ValueError, match="codebook"):
        quantize_nearest_reference(torch.zeros(3), cb.double())
    with pytest.raises(TypeError, match="x must be a floating-point"):
        quantize_nearest_reference(torch.zeros(3, dtype=torch.int32), cb)
    with pytest.raises(ValueError, match="seed"):
        quantize_stochastic_reference(torch.zeros(3), cb, 2**63)
    with pytest.raises(TypeError, match="index"):
        sr_uniform_reference(0, torch.zeros(3))


# --------------------------------------------------------------------------------------------
# Triton kernel vs reference (interpreter on CPU, natively on CUDA). Identical fp32 operations
# in the same order: codes must be equal everywhere, no exemption.
# --------------------------------------------------------------------------------------------


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _special_values(x: torch.Tensor, cb: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    n = x.numel()
    specials = torch.cat([cb[:8], cb[-8:], (cb[1:9] + cb[:8]) / 2,
                          torch.tensor([float("nan"), float("inf"), -float("inf"), 3.0, -3.0,
                                        0.0, -0.0, 1e-30])]).to(x.dtype)
    k = min(n, specials.numel())
    x[:k] = specials[:k].to(x.device)
    return x


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_toward_zero_rounding_matches_float64_and_never_grows(seed: int) -> None:
    """docs/algorithm.md#toward-zero-rounding against an independent float64 oracle, on
    codebooks with and without an exact 0 (make_codebook: seeds 0 and 1 hold one)."""
    from gefen_kernels.ops._quant_ref import toward_zero_codes

    cb = make_codebook(seed)
    gen = torch.Generator().manual_seed(seed)
    x = torch.cat([torch.randn(20_000, generator=gen) * 0.3, cb, torch.nextafter(cb, -cb - 1),
                   torch.nextafter(cb, cb + 1), (cb[1:] + cb[:-1]) / 2,
                   torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1.5, -1.5, float("nan")])])
    q = toward_zero_codes(x, cb)
    z = x.double().numpy()
    assert np.array_equal(q.numpy(), toward_zero64(z, cb.double().numpy()))
    c = cb[q]
    inside = (x.abs() <= 1) & ~torch.isnan(x)
    if bool((cb == 0).any()):
        # Never larger in magnitude, never across 0: |m| shrinks as the gradient stays 0.
        assert bool((c[inside].abs() <= x[inside].abs()).all())
        assert bool((c[inside] * x[inside] >= 0).all())
        # The largest such codeword: the next one up in magnitude exceeds |x|.
        nxt = torch.where(x > 0, cb[(q + 1).clamp(max=255)], cb[(q - 1).clamp(min=0)])
        grow = inside & (c != x) & (x != 0) & (nxt.abs() > c.abs())
        assert bool((nxt[grow].abs() > x[grow].abs()).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("numel", [1, 4097, 65521])
def test_triton_matches_reference(dtype: torch.dtype, numel: int) -> None:
    dev = _device()
    cb = make_codebook(numel).to(dev)
    gen = torch.Generator().manual_seed(numel)
    x = _special_values((torch.randn(numel, generator=gen) * 0.4).to(dtype), cb.cpu()).to(dev)
    assert torch.equal(quantize_nearest_triton(x, cb), quantize_nearest_reference(x, cb))
    for seed, offset in [(0, 0), (-(2**63), 5), (2**63 - 1, 2**40)]:
        assert torch.equal(quantize_stochastic_triton(x, cb, seed, offset),
                           quantize_stochastic_reference(x, cb, seed, offset))


def test_triton_duplicates_and_shapes() -> None:
    dev = _device()
    cb = make_codebook(3, duplicates=True).to(dev)
    x = (torch.randn(3, 5, 7) * 0.5).to(dev)
    x.view(-1)[:256] = cb.repeat(2)[:105]
    assert torch.equal(quantize_nearest_triton(x, cb), quantize_nearest_reference(x, cb))
    assert quantize_nearest_triton(x, cb).shape == (3, 5, 7)
    assert quantize_nearest_triton(torch.empty(0, device=dev), cb).shape == (0,)


def test_public_op_dispatch_and_compile() -> None:
    cb = make_codebook(4)
    x = torch.randn(1000) * 0.5
    assert torch.equal(quantize_nearest(x, cb), quantize_nearest_reference(x, cb))
    assert torch.equal(quantize_stochastic(x, cb, 9, 2),
                       quantize_stochastic_reference(x, cb, 9, 2))
    assert torch.ops.gefen.quantize_nearest.default is not None
    checks = ("test_schema", "test_faketensor")
    torch.library.opcheck(torch.ops.gefen.quantize_nearest.default, (x, cb), test_utils=checks)
    torch.library.opcheck(torch.ops.gefen.quantize_stochastic.default, (x, cb, 5, 0),
                          test_utils=checks)


@pytest.mark.gpu
def test_triton_matches_reference_large_gpu() -> None:
    cb = make_codebook(5).cuda()
    x = torch.randn(1 << 26, device="cuda", dtype=torch.bfloat16) * 0.5
    assert torch.equal(quantize_nearest(x, cb), quantize_nearest_reference(x, cb))
    assert torch.equal(quantize_stochastic(x, cb, 77, 3),
                       quantize_stochastic_reference(x, cb, 77, 3))


@pytest.mark.gpu
def test_compile_fullgraph_gpu() -> None:
    cb = make_codebook(6).cuda()
    x = torch.randn(4097, device="cuda") * 0.5

    @torch.compile(fullgraph=True)
    def both(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_nearest(t * 1.0, cb), quantize_stochastic(t, cb, 11, 0)

    near, stoch = both(x)
    assert torch.equal(near, quantize_nearest_reference(x, cb))
    assert torch.equal(stoch, quantize_stochastic_reference(x, cb, 11, 0))


# --------------------------------------------------------------------------------------------
# The docs/algorithm.md#quantizer search table narrows the kernels' search; it must never change a
# code.
# --------------------------------------------------------------------------------------------


def _learned_like_codebook() -> torch.Tensor:
    """Codewords at distinct histogram-bin centres, as the exact quantizer produces."""
    centres = (torch.arange(4096, dtype=torch.float64) + 0.5) / 2048 - 1
    pick = torch.unique(torch.round(torch.linspace(1, 4094, 254) ** 1.0).long())
    cb = torch.cat([torch.tensor([-1.0, 1.0], dtype=torch.float64), centres[pick]])
    return torch.sort(cb.float()).values


@pytest.mark.parametrize("which", ["dense", "learned", "duplicates"])
def test_search_table_brackets_the_lower_bound(which: str) -> None:
    from gefen_kernels.ops._search_table import build_search_table

    cb = {"dense": make_codebook(12, direct=False), "learned": _learned_like_codebook(),
          "duplicates": make_codebook(13, duplicates=True)}[which]
    assert cb.numel() == 256
    table, steps = build_search_table(cb)
    assert table.dtype == torch.int32 and table.shape == (4097,)
    assert table[0] == 0 and table[-1] == 256
    x = torch.cat([torch.rand(50_000) * 2.2 - 1.1, cb, (cb[1:] + cb[:-1]) / 2])
    lb = torch.searchsorted(cb, x).long()
    b = torch.floor((x + 1.0) * 2048.0).clamp(0, 4095).long()
    assert torch.all(table[b].long() <= lb) and torch.all(lb <= table[b + 1].long())
    widest = int((table[1:] - table[:-1]).max())
    assert steps == max(1, widest.bit_length())
    if which == "learned":
        assert steps <= 2


@pytest.mark.parametrize("which", ["dense", "learned", "duplicates"])
def test_triton_table_and_full_search_agree(which: str) -> None:
    from gefen_kernels.ops.quantize import _launch_quantize

    dev = _device()
    cb = {"dense": make_codebook(14, direct=False), "learned": _learned_like_codebook(),
          "duplicates": make_codebook(15, duplicates=True)}[which].to(dev)
    x = _special_values(torch.rand(20_000) * 2.2 - 1.1, cb.cpu()).to(dev)
    x[-256:] = cb
    for stochastic in (False, True):
        with_table = _launch_quantize(x, cb, 3, 0, stochastic, use_table=True)
        full = _launch_quantize(x, cb, 3, 0, stochastic, use_table=False)
        assert torch.equal(with_table, full)
    assert torch.equal(with_table, quantize_stochastic_reference(x, cb, 3, 0))
    # Toward-zero rounding (zero-gradient elements) from the bracket, in both modes.
    from gefen_kernels.ops._quant_ref import toward_zero_codes

    want = toward_zero_codes(x.cpu(), cb.cpu())
    for stochastic in (False, True):
        for use_table in (True, False):
            got = _launch_quantize(x, cb, 3, 0, stochastic, use_table=use_table,
                                   toward_zero=True)
            assert torch.equal(got.cpu().long(), want), (stochastic, use_table)


def test_search_table_cache_follows_the_codebook() -> None:
    from gefen_kernels.ops._search_table import build_search_table, search_table

    cb = make_codebook(16)
    first, steps = search_table(cb)
    assert search_table(cb)[0] is first  # cached
    cb.copy_(_learned_like_codebook())  # in place: version counter moves
    table, steps2 = search_table(cb)
    assert table is not first
    assert torch.equal(table, build_search_table(cb)[0]) and steps2 == build_search_table(cb)[1]


# --------------------------------------------------------------------------------------------
# The decision table replaces the nearest search when every bucket holds at most one jump.
# --------------------------------------------------------------------------------------------


def _learned_zero_codebook() -> torch.Tensor:
    """:func:`_learned_like_codebook` with the zero codeword: the centre nearest 0 replaced by
    0, so bucket 2048 holds 0 and the centre of bin 2048 (docs/algorithm.md#zero-codeword)."""
    cb = _learned_like_codebook().clone()
    cb[int(torch.argmin(cb.abs()))] = 0.0
    cb = torch.sort(cb).values
    centre = torch.tensor(1 / 4096, dtype=torch.float32)
    if not bool((cb == centre).any()):
        cb[int(torch.searchsorted(cb, centre))] = centre
    return torch.sort(cb).values


def _decision_codebooks() -> dict[str, torch.Tensor]:
    return {"learned": _learned_like_codebook(), "learned_zero": _learned_zero_codebook(),
            "make_codebook": make_codebook(0), "make_codebook_no_zero": make_codebook(2),
            "duplicates": make_codebook(2, duplicates=True),
            "uniform": torch.linspace(-1.0, 1.0, 256)}


def _decode(table: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's lookup, written out in torch from the documented layout (one rounding's
    head and pair words)."""
    b = torch.floor((x + 1.0) * 2048.0).nan_to_num(nan=0.0).clamp(0, 4095).long()
    head, pair = table[b], table[4096 + b]

    def low_float(w: torch.Tensor) -> torch.Tensor:
        lo = w & 0xFFFFFFFF
        return torch.where(lo >= 2**31, lo - 2**32, lo).to(torch.int32).view(torch.float32)

    up = x > low_float(head)
    q = torch.where(up, (head >> 40) & 255, (head >> 32) & 255)
    return q, torch.where(up, low_float(pair >> 32), low_float(pair))


def _hard_values(table: torch.Tensor, cb: torch.Tensor) -> torch.Tensor:
    """Every bucket's first and last fp32 value, every threshold and codeword with their fp32
    neighbours, the specials, and random values."""
    from gefen_kernels.ops._decision_table import _from_key, bucket_key_ranges

    lo, hi = bucket_key_ranges()
    head = table[:4096].cpu()
    lo32 = head & 0xFFFFFFFF
    thresholds = torch.where(lo32 >= 2**31, lo32 - 2**32, lo32).to(torch.int32).view(
        torch.float32)
    thresholds = thresholds[torch.isfinite(thresholds)]
    up, down = torch.tensor(float("inf")), torch.tensor(-float("inf"))
    near = torch.cat([thresholds, cb])
    gen = torch.Generator().manual_seed(0)
    return torch.cat([
        _from_key(lo), _from_key(hi), near, torch.nextafter(near, up),
        torch.nextafter(near, down), torch.randn(8192, generator=gen) * 0.2,
        torch.tensor([0.0, -0.0, 1.0, -1.0, 1.5, -1.5, 3e38, -3e38, float("inf"),
                      -float("inf"), float("nan"), 1e-45, -1e-45]),
    ])


def _decode_staged(table: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The staged lookup of one decision table followed by its own staged section."""
    b = torch.floor((x + 1.0) * 2048.0).nan_to_num(nan=0.0).clamp(0, 4095).long()
    q_lo = table[2 * 4096:2 * 4096 + 512].contiguous().view(torch.uint8).long()[b]
    thresholds = table[2 * 4096 + 512:].contiguous().view(torch.float32)
    return q_lo + (x > thresholds[q_lo]).long()


def _decode_kernel_staged(table: torch.Tensor, x: torch.Tensor, toward_zero: bool) -> torch.Tensor:
    """The kernels' staged lookup on their table (both roundings), from the documented layout:
    the toward-zero rounding reads bucket 4096 + b and threshold 256 + q_lo."""
    b = torch.floor((x + 1.0) * 2048.0).nan_to_num(nan=0.0).clamp(0, 4095).long()
    codes = table[4 * 4096:4 * 4096 + 1024].contiguous().view(torch.uint8).long()
    thresholds = table[4 * 4096 + 1024:].contiguous().view(torch.float32)
    q_lo = codes[b + 4096 * toward_zero]
    return q_lo + (x > thresholds[q_lo + 256 * toward_zero]).long()


@pytest.mark.parametrize("which", list(_decision_codebooks()))
def test_decision_table_matches_the_reference(which: str) -> None:
    from gefen_kernels.ops._decision_table import DIRECT_STEPS, STAGED_STEPS, kernel_table
    from gefen_kernels.ops._quant_ref import toward_zero_codes
    from gefen_kernels.ops.quantize import _launch_quantize

    dev = _device()
    cb = _decision_codebooks()[which].to(dev)
    table, steps = kernel_table(cb)
    # A repeated codeword makes a jump skip a code: no staged section (the head words stay).
    staged = which != "duplicates"
    assert steps == (STAGED_STEPS if staged else DIRECT_STEPS)
    # Nearest then toward-zero decision tables, then both staged sections.
    assert table.shape == (4 * 4096 + 1280 * staged,) and table.dtype == torch.int64
    x = _hard_values(table, cb.cpu())
    for toward_zero in (False, True):
        want = (toward_zero_codes(x, cb.cpu()) if toward_zero
                else quantize_nearest_reference(x, cb.cpu()).long())
        q, codeword = _decode(table.cpu()[8192 * toward_zero:], x)
        assert torch.equal(q, want), toward_zero
        assert torch.equal(codeword.view(torch.int32), cb.cpu()[want].view(torch.int32))
        if staged:
            assert torch.equal(_decode_kernel_staged(table.cpu(), x, toward_zero), want)
        got = _launch_quantize(x.to(dev), cb, 0, 0, False, toward_zero=toward_zero)
        assert torch.equal(got.cpu().long(), want), toward_zero
    # Stochastic rounding still gets the bracket table.
    assert kernel_table(cb, stochastic=True)[1] >= 1


def test_staged_lookup_reads_only_its_section() -> None:
    """Where the kernels gather from shared memory (Triton >= 3.6) they read the staged
    section and not the head words; elsewhere the head words and not the staged section.
    Overwriting the part that must not be read with garbage leaves every code unchanged."""
    from gefen_kernels._triton import gather_supported
    from gefen_kernels.ops import _decision_table
    from gefen_kernels.ops._decision_table import STAGED_STEPS
    from gefen_kernels.ops._quant_ref import toward_zero_codes
    from gefen_kernels.ops.quantize import _launch_quantize

    dev = _device()
    cb = _learned_zero_codebook().to(dev)
    table = _decision_table.kernel_table(cb)[0].clone()
    x = _hard_values(table, cb.cpu())
    want = quantize_nearest_reference(x, cb.cpu()).long()
    garbage = torch.randint(-2**62, 2**62, (table.numel(),), generator=torch.Generator()
                            .manual_seed(3)).to(dev)
    unread = slice(0, 4 * 4096) if gather_supported() else slice(4 * 4096, None)
    table[unread] = garbage[unread]
    # The launcher takes its table from the cache: put the damaged one there.
    _decision_table._NEAREST_CACHE[cb] = (cb._version, table, STAGED_STEPS)
    try:
        got = _launch_quantize(x.to(dev), cb, 0, 0, False)
        got_toward = _launch_quantize(x.to(dev), cb, 0, 0, False, toward_zero=True)
    finally:
        del _decision_table._NEAREST_CACHE[cb]
    assert torch.equal(got.cpu().long(), want)
    assert torch.equal(got_toward.cpu().long(), toward_zero_codes(x, cb.cpu()))


def test_staged_section_keeps_a_pair_and_refuses_a_jump_over_a_code() -> None:
    from gefen_kernels.ops._decision_table import build_decision_table, staged_section

    cb = _learned_like_codebook()
    assert staged_section(build_decision_table(cb, device="cpu")) is not None
    # Two equal codewords keep the section: the jump from 119 to 120 lies at the codeword.
    pair = cb.clone()
    pair[120] = pair[119]
    table = build_decision_table(pair, device="cpu")
    assert table is not None
    staged = staged_section(table)
    assert staged is not None
    full = torch.cat([table, staged])
    x = _hard_values(full, pair)
    assert torch.equal(_decode_staged(full, x), quantize_nearest_reference(x, pair).long())
    # Three equal codewords: just above them the lower bound is 122 and its left neighbour
    # 121 wins, so code 120 is never nearest and one bucket jumps from 119 to 121.
    cb[120:122] = cb[119]
    table = build_decision_table(cb, device="cpu")
    assert table is not None and staged_section(table) is None


@pytest.mark.parametrize("which", list(_decision_codebooks()))
def test_decision_table_search_near_the_midpoint_equals_the_whole_bucket(monkeypatch,
                                                                         which: str) -> None:
    """The build looks for each bucket's jump near its codewords' midpoint first: the table
    must equal the one from bisecting every whole bucket, both where the window holds the jump
    and where it misses (a window of 0 keys misses most jumps and falls back)."""
    from gefen_kernels.ops import _decision_table

    cb = _decision_codebooks()[which]
    tables = []
    for window in (2**40, _decision_table._WINDOW, 0):
        monkeypatch.setattr(_decision_table, "_WINDOW", window)
        tables.append(_decision_table.build_decision_table(cb))
    assert tables[0] is not None
    assert torch.equal(tables[1], tables[0]) and torch.equal(tables[2], tables[0])


def test_decision_table_refuses_two_jumps_in_one_bucket() -> None:
    from gefen_kernels.ops._decision_table import build_decision_table, kernel_table

    crowded = torch.cat([torch.tensor([-1.0]), torch.linspace(-1e-3, 1e-3, 254),
                         torch.tensor([1.0])])
    assert build_decision_table(crowded) is None
    assert kernel_table(crowded)[1] >= 1  # the bracket search instead
    # Three codewords within 1.2 buckets: both midpoints fall into bucket 2048 = [0, 1/2048).
    close = torch.linspace(-1.0, 1.0, 256)
    close[127:130] = torch.tensor([0.05, 0.65, 1.25]) / 2048
    assert build_decision_table(close) is None


def test_bucket_key_ranges_partition_the_floats() -> None:
    from gefen_kernels.ops._decision_table import _bucket, _from_key, bucket_key_ranges

    lo, hi = bucket_key_ranges()
    buckets = torch.arange(4096)
    assert torch.equal(_bucket(_from_key(lo)), buckets)
    assert torch.equal(_bucket(_from_key(hi)), buckets)
    assert torch.equal(lo[1:], hi[:-1] + 1)  # no fp32 value between two buckets
    assert _from_key(lo[:1]).item() == -float("inf") and _from_key(hi[-1:]).item() == float("inf")
    # The key order is the float order.
    x = torch.sort(torch.randn(10_000) * 10).values
    from gefen_kernels.ops._decision_table import _to_key
    keys = _to_key(x)
    assert torch.all(keys[1:] >= keys[:-1])
    assert torch.equal(_from_key(keys).view(torch.int32), x.view(torch.int32))


def test_make_codebook_covers_both_nearest_paths() -> None:
    from gefen_kernels.ops._decision_table import DIRECT_STEPS, STAGED_STEPS, kernel_table

    for seed in range(6):
        steps = kernel_table(make_codebook(seed))[1]
        assert (steps in (DIRECT_STEPS, STAGED_STEPS)) == (seed % 2 == 0), (seed, steps)
