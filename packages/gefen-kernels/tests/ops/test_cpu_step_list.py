"""The native CPU step of a whole list (gefen_kernels.ops._cpu_step.step_list_cpu, the CPU route of
op_step) against the PyTorch references, bit for bit, and its peak memory.

As in test_cpu_step.py, the factored comparisons run the reference with a correctly rounded
square root (the canonical rounding); block mode is compared with the reference as it is.
"""

from __future__ import annotations

import sys

import pytest
import torch
from kernels_inputs import make_codebook, with_zero_gradients

from gefen_kernels import op_step, reference_step
from gefen_kernels.ops import (
    _cpu_native,
    block_step_reference,
    factored_step_reference,
    muon_momentum_reference,
)
from gefen_kernels.ops import _cpu_step as cpu
from gefen_kernels.ops.step_scalars import step_scalars

pytestmark = pytest.mark.skipif(not cpu.native_available(),
                                reason=f"native CPU step unavailable: {_cpu_native.status()}")

_TORCH_SQRT = torch.sqrt
_HYPER = dict(beta1=0.9, beta2=0.999, eps=1e-8)


def _ieee_sqrt(x: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.float32:
        return _TORCH_SQRT(x.double()).float()
    return _TORCH_SQRT(x)


@pytest.fixture
def ieee_sqrt(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "sqrt", _ieee_sqrt)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8) if t.dtype != torch.uint8 else t.reshape(-1)


# (rows, cols, period, param dtype, grad dtype, factored): short and long blocks (a block
# longer than the native pass keeps between its two passes), blocks across rows, every dtype.
_CASES = [
    (24, 40, 32, torch.float32, torch.float32, False),
    (24, 40, 48, torch.bfloat16, torch.float32, True),
    (16, 64, 128, torch.float16, torch.bfloat16, True),
    (4, 2500, 5000, torch.float32, torch.float16, True),
    (2, 6000, 6000, torch.bfloat16, torch.bfloat16, False),
    (30, 20, 8, torch.float16, torch.float16, False),
]


def _tensors(seed: int) -> list[dict[str, torch.Tensor | None]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for rows, cols, period, pdt, gdt, factored in _CASES:
        grad = with_zero_gradients(torch.randn(rows, cols, generator=gen), period, seed)
        grad[:, 1] = 0.0  # a column that never moves
        blocks = rows * cols // period
        out.append({
            "param": torch.randn(rows, cols, generator=gen).to(pdt), "grad": grad.to(gdt),
            "codes": torch.randint(0, 256, (blocks, period), generator=gen, dtype=torch.uint8),
            "scale": torch.rand(blocks, 1, generator=gen),
            "sq": None if factored else torch.rand(blocks, 1, generator=gen),
            "row": torch.rand(rows, generator=gen) if factored else None,
            "col": torch.rand(cols, generator=gen) if factored else None,
        })
    return out


def _clone(ts: list[dict[str, torch.Tensor | None]]) -> list[dict[str, torch.Tensor | None]]:
    return [{k: None if v is None else v.clone() for k, v in t.items()} for t in ts]


def _assert_equal(a: list[dict[str, torch.Tensor | None]],
                  b: list[dict[str, torch.Tensor | None]]) -> None:
    for i, (x, y) in enumerate(zip(a, b)):
        for key, value in x.items():
            if value is not None:
                other = y[key]
                assert other is not None
                assert torch.equal(_bits(value), _bits(other)), (i, key)


@pytest.mark.parametrize("stochastic,maximize,seed",
                         [(False, False, 0), (False, True, 1), (True, False, 2), (True, True, 3)])
def test_step_list_matches_the_references(ieee_sqrt: None, monkeypatch: pytest.MonkeyPatch,
                                          stochastic: bool, maximize: bool, seed: int) -> None:
    """Mixed modes and dtypes in one call, direct (even seed) and crowded (odd) codebooks, two
    threads, against each tensor's reference op."""
    monkeypatch.setattr(cpu, "PARALLEL_MIN_ELEMENTS", 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    cb = make_codebook(seed)
    ts = _tensors(seed)
    seeds = [-(2**63) + 7 * i + seed for i in range(len(ts))]
    scalars = [step_scalars(3.0 + i, 2.0 + i, lr=1e-2, beta1=0.9, beta2=0.999,
                            weight_decay=0.1, factored=t["sq"] is None).rounded()
               for i, t in enumerate(ts)]
    ref = _clone(ts)
    for t, sc, s in zip(ref, scalars, seeds):
        common = dict(lr=sc.lr, bc1_recip=sc.bc1_recip, decay=sc.decay, maximize=maximize,
                      stochastic_round=stochastic, seed=s, **_HYPER)
        if t["sq"] is not None:
            block_step_reference(t["param"], t["grad"], t["codes"], t["scale"], t["sq"], cb,
                                 bc2_rsqrt=sc.bc2, **common)
        else:
            factored_step_reference(t["param"], t["grad"], t["codes"], t["scale"], t["row"],
                                    t["col"], cb, bc2_recip=sc.bc2, **common)
    out = _clone(ts)
    rest = cpu.step_list_cpu(
        [t["param"] for t in out], [t["grad"] for t in out], [t["codes"] for t in out],
        [t["scale"] for t in out], [t["sq"] for t in out], [t["row"] for t in out],
        [t["col"] for t in out], scalars, codebook=cb, maximize=maximize,
        stochastic_round=stochastic, seeds=seeds, **_HYPER)
    assert rest == []
    _assert_equal(ref, out)


def test_op_step_list_with_other_tensors_matches_reference_step(ieee_sqrt: None) -> None:
    """op_step's CPU route: native tensors in one call; a non-contiguous parameter and an fp64
    one through the ops; the same bits as reference_step, counters included."""
    cb = make_codebook(5)
    ts = _tensors(5)
    transposed = torch.randn(40, 24).t()  # non-contiguous [24, 40]
    ts.append({**_clone(ts[:1])[0], "param": transposed})
    ts.append({k: None if v is None else (v.double() if k in ("param", "grad") else v.clone())
               for k, v in ts[0].items()})
    results = []
    for fn in (reference_step, op_step):
        run = _clone(ts)
        steps = [torch.tensor(4.0) for _ in run]
        sq_steps = [torch.tensor(3.0) for _ in run]
        fn([t["param"] for t in run], [t["grad"] for t in run], [t["codes"] for t in run],
           [t["scale"] for t in run], [t["sq"] for t in run], [t["row"] for t in run],
           [t["col"] for t in run], steps, sq_steps, codebook=cb, lr=1e-2, weight_decay=0.1,
           maximize=False, stochastic_round=True, seeds=list(range(len(run))),
           seed_tensors=None, capturable=False, **_HYPER)
        assert all(float(s) == 5.0 for s in steps) and all(float(s) == 4.0 for s in sq_steps)
        results.append(run)
    _assert_equal(*results)


def test_muon_long_blocks_match_reference() -> None:
    cb = make_codebook(3)
    gen = torch.Generator().manual_seed(3)
    grad = torch.randn(2, 5000, generator=gen).to(torch.bfloat16)
    codes = torch.randint(0, 256, (2, 5000), generator=gen, dtype=torch.uint8)
    scale = torch.rand(2, 1, generator=gen)
    kw = dict(beta=0.95, nesterov=True, maximize=False, stochastic_round=True, seed=11)
    ref_c, ref_s = codes.clone(), scale.clone()
    ref = muon_momentum_reference(grad, ref_c, ref_s, cb, **kw)
    out = cpu.muon_momentum_cpu(grad, codes, scale, cb, **kw)
    for a, b in ((ref, out), (ref_c, codes), (ref_s, scale)):
        assert torch.equal(_bits(a), _bits(b))


def _memory() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process, bytes."""
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0]) * 1024
    return values["VmRSS"], values["VmHWM"]


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux)
    except OSError:
        return False
    return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self (Linux)")
@pytest.mark.parametrize("factored", [False, True])
def test_peak_extra_memory_is_bounded(factored: bool) -> None:
    """Peak resident memory a CPU step adds (docs/algorithm.md#step: bounded temporaries): at
    most 64 MiB on a bf16 [6144, 4096] parameter, where one full-size fp32 temporary alone
    would take 96 MiB. Measured as the process's peak RSS (VmHWM, reset just before the step)
    over its RSS before it: every allocation counts, torch's and the native kernel's."""
    if not _reset_peak():
        pytest.skip("/proc/self/clear_refs is not writable")
    rows, cols, period = 6144, 4096, 4096
    blocks = rows * cols // period
    param = torch.randn(rows, cols, dtype=torch.bfloat16)
    grad = torch.randn(rows, cols, dtype=torch.bfloat16)
    codes = torch.randint(0, 256, (blocks, period), dtype=torch.uint8)
    scale = torch.rand(blocks, 1)
    sq = None if factored else torch.rand(blocks, 1)
    row, col = (torch.rand(rows), torch.rand(cols)) if factored else (None, None)
    sc = step_scalars(2.0, 2.0, lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.0,
                      factored=factored).rounded()
    cb = make_codebook(0)

    def step() -> None:
        cpu.step_list_cpu([param], [grad], [codes], [scale], [sq], [row], [col], [sc],
                          codebook=cb, maximize=False, stochastic_round=False, seeds=None,
                          **_HYPER)

    cpu._local.__dict__.pop("bufs", None)  # the thread's scratch buffers count too
    _reset_peak()
    before, _ = _memory()
    step()
    _, peak = _memory()
    extra_mib = (peak - before) / 2**20
    assert extra_mib <= 64, f"peak extra {extra_mib:.1f} MiB"
