"""Cached launches of the fused Gefen step, for an optimizer that steps the same tensors every
step (docs/algorithm.md#block-second-moment, docs/algorithm.md#factored-second-moment).

The public ops (``block_step``, ``factored_step``) validate every argument and go through the
``torch.ops.gefen`` dispatcher on every call: right for a library entry point and for
``torch.compile``, but in an eager optimizer step over ~150 tensors that Python overhead
(argument checks twice, custom-op dispatch, route and grid choice, search-table lookup, scalar
rounding) dominated the step on an H200 (~350 µs of host time per tensor, first GPU run).

A :class:`StepPlan` does the checks and the launch decisions once per (parameter, state)
and keeps them: each step then costs one kernel launch per block-mode tensor and three per
factored tensor (statistics, finalize, update; four where the update is a quantising tile and
a flat update, :func:`._step_kernels.flat_update`), plus one scratch allocation for the
factored partials. The launches are exactly those of :func:`block_step_triton` /
:func:`factored_step_triton`, so results are bit-identical to theirs. A plan holds only weak
references to its tensors; :meth:`StepPlan.matches` says whether it still describes them (a
reloaded checkpoint or a re-mapped codebook gives new tensors, hence a new plan).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor

from .._numerics import f32, to_signed64
from .._triton import require_triton
from ._decision_table import kernel_table
from ._device import check_device_for_triton
from ._step_kernels import (
    LOOP_TILE,
    _step_loop_kernel,
    _step_tile_kernel,
    blocks_in_rows,
    choose_route,
    flat_update,
    launch_flat_update,
    launch_step,
    ncols_divider,
    needs_int64,
    tile_shape,
    tile_warps,
)
from ._triton_helpers import LAUNCH_OPTIONS

__all__ = ["StepPlan"]

_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class StepPlan:
    """The launch of one parameter's fused step, decided once.

    Args:
        param: contiguous fp32/bf16/fp16 parameter (``[R, C]`` in factored mode).
        codes, scale: ``exp_avg_codes`` uint8 ``[B, P]``, ``exp_avg_scale`` fp32 ``[B, 1]``.
        exp_avg_sq: fp32 ``[B, 1]`` (block mode) or ``None`` (factored mode, then
            ``row``/``col`` are fp32 ``[R]``/``[C]``).
        codebook: fp32 ``[256]`` on the parameter's device.
        beta1, beta2, eps, maximize, stochastic_round: fixed for the plan's lifetime.
        capturable: the scalars come from a device ``hyper`` tensor and the seed from a device
            ``seed_tensor`` at each launch.

    Raises:
        TypeError, ValueError: the arguments fail the checks of ``block_step`` /
            ``factored_step`` (made once, here).
    """

    def __init__(self, param: Tensor, codes: Tensor, scale: Tensor, exp_avg_sq: Tensor | None,
                 row: Tensor | None, col: Tensor | None, codebook: Tensor, *, beta1: float,
                 beta2: float, eps: float, maximize: bool, stochastic_round: bool,
                 capturable: bool) -> None:
        require_triton("the Triton Gefen step")
        check_device_for_triton(param)
        self.factored = exp_avg_sq is None
        if self.factored:
            from .factored_step import _check as check_factored

            assert row is not None and col is not None
            check_factored(param, param, codes, scale, row, col, codebook, beta1, beta2, eps, 0,
                           None, None, allow_fp64=False)
        else:
            from .block_step import _check as check_block

            assert exp_avg_sq is not None
            check_block(param, param, codes, scale, exp_avg_sq, codebook, beta1, beta2, eps, 0,
                        None, None, allow_fp64=False)
        self._refs = tuple(weakref.ref(t) if t is not None else None
                           for t in (param, codes, scale, exp_avg_sq, row, col, codebook))
        self._codebook_version = codebook._version
        self.beta1, self.beta2, self.eps = beta1, beta2, eps
        self.maximize, self.stochastic_round = bool(maximize), bool(stochastic_round)
        self.capturable = capturable
        self.shape = tuple(param.shape)
        self.dtype = param.dtype
        self.device = param.device
        num_blocks, period = (int(codes.shape[0]), int(codes.shape[1]))
        self.numel = num_blocks * period
        self.route = choose_route(num_blocks, period, param.device)
        self.ncols = int(param.shape[1]) if self.factored else 1
        self._stats_layout = None
        if self.factored:
            from ._factored_step_kernels import stats_layout

            self._stats_layout = stats_layout(int(param.shape[0]), self.ncols)
        b1, b2 = f32(beta1), f32(beta2)
        self._floats = (b1, f32(1.0 - b1), b2, f32(1.0 - b2), f32(eps))
        table, steps = kernel_table(codebook, stochastic=self.stochastic_round)
        self._table = table
        consts: dict[str, Any] = dict(
            FACTORED=self.factored, MAXIMIZE=self.maximize, STOCHASTIC=self.stochastic_round,
            HYPER=capturable, SEED_PTR=capturable, STEPS=steps,
            OFFS64=needs_int64(num_blocks, period))
        if self.route == "tile":
            p2, bpp, tail = tile_shape(period, self.factored)
            self._kernel = _step_tile_kernel
            self._grid: tuple[int, ...] | None = (-(-num_blocks // bpp),)
            consts.update(BPP=bpp, P2=p2, TAIL=tail, num_warps=tile_warps(bpp * p2),
                          IN_ROW=blocks_in_rows(self.factored, period, self.ncols),
                          FLAT_UPDATE=flat_update(self.factored, period, self.ncols,
                                                  consts["OFFS64"]))
        elif self.route == "loop":
            self._kernel = _step_loop_kernel
            self._grid = (num_blocks,)
            consts.update(TILE=LOOP_TILE, num_warps=8)
        else:  # split: two phases and torch glue; the generic launcher handles it
            self._grid = None
        consts.update(LAUNCH_OPTIONS)
        self._consts = consts
        # A plan built for by-value scalars reads them from the device when given ``hyper``
        # (StepGroups' graph-captured launches): the same bits, another compiled variant.
        self._device_consts = {**consts, "HYPER": True, "SEED_PTR": True}
        self._ints = (num_blocks, period, self.ncols, *ncols_divider(self.ncols))

    def tensors(self) -> tuple[Tensor | None, ...]:
        """``(param, codes, scale, exp_avg_sq, row, col, codebook)`` as planned; ``None`` for
        one the plan was built without or that has been freed (the plan holds weak
        references). :mod:`.step_groups` also reads the launch decisions (``_consts``,
        ``_ints``, ``_floats``, ``_stats_layout``, ``_table``)."""
        return tuple(ref() if ref is not None else None for ref in self._refs)

    def matches(self, param: Tensor, codes: Tensor, scale: Tensor, exp_avg_sq: Tensor | None,
                row: Tensor | None, col: Tensor | None, codebook: Tensor) -> bool:
        """Whether this plan was built for exactly these tensors (identity, not value) and the
        codebook has not been modified since."""
        for ref, t in zip(self._refs, (param, codes, scale, exp_avg_sq, row, col, codebook)):
            if (ref() if ref is not None else None) is not t:
                return False
        return codebook._version == self._codebook_version

    def launch(self, grad: Tensor, *, lr: float, bc1_recip: float, bc2: float, decay: float,
               seed: int, hyper: Tensor | None = None, seed_tensor: Tensor | None = None) -> None:
        """One step of the planned tensor with gradient ``grad`` (in place, as the ops).

        ``lr``, ``bc1_recip``, ``bc2`` (``bc2_rsqrt`` in block mode, ``bc2_recip`` in factored
        mode) and ``decay`` must already be rounded to fp32 (:func:`gefen_kernels._numerics.f32`)
        — the caller computes them once per step for every tensor that shares a step count.
        With ``capturable`` they are ignored and ``hyper`` (fp32 ``[4]``) and ``seed_tensor``
        (int64 ``[1]``) are read on the device; a plan built without ``capturable`` does the
        same when given both (a launch inside a CUDA-graph capture).

        Raises:
            ValueError, TypeError: ``grad`` has another shape or device, or is not contiguous.
        """
        if (tuple(grad.shape) != self.shape or grad.device != self.device
                or not grad.is_contiguous()):
            raise ValueError(f"grad must be contiguous with shape {list(self.shape)} on "
                             f"{self.device}, got {list(grad.shape)} on {grad.device}")
        if grad.dtype not in _GRAD_DTYPES:
            grad = grad.to(torch.float32)
        if self.numel == 0:
            return
        tensors = self._live_tensors(hyper, seed_tensor)  # before anything is mutated
        inv_rbar = None
        if self.factored:
            from .factored_step import factored_stats_triton

            row, col = tensors[4:6]
            assert row is not None and col is not None
            inv_rbar = factored_stats_triton(grad, row, col, beta2=self.beta2,
                                             layout=self._stats_layout)
        self._update(tensors, grad, inv_rbar, lr, bc1_recip, bc2, decay, seed, hyper,
                     seed_tensor)

    def launch_update(self, grad: Tensor, inv_rbar: Tensor | None, *, lr: float,
                      bc1_recip: float, bc2: float, decay: float, seed: int,
                      hyper: Tensor | None = None, seed_tensor: Tensor | None = None) -> None:
        """The update of :meth:`launch` without the factored statistics: ``inv_rbar`` (fp32
        ``[1]``, ``1/rbar``) comes from statistics already run on ``grad`` (which updated
        ``r``/``k``), e.g. by :class:`.step_groups.StepGroups`; ``None`` in block mode. ``grad``
        must be one :meth:`launch` accepts, in an fp32/bf16/fp16 dtype (not checked here)."""
        if self.numel == 0:
            return
        assert (inv_rbar is not None) == self.factored
        self._update(self._live_tensors(hyper, seed_tensor), grad, inv_rbar, lr, bc1_recip,
                     bc2, decay, seed, hyper, seed_tensor)

    def _live_tensors(self, hyper: Tensor | None,
                      seed_tensor: Tensor | None) -> tuple[Tensor | None, ...]:
        """:meth:`tensors`, asserting that the planned ones are alive and, under
        ``capturable``, that the device scalars are given."""
        tensors = self.tensors()
        param, codes, scale, _, _, _, codebook = tensors
        assert param is not None and codes is not None and scale is not None
        assert codebook is not None
        if self.capturable:
            assert hyper is not None and seed_tensor is not None
        assert (hyper is None) == (seed_tensor is None)
        return tensors

    def _update(self, tensors: tuple[Tensor | None, ...], grad: Tensor,
                inv_rbar: Tensor | None, lr: float, bc1_recip: float, bc2: float, decay: float,
                seed: int, hyper: Tensor | None, seed_tensor: Tensor | None) -> None:
        param, codes, scale, exp_avg_sq, row, col, codebook = tensors
        assert param is not None and codes is not None and scale is not None
        assert codebook is not None
        if self._grid is None:
            launch_step(param, grad, codes, scale, exp_avg_sq=exp_avg_sq, row=row, col=col,
                        inv_rbar=inv_rbar, ncols=self.ncols, codebook=codebook, lr=lr,
                        beta1=self.beta1, beta2=self.beta2, eps=self.eps, bc1_recip=bc1_recip,
                        bc2=bc2, decay=decay, maximize=self.maximize,
                        stochastic_round=self.stochastic_round, seed=seed, hyper=hyper,
                        seed_tensor=seed_tensor)
            return
        dummy = codebook
        b1, omb1, b2, omb2, eps = self._floats
        num_blocks, period, ncols, magic, shift = self._ints
        self._kernel[self._grid](
            param, grad, codes, scale, exp_avg_sq if exp_avg_sq is not None else dummy,
            row if row is not None else dummy, col if col is not None else dummy,
            inv_rbar if inv_rbar is not None else dummy, codebook, self._table,
            hyper if hyper is not None else dummy,
            seed_tensor if seed_tensor is not None else dummy, num_blocks, period, ncols, magic,
            shift, b1, omb1, b2, omb2, eps, lr, bc2, bc1_recip, decay, to_signed64(seed),
            **(self._consts if hyper is None or self.capturable else self._device_consts))
        if self._consts.get("FLAT_UPDATE"):
            assert row is not None and col is not None and inv_rbar is not None
            launch_flat_update(param, codes, scale, row, col, inv_rbar, codebook, hyper,
                               ncols=ncols, eps=eps, lr=lr, bc2=bc2, bc1=bc1_recip, decay=decay)
