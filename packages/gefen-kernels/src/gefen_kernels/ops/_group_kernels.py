"""Triton kernels that run the fused step of many tensors in one launch
(docs/algorithm.md#block-second-moment).

Every program looks up its tensor in an int64 *meta table* (one row per tensor, columns in
:data:`META`) through an int32 *program map* (program -> row), then runs exactly the per-program
work of the one-tensor kernels (:func:`._step_kernels._tile_blocks`,
:func:`._step_kernels._flat_update`, :func:`._factored_step_kernels._stats_program`,
:func:`._factored_step_kernels._finalize_program`) with the tensor's own sizes.

**Same compiled layout, same bits.** The order of a block or row sum inside a program follows
the register layout Triton picks, and that follows what the compiler knows about the
alignment of pointers and integers. A one-tensor launch tells it through Triton's launch-time
specialisation (an int equal to 1 becomes the constant 1; an int or pointer divisible by 16
gets a divisibility hint); values loaded from a table tell it nothing, and hints on loaded
values did not survive Triton 3.6's compiler (an H200 run gave a 4x slower, unvectorised tile
kernel and different sums). So the tables carry every such value in a form whose divisibility
the compiler derives itself, decided per class of tensors by constexprs (``SPEC_*`` of
:func:`_spec`):

* pointers: ``base + off16 * V`` with ``base`` a 16-byte-aligned kernel argument of the right
  element type, ``off16`` the distance in 16-byte units and ``V`` elements per 16 bytes (only
  tensors whose pointers are all 16-byte aligned are grouped);
* ints: stored divided by 16 and multiplied back (``SPEC 16``), replaced by the constant 1
  (``SPEC 1``) or stored as is (``SPEC 0``), as the one-tensor launch would see them;
* statistics scratch: each tensor's partials laid out as in the one-tensor launch (row
  partials at an aligned start, column partials and block sums after them), with the offsets
  whose alignment the one-tensor launch would know stored divided by 4.

Gradients are not in the meta table: their offsets from the class's base gradient come from a
per-step device vector (``gptr_ptr``, indexed by the tensor's column ``t``), next to the
per-tensor scalars (``hyper_ptr``, fp32 ``[T, 4]``: lr, bc2, bc1_recip, decay) and seeds
(``seed_ptr``, int64 ``[T]``).
"""

from __future__ import annotations

from .._triton import jit, tl
from ._factored_step_kernels import _finalize_program, _stats_program
from ._step_kernels import _flat_update, _tile_blocks
from ._triton_helpers import _low_float

# Columns of the meta table (int64). Block-mode rows leave the factored columns 0.
META = (
    "param", "codes", "scale", "exp_avg_sq",  # 16-byte offsets from the class bases
    "exp_avg_sq_col", "t", "num_blocks", "period", "ncols", "ncols_magic", "ncols_shift",
    "tile_first",  # first program of this tensor in the tile launch
    "nrows", "n_col_tiles", "n_splits", "tiles_per_split", "rows_per_program",
    "n_row_programs",  # the statistics layout (_factored_step_kernels.stats_layout)
    "region",  # start of the tensor's scratch, in units of 4 floats
    "col_part", "block_sum", "inv_rbar",  # float offsets inside the region
    "ticket",  # index into ticket_ptr
    "stats_first", "finalize_first",  # first programs in the statistics / finalize launches
    "inv_c", "inv_r",  # fp32 bits of f32(1/C), f32(1/R)
    # work items per statistics program (_factored_step_kernels.stats_items_per_program)
    "stats_items",
    # The flat update (FLAT_UPDATE classes): its first program, elements / 16, and the
    # period's divider (_step_kernels.ncols_divider).
    "update_first", "numel16", "period_magic", "period_shift",
)
META_COLS = len(META)
# The kernels index the table with literals (a jit function cannot read a Python dict).
assert META_COLS == 32 and META.index("t") == 5 and META.index("tile_first") == 11
assert META.index("nrows") == 12 and META.index("region") == 18
assert META.index("stats_first") == 23 and META.index("inv_r") == 26
assert META.index("stats_items") == 27 and META.index("update_first") == 28
assert META.index("period_shift") == 31


@jit
def _meta_row(meta_ptr, prog_ptr, pid):  # type: ignore[no-untyped-def]
    return meta_ptr + tl.load(prog_ptr + pid).to(tl.int64) * 32


@jit
def _i32(x):  # type: ignore[no-untyped-def]
    return x.to(tl.int32)


@jit
def _spec(x, SPEC: tl.constexpr):  # type: ignore[no-untyped-def]
    """An int32 as a one-tensor launch presents it after specialisation: ``SPEC == 1`` the
    constant 1; ``SPEC == 16`` stored divided by 16 and multiplied back here, so the compiler
    knows 16 divides it; otherwise as stored."""
    if SPEC == 1:
        return 1
    elif SPEC == 16:
        return x.to(tl.int32) * 16
    else:
        return x.to(tl.int32)


@jit
def _times4(x, ALIGNED: tl.constexpr):  # type: ignore[no-untyped-def]
    """A float offset stored divided by 4 when ``ALIGNED`` (16 bytes), else as is."""
    if ALIGNED:
        return x * 4
    else:
        return x


@jit
def _region(scratch_ptr, row):  # type: ignore[no-untyped-def]
    return scratch_ptr + tl.load(row + 18) * 4


@jit
def _group_tile_kernel(meta_ptr, prog_ptr, gptr_ptr, p_base, g_base, q_base, f_base,  # type: ignore[no-untyped-def]
                       scratch_ptr, cb_ptr, table_ptr, hyper_ptr, seed_ptr, b1, omb1, b2, omb2,
                       eps, P_VEC: tl.constexpr, G_VEC: tl.constexpr, BPP: tl.constexpr,
                       P2: tl.constexpr, FACTORED: tl.constexpr, MAXIMIZE: tl.constexpr,
                       STOCHASTIC: tl.constexpr, STEPS: tl.constexpr, OFFS64: tl.constexpr,
                       IN_ROW: tl.constexpr, SPEC_PERIOD: tl.constexpr,
                       SPEC_NCOLS: tl.constexpr, TAIL: tl.constexpr,
                       FLAT_UPDATE: tl.constexpr):
    """Tile route over the tensors of one class: program ``pid`` runs ``_tile_blocks`` for
    its tensor's program ``pid - tile_first``. ``P_VEC``/``G_VEC``: parameter/gradient
    elements per 16 bytes; ``f_base``: the class's fp32 base (scales, statistics)."""
    pid = tl.program_id(0)
    row = _meta_row(meta_ptr, prog_ptr, pid)
    t = tl.load(row + 5)
    p_ptr = p_base + tl.load(row + 0) * P_VEC
    g_ptr = g_base + tl.load(gptr_ptr + t) * G_VEC
    q_ptr = q_base + tl.load(row + 1) * 16
    s_ptr = f_base + tl.load(row + 2) * 4
    v_ptr = f_base + tl.load(row + 3) * 4  # exp_avg_sq, or exp_avg_sq_row when FACTORED
    col_ptr = f_base + tl.load(row + 4) * 4
    inv_rbar_ptr = _region(scratch_ptr, row) + tl.load(row + 21)
    num_blocks = tl.load(row + 6)
    period = _spec(tl.load(row + 7), SPEC_PERIOD)
    ncols = _spec(tl.load(row + 8), SPEC_NCOLS)
    local = pid.to(tl.int64) - tl.load(row + 11)
    if not OFFS64:
        num_blocks = _i32(num_blocks)
        local = _i32(local)
    lr = tl.load(hyper_ptr + t * 4 + 0)
    bc2 = tl.load(hyper_ptr + t * 4 + 1)
    bc1 = tl.load(hyper_ptr + t * 4 + 2)
    decay = tl.load(hyper_ptr + t * 4 + 3)
    seed_u = tl.load(seed_ptr + t).to(tl.uint64, bitcast=True)
    _tile_blocks(local, p_ptr, g_ptr, q_ptr, s_ptr, v_ptr, v_ptr, col_ptr, inv_rbar_ptr, cb_ptr,
                 table_ptr, num_blocks, period, ncols, _i32(tl.load(row + 9)),
                 _i32(tl.load(row + 10)), b1, omb1, b2, omb2, eps, lr, bc2, bc1, decay, seed_u,
                 BPP, P2, FACTORED, MAXIMIZE, STOCHASTIC, STEPS, OFFS64, IN_ROW, TAIL,
                 FLAT_UPDATE)


@jit
def _group_update_kernel(meta_ptr, prog_ptr, p_base, q_base, f_base, scratch_ptr, cb_ptr,  # type: ignore[no-untyped-def]
                         hyper_ptr, eps, P_VEC: tl.constexpr, SPEC_PERIOD: tl.constexpr,
                         SPEC_NCOLS: tl.constexpr, CHUNKS: tl.constexpr):
    """The flat update over the tensors of one ``FLAT_UPDATE`` class, after its tile launch:
    program ``pid`` runs :func:`._step_kernels._flat_update` for its tensor's program
    ``pid - update_first``."""
    pid = tl.program_id(0)
    row = _meta_row(meta_ptr, prog_ptr, pid)
    t = tl.load(row + 5)
    _flat_update(_i32(pid - tl.load(row + 28)), p_base + tl.load(row + 0) * P_VEC,
                 q_base + tl.load(row + 1) * 16, f_base + tl.load(row + 2) * 4,
                 f_base + tl.load(row + 3) * 4, f_base + tl.load(row + 4) * 4,
                 _region(scratch_ptr, row) + tl.load(row + 21), cb_ptr, _i32(tl.load(row + 29)),
                 _spec(tl.load(row + 7), SPEC_PERIOD), _i32(tl.load(row + 30)),
                 _i32(tl.load(row + 31)), _spec(tl.load(row + 8), SPEC_NCOLS),
                 _i32(tl.load(row + 9)), _i32(tl.load(row + 10)), tl.load(hyper_ptr + t * 4 + 1),
                 tl.load(hyper_ptr + t * 4 + 2), eps, tl.load(hyper_ptr + t * 4 + 0),
                 tl.load(hyper_ptr + t * 4 + 3), CHUNKS)


@jit
def _group_stats_kernel(meta_ptr, prog_ptr, gptr_ptr, g_base, scratch_ptr, ticket_ptr,  # type: ignore[no-untyped-def]
                        G_VEC: tl.constexpr, RB: tl.constexpr, CB: tl.constexpr,
                        SPEC_NROWS: tl.constexpr, SPEC_NCOLS: tl.constexpr,
                        SPEC_TILES: tl.constexpr, SPEC_SPLITS: tl.constexpr,
                        SPEC_TPS: tl.constexpr, SPEC_RPP: tl.constexpr,
                        COL_PART_ALIGNED: tl.constexpr, PREFETCH: tl.constexpr):
    """The statistics kernel over the factored gradients of one class: program ``pid`` runs
    :func:`._factored_step_kernels._stats_program` of its tensor (``stats_items`` work items
    each, the tensor's program count ``cdiv(n_row_programs * n_splits, stats_items)``). The
    item count is passed unspecialised: it only steers the loop, never a layout."""
    pid = tl.program_id(0)
    row = _meta_row(meta_ptr, prog_ptr, pid)
    g_ptr = g_base + tl.load(gptr_ptr + tl.load(row + 5)) * G_VEC
    row_part = _region(scratch_ptr, row)
    _stats_program(_i32(pid - tl.load(row + 23)), g_ptr, row_part,
                   row_part + _times4(tl.load(row + 19), COL_PART_ALIGNED),
                   ticket_ptr + tl.load(row + 22), _spec(tl.load(row + 12), SPEC_NROWS),
                   _spec(tl.load(row + 8), SPEC_NCOLS), _spec(tl.load(row + 13), SPEC_TILES),
                   _spec(tl.load(row + 14), SPEC_SPLITS), _spec(tl.load(row + 15), SPEC_TPS),
                   _spec(tl.load(row + 16), SPEC_RPP), _i32(tl.load(row + 27)), RB, CB,
                   PREFETCH)


@jit
def _group_finalize_kernel(meta_ptr, prog_ptr, f_base, scratch_ptr, ticket_ptr, b2, omb2,  # type: ignore[no-untyped-def]
                           FR: tl.constexpr, SR: tl.constexpr, FC: tl.constexpr,
                           SP: tl.constexpr, FT: tl.constexpr, SPEC_NROWS: tl.constexpr,
                           SPEC_NCOLS: tl.constexpr, SPEC_SPLITS: tl.constexpr,
                           SPEC_NRP: tl.constexpr, COL_PART_ALIGNED: tl.constexpr,
                           BLOCK_SUM_ALIGNED: tl.constexpr):
    """The finalize kernel (PHASE 0: r/k EMA in place, ``1/rbar`` into scratch) over the
    factored tensors of one class."""
    pid = tl.program_id(0)
    row = _meta_row(meta_ptr, prog_ptr, pid)
    r_ptr = f_base + tl.load(row + 3) * 4
    k_ptr = f_base + tl.load(row + 4) * 4
    row_part = _region(scratch_ptr, row)
    inv_rbar_ptr = row_part + tl.load(row + 21)
    nrows = _spec(tl.load(row + 12), SPEC_NROWS)
    # col_sum_ptr and total_ptr are not read in PHASE 0.
    _finalize_program(_i32(pid - tl.load(row + 24)), row_part,
                      row_part + _times4(tl.load(row + 19), COL_PART_ALIGNED), r_ptr, r_ptr,
                      k_ptr, inv_rbar_ptr, inv_rbar_ptr, inv_rbar_ptr,
                      row_part + _times4(tl.load(row + 20), BLOCK_SUM_ALIGNED),
                      ticket_ptr + tl.load(row + 22), nrows, _spec(tl.load(row + 8), SPEC_NCOLS),
                      _spec(tl.load(row + 14), SPEC_SPLITS), _spec(tl.load(row + 17), SPEC_NRP),
                      nrows, _low_float(tl.load(row + 25)), _low_float(tl.load(row + 26)), b2,
                      omb2, 0, FR, SR, FC, SP, FT)
