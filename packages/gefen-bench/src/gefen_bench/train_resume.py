"""``gefen-bench train --resume``: finish a cut-off invocation instead of starting it over.

A device call or a job scheduler can stop ``train`` at any moment; the ``train.json`` it
leaves holds every sweep point and reported run that finished (:mod:`.train`). With
``--resume`` the next invocation reads that file from ``--out``, keeps what it finished and
runs only the rest, so a sweep and its reported runs can span several bounded invocations.

A kept result is only valid for the run it would replace, so the earlier file must come from
the same *plan*: the preset, the device, every task's configuration (with its overrides), the
LR grid, the LR overrides, the seeds and which optimizers run them, and the data seed.
:func:`load` refuses a file whose plan differs and names the keys that differ. The optimizer
list may differ: results of optimizers not asked for are dropped, new ones run.

What is not kept: failed runs and sweep points that raised (they run again), and a reported
run whose LR is not the one this invocation chooses (its sweep point failed before and may
choose differently now).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Keys aggregate_seeds adds to an LM record; a kept per-seed record leaves them out.
_AGGREGATE_KEYS = ("final_eval_loss_runs", "final_eval_loss_std", "seed_spread", "seeds",
                   "runs")


@dataclass
class Previous:
    """What an earlier invocation finished: sweep points by task, and reported runs by
    ``(task, optimizer)`` and seed (each with the ``lr`` it ran at)."""

    points: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    runs: dict[tuple[str, str], dict[int, dict[str, Any]]] = field(default_factory=dict)
    wall: dict[str, float] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)

    def take_runs(self, task: str, name: str, lr: float) -> dict[int, dict[str, Any]]:
        """The kept runs of ``(task, name)`` made at ``lr`` (removed from this record, so
        they are handed out once); runs made at another LR are dropped."""
        runs = self.runs.pop((task, name), {})
        return {seed: r for seed, r in runs.items() if r.get("lr") == lr}


def plan(preset: str, device: str, configs: dict[str, dict[str, Any]],
         sweep_grid: tuple[float, ...] | None, lr_overrides: dict[tuple[str | None, str], float],
         seeds: tuple[int, ...], seeds_for: list[str] | None, data_seed: int) -> dict[str, Any]:
    """Everything a run's result depends on besides its optimizer, as the JSON values a
    report stores (``seeds_for`` None: every optimizer runs every seed)."""
    value = {"preset": preset, "device": device, "configs": configs,
             "sweep_grid": list(sweep_grid) if sweep_grid is not None else None,
             "lr_overrides": {f"{t or '*'}:{n}": lr for (t, n), lr in sorted(
                 lr_overrides.items(), key=lambda kv: (kv[0][0] or "", kv[0][1]))},
             "seeds": list(seeds), "seeds_for": sorted(seeds_for) if seeds_for else None,
             "data_seed": data_seed}
    # Compared with a plan read back from JSON: tuples become lists there.
    return dict(json.loads(json.dumps(value)))


def _number(value: Any) -> float:
    """A loss or score as the report wrote it (NaN as null, infinities as strings) → float."""
    return math.nan if value is None else float(value)


def _lm_seed_runs(record: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Per-seed records of an aggregated LM record: the first seed's full record, the others'
    summaries (what aggregate_seeds needs of them)."""
    runs = record.get("runs") or []
    out: dict[int, dict[str, Any]] = {}
    for i, summary in enumerate(runs):
        if i == 0:
            full = {k: v for k, v in record.items() if k not in _AGGREGATE_KEYS}
            full.update(final_eval_loss=_number(summary["final_eval_loss"]),
                        seed=summary["seed"])
            out[int(summary["seed"])] = full
        else:
            out[int(summary["seed"])] = {**summary, "lr": record.get("lr"),
                                         "final_eval_loss": _number(summary["final_eval_loss"])}
    return out


def load(path: Path, expected: dict[str, Any], names: list[str]) -> Previous:
    """The finished work in the ``train.json`` at ``path`` for an invocation whose
    :func:`plan` is ``expected`` and whose optimizers are ``names``.

    Raises:
        ValueError: ``path`` does not exist or is not a ``gefen-bench train`` report, or its
            plan differs from ``expected`` (the message names the differing keys).
    """
    if not path.is_file():
        raise ValueError(f"--resume: no {path.name} in {path.parent} to resume; run without "
                         "--resume to start")
    try:
        report = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--resume: {path} is not readable JSON ({exc})") from None
    if not str(report.get("schema", "")).startswith("gefen-bench/train/"):
        raise ValueError(f"--resume: {path} is not a gefen-bench train report")
    earlier = report.get("plan")
    if earlier is None:
        raise ValueError(f"--resume: {path} records no plan (written by an older gefen-bench); "
                         "run without --resume")
    differ = sorted(k for k in set(expected) | set(earlier) if expected.get(k) != earlier.get(k))
    if differ:
        raise ValueError(f"--resume: {path} was made by another plan ({', '.join(differ)} "
                         "differ); use the same options, or another --out to start over")
    wanted = set(names)
    prev = Previous()
    for task, sweep in (report.get("lr_sweep") or {}).items():
        prev.points[task] = [{**p, "score": _number(p["score"])} for p in sweep.get("points", [])
                             if p["optimizer"] in wanted and "error" not in p]
    for task, by_name in (report.get("results") or {}).items():
        for name, record in by_name.items():
            if name not in wanted:
                continue
            prev.runs[(task, name)] = (_lm_seed_runs(record) if task == "lm"
                                       else {int(record["seed"]): record})
    per_process = (report.get("wall_s") or {}).get("per_process") or {}
    prev.wall = {tag: s for tag, s in per_process.items() if tag.split("/")[1] in wanted}
    prev.history = [*(report.get("resumed") or []),
                    {"command": report.get("meta", {}).get("command"),
                     "utc": report.get("meta", {}).get("utc"),
                     "versions": report.get("meta", {}).get("versions"),
                     "wall_s": (report.get("wall_s") or {}).get("total")}]
    return prev
