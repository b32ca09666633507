"""Worker job: the digits CNN with one optimizer, over several seeds.

Per seed: the seed fixes the initialisation and the per-epoch shuffles (identical for every
optimizer); the same warm-up + cosine schedule and epoch count apply to all.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from . import optimizers as registry
from .data import digits_splits
from .measure import MemoryMeter, synchronize
from .models import DigitsCNN, warmup_cosine
from .presets import DigitsConfig
from .state_bytes import state_bytes_per_param


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
    """Train one CNN per seed; returns per-seed held-out accuracy/loss curves and summaries.

    ``job`` keys: ``optimizer``, ``lr``, ``config`` (DigitsConfig fields), ``device``,
    ``eval_split`` (``"test"`` or ``"val"``), ``epochs`` (optional override), ``seeds``
    (optional override), ``label``.
    """
    cfg = DigitsConfig(**{**job["config"], "seeds": tuple(job["config"]["seeds"])})
    epochs = int(job.get("epochs") or cfg.epochs)
    seeds = [int(s) for s in (job.get("seeds") or cfg.seeds)]
    device = torch.device(job["device"])
    name, lr = job["optimizer"], float(job["lr"])
    label = job.get("label", name)
    data = digits_splits()
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
        model = DigitsCNN(cfg).to(device)
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
                samples += len(idx)
            synchronize(device)
            train_time += time.perf_counter() - t0
            eval_loss, accuracy = _evaluate(model, x_eval, y_eval)
            curve.append([epoch + 1, round(eval_loss, 5), round(accuracy, 5)])
            if not math.isfinite(eval_loss):
                diverged = True
                break
            emit({"event": "progress", "label": label,
                  "done": k * epochs + epoch + 1, "total": len(seeds) * epochs,
                  "loss": eval_loss})
        state = state_bytes_per_param(opts, [p for _, p in named])
        runs.append({"seed": seed, "eval_curve": curve, "final_eval_loss": curve[-1][1],
                     "accuracy": curve[-1][2], "diverged": diverged})
    memory = meter.stop()
    accs = torch.tensor([r["accuracy"] for r in runs], dtype=torch.float64)
    return {
        "task": "digits",
        "optimizer": name,
        "lr": lr,
        "epochs": epochs,
        "eval_split": job.get("eval_split", "test"),
        "eval_examples": len(y_eval),
        "runs": runs,
        "accuracy_mean": accs.mean().item(),
        "accuracy_std": accs.std().item() if len(runs) > 1 else 0.0,
        "final_eval_loss_mean": sum(r["final_eval_loss"] for r in runs) / len(runs),
        "samples_per_s": samples / train_time if train_time else float("nan"),
        "memory": memory,
        "state": state,
        "external_version": job.get("external_version"),
    }
