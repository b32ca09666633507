"""What the block second moment costs on sharded 2-D parameters (the documented fallback).

    python packages/gefen-dist/benchmarks/sharded_factored_fallback.py --steps 200

``ShardedGefen`` steps sharded 2-D parameters with the per-block second moment (as gefen-core
does for every DTensor, docs/algorithm.md#factored-second-moment), because the factored row/column
statistics would need a cross-shard reduction every step. This trains the same small byte-level
decoder on real text (the Python standard library's ``os.py``) in one process with
``factored_v_2d=True`` and ``False``, and prints the final training loss (mean of the last 20
steps), the held-out loss and the optimizer state in bytes per parameter for both.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def _run(factored: bool, steps: int, lr: float) -> dict:
    from _dist_models import batches, lm_loss, make_model

    from gefen_core import Gefen

    model = make_model(seed=0, dim=64, layers=2, heads=4, seq=64)
    opt = Gefen(model.named_parameters(), lr=lr, factored_v_2d=factored)
    data = batches(steps, batch=8, seq=64, seed=1)
    held = batches(8, batch=8, seq=64, seed=999)
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = lm_loss(model, x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        test = sum(lm_loss(model, x, y).item() for x, y in held) / len(held)
    n = sum(p.numel() for p in model.parameters())
    state = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values()
                if isinstance(t, torch.Tensor) and t.ndim > 0)
    return {"train": sum(losses[-20:]) / 20, "held_out": test, "bytes_per_param": state / n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=2e-3)
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    for factored in (True, False):
        r = _run(factored, args.steps, args.lr)
        print(f"factored_v_2d={factored!s:5}  train {r['train']:.4f}  held-out "
              f"{r['held_out']:.4f}  state {r['bytes_per_param']:.3f} B/param")


if __name__ == "__main__":
    main()
