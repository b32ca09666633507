"""Device memory held by Gefen's state between steps, with and without ``offload_state_``.

    python packages/gefen-dist/benchmarks/offload_vram.py --tensors 16 --numel 4194304

Needs CUDA. Builds ``--tensors`` parameters of ``--numel`` elements, runs three Gefen steps
(block and factored mode as configured), and prints ``torch.cuda.memory_allocated`` between
steps for the plain optimizer and for the offloaded one, the difference in bytes and in
bytes per parameter, and the step time of each (docs/algorithm.md#distributed).
"""

from __future__ import annotations

import argparse
import time


def _run(offload: bool, tensors: int, numel: int, factored: bool) -> tuple[int, float]:
    import torch

    from gefen_core import Gefen
    from gefen_dist import offload_state_

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(numel // 1024, 1024, device="cuda") * 0.02)
              for _ in range(tensors)]
    opt = Gefen(params, lr=1e-3, factored_v_2d=factored)
    times = []
    for step in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if offload and step == 0:
            offload_state_(opt)
        for p in params:
            p.grad = None
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    del opt, params
    torch.cuda.empty_cache()
    return held, min(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--numel", type=int, default=4 * 1024 * 1024)
    ap.add_argument("--factored", action="store_true", help="factored_v_2d=True")
    args = ap.parse_args()
    n = args.tensors * args.numel
    plain, t_plain = _run(False, args.tensors, args.numel, args.factored)
    off, t_off = _run(True, args.tensors, args.numel, args.factored)
    print(f"params {n}: allocated between steps plain {plain} B, offloaded {off} B, "
          f"saved {plain - off} B = {(plain - off) / n:.3f} B/param; "
          f"step {t_plain * 1e3:.2f} ms plain, {t_off * 1e3:.2f} ms offloaded")


if __name__ == "__main__":
    main()
