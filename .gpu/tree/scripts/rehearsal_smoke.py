#!/usr/bin/env python3
"""One real training step through the installed ``gefen`` facade (release rehearsal smoke).

Trains a two-layer MLP on scikit-learn-free synthetic regression data for one step with
``gefen.Gefen`` and checks that the loss is finite, every parameter moved, and the
optimizer holds 1-byte momentum codes (``exp_avg_codes``, uint8). Also resolves
``gefen.GefenDCPState`` (installed through ``gefen-x[dist]``). Exit status 1 on failure.
"""

from __future__ import annotations

import sys

import torch

import gefen


def main() -> int:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 1))
    inputs = torch.randn(256, 64)
    targets = inputs[:, :8].sum(dim=1, keepdim=True)
    optimizer = gefen.Gefen(model.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    loss = torch.nn.functional.mse_loss(model(inputs), targets)
    loss.backward()
    optimizer.step()
    after = list(model.parameters())
    moved = [not torch.equal(b, p.detach()) for b, p in zip(before, after, strict=True)]
    codes = [s.get("exp_avg_codes") for s in optimizer.state.values()]
    problems = []
    if not torch.isfinite(loss):
        problems.append(f"loss is {loss.item()}")
    if not all(moved):
        problems.append(
            f"parameters that did not move: {[i for i, m in enumerate(moved) if not m]}"
        )
    if not codes or any(c is None or c.dtype != torch.uint8 for c in codes):
        problems.append("optimizer state holds no uint8 exp_avg_codes")
    dcp_state = gefen.GefenDCPState
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    if problems:
        return 1
    print(
        f"one Gefen step: loss {loss.item():.4f}, {len(codes)} tensors with uint8 codes; "
        f"gefen.GefenDCPState -> {dcp_state.__module__}.{dcp_state.__qualname__}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
