"""``gefen-bench arch``: the architecture-family matrix.

For every family (:mod:`.arch_families`) and optimizer (default Gefen and AdamW), memorise
one fixed batch for ``--steps`` steps from the same initialisation. A run PASSes when the
loss falls by more than ``--threshold`` (default 30%) of its first value and every loss is
finite. Each (family, optimizer) runs in its own process, so the peak-memory column is that
run's alone; the parameter ranks and dtypes the optimizer stepped are listed per family.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.markup import escape

from . import optimizers as registry
from .arch_families import FAMILIES
from .jobs import run_jobs
from .measure import MemoryMeter, resolve_device, synchronize
from .report import console, markdown_table, mib, print_table, write_json
from .state_bytes import state_bytes_per_param

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``arch``'s options on ``parser``."""
    parser.add_argument("--families", default=None,
                        help="comma-separated families (default: all): " + ", ".join(FAMILIES))
    parser.add_argument("--optimizers", default="gefen,adamw",
                        help="comma-separated optimizer names (default: gefen,adamw)")
    parser.add_argument("--steps", type=int, default=30, help="memorisation steps (default 30)")
    parser.add_argument("--lr", type=float, default=3e-3,
                        help="AdamW learning rate; other optimizers use their registry "
                             "lr_scale times this (Gefen 1x) (default 3e-3)")
    parser.add_argument("--width", type=int, default=1,
                        help="width multiplier of the tiny configs (1 = CPU size)")
    parser.add_argument("--dtype", default="float32", choices=list(_DTYPES),
                        help="parameter dtype (default float32)")
    parser.add_argument("--threshold", type=float, default=0.30,
                        help="PASS needs the loss to fall by more than this fraction")
    parser.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda")
    parser.add_argument("--jobs", type=int, default=2,
                        help="worker processes at once (default 2; times then share cores)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per worker (default: cores / --jobs)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds before one run is killed (default 600)")
    parser.add_argument("--out", type=Path, default=Path("gefen-bench-out/arch"),
                        help="directory for arch.json")
    parser.add_argument("--markdown", action="store_true",
                        help="also print the table as Markdown (for docs/benchmarks.md)")


def run_arch_job(job: dict[str, Any], emit: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Worker: memorise the fixed batch of ``job['family']`` with ``job['optimizer']``."""
    import warnings

    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    device = torch.device(job["device"])
    dtype = _DTYPES[job["dtype"]]
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model, batch = FAMILIES[job["family"]].build(int(job["width"]), gen)
    model = model.to(device=device, dtype=dtype)
    model.train()
    batch = {k: (v.to(device=device, dtype=dtype) if v.is_floating_point() else v.to(device))
             for k, v in batch.items()}
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    # One forward/backward before measuring, so the memory column is not the one-time cost
    # of torch loading its kernels (which would be the same for every optimizer).
    model(**batch).loss.backward()
    model.zero_grad(set_to_none=True)
    meter = MemoryMeter(device)
    meter.start()
    opts = registry.build(job["optimizer"], named, lr=float(job["lr"]), weight_decay=0.0,
                          device=device, model=model)
    losses: list[float] = []
    synchronize(device)
    t0 = time.perf_counter()
    for i in range(int(job["steps"])):
        loss = model(**batch).loss
        loss.backward()
        for o in opts:
            o.step()
        for o in opts:
            o.zero_grad(set_to_none=True)
        losses.append(loss.item())
        emit({"event": "progress", "label": job["label"], "done": i + 1,
              "total": job["steps"], "loss": losses[-1]})
    synchronize(device)
    elapsed = time.perf_counter() - t0
    memory = meter.stop()
    with torch.no_grad():
        final = model(**batch).loss.item()
    params = [p for _, p in named]
    return {
        "family": job["family"],
        "group": FAMILIES[job["family"]].group,
        "model": type(model).__name__,
        "optimizer": job["optimizer"],
        "lr": job["lr"],
        "num_params": sum(p.numel() for p in params),
        "ranks": sorted({p.ndim for p in params}),
        "dtypes": sorted({str(p.dtype).replace("torch.", "") for p in params}),
        "losses": [round(v, 5) for v in losses],
        "initial_loss": losses[0] if losses else None,
        "final_loss": final,
        "finite": all(math.isfinite(v) for v in [*losses, final]),
        "time_s": elapsed,
        "memory": memory,
        "state": state_bytes_per_param(opts, params),
    }


def _family_names(text: str | None) -> list[str]:
    if not text:
        return list(FAMILIES)
    names = [n.strip() for n in text.split(",") if n.strip()]
    for n in names:
        if n not in FAMILIES:
            raise argparse.ArgumentTypeError(
                f"--families: unknown family {n!r}; available: {', '.join(FAMILIES)}")
    return names


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the matrix; prints the table and writes ``arch.json`` under ``args.out``."""
    families = _family_names(args.families)
    names = registry.parse_names(args.optimizers)
    for flag in ("steps", "jobs", "width"):
        if getattr(args, flag) < 1:
            raise argparse.ArgumentTypeError(f"--{flag} must be >= 1")
    if not (args.lr > 0) or not (0 < args.threshold < 1):
        raise argparse.ArgumentTypeError("--lr must be > 0 and --threshold in (0, 1)")
    try:
        device = str(resolve_device(args.device))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--device {args.device}: {exc}") from None
    skipped = {n: why for n in names if (why := registry.availability(n)) is not None}
    for n, reason in skipped.items():
        console.print(f"[yellow]skipped[/yellow] {n}: {escape(reason)}")
    runnable = [n for n in names if n not in skipped]
    threads = args.threads or max(1, (torch.get_num_threads()) // args.jobs)
    jobs = [{"kind": "arch", "family": f, "optimizer": n, "device": device,
             "dtype": args.dtype, "width": args.width, "steps": args.steps,
             "lr": args.lr * registry.get_spec(n).lr_scale, "label": f"{f} · {n}"}
            for f in families for n in runnable]
    start = time.perf_counter()
    done: list[str] = []

    def on_event(event: dict[str, Any]) -> None:
        if event.get("done") == event.get("total"):
            done.append(event["label"])
            console.print(f"  [{len(done)}/{len(jobs)}] {event['label']}: loss "
                          f"{event['loss']:.4g}")

    outcomes = run_jobs(jobs, parallel=args.jobs, on_event=on_event, timeout_s=args.timeout,
                        threads=threads)
    wall = time.perf_counter() - start
    rows: list[dict[str, Any]] = []
    for job, out in zip(jobs, outcomes):
        r: dict[str, Any]
        if out.status == "ok" and out.result is not None:
            r = out.result
            first, final = r["initial_loss"], r["final_loss"]
            drop = 1 - final / first if first and math.isfinite(first) and first > 0 else None
            r["drop"] = drop
            r["pass"] = bool(r["finite"] and drop is not None and drop > args.threshold)
            r["status"] = "ok"
        else:
            r = {"family": job["family"], "optimizer": job["optimizer"], "pass": False,
                 "status": out.status, "error": out.error, "stderr_tail": out.stderr_tail}
            console.print(f"[red]{job['label']} {out.status}[/red]: "
                          + escape(f"{out.error}\n{out.stderr_tail[-1500:]}"))
        rows.append(r)
    columns = ["family", "group", "optimizer", "params", "ranks", "dtypes", "loss first",
               "loss final", "drop %", "finite", "result", "peak MiB over start",
               "state B/param", "time s"]
    table = [[r["family"], r.get("group"), r["optimizer"], r.get("num_params"),
              ",".join(map(str, r.get("ranks", []))) or None, ",".join(r.get("dtypes", [])) or None,
              r.get("initial_loss"), r.get("final_loss"),
              None if r.get("drop") is None else f"{100 * r['drop']:.1f}",
              r.get("finite"), "PASS" if r["pass"] else f"FAIL ({r['status']})",
              mib(r["memory"]["peak_over_start_bytes"]) if "memory" in r else None,
              r["state"]["bytes_per_param"] if "state" in r else None,
              r.get("time_s")] for r in rows]
    print_table(f"gefen-bench arch · {device} · {args.dtype} · {args.steps} steps · PASS = "
                f"loss falls > {100 * args.threshold:.0f}% with no NaN/Inf", columns, table)
    if args.markdown:
        console.print(markdown_table(columns, table), markup=False, soft_wrap=True)
    passed = sum(r["pass"] for r in rows)
    console.print(f"{passed}/{len(rows)} runs passed · wall {wall:.0f} s")
    report = {"device": device, "dtype": args.dtype, "steps": args.steps, "lr_adamw": args.lr,
              "threshold": args.threshold, "width": args.width, "skipped": skipped,
              "memory_method": rows[0].get("memory", {}).get("method") if rows else None,
              "runs": rows, "passed": passed, "total": len(rows), "wall_s": wall}
    path = write_json(args.out / "arch.json", "arch", report, seeds=[0],
                      argv=getattr(args, "argv", None))
    console.print(f"JSON: {path.resolve()}")
    return report
