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
import heapq
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
        started: ``time.monotonic()`` when the process was started (0 where not run);
            with ``wall_s`` it places the run on the invocation's time line.
    """

    status: str
    result: dict[str, Any] | None
    error: str | None
    stderr_tail: str
    wall_s: float
    started: float = 0.0


def run_job(job: dict[str, Any], *, on_event: EventHandler | None = None,
            timeout_s: float | None = None, threads: int | None = None,
            env: dict[str, str] | None = None) -> JobOutcome:
    """Run ``job`` in a fresh ``python -m gefen_bench.worker`` process and wait for it.

    Args:
        job: JSON-serialisable; ``job["kind"]`` selects the worker function.
        on_event: called in this thread for every event line before the result.
        timeout_s: kill the process after this many seconds (``status="timeout"``).
        threads: ``OMP_NUM_THREADS`` / torch intra-op threads for the child.
        env: variables set in the child's environment on top of this process's.
    """
    env = {**os.environ, **(env or {})}
    env["PYTHONUNBUFFERED"] = "1"
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
        job = {**job, "threads": threads}
    started = time.monotonic()
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
        return JobOutcome("timeout", None, f"timed out after {timeout_s:.0f} s", stderr_tail,
                          wall, started)
    if final is not None and final["event"] == "result":
        return JobOutcome("ok", final["result"], None, stderr_tail, wall, started)
    if final is not None:
        return JobOutcome("failed", None, final["error"], final.get("traceback", ""), wall,
                          started)
    last = stderr_tail.strip().splitlines()[-1:] or ["(no output)"]
    return JobOutcome("failed", None, f"worker exited with code {proc.returncode}: {last[0]}",
                      stderr_tail, wall, started)


class JobQueue:
    """Worker jobs run ``parallel`` at a time, each in its own process, with jobs added while
    others run: what ``on_done`` returns for a finished job is queued at once, so a job that
    depends on earlier ones (a reported run on its tuned LR) starts as soon as they end,
    beside whatever else is still running.

    Among queued jobs the highest ``priority`` starts first (ties: the order of
    :meth:`submit`). ``on_event`` and ``on_done`` are called one at a time (under one lock), in
    the threads that wait on the processes.
    """

    def __init__(self, parallel: int = 1, *, on_event: EventHandler | None = None,
                 timeout_s: float | None = None, threads: int | None = None,
                 on_done: Callable[[dict[str, Any], JobOutcome], Any] | None = None) -> None:
        if parallel < 1:
            raise ValueError(f"parallel must be >= 1, got {parallel}")
        self.parallel = parallel
        self.timeout_s = timeout_s
        self.threads = threads
        self._on_event = on_event
        self._on_done = on_done
        self._cond = threading.Condition()
        self._lock = threading.Lock()
        self._heap: list[tuple[float, int, dict[str, Any]]] = []
        self._seq = 0
        self._running = 0
        self._error: BaseException | None = None

    def submit(self, job: dict[str, Any], priority: float = 0.0) -> None:
        """Queue ``job``; callable before :meth:`run` and from ``on_done``."""
        with self._cond:
            heapq.heappush(self._heap, (-priority, self._seq, job))
            self._seq += 1
            self._cond.notify_all()

    def _event(self, event: dict[str, Any]) -> None:
        if self._on_event is not None:
            with self._lock:
                self._on_event(event)

    def _worker(self) -> None:
        while True:
            with self._cond:
                while not self._heap and self._running:
                    self._cond.wait()
                if not self._heap:
                    self._cond.notify_all()
                    return
                _, _, job = heapq.heappop(self._heap)
                self._running += 1
            try:
                out = run_job(job, on_event=self._event, timeout_s=self.timeout_s,
                              threads=self.threads)
                if self._on_done is not None:
                    with self._lock:
                        follow = self._on_done(job, out)
                    for item in follow or ():
                        new_job, priority = item if isinstance(item, tuple) else (item, 0.0)
                        self.submit(new_job, priority)
            except BaseException as exc:  # noqa: BLE001 - re-raised by run()
                with self._cond:
                    self._error = self._error or exc
                    self._heap.clear()
            finally:
                with self._cond:
                    self._running -= 1
                    self._cond.notify_all()

    def run(self) -> None:
        """Run until no job is queued or running. ``on_done(job, outcome)`` may return jobs
        (or ``(job, priority)`` pairs) to queue next."""
        workers = [threading.Thread(target=self._worker, daemon=True)
                   for _ in range(self.parallel)]
        for w in workers:
            w.start()
        for w in workers:
            # Join with a timeout so that Ctrl-C reaches the main thread.
            while w.is_alive():
                w.join(timeout=0.5)
        if self._error is not None:
            raise self._error


def run_jobs(jobs: list[dict[str, Any]], *, parallel: int = 1,
             on_event: EventHandler | None = None, timeout_s: float | None = None,
             threads: int | None = None,
             on_done: Callable[[int, JobOutcome], None] | None = None) -> list[JobOutcome]:
    """Run ``jobs`` (each in its own process), ``parallel`` at a time; results in job order.

    ``on_done(index, outcome)`` is called (one at a time) as each job ends.
    """
    outcomes: dict[int, JobOutcome] = {}
    copies = [dict(job) for job in jobs]
    index = {id(job): i for i, job in enumerate(copies)}

    def done(job: dict[str, Any], out: JobOutcome) -> None:
        i = index[id(job)]
        outcomes[i] = out
        if on_done is not None:
            on_done(i, out)

    queue = JobQueue(parallel, on_event=on_event, timeout_s=timeout_s, threads=threads,
                     on_done=done)
    for job in copies:
        queue.submit(job)
    queue.run()
    return [outcomes[i] for i in range(len(jobs))]
