"""``torch.compile`` of the optimizer step (docs/algorithm.md#compiled-stepping), on the CPU.

Each test compiles a step, counts what dynamo does with ``torch._dynamo.utils.counters`` and
``config.error_on_recompile``, and compares every step with an identical optimizer stepped
eagerly on the same gradients: the compiled step must give the eager step's bits (parameters,
codes, scales, second moments, counters, codebook, global step). Graph breaks are counted when
a graph is traced, so each test clears the counters before the call that traces the steady
step: that call must trace exactly one graph without a break, and later calls must trace
nothing at all.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

from gefen_core import Gefen, GefenMuon, GefenMuonHybrid

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(12, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.fc2 = torch.nn.Linear(16, 20)
        self.fc3 = torch.nn.Linear(20, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.norm(self.fc1(x))))))


def _pair(seed: int = 0, device: str = "cpu") -> tuple[_Net, _Net]:
    torch.manual_seed(seed)
    net = _Net().to(device)
    return net, copy.deepcopy(net)


def _set_grads(nets: tuple[_Net, _Net], step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for a, b in zip(nets[0].parameters(), nets[1].parameters(), strict=True):
        grad = (torch.randn(a.shape, generator=g) * (0.5 + step)).to(a.device)
        a.grad, b.grad = grad.clone(), grad.clone()


def _assert_same(opt: Any, ref: Any, nets: tuple[_Net, _Net]) -> None:
    for (name, a), b in zip(nets[0].named_parameters(), nets[1].parameters(), strict=True):
        assert torch.equal(a, b), name
        for key, value in ref.state[b].items():
            mine = opt.state[a][key]
            if isinstance(value, torch.Tensor):
                assert torch.equal(mine, value), (name, key)
            else:
                assert mine == value, (name, key)
    mine_sd, ref_sd = opt.state_dict(), ref.state_dict()
    assert _global_steps(mine_sd) == _global_steps(ref_sd)


def _global_steps(sd: Any) -> list[int]:
    """Every ``global_step`` in a (possibly nested) state dict."""
    found = []
    if isinstance(sd, dict):
        for key, value in sd.items():
            if key == "global_step":
                found.append(int(value))
            else:
                found.extend(_global_steps(value))
    return found


def _trace_counts(call: Callable[[], Any]) -> tuple[int, int, int]:
    """(graph breaks, graphs, frames) that dynamo traced during ``call()``."""
    counters.clear()
    call()
    return (sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"],
            counters["frames"]["total"])


def _steady(call: Callable[[], Any]) -> None:
    """A steady call traces nothing: no frame, graph or break, no recompile."""
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert _trace_counts(call) == (0, 0, 0)


def _gefen(net: _Net, **options: Any) -> Gefen:
    # Every mode in one optimizer: factored 2-D and block 1-D parameters with nearest rounding,
    # and a group in block mode for its 2-D matrix with stochastic rounding, a tensor lr (on
    # the device a capturable group reads it on), weight decay and maximize.
    lr_device = net.fc3.weight.device if options.get("capturable") else "cpu"
    return Gefen([
        {"params": [*net.fc1.parameters(), *net.norm.parameters(), *net.fc2.parameters()]},
        {"params": [net.fc3.weight], "factored_v_2d": False, "stochastic_round": True,
         "lr": torch.tensor(3e-3, device=lr_device), "weight_decay": 0.1, "maximize": True},
    ], lr=1e-2, **options)


def test_compiled_step_compiles_once_and_matches_eager() -> None:
    nets = _pair()
    opt, ref = _gefen(nets[0]), _gefen(nets[1])
    step = torch.compile(opt.step)
    _set_grads(nets, 0)
    # The first compiled step learns the codebook and the periods outside the graph.
    breaks, _, _ = _trace_counts(step)
    assert breaks >= 1
    ref.step()
    _assert_same(opt, ref, nets)
    _set_grads(nets, 1)
    # The second compiled step traces the steady step: one graph, no break.
    assert _trace_counts(step)[:2] == (0, 1)
    ref.step()
    _assert_same(opt, ref, nets)
    for i in range(2, 5):
        _set_grads(nets, i)
        _steady(step)
        ref.step()
        _assert_same(opt, ref, nets)
    # An eager step after the compiled ones continues from the same step count.
    _set_grads(nets, 5)
    opt.step()
    ref.step()
    _assert_same(opt, ref, nets)
    assert opt._global_step == ref._global_step == 6


def test_compiled_step_after_an_eager_first_step_is_one_fullgraph() -> None:
    nets = _pair(1)
    opt = GefenMuon([nets[0].fc2.weight, nets[0].fc3.weight], lr=2e-2, normuon=True,
                    cautious=True, stochastic_round=True)
    ref = GefenMuon([nets[1].fc2.weight, nets[1].fc3.weight], lr=2e-2, normuon=True,
                    cautious=True, stochastic_round=True)
    _set_grads(nets, 0)
    opt.step()
    ref.step()
    # fullgraph=True: any graph break would raise.
    step = torch.compile(opt.step, fullgraph=True)
    _set_grads(nets, 1)
    assert _trace_counts(step)[:2] == (0, 1)
    ref.step()
    _assert_same(opt, ref, nets)
    for i in range(2, 4):
        _set_grads(nets, i)
        _steady(step)
        ref.step()
        _assert_same(opt, ref, nets)


def test_compiled_batched_newton_schulz_matches_eager() -> None:
    # Nine same-shaped matrices take the batched Newton-Schulz (a stack of momenta, one
    # opaque orthogonalisation, an update op each); the odd one the per-matrix op.
    g = torch.Generator().manual_seed(11)
    mine = [torch.nn.Parameter(torch.randn(8, 16, generator=g)) for _ in range(9)]
    mine.append(torch.nn.Parameter(torch.randn(12, 8, generator=g)))
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in mine]
    opt, ref = (GefenMuon(ps, lr=1e-2, batched_ns=True, normuon=True, stochastic_round=True)
                for ps in (mine, theirs))

    def set_grads(step: int) -> None:
        gen = torch.Generator().manual_seed(step)
        for a, b in zip(mine, theirs, strict=True):
            grad = torch.randn(a.shape, generator=gen)
            a.grad, b.grad = grad.clone(), grad.clone()

    set_grads(0)
    opt.step()
    ref.step()
    step = torch.compile(opt.step, backend="aot_eager", fullgraph=True)
    for i in range(1, 4):
        set_grads(i)
        if i == 1:
            assert _trace_counts(step)[:2] == (0, 1)
        else:
            _steady(step)
        ref.step()
        for a, b in zip(mine, theirs, strict=True):
            assert torch.equal(a, b)
            for key, value in ref.state[b].items():
                assert torch.equal(opt.state[a][key], value) if isinstance(
                    value, torch.Tensor) else opt.state[a][key] == value, key


def test_compiled_hybrid_step_matches_eager_through_functionalization() -> None:
    # aot_eager runs the functionalized graph as it is (no in-place rewrite): the opaque ops
    # get copies of the tensors they mutate, which are copied back.
    nets = _pair(2)
    opt = GefenMuonHybrid(nets[0], lr=2e-2, stochastic_round=True)
    ref = GefenMuonHybrid(nets[1], lr=2e-2, stochastic_round=True)
    _set_grads(nets, 0)
    opt.step()
    ref.step()
    step = torch.compile(opt.step, backend="aot_eager", fullgraph=True)
    for i in range(1, 4):
        _set_grads(nets, i)
        if i == 1:
            assert _trace_counts(step)[:2] == (0, 1)
        else:
            _steady(step)
        ref.step()
        _assert_same(opt, ref, nets)


def test_compiled_train_step_adds_no_break_of_its_own() -> None:
    # torch itself breaks a compiled train step at loss.backward() and opt.zero_grad() (both
    # outside the optimizer step); the step between them is traced whole.
    nets = _pair(3)
    opt = _gefen(nets[0])
    x = torch.randn(8, 12, generator=torch.Generator().manual_seed(7))

    def train_step(inputs: torch.Tensor) -> torch.Tensor:
        loss = nets[0](inputs).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    train_step(x)
    compiled = torch.compile(train_step, backend="aot_eager")
    counters.clear()
    compiled(x)
    reasons = " ".join(counters["graph_break"])
    assert "torch.compiler.disable" not in reasons
    assert "gefen" not in reasons.lower()
    for _ in range(2):
        with torch._dynamo.config.patch(error_on_recompile=True):
            counters.clear()
            compiled(x)
            assert counters["frames"]["total"] == 0
            assert counters["stats"]["unique_graphs"] == 0
    sd = opt.state_dict()
    assert _global_steps(sd) == [4]
    assert all(int(s["step"]) == 4 for s in sd["state"].values())
    assert all(torch.isfinite(p).all() for p in nets[0].parameters())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("capturable", "mode"), [(False, "default"), (True, "default"),
                                                  (True, "reduce-overhead")])
def test_compiled_cuda_step_matches_eager(capturable: bool, mode: str) -> None:
    """On CUDA the opaque op runs the eager fused path (Triton launch plans, grouped launches;
    device scalars and seeds when capturable): the compiled steps give its bits, in default
    mode and in CUDA graphs (reduce-overhead)."""
    nets = _pair(4, "cuda")
    opt, ref = _gefen(nets[0], capturable=capturable), _gefen(nets[1], capturable=capturable)
    _set_grads(nets, 0)
    opt.step()
    ref.step()
    step = torch.compile(opt.step, mode=mode)
    for i in range(1, 6):
        _set_grads(nets, i)
        if i == 1:
            assert _trace_counts(step)[:2] == (0, 1)
        else:
            _steady(step)
        ref.step()
        torch.cuda.synchronize()
        _assert_same(opt, ref, nets)
