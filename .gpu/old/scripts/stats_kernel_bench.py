"""Factored statistics kernel: grouped stats + finalize launch, old against new (diagnostic).

    # 1. the old code (e.g. `git archive <rev> packages/gefen-kernels/src` unpacked in OLD):
    PYTHONPATH=OLD/packages/gefen-kernels/src:scripts python scripts/stats_kernel_bench.py \\
        --save /tmp/stats_old.pt
    # 2. this tree, with launch-setting variants, compared bit for bit with step 1:
    PYTHONPATH=packages/gefen-kernels/src:scripts python scripts/stats_kernel_bench.py \\
        --compare /tmp/stats_old.pt --variants

Times what the optimizer launches for the factored second moment: the grouped statistics
kernel and the finalize kernel (:class:`gefen_kernels.ops.step_groups.StepGroups` with the tile
kernel replaced by a no-op), on Llama-3.2-1B-like bf16 gradients (16 x ``[8192, 2048]``,
16 x ``[2048, 8192]``, 1 x ``[128256, 2048]``, the whole 2-D parameter set) and one fp32 set,
with CUDA events (``--inner`` back-to-back launches per event pair, median over ``--reps``
pairs). It reports GB/s of gradient read (bytes of the gradients once) against a
device-to-device ``copy_`` measured in the same run (counting bytes read plus written), and
the one-tensor launch (``factored_stats_triton``) of each shape.

Bit identity: every launch's statistics scratch (row/column partials, block sums, ``1/rbar``)
is pre-filled with a fixed pattern, copied after the finalize kernel, and compared bit for bit
(together with the updated ``r``/``k`` state and the one-tensor outputs) with the old code's,
on the same inputs (drawn from a seeded CUDA generator). Launch-setting variants (work items
per program, prefetch) are speed choices: each is compared with the old outputs too. Layout
variants (``strip*``: chunks per row strip) sum the columns in another order: for those the
last column prints the largest relative difference of the ``r``/``k`` state from the old
code's.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
from typing import Any

import torch
from kernel_sweep import diagnostic_plan

import gefen_kernels

# (gefen_kernels.ops exports functions of these names: import the modules by path.)
fs = importlib.import_module("gefen_kernels.ops.factored_step")
step_groups = importlib.import_module("gefen_kernels.ops.step_groups")

FILL = 12345.678  # scratch pre-fill: an element still equal to it was never written
PERIOD = 2048
DEV = "cuda"


def llama_shapes() -> list[tuple[int, int]]:
    layer = [
        (2048, 2048),
        (512, 2048),
        (512, 2048),
        (2048, 2048),
        (8192, 2048),
        (8192, 2048),
        (2048, 8192),
    ]
    return [(128256, 2048)] + layer * 16


CASES: dict[str, tuple[list[tuple[int, int]], torch.dtype]] = {
    "16x[8192,2048] bf16": ([(8192, 2048)] * 16, torch.bfloat16),
    "16x[2048,8192] bf16": ([(2048, 8192)] * 16, torch.bfloat16),
    "1x[128256,2048] bf16": ([(128256, 2048)], torch.bfloat16),
    "llama-3.2-1B 2-D bf16": (llama_shapes(), torch.bfloat16),
    "4x[8192,2048] fp32": ([(8192, 2048)] * 4, torch.float32),
}
SINGLE = [(8192, 2048), (2048, 8192), (128256, 2048)]

# name -> module constants of factored_step. Older code lacks them: "base" only. The strip*
# variants change the statistics layout (the column sums' order); the others only the speed,
# so their outputs must equal the default's ("new") bit for bit (the exit status says).
LAYOUT_VARIANTS = ("strip1", "strip4", "strip8", "strip16", "strip32")
VARIANTS: dict[str, dict[str, int]] = {
    "new": {},
    "strip1": {"_STATS_STRIP_CHUNKS": 1},
    "strip4": {"_STATS_STRIP_CHUNKS": 4},
    "strip8": {"_STATS_STRIP_CHUNKS": 8},
    "strip16": {"_STATS_STRIP_CHUNKS": 16},
    "strip32": {"_STATS_STRIP_CHUNKS": 32},
    "items1": {"_STATS_CHUNKS": 1},
    "chunks4": {"_STATS_CHUNKS": 4},
    "chunks16": {"_STATS_CHUNKS": 16},
    "minprog256": {"_STATS_MIN_PROGRAMS": 256},
    "noprefetch": {"_STATS_PREFETCH_MAX_BYTES": 0},
    "prefetch_fp32": {"_STATS_PREFETCH_MAX_BYTES": 4},
}


class _NoOp:
    def __getitem__(self, grid: Any) -> Any:
        return lambda *args, **kwargs: None


class _Capture:
    """Wraps a grouped kernel: the stats launch pre-fills the scratch (``fill``), the finalize
    launch records a copy of it afterwards."""

    def __init__(self, kernel: Any, arg: int, record: list[torch.Tensor] | None) -> None:
        self.kernel, self.arg, self.record = kernel, arg, record
        self.on = False

    def __getitem__(self, grid: Any) -> Any:
        run = self.kernel[grid]

        def call(*args: Any, **kwargs: Any) -> Any:
            if self.on and self.record is None:
                args[self.arg].fill_(FILL)
            out = run(*args, **kwargs)
            if self.on and self.record is not None:
                self.record.append(args[self.arg].clone())
            return out

        return call


def median_ms(fn: Any, reps: int, inner: int) -> float:
    for _ in range(2):
        fn()
    if DEV != "cuda":  # --smoke on the CPU interpreter: one untimed call is enough
        return 1.0
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return statistics.median(times)


def copy_gbps() -> float:
    n = 1 << 30  # 2 GiB of bf16 each way
    a = torch.empty(n, dtype=torch.bfloat16, device=DEV).normal_()
    b = torch.empty_like(a)
    ms = median_ms(lambda: b.copy_(a), 10, 5)
    return 2 * 2 * n / ms / 1e6


class Case:
    def __init__(self, shapes: list[tuple[int, int]], gdt: torch.dtype, seed: int) -> None:
        gen = torch.Generator(device=DEV).manual_seed(seed)
        self.codebook = torch.linspace(-1, 1, 256, device=DEV)
        self.keep, self.plans, self.grads = [], [], []
        for rows, cols in shapes:
            n = rows * cols
            param = torch.zeros(rows, cols, dtype=gdt, device=DEV)
            codes = torch.zeros(n // PERIOD, PERIOD, dtype=torch.uint8, device=DEV)
            scale = torch.zeros(n // PERIOD, 1, device=DEV)
            r = torch.zeros(rows, device=DEV)
            k = torch.zeros(cols, device=DEV)
            g = torch.randn(rows, cols, generator=gen, device=DEV)
            g *= torch.rand(rows, 1, generator=gen, device=DEV) * 3
            g *= torch.rand(1, cols, generator=gen, device=DEV) * 3
            self.grads.append(g.to(gdt))
            del g
            self.keep.append((param, codes, scale, r, k))
        self.bytes = sum(g.numel() * g.element_size() for g in self.grads)
        self.scalars = [(1e-3, 10.0, 30.0, 1.0)] * len(self.keep)

    def groups(self) -> Any:
        # Plans afresh: a plan fixes its statistics layout when built (the strip* variants).
        self.plans = [
            diagnostic_plan(param, codes, scale, None, r, k, self.codebook)
            for param, codes, scale, r, k in self.keep
        ]
        return step_groups.StepGroups(self.plans, self.grads)

    def outputs(
        self, groups: Any, stats: _Capture, fin: _Capture, record: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        for _, _, _, r, k in self.keep:
            r.fill_(0.25)
            k.fill_(0.5)
        record.clear()
        stats.on = fin.on = True
        groups.launch(self.grads, self.scalars, None)
        if DEV == "cuda":
            torch.cuda.synchronize()
        stats.on = fin.on = False
        out = [t.cpu() for t in record]
        out += [t.cpu() for _, _, _, r, k in self.keep for t in (r, k)]
        return out


def single_outputs(shape: tuple[int, int], seed: int) -> tuple[float, list[torch.Tensor]]:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    g = torch.randn(*shape, generator=gen, device=DEV).to(torch.bfloat16)
    r = torch.full((shape[0],), 0.25, device=DEV)
    k = torch.full((shape[1],), 0.5, device=DEV)
    inv = fs.factored_stats_triton(g, r, k, beta2=0.999)
    out = [r.cpu(), k.cpu(), inv.cpu()]
    ms = median_ms(lambda: fs.factored_stats_triton(g, r, k, beta2=0.999), 15, 10)
    return ms, out


def bit_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[bool, str]:
    if len(a) != len(b):
        return False, f"{len(a)} vs {len(b)} tensors"
    for i, (x, y) in enumerate(zip(a, b)):
        if x.shape != y.shape:
            return False, f"tensor {i}: shape {tuple(x.shape)} vs {tuple(y.shape)}"
        xi, yi = x.view(torch.int32), y.view(torch.int32)
        diff = int((xi != yi).sum())
        if diff:
            return False, f"tensor {i}: {diff} of {x.numel()} words differ"
    words = sum(x.numel() for x in a)
    unwritten = sum(int((x == FILL).sum()) for x in a)
    return True, f"{len(a)} tensors, {words} words equal ({unwritten} padding words unwritten)"


def state_rel_diff(a: list[torch.Tensor], b: list[torch.Tensor], n: int) -> float:
    """Largest relative difference between the last ``n`` tensors of ``a`` and ``b`` (the
    ``r``/``k`` state, and ``1/rbar`` for one-tensor launches): the size of the change where a
    new layout sums in another order and the scratch is no longer comparable word for word."""
    worst = 0.0
    for x, y in zip(a[-n:], b[-n:]):
        x64, y64 = x.double(), y.double()
        worst = max(worst, float(((x64 - y64).abs() / y64.abs().clamp_min(1e-30)).max()))
    return worst


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--save", help="save timings and outputs here (the old code's run)")
    parser.add_argument("--compare", help="outputs of the old code's run to compare with")
    parser.add_argument("--variants", action="store_true", help="also time VARIANTS")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--inner", type=int, default=3)
    parser.add_argument("--json", help="write the results table here")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="CPU interpreter check of the script: tiny shapes, no timing",
    )
    args = parser.parse_args()
    if args.smoke:
        global DEV, PERIOD
        DEV, PERIOD = "cpu", 16
        CASES.clear()
        CASES.update(
            {
                "small bf16": ([(64, 96), (40, 1100), (300, 64)], torch.bfloat16),
                "small fp32": ([(64, 96)], torch.float32),
            }
        )
        SINGLE[:] = [(64, 96), (300, 512)]
        if hasattr(fs, "_STATS_MIN_PROGRAMS"):  # several items per program on tiny shapes
            fs._STATS_MIN_PROGRAMS = 2
    print(
        f"gefen_kernels from {gefen_kernels.__file__}; torch {torch.__version__}; "
        f"{torch.cuda.get_device_name() if DEV == 'cuda' else 'cpu'}",
        flush=True,
    )
    copy = copy_gbps() if DEV == "cuda" else 1.0
    print(f"copy_ bandwidth (read + write): {copy:.0f} GB/s", flush=True)
    record: list[torch.Tensor] = []
    stats = _Capture(step_groups._group_stats_kernel, 4, None)
    fin = _Capture(step_groups._group_finalize_kernel, 3, record)
    step_groups._group_stats_kernel, step_groups._group_finalize_kernel = stats, fin
    step_groups._group_tile_kernel = _NoOp()
    has_knobs = hasattr(fs, "_STATS_CHUNKS")
    names = list(VARIANTS) if (args.variants and has_knobs) else ["new" if has_knobs else "old"]
    old = torch.load(args.compare) if args.compare else None
    results: dict[str, Any] = {"copy_gbps": copy, "cases": {}, "single": {}}
    saved: dict[str, Any] = {"cases": {}, "single": {}}
    rows: list[tuple[str, str, dict[str, Any]]] = []
    for ci, (cname, (shapes, gdt)) in enumerate(CASES.items()):
        case = Case(shapes, gdt, seed=100 + ci)
        new_outs: list[torch.Tensor] = []
        for vname in names:
            if vname == "prefetch_fp32" and gdt != torch.float32:
                continue
            saved_consts = {k: getattr(fs, k) for k in VARIANTS.get(vname, {})}
            for k, v in VARIANTS.get(vname, {}).items():
                setattr(fs, k, v)
            try:
                groups = case.groups()
                outs = case.outputs(groups, stats, fin, record)
                ms = median_ms(
                    lambda groups=groups, case=case: groups.launch(case.grads, case.scalars, None),
                    args.reps,
                    args.inner,
                )
            finally:
                for k, v in saved_consts.items():
                    setattr(fs, k, v)
            ok, why = (
                (True, "reference run")
                if old is None
                else bit_equal(old["cases"][cname]["outs"], outs)
            )
            if vname == "new":
                new_outs = outs
            speed_only_ok = (
                vname in ("new", "old") or vname in LAYOUT_VARIANTS or bit_equal(new_outs, outs)[0]
            )
            gbps = case.bytes / ms / 1e6
            entry: dict[str, Any] = {
                "ms": ms,
                "gbps": gbps,
                "pct_copy": 100 * gbps / copy,
                "bit_identical": ok,
                "detail": why,
                "speed_only_same_as_new": speed_only_ok,
            }
            if old is not None:
                entry["old_ms"] = old["cases"][cname]["ms"]
                entry["speedup"] = entry["old_ms"] / ms
                entry["state_max_rel_diff"] = state_rel_diff(
                    outs, old["cases"][cname]["outs"], 2 * len(shapes)
                )
            results["cases"].setdefault(cname, {})[vname] = entry
            if vname in ("new", "old"):
                saved["cases"][cname] = {"ms": ms, "outs": outs}
            rows.append((cname, vname, entry))
            print(json.dumps({"case": cname, "variant": vname, **entry}), flush=True)
        del case
        if DEV == "cuda":
            torch.cuda.empty_cache()
    for si, shape in enumerate(SINGLE):
        ms, outs = single_outputs(shape, seed=200 + si)
        key = f"{shape[0]}x{shape[1]}"
        ok, why = (
            (True, "reference run") if old is None else bit_equal(old["single"][key]["outs"], outs)
        )
        entry = {
            "ms": ms,
            "gbps": shape[0] * shape[1] * 2 / ms / 1e6,
            "bit_identical": ok,
            "detail": why,
        }
        if old is not None:
            entry["old_ms"] = old["single"][key]["ms"]
            entry["speedup"] = entry["old_ms"] / ms
            entry["state_max_rel_diff"] = state_rel_diff(outs, old["single"][key]["outs"], 3)
        results["single"][key] = entry
        saved["single"][key] = {"ms": ms, "outs": outs}
        print(json.dumps({"single": key, **entry}), flush=True)
    if args.save:
        torch.save(saved, args.save)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(f"\ncopy_ {copy:.0f} GB/s (read + write)")
    print(
        f"{'case':24s} {'variant':14s} {'ms':>8s} {'GB/s':>7s} {'%copy':>6s} "
        f"{'old ms':>8s} {'speedup':>7s}  bits       r/k rel. diff"
    )
    for cname, vname, e in rows:
        print(
            f"{cname:24s} {vname:14s} {e['ms']:8.3f} {e['gbps']:7.0f} {e['pct_copy']:6.1f} "
            f"{e.get('old_ms', float('nan')):8.3f} {e.get('speedup', float('nan')):7.2f}  "
            f"{'SAME' if e['bit_identical'] else 'DIFFERENT':10s} "
            f"{e.get('state_max_rel_diff', float('nan')):.1e}"
        )
    for key, e in results["single"].items():
        print(
            f"one-tensor {key:13s} {'':14s} {e['ms']:8.3f} {e['gbps']:7.0f} {'':6s} "
            f"{e.get('old_ms', float('nan')):8.3f} {e.get('speedup', float('nan')):7.2f}  "
            f"{'SAME' if e['bit_identical'] else 'DIFFERENT':10s} "
            f"{e.get('state_max_rel_diff', float('nan')):.1e}"
        )
    differ = [r for r in rows if not r[2]["bit_identical"]] + [
        k for k, e in results["single"].items() if not e["bit_identical"]
    ]
    print(f"\n{len(differ)} outputs differ from the old code" if old is not None else "")
    bad = [f"{c} {v}" for c, v, e in rows if not e["speed_only_same_as_new"]]
    if bad:
        print("speed-only variants whose outputs differ from the default's:", ", ".join(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
