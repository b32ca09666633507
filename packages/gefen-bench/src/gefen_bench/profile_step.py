"""``gefen-bench profile``: where one Gefen step spends its time, kernel by kernel.

A diagnostic for kernel work, not a benchmark (``gefen-bench step`` is the measurement). For
each parameter set built from shapes (:mod:`.param_sets`) and each second-moment mode, the
command builds :class:`gefen_core.Gefen` over random parameters with fixed random gradients,
takes the first step (period search, codebook, state), ``--warmup`` steady steps, then:

* the steady step's host-issue time and its step time (CUDA events on CUDA, host wall time
  elsewhere), medians over ``--steps`` steps;
* ``torch.profiler``'s self time per kernel (CUDA) or per operator (CPU) over ``--steps``
  steady steps, with call counts: the device time of each kernel the step launches;
* the census of the state: how many tensors have each ``(shape, period, factored)``, which is
  what the fused path's launch classes are made of.

Instruction counts need Nsight Compute, which this command does not drive: run
``ncu --metrics smsp__inst_executed.sum`` on ``gefen-bench profile --steps 1`` for them.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from .measure import resolve_device, synchronize
from .param_sets import MODELS, SCALES, build_param_set, numel, shapes_for
from .report import console, print_table, write_json

MODES = ("factored", "block")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``profile``'s options on ``parser``."""
    parser.add_argument("--models", default="gpt2,llama",
                        help="comma-separated parameter sets: gpt2, llama (default both)")
    parser.add_argument("--modes", default="factored,block",
                        help="comma-separated second-moment modes: factored, block (default both)")
    parser.add_argument("--scale", default="full", choices=SCALES,
                        help="full shapes (default) or tiny ones with the same structure")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="parameter and gradient dtype (default bfloat16)")
    parser.add_argument("--steps", type=int, default=20,
                        help="steady steps timed and profiled (default 20)")
    parser.add_argument("--warmup", type=int, default=3,
                        help="steady steps before timing (default 3)")
    parser.add_argument("--top", type=int, default=20,
                        help="kernels (or operators) listed per case (default 20)")
    parser.add_argument("--device", default="auto", help="auto (default), cuda or cpu")
    parser.add_argument("--out", type=Path, default=Path("gefen-bench-out/profile"),
                        help="directory for profile.json")


def _split(text: str, allowed: tuple[str, ...], option: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in items if t not in allowed]
    if unknown or not items:
        raise argparse.ArgumentTypeError(
            f"{option}: unknown value {unknown[0]!r}; available: {', '.join(allowed)}"
            if unknown else f"{option}: give at least one of {', '.join(allowed)}")
    return items


def _census(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """``(shape, period, factored)`` of every stepped tensor, most elements first."""
    counts: Counter[tuple[tuple[int, ...], int, bool]] = Counter()
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p, {})
            if "exp_avg_codes" in st:
                counts[(tuple(p.shape), int(st["period"]), "exp_avg_sq_row" in st)] += 1
    ordered = sorted(counts.items(), key=lambda kv: -kv[1] * numel([("", kv[0][0])]))
    return [{"shape": list(s), "period": per, "factored": f, "count": n}
            for (s, per, f), n in ordered]


def _kernel_times(opt: torch.optim.Optimizer, device: torch.device, steps: int,
                  top: int) -> list[dict[str, Any]]:
    """Self time per kernel (CUDA) or operator (CPU) over ``steps`` steps, most time first."""
    cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CUDA if cuda
                  else torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            opt.step()
        synchronize(device)
    rows = []
    for e in prof.key_averages():
        total_us = (getattr(e, "self_device_time_total", None) if cuda
                    else e.self_cpu_time_total)
        if total_us is None and cuda:  # torch < 2.4 names it after CUDA
            total_us = e.self_cuda_time_total
        if total_us and total_us > 0:
            rows.append({"name": e.key, "calls_per_step": e.count / steps,
                         "us_per_step": total_us / steps})
    rows.sort(key=lambda r: -r["us_per_step"])
    return rows[:top]


def profile_case(model: str, mode: str, *, scale: str, dtype: torch.dtype,
                 device: torch.device, steps: int, warmup: int, top: int) -> dict[str, Any]:
    """Profile one (model, mode): first step, steady timings, kernels, state census."""
    from gefen_core import Gefen

    shapes = shapes_for(model, scale)
    named = build_param_set(shapes, device=device, dtype=dtype)
    opt = Gefen(named, lr=1e-4, weight_decay=0.0, factored_v_2d=mode == "factored")
    synchronize(device)
    t0 = time.perf_counter()
    opt.step()
    synchronize(device)
    first_ms = (time.perf_counter() - t0) * 1e3
    for _ in range(warmup):
        opt.step()
    synchronize(device)
    hosts, steps_ms = [], []
    for _ in range(steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        h0 = time.perf_counter()
        opt.step()
        hosts.append((time.perf_counter() - h0) * 1e3)
        if device.type == "cuda":
            end.record()
            synchronize(device)
            steps_ms.append(start.elapsed_time(end))
        else:
            steps_ms.append((time.perf_counter() - h0) * 1e3)
    return {
        "model": model, "mode": mode, "tensors": len(shapes), "params": numel(shapes),
        "paths": sorted(set(opt.step_paths().values())),
        "first_step_ms": first_ms,
        "host_issue_ms": statistics.median(hosts),
        "step_ms": statistics.median(steps_ms),
        "timer": "cuda-events" if device.type == "cuda" else "host-wall",
        "kernels": _kernel_times(opt, device, steps, top),
        "census": _census(opt),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Print one table per case and write ``profile.json``."""
    models = _split(args.models, MODELS, "--models")
    modes = _split(args.modes, MODES, "--modes")
    if args.steps < 1 or args.warmup < 0 or args.top < 1:
        raise argparse.ArgumentTypeError("--steps and --top must be >= 1, --warmup >= 0")
    try:
        device = resolve_device(args.device)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--device {args.device}: {exc}") from None
    dtype = getattr(torch, args.dtype)
    cases = []
    for model in models:
        for mode in modes:
            console.print(f"profiling Gefen ({mode}) on {model}-shaped {args.dtype} parameters")
            case = profile_case(model, mode, scale=args.scale, dtype=dtype, device=device,
                                steps=args.steps, warmup=args.warmup, top=args.top)
            cases.append(case)
            unit = "kernel" if device.type == "cuda" else "operator"
            console.print(
                f"{model} · {mode} · paths {','.join(case['paths'])}: first step "
                f"{case['first_step_ms']:.1f} ms, steady step {case['step_ms']:.3f} ms "
                f"({case['timer']}), host issue {case['host_issue_ms']:.3f} ms")
            print_table(
                f"{model} · {mode} · time per {unit}", [unit, "calls/step", "µs/step"],
                [[k["name"][:80], k["calls_per_step"], k["us_per_step"]]
                 for k in case["kernels"]])
            print_table(f"{model} · {mode} · state census",
                        ["shape", "period", "factored", "tensors"],
                        [[str(tuple(c["shape"])), c["period"], c["factored"], c["count"]]
                         for c in case["census"]])
    report = {"device": str(device), "dtype": args.dtype, "scale": args.scale,
              "steps": args.steps, "warmup": args.warmup, "cases": cases}
    path = write_json(args.out / "profile.json", "profile", report, seeds=[0],
                      argv=getattr(args, "argv", None))
    console.print(f"JSON: {path.resolve()}")
    return report
