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
memory figure is its own; ``--seeds`` repeats the LM's reported runs over several
initialisation seeds (mean and spread, :mod:`.train_report`).

Sweep runs and reported runs share one job runner (:class:`~.jobs.JobQueue`, ``--jobs`` at
a time): an optimizer's reported runs start as soon as its own sweep points are in, and
``train.json`` is rewritten after every finished run, so a cut-off invocation keeps what it
finished (``"complete": false``); ``--resume`` runs only what such a file lacks
(:mod:`.train_resume`).
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
from .jobs import JobOutcome, JobQueue
from .measure import resolve_device
from .presets import PRESETS, Preset, as_dict, get_preset, with_overrides
from .report import console, fmt, plot_train, write_json
from .train_report import (
    LM_STATE_RATIO,
    LOSS_TOLERANCE,
    aggregate_seeds,
    print_sweeps,
    print_tables,
    verdicts,
)
from .train_resume import Previous, load, plan
from .train_sweep import choose, equal_lr, grid_lrs

__all__ = ["LM_STATE_RATIO", "LOSS_TOLERANCE", "add_arguments", "run"]
# The name the unit tests import.
_verdicts = verdicts

TASKS = ("lm", "digits", "digits-mlp")
DIGITS_TASKS = ("digits", "digits-mlp")
# The shared LR grid, as multiples of each task's AdamW LR (the same values for every optimizer).
DEFAULT_SWEEP_GRID = (0.5, 1.0, 2.0)


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


def parse_seeds(text: str) -> tuple[int, ...]:
    """``"0,1"`` → ``(0, 1)``: distinct integers, at least one. (argparse names the flag in
    its error.)"""
    try:
        seeds = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a list of integers (e.g. 0,1)") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"{text!r} needs distinct integers")
    return seeds


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
    parser.add_argument("--batch", type=int, default=None,
                        help="override the LM batch (sequences of the preset's length per "
                             "step)")
    parser.add_argument("--sweep-steps", type=int, default=None,
                        help="override the steps of each LM LR-sweep run (the preset's "
                             "sweep_steps; at most --steps)")
    parser.add_argument("--grad-clip", type=float, default=None, metavar="NORM",
                        help="override the LM global gradient-norm clip (0 = none; optimizers "
                             "that step in backward never clip globally)")
    parser.add_argument("--checkpointing", action=argparse.BooleanOptionalAction, default=None,
                        help="override the LM's activation checkpointing of every decoder "
                             "layer (default: the preset's, off in every preset)")
    parser.add_argument("--epochs", type=int, default=None,
                        help="override the epoch count of both digits tasks")
    parser.add_argument("--digits-seeds", type=parse_seeds, default=None, metavar="S,S,...",
                        help="override the seeds of both digits tasks' reported runs (each "
                             "seed initialises the model and orders the batches; default: "
                             "the preset's)")
    parser.add_argument("--seed", type=int, default=0, help="LM model-initialisation seed")
    parser.add_argument("--seeds", type=parse_seeds, default=None, metavar="S,S,...",
                        help="LM model-initialisation seeds of the reported runs (e.g. 0,1): "
                             "held-out loss is reported as the mean and spread over them and "
                             "the verdicts compare means (default: --seed alone; the LR "
                             "sweep uses the first)")
    parser.add_argument("--seeds-for", default=None, metavar="NAMES",
                        help="comma-separated optimizers that run every --seeds seed; the "
                             "others run the first only (default: all)")
    parser.add_argument("--data-seed", type=int, default=1234, help="LM data-order seed")
    parser.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda")
    parser.add_argument("--target", action="append", metavar="PKG=DIR",
                        help="directory a published package was pip-installed into with "
                             "--target: gefen-x=DIR (0.5.x) or gefen=DIR (1.2.x)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per worker process (default: torch's choice)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="worker processes at once, LR-sweep runs and reported runs alike "
                             "(default 1; with more, throughput figures share the device and "
                             "only loss/memory/state compare)")
    parser.add_argument("--timeout", type=float, default=3600.0,
                        help="seconds before one optimizer's run is killed (default 3600)")
    parser.add_argument("--out", type=Path, default=Path("gefen-bench-out/train"),
                        help="directory for train.json and train.png")
    parser.add_argument("--resume", action="store_true",
                        help="keep the sweep points and reported runs that the train.json in "
                             "--out finished (an earlier invocation with the same options, "
                             "cut off) and run only the rest")


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
    for flag in ("steps", "batch", "sweep_steps", "epochs", "threads", "jobs"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise argparse.ArgumentTypeError(
                f"--{flag.replace('_', '-')} must be >= 1, got {value}")
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
        return as_dict(with_overrides(preset.lm, steps=args.steps,
                                      batch=getattr(args, "batch", None),
                                      sweep_steps=getattr(args, "sweep_steps", None),
                                      grad_clip=getattr(args, "grad_clip", None),
                                      checkpointing=getattr(args, "checkpointing", None)))
    cfg = _preset_config(preset, task)
    assert cfg is not None
    return as_dict(with_overrides(cfg, epochs=args.epochs,
                                  seeds=getattr(args, "digits_seeds", None)))


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


def _sweep_extra(task: str, config: dict[str, Any]) -> dict[str, Any]:
    extra: dict[str, Any] = {"eval_split": "val"}
    if task == "lm":
        extra["steps"] = min(config["sweep_steps"], config["steps"])
    else:
        extra["epochs"] = min(config["sweep_epochs"], config["epochs"])
        extra["seeds"] = list(config["seeds"][:config["sweep_seeds"]])
    return extra


def sweep_jobs(task: str, names: list[str], config: dict[str, Any], args: argparse.Namespace,
               device: str, targets: dict[str, str],
               done: frozenset[tuple[str, float]] = frozenset()) -> list[dict[str, Any]]:
    """The LR-sweep jobs of ``task`` (job kind ``"sweep"``, :mod:`.train_sweep`): every
    optimizer of ``names`` at every LR of the task's shared grid but the ``(optimizer, lr)``
    points in ``done``, scored on the validation split, in optimizer order so that each
    optimizer's sweep ends early and its reported runs can start.

    With ``--jobs 1`` the package's own optimizers share one process per task (torch is
    imported once) and each published-package optimizer has one; with more, every (optimizer,
    LR) point is a job of its own, so the points run side by side and the job runner balances
    them with the reported runs.
    """
    lrs = grid_lrs(float(config["adamw_lr"]), args.sweep_grid)
    extra = _sweep_extra(task, config)
    if args.jobs > 1:
        groups = [[(n, lr)] for n in names for lr in lrs]
    else:
        native = [n for n in names if registry.get_spec(n).external is None]
        groups = ([[(n, lr) for n in native for lr in lrs]] if native else []) + [
            [(n, lr) for lr in lrs] for n in names if n not in native]
    groups = [g for g in ([p for p in group if p not in done] for group in groups) if g]
    jobs = []
    for group in groups:
        job = _job(task, group[0][0], group[0][1], config, args, device, targets, **extra)
        job.update(kind="sweep", inner=job["kind"], role="sweep",
                   label=f"sweep {task} · {group[0][0]}" + (
                       f" · lr {group[0][1]:.3g}" if len(group) == 1 else ""),
                   points=[{"optimizer": n, "lr": lr} for n, lr in group])
        jobs.append(job)
    return jobs


class _Invocation:
    """The state of one ``gefen-bench train`` invocation while its jobs run.

    Every job — LR-sweep runs and reported runs — goes through one :class:`~.jobs.JobQueue`.
    When the last sweep point of a (task, optimizer) is in, its tuned LR is chosen and its
    reported runs are queued ahead of the remaining sweep points. ``train.json`` is rewritten
    (atomically, :func:`~.report.write_json`) after every finished run, sweep points
    included, with ``"complete": false`` until the end.
    """

    def __init__(self, args: argparse.Namespace, preset: Preset, tasks: list[str],
                 runnable: list[str], configs: dict[str, dict[str, Any]], device: str,
                 targets: dict[str, str], skipped: dict[str, str],
                 lrs: dict[str, dict[str, float]], lr_source: dict[str, dict[str, str]],
                 seeds: tuple[int, ...], seeds_for: set[str], plan: dict[str, Any],
                 previous: Previous | None = None) -> None:
        self.args, self.preset, self.tasks, self.runnable = args, preset, tasks, runnable
        self.plan, self.previous = plan, previous
        self.configs, self.device, self.targets, self.skipped = configs, device, targets, skipped
        self.lrs, self.lr_source = lrs, lr_source
        self.seeds, self.seeds_for = seeds, seeds_for
        self.results: dict[str, dict[str, Any]] = {t: {} for t in tasks}
        self.seed_runs: dict[tuple[str, str], dict[int, dict[str, Any]]] = {}
        self.failed: dict[str, str] = {}
        self.sweeps: dict[str, dict[str, Any]] = {}
        self.pending: dict[tuple[str, str], set[float]] = {}
        self.wall: dict[str, float] = dict(previous.wall) if previous else {}
        self.start = time.monotonic()
        self.bars: _Bars | None = None
        self.queue = JobQueue(args.jobs, on_event=self.on_event, timeout_s=args.timeout,
                              threads=args.threads, on_done=self.on_done)

    # -- job construction ------------------------------------------------------------------
    def seeds_of(self, task: str, name: str) -> tuple[int, ...]:
        if task != "lm":
            return (self.args.seed,)
        return self.seeds if name in self.seeds_for else self.seeds[:1]

    def final_jobs(self, task: str, name: str) -> list[tuple[dict[str, Any], float]]:
        """The reported runs of ``(task, name)`` at its LR, less those ``--resume`` kept."""
        kept = (self.previous.take_runs(task, name, self.lrs[task][name])
                if self.previous is not None else {})
        out = []
        for seed in self.seeds_of(task, name):
            if seed in kept:
                self.seed_runs.setdefault((task, name), {})[seed] = kept[seed]
                self._fold(task, name)
                continue
            job = _job(task, name, self.lrs[task][name], self.configs[task], self.args,
                       self.device, self.targets)
            job.update(role="final", seed=seed)
            if task == "lm" and len(self.seeds_of(task, name)) > 1:
                job["label"] += f" · seed {seed}"
            # Reported runs are longer than sweep points: queued ahead of them.
            out.append((job, 1.0))
        return out

    def initial_jobs(self) -> list[tuple[dict[str, Any], float]]:
        jobs: list[tuple[dict[str, Any], float]] = []
        lr_overrides = self.args.lr_overrides
        for t in self.tasks:
            swept = [n for n in self.runnable
                     if (t, n) not in lr_overrides and (None, n) not in lr_overrides]
            if not self.args.lr_sweep:
                swept = []
            if swept:
                lrs = grid_lrs(float(self.configs[t]["adamw_lr"]), self.args.sweep_grid)
                self.sweeps[t] = {"grid": lrs, "grid_multipliers": list(self.args.sweep_grid),
                                  **_sweep_extra(t, self.configs[t]),
                                  "metric": "validation loss" + (
                                      "" if t == "lm" else " (mean over seeds)"),
                                  "points": [], "tuned": {}, "equal_lr": {}}
                for n in swept:
                    self.pending[(t, n)] = set(lrs)
                kept = self.previous.points.get(t, []) if self.previous is not None else []
                for point in kept:
                    jobs += self.record_point(t, point)
                done = frozenset((p["optimizer"], p["lr"]) for p in self.sweeps[t]["points"])
                jobs += [(j, 0.0) for j in sweep_jobs(t, swept, self.configs[t], self.args,
                                                      self.device, self.targets, done)]
            for n in self.runnable:
                if n not in swept:
                    jobs += self.final_jobs(t, n)
        return jobs

    # -- recording ---------------------------------------------------------------------------
    def _relative(self, out: JobOutcome) -> dict[str, float]:
        return {"started_s": round(out.started - self.start, 3),
                "wall_s": round(out.wall_s, 3)}

    def record_point(self, task: str, point: dict[str, Any]) -> list[tuple[dict[str, Any], float]]:
        """Keep one sweep point; once ``point``'s optimizer has all its grid points, choose
        its tuned LR and return its reported jobs."""
        key = (task, point["optimizer"])
        left = self.pending.get(key)
        if left is None or point["lr"] not in left:
            return []  # already recorded (from its event), or not part of this sweep
        left.discard(point["lr"])
        sw = self.sweeps[task]
        sw["points"].append(point)
        if left:
            return []
        name = point["optimizer"]
        sw["tuned"][name] = choose(sw["points"], name, self.lrs[task][name])
        if sw["tuned"][name]["chosen"]:
            self.lrs[task][name] = sw["tuned"][name]["lr"]
            self.lr_source[task][name] = "--lr-sweep (shared grid, validation loss)"
        if "adamw" in sw["tuned"]:
            sw["equal_lr"] = {n: equal_lr(sw["points"], n) for n in sw["tuned"] if n != "adamw"}
        return self.final_jobs(task, name)

    def on_event(self, event: dict[str, Any]) -> None:
        """Progress bars; a sweep point finished inside a multi-point sweep process is kept
        (and ``train.json`` rewritten) at once, not when its process ends."""
        if event.get("event") == "sweep_point":
            follow = self.record_point(event["task"], event["point"])
            self.write_partial()
            for job, priority in follow:
                self.queue.submit(job, priority)
            return
        if self.bars is not None:
            self.bars(event)

    def on_done(self, job: dict[str, Any], out: JobOutcome
                ) -> list[tuple[dict[str, Any], float]]:
        task = job["task"]
        follow: list[tuple[dict[str, Any], float]] = []
        if job["role"] == "sweep":
            got = {(p["optimizer"], p["lr"]): p
                   for p in ((out.result or {}).get("points") or [])}
            for p in job["points"]:
                point = got.get((p["optimizer"], p["lr"])) or {
                    **p, "score": math.inf, "error": f"{out.status}: {out.error}"}
                follow += self.record_point(task, point)
                if len(job["points"]) == 1:
                    # A point of its own process: where that process ran on the time line.
                    for kept in self.sweeps[task]["points"]:
                        if (kept["optimizer"], kept["lr"]) == (p["optimizer"], p["lr"]):
                            kept["process"] = self._relative(out)
            if out.status != "ok":
                self._report_failure(f"sweep {task}/{job['optimizer']}", out)
        else:
            name = job["optimizer"]
            tag = f"{task}/{name}" + (f"/seed{job['seed']}" if task == "lm"
                                      and len(self.seeds_of(task, name)) > 1 else "")
            self.wall[tag] = out.wall_s
            if out.status == "ok" and out.result is not None:
                out.result.update(lr_source=self.lr_source[task][name],
                                  process_wall_s=out.wall_s, seed=job["seed"],
                                  process=self._relative(out))
                self.seed_runs.setdefault((task, name), {})[job["seed"]] = out.result
                self._fold(task, name)
            else:
                self.failed[tag] = f"{out.status}: {out.error}"
                self._report_failure(tag, out)
        self.write_partial()
        return follow

    def _fold(self, task: str, name: str) -> None:
        runs = self.seed_runs[(task, name)]
        ordered = [runs[s] for s in self.seeds_of(task, name) if s in runs]
        self.results[task][name] = aggregate_seeds(ordered) if task == "lm" else ordered[0]

    def _report_failure(self, tag: str, out: JobOutcome) -> None:
        if out.stderr_tail or out.error:
            console.print(f"[red]{tag} {out.status}[/red]: "
                          + escape(f"{out.error}\n{out.stderr_tail[-2000:]}"))

    # -- the report ------------------------------------------------------------------------
    def report(self, complete: bool) -> dict[str, Any]:
        results = {t: {n: self.results[t][n] for n in self.runnable if n in self.results[t]}
                   for t in self.tasks}
        out = {
            "complete": complete,
            "preset": self.preset.name,
            "device": self.device,
            "tasks": {t: {"config": self.configs[t]} for t in self.tasks},
            "optimizers": {n: {"summary": registry.get_spec(n).summary,
                               "lr_scale": registry.get_spec(n).lr_scale}
                           for n in self.runnable},
            "skipped": self.skipped,
            "failed": self.failed,
            "lr": self.lrs,
            "lr_source": self.lr_source,
            "lr_sweep": self.sweeps if self.args.lr_sweep else None,
            "lm_seeds": {n: list(self.seeds_of("lm", n)) for n in self.runnable}
            if "lm" in self.tasks else None,
            "results": results,
            "verdicts": verdicts(results, self.sweeps, tuned=bool(self.args.lr_sweep)),
            "wall_s": {"total": time.monotonic() - self.start, "per_process": self.wall},
            "parallel_jobs": self.args.jobs,
            "threads_per_job": self.args.threads,
            "plan": self.plan,
            # The invocations whose finished runs --resume kept, earliest first.
            "resumed": self.previous.history if self.previous is not None else [],
        }
        return out

    def write_partial(self) -> None:
        self.write(self.report(complete=False))

    def write(self, report: dict[str, Any]) -> Path:
        return write_json(self.args.out / "train.json", "train", report,
                          seeds=[*self.seeds, self.args.data_seed],
                          argv=getattr(self.args, "argv", None))

    def run(self) -> dict[str, Any]:
        """Queue the sweep and the runs that need no sweep, run everything, report."""
        for job, priority in self.initial_jobs():
            self.queue.submit(job, priority)
        self.write_partial()
        self.queue.run()
        return self.report(complete=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run ``train``; writes ``train.json`` (after every finished run, and complete at the
    end) and ``train.png`` under ``args.out``.

    Returns:
        The report dict (also written as JSON).

    Raises:
        argparse.ArgumentTypeError: invalid options (the CLI prints it as a usage error).
    """
    preset, tasks, names, targets = _check_args(args)
    args.lr_overrides = parse_lr_overrides(args.lr)
    seeds = tuple(args.seeds) if args.seeds else (args.seed,)
    args.seed = seeds[0]  # the LR sweep's and the digits tasks' initialisation seed
    seeds_for = set(registry.parse_names(args.seeds_for) if args.seeds_for else names)
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
            override = args.lr_overrides.get((t, n), args.lr_overrides.get((None, n)))
            lrs[t][n] = override if override is not None else _default_lr(configs[t], n)
            lr_source[t][n] = "--lr" if override is not None else (
                f"default ({registry.get_spec(n).lr_scale:g} x AdamW's "
                f"{configs[t]['adamw_lr']:g})")

    run_plan = plan(preset.name, device, configs, args.sweep_grid if args.lr_sweep else None,
                    args.lr_overrides, seeds,
                    registry.parse_names(args.seeds_for) if args.seeds_for else None,
                    args.data_seed)
    previous = None
    if args.resume:
        try:
            previous = load(args.out / "train.json", run_plan, runnable)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    state = _Invocation(args, preset, tasks, runnable, configs, device, targets, skipped,
                        lrs, lr_source, seeds, seeds_for, run_plan, previous)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=console, transient=False)
    scratch = tempfile.TemporaryDirectory(prefix="gefen-bench-train-")
    if any(t in DIGITS_TASKS for t in tasks):
        # Split once here; every digits worker then loads tensors instead of scikit-learn.
        args.digits_data = save_digits_splits(Path(scratch.name) / "digits.pt")
    with scratch, progress:
        state.bars = _Bars(progress)
        report = state.run()
    results = report["results"]
    if args.lr_sweep:
        print_sweeps({t: sw for t, sw in state.sweeps.items() if sw["points"]})
    print_tables(results, skipped, state.failed, report["verdicts"])
    json_path = state.write(report)
    title = f"gefen-bench train --preset {preset.name} · {device}"
    png_path = plot_train(args.out / "train.png", results.get("lm", {}),
                          results.get("digits", {}), title)
    report["paths"] = {"json": str(json_path), "png": str(png_path)}
    console.print(f"wall time {report['wall_s']['total']:.0f} s")
    console.print(f"JSON: {json_path.resolve()}")
    console.print(f"PNG:  {png_path.resolve()}")
    digits = {t: results[t] for t in DIGITS_TASKS if results.get(t)}
    if digits:
        from .train_digits import plot_digits

        digits_png = plot_digits(args.out / "digits.png", digits, title)
        report["paths"]["digits_png"] = str(digits_png)
        console.print(f"PNG:  {digits_png.resolve()}")
    return report
