"""Host time of a steady fused step without its kernels (diagnostic, CPU).

    TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= python scripts/steady_host_cost.py

Builds a GPT-2-shaped parameter set with the real tensor count (148 tensors, 12 layers) but
small dimensions, routes its CPU tensors through the planned fused path as the CPU tests do
(``tests/test_steady_step.py``'s ``fused_on_cpu``), takes two full steps (the first learns the
codebook, the second is recorded), then replaces the grouped launch with a no-op and times
``SteadyStep.run``: everything a steady step does on the host except issuing its kernels.
``--no-counter-buffer`` keeps the step counters as separate tensors (before 2026-11-30).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

import gefen_kernels.ops.step_groups as step_groups
from gefen_bench.param_sets import build_param_set, gpt2_shapes
from gefen_core import Gefen, _dispatch, _steady_step, functional


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--no-counter-buffer", action="store_true")
    args = parser.parse_args()
    torch.cuda.device = lambda d: contextlib.nullcontext()  # type: ignore[assignment]
    torch.cuda.is_current_stream_capturing = lambda: False
    _dispatch.fused_blocker = lambda p: None  # type: ignore[assignment]
    functional._plans_apply = lambda params: bool(params)  # type: ignore[assignment]
    functional._fused_gefen = functional._planned_gefen  # type: ignore[assignment]
    if args.no_counter_buffer:
        _steady_step._rehome_counters = lambda states: None  # type: ignore[assignment]
    named = build_param_set(
        gpt2_shapes(512, 64, 64, 12), device=torch.device("cpu"), dtype=torch.bfloat16
    )
    opt = Gefen(named, lr=1e-3, weight_decay=0.0)
    for _, p in named:
        p.grad = torch.randn_like(p)
    opt.step()
    opt.step()
    record = opt._steady
    if record is None:
        raise SystemExit("the second step was not recorded")
    step_groups.StepGroups.launch = lambda self, *a, **k: None  # type: ignore[assignment]
    times = []
    for i in range(args.repeats + 5):
        start = time.perf_counter()
        if not record.run(opt):
            raise SystemExit("a steady step fell back to the full step")
        if i >= 5:
            times.append(time.perf_counter() - start)
    mode = "separate counters" if args.no_counter_buffer else "counter buffer"
    print(
        f"{len(named)} tensors, {mode}: steady host time without kernels, median of "
        f"{args.repeats}: {1e3 * statistics.median(times):.3f} ms"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
