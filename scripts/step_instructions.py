"""How many instructions a fused Gefen step executes, and the time the GPU needs to issue them.

    ncu --profile-from-start off --csv --metrics smsp__inst_executed.sum,\\
        gpu__time_duration.sum,smsp__cycles_elapsed.avg.per_second \\
        python scripts/step_instructions.py --model llama > llama.csv
    python scripts/step_instructions.py --summarize llama.csv --model llama

The first form steps a model-shaped bf16 parameter set (``gefen_bench.param_sets``) with
``Gefen`` a few times, then profiles one steady step (``torch.cuda.profiler`` start/stop, so
Nsight Compute sees only that step's kernels). The second form sums Nsight Compute's counts:
warp instructions executed per parameter, and the issue bound, the time the step's kernels
need at one warp instruction per cycle per scheduler (four per SM) at the measured SM clock,
whatever their memory traffic. A step cannot take less than its issue bound; a speed target
below it needs fewer instructions, not better overlap or bandwidth (kernel notes, twentieth
session).
"""

from __future__ import annotations

import argparse
import csv
import io
import sys
from collections import defaultdict

SCHEDULERS_PER_SM = 4  # warp schedulers per streaming multiprocessor (sm_90), one issue/cycle
# Nsight Compute's units (matched lower-cased) for a duration ("ns" in its --csv output) in ms,
_MS = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0}
# and for a clock rate ("hz" in --csv; "Ghz" on the details page; "cycle/<time>" forms) in Hz.
_HZ = {"hz": 1.0, "khz": 1e3, "mhz": 1e6, "ghz": 1e9, "second": 1.0, "usecond": 1e6, "nsecond": 1e9}


def _step(model: str, factored: bool, warm_steps: int) -> None:
    # Imported here: --summarize (and this script's test in `nox -s lint`) needs no torch.
    import torch

    from gefen_bench.param_sets import build_param_set, shapes_for
    from gefen_core import Gefen

    named = build_param_set(
        shapes_for(model, "full"), device=torch.device("cuda"), dtype=torch.bfloat16
    )
    opt = Gefen(named, lr=1e-4, weight_decay=0.0, factored_v_2d=factored)
    for _ in range(warm_steps):
        opt.step()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    opt.step()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def _params(model: str) -> int:
    from gefen_bench.param_sets import numel, shapes_for

    return numel(shapes_for(model, "full"))


def summarize(text: str, params: int, sms: int, clock_hz: float | None = None) -> str:
    """The summary of Nsight Compute's ``--csv`` output ``text`` for a step of ``params``
    parameters on ``sms`` streaming multiprocessors, at ``clock_hz`` (default: the median SM
    clock the profile measured; Nsight Compute locks it to the base clock unless run with
    ``--clock-control none``)."""
    body = text[text.index('"ID"') :]
    per_kernel: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    launches: dict[str, int] = defaultdict(int)
    clocks: list[float] = []
    for row in csv.DictReader(io.StringIO(body)):
        name = row["Kernel Name"].split("(")[0]
        value = float(row["Metric Value"].replace(",", ""))
        metric, unit = row["Metric Name"], row["Metric Unit"]
        if metric == "smsp__inst_executed.sum":
            per_kernel[name]["inst"] += value
            launches[name] += 1
        elif metric == "gpu__time_duration.sum":
            scale = _MS[unit.lower()]
            per_kernel[name]["ms"] += value * scale
        elif metric == "smsp__cycles_elapsed.avg.per_second":
            scale = _HZ[unit.lower().replace("cycle/", "")]
            clocks.append(value * scale)
    # The median launch's clock (the upper one of an even count), unweighted by duration: the
    # clock hardly moves within one step (1.944-1.976 GHz in the twentieth session's profiles).
    measured = sorted(clocks)[len(clocks) // 2] if clocks else float("nan")
    clock = clock_hz or measured
    if clock != clock:
        raise ValueError("the profile has no smsp__cycles_elapsed.avg.per_second: pass clock_hz")
    rate = sms * SCHEDULERS_PER_SM * clock  # warp instructions per second at full issue
    lines = [
        f"{'kernel':40s} {'launches':>8s} {'warp inst':>14s} {'inst/param':>10s} "
        f"{'ms':>8s} {'issue-bound ms':>14s}"
    ]
    total_inst = total_ms = 0.0
    for name, d in sorted(per_kernel.items(), key=lambda kv: -kv[1]["inst"]):
        total_inst += d["inst"]
        total_ms += d["ms"]
        lines.append(
            f"{name[:40]:40s} {launches[name]:8d} {d['inst']:14.4e} "
            f"{d['inst'] * 32 / params:10.1f} {d['ms']:8.3f} {d['inst'] / rate * 1e3:14.3f}"
        )
    lines.append(
        f"{'total':40s} {sum(launches.values()):8d} {total_inst:14.4e} "
        f"{total_inst * 32 / params:10.1f} {total_ms:8.3f} {total_inst / rate * 1e3:14.3f}"
    )
    lines.append(
        f"\n{params} parameters; SM clock {clock / 1e9:.3f} GHz (measured: {measured / 1e9:.3f}, "
        f"the median over kernels), {sms} SMs "
        f"x {SCHEDULERS_PER_SM} schedulers: {rate / 1e12:.3f}e12 warp instructions/s at full "
        f"issue. 'ms' is each kernel's own duration under the profiler (serialised), not the "
        f"step's time."
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama", choices=("gpt2", "llama"))
    parser.add_argument("--block", action="store_true", help="factored_v_2d=False")
    parser.add_argument("--warm-steps", type=int, default=3)
    parser.add_argument("--summarize", metavar="CSV", help="sum an Nsight Compute CSV instead")
    parser.add_argument("--sms", type=int, default=132, help="SM count (--summarize)")
    parser.add_argument(
        "--clock-ghz",
        type=float,
        help="SM clock for the issue bound (--summarize; default: measured)",
    )
    args = parser.parse_args()
    if args.summarize:
        with open(args.summarize) as f:
            clock = args.clock_ghz * 1e9 if args.clock_ghz else None
            print(summarize(f.read(), _params(args.model), args.sms, clock))
        return
    _step(args.model, not args.block, args.warm_steps)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
