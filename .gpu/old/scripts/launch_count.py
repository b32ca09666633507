"""Triton launches of one grouped fused step, by kernel, without running them (diagnostic, CPU).

    PYTHONPATH=<packages>/src:scripts CUDA_VISIBLE_DEVICES= python scripts/launch_count.py

Plans every tensor of a full-size ``gefen_bench.param_sets`` parameter set (bf16; uninitialised
CPU memory, never touched, so the 1.5e9-parameter Llama set costs little RAM) with fixed
periods close to those ``gefen-bench step`` found on an H200 (2-D tensors: 8192 for 8192
columns, else their column count up to 2048; 1-D tensors: their length up to 2048; the
whole last dimension where that would not tile it). It
groups the plans as the optimizer's eager fused path does
(:class:`gefen_kernels.ops.step_groups.StepGroups`), with Triton's interpreter off and the
launchers' device check patched as ``tests/compile_check.py`` does, and counts the Triton
launches of one ``StepGroups.launch`` instead of issuing them. On a GPU machine each launch
costs tens of microseconds of host time in Triton's Python launcher, every steady step.
``--old-layout`` uses statistics strips of one chunk and launches factored loop-route plans
one by one, as the code did before 2026-11-30's ninth session.
"""

from __future__ import annotations

import argparse
import importlib
from collections import Counter
from typing import Any

import torch
from kernel_sweep import diagnostic_plan
from triton.runtime.jit import JITFunction

import gefen_kernels.ops.step_groups as step_groups
from gefen_bench.param_sets import gpt2_shapes, llama_shapes
from gefen_kernels.ops import _dispatch

# (gefen_kernels.ops exports a function of this name: import the module by path.)
factored_step = importlib.import_module("gefen_kernels.ops.factored_step")


def _period(shape: tuple[int, ...]) -> int:
    last = shape[-1]
    period = 8192 if len(shape) == 2 and last == 8192 else min(last, 2048)
    # A block must tile the tensor: else the whole last dimension.
    return period if last % period == 0 else last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("llama", "gpt2"), default="llama")
    parser.add_argument("--old-layout", action="store_true")
    args = parser.parse_args()
    if args.old_layout:
        factored_step._STATS_STRIP_CHUNKS = 1
        tile_only = step_groups._groupable
        step_groups._groupable = lambda plan, grad: plan.route == "tile" and tile_only(plan, grad)
    _dispatch.interpret_mode = lambda: True  # CPU tensors pass the launchers' device check
    shapes = llama_shapes() if args.model == "llama" else gpt2_shapes()
    codebook = torch.linspace(-1.0, 1.0, 256)
    plans, grads, keep = [], [], []
    for _, shape in shapes:
        n = 1
        for s in shape:
            n *= s
        period = _period(shape)
        param = torch.empty(shape, dtype=torch.bfloat16)
        codes = torch.empty(n // period, period, dtype=torch.uint8)
        scale = torch.empty(n // period, 1)
        factored = len(shape) == 2
        sq = None if factored else torch.empty(n // period, 1)
        row = torch.empty(shape[0]) if factored else None
        col = torch.empty(shape[1]) if factored else None
        plans.append(diagnostic_plan(param, codes, scale, sq, row, col, codebook))
        grads.append(torch.empty(shape, dtype=torch.bfloat16))
        keep.append((param, codes, scale, sq, row, col))
    routes = Counter(p.route for p in plans)
    groups = step_groups.StepGroups(plans, grads)
    counts: Counter[str] = Counter()

    def record(self: Any, *a: Any, grid: Any, warmup: bool, **k: Any) -> None:
        counts[self.__name__] += 1

    JITFunction.run = record  # type: ignore[method-assign]
    # The scratch of every chunk and the staged scalars are allocated as on a GPU machine.
    groups.launch(grads, [(1e-3, 1.0, 1.0, 1.0)] * len(plans), None)
    print(
        f"{args.model}: {len(plans)} tensors, routes {dict(routes)}, "
        f"{'old' if args.old_layout else 'current'} layout and grouping"
    )
    print(f"  Triton launches per grouped step: {sum(counts.values())}")
    for name, n in counts.most_common():
        print(f"    {name}: {n}")


if __name__ == "__main__":
    main()
