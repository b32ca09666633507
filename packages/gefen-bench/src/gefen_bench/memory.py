"""``gefen-bench memory``: Gefen's optimizer state in bytes/param, measured, not computed.

For each parameter set built from shapes (:mod:`.param_sets`: GPT-2 small, tied head;
Llama-3.2-1B, untied head) the command builds the real optimizer with its defaults over
random bf16 parameters with random bf16 gradients, runs its first step (period search,
codebook, first update — which is when the state is allocated), and counts the bytes of
every distinct storage the optimizer then holds (:mod:`.state_bytes`). bf16 on CPU needs
about 7.5 GB of RAM for the Llama set (parameters + gradients + state). The target is ≤ 1.02
bytes/param with the defaults. Each row also counts the tensors by second-moment mode
(factored, per block) and records the groups' ``min_dim_size_to_factor`` (the factoring rule,
docs/algorithm.md#factoring-rule: a matrix is factored only if both sides are at least it).
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from rich.markup import escape

from . import optimizers as registry
from .measure import resolve_device, synchronize
from .param_sets import MODELS, SCALES, build_param_set, numel, shapes_for
from .report import console, print_table, write_json
from .state_bytes import state_bytes_per_param

TARGET_BYTES_PER_PARAM = 1.02


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``memory``'s options on ``parser``."""
    parser.add_argument("--models", default="gpt2,llama",
                        help="comma-separated parameter sets: gpt2, llama (default both)")
    parser.add_argument("--optimizers", default="gefen",
                        help="comma-separated optimizer names (default: gefen)")
    parser.add_argument("--scale", default="full", choices=SCALES,
                        help="full shapes (default) or tiny ones with the same structure")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="parameter and gradient dtype (default bfloat16)")
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda or auto")
    parser.add_argument("--out", type=Path, default=Path("gefen-bench-out/memory"),
                        help="directory for memory.json")


def _period_histogram(opts: list[torch.optim.Optimizer]) -> dict[str, int]:
    """How many tensors got each block period (from ``state[p]['period']`` where present)."""
    periods: Counter[int] = Counter()
    for o in opts:
        for st in o.state.values():
            if isinstance(st, dict) and "period" in st:
                periods[int(st["period"])] += 1
    return {str(k): v for k, v in sorted(periods.items())}


def _second_moment_modes(opts: list[torch.optim.Optimizer]) -> dict[str, Any]:
    """Tensors by second-moment mode (``exp_avg_sq_row``: factored, ``exp_avg_sq``: per
    block) and the distinct ``min_dim_size_to_factor`` values of the groups."""
    modes: Counter[str] = Counter()
    rules: set[int] = set()
    for o in opts:
        for st in o.state.values():
            if isinstance(st, dict):
                if "exp_avg_sq_row" in st:
                    modes["factored"] += 1
                elif "exp_avg_sq" in st:
                    modes["per_block"] += 1
        rules.update(int(g["min_dim_size_to_factor"]) for g in o.param_groups
                     if "min_dim_size_to_factor" in g)
    return {"modes": dict(modes), "min_dim_size_to_factor": sorted(rules)}


def measure(name: str, model: str, *, scale: str, dtype: torch.dtype,
            device: torch.device) -> dict[str, Any]:
    """Build ``name`` over ``model``'s shapes, take one step, return the state figures."""
    shapes = shapes_for(model, scale)
    named = build_param_set(shapes, device=device, dtype=dtype)
    params = [p for _, p in named]
    opts = registry.build(name, named, lr=1e-4, weight_decay=0.0, device=device)
    t0 = time.perf_counter()
    for o in opts:
        o.step()
    synchronize(device)
    first_step_s = time.perf_counter() - t0
    state = state_bytes_per_param(opts, params)
    return {"model": model, "optimizer": name, "tensors": len(shapes), "params": numel(shapes),
            "state_bytes": state["state_bytes"], "bytes_per_param": state["bytes_per_param"],
            "first_step_s": first_step_s, "periods": _period_histogram(opts),
            "second_moment": _second_moment_modes(opts)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Print state bytes/param per (optimizer, model) and write ``memory.json``."""
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in models:
        if m not in MODELS:
            raise argparse.ArgumentTypeError(
                f"--models: unknown model {m!r}; available: {', '.join(MODELS)}")
    names = registry.parse_names(args.optimizers)
    try:
        device = resolve_device(args.device)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--device {args.device}: {exc}") from None
    dtype = getattr(torch, args.dtype)
    skipped = {n: r for n in names if (r := registry.availability(n, plain_step=True)) is not None}
    external = [n for n in names if registry.get_spec(n).external]
    if external:
        raise argparse.ArgumentTypeError(
            f"--optimizers: {', '.join(external)} run only in their own process; use "
            "`gefen-bench step --target ...` for published packages")
    for n, reason in skipped.items():
        console.print(f"[yellow]skipped[/yellow] {n}: {escape(reason)}")
    rows = []
    failed: dict[str, str] = {}
    for n in names:
        if n in skipped:
            continue
        for m in models:
            console.print(f"{n} on {m}-shaped {args.dtype} parameters ({args.scale}) ...")
            try:
                rows.append(measure(n, m, scale=args.scale, dtype=dtype, device=device))
            except Exception as exc:  # noqa: BLE001 - reported verbatim, the rest still run
                failed[f"{n}/{m}"] = f"{type(exc).__name__}: {exc}"
                console.print(f"[red]FAILED[/red] {n}/{m}: " + escape(failed[f"{n}/{m}"]))
    table = [[r["optimizer"], r["model"], r["tensors"], r["params"], r["state_bytes"],
              r["bytes_per_param"],
              ("yes" if r["bytes_per_param"] <= TARGET_BYTES_PER_PARAM else "NO")
              if r["optimizer"].startswith("gefen") else "-",
              " / ".join(f"{k} {v}" for k, v in sorted(r["second_moment"]["modes"].items()))
              or "-",
              ",".join(map(str, r["second_moment"]["min_dim_size_to_factor"])) or "-",
              r["first_step_s"]] for r in rows]
    print_table(f"optimizer state after the first step · {device} · {args.dtype}",
                ["optimizer", "model", "tensors", "params", "state bytes", "B/param",
                 f"<= {TARGET_BYTES_PER_PARAM}", "second moment", "min dim to factor",
                 "first step s"], table)
    report = {"device": str(device), "dtype": args.dtype, "scale": args.scale,
              "target_bytes_per_param": TARGET_BYTES_PER_PARAM, "rows": rows,
              "skipped": skipped, "failed": failed}
    path = write_json(args.out / "memory.json", "memory", report, seeds=[0],
                      argv=getattr(args, "argv", None))
    console.print(f"JSON: {path.resolve()}")
    return report
