"""Graph replay in a real training loop (GPU): how often the steady step replays, and its time.

    python scripts/graph_replay_rate.py --steps 40 --out graph_replay.json

A GPT-2-small-shaped decoder (plain ``torch.nn``: 12 pre-norm layers of width 768, 149
parameter tensors, untied 50257-entry head) trains on random tokens with forward, backward,
``Gefen.step()`` and ``zero_grad(set_to_none=True)``: autograd frees and re-allocates every
gradient each step, as in a user's loop. The loop runs twice from the same seed, with
``GEFEN_CUDA_GRAPHS=0`` (the default) and ``=1``, and reports per run the
median ``opt.step()`` time (CUDA events) and host time over the steps after ``--warmup``, the
replay/eager/capture counts of ``gefen_core._step_graphs.counts()`` and the loss at the end.
Each step is timed after a ``synchronize()``, so the step time includes all of the step's host
work before its kernels; ``--loop-steps N`` then runs N more iterations without any sync and
reports the wall time per iteration, where that host work can overlap the backward pass.
``--profile`` then runs both loops again under cProfile (not timed).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import time

import torch
from torch import nn

from gefen_core import Gefen, _step_graphs


class _Decoder(nn.Module):
    def __init__(self, vocab: int, width: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                width,
                heads,
                4 * width,
                dropout=0.0,
                activation="gelu",
                batch_first=True,
                norm_first=True,
            )
            for _ in range(layers)
        )
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe.weight[: idx.shape[1]]
        for block in self.blocks:
            x = block(x, src_mask=self.mask, is_causal=True)
        return self.head(self.ln_f(x))


def _run(args: argparse.Namespace, graphs: bool, profile: bool) -> dict[str, object]:
    os.environ["GEFEN_CUDA_GRAPHS"] = "1" if graphs else "0"
    torch.manual_seed(0)
    model = _Decoder(args.vocab, args.width, args.layers, args.heads, args.seq).cuda()
    model = model.to(torch.bfloat16)
    opt = Gefen(model.parameters(), lr=3e-4, weight_decay=0.1)
    gen = torch.Generator(device="cuda").manual_seed(1)
    before = _step_graphs.counts()
    profiler = cProfile.Profile() if profile else None
    gpu_ms, host_ms = [], []
    loss = torch.zeros(())
    for step in range(args.steps):
        idx = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device="cuda", generator=gen)
        logits = model(idx[:, :-1])
        loss = nn.functional.cross_entropy(
            logits.float().reshape(-1, args.vocab), idx[:, 1:].reshape(-1)
        )
        loss.backward()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        if profiler is not None and step >= args.warmup:
            profiler.runcall(opt.step)
        else:
            opt.step()
        end.record()
        t1 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if step >= args.warmup:
            gpu_ms.append(start.elapsed_time(end))
            host_ms.append((t1 - t0) * 1e3)
    after = _step_graphs.counts()
    # The loop as a user runs it: no synchronisation inside, so the optimizer's host work can
    # overlap the backward pass's kernels still running; the wall time per iteration.
    loop_ms = None
    if not profile and args.loop_steps:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.loop_steps):
            idx = torch.randint(
                0, args.vocab, (args.batch, args.seq + 1), device="cuda", generator=gen
            )
            loss = nn.functional.cross_entropy(
                model(idx[:, :-1]).float().reshape(-1, args.vocab), idx[:, 1:].reshape(-1)
            )
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        loop_ms = (time.perf_counter() - t0) * 1e3 / args.loop_steps
    loop_counts = {k: v - after[k] for k, v in _step_graphs.counts().items()}
    if profiler is not None:
        print(f"--- cProfile of the measured steps, graph replay {'on' if graphs else 'off'}")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    return {
        "graphs": graphs,
        "tensors": sum(1 for _ in model.parameters()),
        "step_ms_median": statistics.median(gpu_ms),
        "host_ms_median": statistics.median(host_ms),
        "counts": {k: after[k] - before[k] for k in after},
        "steady": opt._steady is not None,
        # Plans taking their gradient by address (the graph's key): none when all are grouped.
        "direct_plans": sum(len(c.groups.direct) for c in opt._steady._calls if c.groups)
        if opt._steady is not None
        else None,
        "final_loss": float(loss),
        "measured_steps": len(gpu_ms),
        "loop_ms_per_iteration": loop_ms,
        "loop_counts": loop_counts,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument(
        "--loop-steps",
        type=int,
        default=0,
        help="then this many iterations without a sync inside: ms per iteration",
    )
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="then run both loops again under cProfile and print the top 25",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    runs = [_run(args, graphs=False, profile=False), _run(args, graphs=True, profile=False)]
    if args.profile:  # separate runs: the profiler's overhead stays out of the timings
        for graphs in (False, True):
            _run(args, graphs=graphs, profile=True)
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "args": vars(args),
        "runs": runs,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
