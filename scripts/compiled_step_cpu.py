"""Compiled against eager optimizer steps on the CPU, interleaved (docs/compile.md).

    python scripts/compiled_step_cpu.py [--models gpt2,llama] [--optimizers gefen,...]

For each model's ``--scale`` parameter set and each optimizer of the ``gefen-bench``
registry: two identical optimizers over two identical parameter sets, one stepped eagerly and
one through ``torch.compile``, both after one eager first step. After the compile and a few
warm-up steps, the two are stepped alternately and each step is timed in the main thread's CPU
time (``time.thread_time``, one torch thread), which, unlike wall time, a busy shared machine
barely moves. Prints the medians, the compile time (wall, the first compiled call) and how
many frames dynamo compiled during the timed steps (must be 0: no recompile). On a GPU, use
``gefen-bench step`` (its ``*-compiled`` rows), which times with CUDA events.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch._dynamo.utils import counters

from gefen_bench import optimizers as registry
from gefen_bench.param_sets import SCALES, build_param_set, shapes_for


def _stepper(name: str, model: str, scale: str) -> Callable[[], None]:
    cpu = torch.device("cpu")
    named = build_param_set(shapes_for(model, scale), device=cpu, dtype=torch.bfloat16)
    opts = registry.build(name, named, lr=1e-4, weight_decay=0.0, device=cpu)

    def step() -> None:
        for o in opts:
            o.step()

    return step


def measure(name: str, model: str, scale: str, steps: int, warmup: int) -> dict[str, float]:
    eager = _stepper(name, model, scale)
    other = _stepper(name, model, scale)
    eager()
    other()
    compiled = torch.compile(other)
    start = time.perf_counter()
    compiled()
    compile_s = time.perf_counter() - start
    for _ in range(warmup):
        eager()
        compiled()
    counters.clear()
    eager_s, compiled_s = [], []
    for _ in range(steps):
        t0 = time.thread_time()
        eager()
        t1 = time.thread_time()
        compiled()
        t2 = time.thread_time()
        eager_s.append(t1 - t0)
        compiled_s.append(t2 - t1)
    return {
        "eager_ms": statistics.median(eager_s) * 1e3,
        "compiled_ms": statistics.median(compiled_s) * 1e3,
        "compile_s": compile_s,
        "frames_compiled_while_timed": counters["frames"]["total"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2,llama")
    parser.add_argument(
        "--optimizers", default="gefen,gefen-blockv,gefen-muon-hybrid,adamw-foreach"
    )
    parser.add_argument("--scale", default="tiny", choices=SCALES)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("optimizer model eager_ms compiled_ms compiled/eager compile_s frames_while_timed")
    for model in args.models.split(","):
        for name in args.optimizers.split(","):
            r = measure(name, model, args.scale, args.steps, args.warmup)
            print(
                f"{name} {model} {r['eager_ms']:.2f} {r['compiled_ms']:.2f} "
                f"{r['compiled_ms'] / r['eager_ms']:.3f} {r['compile_s']:.1f} "
                f"{r['frames_compiled_while_timed']}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
