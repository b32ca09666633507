"""Peak memory of a GefenDCPState save, with and without GefenSavePlanner.

    python packages/gefen-dist/benchmarks/dcp_save_peak.py                 # CUDA if present
    python packages/gefen-dist/benchmarks/dcp_save_peak.py --device cpu --tensors 32 --numel 2097152

Builds ``--tensors`` parameters of ``--numel`` elements each (default 32 x 2M = 64M), steps a
plain Gefen once (block mode, so the state is the compact ~1 B/param), then runs one
``dcp.save`` per mode in a fresh process and prints the peak memory above what was resident
before the save, in bytes per parameter: the device peak (``torch.cuda.max_memory_allocated``)
on CUDA, the process's peak RSS growth on the CPU. The published reference implementation
was reported at 8.25 -> 0.50 B/param for this shape.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile


def _rss_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _one(mode: str, device: str, tensors: int, numel: int) -> dict:
    import torch
    import torch.distributed.checkpoint as dcp

    from gefen_core import Gefen
    from gefen_dist import GefenDCPState

    torch.manual_seed(0)
    model = torch.nn.ParameterList(
        torch.nn.Parameter(torch.randn(numel // 1024, 1024, device=device) * 0.02)
        for _ in range(tensors))
    opt = Gefen(model.named_parameters(), lr=1e-3, factored_v_2d=False)
    for p in model:
        p.grad = torch.randn_like(p)
    opt.step()
    for p in model:
        p.grad = None
    state_bytes = sum(t.numel() * t.element_size() for st in opt.state.values()
                      for t in st.values() if isinstance(t, torch.Tensor))
    n = tensors * numel
    with tempfile.TemporaryDirectory() as tmp:
        state = GefenDCPState(model, opt)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            base = _rss_peak_bytes()
            import gc

            gc.collect()
        kwargs = {"planner": state.save_planner()} if mode == "planner" else {}
        dcp.save({"optim": state}, checkpoint_id=tmp, no_dist=True, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
        else:
            peak = _rss_peak_bytes() - base
    return {"mode": mode, "device": device, "params": n,
            "state_bytes_per_param": state_bytes / n, "save_peak_bytes_per_param": peak / n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    ap.add_argument("--tensors", type=int, default=32)
    ap.add_argument("--numel", type=int, default=2 * 1024 * 1024)
    ap.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child:
        print(json.dumps(_one(args._child, args.device, args.tensors, args.numel)))
        return
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for mode in ("eager", "planner"):
        out = subprocess.run(
            [sys.executable, __file__, "--_child", mode, "--device", args.device,
             "--tensors", str(args.tensors), "--numel", str(args.numel)],
            check=True, capture_output=True, text=True, env=dict(os.environ))
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{'mode':8} {'device':6} {'params':>12} {'state B/param':>14} {'save peak B/param':>18}")
    for r in rows:
        print(f"{r['mode']:8} {r['device']:6} {r['params']:>12} "
              f"{r['state_bytes_per_param']:>14.3f} {r['save_peak_bytes_per_param']:>18.3f}")


if __name__ == "__main__":
    main()
