"""Graph-replayed eager fused steps (``gefen_kernels.ops._step_graphs``: the full step's per-plan
launches and the steady step's grouped launches) against eager launches.

A replay must give the eager step's bits, and must not replay when any captured address moved
(new gradient storage, a parameter whose ``.data`` was replaced). Skipped only when CUDA is
absent."""

from __future__ import annotations

import pytest
import torch

from gefen_core import Gefen
from gefen_kernels.ops import _step_graphs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

_SHAPES = {"proj.weight": (256, 384), "head.weight": (96, 4097), "norm.weight": (384,),
           "conv.weight": (32, 16, 3, 3), "odd": (4097,)}


def _params(dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [(n, torch.randn(s, generator=gen).to("cuda", dtype).requires_grad_())
            for n, s in _SHAPES.items()]


def _grad_values(step: int, params: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=gen).to(p.device, p.dtype) for _, p in params]


def _train(monkeypatch: pytest.MonkeyPatch, *, graphs: bool, dtype: torch.dtype,
           stochastic: bool, grads: str, steps: int = 7, move_param_at: int | None = None,
           ) -> tuple[list[torch.Tensor], Gefen]:
    """``grads``: 'static' (one storage per parameter, overwritten each step), 'moving' (new
    tensors each step) or 'strided' (static storage seen through a transposed view)."""
    monkeypatch.setenv("GEFEN_CUDA_GRAPHS", "1" if graphs else "0")
    params = _params(dtype)
    opt = Gefen(params, lr=1e-2, weight_decay=0.1, stochastic_round=stochastic)
    storage = [torch.empty(p.shape[::-1] if grads == "strided" and p.dim() == 2 else p.shape,
                           device="cuda", dtype=dtype) for _, p in params]
    for step in range(steps):
        for (_, p), value, buf in zip(params, _grad_values(step, params), storage):
            if grads == "moving":
                p.grad = value
            elif grads == "strided" and p.dim() == 2:
                buf.copy_(value.t())
                p.grad = buf.t()
            else:
                buf.copy_(value)
                p.grad = buf
        if step == move_param_at:
            p0 = params[0][1]
            p0.data = p0.data.clone()  # the captured parameter address is no longer it
        opt.step()
    torch.cuda.synchronize()
    return [p.detach().clone() for _, p in params], opt


def _graph_of(opt: Gefen) -> object:
    """The graph a full step (per-plan launches) or a steady step (grouped launches) of
    ``opt`` would replay next, or ``None``."""
    first = next(iter(opt.param_groups[0]["params"]))
    entry = _step_graphs._ENTRIES.get(opt.state[first]["exp_avg_codes"])
    if entry is not None and entry.graph is not None:
        return entry.graph
    steady = opt._steady
    for call in steady._calls if steady is not None else []:
        groups = call.record.groups
        group_entry = _step_graphs._GROUP_ENTRIES.get(groups) if groups else None
        if group_entry is not None and group_entry.graph is not None:
            return group_entry.graph
    return None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("stochastic", [False, True])
def test_replayed_steps_equal_eager_steps(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
                                          stochastic: bool) -> None:
    eager, eager_opt = _train(monkeypatch, graphs=False, dtype=dtype, stochastic=stochastic,
                              grads="static")
    before = _step_graphs.counts()
    graphed, graphed_opt = _train(monkeypatch, graphs=True, dtype=dtype,
                                  stochastic=stochastic, grads="static")
    after = _step_graphs.counts()
    assert _graph_of(eager_opt) is None
    assert _graph_of(graphed_opt) is not None  # the later steps were replayed
    # Step 1 is the full step; steady step 2 launches eagerly, step 3 captures, 4-7 replay.
    assert graphed_opt._steady is not None
    assert after["replays"] - before["replays"] >= 4
    for a, b in zip(eager, graphed):
        assert torch.equal(a, b)
    for p_e, p_g in zip(eager_opt.param_groups[0]["params"],
                        graphed_opt.param_groups[0]["params"]):
        for key, value in eager_opt.state[p_e].items():
            other = graphed_opt.state[p_g][key]
            if isinstance(value, torch.Tensor):
                assert torch.equal(value.cpu(), other.cpu()), key


@pytest.mark.parametrize("grads", ["moving", "strided"])
def test_moving_and_strided_gradients_equal_eager(monkeypatch: pytest.MonkeyPatch,
                                                  grads: str) -> None:
    eager, _ = _train(monkeypatch, graphs=False, dtype=torch.bfloat16, stochastic=False,
                      grads=grads)
    graphed, _ = _train(monkeypatch, graphs=True, dtype=torch.bfloat16, stochastic=False,
                        grads=grads)
    for a, b in zip(eager, graphed):
        assert torch.equal(a, b)


def test_a_moved_parameter_is_not_written_through_a_stale_graph(
        monkeypatch: pytest.MonkeyPatch) -> None:
    eager, _ = _train(monkeypatch, graphs=False, dtype=torch.float32, stochastic=False,
                      grads="static", move_param_at=6)
    graphed, opt = _train(monkeypatch, graphs=True, dtype=torch.float32, stochastic=False,
                          grads="static", move_param_at=6)
    for a, b in zip(eager, graphed):
        assert torch.equal(a, b)
    # A replay of the steady step's graph would have written the old storage at step 6 (the
    # parameter would then differ); the steady check saw the moved address and sent the step
    # to the full path, whose own graph key changed too, and which rebuilt the groups.
    assert _graph_of(opt) is None


def test_a_moved_direct_gradient_is_not_read_through_a_stale_graph(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan launched with its gradient's own address (here: a gradient off a 16-byte
    boundary, which cannot be grouped) ties the steady graph to that address. When it moves,
    the step runs eagerly, and the old storage, zeroed, is never read."""
    def train(graphs: bool) -> tuple[list[torch.Tensor], int]:
        monkeypatch.setenv("GEFEN_CUDA_GRAPHS", "1" if graphs else "0")
        params = _params(torch.bfloat16)
        opt = Gefen(params, lr=1e-2, weight_decay=0.1)
        storage = [torch.empty(p.shape, device="cuda", dtype=p.dtype) for _, p in params]

        def unaligned(shape: torch.Size) -> torch.Tensor:
            n = 1
            for s in shape:
                n *= s
            return torch.empty(n + 1, device="cuda", dtype=torch.bfloat16)[1:].view(shape)

        storage[0] = unaligned(params[0][1].shape)
        before = _step_graphs.counts()
        for step in range(8):
            if step == 5:
                old = storage[0]
                storage[0] = unaligned(params[0][1].shape)
            for (_, p), value, buf in zip(params, _grad_values(step, params), storage):
                buf.copy_(value)
                p.grad = buf
            if step == 5:
                old.zero_()  # what a stale replay would read
            opt.step()
        torch.cuda.synchronize()
        assert opt._steady is not None
        assert any(0 in call.record.groups.direct for call in opt._steady._calls
                   if call.record.groups)
        return [p.detach().clone() for _, p in params], (_step_graphs.counts()["replays"]
                                                         - before["replays"])

    eager, _ = train(graphs=False)
    graphed, replays = train(graphs=True)
    for a, b in zip(eager, graphed):
        assert torch.equal(a, b)
    # Steps 4-5 replayed (captured at 3); the moved gradient made step 6 eager; step 7
    # captured again and step 8 replayed.
    assert replays == 3


def test_training_loop_with_freed_gradients_equals_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real loop (forward, backward, step, ``zero_grad(set_to_none=True)``): autograd frees
    and re-allocates the gradients every step, so whether addresses repeat is the allocator's
    call. A twin optimizer steps a copy of the parameters eagerly from clones of the same
    gradients, in lockstep; the two must stay bit-identical."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 10)).cuda()
    twin = [p.detach().clone().requires_grad_() for p in model.parameters()]
    opt = Gefen(model.parameters(), lr=1e-3, weight_decay=0.1)
    eager = Gefen(twin, lr=1e-3, weight_decay=0.1)
    gen = torch.Generator(device="cuda").manual_seed(1)
    before = _step_graphs.counts()["replays"]
    for _ in range(12):
        x = torch.randn(32, 64, device="cuda", generator=gen)
        y = torch.randint(0, 10, (32,), device="cuda", generator=gen)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        for p, q in zip(model.parameters(), twin):
            q.grad = p.grad.clone()
        monkeypatch.setenv("GEFEN_CUDA_GRAPHS", "1")
        opt.step()
        monkeypatch.setenv("GEFEN_CUDA_GRAPHS", "0")
        eager.step()
        opt.zero_grad(set_to_none=True)
        for p, q in zip(model.parameters(), twin):
            assert torch.equal(p, q)
    # Every tensor of this model is grouped (no plan takes its gradient by address), so the
    # steady steps replay whatever addresses the allocator gives the gradients: step 1 is
    # full, step 2 launches eagerly, step 3 captures, steps 4-12 replay.
    assert opt._steady is not None
    assert all(not call.record.groups.direct for call in opt._steady._calls if call.record.groups)
    assert _step_graphs.counts()["replays"] - before == 9
