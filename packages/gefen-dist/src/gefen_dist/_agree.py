"""Agree on rank-local checks before a collective, so a failure is an error on every rank.

A rank that raises between two collectives leaves its peers blocked in the next one until the
process-group timeout (docs/algorithm.md#distributed). Every rank-local check that precedes a
collective therefore runs inside :func:`agreed`: each rank records whether its check failed,
one all-reduce combines the flags, and then either every rank proceeds or every rank raises the
same :class:`CollectiveCheckError`, whose message names the failing ranks and their errors.

:func:`check_grad_presence` is the special case the optimizer needs before its first collective
of a step: which parameters have a gradient must be identical on every rank, otherwise ranks
would enter different sequences of per-parameter collectives.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CollectiveCheckError", "agree", "agreed", "check_grad_presence", "collective_device"]


class CollectiveCheckError(RuntimeError):
    """A check failed on at least one rank; raised identically on every rank.

    Attributes:
        what: the check's description.
        failed_ranks: ranks (in the group) whose check failed, ascending.
        messages: ``{rank: "ExcType: message"}`` for every failing rank.
    """

    def __init__(self, what: str, failed_ranks: Sequence[int], messages: dict[int, str]):
        self.what = what
        self.failed_ranks = list(failed_ranks)
        self.messages = dict(messages)
        detail = "; ".join(f"rank {r}: {messages.get(r, '?')}" for r in self.failed_ranks)
        super().__init__(f"{what} failed on rank(s) {self.failed_ranks}: {detail}")


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Device for small control tensors on ``group``: CUDA for NCCL-only groups, else CPU."""
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "cpu" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _group_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def agree(
    local_error: BaseException | None,
    what: str,
    *,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Combine per-rank verdicts; raise :class:`CollectiveCheckError` on every rank if any failed.

    Collective: every rank of ``group`` must call it, in the same order relative to other
    collectives. Costs one all-reduce of ``world_size`` int32 flags, plus one object all-gather
    of the error messages only when something failed.

    Args:
        local_error: this rank's failure, or ``None``.
        what: short description of the check, used in the message.
        group: process group (default: the default group).

    Raises:
        CollectiveCheckError: on every rank, when any rank passed an error; chained to the
            local error where there is one.
    """
    if not dist.is_available() or not dist.is_initialized():
        if local_error is not None:
            raise local_error
        return
    rank, world = _group_rank(group)
    flags = torch.zeros(world, dtype=torch.int32, device=collective_device(group))
    if local_error is not None:
        flags[rank] = 1
    dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=group)
    failed = [r for r, f in enumerate(flags.tolist()) if f]
    if not failed:
        return
    mine = None if local_error is None else f"{type(local_error).__name__}: {local_error}"
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine, group=group)
    messages = {r: str(gathered[r]) for r in failed}
    raise CollectiveCheckError(what, failed, messages) from local_error


@contextlib.contextmanager
def agreed(what: str, *, group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """Run the block as a rank-local check whose verdict all ranks agree on.

    Usage::

        with agreed("validate checkpoint", group=pg):
            validate(local_state)        # may raise on this rank only
        dist.all_gather(...)             # reached by every rank, or by none

    An exception in the block is caught, agreed with every rank (:func:`agree`) and raised on
    every rank as :class:`CollectiveCheckError`. ``KeyboardInterrupt``/``SystemExit`` are not
    caught.
    """
    error: BaseException | None = None
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - any local failure must be agreed before raising
        error = exc
    agree(error, what, group=group)


def check_grad_presence(
    params: Sequence[torch.Tensor],
    names: Sequence[str] | None = None,
    *,
    group: dist.ProcessGroup | None = None,
) -> list[bool]:
    """Check that the same parameters have a gradient on every rank.

    Collective: two all-reduces of small int32 tensors (parameter count, then the presence
    mask). Call it before the first per-parameter collective of a step.

    Args:
        params: parameters in the order the optimizer visits them (identical on every rank).
        names: optional names for the error message, parallel to ``params``.
        group: process group (default: the default group).

    Returns:
        ``[p.grad is not None for p in params]``, identical on every rank.

    Raises:
        CollectiveCheckError: on every rank, when the ranks disagree on the number of parameters
            or on which ones have a gradient (the message names the first few that differ).
    """
    present = [p.grad is not None for p in params]
    if not dist.is_available() or not dist.is_initialized():
        return present
    device = collective_device(group)
    n = len(present)
    # First agree on the count: tensors of different lengths cannot be reduced together.
    count = torch.tensor([n, -n], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    count_error = None
    if int(count[0]) != n or int(-count[1]) != n:
        count_error = ValueError(
            f"this rank has {n} parameters, others have between {int(-count[1])} and "
            f"{int(count[0])}; build the optimizer from the same parameters on every rank"
        )
    agree(count_error, "parameter count check", group=group)
    mask = torch.tensor(present, dtype=torch.int32, device=device)
    both = torch.cat([mask, 1 - mask])
    dist.all_reduce(both, op=dist.ReduceOp.MIN, group=group)
    # Index i differs across ranks iff min(mask_i) == 0 and min(1 - mask_i) == 0.
    differs = ((both[:n] == 0) & (both[n:] == 0)).nonzero().flatten().tolist()
    if differs:
        label = [names[i] if names is not None else f"param {i}" for i in differs[:5]]
        mine = {label[j]: present[i] for j, i in enumerate(differs[:5])}
        agree(
            ValueError(
                f"gradient presence differs across ranks for {len(differs)} parameter(s), e.g. "
                f"{label} (this rank has grad: {mine}); every rank must produce gradients for "
                "the same parameters (set unused ones' grad to zeros, or None on every rank)"
            ),
            "gradient presence check",
            group=group,
        )
    return present
