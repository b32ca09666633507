"""Compile every Gefen Triton kernel for sm_90 on a machine without a GPU.

The CPU interpreter (``TRITON_INTERPRET=1``) runs kernels as Python and so misses errors that
only the compiler front end sees: an ``int`` argument equal to 1 becomes the *constant* 1 when
Triton specialises it (``period.to(tl.float32)`` then fails), a pointer or integer divisible
by 16 gets an alignment attribute, a ``tl.constexpr`` branch that the interpreter never took is
type-checked. This script drives the real launchers (``block_step_triton``,
``factored_step_triton``, ``multi_block_step_triton``, ``StepGroups``, the quantize launchers,
the Muon momentum launcher, the period scores of one and of many tensors, the histogram and
the codebook DP) over every route and constexpr combination they can pick, records each
launch instead of running it, applies Triton's launch-time specialisation rules (ints equal to
1 -> constexpr, ints and pointers divisible by 16 -> ``tt.divisibility``), and compiles the
result ahead of time with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))``.

Usage (from ``packages/gefen-kernels``)::

    python tests/compile_check.py                 # front end + TTIR/TTGIR passes (default)
    python tests/compile_check.py --stage cubin   # all the way to a cubin (needs ptxas)
    python tests/compile_check.py --resources     # cubin + registers, spills, occupancy
    python tests/compile_check.py --kernel _dp_layer --stage ptx   # some kernels only

``--resources`` reads each cubin's resource usage with ``cuobjdump --dump-resource-usage``
(shipped with Triton) and prints, per configuration, registers per thread, spill bytes and the
warps per SM that the register file allows (64K 32-bit registers and at most 64 resident
warps per SM on sm_90; shared memory not counted): the occupancy side of a latency-bound
kernel, without a GPU. The counts are this Triton's; another version may allocate differently.

Exit status 0 when every configuration compiles; otherwise the failures are printed.
``tests/test_compile_check.py`` runs it in a subprocess (the test session itself interprets).
"""

from __future__ import annotations

import argparse
import functools
import inspect
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any

os.environ["TRITON_INTERPRET"] = "0"  # must precede importing gefen_kernels (kernels compile)

import torch  # noqa: E402

_TORCH_TO_TRITON = {
    torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
    torch.float64: "fp64", torch.uint8: "u8", torch.int16: "i16", torch.int32: "i32",
    torch.int64: "i64",
}

STAGES = ("ir", "ttir", "ttgir", "llir", "ptx", "cubin")


class Launch:
    """One recorded kernel launch with Triton's launch-time specialisation applied."""

    def __init__(self, kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.kernel = kernel
        names = list(kernel.arg_names)
        values = dict(zip(names, args))
        self.options = {k: v for k, v in kwargs.items() if k not in names}
        values.update({k: v for k, v in kwargs.items() if k in names})
        missing = [n for n in names if n not in values]
        if missing:
            raise TypeError(f"{kernel.__name__}: launch lacks arguments {missing}")
        self.signature: dict[str, str] = {}
        self.constexprs: dict[tuple[int, ...], Any] = {}
        self.attrs: dict[tuple[int, ...], list[list[Any]]] = {}
        for i, (name, param) in enumerate(zip(names, kernel.params)):
            v = values[name]
            dns = param.do_not_specialize
            dns_align = getattr(param, "do_not_specialize_on_alignment", False) or dns
            if param.is_constexpr:
                self.signature[name] = "constexpr"
                self.constexprs[(i,)] = v
            elif isinstance(v, torch.Tensor):
                self.signature[name] = "*" + _TORCH_TO_TRITON[v.dtype]
                if not dns_align and v.data_ptr() % 16 == 0:
                    self.attrs[(i,)] = [["tt.divisibility", 16]]
            elif isinstance(v, bool):
                self.signature[name] = "i1"
            elif isinstance(v, int):
                if v == 1 and not dns:
                    # The specialisation that bit the first H200 run: the argument is gone,
                    # the kernel body sees the Python int 1.
                    self.signature[name] = "constexpr"
                    self.constexprs[(i,)] = 1
                    continue
                if -(1 << 31) <= v < (1 << 31):
                    self.signature[name] = "i32"
                elif (1 << 63) <= v < (1 << 64):
                    self.signature[name] = "u64"
                else:
                    self.signature[name] = "i64"
                if not dns_align and v % 16 == 0:
                    self.attrs[(i,)] = [["tt.divisibility", 16]]
            elif isinstance(v, float):
                self.signature[name] = "fp32"
            elif v is None:
                self.signature[name] = "constexpr"
                self.constexprs[(i,)] = None
            else:
                raise TypeError(f"{kernel.__name__}: cannot type argument {name}={v!r}")

    def key(self) -> tuple[Any, ...]:
        return (self.kernel.__name__, tuple(sorted(self.signature.items())),
                tuple(sorted((k, repr(v)) for k, v in self.constexprs.items())),
                tuple(sorted((k, repr(v)) for k, v in self.attrs.items())),
                tuple(sorted(self.options.items())))

    def constexpr(self, name: str) -> Any:
        """The value of constexpr argument ``name`` (``None`` where the kernel has none such);
        :attr:`constexprs` is keyed by argument position."""
        names = list(self.kernel.arg_names)
        return self.constexprs.get((names.index(name),)) if name in names else None

    def describe(self) -> str:
        const = {self.kernel.arg_names[k[0]]: v for k, v in self.constexprs.items()}
        return f"{self.kernel.__name__} {const} {self.options}"


def compile_launch(launch: Launch, stage: str) -> Any:
    """Compile ``launch`` for sm_90 up to ``stage``; raises the compiler's error. Returns the
    compiled kernel at stage ``cubin``, else the module at ``stage``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource, make_backend

    target = GPUTarget("cuda", 90, 32)
    src = ASTSource(fn=launch.kernel, signature=launch.signature, constexprs=launch.constexprs,
                    attrs=launch.attrs)
    if stage == "cubin":
        return triton.compile(src, target=target, options=dict(launch.options))
    from triton._C.libtriton import ir

    backend = make_backend(target)
    options = backend.parse_options(dict(launch.options))
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    codegen_fns = backend.get_codegen_implementation(options)
    module_map = backend.get_module_map()
    # Triton < 3.4 has make_ir(options, ...) and add_stages(stages, options); later versions
    # take the target first and the source language last. Their compilers are the same here.
    if "target" in inspect.signature(src.make_ir).parameters:
        module = src.make_ir(target, options, codegen_fns, module_map, context)
    else:
        module = src.make_ir(options, codegen_fns, module_map, context)
    if stage == "ir":
        return module
    stages: dict[str, Callable[..., Any]] = {}
    if "language" in inspect.signature(backend.add_stages).parameters:
        backend.add_stages(stages, options, src.language)
    else:
        backend.add_stages(stages, options)
    metadata: dict[str, Any] = {}
    for name, fn in stages.items():
        module = fn(module, metadata)
        if name == stage:
            return module


# --------------------------------------------------------------------------------------------
# Recording the launchers' launches
# --------------------------------------------------------------------------------------------


def record_launches(scenarios: Iterator[Callable[[], None]]) -> list[Launch]:
    """Run each scenario with ``JITFunction.run`` patched to record instead of launching."""
    from triton.runtime.jit import JITFunction

    from gefen_kernels.ops import _device as _dispatch

    recorded: list[Launch] = []
    seen: set[tuple[Any, ...]] = set()
    original_run = JITFunction.run
    original_interp = _dispatch.interpret_mode

    def fake_run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        launch = Launch(self, args, kwargs)
        if launch.key() not in seen:
            seen.add(launch.key())
            recorded.append(launch)

    JITFunction.run = fake_run  # type: ignore[method-assign]
    _dispatch.interpret_mode = lambda: True  # CPU tensors pass the launchers' device check
    try:
        for scenario in scenarios:
            scenario()
    finally:
        JITFunction.run = original_run  # type: ignore[method-assign]
        _dispatch.interpret_mode = original_interp
    return recorded


def _codebooks() -> list[torch.Tensor]:
    """Codebooks whose search tables need different ``STEPS`` (1, 2 and the full 8)."""
    uniform = torch.linspace(-1.0, 1.0, 256)
    crowded = torch.cat([torch.tensor([-1.0]), torch.linspace(-1e-3, 1e-3, 254),
                         torch.tensor([1.0])])
    mid = torch.cat([torch.linspace(-1.0, -0.5, 64), torch.linspace(-4e-4, 4e-4, 128),
                     torch.linspace(0.5, 1.0, 64)])
    return [uniform, mid, crowded]


def scenarios() -> Iterator[Callable[[], None]]:
    from gefen_kernels.ops import _search_table
    from gefen_kernels.ops._step_kernels import launch_step
    from gefen_kernels.ops.factored_step import factored_step_triton
    from gefen_kernels.ops.multi_block_step import multi_block_step_triton
    from gefen_kernels.ops.quantize import quantize_nearest_triton, quantize_stochastic_triton

    pdtypes = (torch.float32, torch.bfloat16, torch.float16)
    gdtypes = (torch.float32, torch.bfloat16, torch.float16)
    cbs = _codebooks()
    cb = cbs[0]

    def block_state(nb: int, period: int) -> tuple[torch.Tensor, ...]:
        return (torch.zeros(nb, period, dtype=torch.uint8), torch.zeros(nb, 1),
                torch.zeros(nb, 1))

    def hp(**kw: Any) -> dict[str, Any]:
        base = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, bc1_recip=10.0, bc2=30.0,
                    decay=1.0, maximize=False, stochastic_round=False, seed=3, hyper=None,
                    seed_tensor=None)
        base.update(kw)
        return base

    # Block mode, every route, every dtype pair, the flags that are constexprs.
    shapes = [(1, 1, None), (16, 1, None), (3, 7, None), (64, 16, None), (2, 2048, None),
              (1, 4096, None), (5, 5003, "loop"), (160, 4096 + 16, "loop"), (2, 4099, "split"),
              (1, 32768, "split")]
    # Every dtype pair on one shape per route; the other shapes (the int specialisations)
    # with bf16 parameters and gradients, as in the benchmarks.
    dtype_shapes = {(3, 7, None), (5, 5003, "loop"), (2, 4099, "split")}
    for (nb, period, route) in shapes:
        pairs = ([(p, g) for p in pdtypes for g in gdtypes] if (nb, period, route) in dtype_shapes
                 else [(torch.bfloat16, torch.bfloat16)])
        for pdt, gdt in pairs:
            def run(nb: int = nb, period: int = period, route: str | None = route,
                    pdt: torch.dtype = pdt, gdt: torch.dtype = gdt) -> None:
                n = nb * period
                q, s, v = block_state(nb, period)
                for flags in ({}, {"maximize": True, "stochastic_round": True},
                              {"hyper": torch.ones(4), "seed_tensor": torch.ones(1,
                               dtype=torch.int64)}):
                    launch_step(torch.zeros(n, dtype=pdt), torch.zeros(n, dtype=gdt), q, s,
                                exp_avg_sq=v, row=None, col=None, inv_rbar=None, ncols=1,
                                codebook=cb, route=route, **hp(**flags))
            yield run
    # Factored mode: the statistics kernel and the step kernels with FACTORED=True. 1152, 1140,
    # 144 and 2304 (a 4096-lane tile) take a head and a tail piece (tile_shape's TAIL), 288 / 144
    # with IN_ROW; 1152 on 576 columns and 2304 on 1024 the flat update (every parameter dtype
    # for 576), 1140 (not a multiple of 16) the per-element form.
    for rows, cols, period, route in [(1, 1, 1, None), (1, 16, 16, None), (7, 13, 7, None),
                                      (64, 96, 32, None), (16, 1024, 2048, None),
                                      (10, 576, 1152, None), (10, 570, 1140, None),
                                      (4, 288, 144, None),
                                      (9, 1024, 2304, None),
                                      (2048, 64, 1, None), (3, 5003, 5003, "loop"),
                                      (2, 4099, 4099, "split"), (4097, 1, 1, None),
                                      (1, 4097, 4097, None)]:
        for pdt in (pdtypes if (rows, cols) in ((7, 13), (10, 576)) else (torch.bfloat16,)):
            def run_f(rows: int = rows, cols: int = cols, period: int = period,
                      route: str | None = route, pdt: torch.dtype = pdt) -> None:
                nb = rows * cols // period
                for flags in ({}, {"maximize": True, "stochastic_round": True},
                              {"hyper": torch.ones(4),
                               "seed_tensor": torch.ones(1, dtype=torch.int64)}):
                    kw = hp(**flags)
                    bc2 = kw.pop("bc2")
                    q, s, _ = block_state(nb, period)
                    if route is None:
                        factored_step_triton(torch.zeros(rows, cols, dtype=pdt),
                                             torch.zeros(rows, cols, dtype=torch.bfloat16), q,
                                             s, torch.zeros(rows), torch.zeros(cols), cb,
                                             bc2_recip=bc2, **kw)
                    else:
                        launch_step(torch.zeros(rows, cols, dtype=pdt),
                                    torch.zeros(rows, cols, dtype=torch.bfloat16), q, s,
                                    exp_avg_sq=None, row=torch.zeros(rows),
                                    col=torch.zeros(cols), inv_rbar=torch.ones(1), ncols=cols,
                                    codebook=cb, route=route, bc2=bc2, **kw)
            yield run_f
    # The row-shard statistics (finalize PHASE 1 and 2, an empty shard included) and the
    # statistics kernel with several column tiles per split (taken when the row partials would
    # pass their bound: forced here through an explicit layout on a small gradient).
    def run_shard() -> None:
        from gefen_kernels.ops.factored_step import (
            _stats_partials,
            factored_finalize_stats,
            factored_partial_stats,
        )

        for rows, cols in ((1, 1), (7, 13), (64, 96), (300, 4097)):
            g = torch.zeros(rows, cols, dtype=torch.bfloat16)
            row, col = torch.zeros(rows), torch.zeros(cols)
            stats = factored_partial_stats(torch.zeros(rows, cols, dtype=torch.bfloat16), g, row,
                                           col, beta2=0.999)
            factored_finalize_stats(row, col, stats, beta2=0.999, global_rows=rows + 5)
            factored_finalize_stats(torch.zeros(0), col, stats[rows:], beta2=0.999,
                                    global_rows=rows + 5)
        for gdt in gdtypes:
            _stats_partials(torch.zeros(64, 1024, dtype=gdt), layout=(32, 256, 2, 2, 32))
    yield run_shard
    # int64 offsets (OFFS64), which only tensors near 2**31 elements take: forced here.
    def run_offs64() -> None:
        from gefen_kernels.ops import _step_kernels

        original = _step_kernels.needs_int64
        _step_kernels.needs_int64 = lambda *args, **kwargs: True
        try:
            # (3, 1152): the factored launch takes a head and a tail piece (tile_shape).
            for nb, period, route in [(64, 16, None), (5, 5003, "loop"), (2, 4099, "split"),
                                      (3, 1152, None)]:
                q, s, v = block_state(nb, period)
                for flags in ({}, {"maximize": True, "stochastic_round": True}):
                    launch_step(torch.zeros(nb * period, dtype=torch.bfloat16),
                                torch.zeros(nb * period, dtype=torch.bfloat16), q, s,
                                exp_avg_sq=v, row=None, col=None, inv_rbar=None, ncols=1,
                                codebook=cb, route=route, **hp(**flags))
                    launch_step(torch.zeros(nb, period, dtype=torch.bfloat16),
                                torch.zeros(nb, period, dtype=torch.bfloat16), q, s,
                                exp_avg_sq=None, row=torch.zeros(nb), col=torch.zeros(period),
                                inv_rbar=torch.ones(1), ncols=period, codebook=cb, route=route,
                                **hp(**flags))
        finally:
            _step_kernels.needs_int64 = original
    yield run_offs64
    # The search table's STEPS and the full search (STEPS=0, taken during graph capture).
    for codebook in cbs:
        def run_t(codebook: torch.Tensor = codebook) -> None:
            q, s, v = block_state(4, 64)
            launch_step(torch.zeros(256), torch.zeros(256), q, s, exp_avg_sq=v, row=None,
                        col=None, inv_rbar=None, ncols=1, codebook=codebook, **hp())
            launch_step(torch.zeros(256), torch.zeros(256), q, s, exp_avg_sq=v, row=None,
                        col=None, inv_rbar=None, ncols=1, codebook=codebook, use_table=False,
                        **hp())
            quantize_nearest_triton(torch.zeros(1), codebook)
            quantize_nearest_triton(torch.zeros(3, 5), codebook)
            for xdt in (torch.float32, torch.bfloat16, torch.float16):
                quantize_nearest_triton(torch.zeros(4096, dtype=xdt), codebook)
                quantize_stochastic_triton(torch.zeros(4096, dtype=xdt), codebook, 5, 1)
        yield run_t
    # Multi-tensor launches: every (param dtype, grad dtype) and several period classes.
    for pdt, gdt in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                     (torch.float16, torch.float32), (torch.bfloat16, torch.float16)):
        def run_m(pdt: torch.dtype = pdt, gdt: torch.dtype = gdt) -> None:
            shapes = [(1, 1), (16, 1), (3, 7), (64, 16), (2, 2048), (1, 4096), (2, 5003)]
            params = [torch.zeros(nb * p, dtype=pdt) for nb, p in shapes]
            grads = [torch.zeros(nb * p, dtype=gdt) for nb, p in shapes]
            states = [block_state(nb, p) for nb, p in shapes]
            for flags in ({}, {"maximize": True, "stochastic_round": True}):
                multi_block_step_triton(
                    params, grads, [st[0] for st in states], [st[1] for st in states],
                    [st[2] for st in states], cb, beta1=0.9, beta2=0.999, eps=1e-8,
                    hyper=torch.ones(len(shapes), 4),
                    seeds=torch.ones(len(shapes), dtype=torch.int64), **flags)
        yield run_m
    # Grouped planned steps (step_groups): both modes, every dtype pair, aligned (multiples of
    # 16) and unaligned classes, the rounding flags; OFFS64 in run_groups64 below.
    for pdt, gdt in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                     (torch.float16, torch.float32), (torch.bfloat16, torch.float16)):
        def run_g(pdt: torch.dtype = pdt, gdt: torch.dtype = gdt) -> None:
            _group_launch([((64, 96), 32), ((7, 13), 7), ((16, 1024), 2048), ((2048, 64), 1),
                           ((1, 1), 1), ((48,), 16), ((21,), 7), ((4096,), 2048),
                           ((10, 576), 1152), ((4, 288), 144)], pdt, gdt, cb)
        yield run_g

    def run_groups64() -> None:
        from gefen_kernels.ops import step_plan

        original = step_plan.needs_int64
        step_plan.needs_int64 = lambda *args, **kwargs: True
        try:
            _group_launch([((64, 96), 32), ((7, 13), 7), ((48,), 16), ((10, 576), 1152)],
                          torch.bfloat16, torch.bfloat16, cb)
        finally:
            step_plan.needs_int64 = original
    yield run_groups64
    # The Muon momentum (docs/algorithm.md#gefenmuon): every route, dtype and constexpr flag.
    from gefen_kernels.ops._muon_kernels import launch_muon_momentum

    muon_shapes = [(1, 1, None), (16, 1, None), (4097, 1, None), (3, 7, None), (64, 16, None),
                   (2, 2048, None), (1, 4096, None), (5, 5003, "loop"),
                   (160, 4096 + 16, "loop"), (2, 4099, "split"), (1, 32768, "split")]
    muon_dtype_shapes = {(3, 7, None), (5, 5003, "loop"), (2, 4099, "split")}
    for (nb, period, route) in muon_shapes:
        for gdt in (gdtypes if (nb, period, route) in muon_dtype_shapes
                    else (torch.bfloat16,)):
            def run_mu(nb: int = nb, period: int = period, route: str | None = route,
                       gdt: torch.dtype = gdt) -> None:
                q, s, _ = block_state(nb, period)
                g = torch.zeros(nb * period, dtype=gdt)
                for flags in ({"nesterov": False}, {"nesterov": True},
                              {"nesterov": True, "maximize": True, "stochastic_round": True},
                              {"nesterov": False, "stochastic_round": True,
                               "seed_tensor": torch.ones(1, dtype=torch.int64)}):
                    kw: dict[str, Any] = dict(beta=0.95, maximize=False, stochastic_round=False,
                                              seed=3, seed_tensor=None)
                    kw.update(flags)
                    launch_muon_momentum(g, q, s, cb, torch.empty_like(g), route=route, **kw)
            yield run_mu
    for codebook in cbs:
        def run_mt(codebook: torch.Tensor = codebook) -> None:
            q, s, _ = block_state(4, 64)
            for use_table in (True, False):
                launch_muon_momentum(torch.zeros(256), q, s, codebook, torch.empty(256),
                                     beta=0.9, nesterov=True, maximize=False,
                                     stochastic_round=False, seed=0, seed_tensor=None,
                                     use_table=use_table)
        yield run_mt
    _search_table._CACHE.clear()
    # The first step's kernels: the period scores (both variants; several chunks, so the
    # carries' and the predecessor's variants) and the histogram (both routes).
    from gefen_kernels.ops import period_scores as ps_mod
    from gefen_kernels.ops.histogram import histogram_triton

    for variant in ("log_contrast", "variance"):
        def run_ps(variant: str = variant) -> None:
            original = ps_mod._CHUNK_TRITON
            ps_mod._CHUNK_TRITON = 4096
            try:
                for n in (12, 3 * 4096 * 5):
                    g = torch.zeros(n, dtype=torch.bfloat16)
                    cands = [p for p in range(1, n) if n % p == 0 and n // p >= 2][:40]
                    ps_mod.period_scores_triton(g, torch.tensor(cands), variant)
            finally:
                ps_mod._CHUNK_TRITON = original
        yield run_ps

        def run_ps_many(variant: str = variant) -> None:
            # Several rounds and prefix classes (every dtype, aligned and unaligned chunks),
            # several chunks per tensor; a call with one slot and one pair (ints equal to 1).
            saved = ps_mod._CHUNK_TRITON, ps_mod._ROUND_SHARE
            ps_mod._CHUNK_TRITON, ps_mod._ROUND_SHARE = 4096, 1
            try:
                grads, cands = _period_mix(variant)
                ps_mod.multi_period_scores_triton(grads, [torch.tensor(c) for c in cands],
                                                  variant)
                one = [1] if variant == "variance" else [2]
                ps_mod.multi_period_scores_triton([torch.zeros(4)], [torch.tensor(one)],
                                                  variant)
            finally:
                ps_mod._CHUNK_TRITON, ps_mod._ROUND_SHARE = saved
        yield run_ps_many
    for gdt in gdtypes:
        def run_hist(gdt: torch.dtype = gdt) -> None:
            for n, period, route in ((64 * 48, 48, None), (3 * 5003, 5003, None),
                                     (2 * 4099, 4099, "split")):
                # The kernels are recorded, not run: histc counts unwritten bins (it ignores
                # values outside its range, so no error).
                histogram_triton(torch.zeros(n, dtype=gdt), period, _route=route)
        yield run_hist
    # The first step's codebook DP: the full-size problem ([32, 64] tiles) and small ones
    # (one row per layer when k == M).
    def run_quantizer_dp() -> None:
        from gefen_kernels.ops.quantizer_dp import optimal_quantizer_dp_triton, quantizer_prefix

        for m, k in ((4096, 256), (40, 5), (8, 8)):
            x = torch.linspace(-1.0, 1.0, m, dtype=torch.float64)
            optimal_quantizer_dp_triton(quantizer_prefix(x, torch.ones(m)), k)
    yield run_quantizer_dp


def _group_launch(cases: list[tuple[tuple[int, ...], int]], pdt: torch.dtype,
                  gdt: torch.dtype, cb: torch.Tensor) -> None:
    """One StepGroups step per rounding flag set over ``cases`` ((shape, period); 2-D shapes
    factored)."""
    from gefen_kernels.ops.step_groups import StepGroups
    from gefen_kernels.ops.step_plan import StepPlan
    from gefen_kernels.ops.step_scalars import StepScalars

    for flags in ({"maximize": False, "stochastic_round": False},
                  {"maximize": True, "stochastic_round": True}):
        plans, grads, keep = [], [], []  # plans hold weak references: keep the tensors
        for shape, period in cases:
            n = 1
            for d in shape:
                n *= d
            codes = torch.zeros(n // period, period, dtype=torch.uint8)
            scale = torch.zeros(n // period, 1)
            factored = len(shape) == 2
            sq = None if factored else torch.zeros(n // period, 1)
            row = torch.zeros(shape[0]) if factored else None
            col = torch.zeros(shape[1]) if factored else None
            param = torch.zeros(shape, dtype=pdt)
            keep.append((param, codes, scale, sq, row, col))
            plans.append(StepPlan(param, codes, scale, sq, row, col, cb, beta1=0.9, beta2=0.999,
                                  eps=1e-8, capturable=False, **flags))
            grads.append(torch.zeros(shape, dtype=gdt))
        scalars = [StepScalars(lr=1e-3, bc2=10.0, bc1_recip=30.0, decay=1.0)] * len(plans)
        StepGroups(plans, grads).launch(grads, scalars, [3] * len(plans))
        # Unaligned gradients: the class without alignment hints.
        shifted = []
        for g in grads:
            buf = torch.zeros(g.numel() + 1, dtype=g.dtype)
            shifted.append(buf[1:].view_as(g))
        StepGroups(plans, shifted).launch(shifted, scalars, [3] * len(plans))


def _period_mix(variant: str) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Gradients of every batched dtype, 16-byte aligned or not, of one to three chunks of 4096
    elements, with their candidates (at most 40 each)."""
    grads = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for shift, n in ((0, 12), (0, 3 * 4096 * 5 // 6), (1, 3000)):
            grads.append(torch.zeros(n + shift, dtype=dtype)[shift:])
    cands = [[p for p in range(1, g.numel()) if g.numel() % p == 0
              and (variant == "variance" or g.numel() // p >= 2)][:40] for g in grads]
    return grads, cands


# One-tensor period kernel -> its batched twin. The batched kernels look their segment or pair
# up in a table (scalar loads, no layout); the one-tensor terms kernel instead finds its
# candidate with a vector over the candidates: one load and one integer reduction that lead its
# list and are skipped.
_PERIOD_PAIRS = {"_period_prefix_kernel": ("_multi_prefix_kernel", 0),
                 "_period_terms_kernel": ("_multi_terms_kernel", 2),
                 "_period_carry_kernel": ("_multi_carry_kernel", 0)}


def compare_period_layouts() -> int:
    """Compile every one-tensor period-score launch (``period_scores_triton``) and every
    batched one (``multi_period_scores_triton``) of :func:`_period_mix`'s tensors to TTGIR and
    compare :func:`layouts` of each one-tensor kernel with every batched twin of the same
    variant (prefix kernels: also the same gradient dtype and alignment). Prints one line per
    one-tensor configuration; returns the number that differ from some twin."""
    from gefen_kernels.ops import period_scores as ps_mod

    def run(variant: str, many: bool) -> None:
        saved = ps_mod._CHUNK_TRITON, ps_mod._ROUND_SHARE
        ps_mod._CHUNK_TRITON, ps_mod._ROUND_SHARE = 4096, 1
        try:
            grads, cands = _period_mix(variant)
            tensors = [torch.tensor(c) for c in cands]
            if many:
                ps_mod.multi_period_scores_triton(grads, tensors, variant)
            else:
                for g, c in zip(grads, tensors):
                    ps_mod.period_scores_triton(g, c, variant)
        finally:
            ps_mod._CHUNK_TRITON, ps_mod._ROUND_SHARE = saved

    def class_of(launch: Launch) -> tuple[Any, ...]:
        first = launch.kernel.arg_names[0]  # the gradient (g_ptr / g_base)
        aligned = (0,) in launch.attrs
        if launch.kernel.__name__ == "_multi_prefix_kernel":
            aligned = launch.constexpr("G_VEC") > 1
        return (launch.constexpr("LOG_CONTRAST"), launch.signature[first], aligned)

    variants = ("log_contrast", "variance")
    single = record_launches(iter([functools.partial(run, v, False) for v in variants]))
    batched = record_launches(iter([functools.partial(run, v, True) for v in variants]))
    ttgir: dict[int, list[str]] = {}

    def lay(launch: Launch) -> list[str]:
        if id(launch) not in ttgir:
            ttgir[id(launch)] = layouts(str(compile_launch(launch, "ttgir")))
        return ttgir[id(launch)]

    different = 0
    for launch in single:
        name = launch.kernel.__name__
        if name not in _PERIOD_PAIRS:
            continue
        twin_name, skip = _PERIOD_PAIRS[name]
        prefix = name == "_period_prefix_kernel"
        twins = [t for t in batched if t.kernel.__name__ == twin_name
                 and t.constexpr("LOG_CONTRAST") == launch.constexpr("LOG_CONTRAST")
                 and (not prefix or class_of(t) == class_of(launch))]
        a = lay(launch)[skip:]
        same = bool(twins) and bool(a) and all(lay(t) == a for t in twins)
        different += not same
        print(f"{launch.describe()} / {len(twins)} x {twin_name}: "
              f"{'same layouts' if same else 'DIFFERENT'}", flush=True)
        if not same:
            print(f"  one-tensor: {a}")
            for t in twins:
                print(f"  batched:    {lay(t)}")
    return different


REGISTERS_PER_SM = 65536  # sm_90 register file, 32-bit registers
MAX_WARPS_PER_SM = 64


def resource_usage(compiled: Any) -> dict[str, int]:
    """Registers per thread and spill (stack) bytes of a compiled kernel's cubin."""
    import subprocess
    import tempfile

    from triton import knobs

    cuobjdump = knobs.nvidia.cuobjdump.path
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], check=True,
                             capture_output=True, text=True).stdout
    return parse_resource_usage(out)


def parse_resource_usage(text: str) -> dict[str, int]:
    """``{"reg": ..., "stack": ..., "shared": ..., "local": ...}`` from cuobjdump's
    ``--dump-resource-usage`` text (one kernel per cubin)."""
    import re

    fields = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text))
    return {k.lower(): int(v) for k, v in fields.items()}


def resident_warps(regs: int, num_warps: int) -> int:
    """Warps per SM the register file allows for programs of ``num_warps`` warps (registers
    are allocated per warp in units of 256, i.e. per thread rounded up to 8)."""
    per_warp = -(-max(regs, 1) // 8) * 8 * 32
    programs = min(REGISTERS_PER_SM // (per_warp * num_warps), MAX_WARPS_PER_SM // num_warps)
    return programs * num_warps


# --------------------------------------------------------------------------------------------
# Grouped kernels against the one-tensor kernels: the same register layouts
# --------------------------------------------------------------------------------------------

# (shape, period): factored when 2-D; aligned and unaligned periods and column counts, sizes
# that make the statistics scratch's column partials and block sums aligned or not.
# 1152 takes a head and a tail piece, with (2304 columns) and without (3072) IN_ROW; without,
# the tile only quantises and the flat update follows (FLAT_UPDATE), as at 1536 on 2304.
LAYOUT_CASES = [((256, 2048), 2048), ((768, 2304), 1152), ((768, 3072), 1152),
                ((768, 2304), 1536), ((768, 2850), 1140),
                ((1733, 768), 1733), ((40, 24), 8), ((5, 600), 40), ((1, 16), 16),
                ((4096,), 64), ((2304,), 24), ((7,), 7), ((3466, 768), 768)]
_LAYOUT_PAIRS = {"_step_tile_kernel": "_group_tile_kernel",
                 "_step_update_kernel": "_group_update_kernel",
                 "_factored_stats_kernel": "_group_stats_kernel",
                 "_factored_finalize_kernel": "_group_finalize_kernel"}


def layouts(ttgir: str) -> list[str]:
    """The layout of every load and of every reduction's operand in a TTGIR module, in program
    order, with the ``#blocked`` aliases resolved. A reduction's order follows its operand's
    layout, so equal lists mean equal summation orders."""
    import re

    # "#ttg." since Triton 3.3, "#triton_gpu." before: any attribute alias.
    aliases = dict(re.findall(r"^(#[\w]+) = (#[\w.]+<[^\n]+)$", ttgir, re.M))
    out = []
    for line in ttgir.splitlines():
        if "tt.load" in line or (line.lstrip().startswith("})") and "->" in line):
            out += [aliases.get(a, a) for a in re.findall(r"(#[\w]+)>", line.split(" : ")[-1])]
    return out


def compare_group_layouts() -> int:
    """For each of :data:`LAYOUT_CASES` (bf16, nearest rounding), compile the one-tensor
    launches (``factored_step_triton`` / ``block_step_triton``) and the grouped ones
    (``StepGroups``) to TTGIR and compare :func:`layouts` kernel by kernel. Prints one line per
    kernel pair; returns the number of pairs that differ."""
    from gefen_kernels.ops.block_step import block_step_triton
    from gefen_kernels.ops.factored_step import factored_step_triton

    cb = _codebooks()[0]
    kw: dict[str, Any] = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, bc1_recip=10.0,
                              decay=1.0)

    def one(shape: tuple[int, ...], period: int) -> None:
        n = 1
        for d in shape:
            n *= d
        q = torch.zeros(n // period, period, dtype=torch.uint8)
        s = torch.zeros(n // period, 1)
        p, g = torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16)
        if len(shape) == 2:
            factored_step_triton(p, g, q, s, torch.zeros(shape[0]), torch.zeros(shape[1]), cb,
                                 bc2_recip=30.0, **kw)
        else:
            block_step_triton(p, g, q, s, torch.zeros(n // period, 1), cb, bc2_rsqrt=30.0, **kw)

    different = 0
    for shape, period in LAYOUT_CASES:
        single = record_launches(iter([functools.partial(one, shape, period)]))
        grouped = {launch.kernel.__name__: launch for launch in record_launches(iter(
            [functools.partial(_group_launch, [(shape, period)], torch.bfloat16, torch.bfloat16,
                               cb)])) if not launch.constexpr("MAXIMIZE")}
        for launch in single:
            name = launch.kernel.__name__
            twin = grouped[_LAYOUT_PAIRS[name]]
            a = layouts(str(compile_launch(launch, "ttgir")))
            b = layouts(str(compile_launch(twin, "ttgir")))
            same = a == b and bool(a)
            different += not same
            print(f"{str(shape):14s} P={period:<5d} {name} / {twin.kernel.__name__}: "
                  f"{'same layouts' if same else 'DIFFERENT'}", flush=True)
            if not same:
                print(f"  one-tensor: {a}\n  grouped:    {b}")
    return different


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", choices=STAGES, default="ttgir",
                        help="last compiler stage to run (default: ttgir; cubin needs ptxas)")
    parser.add_argument("--list", action="store_true", help="print each configuration")
    parser.add_argument("--compare-layouts", action="store_true",
                        help="compare the grouped step kernels' and the batched period-score "
                             "kernels' TTGIR layouts with the one-tensor kernels' (same bits "
                             "need the same layouts); exit 1 if any differ")
    parser.add_argument("--kernel", metavar="NAME", action="append",
                        help="compile only the launches of kernels whose name contains NAME "
                             "(repeatable); every scenario is still recorded")
    parser.add_argument("--resources", action="store_true",
                        help="compile to cubin and print registers, spills and register-limited "
                             "warps per SM of every distinct configuration")
    args = parser.parse_args(argv)
    if args.compare_layouts:
        import triton

        different = compare_group_layouts() + compare_period_layouts()
        print(f"triton {triton.__version__}: {different} kernel pairs with different layouts")
        return 1 if different else 0
    if args.resources:
        args.stage = "cubin"
    import triton

    launches = record_launches(scenarios())
    if args.kernel:
        launches = [launch for launch in launches
                    if any(name in launch.kernel.__name__ for name in args.kernel)]
    failures = []
    for launch in launches:
        if args.list:
            print(launch.describe(), flush=True)
        try:
            compiled = compile_launch(launch, args.stage)
        except Exception as exc:  # report every failing configuration, not just the first
            failures.append((launch, exc))
            continue
        if args.resources:
            use = resource_usage(compiled)
            warps = int(launch.options.get("num_warps", 4))
            print(f"regs {use.get('reg', 0):3d}  spill {use.get('stack', 0):3d} B  "
                  f"warps/SM {resident_warps(use.get('reg', 0), warps):2d}  "
                  f"{launch.describe()}", flush=True)
    kernels = sorted({launch.kernel.__name__ for launch in launches})
    print(f"triton {triton.__version__}: compiled {len(launches)} configurations of "
          f"{len(kernels)} kernels ({', '.join(kernels)}) to {args.stage} for sm_90; "
          f"{len(failures)} failed")
    for launch, exc in failures:
        print(f"\nFAILED {launch.describe()}")
        print("".join(traceback.format_exception_only(type(exc), exc))[-3000:])
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
