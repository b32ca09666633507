"""``gefen-bench train``'s reporting: seeds aggregated, the verdicts, the terminal tables.

A reported LM run may be repeated over several model-initialisation seeds (``--seeds``);
:func:`aggregate_seeds` folds them into one record whose ``final_eval_loss`` is the mean and
whose spread is the relative range of the seeds' held-out losses. :func:`verdicts` compares
means and says when a gap lies within that spread.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from rich.markup import escape

from .report import console, fmt, mib, print_table

# The bar on every task: held-out loss (mean over seeds) within 2% of AdamW's, each optimizer
# at its own tuned LR; on the LM also at most 1/3 of AdamW's state.
LOSS_TOLERANCE = 0.02
LM_STATE_RATIO = 1 / 3
# The stricter reading of the bar: a gap of at most 1%, or of at most the measured
# seed spread where that is larger (reported beside the pass/miss of the 2% bar).
TIGHT_TOLERANCE = 0.01


def aggregate_seeds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One LM record from per-seed results (``runs`` in seed order, each with ``seed``).

    The record is the first seed's result (its curves, memory, throughput and state) with
    ``final_eval_loss`` replaced by the mean over the seeds that did not diverge, and
    ``final_eval_loss_runs``, ``final_eval_loss_std`` (sample standard deviation, 0 for one
    seed), ``seed_spread`` (``(max - min) / mean`` of the held-out losses, 0 for one seed)
    and ``runs`` (per seed: ``seed``, ``final_eval_loss``, ``tokens_per_s``, ``steps``,
    ``diverged``, ``process_wall_s``) added. A diverged seed makes the mean NaN.
    """
    if not runs:
        raise ValueError("aggregate_seeds needs at least one run")
    losses = [float(r["final_eval_loss"]) for r in runs]
    finite = all(math.isfinite(v) for v in losses)
    mean = statistics.fmean(losses) if finite else float("nan")
    out = dict(runs[0])
    out.update(
        final_eval_loss=mean,
        final_eval_loss_runs=losses,
        final_eval_loss_std=(statistics.stdev(losses) if finite and len(losses) > 1 else 0.0),
        seed_spread=((max(losses) - min(losses)) / mean if finite and mean else 0.0),
        seeds=[r.get("seed") for r in runs],
        runs=[{k: r.get(k) for k in ("seed", "final_eval_loss", "tokens_per_s", "steps",
                                     "diverged", "process_wall_s")} for r in runs],
    )
    return out


def held_out_loss(task: str, r: dict[str, Any]) -> float:
    """The figure compared across optimizers: LM held-out loss (mean over its seeds), or the
    digits tasks' held-out loss mean over their seeds."""
    return r["final_eval_loss"] if task == "lm" else r["final_eval_loss_mean"]


def verdicts(results: dict[str, dict[str, Any]], sweeps: dict[str, dict[str, Any]],
              tuned: bool) -> list[dict[str, Any]]:
    """Every Gefen-family optimizer against AdamW on every task: held-out loss within 2%
    (mean over seeds), each at its own LR (tuned by the sweep when ``tuned``); on the LM
    also at most 1/3 of AdamW's state. The equal-LR gap (validation, sweep runs) at AdamW's
    tuned LR is reported beside it.

    On the LM, where either side ran several seeds, ``seed_spread`` is the larger of the two
    optimizers' spreads (:func:`aggregate_seeds`), ``within_seed_spread`` says whether the
    gap's magnitude lies within it, and ``within_1pct_or_spread`` whether the gap is at most
    1% or at most that spread, whichever is larger."""
    out: list[dict[str, Any]] = []
    at = "each at its own tuned LR" if tuned else "at the LRs given"
    for task, res in results.items():
        ref = res.get("adamw")
        if ref is None:
            continue
        for name, r in res.items():
            if not name.startswith("gefen"):
                continue
            ratio = held_out_loss(task, r) / held_out_loss(task, ref) - 1
            v: dict[str, Any] = {"task": task, "optimizer": name, "lr": r["lr"],
                                 "adamw_lr": ref["lr"], "held_out_loss_vs_adamw": ratio}
            ok = ratio <= LOSS_TOLERANCE
            bar = f"held-out loss <= AdamW's +2% ({at})"
            if task == "lm":
                v["state_vs_adamw"] = (r["state"]["bytes_per_param"]
                                       / ref["state"]["bytes_per_param"])
                ok = ok and v["state_vs_adamw"] <= LM_STATE_RATIO
                bar += " at <= 1/3 of its state"
                seeds = {"adamw": len(ref.get("final_eval_loss_runs") or [1]),
                         name: len(r.get("final_eval_loss_runs") or [1])}
                spread = max(float(ref.get("seed_spread") or 0.0),
                             float(r.get("seed_spread") or 0.0))
                v["seeds"] = seeds
                v["seed_spread"] = spread if max(seeds.values()) > 1 else None
                v["within_seed_spread"] = (abs(ratio) <= spread
                                           if v["seed_spread"] is not None else None)
                v["within_1pct_or_spread"] = abs(ratio) <= max(TIGHT_TOLERANCE, spread)
            else:
                v["accuracy_vs_adamw"] = r["accuracy_mean"] - ref["accuracy_mean"]
            sweep = sweeps.get(task)
            if sweep and name in sweep.get("equal_lr", {}):
                same = [e for e in sweep["equal_lr"][name] if e["lr"] == ref["lr"]]
                v["equal_lr_val_loss_vs_adamw"] = same[0]["vs_ref"] if same else None
            out.append({**v, "pass": bool(ok), "bar": bar})
    return out


def print_tables(results: dict[str, dict[str, Any]], skipped: dict[str, str],
                 failed: dict[str, str], verdicts: list[dict[str, Any]]) -> None:
    """The terminal tables of every task that ran, what was skipped or failed, the verdicts."""
    lm = results.get("lm", {})
    if lm:
        ref = lm.get("adamw", {}).get("final_eval_loss")
        rows = [[n, f"{r['lr']:.3g}", r["final_eval_loss"],
                 _seed_cell(r),
                 None if not ref else f"{100 * (r['final_eval_loss'] / ref - 1):+.2f}%",
                 f"{r['tokens_per_s']:.0f}", r["optimizer_step_ms_median"],
                 mib(r["memory"]["peak_bytes"]), mib(r["memory"]["peak_over_start_bytes"]),
                 mib(r["memory"].get("steady_peak_bytes")),
                 r["state"]["bytes_per_param"]] for n, r in lm.items()]
        print_table("byte-level LM on stdlib sources (held-out split; loss: mean over seeds)",
                    ["optimizer", "lr", "held-out loss", "seeds (spread)", "vs AdamW",
                     "tokens/s", "opt.step ms", "peak MiB", "peak over start MiB",
                     "steady peak MiB", "state B/param"], rows)
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
        if v.get("seed_spread") is not None:
            within = "within" if v["within_seed_spread"] else "outside"
            detail += (f", {within} the seed spread {100 * v['seed_spread']:.2f}% "
                       f"(seeds {v['seeds']['adamw']} and {v['seeds'][v['optimizer']]})")
        if v.get("equal_lr_val_loss_vs_adamw") is not None:
            detail += (f"; at equal LR {v['adamw_lr']:.3g}: validation loss "
                       f"{100 * v['equal_lr_val_loss_vs_adamw']:+.2f}% vs AdamW")
        console.print(f"{tag} {v['task']} {v['optimizer']}: {detail} (bar: {v['bar']})")


def _seed_cell(r: dict[str, Any]) -> str:
    runs = r.get("final_eval_loss_runs") or [r["final_eval_loss"]]
    if len(runs) == 1:
        return "1"
    return f"{len(runs)} ({100 * r['seed_spread']:.2f}%)"


def print_sweeps(sweeps: dict[str, dict[str, Any]]) -> None:
    """Per task, every optimizer's validation loss at every grid LR (``*``: the tuned one)."""
    for task, sw in sweeps.items():
        names = list(dict.fromkeys(p["optimizer"] for p in sw["points"]))
        score = {(p["optimizer"], p["lr"]): p["score"] for p in sw["points"]}
        tuned = sw.get("tuned", {})
        rows = [[n, *[("*" if n in tuned and tuned[n]["lr"] == lr else "") + fmt(score.get((n, lr)))
                      for lr in sw["grid"]]] for n in names]
        length = (f"{sw['steps']} steps" if "steps" in sw else
                  f"{sw['epochs']} epochs, {len(sw['seeds'])} seed(s)")
        print_table(f"{task}: LR sweep, {sw['metric']} ({length}; * = tuned)",
                    ["optimizer", *[f"lr {lr:.3g}" for lr in sw["grid"]]], rows)


