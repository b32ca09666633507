"""step_in_backward on CUDA: the fused path stepped in buckets from the gradient hooks is
bit-identical to the grouped full step, and the gradients no longer add up in peak memory
(docs/algorithm.md#step-in-backward)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from gefen_core import Gefen, step_in_backward

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@contextlib.contextmanager
def _deterministic() -> Iterator[None]:
    """Deterministic CUDA backward: the math attention kernel and torch's deterministic
    algorithms. The flash and memory-efficient attention backwards accumulate with atomics, so
    two runs of the same training differ in their gradients whatever the optimizer does."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


@pytest.mark.parametrize("kind", ["block-nearest", "factored-stochastic"])
def test_fused_in_backward_is_bit_identical_to_the_fused_full_step(kind: str) -> None:
    from test_backward_step import OPTIONS, _same, _train

    options = dict(OPTIONS[kind], fused=True)
    with _deterministic():
        reference = _train("nn", options, steps=8, switch_at=4, device="cuda",
                           dtype=torch.bfloat16)
        # The harness repeats itself, so a difference below is the stepping's.
        _same(_train("nn", options, steps=8, switch_at=4, device="cuda", dtype=torch.bfloat16),
              reference, "nn twice")
        for modes in ("bb", "nb", "bn"):
            got = _train(modes, options, steps=8, switch_at=4, device="cuda",
                         dtype=torch.bfloat16)
            _same(got, reference, modes)


def _peak_of_a_step(in_backward: bool, layers: int = 16, width: int = 2048,
                    before: int = 3, bucket_cap_mb: float = 25.0) -> tuple[int, int]:
    """Peak bytes allocated during one training step (backward and optimizer.step()) of a bf16
    stack of linear layers, each followed by an RMS norm as in a transformer, after ``before``
    steps (0: the first step, which learns the codebook), beyond what was allocated before it;
    and the gradients' bytes. The handle keeps the smallest parameter's gradient for
    ``optimizer.step()``: here a norm's weight, as in a real model."""
    torch.manual_seed(0)
    blocks = [m for _ in range(layers) for m in (nn.Linear(width, width, bias=False),
                                                  nn.RMSNorm(width))]
    model = nn.Sequential(*blocks).to(device="cuda", dtype=torch.bfloat16)
    opt = Gefen(model.named_parameters(), lr=1e-4, fused=True)
    handle = step_in_backward(model, opt, bucket_cap_mb=bucket_cap_mb) if in_backward else None
    x = torch.randn(4, width, device="cuda", dtype=torch.bfloat16)
    for _ in range(before):
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model(x).float().square().mean().backward()
    opt.step()
    opt.zero_grad()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    if handle is not None:
        handle.remove()
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return peak, grad_bytes


def test_in_backward_peak_memory_drops_by_most_of_the_gradients() -> None:
    normal, grad_bytes = _peak_of_a_step(in_backward=False)
    each, _ = _peak_of_a_step(in_backward=True, bucket_cap_mb=0)
    bucketed, _ = _peak_of_a_step(in_backward=True)
    print(f"step peak above the resting allocation: normal {normal / 2**20:.1f} MiB, in "
          f"backward {each / 2**20:.1f} MiB one parameter at a time, {bucketed / 2**20:.1f} MiB "
          f"in 25 MiB buckets, gradients {grad_bytes / 2**20:.1f} MiB")
    assert normal - each >= 0.8 * grad_bytes
    # A bucket holds gradients until their bytes reach the cap: at most the cap and one
    # gradient (8 MiB here) more than stepping each at once.
    assert bucketed - each <= (25 + 8) * 2**20


def test_offloaded_first_step_peak_memory_drops_by_most_of_the_gradients() -> None:
    # On CUDA the codebook-learning step offloads each gradient after its hook (the default).
    normal, grad_bytes = _peak_of_a_step(in_backward=False, before=0)
    offloaded, _ = _peak_of_a_step(in_backward=True, before=0)
    print(f"first-step peak above the resting allocation: normal {normal / 2**20:.1f} MiB, "
          f"offloaded {offloaded / 2**20:.1f} MiB, gradients {grad_bytes / 2**20:.1f} MiB")
    assert normal - offloaded >= 0.8 * grad_bytes
