"""Failure discipline: a check that fails on one rank is an error on every rank, never a hang."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from gefen_dist._agree import CollectiveCheckError, agree, agreed, check_grad_presence
from gefen_dist.testing import DistributedTestError, DistributedTimeoutError, run_distributed

COLLECTIVE_TIMEOUT = 20.0


def _catch(fn):
    start = time.monotonic()
    try:
        fn()
    except CollectiveCheckError as exc:
        return {"type": "CollectiveCheckError", "failed": exc.failed_ranks,
                "msg": str(exc), "seconds": time.monotonic() - start}
    except Exception as exc:  # noqa: BLE001
        return {"type": type(exc).__name__, "msg": str(exc), "seconds": time.monotonic() - start}
    return {"type": None, "seconds": time.monotonic() - start}


def _scenarios(rank: int, world: int) -> dict:
    out = {}

    def fail_on_last_rank():
        with agreed("load validation"):
            if rank == world - 1:
                raise ValueError("corrupt shard on this rank")
        dist.barrier()  # never reached when the check failed

    out["one_rank_fails"] = _catch(fail_on_last_rank)

    def all_fine():
        with agreed("load validation"):
            pass
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == world

    out["all_fine"] = _catch(all_fine)

    def grads_differ():
        params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(4)]
        for i, p in enumerate(params):
            if i != 2 or rank == 0:
                p.grad = torch.ones(3)
        check_grad_presence(params, names=["a", "b", "c", "d"])

    out["grads_differ"] = _catch(grads_differ)

    def grads_same():
        params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(3)]
        params[1].grad = torch.ones(3)
        return check_grad_presence(params)

    out["grads_same"] = _catch(grads_same)
    params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(3)]
    params[1].grad = torch.ones(3)
    out["presence"] = check_grad_presence(params)

    def counts_differ():
        params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(2 + rank)]
        check_grad_presence(params)

    out["counts_differ"] = _catch(counts_differ)

    def every_rank_fails():
        agree(RuntimeError(f"boom {rank}"), "step")

    out["every_rank_fails"] = _catch(every_rank_fails)
    # The group is still usable after all the agreed failures.
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    out["sum_after"] = t.item()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2])
def test_agreed_failures_raise_on_every_rank(world):
    results = run_distributed(_scenarios, world, collective_timeout=COLLECTIVE_TIMEOUT)
    for rank, out in enumerate(results):
        one = out["one_rank_fails"]
        assert one["type"] == "CollectiveCheckError", (rank, one)
        assert one["failed"] == [world - 1]
        assert "corrupt shard on this rank" in one["msg"]
        # Agreement is one all-reduce, not a collective timeout.
        assert one["seconds"] < COLLECTIVE_TIMEOUT / 2
        assert out["all_fine"]["type"] is None
        gd = out["grads_differ"]
        assert gd["type"] == "CollectiveCheckError" and "'c'" in gd["msg"], gd
        assert "'a'" not in gd["msg"] and "'b'" not in gd["msg"]
        assert out["grads_same"]["type"] is None
        assert out["presence"] == [False, True, False]
        cd = out["counts_differ"]
        assert cd["type"] == "CollectiveCheckError" and "parameters" in cd["msg"], cd
        ev = out["every_rank_fails"]
        assert ev["failed"] == list(range(world))
        assert all(f"boom {r}" in ev["msg"] for r in range(world))
        assert out["sum_after"] == sum(range(world))
    # Identical message on every rank.
    assert len({out["one_rank_fails"]["msg"] for out in results}) == 1


def _unagreed_failure(rank: int, world: int) -> None:
    if rank == 1:
        raise KeyError("rank-local failure without agreement")
    dist.barrier()


@pytest.mark.timeout(120)
def test_harness_unagreed_failure_surfaces_on_every_rank_within_timeout():
    # Without agreement the peer waits in its collective until the process-group timeout
    # (a gloo error), and the harness reports both ranks instead of hanging.
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_unagreed_failure, 2, collective_timeout=5.0, timeout=60.0)
    assert time.monotonic() - start < 60.0
    outcomes = info.value.outcomes
    assert [o.rank for o in outcomes] == [0, 1]
    assert outcomes[1].error_type == "builtins.KeyError"
    assert "rank-local failure without agreement" in outcomes[1].traceback
    assert not outcomes[0].ok  # the peer raised too (collective timeout / connection closed)


def _sleeper(rank: int, world: int) -> None:
    if rank == 0:
        time.sleep(60)


@pytest.mark.timeout(60)
def test_harness_kills_ranks_past_the_deadline():
    start = time.monotonic()
    with pytest.raises(DistributedTimeoutError) as info:
        run_distributed(_sleeper, 2, timeout=12.0, collective_timeout=5.0)
    # Rank 0 sleeps past the deadline (rank 1 normally reports; on a saturated machine its
    # start-up alone may exceed the deadline too).
    assert 0 in info.value.missing
    assert time.monotonic() - start < 40.0


def _results(rank: int, world: int, base: int) -> tuple[int, int]:
    return rank, base + world


@pytest.mark.timeout(60)
def test_harness_returns_results_in_rank_order():
    assert run_distributed(_results, 2, 10) == [(0, 12), (1, 12)]


def test_agree_without_process_group_reraises_local_error():
    with pytest.raises(ValueError, match="local"):
        agree(ValueError("local"), "check")
    agree(None, "check")
    p = torch.nn.Parameter(torch.zeros(1))
    assert check_grad_presence([p]) == [False]
