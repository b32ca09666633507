"""capturable=True steps in grouped launches
(``gefen_kernels.ops.fused_step._grouped_capturable``): the same bits as the per-tensor
capturable launches. Runs the planned path compiled on CUDA, or on the CPU under the Triton
interpreter; ``test_gefen_gpu.py`` checks it through the optimizer and a captured graph."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch

gefen_kernels = pytest.importorskip("gefen_kernels")
if not gefen_kernels.triton_available():
    pytest.skip("needs Triton", allow_module_level=True)
from gefen_kernels._triton import interpret_mode  # noqa: E402

fused = importlib.import_module("gefen_kernels.ops.fused_step")

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEV == "cpu" and not interpret_mode(),
    reason="without CUDA the planned path runs only in the interpreter (TRITON_INTERPRET=1)")

# (shape, period, param dtype, grad dtype, factored): both modes, three dtypes, a gradient
# dtype other than the parameter's.
CASES = [((24, 40), 20, torch.bfloat16, torch.bfloat16, True),
         ((210,), 7, torch.bfloat16, torch.bfloat16, False),
         ((32, 64), 64, torch.float32, torch.float32, True),
         ((96,), 32, torch.float16, torch.float32, False),
         ((16, 32), 32, torch.bfloat16, torch.float16, True)]


def _state(seed: int) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(seed)
    items = []
    for j, (shape, period, pdt, _, factored) in enumerate(CASES):
        n = torch.Size(shape).numel()
        it: dict[str, Any] = {
            "param": torch.randn(shape, generator=gen).to(pdt),
            "codes": torch.randint(0, 256, (n // period, period), generator=gen,
                                   dtype=torch.uint8),
            "scale": torch.rand(n // period, 1, generator=gen) * 1e-2,
            "step": torch.tensor(7.0 + j), "sq_step": torch.tensor(2.0 + j),
            "sq": None, "row": None, "col": None,
        }
        if factored:
            it["row"] = torch.rand(shape[0], generator=gen) * 1e-3
            it["col"] = torch.rand(shape[1], generator=gen) * 1e-3
        else:
            it["sq"] = torch.rand(n // period, 1, generator=gen) * 1e-3
        items.append({k: v.to(DEV) if isinstance(v, torch.Tensor) else v
                      for k, v in it.items()})
    return items


def _run(stochastic_round: bool, grouped: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[
        list[dict[str, Any]], list[bool]]:
    taken: list[bool] = []
    real = fused._grouped_capturable

    def spy(*args: Any, **kwargs: Any) -> bool:
        done = real(*args, **kwargs) if grouped else False
        taken.append(done)
        return done

    monkeypatch.setattr(fused, "_grouped_capturable", spy)
    items = _state(100)
    codebook = torch.linspace(-1.0, 1.0, 256, device=DEV).pow(3)
    for step in range(3):
        gen = torch.Generator().manual_seed(50 + step)
        grads = [torch.randn(it["param"].shape, generator=gen).to(DEV, case[3])
                 for it, case in zip(items, CASES)]
        t = torch.tensor(10 + step, dtype=torch.int64, device=DEV)
        seeds = [torch.bitwise_xor(t * 12345, 1000 + j).reshape(1) for j in range(len(items))]
        fused._planned(
            [i["param"] for i in items], grads, [i["codes"] for i in items],
            [i["scale"] for i in items], [i["sq"] for i in items], [i["row"] for i in items],
            [i["col"] for i in items], [i["step"] for i in items],
            [i["sq_step"] for i in items], codebook=codebook,
            lr=torch.tensor(1e-2, device=DEV),
            beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, maximize=False,
            stochastic_round=stochastic_round, seeds=None, seed_tensors=seeds,
            capturable=True)
    return items, taken


@pytest.mark.parametrize("stochastic_round", [False, True])
def test_grouped_capturable_launches_equal_per_tensor_launches(
        stochastic_round: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    grouped, taken = _run(stochastic_round, True, monkeypatch)
    assert taken == [True] * 3
    alone, taken = _run(stochastic_round, False, monkeypatch)
    assert taken == [False] * 3
    for j, (a, b) in enumerate(zip(grouped, alone)):
        for key, value in a.items():
            if value is not None:
                assert torch.equal(value, b[key]), (CASES[j], key)
    assert not torch.equal(grouped[0]["param"], _state(100)[0]["param"])  # it stepped


def test_one_tensor_takes_its_own_launch() -> None:
    it = _state(1)[2]
    assert not fused._grouped_capturable(
        [it["param"]], [torch.zeros_like(it["param"])], [it["codes"]], [it["scale"]],
        [it["sq"]], [it["row"]], [it["col"]], [it["step"]], [it["sq_step"]],
        [torch.zeros(1, dtype=torch.int64, device=DEV)], None,
        codebook=torch.linspace(-1, 1, 256, device=DEV),
        lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, maximize=False,
        stochastic_round=False)
