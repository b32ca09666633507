"""Shared reporting: run metadata, the JSON writer, terminal tables and plots.

Every JSON report gefen-bench writes has the same envelope::

    {"schema": "gefen-bench/<command>/1", "meta": {...}, ...command fields...}

where ``meta`` records the command line, the time (UTC), the machine (CPU, cores, memory,
GPU), Python, torch, CUDA, Triton and the versions of gefen-x packages and peers, and the
seed(s) used.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
import math
import os
import platform
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

_PACKAGES = ("gefen-kernels", "gefen-core", "gefen-dist", "gefen-bench", "gefen-x",
             "transformers", "numpy", "scikit-learn", "matplotlib", "triton", "torchao",
             "bitsandbytes")

console = Console()
if not console.is_terminal:
    # Logs and CI: keep the wide tables readable instead of wrapping at 80 columns.
    console = Console(width=160)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def machine_info() -> dict[str, Any]:
    """CPU model, usable cores, physical memory (bytes), OS and GPU name/memory if any."""
    info: dict[str, Any] = {
        "cpu": _cpu_name(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "memory_bytes": _memory_bytes(),
        "os": platform.platform(),
        "torch_threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = props.name
        info["gpu_memory_bytes"] = props.total_memory
        info["gpu_count"] = torch.cuda.device_count()
    return info


def versions() -> dict[str, str | None]:
    """Python, torch, CUDA and installed package versions (``None`` when absent)."""
    out: dict[str, str | None] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    for name in _PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


# Environment variables of the invoking process that change what a run measures (graph replay,
# kernel paths and caches, the allocator, threads, visible devices), recorded in every report's
# ``meta``. Workers inherit them, except what a command sets per worker: ``--threads``
# (``threads_per_job`` in train's report) and the temporary cache directories of
# ``step --first-step cold-cache`` (its rows' ``first_step_mode``).
_RECORDED_PREFIXES = ("GEFEN_", "TRITON_", "TORCHINDUCTOR_")
_RECORDED_NAMES = frozenset({"PYTORCH_CUDA_ALLOC_CONF", "CUDA_LAUNCH_BLOCKING",
                             "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "XDG_CACHE_HOME", "CC"})


def run_metadata(*, seeds: Sequence[int] | None = None,
                 argv: Sequence[str] | None = None) -> dict[str, Any]:
    """The ``meta`` block of a report."""
    argv = list(sys.argv if argv is None else argv)
    prog = Path(argv[0]).name if argv else "gefen-bench"
    return {
        "command": shlex.join([prog, *argv[1:]]),
        "utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "versions": versions(),
        "seeds": list(seeds) if seeds is not None else None,
        "environment": {k: v for k, v in sorted(os.environ.items())
                        if k.startswith(_RECORDED_PREFIXES) or k in _RECORDED_NAMES},
    }


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def write_json(path: Path, command: str, payload: dict[str, Any], *,
               seeds: Sequence[int] | None = None, argv: Sequence[str] | None = None) -> Path:
    """Write ``payload`` with the standard envelope to ``path`` (parents created); NaN → null.

    ``argv`` is the command line to record (default ``sys.argv``).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {"schema": f"gefen-bench/{command}/1",
                "meta": run_metadata(seeds=seeds, argv=argv), **payload}
    # Write beside and rename: a run killed mid-write (the GPU jobs are bounded by timeouts)
    # leaves the previous complete file, never a truncated one.
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_jsonable(document), indent=1, allow_nan=False) + "\n")
    os.replace(tmp, path)
    return path


def fmt(value: Any, digits: int = 3) -> str:
    """Table cell text: floats to ``digits`` decimals, None/NaN as ``-``."""
    if value is None:
        return "-"
    if isinstance(value, float):
        if not math.isfinite(value):
            return "nan" if math.isnan(value) else "inf"
        return f"{value:.{digits}f}"
    return str(value)


def mib(n_bytes: float | None) -> float | None:
    """Bytes → MiB (None passes through)."""
    return None if n_bytes is None else n_bytes / 2**20


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], *,
                caption: str | None = None) -> None:
    """A rich table on the terminal; cells pass through :func:`fmt`."""
    table = Table(title=title, caption=caption, show_lines=False)
    for i, c in enumerate(columns):
        table.add_column(c, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*(fmt(c) for c in row))
    console.print(table)


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """The same table as GitHub-flavoured Markdown (for docs)."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _smooth(values: Sequence[float], weight: float = 0.95) -> list[float]:
    out: list[float] = []
    avg = None
    for v in values:
        if not math.isfinite(v):
            out.append(float("nan"))
            continue
        avg = v if avg is None else weight * avg + (1 - weight) * v
        out.append(avg)
    return out


def _legend(ax: Any) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def plot_train(path: Path, lm: dict[str, dict[str, Any]], digits: dict[str, dict[str, Any]],
               title: str) -> Path:
    """PNG of the tasks that ran, one colour per optimizer: LM train and held-out loss curves
    and held-out loss per optimizer (mean, with the range over seeds where there are
    several), digits CNN held-out loss, and bars of peak memory, throughput and optimizer
    state bytes/param. A task that did not run has no panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys([*lm, *digits]))
    colours = {n: plt.get_cmap("tab10")(i % 10) for i, n in enumerate(names)}

    def train_curves(ax: Any) -> None:
        for n, r in lm.items():
            ax.plot(range(1, len(r["train_loss"]) + 1), _smooth(r["train_loss"]),
                    label=f"{n} (lr {r['lr']:.2g})", color=colours[n])
        ax.set(title="byte-level LM: train loss (EMA 0.95)", xlabel="step", ylabel="nats/byte")
        _legend(ax)

    def eval_curves(ax: Any) -> None:
        for n, r in lm.items():
            if r["eval_loss"]:
                s, v = zip(*r["eval_loss"])
                ax.plot(s, v, marker="o", label=n, color=colours[n])
        ax.set(title="byte-level LM: held-out loss", xlabel="step", ylabel="nats/byte")
        _legend(ax)

    def final_loss(ax: Any) -> None:
        keys = list(lm)
        means = [lm[k]["final_eval_loss"] for k in keys]
        runs = [lm[k].get("final_eval_loss_runs") or [lm[k]["final_eval_loss"]] for k in keys]
        err = [[m - min(r) for m, r in zip(means, runs)], [max(r) - m for m, r in zip(means, runs)]]
        ax.bar(range(len(keys)), means, yerr=err, capsize=3, color=[colours[k] for k in keys])
        ax.set_xticks(range(len(keys)), keys, rotation=30, ha="right", fontsize=8)
        finite = [m for m in means if math.isfinite(m)]
        if finite:
            ax.set_ylim(min(finite) * 0.97, max(finite) * 1.03)
        ax.set(title="LM: final held-out loss (mean; bars: range over seeds)",
               ylabel="nats/byte")
        for i, m in enumerate(means):
            ax.annotate(f"{m:.4f} ({len(runs[i])})", (i, m), ha="center", va="bottom",
                        fontsize=7)

    def digits_curves(ax: Any) -> None:
        for n, r in digits.items():
            curves = [run["eval_curve"] for run in r["runs"]]
            epochs = [c[0] for c in curves[0]]
            mean = [sum(c[i][1] for c in curves) / len(curves) for i in range(len(epochs))]
            ax.plot(epochs, mean, marker=".", label=f"{n} ({100 * r['accuracy_mean']:.2f}%)",
                    color=colours[n])
        ax.set(title="digits CNN: held-out loss (mean of seeds)", xlabel="epoch", ylabel="loss")
        ax.set_yscale("log")
        _legend(ax)

    def bars(values: dict[str, float], title: str, unit: str) -> Any:
        def draw(ax: Any) -> None:
            keys = list(values)
            ax.bar(range(len(keys)), [values[k] for k in keys],
                   color=[colours[k] for k in keys])
            ax.set_xticks(range(len(keys)), keys, rotation=30, ha="right", fontsize=8)
            ax.set(title=title, ylabel=unit)
            for i, k in enumerate(keys):
                ax.annotate(f"{values[k]:.3g}", (i, values[k]), ha="center", va="bottom",
                            fontsize=8)
        return draw

    panels: list[Any] = []
    if lm:
        panels += [train_curves, eval_curves, final_loss]
    if digits:
        panels.append(digits_curves)
    if lm:
        panels += [bars({n: (mib(r["memory"]["peak_over_start_bytes"]) or 0.0)
                         for n, r in lm.items()}, "LM: peak memory over start", "MiB"),
                   bars({n: r["tokens_per_s"] for n, r in lm.items()}, "LM: throughput",
                        "tokens/s")]
    src = lm or digits
    if src:
        panels.append(bars({n: r["state"]["bytes_per_param"] for n, r in src.items()},
                           "optimizer state", "bytes/param"))
    cols = min(3, max(1, len(panels)))
    rows = max(1, -(-len(panels) // cols))
    fig, axes = plt.subplots(rows, cols, figsize=(5.4 * cols, 4.25 * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax, draw in zip(flat, panels):
        draw(ax)
    for ax in flat[len(panels):]:
        ax.set_axis_off()
    return save_figure(fig, title, path)


def save_figure(fig: Any, title: str, path: Path) -> Path:
    """Title, lay out and write a matplotlib figure as a PNG (parents created), then close it."""
    import matplotlib.pyplot as plt

    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
