"""Run one measurement in its own Python process.

Why a process per optimizer: the CPU memory figure is the process's RSS high-water mark
(``ru_maxrss``), which only means something for one optimizer if nothing else ran in that
process; CUDA peaks get a clean allocator; and the published ``gefen`` packages, which
import under the same name as this project's facade, can only be loaded in a fresh
interpreter.

Protocol: the parent writes one JSON job to the child's stdin; the child
(``python -m gefen_bench.worker``) writes JSON lines to its *original* stdout — events
(``{"event": "progress", ...}``) and finally ``{"event": "result", "result": {...}}`` or
``{"event": "error", "error": "...", "traceback": "..."}`` — while anything libraries print
goes to stderr, of which the parent keeps the tail for failure reports.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

EventHandler = Callable[[dict[str, Any]], None]

_STDERR_TAIL_LINES = 40


@dataclass
class JobOutcome:
    """What one worker process returned.

    Attributes:
        status: ``"ok"``, ``"failed"`` (the job raised; ``error`` holds its message) or
            ``"timeout"``.
        result: the job's result dict when ``status == "ok"``.
        error: the failure, verbatim (exception line, or exit code and stderr tail).
        stderr_tail: the last lines the process wrote to stderr.
        wall_s: wall time of the process in seconds (start-up included).
    """

    status: str
    result: dict[str, Any] | None
    error: str | None
    stderr_tail: str
    wall_s: float


def run_job(job: dict[str, Any], *, on_event: EventHandler | None = None,
            timeout_s: float | None = None, threads: int | None = None) -> JobOutcome:
    """Run ``job`` in a fresh ``python -m gefen_bench.worker`` process and wait for it.

    Args:
        job: JSON-serialisable; ``job["kind"]`` selects the worker function.
        on_event: called in this thread for every event line before the result.
        timeout_s: kill the process after this many seconds (``status="timeout"``).
        threads: ``OMP_NUM_THREADS`` / torch intra-op threads for the child.
    """
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
        job = {**job, "threads": threads}
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gefen_bench.worker"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=env, text=True, bufsize=1,
    )
    tail: collections.deque[str] = collections.deque(maxlen=_STDERR_TAIL_LINES)
    err_reader = threading.Thread(target=lambda: tail.extend(proc.stderr), daemon=True)  # type: ignore[arg-type]
    err_reader.start()
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps(job))
    proc.stdin.close()

    timed_out = threading.Event()

    def kill_on_timeout() -> None:
        timed_out.set()
        proc.kill()

    timer = threading.Timer(timeout_s, kill_on_timeout) if timeout_s else None
    if timer is not None:
        timer.start()
    final: dict[str, Any] | None = None
    try:
        for line in proc.stdout:
            line = line.strip()
            if not line:
                continue
            try:
                message = json.loads(line)
            except json.JSONDecodeError:
                tail.append(line + "\n")
                continue
            if message.get("event") in ("result", "error"):
                final = message
            elif on_event is not None:
                on_event(message)
        proc.wait()
    finally:
        if timer is not None:
            timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err_reader.join(timeout=5)
    wall = time.perf_counter() - start
    stderr_tail = "".join(tail)
    if timed_out.is_set():
        return JobOutcome("timeout", None, f"timed out after {timeout_s:.0f} s", stderr_tail, wall)
    if final is not None and final["event"] == "result":
        return JobOutcome("ok", final["result"], None, stderr_tail, wall)
    if final is not None:
        return JobOutcome("failed", None, final["error"], final.get("traceback", ""), wall)
    last = stderr_tail.strip().splitlines()[-1:] or ["(no output)"]
    return JobOutcome("failed", None, f"worker exited with code {proc.returncode}: {last[0]}",
                      stderr_tail, wall)


def run_jobs(jobs: list[dict[str, Any]], *, parallel: int = 1,
             on_event: EventHandler | None = None, timeout_s: float | None = None,
             threads: int | None = None,
             on_done: Callable[[int, JobOutcome], None] | None = None) -> list[JobOutcome]:
    """Run ``jobs`` (each in its own process), ``parallel`` at a time; results in job order.

    ``on_done(index, outcome)`` is called (in this thread, one at a time) as each job ends.
    """
    lock = threading.Lock()

    def locked(event: dict[str, Any]) -> None:
        if on_event is not None:
            with lock:
                on_event(event)

    def one(index: int) -> JobOutcome:
        out = run_job(jobs[index], on_event=locked, timeout_s=timeout_s, threads=threads)
        if on_done is not None:
            with lock:
                on_done(index, out)
        return out

    if parallel <= 1:
        return [one(i) for i in range(len(jobs))]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=parallel) as pool:
        futures = [pool.submit(one, i) for i in range(len(jobs))]
        return [f.result() for f in futures]
