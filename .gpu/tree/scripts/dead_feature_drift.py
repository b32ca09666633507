"""How far the weights of a feature that stops getting gradients keep moving (diagnostic).

    python scripts/dead_feature_drift.py --out docs/results/cpu-dead-feature-drift

A ``[64, 64]`` fp32 parameter gets standard-normal gradients for ``--live`` steps; then its
first four columns (four input features, e.g. dead ReLU units feeding the layer) get exact-zero
gradients while the other columns stay live. With AdamW the dead columns' update decays with
the momentum (``beta1 ** t``) and reaches exactly zero. The script prints, for each optimizer,
the largest per-step change of a dead-column weight at several times after the feature died,
in units of ``lr``. Weight decay is 0, so any change is the update itself.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from gefen_core import Gefen

Factory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


def _drift(make: Factory, live: int, dead: int, marks: list[int]) -> dict[int, float]:
    p = torch.nn.Parameter(torch.zeros(64, 64))
    opt = make([p])
    gen = torch.Generator().manual_seed(1)
    out: dict[int, float] = {}
    for t in range(live + dead):
        grad = torch.randn(64, 64, generator=gen)
        if t >= live:
            grad[:, :4] = 0.0
        p.grad = grad
        before = p.detach()[:, :4].clone()
        opt.step()
        since = t + 1 - live
        if since in marks:
            out[since] = (p.detach()[:, :4] - before).abs().max().item()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--live", type=int, default=100, help="steps before the feature dies")
    parser.add_argument("--dead", type=int, default=3000, help="steps after it dies")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--out", type=Path, default=None, help="write results.json here")
    args = parser.parse_args()
    lr = args.lr
    marks = sorted({m for m in (1, 10, 100, 1000, args.dead) if m <= args.dead})
    optimizers: dict[str, Factory] = {
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=0.0),
        "gefen": lambda ps: Gefen(ps, lr=lr, weight_decay=0.0),
        "gefen factored_v_2d=False": lambda ps: Gefen(
            ps, lr=lr, weight_decay=0.0, factored_v_2d=False
        ),
        "gefen stochastic_round=True": lambda ps: Gefen(
            ps, lr=lr, weight_decay=0.0, stochastic_round=True
        ),
    }
    results = {}
    print(
        "largest per-step change of a dead-column weight, in units of lr, t steps after "
        "the feature died"
    )
    print(f"{'optimizer':30s}" + "".join(f"{f't={m}':>12s}" for m in marks))
    for name, make in optimizers.items():
        torch.manual_seed(0)
        drift = {m: v / lr for m, v in _drift(make, args.live, args.dead, marks).items()}
        results[name] = drift
        print(f"{name:30s}" + "".join(f"{drift[m]:12.3g}" for m in marks))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {
            "command": " ".join(["python", *sys.argv]),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "unit": "max |delta p| per step / lr",
        }
        (args.out / "results.json").write_text(
            json.dumps({"meta": meta, "results": results}, indent=1) + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
