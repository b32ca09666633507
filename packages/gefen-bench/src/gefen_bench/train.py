"""``gefen-bench train``: real models on real data, Gefen head to head with its peers.

Tasks (embedded, no download): a byte-level Llama-style decoder on the Python standard
library's own sources (``lm``), and on scikit-learn's digits over several seeds a small CNN
(``digits``, scored by held-out accuracy) and an MLP (``digits-mlp``, scored by held-out
cross-entropy). Every optimizer gets the same model initialisation, data order, schedule and
step count. Quality is compared at each optimizer's own tuned learning rate: by default
(``--lr-sweep``) every optimizer is trained at every LR of one grid shared by all of them
(multiples of the task's AdamW LR), on fewer steps or epochs and one seed, and takes its best
grid point by validation loss, on a split disjoint from the held-out one
(:mod:`.train_sweep`); the same sweep runs give the equal-LR comparison. ``--no-lr-sweep``
runs every optimizer at the task's AdamW LR times the registry's ``lr_scale`` (1 for Gefen);
``--lr`` overrides either. Each reported (task, optimizer) run has its own process so that its
memory figure is its own.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from . import optimizers as registry
from .data import save_digits_splits
from .jobs import JobOutcome, run_job, run_jobs
from .measure import resolve_device
from .presets import PRESETS, Preset, as_dict, get_preset, with_overrides
from .report import console, fmt, mib, plot_train, print_table, write_json
from .train_sweep import choose, equal_lr, grid_lrs

TASKS = ("lm", "digits", "digits-mlp")
DIGITS_TASKS = ("digits", "digits-mlp")
# The shared LR grid, as multiples of each task's AdamW LR (the same values for every optimizer).
DEFAULT_SWEEP_GRID = (0.5, 1.0, 2.0)
# The bar on every task: held-out loss (mean over seeds) within 2% of AdamW's, each optimizer
# at its own tuned LR; on the LM also at most 1/3 of AdamW's state.
LOSS_TOLERANCE = 0.02
LM_STATE_RATIO = 1 / 3


def parse_assignments(values: list[str] | None, flag: str) -> dict[str, str]:
    """``["a=1", "b=2"]`` → ``{"a": "1", "b": "2"}``; ArgumentTypeError names the flag."""
    out: dict[str, str] = {}
    for item in values or []:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise argparse.ArgumentTypeError(
                f"{flag} expects NAME=VALUE (e.g. {flag} gefen=3e-3), got {item!r}")
        out[key.strip()] = value.strip()
    return out


def parse_lr_overrides(values: list[str] | None) -> dict[tuple[str | None, str], float]:
    """``--lr [TASK:]NAME=LR`` → ``{(task or None, name): lr}``, every part validated."""
    out: dict[tuple[str | None, str], float] = {}
    for key, value in parse_assignments(values, "--lr").items():
        task, _, name = key.rpartition(":")
        if task and task not in TASKS:
            raise argparse.ArgumentTypeError(
                f"--lr {key}={value}: unknown task {task!r}; tasks are {', '.join(TASKS)}")
        registry.get_spec(name)
        try:
            lr = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"--lr {key}={value}: {value!r} is not a number") from None
        if not (lr > 0 and math.isfinite(lr)):
            raise argparse.ArgumentTypeError(f"--lr {key}={value}: must be a positive number")
        out[(task or None, name)] = lr
    return out


def parse_grid(text: str) -> tuple[float, ...]:
    """``"0.5,1,2"`` → multipliers of each optimizer's default LR (positive numbers)."""
    try:
        grid = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--sweep-grid: {text!r} is not a list of numbers") from None
    if not grid or any(not (g > 0) for g in grid):
        raise argparse.ArgumentTypeError(f"--sweep-grid: {text!r} needs positive multipliers")
    return grid


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``train``'s options on ``parser``."""
    parser.add_argument("--preset", default="cpu-default", choices=list(PRESETS),
                        help="model/data/step scale (default: cpu-default, the embedded "
                             "no-download CPU run)")
    parser.add_argument("--tasks", default=None,
                        help="comma-separated subset of: " + ", ".join(TASKS) + " (default: "
                             "all that the preset has)")
    parser.add_argument("--optimizers", default=None,
                        help="comma-separated optimizer names (default: "
                             + ",".join(registry.TRAIN_DEFAULT) + "; unavailable ones are "
                             "reported as skipped)")
    parser.add_argument("--lr", action="append", metavar="[TASK:]NAME=LR",
                        help="learning rate for one optimizer, e.g. --lr gefen=3e-3 or "
                             "--lr digits:adamw=1e-3 (repeatable)")
    parser.add_argument("--lr-sweep", action=argparse.BooleanOptionalAction, default=True,
                        help="tune each optimizer's LR on one grid shared by all of them "
                             "(--sweep-grid), by validation loss of shorter runs, and compare "
                             "at the tuned LRs (default: on; --no-lr-sweep: the registry "
                             "defaults, Gefen at AdamW's LR)")
    parser.add_argument("--sweep-grid", type=parse_grid, default=DEFAULT_SWEEP_GRID,
                        help="the shared LR grid as multiples of each task's AdamW LR "
                             "(default: 0.5,1,2)")
    parser.add_argument("--steps", type=int, default=None, help="override the LM step count")
    parser.add_argument("--grad-clip", type=float, default=None, metavar="NORM",
                        help="override the LM global gradient-norm clip (0 = none; optimizers "
                             "that step in backward never clip globally)")
    parser.add_argument("--epochs", type=int, default=None,
                        help="override the epoch count of both digits tasks")
    parser.add_argument("--seed", type=int, default=0, help="LM model-initialisation seed")
    parser.add_argument("--data-seed", type=int, default=1234, help="LM data-order seed")
    parser.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda")
    parser.add_argument("--target", action="append", metavar="PKG=DIR",
                        help="directory a published package was pip-installed into with "
                             "--target: gefen-x=DIR (0.5.x) or gefen=DIR (1.2.x)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per worker process (default: torch's choice)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="worker processes at once (default 1; with more, throughput "
                             "figures share the CPU and only loss/memory/state compare)")
    parser.add_argument("--timeout", type=float, default=3600.0,
                        help="seconds before one optimizer's run is killed (default 3600)")
    parser.add_argument("--out", type=Path, default=Path("gefen-bench-out/train"),
                        help="directory for train.json and train.png")


def _check_args(args: argparse.Namespace) -> tuple[Preset, list[str], list[str], dict[str, str]]:
    preset = get_preset(args.preset)
    tasks = [t.strip() for t in (args.tasks or ",".join(TASKS)).split(",") if t.strip()]
    for t in tasks:
        if t not in TASKS:
            raise argparse.ArgumentTypeError(
                f"--tasks: unknown task {t!r}; tasks are {', '.join(TASKS)}")
    absent = [t for t in DIGITS_TASKS if _preset_config(preset, t) is None]
    if args.tasks:
        for t in tasks:
            if t in absent:
                raise argparse.ArgumentTypeError(f"--preset {preset.name} has no {t} task")
    tasks = [t for t in tasks if t not in absent]
    if args.grad_clip is not None and not args.grad_clip >= 0:
        raise argparse.ArgumentTypeError(f"--grad-clip must be >= 0, got {args.grad_clip}")
    for flag in ("steps", "epochs", "threads", "jobs"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise argparse.ArgumentTypeError(f"--{flag} must be >= 1, got {value}")
    names = (registry.parse_names(args.optimizers) if args.optimizers
             else list(registry.TRAIN_DEFAULT))
    if "adamw" not in names:
        names.insert(0, "adamw")  # the reference every comparison is made against
    targets = parse_assignments(args.target, "--target")
    for key in targets:
        if key not in registry.EXTERNAL_PACKAGES:
            raise argparse.ArgumentTypeError(
                f"--target {key}=...: unknown package; use one of "
                f"{', '.join(registry.EXTERNAL_PACKAGES)}")
    return preset, tasks, names, targets


def _preset_config(preset: Preset, task: str) -> Any:
    return {"lm": preset.lm, "digits": preset.digits, "digits-mlp": preset.digits_mlp}[task]


def _task_config(preset: Preset, task: str, args: argparse.Namespace) -> dict[str, Any]:
    if task == "lm":
        return as_dict(with_overrides(preset.lm, steps=args.steps, grad_clip=args.grad_clip))
    cfg = _preset_config(preset, task)
    assert cfg is not None
    return as_dict(with_overrides(cfg, epochs=args.epochs))


def _default_lr(config: dict[str, Any], name: str) -> float:
    return float(config["adamw_lr"]) * registry.get_spec(name).lr_scale


def _job(task: str, name: str, lr: float, config: dict[str, Any], args: argparse.Namespace,
         device: str, targets: dict[str, str], **extra: Any) -> dict[str, Any]:
    spec = registry.get_spec(name)
    # Both digits tasks run the same worker job; the config's ``model`` picks the network.
    kind = "digits" if task in DIGITS_TASKS else task
    job: dict[str, Any] = {"kind": kind, "task": task, "optimizer": name, "lr": lr,
                           "config": config,
                           "device": device, "seed": args.seed, "data_seed": args.data_seed,
                           "label": f"{task} · {name}", **extra}
    if task in DIGITS_TASKS and getattr(args, "digits_data", None):
        job["data_path"] = str(args.digits_data)
    if spec.external is not None:
        job["target"] = targets[spec.external]
    return job


class _Bars:
    """One rich progress bar per worker job, fed by the jobs' progress events."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.tasks: dict[str, Any] = {}

    def __call__(self, event: dict[str, Any]) -> None:
        label = event.get("label", "?")
        if label not in self.tasks:
            self.tasks[label] = self.progress.add_task(label, total=event.get("total"))
        loss = event.get("loss")
        self.progress.update(self.tasks[label], completed=event.get("done", 0),
                             total=event.get("total"),
                             description=f"{label}  loss {fmt(loss)}")


def _run(job: dict[str, Any], bars: _Bars, args: argparse.Namespace) -> JobOutcome:
    return run_job(job, on_event=bars, timeout_s=args.timeout, threads=args.threads)


def _sweep_task(task: str, names: list[str], config: dict[str, Any], args: argparse.Namespace,
                device: str, targets: dict[str, str], bars: _Bars) -> dict[str, Any]:
    """Every optimizer of ``names`` at every LR of the task's shared grid, scored on the
    validation split (:mod:`.train_sweep`); one worker process for the package's own
    optimizers, one per published-package optimizer."""
    lrs = grid_lrs(float(config["adamw_lr"]), args.sweep_grid)
    extra: dict[str, Any] = {"eval_split": "val"}
    if task == "lm":
        extra["steps"] = min(config["sweep_steps"], config["steps"])
    else:
        extra["epochs"] = min(config["sweep_epochs"], config["epochs"])
        extra["seeds"] = list(config["seeds"][:config["sweep_seeds"]])
    native = [n for n in names if registry.get_spec(n).external is None]
    groups = ([native] if native else []) + [[n] for n in names if n not in native]
    points: list[dict[str, Any]] = []
    for group in groups:
        job = _job(task, group[0], lrs[0], config, args, device, targets, **extra)
        job.update(kind="sweep", inner=job["kind"],
                   points=[{"optimizer": n, "lr": lr} for n in group for lr in lrs])
        out = _run(job, bars, args)
        if out.status == "ok" and out.result is not None:
            points += out.result["points"]
        else:
            points += [{"optimizer": n, "lr": lr, "score": math.inf,
                        "error": f"{out.status}: {out.error}"} for n in group for lr in lrs]
    return {"grid": lrs, "grid_multipliers": list(args.sweep_grid), **extra,
            "metric": "validation loss" + ("" if task == "lm" else " (mean over seeds)"),
            "points": points}


def _held_out_loss(task: str, r: dict[str, Any]) -> float:
    return r["final_eval_loss"] if task == "lm" else r["final_eval_loss_mean"]


def _verdicts(results: dict[str, dict[str, Any]], sweeps: dict[str, dict[str, Any]],
              tuned: bool) -> list[dict[str, Any]]:
    """Every Gefen-family optimizer against AdamW on every task: held-out loss within 2%
    (mean over seeds), each at its own LR (tuned by the sweep when ``tuned``); on the LM
    also at most 1/3 of AdamW's state. The equal-LR gap (validation, sweep runs) at AdamW's
    tuned LR is reported beside it."""
    out: list[dict[str, Any]] = []
    at = "each at its own tuned LR" if tuned else "at the LRs given"
    for task, res in results.items():
        ref = res.get("adamw")
        if ref is None:
            continue
        for name, r in res.items():
            if not name.startswith("gefen"):
                continue
            ratio = _held_out_loss(task, r) / _held_out_loss(task, ref) - 1
            v: dict[str, Any] = {"task": task, "optimizer": name, "lr": r["lr"],
                                 "adamw_lr": ref["lr"], "held_out_loss_vs_adamw": ratio}
            ok = ratio <= LOSS_TOLERANCE
            bar = f"held-out loss <= AdamW's +2% ({at})"
            if task == "lm":
                v["state_vs_adamw"] = (r["state"]["bytes_per_param"]
                                       / ref["state"]["bytes_per_param"])
                ok = ok and v["state_vs_adamw"] <= LM_STATE_RATIO
                bar += " at <= 1/3 of its state"
            else:
                v["accuracy_vs_adamw"] = r["accuracy_mean"] - ref["accuracy_mean"]
            sweep = sweeps.get(task)
            if sweep and name in sweep.get("equal_lr", {}):
                same = [e for e in sweep["equal_lr"][name] if e["lr"] == ref["lr"]]
                v["equal_lr_val_loss_vs_adamw"] = same[0]["vs_ref"] if same else None
            out.append({**v, "pass": bool(ok), "bar": bar})
    return out


def _print_tables(results: dict[str, dict[str, Any]], skipped: dict[str, str],
                  failed: dict[str, str], verdicts: list[dict[str, Any]]) -> None:
    lm = results.get("lm", {})
    if lm:
        ref = lm.get("adamw", {}).get("final_eval_loss")
        rows = [[n, f"{r['lr']:.3g}", r["final_eval_loss"],
                 None if not ref else f"{100 * (r['final_eval_loss'] / ref - 1):+.2f}%",
                 f"{r['tokens_per_s']:.0f}", r["optimizer_step_ms_median"],
                 mib(r["memory"]["peak_bytes"]), mib(r["memory"]["peak_over_start_bytes"]),
                 r["state"]["bytes_per_param"]] for n, r in lm.items()]
        print_table("byte-level LM on stdlib sources (held-out split)",
                    ["optimizer", "lr", "held-out loss", "vs AdamW", "tokens/s",
                     "opt.step ms", "peak MiB", "peak over start MiB", "state B/param"], rows)
    digits = results.get("digits", {})
    if digits:
        rows = [[n, f"{r['lr']:.3g}",
                 f"{100 * r['accuracy_mean']:.2f} ± {100 * r['accuracy_std']:.2f}",
                 " ".join(f"{100 * x['accuracy']:.2f}" for x in r["runs"]),
                 r["final_eval_loss_mean"], f"{r['samples_per_s']:.0f}",
                 mib(r["memory"]["peak_over_start_bytes"]), r["state"]["bytes_per_param"]]
                for n, r in digits.items()]
        print_table("digits CNN (held-out split)",
                    ["optimizer", "lr", "accuracy %", "per seed", "held-out loss",
                     "samples/s", "peak over start MiB", "state B/param"], rows)
    mlp = results.get("digits-mlp", {})
    if mlp:
        ref = mlp.get("adamw", {}).get("final_eval_loss_mean")
        rows = [[n, f"{r['lr']:.3g}",
                 f"{r['final_eval_loss_mean']:.4f} ± {r['final_eval_loss_std']:.4f}",
                 None if not ref else f"{100 * (r['final_eval_loss_mean'] / ref - 1):+.2f}%",
                 " ".join(f"{x['final_eval_loss']:.4f}" for x in r["runs"]),
                 f"{100 * r['accuracy_mean']:.2f} ± {100 * r['accuracy_std']:.2f}",
                 f"{r['samples_per_s']:.0f}", r["state"]["bytes_per_param"]]
                for n, r in mlp.items()]
        print_table("digits MLP (held-out split)",
                    ["optimizer", "lr", "held-out loss", "vs AdamW", "per seed",
                     "accuracy %", "samples/s", "state B/param"], rows)
    for name, reason in {**skipped, **failed}.items():
        kind = "skipped" if name in skipped else "FAILED"
        console.print(f"[yellow]{kind}[/yellow] {name}: {escape(reason)}")
    for v in verdicts:
        tag = "[green]PASS[/green]" if v["pass"] else "[red]MISS[/red]"
        detail = (f"held-out loss {100 * v['held_out_loss_vs_adamw']:+.2f}% vs AdamW "
                  f"(lr {v['lr']:.3g} vs {v['adamw_lr']:.3g})")
        if v["task"] == "lm":
            detail += f", state {v['state_vs_adamw']:.3f}x AdamW's"
        else:
            detail += f", accuracy {100 * v['accuracy_vs_adamw']:+.2f} points"
        if v.get("equal_lr_val_loss_vs_adamw") is not None:
            detail += (f"; at equal LR {v['adamw_lr']:.3g}: validation loss "
                       f"{100 * v['equal_lr_val_loss_vs_adamw']:+.2f}% vs AdamW")
        console.print(f"{tag} {v['task']} {v['optimizer']}: {detail} (bar: {v['bar']})")


def _print_sweeps(sweeps: dict[str, dict[str, Any]]) -> None:
    for task, sw in sweeps.items():
        names = list(dict.fromkeys(p["optimizer"] for p in sw["points"]))
        score = {(p["optimizer"], p["lr"]): p["score"] for p in sw["points"]}
        rows = [[n, *[("*" if sw["tuned"][n]["lr"] == lr else "") + fmt(score.get((n, lr)))
                      for lr in sw["grid"]]] for n in names]
        length = (f"{sw['steps']} steps" if "steps" in sw else
                  f"{sw['epochs']} epochs, {len(sw['seeds'])} seed(s)")
        print_table(f"{task}: LR sweep, {sw['metric']} ({length}; * = tuned)",
                    ["optimizer", *[f"lr {lr:.3g}" for lr in sw["grid"]]], rows)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run ``train``; writes ``train.json`` and ``train.png`` under ``args.out``.

    Returns:
        The report dict (also written as JSON).

    Raises:
        argparse.ArgumentTypeError: invalid options (the CLI prints it as a usage error).
    """
    preset, tasks, names, targets = _check_args(args)
    lr_overrides = parse_lr_overrides(args.lr)
    try:
        device = str(resolve_device(args.device))
    except (ValueError, RuntimeError) as exc:
        raise argparse.ArgumentTypeError(f"--device {args.device}: {exc}") from None
    skipped = {n: reason for n in names
               if (reason := registry.availability(n, targets)) is not None}
    runnable = [n for n in names if n not in skipped]
    configs = {t: _task_config(preset, t, args) for t in tasks}
    console.print(f"gefen-bench train · preset {preset.name}: {preset.description}")
    console.print(escape(f"device {device} · tasks {', '.join(tasks)} · optimizers "
                         f"{', '.join(runnable)}" + (f" · skipped {', '.join(skipped)}"
                                                     if skipped else "")))
    lrs: dict[str, dict[str, float]] = {}
    lr_source: dict[str, dict[str, str]] = {}
    for t in tasks:
        lrs[t], lr_source[t] = {}, {}
        for n in runnable:
            override = lr_overrides.get((t, n), lr_overrides.get((None, n)))
            lrs[t][n] = override if override is not None else _default_lr(configs[t], n)
            lr_source[t][n] = "--lr" if override is not None else (
                f"default ({registry.get_spec(n).lr_scale:g} x AdamW's "
                f"{configs[t]['adamw_lr']:g})")

    results: dict[str, dict[str, Any]] = {t: {} for t in tasks}
    failed: dict[str, str] = {}
    sweeps: dict[str, dict[str, Any]] = {t: {} for t in tasks}
    wall: dict[str, float] = {}
    start = time.perf_counter()
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=console, transient=False)
    scratch = tempfile.TemporaryDirectory(prefix="gefen-bench-train-")
    if any(t in DIGITS_TASKS for t in tasks):
        # Split once here; every digits worker then loads tensors instead of scikit-learn.
        args.digits_data = save_digits_splits(Path(scratch.name) / "digits.pt")
    with scratch, progress:
        bars = _Bars(progress)
        if args.lr_sweep:
            for t in tasks:
                # An explicit --lr wins over the sweep.
                swept = [n for n in runnable
                         if (t, n) not in lr_overrides and (None, n) not in lr_overrides]
                if not swept:
                    continue
                sw = sweeps[t] = _sweep_task(t, swept, configs[t], args, device, targets,
                                             bars)
                sw["tuned"] = {n: choose(sw["points"], n, lrs[t][n]) for n in swept}
                sw["equal_lr"] = {n: equal_lr(sw["points"], n) for n in swept if n != "adamw"}
                for n in swept:
                    if sw["tuned"][n]["chosen"]:
                        lrs[t][n] = sw["tuned"][n]["lr"]
                        lr_source[t][n] = "--lr-sweep (shared grid, validation loss)"
        pairs = [(t, n) for t in tasks for n in runnable]

        def record(k: int, out: JobOutcome) -> None:
            t, n = pairs[k]
            wall[f"{t}/{n}"] = out.wall_s
            if out.status == "ok" and out.result is not None:
                out.result["lr_source"] = lr_source[t][n]
                out.result["process_wall_s"] = out.wall_s
                results[t][n] = out.result
            else:
                failed[f"{t}/{n}"] = f"{out.status}: {out.error}"
                if out.stderr_tail:
                    console.print(f"[red]{t}/{n} {out.status}[/red]: "
                                  + escape(f"{out.error}\n{out.stderr_tail[-2000:]}"))
            # Written after every run, so an interrupted invocation keeps what finished.
            write_json(args.out / "train.json", "train",
                       {"complete": False, "preset": preset.name, "device": device,
                        "lr": lrs, "lr_source": lr_source, "skipped": skipped,
                        "failed": failed, "results": results},
                       seeds=[args.seed, args.data_seed], argv=getattr(args, "argv", None))

        run_jobs([_job(t, n, lrs[t][n], configs[t], args, device, targets) for t, n in pairs],
                 parallel=args.jobs, on_event=bars, timeout_s=args.timeout,
                 threads=args.threads, on_done=record)
    # Report in the registry's order whatever order the runs finished in.
    results = {t: {n: results[t][n] for n in runnable if n in results[t]} for t in tasks}
    total_wall = time.perf_counter() - start
    verdicts = _verdicts(results, sweeps, tuned=bool(args.lr_sweep))
    if args.lr_sweep:
        _print_sweeps({t: sw for t, sw in sweeps.items() if sw})
    _print_tables(results, skipped, failed, verdicts)
    report = {
        "complete": True,
        "preset": preset.name,
        "device": device,
        "tasks": {t: {"config": configs[t]} for t in tasks},
        "optimizers": {n: {"summary": registry.get_spec(n).summary,
                           "lr_scale": registry.get_spec(n).lr_scale} for n in runnable},
        "skipped": skipped,
        "failed": failed,
        "lr": lrs,
        "lr_source": lr_source,
        "lr_sweep": sweeps if args.lr_sweep else None,
        "results": results,
        "verdicts": verdicts,
        "wall_s": {"total": total_wall, "per_process": wall},
        "parallel_jobs": args.jobs,
        "threads_per_job": args.threads,
    }
    out_dir: Path = args.out
    json_path = write_json(out_dir / "train.json", "train", report,
                           seeds=[args.seed, args.data_seed],
                           argv=getattr(args, "argv", None))
    title = f"gefen-bench train --preset {preset.name} · {device}"
    png_path = plot_train(out_dir / "train.png", results.get("lm", {}),
                          results.get("digits", {}), title)
    report["paths"] = {"json": str(json_path), "png": str(png_path)}
    console.print(f"wall time {total_wall:.0f} s")
    console.print(f"JSON: {json_path.resolve()}")
    console.print(f"PNG:  {png_path.resolve()}")
    digits = {t: results[t] for t in DIGITS_TASKS if results.get(t)}
    if digits:
        from .train_digits import plot_digits

        digits_png = plot_digits(out_dir / "digits.png", digits, title)
        report["paths"]["digits_png"] = str(digits_png)
        console.print(f"PNG:  {digits_png.resolve()}")
    return report
