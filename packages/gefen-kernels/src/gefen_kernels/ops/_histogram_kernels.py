"""Triton kernels of :mod:`.histogram` (docs/algorithm.md#histogram): each element's bin index,
counted by the launcher with ``torch.histc``. The launchers, the reference and the custom op are in
:mod:`.histogram`."""

from __future__ import annotations

from .._triton import jit, tl

# --------------------------------------------------------------------------------------------
# Triton kernels: each element's bin index (tile route: whole blocks per program; split route:
# long blocks), counted by torch.histc
# --------------------------------------------------------------------------------------------
# Why not tl.histogram: with 4096 bins its lowering costs about 56 warp instructions per
# element (a ballot per index bit, then every lane walks its 128 bins), which made the
# histogram most of the first step's GPU time (H200, Llama-3.2-1B shapes: 172 ms).
# torch.histc counts in shared memory with atomics. Its input is the bin index as an fp32
# integer (-1 for a dropped element, outside its range; 4096 for the zero bin), binned over
# [0, 4097) into 4097 bins, so bin b holds exactly the elements of index b. Its counts are
# fp32, exact because a chunk has at most 2**24 elements, and order-independent. Unlike
# torch.bincount it takes no host sync: bincount reads its input's min and max to the host to
# size its output, twice per chunk, 98 syncs on the Llama-3.2-1B shapes. CUDA flags histc as
# nondeterministic (it cannot know its float counts are integers), so under
# torch.use_deterministic_algorithms the counts come from bincount instead; the same counts.



@jit
def _bin_index(g, amax, valid, NUM_BINS: tl.constexpr):  # type: ignore[no-untyped-def]
    """Bin of fp32 ``g`` normalised by ``amax`` (broadcastable), as an fp32 integer; the zero
    bin ``NUM_BINS`` where the normalised value is exactly 0; ``-1`` (dropped) where not
    ``valid``."""
    positive = amax > 0
    z = tl.where(positive, tl.math.div_rn(g, tl.where(positive, amax, 1.0)), 0.0)
    idx = tl.floor((z + 1.0) * (NUM_BINS // 2))
    idx = tl.minimum(tl.maximum(idx, 0.0), NUM_BINS - 1.0)
    idx = tl.where(z == 0.0, NUM_BINS * 1.0, idx)
    return tl.where(valid, idx, -1.0)


@jit
def _finite(x):
    return (x == x) & (tl.abs(x) != float("inf"))


@jit
def _not_finite(x):
    # Spelled out rather than ~_finite(x): Triton 3.3's interpreter cannot invert booleans.
    return (x != x) | (tl.abs(x) == float("inf"))


@jit
def _histogram_tile_kernel(g_ptr, idx_ptr, num_blocks, period, BPP: tl.constexpr,  # type: ignore[no-untyped-def]
                           P2: tl.constexpr, NUM_BINS: tl.constexpr):
    """Tile route: ``BPP`` whole blocks (``[BPP, P2]``, ``P2`` = next pow2 >= period) per
    program; g_ptr fp32/bf16/fp16 ``[N]``; idx_ptr fp32 ``[N]``, each element's bin."""
    pid = tl.program_id(0).to(tl.int64)
    blocks = pid * BPP + tl.arange(0, BPP).to(tl.int64)
    cols = tl.arange(0, P2).to(tl.int64)
    mask = (blocks < num_blocks)[:, None] & (cols < period)[None, :]
    offs = blocks[:, None] * period + cols[None, :]
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(g), axis=1)
    bad = tl.max((mask & _not_finite(g)).to(tl.int32), axis=1)
    tl.store(idx_ptr + offs, _bin_index(g, amax[:, None], (bad == 0)[:, None], NUM_BINS),
             mask=mask)


@jit
def _histogram_partial_max_kernel(g_ptr, part_ptr, period, num_splits, SPLIT: tl.constexpr,  # type: ignore[no-untyped-def]
                                  TILE: tl.constexpr):
    """Split route, phase 1: max |g| of one slice of a block (Inf if a NaN/Inf is seen)."""
    pid = tl.program_id(0).to(tl.int64)
    block = pid // num_splits
    split = pid % num_splits
    lanes = tl.arange(0, TILE).to(tl.int64)
    acc = tl.zeros([TILE], dtype=tl.float32)
    for start in range(0, SPLIT, TILE):
        pos = split * SPLIT + start + lanes
        mask = pos < period
        g = tl.load(g_ptr + block * period + pos, mask=mask, other=0.0).to(tl.float32)
        a = tl.where(_finite(g), tl.abs(g), float("inf"))
        acc = tl.maximum(acc, a)
    tl.store(part_ptr + block * num_splits + split, tl.max(acc, axis=0))


@jit
def _histogram_split_kernel(g_ptr, amax_ptr, idx_ptr, period, num_splits,  # type: ignore[no-untyped-def]
                            SPLIT: tl.constexpr, TILE: tl.constexpr, NUM_BINS: tl.constexpr):
    """Split route, phase 2: the bins of one slice of a block with the block's max (the
    overflow bin for a block whose max is not finite)."""
    pid = tl.program_id(0).to(tl.int64)
    block = pid // num_splits
    split = pid % num_splits
    lanes = tl.arange(0, TILE).to(tl.int64)
    amax = tl.load(amax_ptr + block)
    for start in range(0, SPLIT, TILE):
        pos = split * SPLIT + start + lanes
        mask = pos < period
        offs = block * period + pos
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(idx_ptr + offs, _bin_index(g, amax, amax != float("inf"), NUM_BINS),
                 mask=mask)
