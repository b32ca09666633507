"""Where the fused step tile kernel's time goes: ablations and candidate variants (diagnostic).

    PYTHONPATH=<packages>/src python scripts/kernel_ablation.py > ablation.txt

METHOD.md's "time variants that leave one stage out": each variant is the production
``_step_tile_kernel`` compiled from a patched copy of ``_step_kernels.py`` /
``_triton_helpers.py`` (written beside them as ``_abl_*.py`` and removed afterwards), launched
exactly as :class:`gefen_kernels.ops.step_plan.StepPlan` launches the real one, on a bf16
``[8192, 8192]`` parameter (67M elements, far above the 50 MB L2) with 2048- and
256-element blocks, block and factored mode. Variants marked ``ablation`` drop or cheapen a
stage and give wrong numbers on purpose (their time bounds that stage's cost); ``candidate``
variants are meant to give the same codes, scales and parameters as the production kernel,
and the script checks that they do, bit for bit, on the same inputs. Variants whose
pattern is not in the sources given (an older or newer version) are skipped.

Also prints, for a Llama-3.2-1B-shaped bf16 set stepped once by ``Gefen`` (random
gradients, as ``gefen-bench step``), which period and route each tensor got.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import pathlib
import sys
from collections import Counter
from typing import Any

import torch
from kernel_sweep import diagnostic_plan, median_event_ms

import gefen_kernels.ops as ops_pkg
from gefen_kernels.ops._search_table import kernel_table
from gefen_kernels.ops._step_kernels import tile_shape
from gefen_kernels.ops.factored_step import factored_stats_triton

NCOLS = 8192
# (file, old, new); every `old` must occur in the file.
Patch = tuple[str, str, str]
_SK, _TH = "_step_kernels.py", "_triton_helpers.py"
VARIANTS: dict[str, tuple[str, list[Patch]]] = {
    "base": ("production", []),
    "rn_cast": (
        "candidate: bf16 rounding by the hardware cast (cvt.rn) instead of integer ops",
        [
            (
                _TH,
                "    if dtype == tl.bfloat16:\n        bits",
                "    if dtype == tl.float64:\n        bits",
            ),
        ],
    ),
    "evict_g": (
        "candidate: grad loaded evict_first",
        [
            (
                _SK,
                "g = tl.load(g_ptr + offs, mask=mask, other=0.0)",
                "g = tl.load(g_ptr + offs, mask=mask, other=0.0, eviction_policy='evict_first')",
            ),
        ],
    ),
    "no_div": (
        "ablation: m * (1/s) per block instead of m / s per element",
        [
            (
                _SK,
                "tl.math.div_rn(m, tl.where(positive, s_new, 1.0))",
                "m * tl.math.div_rn(1.0, tl.where(positive, s_new, 1.0))",
            ),
        ],
    ),
    "no_search": (
        "ablation: quantiser replaced by an affine round (no table, no pair gather)",
        [
            (
                _SK,
                "q, codeword = tl_quantize_nearest(z, cb_ptr, table_ptr, STEPS, zero)",
                "q, codeword = tl.minimum(tl.maximum((z * 127.5 + 127.5).to(tl.int32), 0), 255), z",
            ),
        ],
    ),
    "no_cb_gather": (
        "ablation: momentum codeword from the code by arithmetic, no gather",
        [
            (_SK, "_codewords(cb_ptr, code), g)", "code.to(tl.float32) * 0.0078125 - 1.0, g)"),
        ],
    ),
    "shift_rowcol": (
        "ablation (factored): row/column by shift and mask (ncols = 8192)",
        [
            (_SK, "row_ptr + offs // ncols", "row_ptr + (offs >> 13)"),
            (_SK, "col_ptr + offs % ncols", "col_ptr + (offs & 8191)"),
        ],
    ),
    "fast_sigma": (
        "ablation (factored): approximate sqrt and reciprocal for sigma",
        [
            (
                _SK,
                "    h = tl.math.sqrt_rn(big_v * bc2)\n    h = h + eps\n"
                "    return big_v, tl.math.div_rn(1.0, h) * bc1",
                "    h = tl.sqrt(big_v * bc2)\n    h = h + eps\n    return big_v, bc1 / h",
            ),
        ],
    ),
}
VARIANTS["load_cb"] = (
    "candidate: momentum codeword by a load from global memory (before run 6)",
    [(_SK, "_codewords(cb_ptr, code), g)", "tl.load(cb_ptr + code), g)")],
)
# The nearest-rounding lookup (run 2026-11-30): production reads only the decision table's
# head word and gathers c[q] from the register codebook; pair_load is the code before it (on
# today's table layout).
_HEAD_GATHER = (
    "        head = tl.load(table_ptr + b)\n"
    "        up = x > _low_float(head)\n"
    "        codes = (head >> 32).to(tl.int32)\n"
    "        q = tl.where(up, (codes >> 8) & 255, codes & 255)\n"
    "        if GATHER:\n"
    "            cq = tl_codewords(cb_ptr, q)\n"
    "        else:\n"
    "            pair = tl.load(table_ptr + (DECISION_PAIRS + b))\n"
    "            cq = tl.where(up, _high_float(pair), _low_float(pair))\n"
)
VARIANTS["pair_load"] = (
    "candidate: codeword from the decision table's pair word (production before 2026-11-30)",
    [
        (
            _TH,
            _HEAD_GATHER,
            "        head = tl.load(table_ptr + b)\n"
            "        pair = tl.load(table_ptr + (DECISION_PAIRS + b))\n"
            "        up = x > _low_float(head)\n"
            "        codes = (head >> 32).to(tl.int32)\n"
            "        q = tl.where(up, (codes >> 8) & 255, codes & 255)\n"
            "        cq = tl.where(up, _high_float(pair), _low_float(pair))\n",
        ),
    ],
)
# The decision table's layout: head words together, then the pair words (production since
# 2026-11-30, measured as the variant head_packed before); interleaved is the layout before.
VARIANTS["interleaved"] = (
    "candidate: the decision table's head and pair words interleaved (64 KiB of heads' lines)",
    [
        (_TH, "head = tl.load(table_ptr + b)", "head = tl.load(table_ptr + 2 * b)"),
        (
            _TH,
            "pair = tl.load(table_ptr + (DECISION_PAIRS + b))",
            "pair = tl.load(table_ptr + (2 * b + 1))",
        ),
    ],
)
# The lookup before 2026-12-01: the head word by a random global load, where production now
# gathers the staged section from shared memory (_decision_table.staged_section).
VARIANTS["head_lookup"] = (
    "candidate: the decision table's head word loaded from global memory (before 2026-12-01)",
    [(_TH, "    if STEPS == -2 and GATHER:\n", "    if STEPS == -99 and GATHER:\n")],
)
# The factored tile route's column statistics per element (production before 2026-12-01,
# where the period divides the column count; call 3 of the session-16 results measured the
# change as the candidate "k_rows").
VARIANTS["flat_k"] = (
    "candidate (factored): row and column statistics gathered per element (before 2026-12-01; "
    "one-tile periods only, the head-and-tail path keeps IN_ROW)",
    [(_SK, "    if FACTORED and IN_ROW:\n", "    if FACTORED and IN_ROW == 2:\n")],
)
# Variants that take the decision table in another layout: variant -> (table -> its table).
TABLE_LAYOUTS: dict[str, Any] = {
    # head and pair of bucket b at 2b and 2b + 1 (the staged section, if any, after them)
    "interleaved": lambda t: torch.cat(
        [t[:8192].view(2, -1).t().contiguous().reshape(-1), t[8192:]]
    ),
}
VARIANTS["base_again"] = ("candidate: production timed a second time (the spread)", [])
# The tile route's head and tail pieces (tile_shape's TAIL, factored mode): one_tile is the
# one [BPP, P2] tile production used before; any_tail a tail for every period in
# (P2 / 2, 3 P2 / 4], where production takes one only up to 5 P2 / 8.
VARIANTS["one_tile"] = ("candidate: one [BPP, P2] tile per block, no tail piece (TAIL=0)", [])
VARIANTS["any_tail"] = (
    "candidate (factored): a tail piece for every period in (P2 / 2, 3 P2 / 4]",
    [],
)


def _any_tail(period: int) -> dict[str, int]:
    p2 = 1 << (period - 1).bit_length()
    tail = 1 << (period - p2 // 2 - 1).bit_length() if p2 // 2 < period <= 3 * p2 // 4 else 0
    return {"TAIL": tail if tail >= 16 else 0}


# Two head-and-tail blocks per program instead of one (production: BPP = 2048 // P2), so the
# per-program work (the staged lookup, the codebook copies) is spread over twice the elements.
VARIANTS["tail_bpp2"] = ("candidate (factored): two blocks per head-and-tail program, 8 warps", [])
VARIANTS["tail_bpp2_w4"] = (
    "candidate (factored): two blocks per head-and-tail program, 4 warps",
    [],
)


def _tail_bpp2(warps: int) -> Any:
    def overrides(period: int) -> dict[str, int]:
        p2, bpp, tail = tile_shape(period, True)
        return {"BPP": 2 * bpp, "num_warps": warps} if tail else {}

    return overrides


# Variants launched with other constexprs: variant -> (period -> overrides of the plan's).
CONSTS: dict[str, Any] = {
    "one_tile": lambda period: {"TAIL": 0},
    "any_tail": _any_tail,
    "tail_bpp2": _tail_bpp2(8),
    "tail_bpp2_w4": _tail_bpp2(4),
}
VARIANTS["all_ablations"] = (
    "ablation: every ablation and candidate above at once",
    [
        p
        for name, (_, ps) in VARIANTS.items()
        if name
        not in (
            "base",
            "load_cb",
            "pair_load",
            "interleaved",
            "head_lookup",
            "flat_k",
            "one_tile",
            "any_tail",
        )
        for p in ps
    ],
)
VARIANTS["no_ieee"] = (
    "ablation: fast_sigma and no_div together (no per-element IEEE division or square root)",
    [*VARIANTS["fast_sigma"][1], *VARIANTS["no_div"][1]],
)
VARIANTS["no_gathers"] = (
    "ablation: no_search and no_cb_gather together",
    [*VARIANTS["no_search"][1], *VARIANTS["no_cb_gather"][1]],
)


def _learned_codebook() -> torch.Tensor:
    """The exact quantizer's codebook (gefen_core) for block-normalised Gaussian momentum,
    as the optimizer learns it at its first step."""
    from gefen_core.codebook import optimal_codebook

    gen = torch.Generator().manual_seed(0)
    m = torch.randn(4096, 256, generator=gen)
    z = (m / m.abs().amax(dim=1, keepdim=True)).reshape(-1)
    return optimal_codebook(torch.histc(z, 4096, -1, 1).to(torch.int64)).float()


def _load_variant(name: str, patches: list[Patch]) -> Any:
    """Write patched copies of the two modules into the ops package and import them
    (``None``: a pattern is not in this version of the sources)."""
    src_dir = pathlib.Path(ops_pkg.__file__).parent
    th_mod, sk_mod = f"_abl_{name}_th", f"_abl_{name}_sk"
    texts = {f: (src_dir / f).read_text() for f in (_SK, _TH)}
    for file, old, new in patches:
        if old not in texts[file]:
            return None
        texts[file] = texts[file].replace(old, new)
    texts[_SK] = texts[_SK].replace("from ._triton_helpers import", f"from .{th_mod} import")
    (src_dir / f"{th_mod}.py").write_text(texts[_TH])
    (src_dir / f"{sk_mod}.py").write_text(texts[_SK])
    module = importlib.import_module(f"gefen_kernels.ops.{sk_mod}")
    if name in TABLE_LAYOUTS:
        module._ABL_TABLE_LAYOUT = TABLE_LAYOUTS[name]
    module._ABL_CONSTS = CONSTS.get(name)
    return module


def _cleanup() -> None:
    for f in pathlib.Path(ops_pkg.__file__).parent.glob("_abl_*.py"):
        f.unlink()


DEVICE = torch.device("cuda")
ROWS = 8192


def _time(fn: Any, reps: int) -> float:
    if DEVICE.type != "cuda":  # the interpreter smoke run (--device cpu): no timing
        fn()
        return float("nan")
    return float(median_event_ms(fn, reps, warmup=3))


class Case:
    """One bf16 [8192, 8192] parameter with its state, in ``[numel / period, period]`` blocks."""

    def __init__(self, period: int, factored: bool) -> None:  # noqa: D107
        dev = DEVICE
        gen = torch.Generator(device=dev).manual_seed(0)
        shape = (ROWS, NCOLS)
        n = shape[0] * shape[1]
        blocks = n // period
        self.p = torch.randn(shape, device=dev, dtype=torch.bfloat16, generator=gen)
        self.g = torch.randn(shape, device=dev, dtype=torch.bfloat16, generator=gen)
        self.codes = torch.randint(
            0, 256, (blocks, period), device=dev, dtype=torch.uint8, generator=gen
        )
        self.scale = torch.rand(blocks, 1, device=dev, generator=gen) + 0.5
        self.codebook = _learned_codebook().to(dev)
        self.sq = None if factored else torch.rand(blocks, 1, device=dev, generator=gen)
        self.row = torch.rand(shape[0], device=dev, generator=gen) if factored else None
        self.col = torch.rand(shape[1], device=dev, generator=gen) if factored else None
        self.plan = diagnostic_plan(
            self.p, self.codes, self.scale, self.sq, self.row, self.col, self.codebook
        )
        assert self.plan.route == "tile", self.plan.route
        self.inv_rbar = None
        if factored:
            layout = self.plan._stats_layout
            self.inv_rbar = factored_stats_triton(
                self.g, self.row, self.col, beta2=0.999, layout=layout
            )
        self.factored = factored
        self.period = period
        self._tables: dict[Any, torch.Tensor] = {}

    def state(self) -> list[torch.Tensor]:
        return [t for t in (self.p, self.codes, self.scale, self.sq) if t is not None]

    def args(self) -> tuple[Any, ...]:
        dummy = self.codebook
        b1, omb1, b2, omb2, eps = self.plan._floats
        # (num_blocks, period, ncols) and, from the decision-table version on, the divider.
        return (
            self.p,
            self.g,
            self.codes,
            self.scale,
            self.sq if self.sq is not None else dummy,
            self.row if self.row is not None else dummy,
            self.col if self.col is not None else dummy,
            self.inv_rbar if self.inv_rbar is not None else dummy,
            self.codebook,
            self.plan._table,
            dummy,
            dummy,
            *self.plan._ints,
            b1,
            omb1,
            b2,
            omb2,
            eps,
            1e-4,
            1.0,
            1.0,
            1.0 - 1e-5,
        )

    def launch(self, module: Any) -> None:
        args = self.args()
        layout = getattr(module, "_ABL_TABLE_LAYOUT", None)
        if layout is not None:  # the variant's decision-table layout (TABLE_LAYOUTS)
            assert self.plan._consts["STEPS"] in (-1, -2), "a layout applies to the decision table"
            if layout not in self._tables:
                self._tables[layout] = layout(self.plan._table)
            args = (*args[:9], self._tables[layout], *args[10:])
        consts = dict(self.plan._consts)
        grid = self.plan._grid
        overrides = getattr(module, "_ABL_CONSTS", None)
        if overrides is not None and self.factored:  # a tail piece is factored mode's only
            consts.update(overrides(self.period))
            if consts["BPP"] != self.plan._consts["BPP"]:
                grid = (-(-self.plan._ints[0] // consts["BPP"]),)
        module._step_tile_kernel[grid](*args, 0, **consts)
        if consts.get("FLAT_UPDATE"):  # blocks across rows: the tile quantised, now update
            b1, omb1, b2, omb2, eps = self.plan._floats
            lr, bc2, bc1, decay = args[-4:]
            module.launch_flat_update(
                self.p,
                self.codes,
                self.scale,
                self.row,
                self.col,
                self.inv_rbar,
                self.codebook,
                None,
                ncols=NCOLS,
                eps=eps,
                lr=lr,
                bc2=bc2,
                bc1=bc1,
                decay=decay,
            )


def _differing(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements whose bit patterns differ."""
    bits = {4: torch.int32, 2: torch.int16, 1: torch.uint8}[a.element_size()]
    return int((a.view(bits) != b.view(bits)).sum())


def _check(case: Case, run: Any) -> str:
    """Run production and ``run`` once each from the same state: "bit-identical", or which
    outputs differ and in how many elements (also used by the tma and chunk probes)."""
    saved = [t.clone() for t in case.state()]
    case.launch(importlib.import_module("gefen_kernels.ops._step_kernels"))
    expect = [t.clone() for t in case.state()]
    for t, s in zip(case.state(), saved):
        t.copy_(s)
    run()
    got = [t.clone() for t in case.state()]
    for t, s in zip(case.state(), saved):
        t.copy_(s)
    names = ["param", "codes", "scale", "exp_avg_sq"]
    diffs = [f"{name} {n}" for name, a, b in zip(names, expect, got) if (n := _differing(a, b))]
    return "differs: " + ", ".join(diffs) if diffs else "bit-identical"


def _periods() -> None:
    from gefen_bench.param_sets import build_param_set, shapes_for
    from gefen_core import Gefen

    named = build_param_set(shapes_for("llama", "full"), device=DEVICE, dtype=torch.bfloat16)
    opt = Gefen(named, lr=1e-4, weight_decay=0.0)
    opt.step()
    torch.cuda.synchronize()
    seen: Counter[tuple[Any, ...]] = Counter()
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state[p]
            if "exp_avg_codes" not in st:
                continue
            b, per = st["exp_avg_codes"].shape
            from gefen_kernels.ops._step_kernels import choose_route

            seen[
                (
                    tuple(p.shape),
                    int(per),
                    choose_route(int(b), int(per), p.device),
                    "exp_avg_sq_row" in st,
                )
            ] += 1
    print("\nLlama-3.2-1B-shaped set after one Gefen step (shape, period, route, factored): count")
    for key, count in sorted(seen.items(), key=lambda kv: -kv[1] * torch.Size(kv[0][0]).numel()):
        print(f"  {key}: {count}")
    del opt, named
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30, help="launches timed per round")
    parser.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="rounds over all variants; the median round is reported",
    )
    parser.add_argument(
        "--periods",
        default="2048,256",
        help="block periods of the cases (each must divide rows x 8192)",
    )
    parser.add_argument(
        "--rows",
        type=int,
        default=8192,
        help="rows of the [rows, 8192] parameter (8190: periods 1536 and 1152)",
    )
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--no-periods", action="store_true")
    parser.add_argument(
        "--ncu",
        action="store_true",
        help="one production launch per case and nothing else (run under ncu)",
    )
    parser.add_argument(
        "--device",
        default="cuda",
        help="cpu: a smoke run under TRITON_INTERPRET=1 (8 rows unless --rows says otherwise)",
    )
    args = parser.parse_args()
    global DEVICE, ROWS
    DEVICE = torch.device(args.device)
    ROWS = args.rows
    if DEVICE.type != "cuda" and ROWS == 8192:
        ROWS = 8
    if args.ncu:
        prod = importlib.import_module("gefen_kernels.ops._step_kernels")
        for factored in (True, False):
            Case(2048, factored).launch(prod)
        torch.cuda.synchronize()
        return
    if not args.no_periods:
        _periods()
    names = args.variants.split(",")
    modules = {}
    try:
        for name in names:
            modules[name] = _load_variant(name, VARIANTS[name][1])
        for name in names:
            state = "" if modules[name] is not None else " (not applicable to these sources)"
            print(f"  {name:14s} {VARIANTS[name][0]}{state}")
        names = [name for name in names if modules[name] is not None]
        print(
            f"\ncodebook: the learned one of _learned_codebook(); kernel table STEPS "
            f"{kernel_table(_learned_codebook().to(DEVICE))[1]} (-1: decision table, -2: with its "
            f"staged section)"
        )
        n = ROWS * NCOLS
        src = torch.empty(n * 4, dtype=torch.uint8, device=DEVICE)
        dst = torch.empty_like(src)
        copy_ms = _time(functools.partial(dst.copy_, src), args.reps)
        src = dst = torch.empty(0)
        print(f"\ncopy of 8 B/param for {n} elements: {copy_ms:.3f} ms")
        rows = []
        for factored in (True, False):
            for period in (int(p) for p in args.periods.split(",")):
                case = Case(period, factored)
                mode = "factored" if factored else "block"
                tag = (
                    f"{mode} P={period} BPP={case.plan._consts['BPP']} "
                    f"TAIL={case.plan._consts['TAIL']} "
                    f"warps={case.plan._consts['num_warps']} STEPS={case.plan._consts['STEPS']}"
                )
                runs = {name: functools.partial(case.launch, modules[name]) for name in names}
                # Rounds over all variants, not all rounds of one variant then the next: the
                # GPU's clock drifts over a run (production timed twice in a row has differed
                # by 15 %), and interleaving spreads that drift over every variant alike.
                times: dict[str, list[float]] = {name: [] for name in names}
                for _ in range(args.rounds):
                    for name in names:
                        times[name].append(_time(runs[name], args.reps))
                for name in names:
                    same = ""
                    if VARIANTS[name][0].startswith("candidate"):
                        same = _check(case, runs[name])
                    ts = sorted(times[name])
                    rows.append((tag, name, ts[len(ts) // 2], ts[0], ts[-1], same))
                case = None  # type: ignore[assignment]
                torch.cuda.empty_cache()
        print(
            f"\n{args.rounds} interleaved rounds of {args.reps} launches: the median round "
            f"(ms), its range, % of copy"
        )
        print(f"{'case':36s} {'variant':18s} {'ms':>7s} {'range':>15s} {'% copy':>7s}  check")
        for tag, name, ms, lo, hi, same in rows:
            print(
                f"{tag:36s} {name:18s} {ms:7.3f} {lo:7.3f}-{hi:<7.3f} {copy_ms / ms:7.0%}  {same}"
            )
    finally:
        _cleanup()
        sys.stdout.flush()


if __name__ == "__main__":
    main()
