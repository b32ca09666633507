"""``gefen-bench train``'s learning-rate sweep: one LR grid shared by every optimizer.

Quality is compared at each optimizer's own tuned LR, and also reported at equal LR: for a
task, every optimizer is trained at every LR of one grid (multiples of
the task's AdamW LR, the same absolute values for all), on fewer steps or epochs and seeds than
the reported run, and scored on the validation split, which is disjoint from the held-out split
the reported runs are scored on. Each optimizer's tuned LR is its best grid point; the same runs
also give the equal-LR comparison at every grid point.

Sweep runs are worker jobs of kind ``"sweep"`` (:func:`run_sweep_job`), queued on the same
job runner as the reported runs (``gefen-bench train``'s ``--jobs``). Nothing a sweep run
reports depends on having a process of its own (its memory figure is not used): with one job
at a time, the package's own optimizers share one process per task (torch imported once); with
more, each (optimizer, LR) point is a job of its own and runs beside the others. An optimizer
from a published package (``--target``) imports as ``gefen`` and never shares a process.
"""

from __future__ import annotations

import math
import time
import traceback
from collections.abc import Callable
from typing import Any

Emit = Callable[[dict[str, Any]], None]


def _training_job(kind: str) -> Callable[[dict[str, Any], Emit], dict[str, Any]]:
    """The job function of one training run of a sweep (``lm`` or ``digits``)."""
    if kind == "lm":
        from .train_lm import run_lm_job

        return run_lm_job
    if kind == "digits":
        from .train_digits import run_digits_job

        return run_digits_job
    raise ValueError(f"unknown sweep job kind {kind!r}; expected lm or digits")


def run_sweep_job(job: dict[str, Any], emit: Emit) -> dict[str, Any]:
    """Run ``job["inner"]`` (the job kind of the task, ``"lm"`` or ``"digits"``) once per
    ``job["points"]`` entry (``{"optimizer", "lr"}``), each as its own training run from the
    same initialisation and data. A point that raises is reported, not fatal.

    Returns:
        ``{"points": [{"optimizer", "lr", "score", "result" | "error"}, ...]}``, ``score`` the
        validation loss (:func:`score`).
    """
    fn = _training_job(job["inner"])
    out = []
    for point in job["points"]:
        sub = {k: v for k, v in job.items() if k not in ("points", "inner")}
        sub.update(kind=job["inner"], optimizer=point["optimizer"], lr=float(point["lr"]),
                   label=f"sweep {job['task']} · {point['optimizer']} · lr {point['lr']:.3g}")
        start = time.perf_counter()
        try:
            result = fn(sub, emit)
            out.append({**point, "score": score(job["task"], result),
                        "result": _summary(result), "run_s": time.perf_counter() - start})
        except Exception as exc:  # noqa: BLE001 - one diverging point must not stop the rest
            out.append({**point, "score": math.inf, "error": f"{type(exc).__name__}: {exc}",
                        "traceback": traceback.format_exc()[-2000:]})
        # The parent keeps each point as it ends, so a cut-off sweep keeps what finished.
        emit({"event": "sweep_point", "task": job["task"], "point": out[-1]})
    return {"points": out}


def score(task: str, result: dict[str, Any]) -> float:
    """Lower is better: the validation loss (LM), or its mean over the seeds (digits tasks);
    ``inf`` for a run that diverged."""
    value = result.get("final_eval_loss") if task == "lm" else result.get("final_eval_loss_mean")
    return float(value) if value is not None and math.isfinite(value) else math.inf


def _summary(result: dict[str, Any]) -> dict[str, Any]:
    keys = ("final_eval_loss", "final_eval_loss_mean", "accuracy_mean", "steps", "diverged",
            "eval_split")
    return {k: result[k] for k in keys if k in result}


def grid_lrs(adamw_lr: float, grid: tuple[float, ...]) -> list[float]:
    """The absolute LRs of a task's shared grid (``grid`` multiplies AdamW's preset LR)."""
    return [adamw_lr * g for g in grid]


def choose(points: list[dict[str, Any]], name: str, fallback: float) -> dict[str, Any]:
    """``name``'s tuned LR: its grid point of least validation loss (ties: the smaller LR);
    ``fallback`` where every point diverged or failed."""
    mine = sorted((p for p in points if p["optimizer"] == name), key=lambda p: p["lr"])
    finite = [p for p in mine if math.isfinite(p["score"])]
    if not finite:
        return {"lr": fallback, "score": math.inf, "at_edge": False, "chosen": False}
    best = min(finite, key=lambda p: p["score"])
    return {"lr": best["lr"], "score": best["score"], "chosen": True,
            # At the end of the grid the optimum may lie outside it.
            "at_edge": best["lr"] in (mine[0]["lr"], mine[-1]["lr"]) and len(mine) > 1}


def equal_lr(points: list[dict[str, Any]], name: str, ref: str = "adamw") -> list[dict[str, Any]]:
    """At every grid LR both ran at: ``name``'s validation loss against ``ref``'s."""
    by = {(p["optimizer"], p["lr"]): p["score"] for p in points}
    rows = []
    for (opt, lr), value in sorted(by.items(), key=lambda kv: kv[0][1]):
        if opt != name or (ref, lr) not in by:
            continue
        other = by[(ref, lr)]
        gap = value / other - 1 if math.isfinite(value) and math.isfinite(other) and other else None
        rows.append({"lr": lr, "val_loss": value, "ref_val_loss": other, "vs_ref": gap})
    return rows
