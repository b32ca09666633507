"""Row-sharded factored statistics (docs/algorithm.md#factored-second-moment):
``factored_partial_stats`` + ``stats=`` on the step.

* one shard, no reduction: the two-phase step equals the one-call step bit for bit (reference
  and Triton interpreter), and the partial stage mutates nothing;
* several row shards whose column sums and ``sum(r')`` are added: ``r``, ``k`` and the step
  agree with an independent float64 implementation of docs/algorithm.md#factored-second-moment on
  the global matrix, codes and scales equal the one-call step's, and every shard (an empty one
  included, through ``factored_finalize_stats``) holds the same ``k``;
* bad ``stats``/``global_rows`` are rejected before anything changes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernels_inputs import make_codebook
from kernels_oracle import factored_stats64

from gefen_kernels.ops.factored_step import (
    _partial_stats_triton,
    factored_finalize_stats,
    factored_partial_stats,
    factored_partial_stats_reference,
    factored_step,
    factored_step_reference,
    factored_step_triton,
)

# The Triton paths compile for CUDA when it is present, else run in the interpreter on CPU.
DEV = "cuda" if torch.cuda.is_available() else "cpu"
BETA2 = 0.999
HYPER = dict(lr=1e-3, beta1=0.9, beta2=BETA2, eps=1e-8, bc1_recip=1.0 / (1 - 0.9**3),
             bc2_recip=1.0 / (1 - BETA2**3), decay=1.0 - 1e-3 * 0.01)


def _inputs(rows: int, cols: int, period: int, seed: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    param = torch.randn(rows, cols, generator=gen).to(dtype)
    # Rows and columns of very different scale, so wrong (local) statistics cannot pass.
    scale = torch.logspace(-3, 0, rows).reshape(-1, 1) * torch.logspace(0, -2, cols)
    grad = (torch.randn(rows, cols, generator=gen) * scale).to(dtype)
    blocks = rows * cols // period
    state = {
        "codes": torch.randint(0, 256, (blocks, period), dtype=torch.uint8, generator=gen),
        "scale": torch.rand(blocks, 1, generator=gen) * 1e-2,
        "row": torch.rand(rows, generator=gen) * 1e-4,
        "col": torch.rand(cols, generator=gen) * 1e-4,
    }
    return param.to(DEV), grad.to(DEV), {k: v.to(DEV) for k, v in state.items()}


def _partial_triton(param, grad, row, col, *, beta2):
    return _partial_stats_triton(grad, row, beta2)


IMPLS = [
    pytest.param(factored_step_reference, factored_partial_stats_reference, id="reference"),
    pytest.param(factored_step_triton, _partial_triton, id="triton"),
]


@pytest.mark.parametrize("step,partial", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unreduced_two_phase_equals_one_call(step, partial, dtype) -> None:
    param, grad, st = _inputs(12, 40, 8, seed=1, dtype=dtype)
    cb = make_codebook(1).to(DEV)
    a = {k: v.clone() for k, v in st.items()}
    pa = param.clone()
    step(pa, grad, a["codes"], a["scale"], a["row"], a["col"], cb, **HYPER)
    b = {k: v.clone() for k, v in st.items()}
    pb = param.clone()
    stats = partial(pb, grad, b["row"], b["col"], beta2=BETA2)
    assert all(torch.equal(b[k], st[k]) for k in st), "the partial stage mutated state"
    step(pb, grad, b["codes"], b["scale"], b["row"], b["col"], cb, **HYPER, stats=stats,
         global_rows=12)
    assert torch.equal(pa, pb)
    for k in st:
        assert torch.equal(a[k], b[k]), k


def test_fp64_reference_two_phase() -> None:
    param, grad, st = _inputs(6, 10, 5, seed=2, dtype=torch.float64)
    cb = make_codebook(2).to(DEV)
    a = {k: v.clone() for k, v in st.items()}
    pa = param.clone()
    factored_step_reference(pa, grad, a["codes"], a["scale"], a["row"], a["col"], cb, **HYPER)
    b = {k: v.clone() for k, v in st.items()}
    pb = param.clone()
    stats = factored_partial_stats(pb, grad, b["row"], b["col"], beta2=BETA2)
    assert stats.dtype == torch.float64 and stats.shape == (6 + 10 + 1,)
    factored_step(pb, grad, b["codes"], b["scale"], b["row"], b["col"], cb, **HYPER, stats=stats,
                  global_rows=6)
    assert torch.equal(pa, pb) and all(torch.equal(a[k], b[k]) for k in st)


@pytest.mark.parametrize("step,partial", IMPLS)
@pytest.mark.parametrize("bounds", [(0, 5, 12), (0, 4, 8, 12, 12)])
def test_row_shards_match_global_float64(step, partial, bounds) -> None:
    rows, cols, period = 12, 40, 8
    param, grad, st = _inputs(rows, cols, period, seed=3)
    cb = make_codebook(3).to(DEV)
    full = {k: v.clone() for k, v in st.items()}
    p_full = param.clone()
    step(p_full, grad, full["codes"], full["scale"], full["row"], full["col"], cb, **HYPER)

    shards = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        shards.append({
            "lo": lo, "hi": hi, "param": param[lo:hi].clone(), "grad": grad[lo:hi].clone(),
            "codes": st["codes"].reshape(rows, cols)[lo:hi].reshape(-1, period).clone(),
            "scale": st["scale"][lo * cols // period:hi * cols // period].clone(),
            "row": st["row"][lo:hi].clone(), "col": st["col"].clone()})
    stats = [partial(s["param"], s["grad"], s["row"], s["col"], beta2=BETA2) for s in shards]
    total = sum(t[s["hi"] - s["lo"]:] for s, t in zip(shards, stats))
    for s, t in zip(shards, stats):
        n = s["hi"] - s["lo"]
        t = t.clone()
        t[n:] = total
        if n == 0:  # an empty shard keeps k in step with the others
            factored_finalize_stats(s["row"], s["col"], t, beta2=BETA2, global_rows=rows,
                                    reference=step is factored_step_reference)
        else:
            step(s["param"], s["grad"], s["codes"], s["scale"], s["row"], s["col"], cb,
                 **HYPER, stats=t, global_rows=rows)

    r_new, k_new, _ = factored_stats64(grad.double().cpu().numpy(),
                                       st["row"].double().cpu().numpy(),
                                       st["col"].double().cpu().numpy(),
                                       beta2=float(np.float32(BETA2)))
    r = torch.cat([s["row"] for s in shards])
    assert torch.equal(r, full["row"])  # whole rows are local: the same sums
    np.testing.assert_allclose(r.double().cpu().numpy(), r_new, rtol=1e-6)
    for s in shards:
        assert torch.equal(s["col"], shards[0]["col"])
        # fp32 column sums over 12 rows in another order: a few ulps of the fp64 value.
        np.testing.assert_allclose(s["col"].double().cpu().numpy(), k_new, rtol=2e-6)
    codes = torch.cat([s["codes"].reshape(-1) for s in shards])
    assert torch.equal(codes, full["codes"].reshape(-1))
    p = torch.cat([s["param"] for s in shards])
    torch.testing.assert_close(p, p_full, rtol=1e-6, atol=1e-9)


def test_bad_stats_rejected_before_mutation() -> None:
    param, grad, st = _inputs(4, 8, 4, seed=4)
    cb = make_codebook(4).to(DEV)
    before = {k: v.clone() for k, v in st.items()}
    p = param.clone()
    good = factored_partial_stats_reference(p, grad, st["row"], st["col"], beta2=BETA2)
    bad_calls = [
        dict(stats=good[:-1], global_rows=4),
        dict(stats=good, global_rows=None),
        dict(stats=good, global_rows=3),
        dict(stats=None, global_rows=4),
        dict(stats=good.double(), global_rows=4),
    ]
    for kw in bad_calls:
        with pytest.raises((TypeError, ValueError)):
            factored_step(p, grad, st["codes"], st["scale"], st["row"], st["col"], cb, **HYPER,
                          **kw)
    with pytest.raises(ValueError, match="exp_avg_sq_col"):
        factored_partial_stats(p, grad, st["row"], torch.zeros(9, device=DEV), beta2=BETA2)
    with pytest.raises(ValueError, match="global_rows"):
        factored_finalize_stats(torch.zeros(0, device=DEV), st["col"].clone(), good[4:].clone(),
                                beta2=BETA2, global_rows=0)
    assert torch.equal(p, param) and all(torch.equal(st[k], before[k]) for k in st)


def test_public_op_schema_with_stats() -> None:
    param, grad, st = _inputs(6, 10, 5, seed=5)
    cb = make_codebook(5).to(DEV)
    stats = factored_partial_stats(param, grad, st["row"], st["col"], beta2=BETA2)
    torch.library.opcheck(
        torch.ops.gefen.factored_step.default,
        (param.clone(), grad, st["codes"].clone(), st["scale"].clone(), st["row"].clone(),
         st["col"].clone(), cb, None, None, 1e-3, 0.9, BETA2, 1e-8, 2.0, 3.0, 1.0, False,
         False, 0, stats, 6), test_utils=("test_schema", "test_faketensor"))
