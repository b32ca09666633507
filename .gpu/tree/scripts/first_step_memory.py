"""Which part of Gefen's first CUDA step sets its peak extra memory (diagnostic).

    PYTHONPATH=<packages>/src python scripts/first_step_memory.py [--models llama,gpt2]

For each model-shaped bf16 parameter set (``gefen_bench.param_sets``) with gradients
allocated, the first ``opt.step()`` runs with these methods wrapped: the period search of all
tensors (``Gefen._select_periods``, inside ``_learn``), the histogram and codebook
(``Gefen._learn``, whose figure then covers what follows the search), state creation
(``Gefen._init_group``) and the update (``functional.gefen``). Each wrapper resets CUDA's peak
counter and prints the phase's peak above the memory allocated when it began (MiB). The
largest phases are listed at the end with the step's own peak above its start, the figure
``gefen-bench step`` reports as "first-step peak". The kernels issue's target is <= 512 MiB.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from typing import Any

import torch

MIB = 1 << 20


def _measure(
    phases: list[tuple[float, str, int]], label: Callable[..., str], fn: Callable[..., Any]
) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn(*args, **kwargs)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        phases.append(((peak - base) / MIB, label(*args), peak))
        return out

    return wrapped


def _run(model: str) -> None:
    from gefen_bench.param_sets import build_param_set, shapes_for
    from gefen_core import Gefen, functional, optimizer

    dev = torch.device("cuda")
    named = build_param_set(shapes_for(model, "full"), device=dev, dtype=torch.bfloat16)
    gen = torch.Generator(device=dev).manual_seed(0)
    for _, p in named:
        p.grad = torch.randn(p.shape, generator=gen, device=dev, dtype=p.dtype)
    opt = Gefen(named, lr=1e-4)
    phases: list[tuple[float, str, int]] = []
    patches: list[tuple[Any, str, Callable[..., str]]] = [
        (
            Gefen,
            "_select_periods",
            lambda self, items: f"period search ({len(items)} tensors)",
        ),
        (Gefen, "_learn", lambda self, entries, periods: "histogram + codebook"),
        (Gefen, "_init_group", lambda self, group, entries, periods: "state creation"),
    ]
    saved: list[tuple[Any, str, Any]] = []
    for owner, attr, label in patches:
        saved.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, _measure(phases, label, getattr(owner, attr)))
    saved.append((optimizer, "_gefen_functional", optimizer._gefen_functional))
    optimizer._gefen_functional = _measure(
        phases, lambda *a: f"update ({len(a[0])} tensors)", functional.gefen
    )
    try:
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        opt.step()
        torch.cuda.synchronize()
        # Each phase reset the peak counter: the step's peak is the highest phase peak (or
        # what came after the last phase).
        top = max([torch.cuda.max_memory_allocated()] + [peak for _, _, peak in phases])
        total = (top - start) / MIB
    finally:
        for owner, attr, original in saved:
            setattr(owner, attr, original)
    state = (torch.cuda.memory_allocated() - start) / MIB
    print(
        f"\n=== {model}: first-step peak above its start {total:.1f} MiB; state created "
        f"{state:.1f} MiB; peak above the state {total - state:.1f} MiB"
    )
    print("  peak of each phase above the memory allocated when it began, largest first:")
    for mib, what, _ in sorted(phases, reverse=True)[:12]:
        print(f"  {mib:10.1f} MiB  {what}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama,gpt2")
    args = parser.parse_args()
    for model in args.models.split(","):
        _run(model)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
