"""Launch-configuration sweep of the fused step kernels on one CUDA tensor (diagnostic).

    PYTHONPATH=<packages>/src python scripts/kernel_sweep.py > sweep.txt
    PYTHONPATH=<packages>/src python scripts/kernel_sweep.py --tile-max-period 8192 \
        --shapes 2048x8192                 # the tile route for 8192-element blocks

For Llama-shaped bf16 matrices (``[8192, 2048]``: tile route, one 2048-element block per
row; ``[2048, 8192]``: loop route) in block and factored mode, times one planned step
(:class:`gefen_kernels.ops.step_plan.StepPlan`, CUDA events, median of 50) for several
``num_warps`` / blocks-per-program / ``maxnreg`` settings (a register cap trades spills for
resident warps: ``tests/compile_check.py --resources`` in gefen-kernels prints each
configuration's registers and spills without a GPU), the factored statistics alone, and a
``copy_`` of the same bytes, and prints the effective bandwidth at 8 B/param. Results do not
depend on these settings (only speed does): the sweep is for choosing them.
"""

from __future__ import annotations

import argparse
import importlib

import torch

from gefen_kernels.ops.factored_step import factored_stats_triton, stats_layout
from gefen_kernels.ops.step_plan import StepPlan

step_kernels = importlib.import_module("gefen_kernels.ops._step_kernels")


def median_event_ms(fn, reps: int = 50, warmup: int = 5) -> float:  # type: ignore[no-untyped-def]
    """Median CUDA-event milliseconds of ``fn`` over ``reps`` calls after ``warmup`` calls
    (also used by ``kernel_ablation.py``)."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def diagnostic_plan(p, codes, scale, sq, row, col, codebook) -> StepPlan:  # type: ignore[no-untyped-def]
    """The step plan the diagnostics time: AdamW-default betas and eps, nearest rounding, no
    capture (also used by ``kernel_ablation.py``)."""
    return StepPlan(
        p,
        codes,
        scale,
        sq,
        row,
        col,
        codebook,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        maximize=False,
        stochastic_round=False,
        capturable=False,
    )


def _case(shape: tuple[int, int], factored: bool) -> None:
    rows, cols = shape
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    p = torch.randn(shape, device=dev, dtype=torch.bfloat16, generator=gen)
    g = torch.randn(shape, device=dev, dtype=torch.bfloat16, generator=gen)
    codes = torch.randint(0, 256, (rows, cols), device=dev, dtype=torch.uint8, generator=gen)
    scale = torch.rand(rows, 1, device=dev, generator=gen) + 0.5
    codebook = torch.linspace(-1.0, 1.0, 256, device=dev)
    sq = None if factored else torch.rand(rows, 1, device=dev, generator=gen)
    row = torch.rand(rows, device=dev, generator=gen) if factored else None
    col = torch.rand(cols, device=dev, generator=gen) if factored else None
    plan = diagnostic_plan(p, codes, scale, sq, row, col, codebook)
    n = p.numel()
    src = torch.empty(n * 4, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_ms = median_event_ms(lambda: dst.copy_(src))  # 4 B/param each way = 8 B/param moved
    mode = "factored" if factored else "block"
    print(f"\n{list(shape)} {mode}, route {plan.route}: copy of 8 B/param {copy_ms:.3f} ms")
    if factored:
        layout = stats_layout(rows, cols)
        ms = median_event_ms(lambda: factored_stats_triton(g, row, col, beta2=0.999, layout=layout))
        print(f"  statistics + finalize alone: {ms:.3f} ms ({2 * n / ms / 1e6:.0f} GB/s of grad)")
    base = dict(plan._consts)
    grid = plan._grid
    variants: list[tuple[int, int, int | None]] = [(w, 1, None) for w in (4, 8, 16)]
    if plan.route == "tile":
        variants += [(w, 2, None) for w in (4, 8, 16)]
    variants += [(base.get("num_warps", 4), 1, cap) for cap in (96, 80, 64)]
    for warps, bpp_mult, cap in variants:
        consts = dict(base, num_warps=warps)
        if cap is not None:
            consts["maxnreg"] = cap
        if plan.route == "tile":
            consts["BPP"] = base["BPP"] * bpp_mult
            plan._grid = (-(-rows // consts["BPP"]),)
        plan._consts = consts

        def step() -> None:
            plan.launch(g, lr=1e-4, bc1_recip=1.0, bc2=1.0, decay=1.0, seed=0)

        ms = median_event_ms(step)
        print(
            f"  num_warps={warps:2d} BPP={consts.get('BPP', '-')} maxnreg={cap or '-'}: "
            f"{ms:.3f} ms, "
            f"{8 * n / ms / 1e6:.0f} GB/s at 8 B/param ({copy_ms / ms:.0%} of copy)"
        )
    plan._consts, plan._grid = base, grid


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tile-max-period",
        type=int,
        help="route periods up to this to the tile kernel (default: the production bound)",
    )
    parser.add_argument("--shapes", default="8192x2048,2048x8192")
    args = parser.parse_args()
    if args.tile_max_period is not None:
        step_kernels.TILE_MAX_PERIOD = args.tile_max_period  # read by choose_route at call time
    for text in args.shapes.split(","):
        rows, cols = (int(x) for x in text.split("x"))
        for factored in (False, True):
            _case((rows, cols), factored)


if __name__ == "__main__":
    main()
