"""Peak memory and timing helpers shared by the benchmarks.

Memory method, stated in every report:

* CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` at the start
  of the measured region (bytes the caching allocator handed out, not reserved), leaving out
  what runs inside :meth:`MemoryMeter.paused` (evaluation, which is not training memory).
* CPU: the process's RSS high-water mark (``resource.getrusage(RUSAGE_SELF).ru_maxrss``) at
  the end of the region, and the same figure minus the RSS at the start of the region. Each
  optimizer runs in its own process (:mod:`.jobs`), so the high-water mark is that
  optimizer's alone.
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
from collections.abc import Iterator
from typing import Any

import torch

CPU_METHOD = ("process RSS high-water (getrusage ru_maxrss), one process per optimizer; "
              "'over start' subtracts the RSS once model and data were built")
CUDA_METHOD = "torch.cuda.max_memory_allocated after reset_peak_memory_stats"


def current_rss_bytes() -> int:
    """Resident set size now (bytes): /proc/self/statm on Linux, else the high-water mark."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    """This process's RSS high-water mark in bytes.

    ``ru_maxrss`` is in KiB on Linux and in bytes on macOS.
    """
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


class MemoryMeter:
    """Peak memory over a region on ``device``; :meth:`stop` returns a dict of bytes.

    On CUDA, :meth:`mark_steady` (called once, after the first training step) splits the
    region: ``steady_peak_bytes`` is the peak after it, the memory of the steps that repeat.
    The first step can peak higher than the rest (an optimizer that allocates its state then,
    or one that steps in backward but keeps every gradient for its first step).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._start = 0
        self._first_peak: int | None = None
        # The peak so far of the current part (first step, then steady steps) up to the
        # last pause: CUDA keeps one peak counter, reset when a pause ends.
        self._part_peak = 0

    def _peak_so_far(self) -> int:
        return max(self._part_peak, torch.cuda.max_memory_allocated(self.device))

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Leave what runs inside out of the peaks (CUDA; the CPU's RSS high-water mark
        cannot leave anything out, so there it is a no-op)."""
        if self.device.type != "cuda":
            yield
            return
        torch.cuda.synchronize(self.device)
        self._part_peak = self._peak_so_far()
        try:
            yield
        finally:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            self._start = current_rss_bytes()

    def mark_steady(self) -> None:
        """The steps from here on are the steady ones (CUDA; a no-op on the CPU)."""
        if self.device.type == "cuda" and self._first_peak is None:
            torch.cuda.synchronize(self.device)
            self._first_peak = self._peak_so_far()
            self._part_peak = 0
            torch.cuda.reset_peak_memory_stats(self.device)

    def stop(self) -> dict[str, Any]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            later = self._peak_so_far()
            peak = max(later, self._first_peak or 0)
            steady = later if self._first_peak is not None else None
            return {"peak_bytes": peak, "peak_over_start_bytes": peak - self._start,
                    "steady_peak_bytes": steady, "method": CUDA_METHOD}
        peak = peak_rss_bytes()
        return {"peak_bytes": peak, "peak_over_start_bytes": max(0, peak - self._start),
                "steady_peak_bytes": None, "method": CPU_METHOD}


def synchronize(device: torch.device) -> None:
    """Wait for queued work on ``device`` (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def resolve_device(text: str) -> torch.device:
    """``"auto"`` → CUDA when available, else CPU; otherwise ``torch.device(text)``.

    Raises:
        ValueError: a CUDA device was asked for but torch sees none.
    """
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(text)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {text}: torch {torch.__version__} sees no CUDA device; "
                         "use --device cpu")
    return device
