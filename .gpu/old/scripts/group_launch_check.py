"""Grouped launches (``gefen_kernels.ops.step_groups``) against one plan launch per tensor on
CUDA: bits and device time (diagnostic).

    PYTHONPATH=<packages>/src:scripts python scripts/group_launch_check.py

For each case (a list of bf16 tensors, block or factored mode, periods aligned to 16 or not)
it steps identical copies three ways: per plan twice (A1, A2: run-to-run), grouped once (B),
and prints the number of differing elements of every parameter and state tensor for A1 vs A2
and A1 vs B, then the median CUDA-event time of one per-plan step and one grouped step, and
the registers of each compiled tile kernel.
"""

from __future__ import annotations

import pathlib
import sys

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "packages" / "gefen-kernels" / "tests" / "ops"))
sys.path.insert(0, str(HERE))

# (label, [(shape, period)], factored)
CASES = [
    ("block 8192x8192 P2048", [((8192 * 8192,), 2048)], False),
    ("factored 8192x8192 P2048", [((8192, 8192), 2048)], True),
    ("block 8192x8192 P1733", [((8192 * 8192 - 8192 * 8192 % 1733,), 1733)], False),
    ("factored 16x[2048,2048] P2048", [((2048, 2048), 2048)] * 16, True),
    ("block 16x[2048x2048] P1152", [((2048 * 2048 - 2048 * 2048 % 1152,), 1152)] * 16, False),
]


def _diff(a: torch.Tensor, b: torch.Tensor) -> int:
    if a.is_floating_point():
        width = {2: torch.int16, 4: torch.int32}[a.element_size()]
        return int((a.view(width) != b.view(width)).sum())
    return int((a != b).sum())


def check_case(label: str, specs: list, factored: bool, cb: torch.Tensor) -> None:  # type: ignore[type-arg]
    """Bits (A1 vs A2, A1 vs B) and per-plan against grouped time of one case."""
    from kernel_sweep import diagnostic_plan, median_event_ms

    from gefen_kernels._numerics import f32
    from gefen_kernels.ops.step_groups import StepGroups

    gen = torch.Generator(device="cuda").manual_seed(0)
    base = []
    for shape, period in specs:
        n = 1
        for d in shape:
            n *= d
        item = {
            "p": torch.randn(shape, device="cuda", generator=gen).to(torch.bfloat16),
            "g": torch.randn(shape, device="cuda", generator=gen).to(torch.bfloat16),
            "q": torch.randint(
                0, 256, (n // period, period), device="cuda", dtype=torch.uint8, generator=gen
            ),
            "s": torch.rand(n // period, 1, device="cuda", generator=gen) * 0.1,
            "v": None
            if factored
            else torch.rand(n // period, 1, device="cuda", generator=gen) * 1e-2,
            "r": torch.rand(shape[0], device="cuda", generator=gen) if factored else None,
            "k": torch.rand(shape[1], device="cuda", generator=gen) if factored else None,
        }
        base.append(item)

    def copy():  # type: ignore[no-untyped-def]
        return [{k: (v.clone() if v is not None else None) for k, v in it.items()} for it in base]

    def plans_of(items):  # type: ignore[no-untyped-def]
        return [
            diagnostic_plan(it["p"], it["q"], it["s"], it["v"], it["r"], it["k"], cb)
            for it in items
        ]

    t = 5
    bc2 = 1.0 / (1.0 - 0.999**t) if factored else (1.0 - 0.999**t) ** -0.5
    sc = (f32(1e-3), f32(1.0 / (1.0 - 0.9**t)), f32(bc2), f32(1.0 - 1e-5))

    def per_plan(plans, items):  # type: ignore[no-untyped-def]
        for plan, it in zip(plans, items):
            plan.launch(it["g"], lr=sc[0], bc1_recip=sc[1], bc2=sc[2], decay=sc[3], seed=0)

    a1, a2, b = copy(), copy(), copy()
    per_plan(plans_of(a1), a1)
    per_plan(plans_of(a2), a2)
    b_plans = plans_of(b)
    groups = StepGroups(b_plans, [it["g"] for it in b])
    groups.launch([it["g"] for it in b], [sc] * len(b), None)
    torch.cuda.synchronize()
    for name, other in (("A1 vs A2", a2), ("A1 vs B ", b)):
        counts = {
            k: sum(_diff(x[k], y[k]) for x, y in zip(a1, other))
            for k in ("p", "q", "s", "v", "r", "k")
            if a1[0][k] is not None
        }
        print(f"{label:32s} {name} differing elements: {counts}", flush=True)
    w = copy()
    w_plans = plans_of(w)
    ms_plan = median_event_ms(lambda: per_plan(w_plans, w), reps=20)
    w_groups = StepGroups(w_plans, [it["g"] for it in w])
    grads = [it["g"] for it in w]
    ms_group = median_event_ms(lambda: w_groups.launch(grads, [sc] * len(w), None), reps=20)
    print(f"{label:32s} per-plan {ms_plan:.3f} ms  grouped {ms_group:.3f} ms", flush=True)


def main() -> None:
    from kernels_inputs import make_codebook

    from gefen_kernels.ops import _group_kernels, _step_kernels

    cb = make_codebook(2).cuda()
    for label, specs, factored in CASES:
        check_case(label, specs, factored, cb)
    for kernel in (_step_kernels._step_tile_kernel, _group_kernels._group_tile_kernel):
        for cache in getattr(kernel, "device_caches", {}).values():
            for compiled in cache[0].values():
                meta = compiled.metadata
                print(
                    kernel.fn.__name__,
                    "regs",
                    getattr(compiled, "n_regs", None),
                    "spills",
                    getattr(compiled, "n_spills", None),
                    "warps",
                    meta.num_warps,
                    flush=True,
                )


if __name__ == "__main__":
    main()
