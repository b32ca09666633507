"""``gefen-bench fit``: the largest Llama-shaped model each optimizer can train on this device.

For every optimizer, the largest model of one fixed family (:func:`family_config`: width and
depth grow together by one rule) whose full training step — forward, backward, the
optimizer step (``opt.step()``, or the updates inside backward for an entry that steps
there), bf16 parameters and gradients, a stated batch and sequence length, activation
checkpointing on or off as stated — runs without running out of memory. The size index is
found by bisection; each probe runs in its own process (:mod:`.jobs`), so an out-of-memory
error leaves no allocator state behind and every probe starts from an empty device.

Memory budget:

* CUDA: ``torch.cuda.set_per_process_memory_fraction(budget / total)`` caps the caching
  allocator, and a probe fits when two full training steps (the first allocates the
  optimizer state) raise no out-of-memory error. Peak: ``max_memory_allocated`` over the
  second step.
* CPU: torch has no allocator cap, so the budget is *accounted*: a probe's peak is the bytes
  of parameters, gradients and optimizer state plus the tensors the forward pass saves for
  backward (counted through ``torch.autograd.graph.saved_tensors_hooks``), and it fits when
  that is within the budget. This is what the CPU tests use to exercise the search; it is
  not a measurement of the process's memory.

Memory breakdown of a fit: ``params`` (bytes of the parameters), ``grads`` (bytes of the
gradients present after backward; none for an entry that steps inside backward),
``optimizer_state`` (:mod:`.state_bytes`) and ``activations_other`` (the peak minus those
three: saved activations, logits, workspace, allocator rounding).
"""

from __future__ import annotations

import argparse
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rich.markup import escape

from . import optimizers as registry
from .jobs import run_job
from .report import console, markdown_table, print_table, write_json

DEFAULT_OPTIMIZERS = "adamw,adamw-fp32-state,gefen,gefen-in-backward"
# The references every other optimizer's largest model is divided by.
REFERENCES = {"adamw": "AdamW, bf16 state", "adamw-fp32-state": "AdamW, fp32 state"}
LLAMA3_VOCAB = 128_256
HEAD_DIM = 64

Probe = Callable[[int], dict[str, Any]]


def kv_heads(heads: int) -> int:
    """Grouped-query attention: the largest divisor of ``heads`` that is at most a quarter of
    it (at least 1)."""
    return max(d for d in range(1, max(1, heads // 4) + 1) if heads % d == 0)


def family_config(size: int, vocab: int = LLAMA3_VOCAB) -> dict[str, int]:
    """The Llama-shaped model of size index ``size`` (an integer >= 2).

    The rule: hidden size ``64 * size``; ``size // 2`` layers; ``size`` attention heads of
    64; key/value heads :func:`kv_heads`; MLP width 4 x hidden; untied input embedding and
    LM head over ``vocab`` tokens (Llama-3's 128,256 by default); no biases. Size 32 is
    Llama-3.2-1B's body (hidden 2048, 16 layers, 32/8 heads, MLP 8192) and size 64 is
    Llama-3.1-8B's width and depth (hidden 4096, 32 layers). Parameters grow about as
    ``size ** 3``: each size index is about ``3 / size`` more parameters than the last.

    Raises:
        ValueError: ``size`` < 2 or ``vocab`` < 2.
    """
    if size < 2:
        raise ValueError(f"size must be >= 2 (one layer of hidden 128), got {size}")
    if vocab < 2:
        raise ValueError(f"vocab must be >= 2, got {vocab}")
    hidden = HEAD_DIM * size
    return {"size": size, "hidden_size": hidden, "num_hidden_layers": size // 2,
            "num_attention_heads": size, "num_key_value_heads": kv_heads(size),
            "intermediate_size": 4 * hidden, "vocab_size": vocab}


def param_count(cfg: dict[str, int]) -> int:
    """Parameters of :func:`family_config`'s model, from its shapes."""
    d, v, f = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    kv = cfg["num_key_value_heads"] * HEAD_DIM
    layer = 2 * d * d + 2 * d * kv + 3 * d * f + 2 * d  # q, o; k, v; gate, up, down; 2 norms
    return cfg["num_hidden_layers"] * layer + 2 * v * d + d


def build_model(cfg: dict[str, int], seq_len: int) -> Any:
    """A ``transformers.LlamaForCausalLM`` of ``cfg`` (no weights downloaded), on the current
    default device and dtype."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"], max_position_embeddings=seq_len,
        tie_word_embeddings=False, use_cache=False, bos_token_id=None, eos_token_id=None,
        pad_token_id=None)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def _is_oom(exc: BaseException) -> bool:
    import torch

    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in text
                                              or "alloc_failed" in text
                                              or "can't allocate memory" in text)


def run_fit_probe(job: dict[str, Any], emit: Callable[[dict[str, Any]], None]
                  ) -> dict[str, Any]:
    """Worker job (kind ``"fit"``): can ``job["optimizer"]`` train model ``job["size"]``?

    ``job`` keys: ``optimizer``, ``size``, ``vocab``, ``batch``, ``seq_len``,
    ``checkpointing`` (bool), ``device``, ``budget_bytes``, ``target`` (published package).

    Returns:
        ``{"fits": bool, "oom": str | None, "size", "params", "peak_bytes",
        "breakdown": {"params", "grads", "optimizer_state", "activations_other"},
        "budget_method"}``; bytes throughout. An out-of-memory error (or, on CPU, an
        accounted peak above the budget) is a result (``fits`` false), not a failure.
    """
    import torch
    import torch.nn.functional as F

    from .models import enable_checkpointing
    from .state_bytes import state_bytes_per_param

    device = torch.device(job["device"])
    cfg = family_config(int(job["size"]), int(job["vocab"]))
    budget = int(job["budget_bytes"])
    name = job["optimizer"]
    params_count = param_count(cfg)
    out: dict[str, Any] = {"size": cfg["size"], "config": cfg, "params": params_count,
                           "fits": False, "oom": None, "peak_bytes": None, "breakdown": None}
    if device.type == "cuda":
        if device.index is None:  # the allocator cap needs an indexed device
            device = torch.device("cuda", torch.cuda.current_device())
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), device)
        out["budget_method"] = "torch.cuda.set_per_process_memory_fraction"
    else:
        out["budget_method"] = ("accounted: params + grads + optimizer state + tensors saved "
                                "for backward")
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        try:
            storage = t.untyped_storage()
            saved[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, NotImplementedError):
            pass
        return t

    try:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            torch.manual_seed(0)
            with torch.device(device):
                model = build_model(cfg, int(job["seq_len"]))
        finally:
            torch.set_default_dtype(previous)
        model.train()
        if job.get("checkpointing"):
            enable_checkpointing(model)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        params = [p for _, p in named]
        opts = registry.build(name, named, lr=1e-4, weight_decay=0.0, device=device,
                              model=model)
        tokens = torch.randint(0, cfg["vocab_size"], (int(job["batch"]), int(job["seq_len"]) + 1),
                               generator=torch.Generator().manual_seed(0)).to(device)
        grads = 0
        for step in range(2):
            if step == 1 and device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            saved.clear()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                logits = model(input_ids=tokens[:, :-1]).logits
                loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                       tokens[:, 1:].reshape(-1))
            del logits
            loss.backward()
            grads = sum(p.grad.numel() * p.grad.element_size() for p in params
                        if p.grad is not None)
            for o in opts:
                o.step()
            for o in opts:
                o.zero_grad(set_to_none=True)
            emit({"event": "progress", "label": f"fit {name} · size {cfg['size']}",
                  "done": step + 1, "total": 2})
        state = state_bytes_per_param(opts, params)["state_bytes"]
        param_bytes = sum(p.numel() * p.element_size() for p in params)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device)
        else:
            peak = param_bytes + grads + state + sum(saved.values())
        # CUDA: the allocator cap has already said no by raising; CPU: the accounted peak.
        fits = device.type == "cuda" or peak <= budget
        out.update(peak_bytes=peak, fits=fits,
                   breakdown={"params": param_bytes, "grads": grads, "optimizer_state": state,
                              "activations_other": peak - param_bytes - grads - state})
        if not out["fits"]:
            out["oom"] = f"accounted peak {peak} B is over the budget of {budget} B"
    except Exception as exc:  # noqa: BLE001 - out of memory is a result; the rest re-raise
        if not _is_oom(exc):
            raise
        out["oom"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    return out


def largest_fit(probe: Probe, *, start: int, max_size: int, budget: int,
                min_size: int = 2) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """The largest size in ``[min_size, max_size]`` for which ``probe(size)["fits"]``,
    assuming fitting is monotone in size, by bisection of the bracket (largest fit, smallest
    non-fit) from ``start``.

    Pivots alternate between the midpoint of the bracket (twice the largest fit while no size
    has failed) and a prediction from the largest fit's
    breakdown (:func:`predict_size`), clamped into the bracket; the bracket shrinks at every
    probe, so the search ends, and the midpoint probes bound it to about twice plain
    bisection's count.

    Returns:
        (the largest fitting probe's result or ``None`` when even ``min_size`` does not fit,
        every probe's result in the order run).
    """
    if not min_size <= start <= max_size:
        raise ValueError(f"start {start} is outside [{min_size}, {max_size}]")
    results: dict[int, dict[str, Any]] = {}
    lo, hi = min_size - 1, max_size + 1  # largest known fit, smallest known non-fit
    size, predicted_last = start, False
    while True:
        r = probe(size)
        results[size] = r
        if r["fits"]:
            lo = max(lo, size)
        else:
            hi = min(hi, size)
        if hi - lo <= 1:
            break
        pivot = None
        if lo >= min_size and not predicted_last:
            pivot = predict_size(results[lo], budget)
            predicted_last = True
        else:
            predicted_last = False
        if pivot is None:
            # Nothing fits yet: halve downwards; nothing failed yet: double; else bisect.
            pivot = 2 * lo if lo >= min_size and hi > max_size else (lo + hi) // 2
        size = min(hi - 1, max(lo + 1, pivot))
    probes = list(results.values())
    return (results[lo] if lo >= min_size else None), probes


def predict_size(fit: dict[str, Any], budget: int) -> int | None:
    """The largest size whose peak, scaled from ``fit``'s breakdown, is within ``budget``:
    parameters, gradients and state in proportion to the parameter count, activations and
    the rest in proportion to layers x hidden x (hidden + vocab) / hidden (saved
    activations per token, plus the logits). ``None`` without a breakdown."""
    b = fit.get("breakdown")
    if not b or not fit.get("params"):
        return None
    cfg = fit["config"]
    per_param = (b["params"] + b["grads"] + b["optimizer_state"]) / fit["params"]

    def act_scale(c: dict[str, int]) -> float:
        return c["num_hidden_layers"] * c["hidden_size"] + c["vocab_size"]

    other = max(0, b["activations_other"]) / act_scale(cfg)
    best = None
    for size in range(2, 4096):
        c = family_config(size, cfg["vocab_size"])
        if per_param * param_count(c) + other * act_scale(c) > budget:
            break
        best = size
    return best


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``fit``'s options on ``parser``."""
    parser.add_argument("--optimizers", default=DEFAULT_OPTIMIZERS,
                        help=f"comma-separated optimizer names (default: {DEFAULT_OPTIMIZERS})")
    parser.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda")
    parser.add_argument("--budget-gib", type=float, default=None,
                        help="memory budget in GiB (CUDA default: the whole device; CPU: "
                             "required, an accounted budget)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    parser.add_argument("--seq-len", type=int, default=1024,
                        help="tokens per sequence (default 1024)")
    parser.add_argument("--vocab", type=int, default=LLAMA3_VOCAB,
                        help=f"vocabulary size (default {LLAMA3_VOCAB}, Llama-3's)")
    parser.add_argument("--checkpointing", action=argparse.BooleanOptionalAction, default=True,
                        help="activation checkpointing of every decoder layer (default on)")
    parser.add_argument("--min-size", type=int, default=2, help="smallest size index (default 2)")
    parser.add_argument("--max-size", type=int, default=512,
                        help="largest size index tried (default 512)")
    parser.add_argument("--start", type=int, default=None,
                        help="first size probed (default: from the budget, assuming 16 bytes "
                             "per parameter)")
    parser.add_argument("--target", action="append", metavar="PKG=DIR",
                        help="directory a published package was pip-installed into: "
                             "gefen-x=DIR (0.5.x) or gefen=DIR (1.2.x)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds before one probe is killed (default 600)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="optimizers searched at once, each probe in its own process "
                             "(default 1); on CUDA, jobs x --budget-gib must fit the device")
    parser.add_argument("--out", type=Path, default=Path("gefen-bench-out/fit"),
                        help="directory for fit.json and fit.md")


def _check(args: argparse.Namespace) -> tuple[list[str], str, int, dict[str, str]]:
    import torch

    from .measure import resolve_device
    from .train import parse_assignments

    names = registry.parse_names(args.optimizers)
    try:
        device = resolve_device(args.device)
    except (ValueError, RuntimeError) as exc:
        raise argparse.ArgumentTypeError(f"--device {args.device}: {exc}") from None
    for flag in ("batch", "seq_len", "vocab", "min_size", "max_size"):
        if getattr(args, flag) < (2 if flag in ("vocab", "min_size") else 1):
            raise argparse.ArgumentTypeError(
                f"--{flag.replace('_', '-')} is too small: {getattr(args, flag)}")
    if args.max_size < args.min_size:
        raise argparse.ArgumentTypeError("--max-size must be >= --min-size")
    if args.budget_gib is None:
        if device.type != "cuda":
            raise argparse.ArgumentTypeError(
                "--budget-gib is required off CUDA (e.g. --budget-gib 0.05)")
        budget = torch.cuda.get_device_properties(device).total_memory
    elif not (args.budget_gib > 0 and math.isfinite(args.budget_gib)):
        raise argparse.ArgumentTypeError(f"--budget-gib must be positive, got {args.budget_gib}")
    else:
        budget = int(args.budget_gib * 2**30)
    if args.jobs < 1:
        raise argparse.ArgumentTypeError(f"--jobs must be >= 1, got {args.jobs}")
    if device.type == "cuda" and args.jobs > 1:
        total = torch.cuda.get_device_properties(device).total_memory
        if args.jobs * budget > total:
            # Probes side by side share the device: a probe could fail for want of memory
            # another probe holds, and its model would count as not fitting.
            raise argparse.ArgumentTypeError(
                f"--jobs {args.jobs} x --budget-gib {budget / 2**30:.2f} exceeds the device's "
                f"{total / 2**30:.2f} GiB: lower --jobs or --budget-gib")
    targets = parse_assignments(args.target, "--target")
    return names, str(device), budget, targets


def _default_start(budget: int, vocab: int, min_size: int, max_size: int) -> int:
    size = min_size
    while size < max_size and param_count(family_config(size + 1, vocab)) * 16 <= budget:
        size += 1
    return size


def params_text(n: int) -> str:
    """``1498482688`` → ``"1.50B"``; millions as ``"12.3M"``; smaller counts in full."""
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    return f"{n / 1e6:.1f}M" if n >= 1e6 else str(n)


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def summary_markdown(report: dict[str, Any]) -> str:
    """The README-ready table of ``report`` (largest model, ratios, breakdown in GiB)."""
    refs = [r for r in REFERENCES if report["results"].get(r, {}).get("largest")]
    cols = ["optimizer", "largest model (params)", "size index", *[
        f"vs {REFERENCES[r]}" for r in refs], "params GiB", "grads GiB", "state GiB",
        "activations + other GiB", "peak GiB"]
    rows = []
    for name, r in report["results"].items():
        best = r.get("largest")
        if best is None:
            rows.append([name, "does not fit", "-", *["-" for _ in refs], "-", "-", "-", "-",
                         "-"])
            continue
        b = best["breakdown"]
        rows.append([name, params_text(best["params"]), best["size"],
                     *[f"{r['ratio_to'][ref]:.2f}x" for ref in refs],
                     _gib(b["params"]), _gib(b["grads"]), _gib(b["optimizer_state"]),
                     _gib(b["activations_other"]), _gib(best["peak_bytes"])])
    s = report["setup"]
    head = (f"Largest Llama-shaped model (gefen-bench fit rule) whose full bf16 training step "
            f"runs in {_gib(s['budget_bytes'])} GiB on {report['device_name']}: batch "
            f"{s['batch']} x {s['seq_len']} tokens, vocabulary {s['vocab']}, activation "
            f"checkpointing {'on' if s['checkpointing'] else 'off'}.\n\n")
    return head + markdown_table(cols, rows) + "\n"


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Search every optimizer's largest model; write ``fit.json`` and ``fit.md``.

    Raises:
        argparse.ArgumentTypeError: invalid options (the CLI prints it as a usage error).
    """
    import torch

    names, device, budget, targets = _check(args)
    skipped = {n: why for n in names
               if (why := registry.availability(n, targets)) is not None}
    start = args.start or _default_start(budget, args.vocab, args.min_size, args.max_size)
    if not args.min_size <= start <= args.max_size:
        raise argparse.ArgumentTypeError(
            f"--start {start} is outside [--min-size {args.min_size}, --max-size "
            f"{args.max_size}]")
    setup = {"budget_bytes": budget, "jobs": args.jobs, "batch": args.batch,
             "seq_len": args.seq_len,
             "vocab": args.vocab, "checkpointing": bool(args.checkpointing),
             "param_dtype": "bfloat16", "rule": family_config.__doc__.split("\n\n")[1].strip()
             if family_config.__doc__ else "", "start": start}
    device_name = (torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda")
                   else "CPU (accounted budget)")
    results: dict[str, dict[str, Any]] = {}
    report = {"complete": False, "device": device, "device_name": device_name, "setup": setup,
              "skipped": skipped, "results": results}
    t0 = time.perf_counter()
    lock = threading.Lock()  # results and fit.json, written as each optimizer finishes

    def search(name: str) -> None:
        def probe(size: int) -> dict[str, Any]:
            job = {"kind": "fit", "optimizer": name, "size": size, "vocab": args.vocab,
                   "batch": args.batch, "seq_len": args.seq_len,
                   "checkpointing": bool(args.checkpointing), "device": device,
                   "budget_bytes": budget}
            spec = registry.get_spec(name)
            if spec.external is not None:
                job["target"] = targets[spec.external]
            out = run_job(job, timeout_s=args.timeout)
            if out.status == "ok" and out.result is not None:
                r = {**out.result, "process_wall_s": out.wall_s}
            else:  # a probe that failed otherwise counts as not fitting, with its reason
                r = {"size": size, "params": param_count(family_config(size, args.vocab)),
                     "fits": False, "oom": None, "error": f"{out.status}: {out.error}",
                     "process_wall_s": out.wall_s}
            mark = "fits" if r["fits"] else ("OOM" if r.get("oom") else "FAILED")
            console.print(escape(f"{name}: size {size} ({params_text(r['params'])} params) "
                                 f"{mark} in {out.wall_s:.1f} s"
                                 + (f", peak {_gib(r.get('peak_bytes'))} GiB"
                                    if r.get("peak_bytes") else "")))
            return r

        best, probes = largest_fit(probe, start=start, max_size=args.max_size, budget=budget,
                                   min_size=args.min_size)
        with lock:
            results[name] = {"largest": best, "probes": probes,
                             "steps_in_backward": registry.get_spec(name).steps_in_backward}
            write_json(args.out / "fit.json", "fit", report, seeds=[0],
                       argv=getattr(args, "argv", None))

    for name in names:
        if name in skipped:
            console.print(f"[yellow]skipped[/yellow] {name}: {escape(skipped[name])}")
    todo = [n for n in names if n not in skipped]
    with ThreadPoolExecutor(max_workers=max(1, min(args.jobs, len(todo)))) as pool:
        for future in [pool.submit(search, n) for n in todo]:
            future.result()
    # The order asked for, whichever search finished first.
    ordered = {n: results[n] for n in names if n in results}
    results.clear()
    results.update(ordered)
    for r in results.values():
        best = r["largest"]
        r["ratio_to"] = {ref: (best["params"] / results[ref]["largest"]["params"]
                               if best and results.get(ref, {}).get("largest") else None)
                         for ref in REFERENCES}
    report.update(complete=True, wall_s=time.perf_counter() - t0)
    md = summary_markdown(report)
    rows = [[n, r["largest"]["params"] if r["largest"] else None,
             r["largest"]["size"] if r["largest"] else None,
             *[r["ratio_to"][ref] for ref in REFERENCES], len(r["probes"])]
            for n, r in results.items()]
    print_table(f"gefen-bench fit · {device_name} · budget {_gib(budget)} GiB",
                ["optimizer", "largest params", "size", *[f"vs {v}" for v in
                                                          REFERENCES.values()], "probes"],
                rows)
    path = write_json(args.out / "fit.json", "fit", report, seeds=[0],
                      argv=getattr(args, "argv", None))
    md_path = args.out / "fit.md"
    md_path.write_text(md)
    console.print(md)
    console.print(f"JSON: {path.resolve()}")
    console.print(f"Markdown: {md_path.resolve()}")
    return report
