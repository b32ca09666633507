"""Triton kernels of the quantized Muon momentum (docs/algorithm.md#gefenmuon).

The Gefen step kernels of :mod:`._step_kernels` without a second moment or a parameter write:
recompute ``m`` from the old codes and scale, take the new block max, re-quantise, write the
codes and the **dense momentum** ``u`` (the gradient's dtype). The routes are the step's
(:func:`._step_kernels.choose_route`, performance only):

* ``tile`` (``P <= 4096``): one program owns ``BPP`` whole blocks as a ``[BPP, P2]`` register
  tile; grad and codes are read once, codes and ``u`` written once.
* ``loop``: one program per block, two sweeps over it in ``TILE`` steps (max, then quantise
  and write; the second sweep re-reads grad and codes from L2).
* ``split``: few long blocks: phase 1 is the step's own partial-max kernel
  (``_step_partial_kernel`` with ``FACTORED=True``, which skips the sum of squares), a torch
  ``amax`` merges the partials (order-independent, NaN-propagating), phase 2 re-computes ``m``
  with the old scale, quantises with the new one and writes; the new scales are copied last.
  One flat grid axis ``(block, split) = divmod(pid, num_splits)``: CUDA caps grid axes 1 and 2
  at 65535.

The block max is order-independent, so every route gives the same codes and scales as the
PyTorch reference bit for bit, and the dense output (a function of the new code, the new scale
and the gradient only) is bit-identical too. All arithmetic is fp32 with separately rounded
products (``LAUNCH_OPTIONS``: no fma contraction); offsets are int64.

Pointer arguments: ``g_ptr`` grad (``N``, fp32/bf16/fp16), ``q_ptr`` uint8 codes ``[B, P]``,
``s_ptr`` fp32 scales ``[B]``, ``cb_ptr`` fp32 ``[256]``, ``table_ptr`` the search table of
docs/algorithm.md#quantizer, packed (:func:`._decision_table.kernel_table`; ``STEPS`` probes;
``STEPS=0``: full search), ``seed_ptr`` int64 ``[1]`` (``SEED_PTR``), ``u_ptr`` the output (``N``,
the gradient's dtype). Constexprs: ``NESTEROV`` look-ahead, ``MAXIMIZE`` negate grad, ``STOCHASTIC``
rounding, ``SEED_PTR`` read the seed from device memory (CUDA-graph capturable).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._numerics import f32, to_signed64
from .._triton import jit, program_elements, require_triton, tl, triton
from ._decision_table import kernel_table
from ._device import check_device_for_triton
from ._step_kernels import (
    LOOP_TILE,
    SPLIT_ELEMENTS,
    TILE_ELEMENTS,
    _load_seed,
    _momentum,
    _next_pow2,
    _step_partial_kernel,
    _stored_block_scalars,
    _sweep_block,
    choose_route,
    needs_int64,
)
from ._triton_helpers import (
    LAUNCH_OPTIONS,
    tl_nan_max,
    tl_quantize_nearest,
    tl_quantize_stochastic,
    tl_round_to,
)

__all__ = ["launch_muon_momentum"]


@jit
def _muon_write(q_ptr, u_ptr, cb_ptr, table_ptr, offs, mask, g, m, s_new, b, omb, seed_u,  # type: ignore[no-untyped-def]
                NESTEROV: tl.constexpr, STOCHASTIC: tl.constexpr, STEPS: tl.constexpr):
    """Quantise ``m`` with the new scale, write the codes and the dense momentum at ``offs``.

    ``u = fp(f32(fp(c[q']) * s'))``; Nesterov: ``fp(f32(f32((1 - b) * g) + fp(f32(u * b))))``
    with ``fp`` the output dtype (docs/algorithm.md#gefenmuon, each product rounded on its own).
    """
    positive = s_new > 0
    z = tl.where(positive, tl.math.div_rn(m, tl.where(positive, s_new, 1.0)), 0.0)
    # A zero gradient rounds toward zero (docs/algorithm.md#toward-zero-rounding).
    if STOCHASTIC:
        q, c_q = tl_quantize_stochastic(z, cb_ptr, table_ptr, STEPS, seed_u, offs, g == 0.0)
    else:
        q, c_q = tl_quantize_nearest(z, cb_ptr, table_ptr, STEPS, g == 0.0)
    tl.store(q_ptr + offs, q.to(tl.uint8), mask=mask)
    out_dtype = u_ptr.dtype.element_ty
    codeword = tl_round_to(c_q, out_dtype).to(tl.float32)
    u = tl_round_to(codeword * s_new, out_dtype)
    if NESTEROV:
        look = tl_round_to(u.to(tl.float32) * b, out_dtype).to(tl.float32)
        u = tl_round_to(omb * g + look, out_dtype)
    tl.store(u_ptr + offs, u, mask=mask)


# num_blocks only bounds masks: specialising it would multiply the compiled variants.
@jit(do_not_specialize=["seed", "num_blocks"])
def _muon_tile_kernel(g_ptr, q_ptr, s_ptr, cb_ptr, table_ptr, seed_ptr, u_ptr, num_blocks,  # type: ignore[no-untyped-def]
                      period, b, omb, seed, BPP: tl.constexpr, P2: tl.constexpr,
                      NESTEROV: tl.constexpr, MAXIMIZE: tl.constexpr, STOCHASTIC: tl.constexpr,
                      SEED_PTR: tl.constexpr, STEPS: tl.constexpr):
    """Tile route: program ``pid`` owns blocks ``[pid * BPP, (pid + 1) * BPP)``."""
    pid = tl.program_id(0).to(tl.int64)
    blocks = pid * BPP + tl.arange(0, BPP).to(tl.int64)
    cols = tl.arange(0, P2).to(tl.int64)
    bmask = blocks < num_blocks
    mask = bmask[:, None] & (cols < period)[None, :]
    offs = blocks[:, None] * period + cols[None, :]
    s_old = tl.load(s_ptr + blocks, mask=bmask, other=0.0)
    g, m = _momentum(g_ptr, q_ptr, cb_ptr, offs, mask, s_old[:, None], b, omb, MAXIMIZE)
    s_new = tl_nan_max(tl.where(mask, tl.abs(m), 0.0), mask & (m != m), 1)
    _muon_write(q_ptr, u_ptr, cb_ptr, table_ptr, offs, mask, g, m, s_new[:, None], b, omb,
                _load_seed(seed_ptr, seed, SEED_PTR), NESTEROV, STOCHASTIC, STEPS)
    tl.store(s_ptr + blocks, s_new, mask=bmask)


@jit(do_not_specialize=["seed"])
def _muon_loop_kernel(g_ptr, q_ptr, s_ptr, cb_ptr, table_ptr, seed_ptr, u_ptr, period, b, omb,  # type: ignore[no-untyped-def]
                      seed, TILE: tl.constexpr, NESTEROV: tl.constexpr,
                      MAXIMIZE: tl.constexpr, STOCHASTIC: tl.constexpr,
                      SEED_PTR: tl.constexpr, STEPS: tl.constexpr):
    """Loop route: program ``pid`` owns block ``pid`` and sweeps it twice in ``TILE`` steps."""
    block = tl.program_id(0).to(tl.int64)
    base = block * period
    lanes = tl.arange(0, TILE).to(tl.int64)
    s_old = tl.load(s_ptr + block)
    s_new, _ = _sweep_block(g_ptr, q_ptr, cb_ptr, base, lanes, period, s_old, b, omb, MAXIMIZE,
                            TILE)
    tl.store(s_ptr + block, s_new)  # s_old is in registers already
    # Every thread continues with the stored scale (see _stored_block_scalars).
    s_new, _ = _stored_block_scalars(s_ptr + block, s_ptr, 0.0, 1.0, 1.0, True)
    seed_u = _load_seed(seed_ptr, seed, SEED_PTR)
    start = period * 0
    while start < period:
        mask = start + lanes < period
        offs = base + start + lanes
        g, m = _momentum(g_ptr, q_ptr, cb_ptr, offs, mask, s_old, b, omb, MAXIMIZE)
        _muon_write(q_ptr, u_ptr, cb_ptr, table_ptr, offs, mask, g, m, s_new, b, omb, seed_u,
                    NESTEROV, STOCHASTIC, STEPS)
        start += TILE


@jit(do_not_specialize=["seed"])
def _muon_apply_kernel(g_ptr, q_ptr, s_ptr, s_new_ptr, cb_ptr, table_ptr, seed_ptr, u_ptr,  # type: ignore[no-untyped-def]
                       period, num_splits, b, omb, seed, SPLIT: tl.constexpr,
                       TILE: tl.constexpr, NESTEROV: tl.constexpr, MAXIMIZE: tl.constexpr,
                       STOCHASTIC: tl.constexpr, SEED_PTR: tl.constexpr, STEPS: tl.constexpr):
    """Split route, phase 2: recompute m with the old scale, quantise with the new one, write."""
    pid = tl.program_id(0).to(tl.int64)
    block = pid // num_splits
    split = pid % num_splits
    lanes = tl.arange(0, TILE).to(tl.int64)
    s_old = tl.load(s_ptr + block)
    s_new = tl.load(s_new_ptr + block)
    seed_u = _load_seed(seed_ptr, seed, SEED_PTR)
    lo = split * SPLIT
    for start in range(0, SPLIT, TILE):
        pos = lo + start + lanes
        mask = pos < period
        offs = block * period + pos
        g, m = _momentum(g_ptr, q_ptr, cb_ptr, offs, mask, s_old, b, omb, MAXIMIZE)
        _muon_write(q_ptr, u_ptr, cb_ptr, table_ptr, offs, mask, g, m, s_new, b, omb, seed_u,
                    NESTEROV, STOCHASTIC, STEPS)


def launch_muon_momentum(
    grad: Tensor, codes: Tensor, scale: Tensor, codebook: Tensor, out: Tensor, *,
    beta: float, nesterov: bool, maximize: bool, stochastic_round: bool, seed: int,
    seed_tensor: Tensor | None, route: str | None = None,
    split_elements: int = SPLIT_ELEMENTS, loop_tile: int | None = None, use_table: bool = True,
) -> None:
    """Launch the Muon momentum kernels; arguments already validated by the caller.

    ``grad`` and ``out``: contiguous, ``N`` elements, the same dtype (fp32/bf16/fp16);
    ``codes`` uint8 ``[B, P]`` and ``scale`` fp32 ``[B, 1]`` are updated in place. ``route``,
    ``split_elements``, ``loop_tile`` and ``use_table`` exist for tests (results never depend
    on them; ``loop_tile=None``: ``LOOP_TILE``, wider in the interpreter, as the tile route's
    ``program_elements``). No host synchronisation once the codebook's search table is cached.
    """
    require_triton("the Triton Muon momentum")
    check_device_for_triton(grad)
    num_blocks, period = codes.shape
    if num_blocks * period == 0:
        return
    b = f32(beta)
    omb = f32(1.0 - b)
    table, steps = (kernel_table(codebook, stochastic=bool(stochastic_round)) if use_table
                    else (codebook, 0))
    seed_ptr = seed_tensor if seed_tensor is not None else codebook
    flags = dict(NESTEROV=bool(nesterov), MAXIMIZE=bool(maximize),
                 STOCHASTIC=bool(stochastic_round), SEED_PTR=seed_tensor is not None,
                 STEPS=steps)
    flat_g, flat_u = grad.view(-1), out.view(-1)
    loop_tile = loop_tile or program_elements(LOOP_TILE)
    route = route or choose_route(num_blocks, period, grad.device)
    if route == "tile":
        p2 = _next_pow2(period)
        bpp = max(1, program_elements(TILE_ELEMENTS) // p2)
        _muon_tile_kernel[(triton.cdiv(num_blocks, bpp),)](
            flat_g, codes, scale, codebook, table, seed_ptr, flat_u, num_blocks, period, b, omb,
            to_signed64(seed), BPP=bpp, P2=p2, **flags,
            num_warps=8 if bpp * p2 >= 2048 else 4, **LAUNCH_OPTIONS)
    elif route == "loop":
        _muon_loop_kernel[(num_blocks,)](
            flat_g, codes, scale, codebook, table, seed_ptr, flat_u, period, b, omb,
            to_signed64(seed), TILE=loop_tile, **flags, num_warps=8, **LAUNCH_OPTIONS)
    elif route == "split":
        num_splits = triton.cdiv(period, split_elements)
        part_max = torch.empty(num_blocks, num_splits, dtype=torch.float32, device=grad.device)
        tile = min(loop_tile, split_elements)
        # The step's phase-1 kernel; FACTORED=True drops its sum of squares (not needed here).
        _step_partial_kernel[(num_blocks * num_splits,)](
            flat_g, codes, scale, codebook, part_max, part_max, period, num_splits, b, omb,
            SPLIT=split_elements, TILE=tile, FACTORED=True, MAXIMIZE=bool(maximize),
            OFFS64=needs_int64(num_blocks, period, split_elements=split_elements,
                               loop_tile=loop_tile), num_warps=8, **LAUNCH_OPTIONS)
        s_new = part_max.amax(dim=1)  # NaN-propagating, order-independent
        _muon_apply_kernel[(num_blocks * num_splits,)](
            flat_g, codes, scale, s_new, codebook, table, seed_ptr, flat_u, period, num_splits,
            b, omb, to_signed64(seed), SPLIT=split_elements, TILE=tile, **flags, num_warps=8,
            **LAUNCH_OPTIONS)
        scale.view(-1).copy_(s_new)
    else:
        raise ValueError(f"unknown route {route!r}; expected 'tile', 'loop' or 'split'")
