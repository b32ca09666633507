"""Entry point of a measurement process: ``python -m gefen_bench.worker`` (see :mod:`.jobs`)."""

from __future__ import annotations

import json
import os
import resource
import sys
import traceback
from collections.abc import Callable
from typing import Any, TextIO

Emit = Callable[[dict[str, Any]], None]


def _job_function(kind: str) -> Callable[[dict[str, Any], Emit], dict[str, Any]]:
    if kind == "lm":
        from .train_lm import run_lm_job

        return run_lm_job
    if kind == "digits":
        from .train_digits import run_digits_job

        return run_digits_job
    if kind == "arch":
        from .arch import run_arch_job

        return run_arch_job
    if kind == "step":
        from .step import run_step_job

        return run_step_job
    if kind == "sweep":
        from .train_sweep import run_sweep_job

        return run_sweep_job
    if kind == "fit":
        from .fit import run_fit_probe

        return run_fit_probe
    raise ValueError(f"unknown job kind {kind!r}; expected lm, digits, arch, step, sweep or fit")


def main() -> int:
    job = json.loads(sys.stdin.read())
    # Keep the protocol on the original stdout; anything else printed (including by C code)
    # goes to stderr, so a chatty library cannot corrupt the result line.
    proto: TextIO = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def emit(message: dict[str, Any]) -> None:
        proto.write(json.dumps(message) + "\n")
        proto.flush()

    try:
        if job.get("threads"):
            import torch

            torch.set_num_threads(int(job["threads"]))
        target = job.get("target")
        if target:
            from .optimizers import load_external_gefen

            job["external_version"] = load_external_gefen(target)
        result = _job_function(job["kind"])(job, emit)
        # CPU seconds this process used: with the wall time, it shows when a run was slowed
        # by other work on the machine.
        usage = resource.getrusage(resource.RUSAGE_SELF)
        result["process_cpu_s"] = usage.ru_utime + usage.ru_stime
        emit({"event": "result", "result": result})
    except BaseException as exc:  # noqa: BLE001 - every failure is reported verbatim
        emit({"event": "error", "error": f"{type(exc).__name__}: {exc}",
              "traceback": traceback.format_exc()})
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
