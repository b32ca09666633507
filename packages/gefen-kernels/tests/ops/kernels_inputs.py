"""Shared test inputs: codebooks and step states."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import torch


def make_codebook(seed: int = 0, *, duplicates: bool = False,
                  direct: bool | None = None, zero: bool | None = None) -> torch.Tensor:
    """A sorted fp32 [256] codebook with c[0] = -1, c[255] = +1, dense near 0 like a learned one.

    ``zero`` (default: ``seed % 4 < 2``): the codeword nearest 0 is exactly 0, as in a codebook
    learned with the zero codeword (docs/algorithm.md#zero-codeword); otherwise no codeword is
    0, as in one saved before it. ``direct``
    (default: even ``seed``): the inner codewords are histogram bin centres at least two bins
    apart, as a learned codebook's are, so nearest rounding takes the kernels' decision table;
    otherwise they are unsnapped and crowd into shared buckets near 0, so it takes the bracket
    search (``test_make_codebook_covers_both_nearest_paths`` checks both).
    """
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(254, generator=gen, dtype=torch.float64) * 2 - 1
    inner = torch.sign(u) * u.abs() ** 2.5  # concentrate near zero
    inner = inner.clamp(-0.999, 0.999)
    inner[inner == 0] = 1e-4
    if direct if direct is not None else seed % 2 == 0:
        bins = np.sort(np.floor((inner.numpy() + 1.0) * 2048).astype(np.int64))
        # Bins 2 .. 4093, at least two apart: make bins - 2i non-decreasing within its range.
        step = 2 * np.arange(bins.size)
        slack = np.maximum.accumulate(np.clip(bins - step, 2, 4093 - step[-1]))
        bins = slack + step
        inner = torch.from_numpy((bins + 0.5) / 2048 - 1.0)
    if duplicates:
        inner[100:110] = inner[100]
    if zero if zero is not None else seed % 4 < 2:
        inner[int(torch.argmin(inner.abs()))] = 0.0
    cb = torch.cat([torch.tensor([-1.0, 1.0], dtype=torch.float64), inner]).float()
    return torch.sort(cb).values.contiguous()


def with_zero_gradients(grad: torch.Tensor, period: int, seed: int) -> torch.Tensor:
    """``grad`` (in place, returned) with exact zeros, which the steps round toward zero
    (docs/algorithm.md#toward-zero-rounding): about a quarter of the elements, a ``-0.0``, and
    the second block whole where there are at least three blocks."""
    flat = grad.view(-1)
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.rand(flat.numel(), generator=gen) < 0.25).to(flat.device)
    flat.masked_fill_(mask, 0.0)
    if flat.numel():
        flat[flat.numel() // 2] = -0.0
    if flat.numel() >= 3 * period:
        flat[period:2 * period] = 0.0
    return grad


def ulp(x: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Spacing of ``dtype`` at |x| (an upper bound on one rounding step's error times 2)."""
    x = np.abs(np.asarray(x, dtype=np.float64))
    mant = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10, torch.float64: 52}[dtype]
    tiny = {torch.float32: 2.0**-149, torch.bfloat16: 2.0**-133, torch.float16: 2.0**-24,
            torch.float64: 2.0**-1074}[dtype]
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(np.where(x > 0, x, 1.0)))
    return np.maximum(2.0 ** (e - mant), tiny)


def random_state(num_blocks: int, period: int, *, seed: int, fresh: bool = False,
                 device: str = "cpu") -> dict[str, torch.Tensor]:
    """Codes, scales and second moment of a parameter that has been stepped before."""
    gen = torch.Generator().manual_seed(seed)
    if fresh:
        codes = torch.zeros(num_blocks, period, dtype=torch.uint8)
        scale = torch.zeros(num_blocks, 1)
        v = torch.zeros(num_blocks, 1)
    else:
        codes = torch.randint(0, 256, (num_blocks, period), generator=gen, dtype=torch.uint8)
        scale = torch.rand(num_blocks, 1, generator=gen) * 0.1
        v = torch.rand(num_blocks, 1, generator=gen) * 1e-2
    return {"codes": codes.to(device), "scale": scale.to(device), "exp_avg_sq": v.to(device)}


def clone_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.items()}


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Equal bit patterns, except that any NaN equals any NaN: a NaN's payload is not part of
    the numerics contract (``gefen_kernels._numerics``; GPU arithmetic returns the canonical
    NaN ``0x7fffffff`` where a kernel's NaN constant is ``0x7fc00000``)."""
    assert a.dtype == b.dtype and a.shape == b.shape, what
    if a.is_floating_point():
        ai = a.contiguous().view(-1).view({2: torch.int16, 4: torch.int32, 8: torch.int64}[
            a.element_size()])
        bi = b.contiguous().view(-1).view(ai.dtype)
        a_nan, b_nan = torch.isnan(a.reshape(-1)), torch.isnan(b.reshape(-1))
        diff = int(((ai != bi) & ~(a_nan & b_nan)).sum())
    else:
        diff = int((a != b).sum())
    assert diff == 0, f"{what}: {diff} elements differ"


def assert_within_one_ulp(a: torch.Tensor, b: torch.Tensor, what: str,
                          before: torch.Tensor | None = None) -> None:
    """Parameters of the kernel vs the reference: both NaN, or at most one ulp apart.

    The only input that differs between the two is the fp32 sum of squares (summation order),
    which moves the second moment, hence sigma and the update u, by a few fp32 ulps. After
    rounding to the parameter dtype that is at most one ulp of the dtype at the larger of the
    old and new values (|u| <= |p_old| + |p_new|); fp32 parameters see the few ulps of u
    directly, so they get four ulps of the largest of the old value, the new value and the
    update (the update is the largest where the parameter crosses 0).
    """
    assert a.dtype == b.dtype, what
    an, bn = torch.isnan(a), torch.isnan(b)
    assert torch.equal(an, bn), f"{what}: NaN positions differ"
    a64, b64 = a[~an].double().cpu().numpy(), b[~bn].double().cpu().numpy()
    mag = np.maximum(np.abs(a64), np.abs(b64))
    if before is not None:
        old64 = before.reshape(a.shape)[~an].double().cpu().numpy()
        mag = np.maximum(mag, np.abs(old64))
        if a.dtype == torch.float32:
            mag = np.maximum(mag, np.abs(b64 - old64))
    tol = ulp(mag, a.dtype) * (4.0 if a.dtype == torch.float32 else 1.0)
    bad = np.abs(a64 - b64) > tol
    assert not bad.any(), f"{what}: {int(bad.sum())} elements beyond tolerance"


def count_launches(monkeypatch: Any, module: Any, names: tuple[str, ...]) -> Counter:
    """Replace each kernel ``module.<name>`` by a wrapper that counts its launches (the
    launchers index ``kernel[grid]`` through the module, so the wrapper sees every launch)
    and return the live counter, keyed by name."""
    counts: Counter = Counter()

    class Counting:
        def __init__(self, name: str, kernel: Any) -> None:
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid: Any) -> Any:
            counts[self.name] += 1
            return self.kernel[grid]

    for name in names:
        monkeypatch.setattr(module, name, Counting(name, getattr(module, name)))
    return counts
