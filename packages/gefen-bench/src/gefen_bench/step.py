"""``gefen-bench step``: the optimizer-step micro-benchmark with a copy-bandwidth roofline.

Method (docs/benchmarks.md): parameter sets built from GPT-2- and Llama-3.2-1B shapes
(:mod:`.param_sets`), random-normal values, fixed random-normal bf16 gradients, lr=1e-4,
weight_decay=0, other hyperparameters at their defaults. Each optimizer runs in its own
process (with a timeout; failures are reported verbatim) which first steps a tiny 3-tensor
set, so one-time process costs (imports, JIT, lazy kernel loading) stay out of the
first-step figure. Per model: 1 first step, ``--warmup`` steps, then ``--steps`` timed
steps, each timed with CUDA events after a device synchronisation (so host launch gaps
count); host-issue ms is how long ``step()`` takes to return on the host. The first step is
taken twice: by the first optimizer built in the process for this model (first-step ms: it
also loads, or compiles, the kernel variants this model's shapes need that the pre-warm did
not) and by a second one built over the same parameters and gradients after the first is
dropped (warm first-step ms: the step's own work, with every kernel loaded); the second
optimizer is the one timed after that. The ``*-graph`` entries (CUDA only) take the first
step eagerly, run the warm-up steps on a side stream, capture one step in a
``torch.cuda.CUDAGraph`` and time its replays: the step without any host launch cost, as a
user who captures the optimizer step gets it. Their steady "peak extra"
is about 0: what the captured step allocates lives in the graph's memory pool, counted in
alloc-delta instead. The ``*-compiled`` entries take the first step eagerly, then wrap the
steps in ``torch.compile`` (default mode; the pre-warm compiles the tiny set the same way);
compile ms is the first compiled call (dynamo, AOT and inductor for this model, plus one
step), the warm-up and timed steps run the compiled steady step, next to the eager rows of
the same optimizer in the same run (docs/compile.md).

``--first-step`` says what first-step ms includes. ``prewarmed`` (the default) is the above.
``warm-cache`` and ``cold-cache`` run each (optimizer, model) in its own process with no
pre-warm, so first-step ms is a fresh process's first step on that model: on the kernel caches
as they are on disk (``warm-cache``), or on new, empty Triton, inductor and native-step cache
directories (``cold-cache``, which also records how many cache files the first step wrote):
the first step of a job on a new node or container. Kernels that only steady steps launch are
compiled or loaded in the warm-up steps after it, and a ``*-compiled`` row's compile ms then
includes dynamo's and inductor's one-time start-up in the process. In these modes
``--timeout`` bounds each (optimizer, model) process, ``step.json`` is rewritten after each,
and a failure is keyed ``optimizer/model`` in ``failed``.

Columns: median step ms; host-issue ms (median); first-step ms; warm first-step ms (the
second optimizer's first step, above); compile ms (compiled entries, above); state B/param (distinct
storages reachable from the optimizer, :mod:`.state_bytes`); alloc-delta B/param (growth of
``memory_allocated`` from before the optimizer was built to after all steps); peak extra MiB
(``max_memory_allocated`` − ``memory_allocated`` before a step, after
``reset_peak_memory_stats``; on the CPU the process's peak resident set, reset just before the
step, less its resident set before it, where Linux ``/proc`` has them; max over 3 steady
steps, and on CUDA for the first step, which includes allocating the state); first-step
transient MiB (that first-step peak less the memory the first step left allocated, i.e. its
state: what the step needed beyond what it kept);
eff GB/s = the optimizer's minimal bytes/param (registry) × params / median step; % of the
device-to-device copy bandwidth measured in the same run. Each row records its ``timer``
(``"cuda-events"`` on CUDA, ``"host-wall"`` otherwise).

Muon-family rows (``GefenMuonHybrid``, ``torch.optim.Muon`` + AdamW) also carry
``state_halves`` (:func:`~gefen_bench.state_bytes.state_bytes_by_half`): the Muon half's state
over the Muon-routed parameters, the backup half's over the rest, and the whole, in bytes and
bytes/param, printed as a second table. Both are routed by docs/algorithm.md#hybrid (the bench's
``split_for_muon`` for torch Muon, the hybrid's own ``split_params_for_muon``), so on the
same parameter set the halves cover the same tensors.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.markup import escape

from . import optimizers as registry
from .jobs import run_job
from .measure import resolve_device, synchronize
from .param_sets import MODELS, SCALES, build_param_set, numel, shapes_for
from .report import console, mib, print_table, write_json
from .state_bytes import state_bytes_per_param

STEP_DEFAULT = ("gefen", "gefen-blockv", "adamw-fused", "adamw-foreach", "gefen-graph",
                "gefen-blockv-graph", "adamw-fused-graph", "gefen-compiled",
                "gefen-blockv-compiled", "muon", "gefen-muon-hybrid",
                "gefen-muon-hybrid-adamw", "gefenx-0.5", "gefenx-0.5-blockv", "gefen-1.2")
_COPY_BYTES = {"cuda": 4 * 2**30, "cpu": 256 * 2**20}
# --device cpu defaults: the CPU step's three sets (docs/benchmarks.md) against torch's
# default AdamW, fp32, in both second-moment modes.
CPU_MODELS = "square4096,small64x256,gpt2"
CPU_DEFAULT = ("adamw-default", "gefen", "gefen-blockv")
FIRST_STEP_MODES = ("prewarmed", "warm-cache", "cold-cache")
# The kernel caches a cold-cache process gets new, empty directories for (Triton's compiled
# kernels, inductor's, gefen_kernels' native CPU step).
_CACHE_VARIABLES = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "GEFEN_KERNELS_CACHE")
# The optimizer each row's "x baseline" ratio divides by, per device type.
_BASELINE = {"cpu": "adamw-default", "cuda": "adamw-fused"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``step``'s options on ``parser``."""
    parser.add_argument("--models", default=None,
                        help="comma-separated parameter sets: gpt2, llama, llama-lora, "
                             "square4096, small64x256 (default gpt2,llama,llama-lora; on "
                             "--device cpu "
                             f"{CPU_MODELS})")
    parser.add_argument("--optimizers", default=None,
                        help="comma-separated optimizer names (default: " + ",".join(STEP_DEFAULT)
                        + "; on --device cpu " + ",".join(CPU_DEFAULT)
                        + "; unavailable ones are reported as skipped)")
    parser.add_argument("--steps", type=int, default=50, help="timed steps (default 50)")
    parser.add_argument("--warmup", type=int, default=5,
                        help="warm-up steps after the first step (default 5)")
    parser.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda")
    parser.add_argument("--scale", default="full", choices=SCALES,
                        help="full shapes, or tiny ones with the same structure (CPU tests)")
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                        help="parameter and gradient dtype (default bfloat16; float32 on "
                             "--device cpu)")
    parser.add_argument("--target", action="append", metavar="PKG=DIR",
                        help="published package dir (pip install --no-deps --target DIR): "
                             "gefen-x=DIR (0.5.x) or gefen=DIR (1.2.x)")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds per optimizer process, or per optimizer and model "
                             "with --first-step warm-cache or cold-cache (default 900)")
    parser.add_argument("--out", type=Path, default=Path("gefen-bench-out/step"),
                        help="directory for step.json and step.png")
    parser.add_argument("--first-step", default="prewarmed", choices=FIRST_STEP_MODES,
                        help="what first-step ms includes: prewarmed (default: one process "
                             "per optimizer, a tiny set stepped first), warm-cache (one "
                             "process per optimizer and model, nothing stepped before: the "
                             "first step of a fresh process on the kernel caches as they are) "
                             "or cold-cache (the same with new, empty Triton, inductor and "
                             "native-step caches: the first step compiles what it launches)")
    parser.add_argument("--replot", type=Path, default=None, metavar="STEP_JSON",
                        help="measure nothing: draw step.png next to an existing step.json")


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _copy_bandwidth(device: torch.device, repeats: int = 20) -> dict[str, Any]:
    n_bytes = _COPY_BYTES[device.type] if device.type in _COPY_BYTES else 2**28
    src = torch.empty(n_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        synchronize(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    median = _median(times)
    return {"buffer_bytes": n_bytes, "median_s": median,
            "gb_per_s": 2 * n_bytes / median / 1e9,
            "method": f"copy_ of a {n_bytes / 2**30:.2f} GiB buffer, bytes read + written, "
                      f"median of {repeats}"}


class _Timer:
    """Device time of one call (CUDA events, else wall) plus its host-issue time (s)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __call__(self, fn: Callable[[], Any]) -> tuple[float, float]:
        synchronize(self.device)
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            h0 = time.perf_counter()
            fn()
            host = time.perf_counter() - h0
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3, host
        h0 = time.perf_counter()
        fn()
        host = time.perf_counter() - h0
        return host, host


def _captured(step: Callable[[], None], device: torch.device,
              warmup: int) -> Callable[[], None]:
    """torch's CUDA-graph recipe: warm-up steps on a side stream, capture one step; returns
    the replay. The gradients are the same tensors at every step, as the graph needs. Runs
    with ``device`` current (the capture stream is the current device's)."""
    with torch.cuda.device(device):
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(max(warmup, 1)):
                step()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=torch.cuda.Stream(device)):
            step()
    return graph.replay


def _allocated(device: torch.device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def _rss_and_peak() -> tuple[int, int] | None:
    """This process's resident set and its high-water mark (bytes; Linux ``/proc``)."""
    try:
        with open("/proc/self/status") as f:
            values = {k: int(v.split()[0]) * 1024 for k, _, v in
                      (line.partition(":") for line in f) if k in ("VmRSS", "VmHWM")}
        return values["VmRSS"], values["VmHWM"]
    except (OSError, KeyError, ValueError):
        return None


def _reset_rss_peak() -> bool:
    """Reset the high-water mark to the current resident set (Linux ``clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _peak_extra(device: torch.device, fn: Callable[[], Any]) -> int | None:
    """Bytes ``fn`` needs above what is allocated before it: CUDA ``max_memory_allocated`` over
    ``memory_allocated``; on the CPU the process's peak resident set (reset just before) over
    its resident set before (every allocation: torch's, native code's, Python's), where Linux
    exposes them, else ``None``."""
    if device.type != "cuda":
        start = _rss_and_peak() if _reset_rss_peak() else None
        fn()
        end = _rss_and_peak()
        return None if start is None or end is None else max(0, end[1] - start[0])
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def _bench_model(name: str, model: str, job: dict[str, Any], device: torch.device,
                 dtype: torch.dtype) -> dict[str, Any]:
    shapes = shapes_for(model, job["scale"])
    named = build_param_set(shapes, device=device, dtype=dtype)
    params = [p for _, p in named]
    synchronize(device)
    base = _allocated(device)
    opts = registry.build(name, named, lr=1e-4, weight_decay=0.0, device=device)

    def step() -> None:
        for o in opts:
            o.step()

    timer = _Timer(device)
    first_peak: int | None = None
    first_kept: int | None = None
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    before_first = _allocated(device)
    cache_files_before = _cache_files(job)
    first_s, _ = timer(step)
    cache_files_after = _cache_files(job)
    if device.type == "cuda":
        first_peak = torch.cuda.max_memory_allocated(device) - (before_first or 0)
        first_kept = (_allocated(device) or 0) - (before_first or 0)
    # The same first step again, with a new optimizer over the same parameters and gradients:
    # every kernel variant this model needs is loaded now, so this one is the step's own work
    # (period search, codebook, first update). The optimizer timed from here on is this one.
    opts[:] = []
    opts.extend(registry.build(name, named, lr=1e-4, weight_decay=0.0, device=device))
    synchronize(device)
    warm_first_s, _ = timer(step)
    spec = registry.get_spec(name)
    compile_s = None
    if spec.graph:
        step = _captured(step, device, job["warmup"])
    elif spec.compiled:
        step = torch.compile(step)
        compile_s, _ = timer(step)
        for _ in range(job["warmup"]):
            step()
    else:
        for _ in range(job["warmup"]):
            step()
    times, hosts = [], []
    for _ in range(job["steps"]):
        t, h = timer(step)
        times.append(t)
        hosts.append(h)
    steady_peaks = [_peak_extra(device, step) for _ in range(3)]
    synchronize(device)
    after = _allocated(device)
    state = state_bytes_per_param(opts, params)
    n = numel(shapes)
    median = _median(times)
    min_bpp = spec.min_bytes_per_param
    result = {
        "model": model, "optimizer": name, "tensors": len(shapes), "params": n,
        "step_ms_median": median * 1e3,
        # Nearest-rank percentile: the smallest time at or above 90% of the steps.
        "step_ms_p90": sorted(times)[math.ceil(0.9 * len(times)) - 1] * 1e3,
        "host_issue_ms_median": _median(hosts) * 1e3,
        "first_step_ms": first_s * 1e3,
        "first_step_mode": job.get("first_step", "prewarmed"),
        "kernel_cache_files_before_first_step": cache_files_before,
        "kernel_cache_files_after_first_step": cache_files_after,
        "first_step_warm_ms": warm_first_s * 1e3,
        "state_bytes_per_param": state["bytes_per_param"],
        "state_bytes": state["state_bytes"],
        "state_halves": state.get("halves"),
        "alloc_delta_bytes_per_param": None if base is None or after is None
        else (after - base) / n,
        "peak_extra_mib": None if steady_peaks[0] is None
        else mib(max(p for p in steady_peaks if p is not None)),
        "first_step_peak_extra_mib": mib(first_peak),
        "first_step_transient_mib": None if first_peak is None or first_kept is None
        else mib(first_peak - first_kept),
        "min_bytes_per_param": min_bpp,
        "timer": "cuda-events" if device.type == "cuda" else "host-wall",
        "cuda_graph": spec.graph,
        "compiled": spec.compiled,
        "compile_ms": None if compile_s is None else compile_s * 1e3,
        "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                        else "cpu"),
        "eff_gb_per_s": min_bpp * n / median / 1e9,
        "optimizer_classes": [type(o).__module__ + "." + type(o).__name__ for o in opts],
    }
    # Free this model's tensors before the next one is built (the closure holds `opts`).
    opts.clear()
    named.clear()
    params.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def _prewarm(name: str, device: torch.device, dtype: torch.dtype) -> None:
    """Step a tiny 3-tensor set, so one-time process costs (imports, JIT, lazy kernel
    loading) stay out of the first step."""
    warm = [(f"warm.{i}.weight", torch.nn.Parameter(torch.randn(s, device=device, dtype=dtype)))
            for i, s in enumerate([(64, 32), (32,), (16, 8)])]
    for _, p in warm:
        p.grad = torch.randn_like(p)
    for o in registry.build(name, warm, lr=1e-4, weight_decay=0.0, device=device):
        o.step()
        warm_step = torch.compile(o.step) if registry.get_spec(name).compiled else o.step
        for _ in range(2):
            warm_step()


def _cache_files(job: dict[str, Any]) -> int | None:
    """Files in the kernel caches a cold-cache job was given (``None`` in other modes)."""
    if job.get("first_step") != "cold-cache":
        return None
    return sum(len(files) for var in _CACHE_VARIABLES if var in os.environ
               for _, _, files in os.walk(os.environ[var]))


def _process_jobs(base: dict[str, Any], first_step: str) -> list[tuple[dict[str, Any], bool]]:
    """The worker processes of one optimizer: ``(job, cold)`` pairs. Prewarmed runs every
    model in one process; the other modes give each model its own, so each first step is a
    fresh process's, and ``cold`` ones run on new, empty kernel caches."""
    if first_step == "prewarmed":
        return [({**base, "first_step": first_step}, False)]
    return [({**base, "models": [m], "first_step": first_step}, first_step == "cold-cache")
            for m in base["models"]]


def run_step_job(job: dict[str, Any], emit: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Worker: copy bandwidth (``job['mode'] == 'copy'``) or one optimizer over the models."""
    device = torch.device(job["device"])
    if job.get("mode") == "copy":
        return _copy_bandwidth(device)
    dtype = getattr(torch, job["dtype"])
    name = job["optimizer"]
    if job.get("first_step", "prewarmed") == "prewarmed":
        _prewarm(name, device, dtype)
    rows = []
    for model in job["models"]:
        rows.append(_bench_model(name, model, job, device, dtype))
        emit({"event": "progress", "label": name, "done": len(rows),
              "total": len(job["models"])})
    return {"rows": rows, "external_version": job.get("external_version")}


def _add_ratios(rows: list[dict[str, Any]], baseline: str | None) -> None:
    """``ratio_to_baseline``: each row's median step over ``baseline``'s on the same model
    (``None`` where that optimizer was not measured)."""
    base = {r["model"]: r["step_ms_median"] for r in rows if r["optimizer"] == baseline}
    for r in rows:
        ref = base.get(r["model"])
        r["ratio_to_baseline"] = r["step_ms_median"] / ref if ref else None


def _commit() -> str | None:
    """The git commit of the working directory (``None`` outside a git checkout)."""
    import subprocess

    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


_HALF_COLUMNS = ["optimizer", "model", "Muon half params", "Muon half B/param",
                 "backup half params", "backup half B/param", "whole B/param",
                 "Muon + backup bytes", "whole bytes", "unattributed bytes"]


def _halves_table(rows: list[dict[str, Any]]) -> list[list[Any]]:
    """One line per Muon-family row: each half's size and state, and the whole's
    (docs/algorithm.md#hybrid)."""
    table = []
    for r in sorted(rows, key=lambda r: r["model"]):
        h = r.get("state_halves")
        if not h:
            continue
        table.append([r["optimizer"], r["model"], h["muon"]["numel"],
                      h["muon"]["bytes_per_param"], h["backup"]["numel"],
                      h["backup"]["bytes_per_param"], h["whole"]["bytes_per_param"],
                      h["halves_sum_bytes"], h["whole"]["state_bytes"],
                      h["unattributed_bytes"]])
    return table


def plot_step(path: Path, rows: list[dict[str, Any]], title: str) -> Path:
    """PNG: one panel per model, one bar per optimizer of the median steady ``opt.step()``
    time (ms), with the host-issue time (ms) drawn over each bar and the ratio to
    ``adamw-fused`` of the same model written above it (when that optimizer was measured)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .report import save_figure

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, max(1, len(models)), figsize=(6 * max(1, len(models)), 4.2),
                             squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == model]
        names = [r["optimizer"] for r in mine]
        steps = [r["step_ms_median"] for r in mine]
        ratios = [r.get("ratio_to_baseline") for r in mine]
        timer = "CUDA events" if mine[0].get("timer") == "cuda-events" else "host wall clock"
        ax.bar(range(len(mine)), steps, color="tab:blue", label=f"step ({timer})")
        ax.scatter(range(len(mine)), [r["host_issue_ms_median"] for r in mine], marker="_",
                   s=400, color="black", zorder=3, label="host issue")
        for i, value in enumerate(steps):
            text = f"{value:.3g} ms" + (f"\n{ratios[i]:.2f}x" if ratios[i] else "")
            ax.annotate(text, (i, value), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(mine)), names, rotation=20, ha="right", fontsize=8)
        ax.set(title=f"{model}: median opt.step()", ylabel="ms")
        ax.set_ylim(0, max(steps) * 1.25)
        ax.legend(fontsize=8)
    return save_figure(fig, title, path)


def _title(report: dict[str, Any]) -> str:
    device = next((r.get("device_name") for r in report["rows"]), report["device"])
    return (f"gefen-bench step · {device} · {report['dtype']} · {report['scale']} shapes · "
            f"{report['steps']} timed steps")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the micro-benchmark; prints the table and writes ``step.json`` and ``step.png``
    under ``args.out`` (or, with ``--replot``, only draws the PNG of an existing JSON)."""
    import json

    from .train import parse_assignments

    if getattr(args, "replot", None) is not None:
        try:
            saved = json.loads(args.replot.read_text())
        except (OSError, ValueError) as exc:
            raise argparse.ArgumentTypeError(f"--replot {args.replot}: {exc}") from None
        if not isinstance(saved, dict) or not saved.get("rows"):
            raise argparse.ArgumentTypeError(f"--replot {args.replot}: no measured rows")
        png = plot_step(args.replot.with_suffix(".png"), saved["rows"], _title(saved))
        console.print(f"chart: {png.resolve()}")
        return saved

    try:
        device = resolve_device(args.device)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--device {args.device}: {exc}") from None
    on_cpu = device.type == "cpu"
    if args.models is None:
        args.models = CPU_MODELS if on_cpu else "gpt2,llama,llama-lora"
    if args.dtype is None:
        args.dtype = "float32" if on_cpu else "bfloat16"
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in models:
        if m not in MODELS:
            raise argparse.ArgumentTypeError(
                f"--models: unknown model {m!r}; available: {', '.join(MODELS)}")
    if args.steps < 1 or args.warmup < 0:
        raise argparse.ArgumentTypeError("--steps must be >= 1 and --warmup >= 0")
    names = (registry.parse_names(args.optimizers) if args.optimizers
             else list(CPU_DEFAULT if on_cpu else STEP_DEFAULT))
    targets = parse_assignments(args.target, "--target")
    for key in targets:
        if key not in registry.EXTERNAL_PACKAGES:
            raise argparse.ArgumentTypeError(
                f"--target {key}=...: unknown package; use one of "
                f"{', '.join(registry.EXTERNAL_PACKAGES)}")
    skipped = {n: r for n in names
               if (r := registry.availability(n, targets, device, plain_step=True)) is not None}
    for n, reason in skipped.items():
        console.print(f"[yellow]skipped[/yellow] {n}: {escape(reason)}")
    start = time.perf_counter()
    base = {"kind": "step", "device": str(device), "dtype": args.dtype, "scale": args.scale,
            "models": models, "steps": args.steps, "warmup": args.warmup,
            "first_step": args.first_step}
    copy = run_job({**base, "mode": "copy"}, timeout_s=args.timeout)
    bandwidth: dict[str, Any] = (copy.result if copy.status == "ok" and copy.result
                                 else {"error": copy.error})
    console.print(f"copy bandwidth: {bandwidth.get('gb_per_s', float('nan')):.0f} GB/s "
                  f"({bandwidth.get('method', bandwidth.get('error'))})")
    rows: list[dict[str, Any]] = []
    failed: dict[str, str] = {}

    def report(complete: bool) -> dict[str, Any]:
        return {"device": str(device), "dtype": args.dtype, "scale": args.scale,
                "commit": _commit(), "baseline": _BASELINE.get(device.type),
                "models": models, "steps": args.steps, "warmup": args.warmup,
                "first_step": args.first_step, "copy_bandwidth": bandwidth, "rows": rows,
                "skipped": skipped, "failed": failed, "wall_s": time.perf_counter() - start,
                "complete": complete}

    for n in names:
        if n in skipped:
            continue
        job = {**base, "optimizer": n}
        spec = registry.get_spec(n)
        if spec.external is not None:
            job["target"] = targets[spec.external]
        console.print(f"running {n} ...")
        for process_job, cold in _process_jobs(job, args.first_step):
            if cold:
                # A killed worker may leave files being written: cleaning up never fails the run.
                with tempfile.TemporaryDirectory(prefix="gefen-bench-cold-",
                                                 ignore_cleanup_errors=True) as tmp:
                    env = {var: str(Path(tmp) / var.lower()) for var in _CACHE_VARIABLES}
                    out = run_job(process_job, timeout_s=args.timeout, env=env)
            else:
                out = run_job(process_job, timeout_s=args.timeout)
            if out.status == "ok" and out.result is not None:
                for row in out.result["rows"]:
                    row["external_version"] = out.result.get("external_version")
                    ceiling = bandwidth.get("gb_per_s")
                    row["pct_copy_bw"] = (100 * row["eff_gb_per_s"] / ceiling if ceiling
                                          else None)
                    rows.append(row)
            else:
                key = n if args.first_step == "prewarmed" else f"{n}/{process_job['models'][0]}"
                failed[key] = f"{out.status}: {out.error}"
                console.print(f"[red]{key} {out.status}[/red]: "
                              + escape(f"{out.error}\n{out.stderr_tail[-3000:]}"))
            # Rewritten after every process: a run cut short by an outer timeout keeps the
            # rows measured so far ("complete": false).
            write_json(args.out / "step.json", "step", report(False), seeds=[0],
                       argv=getattr(args, "argv", None))
    wall = time.perf_counter() - start
    _add_ratios(rows, _BASELINE.get(device.type))
    columns = ["optimizer", "model", "step ms median", "x baseline", "host-issue ms",
               "first-step ms",
               "warm first-step ms", "compile ms", "state B/param", "alloc-delta B/param",
               "peak extra MiB", "first-step peak MiB", "first-step transient MiB",
               "min B/param", "eff GB/s", "% copy BW"]
    table = [[r["optimizer"], r["model"], r["step_ms_median"], r.get("ratio_to_baseline"),
              r["host_issue_ms_median"],
              r["first_step_ms"], r.get("first_step_warm_ms"), r.get("compile_ms"),
              r["state_bytes_per_param"],
              r["alloc_delta_bytes_per_param"],
              r["peak_extra_mib"], r["first_step_peak_extra_mib"],
              r.get("first_step_transient_mib"), r["min_bytes_per_param"],
              r["eff_gb_per_s"], r["pct_copy_bw"]] for r in sorted(rows, key=lambda r: r["model"])]
    print_table(f"gefen-bench step · {device} · {args.dtype} · {args.scale} shapes · "
                f"first step {args.first_step} · {args.steps} timed steps · "
                f"x baseline = median step / {_BASELINE.get(device.type)}'s (same run)",
                columns, table)
    halves = _halves_table(rows)
    if halves:
        print_table("state by half (Muon half over Muon-routed params, backup half over the "
                    "rest; whole measured once)", _HALF_COLUMNS, halves)
    final = report(True)
    final["wall_s"] = wall
    path = write_json(args.out / "step.json", "step", final, seeds=[0],
                      argv=getattr(args, "argv", None))
    if rows:
        plot_step(path.with_suffix(".png"), rows, _title(final))
    console.print(f"wall {wall:.0f} s · JSON: {path.resolve()}")
    return final
