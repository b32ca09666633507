"""Worker job: train the byte-level Llama on standard-library text with one optimizer.

Same model initialisation (``seed``), data order (``data_seed``), schedule and step count
for every optimizer; only the optimizer and its learning rate change.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from . import optimizers as registry
from .data import eval_offsets, gather_windows, stdlib_corpus, window_offsets
from .measure import MemoryMeter, synchronize
from .models import byte_llama, enable_checkpointing, warmup_cosine
from .presets import LMConfig
from .state_bytes import state_bytes_per_param

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_EVAL_BATCH = 32


def _loss(model: torch.nn.Module, windows: torch.Tensor, autocast: bool) -> torch.Tensor:
    inputs, targets = windows[:, :-1], windows[:, 1:]
    with torch.autocast(windows.device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=inputs).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


@torch.no_grad()
def evaluate(model: torch.nn.Module, stream: torch.Tensor, offsets: torch.Tensor,
             cfg: LMConfig, device: torch.device) -> float:
    """Mean next-byte cross-entropy (nats/byte) over the fixed windows ``offsets``."""
    model.eval()
    total = 0.0
    for i in range(0, len(offsets), _EVAL_BATCH):
        chunk = offsets[i:i + _EVAL_BATCH]
        windows = gather_windows(stream, chunk, cfg.seq_len).to(device)
        total += _loss(model, windows, cfg.autocast_bf16).item() * len(chunk)
    model.train()
    return total / len(offsets)


def run_lm_job(job: dict[str, Any], emit: Callable[[dict[str, Any]], None]
               ) -> dict[str, Any]:
    """Train and evaluate; returns curves, final held-out loss, throughput, memory, state size.

    ``job`` keys: ``optimizer``, ``lr``, ``config`` (LMConfig fields), ``device``, ``seed``,
    ``data_seed``, ``eval_split`` (``"test"`` for reports, ``"val"`` for LR sweeps), ``steps``
    (optional override), ``label`` (progress label).
    """
    cfg = LMConfig(**job["config"])
    steps = int(job.get("steps") or cfg.steps)
    device = torch.device(job["device"])
    name, lr = job["optimizer"], float(job["lr"])
    label = job.get("label", name)
    corpus = stdlib_corpus(max_train_bytes=cfg.max_train_bytes)
    held = corpus.test if job.get("eval_split", "test") == "test" else corpus.val
    offsets = window_offsets(len(corpus.train), cfg.seq_len, steps * cfg.batch,
                             seed=int(job.get("data_seed", 1234)))
    curve_eval = eval_offsets(len(held), cfg.seq_len, cfg.eval_windows)
    final_eval = eval_offsets(len(held), cfg.seq_len, cfg.final_eval_windows)

    torch.manual_seed(int(job.get("seed", 0)))
    model = byte_llama(cfg).to(device=device, dtype=_DTYPES[cfg.param_dtype])
    if cfg.checkpointing:
        enable_checkpointing(model)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]

    meter = MemoryMeter(device)
    meter.start()
    opts = registry.build(name, named, lr=lr, weight_decay=cfg.weight_decay, device=device,
                          model=model)
    factor = warmup_cosine(steps, cfg.warmup_frac, cfg.final_lr_frac)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, factor) for o in opts]
    # An optimizer stepping in backward has updated every parameter before a global norm
    # exists: it trains unclipped (reported as grad_clip 0).
    clip = cfg.grad_clip if not registry.get_spec(name).steps_in_backward else 0.0

    train_loss: list[float] = []
    eval_curve: list[tuple[int, float]] = []
    step_s: list[float] = []
    opt_step_s: list[float] = []
    diverged = False
    for i in range(steps):
        windows = gather_windows(corpus.train, offsets[i * cfg.batch:(i + 1) * cfg.batch],
                                 cfg.seq_len).to(device)
        synchronize(device)
        t0 = time.perf_counter()
        loss = _loss(model, windows, cfg.autocast_bf16)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        synchronize(device)
        t1 = time.perf_counter()
        for o in opts:
            o.step()
        synchronize(device)
        t2 = time.perf_counter()
        for o in opts:
            o.zero_grad(set_to_none=True)
        for s in scheds:
            s.step()
        step_s.append(time.perf_counter() - t0)
        opt_step_s.append(t2 - t1)
        if i == 0:
            meter.mark_steady()
        value = loss.item()
        train_loss.append(value)
        if not math.isfinite(value):
            diverged = True
            break
        if (i + 1) % cfg.eval_every == 0 or i + 1 == steps:
            with meter.paused():  # evaluation's batches are not training memory
                eval_curve.append((i + 1, evaluate(model, held, curve_eval, cfg, device)))
        emit({"event": "progress", "label": label, "done": i + 1, "total": steps,
              "loss": value})

    memory = meter.stop()
    state = state_bytes_per_param(opts, params)
    final = (evaluate(model, held, final_eval, cfg, device) if not diverged else float("nan"))
    tokens = cfg.batch * cfg.seq_len
    # Throughput over the steps after the first two: the first learns the codebook and the
    # periods, and the second is the first of the steady kind, which compiles its kernels (an
    # optimizer stepping in backward launches other kernels from its second step on).
    steady = step_s[2:] or step_s[1:] or step_s
    return {
        "task": "lm",
        "optimizer": name,
        "lr": lr,
        "steps": len(train_loss),
        "diverged": diverged,
        "eval_split": job.get("eval_split", "test"),
        "train_loss": [round(v, 5) for v in train_loss],
        "eval_loss": [[s, round(v, 5)] for s, v in eval_curve],
        "final_eval_loss": final,
        "final_eval_tokens": cfg.final_eval_windows * cfg.seq_len,
        "tokens_per_s": tokens * len(steady) / sum(steady),
        "first_step_ms": step_s[0] * 1e3,
        # Every step's wall time, so that one slow step shows apart from a slow steady state.
        "step_ms": [round(v * 1e3, 3) for v in step_s],
        "optimizer_step_ms_median": sorted(opt_step_s)[len(opt_step_s) // 2] * 1e3,
        "memory": memory,
        "state": state,
        "num_params": sum(p.numel() for p in params),
        "grad_clip": clip,
        "optimizer_classes": [type(o).__module__ + "." + type(o).__name__ for o in opts],
        "external_version": job.get("external_version"),
    }
