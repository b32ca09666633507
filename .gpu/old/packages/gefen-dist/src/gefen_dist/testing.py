"""Run a function on N spawned ``torch.distributed`` processes, for tests.

``run_distributed(fn, world_size)`` starts ``world_size`` fresh interpreters (``spawn``), joins
them into one process group (gloo on CPU by default) with an explicit collective timeout, calls
``fn(rank, world_size, *args)`` on each and returns the per-rank results in rank order.

It never hangs the caller:

* every rank's ``init_process_group`` gets ``timeout=collective_timeout`` (gloo's default is 30
  minutes, so a rank that dies before a collective would otherwise stall its peers that long);
* the parent waits at most ``timeout`` seconds in total, then kills every child still running and
  raises :class:`DistributedTimeoutError` naming the ranks that did not report;
* an exception on any rank is sent back with its traceback and re-raised in the parent as
  :class:`DistributedTestError`, which lists every rank's outcome.

Rendezvous goes through a ``FileStore`` in a fresh temporary directory, so no TCP port has to be
guessed and concurrent test runs never collide.

``fn`` and its arguments must be picklable (a module-level function), because ``spawn`` imports
the caller's module in every child. Children run with one intra-op thread each, so several ranks
share a small CI machine without oversubscription.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

__all__ = [
    "DistributedTestError",
    "DistributedTimeoutError",
    "RankOutcome",
    "run_distributed",
]


@dataclass(frozen=True)
class RankOutcome:
    """What one rank reported: its result, or the exception it raised.

    ``error_type`` is the qualified class name (``"builtins.ValueError"``), ``message`` its
    ``str()``, ``traceback`` the formatted traceback text; all ``None`` when the rank succeeded.
    """

    rank: int
    result: Any = None
    error_type: str | None = None
    message: str | None = None
    traceback: str | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error_type is None


class DistributedTestError(RuntimeError):
    """At least one rank raised. ``outcomes`` holds every rank's :class:`RankOutcome`."""

    def __init__(self, outcomes: Sequence[RankOutcome]) -> None:
        self.outcomes = list(outcomes)
        lines = []
        for o in self.outcomes:
            if o.ok:
                lines.append(f"rank {o.rank}: ok ({o.seconds:.1f} s)")
            else:
                lines.append(
                    f"rank {o.rank}: {o.error_type}: {o.message} ({o.seconds:.1f} s)\n"
                    f"{o.traceback}"
                )
        super().__init__("distributed run failed:\n" + "\n".join(lines))


class DistributedTimeoutError(TimeoutError):
    """Some ranks did not finish within the parent's deadline; they were killed."""

    def __init__(self, missing: Sequence[int], outcomes: Sequence[RankOutcome], timeout: float):
        self.missing = list(missing)
        self.outcomes = list(outcomes)
        done = ", ".join(
            f"rank {o.rank}: {'ok' if o.ok else f'{o.error_type}: {o.message}'}"
            for o in outcomes
        )
        super().__init__(
            f"ranks {self.missing} did not finish within {timeout:.0f} s and were killed"
            + (f"; finished: {done}" if done else "")
        )


def _child(
    rank: int,
    world_size: int,
    init_file: str,
    backend: str,
    collective_timeout: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    env: dict[str, str],
    results: Any,
    release: Any,
) -> None:
    start = time.monotonic()
    os.environ.update(env)
    initialised = False
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=collective_timeout),
        )
        initialised = True
        value = fn(rank, world_size, *args)
        # Plain pickle, not the queue's ForkingPickler: torch would share tensor storage through
        # file descriptors that vanish when this process exits before the parent reads them.
        payload = pickle.dumps(value)
        results.put(RankOutcome(rank, result=payload, seconds=time.monotonic() - start))
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        kind = type(exc)
        results.put(
            RankOutcome(
                rank,
                error_type=f"{kind.__module__}.{kind.__qualname__}",
                message=str(exc),
                traceback="".join(traceback.format_exception(exc)),
                seconds=time.monotonic() - start,
            )
        )
    finally:
        # No rank leaves before every rank has reported: a rank that exited right after the
        # last collective of ``fn`` could take with it a message a slower peer still needs
        # (seen with gloo on torch 2.7: that peer then never returned). The outcome is reported
        # first, because destroying the group can itself block on torch 2.7 with gloo; the
        # parent kills a rank stuck there once every outcome has arrived.
        release.wait(collective_timeout)
        if initialised:
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 90.0,
    collective_timeout: float = 30.0,
    env: dict[str, str] | None = None,
    raise_on_error: bool = True,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks.

    Args:
        fn: module-level (picklable) callable. Its return value must be picklable.
        world_size: number of processes, ``>= 1``.
        *args: extra picklable positional arguments for ``fn``.
        backend: ``torch.distributed`` backend, ``"gloo"`` (CPU) or ``"nccl"``.
        timeout: seconds the parent waits for all ranks before killing them.
        collective_timeout: seconds passed to ``init_process_group(timeout=...)``; a rank that
            waits longer than this in one collective raises instead of hanging. Keep it below
            ``timeout``.
        env: extra environment variables set in each child before anything is imported.
        raise_on_error: with ``False`` return the list of :class:`RankOutcome` instead of
            raising; used by tests that assert every rank failed.

    Returns:
        ``fn``'s return values in rank order (or the outcomes, see ``raise_on_error``).

    Raises:
        ValueError: ``world_size < 1`` or ``collective_timeout >= timeout``.
        DistributedTestError: a rank raised (with every rank's traceback).
        DistributedTimeoutError: a rank did not report within ``timeout`` seconds.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if collective_timeout >= timeout:
        raise ValueError(
            f"collective_timeout ({collective_timeout} s) must be shorter than timeout "
            f"({timeout} s) so a stuck collective fails before the parent kills the ranks"
        )
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    release = ctx.Event()  # set by the parent once every rank has reported (or on timeout)
    with tempfile.TemporaryDirectory(prefix="gefen_dist_") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(
                target=_child,
                args=(
                    rank, world_size, init_file, backend, collective_timeout, fn, tuple(args),
                    dict(env or {}), results, release,
                ),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        outcomes: dict[int, RankOutcome] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(outcomes) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    outcome = results.get(timeout=min(remaining, 0.5))
                except queue_mod.Empty:
                    # A child killed by a signal (e.g. OOM) never reports: notice it.
                    dead = [
                        r for r, p in enumerate(procs)
                        if r not in outcomes and not p.is_alive() and p.exitcode not in (0, None)
                    ]
                    for r in dead:
                        outcomes[r] = RankOutcome(
                            r, error_type="ProcessExit",
                            message=f"process exited with code {procs[r].exitcode}",
                            traceback="",
                        )
                    continue
                outcomes[outcome.rank] = outcome
        finally:
            release.set()
            for p in procs:
                p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5.0)
            results.close()
    ordered = [outcomes[r] for r in sorted(outcomes)]
    missing = [r for r in range(world_size) if r not in outcomes]
    if missing:
        raise DistributedTimeoutError(missing, ordered, timeout)
    ordered = [o if not o.ok else RankOutcome(o.rank, result=pickle.loads(o.result),
                                               seconds=o.seconds) for o in ordered]
    if not raise_on_error:
        return ordered
    if any(not o.ok for o in ordered):
        raise DistributedTestError(ordered)
    return [o.result for o in ordered]
