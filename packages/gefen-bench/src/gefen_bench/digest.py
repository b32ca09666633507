"""``gefen-bench digest``: bit-exact fingerprints of Gefen's results, to compare source trees.

A *case* per parameter set (:mod:`.param_sets`) x route x rounding: the set, built in
``--dtype`` on ``--device`` from seed 0, is stepped ``--steps`` times by ``gefen_core.Gefen``
with its defaults but ``lr=1e-3``, ``weight_decay=0.01`` and ``stochastic_round`` (``nearest``:
False, ``stochastic``: True). Before each step fresh gradients are copied into the same ``.grad``
tensors: float32 normals from a CPU ``torch.Generator`` seeded with 1, cast to ``--dtype``,
drawn once per set and kept on the host (steps x the set's bytes), the same in every case and
tree. Route ``eager`` calls ``opt.step()``; ``captured`` (CUDA only, else skipped with a note;
``--steps`` >= 2) passes ``capturable=True`` and ``lr`` as a float32 device tensor, steps once
eagerly, once on a side stream, then captures a step in a ``torch.cuda.CUDAGraph`` and replays
it (torch's recipe, the helper of ``step``'s ``*-graph`` entries).

Fingerprint: SHA-256 of the raw bytes (contiguous CPU copy viewed as uint8: any dtype's bits) of
each parameter and each ``opt.state`` tensor, by parameter, state keys sorted; non-tensor state
values (``period``) are kept as they are. A combined SHA-256 per case covers each entry's name,
dtype, shape and digest. The JSON ``results["model/route/rounding"]`` holds ``digest``,
``tensors``, ``bytes`` and ``entries`` (``{"sha256", "dtype", "shape"}`` or ``{"value"}``; state
tensors named ``param:key``); ``sources``, the ``gefen_core``/``gefen_kernels`` imported and
their trees' commits. ``--compare A B`` measures nothing: per case equal, differ (naming the
first differing entries) or missing; exit status 1 on any difference or missing case, else 0.

Only API older trees have is used (``Gefen(...)``, ``opt.step()``, ``opt.state``), imported in
:func:`run_case`: another tree's ``gefen_core`` and ``gefen_kernels`` can lead ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from rich.markup import escape

from .measure import resolve_device, synchronize
from .param_sets import MODELS, SCALES, Shapes, build_param_set, shapes_for
from .report import console, print_table, write_json
from .step import _captured

ROUTES = ("eager", "captured")
ROUNDINGS = ("nearest", "stochastic")
LR, WEIGHT_DECAY = 1e-3, 0.01
SEED = 0  # parameters; the gradients' generator uses SEED + 1
SHOWN = 4  # differing entries named per case in the comparison table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``digest``'s options on ``parser``."""
    parser.add_argument("--models", default="gpt2,llama,llama-lora",
                        help=f"comma-separated, of {', '.join(MODELS)} (default: the first 3)")
    parser.add_argument("--routes", default="eager,captured",
                        help="comma-separated: eager, captured (CUDA only; default both)")
    parser.add_argument("--rounding", default="nearest,stochastic",
                        help="comma-separated: nearest, stochastic (default both)")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps (default 4)")
    parser.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="parameter and gradient dtype (default bfloat16)")
    parser.add_argument("--scale", default="full", choices=SCALES,
                        help="full shapes, or tiny ones with the same structure (CPU tests)")
    parser.add_argument("--deterministic", action="store_true",
                        help="Gefen(deterministic=True) (docs/algorithm.md#deterministic)")
    parser.add_argument("--repeat", action="store_true",
                        help="run each case twice; record whether the digests agree")
    parser.add_argument("--out", type=Path, default=Path("gefen-bench-out/digest.json"))
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"),
                        help="compare two digest JSON files instead; exit 1 unless all equal")


def _items(text: str, flag: str, allowed: tuple[str, ...]) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    for x in items or [""]:
        if x not in allowed:
            raise argparse.ArgumentTypeError(
                f"{flag}: unknown value {x!r}; available: {', '.join(allowed)}")
    return items


def fingerprint(named: Sequence[tuple[str, torch.Tensor]], opt: Any) -> dict[str, Any]:
    """``{"digest", "tensors", "bytes", "entries"}`` of the parameters and ``opt.state``
    (module docstring)."""
    entries: dict[str, dict[str, Any]] = {}
    n_bytes = 0
    for name, p in named:
        state = opt.state.get(p, {})
        for label, value in [(name, p), *((f"{name}:{k}", state[k]) for k in sorted(state))]:
            if isinstance(value, torch.Tensor):
                raw = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
                n_bytes += raw.numel()
                entries[label] = {"sha256": hashlib.sha256(raw.numpy().data).hexdigest(),
                                  "dtype": str(value.dtype).removeprefix("torch."),
                                  "shape": list(value.shape)}
            else:
                plain = value is None or isinstance(value, (bool, int, float, str))
                entries[label] = {"value": value if plain else repr(value)}
    combined = hashlib.sha256()
    for label, entry in entries.items():
        combined.update(json.dumps([label, entry], sort_keys=True).encode() + b"\n")
    return {"digest": combined.hexdigest(), "tensors": sum("sha256" in e for e in
            entries.values()), "bytes": n_bytes, "entries": entries}


def run_case(shapes: Shapes, grads: list[list[torch.Tensor]], route: str, rounding: str, *,
             device: torch.device, dtype: torch.dtype, deterministic: bool = False
             ) -> dict[str, Any]:
    """One case (module docstring): build the set, step ``len(grads)`` times, fingerprint."""
    import gefen_core

    torch.manual_seed(SEED)
    named = build_param_set(shapes, device=device, dtype=dtype, seed=SEED)
    captured = route == "captured"
    opt = gefen_core.Gefen(named, lr=torch.tensor(LR, device=device) if captured else LR,
                           weight_decay=WEIGHT_DECAY, stochastic_round=rounding == "stochastic",
                           capturable=captured, deterministic=deterministic)
    step: Callable[[], Any] = opt.step
    for k in range(len(grads)):
        for (_, p), g in zip(named, grads[k]):
            p.grad.copy_(g)  # type: ignore[union-attr]  # build_param_set made every .grad
        if captured and k == 1:  # this step runs on a side stream, then one step is captured
            step = _captured(opt.step, device, warmup=1)
        else:
            step()
    synchronize(device)
    return fingerprint(named, opt)


def _source(module_name: str) -> dict[str, str | None]:
    """Directory of an imported package and its tree's commit, ``-dirty`` appended when tracked
    files differ from it; ``None`` outside a git checkout or where git does not track the
    package's files (a copy, e.g. from ``git archive``, inside another checkout)."""
    import importlib

    path = str(Path(importlib.import_module(module_name).__file__ or "").parent)
    try:
        tracked = subprocess.run(["git", "-C", path, "ls-files", "--error-unmatch", "."],
                                 capture_output=True, text=True, timeout=10)
        if tracked.returncode != 0:
            return {"path": path, "commit": None}
        done = subprocess.run(["git", "-C", path, "describe", "--always", "--dirty",
                               "--abbrev=40"], capture_output=True, text=True, timeout=10)
        return {"path": path, "commit": done.stdout.strip() if done.returncode == 0 else None}
    except (OSError, subprocess.SubprocessError):
        return {"path": path, "commit": None}


def _load(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"--compare {path}: {exc}") from None
    if not isinstance(doc, dict) or doc.get("schema") != "gefen-bench/digest/1":
        raise argparse.ArgumentTypeError(f"--compare {path}: not a digest JSON (schema "
                                         "gefen-bench/digest/1); write one with --out")
    return doc


def compare(path_a: Path, path_b: Path) -> dict[str, Any]:
    """Compare two digest files case by case and print the table.

    Raises:
        argparse.ArgumentTypeError: a file is unreadable or not a digest JSON.
        SystemExit: status 1 unless every case of either file is in both and equal.
    """
    a, b = _load(path_a), _load(path_b)
    ra, rb = a["results"], b["results"]
    rows, cases = [], {}
    for key in dict.fromkeys([*ra, *rb]):
        if key not in ra or key not in rb:
            result, detail = f"missing in {'A' if key not in ra else 'B'}", []
        else:
            ea, eb = ra[key]["entries"], rb[key]["entries"]
            detail = [n for n in dict.fromkeys([*ea, *eb]) if ea.get(n) != eb.get(n)]
            result = "equal" if ra[key]["digest"] == rb[key]["digest"] else "differ"
        flaky = [x for x, r in (("A", ra), ("B", rb)) if r.get(key, {}).get("repeatable") is False]
        cases[key] = {"result": result, "differing": detail, "unrepeatable_in": flaky}
        more = f" (+{len(detail) - SHOWN} more)" if len(detail) > SHOWN else ""
        note = [", ".join(detail[:SHOWN]) + more] if detail else []
        note += [f"not repeatable in {'+'.join(flaky)}"] if flaky else []
        rows.append([key, result, escape("; ".join(note) or "-")])
    for label, doc, path in (("A", a, path_a), ("B", b, path_b)):
        core = doc["sources"]["gefen_core"]
        console.print(escape(f"{label}: {path} · gefen_core {core['path']} ({core['commit']})"))
    mismatched = [f"{f} {a.get(f)} vs {b.get(f)}" for f in ("device_name", "dtype", "scale",
                  "steps", "deterministic") if a.get(f) != b.get(f)]
    if mismatched:
        console.print(escape("setups differ: " + ", ".join(mismatched)))
    print_table("gefen-bench digest: A vs B", ["case", "result", "first differing entries"],
                rows, caption=None if cases else "neither file has results: nothing compared")
    equal = bool(cases) and all(c["result"] == "equal" for c in cases.values())
    if not equal:
        raise SystemExit(1)
    return {"equal": equal, "setup_mismatch": mismatched, "cases": cases}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Fingerprint every case and write ``args.out``, or with ``--compare`` compare two files.

    Raises:
        argparse.ArgumentTypeError: invalid options (the CLI prints it as a usage error).
        SystemExit: status 1 from ``--compare`` when a case differs or is missing.
    """
    if args.compare is not None:
        return compare(*args.compare)
    try:
        device = resolve_device(args.device)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--device {args.device}: {exc}") from None
    models = _items(args.models, "--models", MODELS)
    routes = _items(args.routes, "--routes", ROUTES)
    roundings = _items(args.rounding, "--rounding", ROUNDINGS)
    if args.steps < (2 if "captured" in routes and device.type == "cuda" else 1):
        raise argparse.ArgumentTypeError(f"--steps must be >= 1, and >= 2 with the captured "
                                         f"route on CUDA; got {args.steps}")
    dtype = getattr(torch, args.dtype)
    results: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    for model in models:
        shapes = shapes_for(model, args.scale)
        gen = torch.Generator().manual_seed(SEED + 1)  # the gradients, per step per tensor
        grads = [[torch.randn(s, generator=gen).to(dtype) for _, s in shapes]
                 for _ in range(args.steps)]
        for key in (f"{model}/{r}/{n}" for r in routes for n in roundings):
            _, route, rounding = key.split("/")
            if route == "captured" and device.type != "cuda":
                skipped[key] = "the captured route needs CUDA (torch.cuda.CUDAGraph)"
                console.print(f"[yellow]skipped[/yellow] {key}: {skipped[key]}")
                continue
            t0 = time.perf_counter()
            r, *again = [run_case(shapes, grads, route, rounding, device=device, dtype=dtype,
                                  deterministic=args.deterministic)
                         for _ in range(2 if args.repeat else 1)]
            if again:
                r["repeatable"] = again[0]["digest"] == r["digest"]
            r["wall_s"] = time.perf_counter() - t0
            results[key] = r
            console.print(f"{key}: {r['digest'][:16]} · {r['tensors']} tensors, "
                          f"{r['bytes'] / 2**20:.1f} MiB hashed · {r['wall_s']:.1f} s"
                          + (f" · repeatable {r['repeatable']}" if again else ""))
        del grads
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report = {"device": str(device), "device_name": name, "dtype": args.dtype,
              "scale": args.scale, "steps": args.steps, "deterministic": args.deterministic,
              "hyperparameters": {"lr": LR, "weight_decay": WEIGHT_DECAY}, "skipped": skipped,
              "sources": {m: _source(m) for m in ("gefen_core", "gefen_kernels")},
              "results": results}
    path = write_json(args.out, "digest", report, seeds=[SEED, SEED + 1],
                      argv=getattr(args, "argv", None))
    console.print(f"JSON: {path.resolve()}")
    return report
