"""Worker job: a digits classifier (CNN or MLP) with one optimizer, over several seeds.

Per seed: the seed fixes the initialisation and the per-epoch shuffles (identical for every
optimizer); the same warm-up + cosine schedule and epoch count apply to all. The model is
the config's ``model``: :class:`~gefen_bench.models.DigitsCNN` (task ``digits``) or
:class:`DigitsMLP` (task ``digits-mlp``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import optimizers as registry
from .data import digits_splits, load_digits_splits
from .measure import MemoryMeter, synchronize
from .models import DigitsCNN, warmup_cosine
from .presets import DigitsConfig
from .report import save_figure
from .state_bytes import state_bytes_per_param

DIGITS_MODELS = ("cnn", "mlp")


class DigitsMLP(nn.Module):
    """Two ReLU hidden layers of ``cfg.hidden`` units on the 64 flattened pixels.

    Input ``[N, 1, 8, 8]`` float32 in [0, 1]; output ``[N, 10]`` logits.
    """

    def __init__(self, cfg: DigitsConfig) -> None:
        super().__init__()
        self.hidden = nn.Sequential(
            nn.Flatten(),
            nn.Linear(64, cfg.hidden), nn.ReLU(),
            nn.Linear(cfg.hidden, cfg.hidden), nn.ReLU(),
        )
        # Named "classifier" so Muon-style routing (docs/algorithm.md#hybrid) sends it to the
        # backup.
        self.classifier = nn.Linear(cfg.hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.hidden(x))


def build_digits_model(cfg: DigitsConfig) -> nn.Module:
    """The classifier ``cfg.model`` names; ValueError for another name."""
    if cfg.model == "cnn":
        return DigitsCNN(cfg)
    if cfg.model == "mlp":
        return DigitsMLP(cfg)
    raise ValueError(f"DigitsConfig.model must be one of {', '.join(DIGITS_MODELS)}, "
                     f"got {cfg.model!r}")


@torch.no_grad()
def _evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    model.eval()
    logits = model(x)
    model.train()
    loss = F.cross_entropy(logits, y).item()
    accuracy = (logits.argmax(dim=1) == y).float().mean().item()
    return loss, accuracy


def run_digits_job(job: dict[str, Any], emit: Callable[[dict[str, Any]], None]
                   ) -> dict[str, Any]:
    """Train one classifier per seed; returns per-seed held-out accuracy/loss curves and summaries.

    ``job`` keys: ``optimizer``, ``lr``, ``config`` (DigitsConfig fields), ``device``,
    ``eval_split`` (``"test"`` or ``"val"``), ``epochs`` (optional override), ``seeds``
    (optional override), ``task`` (name reported, default ``"digits"``), ``label``,
    ``data_path`` (optional: splits written by :func:`~gefen_bench.data.save_digits_splits`;
    otherwise they are built here).

    Each run's ``eval_curve`` lists ``[epoch, held-out loss (nats), held-out accuracy
    (fraction), mean training loss of the epoch (nats)]``.
    """
    cfg = DigitsConfig(**{**job["config"], "seeds": tuple(job["config"]["seeds"])})
    epochs = int(job.get("epochs") or cfg.epochs)
    seeds = [int(s) for s in (job.get("seeds") or cfg.seeds)]
    device = torch.device(job["device"])
    name, lr = job["optimizer"], float(job["lr"])
    label = job.get("label", name)
    data = load_digits_splits(Path(job["data_path"])) if job.get("data_path") else digits_splits()
    x_train, y_train = data.x_train.to(device), data.y_train.to(device)
    if job.get("eval_split", "test") == "test":
        x_eval, y_eval = data.x_test.to(device), data.y_test.to(device)
    else:
        x_eval, y_eval = data.x_val.to(device), data.y_val.to(device)
    n = len(y_train)
    per_epoch = math.ceil(n / cfg.batch)
    total = per_epoch * epochs

    meter = MemoryMeter(device)
    meter.start()
    runs: list[dict[str, Any]] = []
    samples = 0
    train_time = 0.0
    state: dict[str, Any] = {}
    for k, seed in enumerate(seeds):
        torch.manual_seed(seed)
        model = build_digits_model(cfg).to(device)
        named = list(model.named_parameters())
        opts = registry.build(name, named, lr=lr, weight_decay=cfg.weight_decay,
                              device=device, model=model)
        factor = warmup_cosine(total, cfg.warmup_frac, cfg.final_lr_frac)
        scheds = [torch.optim.lr_scheduler.LambdaLR(o, factor) for o in opts]
        curve: list[list[float]] = []
        diverged = False
        for epoch in range(epochs):
            order = torch.randperm(n, generator=torch.Generator().manual_seed(
                seed * 1000 + epoch)).to(device)
            train_loss = torch.zeros((), device=device)
            synchronize(device)
            t0 = time.perf_counter()
            for b in range(per_epoch):
                idx = order[b * cfg.batch:(b + 1) * cfg.batch]
                loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
                loss.backward()
                for o in opts:
                    o.step()
                for o in opts:
                    o.zero_grad(set_to_none=True)
                for s in scheds:
                    s.step()
                train_loss += loss.detach() * len(idx)
                samples += len(idx)
            synchronize(device)
            train_time += time.perf_counter() - t0
            with meter.paused():
                eval_loss, accuracy = _evaluate(model, x_eval, y_eval)
            curve.append([epoch + 1, round(eval_loss, 5), round(accuracy, 5),
                          round(train_loss.item() / n, 5)])
            if not math.isfinite(eval_loss):
                diverged = True
                break
            emit({"event": "progress", "label": label,
                  "done": k * epochs + epoch + 1, "total": len(seeds) * epochs,
                  "loss": eval_loss})
        state = state_bytes_per_param(opts, [p for _, p in named])
        runs.append({"seed": seed, "eval_curve": curve, "final_eval_loss": curve[-1][1],
                     "accuracy": curve[-1][2], "final_train_loss": curve[-1][3],
                     "diverged": diverged})
    memory = meter.stop()
    accs = torch.tensor([r["accuracy"] for r in runs], dtype=torch.float64)
    losses = torch.tensor([r["final_eval_loss"] for r in runs], dtype=torch.float64)
    return {
        "task": job.get("task", "digits"),
        "model": cfg.model,
        "params": sum(p.numel() for _, p in named),
        "optimizer": name,
        "lr": lr,
        "epochs": epochs,
        "steps": total,
        "eval_split": job.get("eval_split", "test"),
        "eval_examples": len(y_eval),
        "runs": runs,
        "accuracy_mean": accs.mean().item(),
        "accuracy_std": accs.std().item() if len(runs) > 1 else 0.0,
        "final_eval_loss_mean": losses.mean().item(),
        "final_eval_loss_std": losses.std().item() if len(runs) > 1 else 0.0,
        "samples_per_s": samples / train_time if train_time else float("nan"),
        "memory": memory,
        "state": state,
        "external_version": job.get("external_version"),
    }


def plot_digits(path: Path, results: dict[str, dict[str, dict[str, Any]]], title: str) -> Path:
    """PNG: per digits task (rows), mean-over-seeds held-out loss (log scale, with the training
    loss dashed) and held-out accuracy against epoch, one colour per optimizer.

    ``results`` maps task name → optimizer name → the result of :func:`run_digits_job`.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = [t for t, r in results.items() if r]
    names = list(dict.fromkeys(n for t in tasks for n in results[t]))
    colours = {n: plt.get_cmap("tab10")(i % 10) for i, n in enumerate(names)}
    fig, axes = plt.subplots(max(1, len(tasks)), 2, figsize=(12, 4 * max(1, len(tasks))),
                             squeeze=False)
    for row, task in zip(axes, tasks):
        for n, r in results[task].items():
            curves = [run["eval_curve"] for run in r["runs"]]
            length = min(len(c) for c in curves)
            epochs = [c[0] for c in curves[0][:length]]

            def mean(col: int, curves: list[Any] = curves, length: int = length) -> list[float]:
                return [sum(c[i][col] for c in curves) / len(curves) for i in range(length)]

            row[0].plot(epochs, mean(1), marker=".", label=f"{n} held-out (lr {r['lr']:.2g})",
                        color=colours[n])
            if all(len(c[0]) > 3 for c in curves):
                row[0].plot(epochs, mean(3), linestyle="--", label=f"{n} train",
                            color=colours[n])
            row[1].plot(epochs, [100 * a for a in mean(2)], marker=".",
                        label=f"{n} ({100 * r['accuracy_mean']:.2f}%)", color=colours[n])
        model = "CNN" if task == "digits" else "MLP"
        row[0].set(title=f"{task} ({model}): loss, mean of seeds", xlabel="epoch",
                   ylabel="cross-entropy (nats)", yscale="log")
        # Zoomed on the finish (the first epochs sit far below it), never hiding a final value.
        lowest = min(100 * r["accuracy_mean"] for r in results[task].values())
        row[1].set(title=f"{task} ({model}): held-out accuracy, mean of seeds",
                   xlabel="epoch", ylabel="%", ylim=(min(90.0, lowest - 2), 100.5))
        for ax in row:
            ax.legend(fontsize=8)
    return save_figure(fig, title, path)
