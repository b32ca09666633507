"""Where the first fused Gefen step's wall time goes, phase by phase (diagnostic, CUDA).

    PYTHONPATH=<packages>/src python scripts/first_step_phases.py --models gpt2,llama

The issue's first-step target (period search + codebook + first update, ≤ 100 ms) is a wall
time, mostly host time. For each model-shaped bf16 parameter set (``gefen_bench.param_sets``,
the ``gefen-bench step`` gradients) this steps ``--repeats`` fresh optimizers once over the
same gradients, after one that loads every kernel, then as many again, each after
``torch.cuda.empty_cache()`` (the allocator's ``cudaMalloc`` calls are paid again, as in a
fresh process). It prints the phases of one more: the finiteness check, the period search,
the histogram, the exact codebook solver, state creation, the first update (plans and
launches) and the steady-step cache. Each phase is timed from a
device synchronisation to the next, so a phase owns the device work it queued; the sum is a
little above the unsynchronised first step, printed beside it. ``--cprofile N`` then steps one
more fresh optimizer under ``cProfile`` and prints its N most expensive functions (own time);
``--callers REGEX`` adds who called the matching functions (the host's blocking reads);
``--kernels N`` steps one under ``torch.profiler`` and prints the N kernels with the most
device time (the device's share of each phase, which the synchronised phase times mix with
host time).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import pstats
import time
from collections import defaultdict
from typing import Any

import torch


def _timed(totals: dict[str, float], name: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            torch.cuda.synchronize()
            totals[name] += time.perf_counter() - t0

    return wrapper


def _phases(model: str, repeats: int, top: int, kernels: int, callers: str) -> None:
    import gefen_core.codebook as codebook
    import gefen_core.optimizer as optimizer
    import gefen_kernels.ops as ops
    from gefen_bench.param_sets import build_param_set, shapes_for
    from gefen_core import Gefen

    dev = torch.device("cuda")
    named = build_param_set(shapes_for(model, "full"), device=dev, dtype=torch.bfloat16)

    def first_step_ms(empty_cache: bool) -> float:
        opt = Gefen(named, lr=1e-4, weight_decay=0.0)
        torch.cuda.synchronize()
        if empty_cache:
            torch.cuda.empty_cache()
        t0 = time.perf_counter()
        opt.step()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3

    plain = [first_step_ms(False) for _ in range(repeats + 1)]
    # The same with the caching allocator emptied first: the state's (and the scratch's)
    # cudaMalloc calls are paid again, as in a fresh process, with every kernel still loaded.
    cold = [first_step_ms(True) for _ in range(repeats)]
    totals: dict[str, float] = defaultdict(float)
    patches = [
        (Gefen, "_all_finite", "finiteness check", True),
        (Gefen, "_search_periods", "period search", False),
        (ops, "histogram_sum", "histogram", False),
        (codebook, "optimal_codebook", "codebook solver", False),
        (Gefen, "_init_group", "state creation", False),
        (optimizer, "_gefen_functional", "first update", False),
        (optimizer._steady_step, "build", "steady-step cache", False),
    ]
    saved = []
    for owner, attr, label, static in patches:
        fn = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        saved.append((owner, attr, fn))
        inner = fn.__func__ if static else fn
        wrapped = _timed(totals, label, inner)
        setattr(owner, attr, staticmethod(wrapped) if static else wrapped)
    try:
        opt = Gefen(named, lr=1e-4, weight_decay=0.0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.step()
        torch.cuda.synchronize()
        total = (time.perf_counter() - t0) * 1e3
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)
    print(
        f"\n=== {model}: first step of fresh optimizers, kernels loaded: "
        + " / ".join(f"{t:.1f}" for t in plain[1:])
        + " ms (unsynchronised)"
    )
    print(
        "the same after torch.cuda.empty_cache() (the allocator's cudaMalloc calls again): "
        + " / ".join(f"{t:.1f}" for t in cold)
        + " ms"
    )
    print(f"with a sync around each phase: {total:.1f} ms")
    accounted = 0.0
    for label, seconds in totals.items():
        accounted += seconds * 1e3
        print(f"  {label:<20s} {seconds * 1e3:8.1f} ms")
    print(f"  {'other':<20s} {total - accounted:8.1f} ms")
    if top:
        opt = Gefen(named, lr=1e-4, weight_decay=0.0)
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        opt.step()
        torch.cuda.synchronize()
        prof.disable()
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out).sort_stats("tottime")
        stats.print_stats(top)
        if callers:
            stats.print_callers(callers)
        print(out.getvalue())
    if kernels:
        from torch.profiler import ProfilerActivity, profile

        opt = Gefen(named, lr=1e-4, weight_decay=0.0)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as kprof:
            opt.step()
            torch.cuda.synchronize()
        print(
            kprof.key_averages().table(
                sort_by="self_device_time_total", row_limit=kernels, max_name_column_width=60
            )
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,llama")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--cprofile",
        type=int,
        default=0,
        metavar="N",
        help="also print the N functions with the most own time under cProfile",
    )
    parser.add_argument(
        "--callers",
        default="",
        metavar="REGEX",
        help="with --cprofile, also print who called the functions matching "
        "REGEX (e.g. the blocking reads: 'tolist|method .to. ')",
    )
    parser.add_argument(
        "--kernels",
        type=int,
        default=0,
        metavar="N",
        help="also print the N kernels with the most device time (torch.profiler)",
    )
    args = parser.parse_args()
    for model in args.models.split(","):
        _phases(model.strip(), args.repeats, args.cprofile, args.kernels, args.callers)


if __name__ == "__main__":
    main()
