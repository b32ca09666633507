"""ShardedGefenMuon step time per ``sharded_mode`` on FSDP2-sharded Llama-3.2-1B hidden matrices.

    python packages/gefen-dist/benchmarks/muon_modes_step.py --world 2 --json muon_modes.json

Needs ``--world`` CUDA GPUs (NCCL); ``--device cpu`` runs the same code on gloo. Builds the
hidden matrices of ``--layers`` Llama-3.2-1B decoder layers (q, k, v, o, gate, up, down; bf16;
16 layers = 973M parameters), shards every layer with ``fully_shard`` (``Shard(0)``), gives
each parameter a random sharded gradient and times ``opt.step()`` of
:class:`gefen_dist.ShardedGefenMuon` in ``"exact"``, ``"distributed"`` and ``"approx"`` mode,
one after the other in the same processes (docs/algorithm.md#distributed). A
step's time is the slowest rank's wall time between a barrier and the synchronised end of the
step; the median over ``--steps`` steps after ``--warmup`` is reported, with the single-GPU
``GefenMuon`` on the full matrices (rank 0, same shapes) as the reference. Prints one JSON
object (also written to ``--json``): per-mode median/min/max ms, the ratios
``distributed / exact`` and ``approx / exact``, GPU names and versions.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

HIDDEN, KV, FFN = 2048, 512, 8192  # Llama-3.2-1B
SHAPES = {
    "q": (HIDDEN, HIDDEN),
    "k": (KV, HIDDEN),
    "v": (KV, HIDDEN),
    "o": (HIDDEN, HIDDEN),
    "gate": (FFN, HIDDEN),
    "up": (FFN, HIDDEN),
    "down": (HIDDEN, FFN),
}
MODES = ("exact", "distributed", "approx")
NO_NVLS = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def _model(layers: int, device: str, shrink: int = 1) -> Any:
    import torch
    from torch import nn

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            for name, shape in SHAPES.items():
                rows, cols = (max(1, d // shrink) for d in shape)
                setattr(self, name, nn.Parameter(torch.randn(rows, cols) * 0.02))

    torch.manual_seed(0)
    model = nn.Module()
    model.layers = nn.ModuleList(Layer() for _ in range(layers))
    return model.to(device=device, dtype=torch.bfloat16)


def _time_steps(
    opt: Any, params: list, grads: list, warmup: int, steps: int, sharded: bool
) -> list[float]:
    import torch
    import torch.distributed as dist

    device = params[0].device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for i in range(warmup + steps):
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        if sharded:
            dist.barrier()
        sync()
        t0 = time.perf_counter()
        opt.step()
        sync()
        dt = torch.tensor([time.perf_counter() - t0], device=device)
        if sharded:
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if i >= warmup:
            times.append(float(dt) * 1e3)
    return times


def _summary(times: list[float]) -> dict[str, float]:
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times)}


def _worker(rank: int, world: int, layers: int, warmup: int, steps: int, device: str,
            shrink: int = 1) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from gefen_core import GefenMuon
    from gefen_dist import ShardedGefenMuon

    if device == "cuda":
        torch.cuda.set_device(rank)
    out: dict[str, Any] = {"modes": {}}
    for mode in MODES:
        model = _model(layers, device, shrink)
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        params = list(model.parameters())
        gen = torch.Generator(device=device).manual_seed(1 + rank)
        grads = []
        for p in params:
            local = p.to_local()
            g = torch.randn(local.shape, device=device, generator=gen).to(local.dtype) * 1e-3
            grads.append(
                DTensor.from_local(g, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
            )
        opt = ShardedGefenMuon(params, sharded_mode=mode)
        out["modes"][mode] = _summary(_time_steps(opt, params, grads, warmup, steps, True))
        del opt, model, params, grads
        if device == "cuda":
            torch.cuda.empty_cache()
    if rank == 0:
        model = _model(layers, device, shrink)
        params = list(model.parameters())
        gen = torch.Generator(device=device).manual_seed(1)
        grads = [
            torch.randn(p.shape, device=device, generator=gen).to(p.dtype) * 1e-3 for p in params
        ]
        out["single_gpu"] = _summary(
            _time_steps(GefenMuon(params), params, grads, warmup, steps, False)
        )
        out["params"] = sum(p.numel() for p in params)
    dist.barrier()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2, help="ranks, one GPU each")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: gloo, a functional smoke of this script, not a figure",
    )
    ap.add_argument(
        "--shrink",
        type=int,
        default=1,
        help="divide every matrix dimension by this: with a large value the step is host "
        "overhead (Python, dispatch, collectives' host side), measurable on the CPU",
    )
    ap.add_argument("--label", default="", help="free text stored in the JSON (e.g. a commit)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    os.environ.update(NO_NVLS)  # inherited by the spawned ranks before they import torch

    import torch

    from gefen_dist.testing import run_distributed

    cuda = args.device == "cuda"
    if cuda and torch.cuda.device_count() < args.world:
        raise SystemExit(
            f"--world {args.world} needs {args.world} CUDA GPUs, "
            f"{torch.cuda.device_count()} visible"
        )
    res = run_distributed(
        _worker,
        args.world,
        args.layers,
        args.warmup,
        args.steps,
        args.device,
        args.shrink,
        backend="cpu:gloo,cuda:nccl" if cuda else "gloo",
        timeout=900,
        collective_timeout=600,
        env=NO_NVLS,
    )[0]
    modes = res["modes"]
    exact = modes["exact"]["median_ms"]
    result = {
        "benchmark": "ShardedGefenMuon step per sharded_mode",
        "command": "python packages/gefen-dist/benchmarks/muon_modes_step.py "
        f"--world {args.world} --layers {args.layers} --warmup {args.warmup} "
        f"--steps {args.steps} --device {args.device} --shrink {args.shrink}",
        "label": args.label,
        "world": args.world,
        "layers": args.layers,
        "params": res["params"],
        "dtype": "bfloat16",
        "steps": args.steps,
        "warmup": args.warmup,
        "modes": modes,
        "single_process_gefen_muon": res["single_gpu"],
        "ratio_distributed_over_exact": modes["distributed"]["median_ms"] / exact,
        "ratio_approx_over_exact": modes["approx"]["median_ms"] / exact,
        "gpus": [torch.cuda.get_device_name(i) for i in range(args.world)] if cuda else [],
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda},
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
