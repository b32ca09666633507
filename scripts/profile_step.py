"""Where a fused Gefen step spends its time on CUDA: host profile and per-kernel device time.

    PYTHONPATH=<packages>/src python scripts/profile_step.py --models gpt2,llama > profile.txt

For each model-shaped bf16 parameter set (``gefen_bench.param_sets``) and each second-moment
mode, prints the first-step wall time, the steady step's host-issue and CUDA-event times, the
top host functions under ``cProfile`` over ``--steps`` steady steps, and the device time per
kernel name from ``torch.profiler`` (docs/algorithm.md#step; the kernels issue's speed targets),
then the first step of a second optimizer on the same gradients, with the kernels already loaded.
A diagnostic for kernel work, not a benchmark: ``gefen-bench step`` is the measurement.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch


def _profile(model: str, factored: bool, steps: int, launches: bool = False) -> None:
    from gefen_bench.param_sets import build_param_set, shapes_for
    from gefen_core import Gefen

    dev = torch.device("cuda")
    named = build_param_set(shapes_for(model, "full"), device=dev, dtype=torch.bfloat16)
    opt = Gefen(named, lr=1e-4, weight_decay=0.0, factored_v_2d=factored)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    pr = cProfile.Profile()
    pr.enable()
    opt.step()
    torch.cuda.synchronize()
    pr.disable()
    first = time.perf_counter() - t0
    print(f"\n=== {model} factored_v_2d={factored}: first step {first * 1e3:.1f} ms")
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(25)
    print(s.getvalue())
    for _ in range(5):
        opt.step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    hosts, devs = [], []
    for _ in range(steps):
        start.record()
        h0 = time.perf_counter()
        opt.step()
        hosts.append(time.perf_counter() - h0)
        end.record()
        torch.cuda.synchronize()
        devs.append(start.elapsed_time(end))
    hosts.sort()
    devs.sort()
    print(
        f"steady: host issue median {hosts[len(hosts) // 2] * 1e3:.2f} ms, "
        f"event median {devs[len(devs) // 2]:.2f} ms"
    )
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        opt.step()
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
    print(f"--- cProfile over {steps} steady steps, by own time")
    print(s.getvalue())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            opt.step()
        torch.cuda.synchronize()
    print("--- device time per kernel over 3 steady steps")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20))
    if launches:
        _print_launches(opt)
    # A second optimizer's first step over the same gradients: every kernel it launches is
    # already loaded in this process, so this is the first step's own work (period search,
    # codebook, state, first update) without Triton's compile or cache load.
    del opt
    torch.cuda.empty_cache()
    again = Gefen(named, lr=1e-4, weight_decay=0.0, factored_v_2d=factored)
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        t0 = time.perf_counter()
        pr.enable()
        again.step()
        torch.cuda.synchronize()
        pr.disable()
        second = time.perf_counter() - t0
    print(
        f"--- first step of a second optimizer (kernels loaded): {second * 1e3:.1f} ms "
        "(under both profilers)"
    )
    t0 = time.perf_counter()
    Gefen(named, lr=1e-4, weight_decay=0.0, factored_v_2d=factored).step()
    torch.cuda.synchronize()
    print(
        f"--- first step of a third optimizer, no profiler: "
        f"{(time.perf_counter() - t0) * 1e3:.1f} ms"
    )
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(40)
    print(s.getvalue())
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
    del again, named
    torch.cuda.empty_cache()


def _print_launches(opt) -> None:  # type: ignore[no-untyped-def]
    """Each kernel of one steady step in issue order with its device time, then the
    (shape, period, factored) census of the parameters (what the launch classes hold)."""
    from collections import Counter

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        opt.step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: e.time_range.start)
    total = sum(e.time_range.elapsed_us() for e in kernels)
    print(f"--- one steady step, {len(kernels)} kernels, {total:.1f} us of device time")
    for e in kernels:
        print(f"  {e.time_range.elapsed_us():9.1f} us  {e.name[:90]}")
    census: Counter[tuple[object, ...]] = Counter()
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state[p]
            if "exp_avg_codes" in st:
                census[
                    (tuple(p.shape), int(st["exp_avg_codes"].shape[1]), "exp_avg_sq_row" in st)
                ] += 1
    print("--- parameters (shape, period, factored): count")
    for key, count in sorted(census.items(), key=lambda kv: -kv[1] * torch.Size(kv[0][0]).numel()):
        print(f"  {key}: {count}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,llama")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--modes",
        default="factored,block",
        help="second-moment modes, comma-separated (factored, block)",
    )
    parser.add_argument(
        "--launches",
        action="store_true",
        help="also list each kernel of one steady step, and the periods",
    )
    args = parser.parse_args()
    modes = args.modes.split(",")
    if not set(modes) <= {"factored", "block"}:
        parser.error(f"--modes takes factored and/or block, got {args.modes!r}")
    for model in args.models.split(","):
        for mode in modes:
            _profile(model, mode == "factored", args.steps, args.launches)


if __name__ == "__main__":
    main()
