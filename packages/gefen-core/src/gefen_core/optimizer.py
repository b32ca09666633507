"""The :class:`Gefen` optimizer class: validation, groups, state, step orchestration
(docs/algorithm.md#step).

The per-tensor math is in ``gefen_kernels`` (reached through :mod:`gefen_core.functional`),
the codebook solver in :mod:`gefen_core.codebook`, the period search in
:mod:`gefen_core.period` and the checkpoint format in :mod:`gefen_core.checkpoint`.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from . import _compiled_step, _docs, _params, _seeds, _steady_step
from . import amp as _amp
from . import dispatch as _dispatch
from . import nonfinite as _nonfinite
from ._seeds import mix_seed, name_salt
from .codebook import remap_codes
from .functional import gefen as _gefen_functional

__all__ = ["Gefen"]


class Gefen(Optimizer):
    r"""AdamW with about one byte of optimizer state per parameter (Gefen, arXiv:2606.13894).

    The first moment is stored as uint8 codes into one learned 256-entry codebook shared by
    all tensors, times one fp32 scale per block of ``P`` consecutive elements; the second
    moment is one fp32 value per block, or (matrices, docs/algorithm.md#factoring-rule)
    Adafactor row and column statistics. The codebook is the exact MSE-optimal quantizer
    (codewords -1, 0, +1 forced) of the histogram of block-normalised first-step gradients;
    each tensor's block period :math:`P` is found on its first step from the structure of
    :math:`g^2`. Math: docs/algorithm.md#step, #zero-codeword.

    .. math::
       \begin{aligned}
            &\textbf{input}: \gamma \text{ (lr)}, \beta_1, \beta_2, \theta_0, \epsilon,
                \lambda \text{ (weight decay)}, \textit{maximize}, c\in[-1,1]^{256}
                \text{ (codebook, learned at } t=1) \\
            &\textbf{initialize}: q_0 \leftarrow 0 \text{ (uint8)}, s_0 \leftarrow 0,
                v_0 \leftarrow 0 \text{ (per block } b \text{ of } P \text{ elements)} \\
            &\textbf{for} \: t=1 \: \textbf{to} \: \ldots \: \textbf{do} \\
            &\hspace{5mm} g_t \leftarrow \pm\nabla_\theta f_t(\theta_{t-1})
                \quad(- \text{ if } \textit{maximize}) \\
            &\hspace{5mm} v_{t,b} \leftarrow \beta_2 v_{t-1,b} + (1-\beta_2)\,
                \tfrac{1}{P}\textstyle\sum_{i\in b} g_{t,i}^2
                \quad\text{(factored: } V_{ij} = r_i k_j / \overline{r}\text{)} \\
            &\hspace{5mm} \theta_t \leftarrow \theta_{t-1} (1 - \gamma\lambda) \\
            &\hspace{5mm} \sigma_b \leftarrow \frac{1}{1-\beta_1^t}\Big/
                \Big(\sqrt{v_{t,b}/(1-\beta_2^t)} + \epsilon\Big) \\
            &\hspace{5mm} m_i \leftarrow \beta_1\, s_{t-1,b}\, c[q_{t-1,i}]
                + (1-\beta_1)\, g_{t,i} \\
            &\hspace{5mm} s_{t,b} \leftarrow \max_{i\in b} |m_i|, \quad
                q_{t,i} \leftarrow \mathrm{round}_c(m_i / s_{t,b}) \\
            &\hspace{5mm} \theta_{t,i} \leftarrow \theta_{t,i}
                - \gamma\, \sigma_b\, c[q_{t,i}]\, s_{t,b} \\
            &\textbf{return} \: \theta_t
       \end{aligned}

    :math:`\mathrm{round}_c` is the nearest codeword (ties to the lower index) or, with
    ``stochastic_round``, unbiased stochastic rounding seeded by the step and a per-tensor
    salt (docs/algorithm.md#toward-zero-rounding); where :math:`g_{t,i} = 0`, both round toward
    zero, so a stopped coordinate's update reaches 0 as AdamW's does
    (docs/algorithm.md#toward-zero-rounding). The update uses the *re-quantized* momentum. The
    canonical fp32 rounding sequence is that of docs/algorithm.md#block-second-moment,
    docs/algorithm.md#factored-second-moment.

    Args:
        params (iterable): tensors, ``(name, tensor)`` pairs (``model.named_parameters()``),
            a mix of both, or dicts defining parameter groups (which may override ``lr``,
            ``betas`` or ``beta1``/``beta2``, ``eps``, ``weight_decay``, the Gefen options, and
            carry a ``name`` and any extra keys). A single tensor is accepted too.
        lr (float or Tensor, optional): learning rate :math:`\gamma`, >= 0; a tensor must have
            one element and is read without a host sync when ``capturable`` (default: 1e-3)
        betas (tuple[float, float] or tuple[Tensor, Tensor], optional):
            :math:`(\beta_1, \beta_2)`, each in [0, 1): two numbers, or two 1-element
            tensors as AdamW takes them, read on the host once per in-place change
            (default: (0.9, 0.999))
        eps (float, optional): added to the bias-corrected :math:`\sqrt{v}`, finite and > 0
            (default: 1e-8)
        weight_decay (float, optional): decoupled weight decay :math:`\lambda` >= 0, applied
            as :math:`\theta \leftarrow \theta(1-\gamma\lambda)`; same default as
            ``torch.optim.AdamW`` (default: 1e-2)
        {maximize}
        {foreach}
        {capturable}
        {differentiable}
        {fused}
        factored_v_2d (bool, optional): factored (row/column) second moment for 2-D
            parameters, docs/algorithm.md#factored-second-moment (default: True)
        {min_dim_size_to_factor}
        stochastic_round (bool, optional): unbiased stochastic rounding of the momentum codes
            on every path, docs/algorithm.md#quantizer (default: False)
        deterministic (bool, optional): fixed-order reductions everywhere so identical inputs
            give bit-identical results on identical hardware, docs/algorithm.md#deterministic; saved
            in checkpoints and must match on load (default: False)
        period_search (str, optional): ``"log_contrast"`` (docs/algorithm.md#period-search, the
            paper) or ``"variance"`` (docs/algorithm.md#period-search), both followed by the
            memory-safe fallback (default: "log_contrast")
        force_1d_period_one (bool, optional): 1-D parameters get ``P = 1`` (default: False)
        force_2d_period_one (bool, optional): 2-D parameters get ``P = 1`` (default: False)
        period_one_substrings (tuple[str, ...], optional): parameters whose lower-cased name
            contains one of these (lower-cased) substrings get ``P = 1`` (default: ())
        codebook_refresh_every (int, optional): relearn the codebook every this many steps
            from the current gradients and re-map all codes, docs/algorithm.md#codebook; 0 = never,
            >= 0, optimizer-wide (default: 0)
        {skip_nonfinite}

    Dispatch:
        {dispatch}

    State:
        Per parameter (``B = N / P`` blocks of ``P`` elements, ``N`` = numel):

        * ``step`` — fp32 0-dim tensor, momentum age (CPU; parameter device if capturable);
        * ``period`` — int ``P``;
        * ``exp_avg_codes`` — uint8 ``[B, P]``, 1 byte/param;
        * ``exp_avg_scale`` — fp32 ``[B, 1]``, 4/P bytes/param;
        * ``exp_avg_sq`` — fp32 ``[B, 1]``, 4/P bytes/param (block mode), or
          ``exp_avg_sq_row`` fp32 ``[R]`` and ``exp_avg_sq_col`` fp32 ``[C]``,
          4(R+C)/N bytes/param (factored mode);
        * ``exp_avg_sq_step`` — fp32 0-dim tensor, age of the second moment.

        Block mode costs ``1 + 8/P`` bytes/param (``P = 1``: 9), factored mode about
        ``1 + 4/P``. Optimizer-wide: the fp32 ``[256]`` codebook and the step count ``T``.
        State is fp32 (codes uint8) whatever the parameter dtype.

    Raises:
        TypeError: a non-tensor parameter, a non-bool flag, a string ``period_one_substrings``.
        ValueError: invalid ``lr``/``betas``/``eps``/``weight_decay``/``period_search``/
            ``codebook_refresh_every``; complex or non-leaf parameters; a parameter listed
            twice; an empty parameter list; ``capturable`` with ``codebook_refresh_every > 0``
            or with ``skip_nonfinite``; a DTensor parameter sharded over ranks (FSDP2,
            tensor parallel), here or at ``step()`` if it became one later, naming the
            parameter: use ``gefen_dist.ShardedGefen`` (docs/algorithm.md#distributed).
        RuntimeError: ``differentiable=True``; ``amsgrad=True``; ``fused=True`` with
            ``foreach=True``; an explicit ``fused=True`` that some parameter cannot take
            (CPU, fp64, no Triton).

        Where ``torch.optim.AdamW`` refuses the same input, the exception type is AdamW's and
        the message starts with AdamW's text (``Invalid learning rate: -1.0 (...)``).

    Differences from torch.optim.AdamW (each with its reason in
    docs/internals/torch-optim-deviations.md): quantized state (no ``exp_avg``); ``amsgrad``,
    ``differentiable``, complex parameters, ``eps = 0``, non-finite hyperparameters and a
    parameter listed twice in a group are refused; a bare tensor, mixed named and unnamed
    parameters and tensor ``lr``/``betas`` with ``foreach=True`` are accepted; every tensor
    is named; checkpoints load all-or-nothing; a captured CUDA graph keeps tensor betas'
    values at capture.

    {nan_policy}

    References:
        Benedek, Koren, Fried, "Gefen: Optimized Stochastic Optimizer", 2026,
        https://arxiv.org/abs/2606.13894. Loshchilov & Hutter, "Decoupled Weight Decay
        Regularization", https://arxiv.org/abs/1711.05101. Shazeer & Stern, "Adafactor",
        https://arxiv.org/abs/1804.04235.
    """

    def __init__(
        self,
        params: Any,
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        factored_v_2d: bool = True,
        min_dim_size_to_factor: int = 128,
        stochastic_round: bool = False,
        deterministic: bool = False,
        period_search: str = "log_contrast",
        force_1d_period_one: bool = False,
        force_2d_period_one: bool = False,
        period_one_substrings: Iterable[str] = (),
        codebook_refresh_every: int = 0,
        skip_nonfinite: bool = False,
    ) -> None:
        where = "Gefen"
        if not isinstance(deterministic, bool):
            raise TypeError(f"{where}: deterministic must be a bool, got {deterministic!r}")
        _nonfinite.check_skip_option(skip_nonfinite, capturable, where)
        if (not isinstance(codebook_refresh_every, int) or isinstance(codebook_refresh_every, bool)
                or codebook_refresh_every < 0):
            raise ValueError(
                f"{where}: codebook_refresh_every must be an int >= 0 (0 = never), got "
                f"{codebook_refresh_every!r}"
            )
        if capturable and codebook_refresh_every > 0:
            raise ValueError(
                f"{where}: capturable=True cannot refresh the codebook (it re-maps every code on "
                "the host); use codebook_refresh_every=0 with capturable=True"
            )
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
            maximize=maximize,
            foreach=foreach, capturable=capturable, differentiable=differentiable, fused=fused,
            factored_v_2d=factored_v_2d, min_dim_size_to_factor=min_dim_size_to_factor,
            stochastic_round=stochastic_round, period_search=period_search,
            force_1d_period_one=force_1d_period_one, force_2d_period_one=force_2d_period_one,
            period_one_substrings=_params.normalize_substrings(period_one_substrings, where),
        )
        _params.check_group_options(defaults, where)
        defaults["betas"] = _params.check_betas(betas, where)
        if isinstance(lr, Tensor):
            defaults["lr"] = lr  # kept as the caller's tensor, like torch.optim

        self._deterministic = deterministic
        self._codebook_refresh_every = codebook_refresh_every
        self._skip_nonfinite = skip_nonfinite
        #: Steps that ``skip_nonfinite`` skipped since construction.
        self.skipped_steps = 0
        #: Whether the last ``step()`` was skipped by ``skip_nonfinite``.
        self.last_step_skipped = False
        self._global_step = 0
        self._codebook: Tensor | None = None
        self._init_runtime_caches()
        if isinstance(params, Tensor):
            params = [params]
        # Materialise once: generators must be consumed once, and an empty list is an error.
        params = list(params)
        if not params:
            raise ValueError(_params.torch_error("optimizer got an empty parameter list", where,
                                                 "pass at least one tensor"))
        # A plain list forms one implicit group whose unnamed tensors are `param_{j}`
        # (docs/algorithm.md#overview).
        self._building_implicit_group = not isinstance(params[0], dict)
        try:
            super().__init__(
                [{"params": params}] if self._building_implicit_group else params, defaults)
        finally:
            self._building_implicit_group = False

    # ------------------------------------------------------------------ groups and names
    def _init_runtime_caches(self) -> None:
        # Never serialised: rebuilt on demand (docs/algorithm.md#state-layout "scratch").
        self._codebook_cache: dict[torch.device, Tensor] = {}
        self._lr_cache: dict[int, tuple[weakref.ref[Tensor], int, float]] = {}
        self._device_global_step: dict[torch.device, Tensor] = {}
        # Capturable steps: each device's per-tensor salts as one int64 tensor, so a step
        # mixes every seed in one launch. An entry is never evicted, because a captured graph
        # reads it at every replay; the first _SALT_TABLES lists of stepped tensors get one.
        # (load_state_dict rebuilds these caches: a graph is recaptured after it, as the state
        # tensors it reads are replaced too.)
        self._salt_tensors: dict[tuple[torch.device, tuple[int, ...]], Tensor] = {}
        # The last full step's launches, repeated while nothing they depend on changes.
        self._steady: _steady_step.SteadyStep | None = None
        # What a step traced by torch.compile reads and cannot create
        # (docs/algorithm.md#compiled-stepping).
        self._compiled_salts: dict[str, int] | None = None
        self._compiled_salts_key: tuple[int, ...] | None = None
        self._static_marked_key: tuple[int, ...] | None = None

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group; validated completely before anything is registered.

        Raises:
            TypeError, ValueError, RuntimeError: as the constructor, naming the group.
        """
        group = _params.new_group(
            param_group, defaults=self.defaults, groups=self.param_groups,
            implicit=getattr(self, "_building_implicit_group", False),
            refresh_every=self._codebook_refresh_every)
        where = f"Gefen param group {len(self.param_groups)}"
        _nonfinite.check_skip_option(self._skip_nonfinite, group["capturable"], where)
        for t, name in zip(group["params"], group["param_names"]):
            self._refuse_sharded(t, name)
        self.param_groups.append(group)
        self._steady = None

    def _sync_param_names(self) -> None:
        """Give the tensors of a group whose ``params`` a wrapper rebound names of their own
        (:func:`gefen_core._params.live_names`), so every tensor is stepped and checkpointed."""
        groups = self.param_groups
        if all(len(g.get("param_names", ())) == len(g["params"])
               == len(g.get("param_names_synthesized", ())) for g in groups):
            return
        for group, (names, flags) in zip(groups, _params.live_names(groups)):
            group["param_names"], group["param_names_synthesized"] = names, flags

    def _named_params(self) -> Iterable[tuple[dict[str, Any], Tensor, str]]:
        self._sync_param_names()
        for group in self.param_groups:
            for p, name in zip(group["params"], group["param_names"]):
                yield group, p, name

    def step_paths(self) -> dict[str, str]:
        """Which implementation steps each parameter: ``{name: "fused" | "foreach" |
        "for_loop"}``. The step uses exactly this choice (see the dispatch rule)."""
        return {
            name: _dispatch.choose_path(
                p, group, deterministic=self._deterministic,
                sharded_factored=self._reduces_factored_stats)
            for group, p, name in self._named_params()
        }

    # ------------------------------------------------------------------ AMP
    @property
    def _step_supports_amp_scaling(self) -> bool:  # read by torch.amp.GradScaler.step
        return any(p.dtype == torch.float16 for _, p, _ in self._named_params())

    # ------------------------------------------------------------------ extension points
    #: Whether DTensor 2-D parameters take the factored second moment
    #: (docs/algorithm.md#factored-second-moment). Only a subclass whose
    #: :meth:`_factored_statistics` sums the shards' statistics may set it.
    _reduces_factored_stats: bool = False
    #: The class to name when a parameter is a DTensor sharded over ranks, which this class
    #: would step with a rank-local codebook and periods; ``None`` for a class that steps such
    #: parameters correctly or refuses them itself (GefenMuon, the gefen_dist classes).
    _sharded_alternative: str | None = "gefen_dist.ShardedGefen (same arguments)"

    def _refuse_sharded(self, p: Tensor, name: str) -> None:
        """Refuse a DTensor with a non-``Replicate`` placement (docs/algorithm.md#distributed).

        Raises:
            ValueError: naming the parameter, its placements and :attr:`_sharded_alternative`.
        """
        alternative = self._sharded_alternative
        if alternative is None or not _dispatch.is_dtensor(p):
            return
        placements = tuple(p.placements)  # type: ignore[attr-defined]
        if all(pl.is_replicate() for pl in placements):
            return
        raise ValueError(
            f"{type(self).__name__}: parameter {name!r} is a DTensor sharded as {placements} "
            "(FSDP2 fully_shard or tensor parallel). This class would learn its codebook and "
            "block periods from each rank's shard alone, so every rank would train a "
            f"different optimizer; use {alternative}")

    def _step_is_nonfinite(self) -> bool:
        """Whether some gradient of this step has a NaN or Inf element (``skip_nonfinite``,
        docs/algorithm.md#non-finite-gradients). A distributed subclass agrees on it over the
        ranks, so they all skip or all step."""
        return not self._all_finite(_nonfinite.step_gradients(
            p for _, p, _ in self._named_params()))

    def _record_skipped_step(self) -> None:
        self.skipped_steps += 1
        self.last_step_skipped = True

    def _factored_statistics(
        self, entries: list[tuple[Tensor, Tensor, Tensor, Tensor, float, bool]],
    ) -> list[Tensor]:
        """This rank's factored statistics of the DTensor (row-sharded) matrices of the step.

        Called once per step, before any parameter is updated, by every optimizer whose
        ``_reduces_factored_stats`` is true (with an empty list when this rank steps none).

        Args:
            entries: ``(param, local grad, exp_avg_sq_row, exp_avg_sq_col, beta2, fused)`` per
                factored DTensor parameter stepped here, in step order.

        Returns:
            One ``stats`` tensor per entry (``gefen_kernels.ops.factored_step.
            factored_partial_stats``: fp32 ``[R_local + C + 1]``), whose ``[R_local:]`` part the
            step then treats as summed over every shard. Here: unreduced (right when the local
            rows are all rows); a distributed subclass all-reduces them in place.
        """
        from gefen_kernels.ops.factored_step import (
            factored_partial_stats,
            factored_partial_stats_reference,
        )

        out = []
        for p, g, row, col, beta2, fused in entries:
            fn = factored_partial_stats if fused else factored_partial_stats_reference
            lp = _dispatch.local(p)
            out.append(fn(lp if lp.is_contiguous() else lp.contiguous(),
                          g if g.is_contiguous() else g.contiguous(), row, col, beta2=beta2))
        return out

    def _reduce_histogram(self, counts: Tensor) -> Tensor:
        """Combine the int64 ``[4097]`` codebook histogram across replicas. Identity here;
        a distributed subclass all-reduces it (sum) so every rank learns the same codebook."""
        return counts

    def _search_periods(self, grads: list[Tensor], shapes: list[tuple[int, ...]],
                        names: list[str], variant: str) -> list[int]:
        """Period search for the tensors no docs/algorithm.md#period-search gate decided: every
        tensor's scores are launched before any is read back (one host sync per device,
        :func:`gefen_core.period.search_periods`); errors name the parameter. A distributed
        subclass may override it to reduce the period statistics over the global tensors."""
        from .period import search_periods

        return [int(p) for p in search_periods(grads, shapes, variant=variant, fallback=True,
                                               names=names)]

    def _select_period(self, param: Tensor, grad: Tensor, name: str, group: dict[str, Any]) -> int:
        """docs/algorithm.md#period-search gates in order, then :meth:`_search_periods`
        (:meth:`_select_periods` of one tensor)."""
        return self._select_periods([(param, grad, name, group)])[0]

    def _select_periods(self, items: Sequence[tuple[Tensor, Tensor, str, dict[str, Any]]],
                        ) -> list[int]:
        """The period of each ``(param, grad, name, group)``: the docs/algorithm.md#period-search
        gates in order, then one :meth:`_search_periods` call per search variant for the tensors no
        gate decided (a model's first step then waits for the device once, not once per tensor)."""
        periods: list[int] = [0] * len(items)
        pending: dict[str, list[int]] = {}
        for i, (param, _, name, group) in enumerate(items):
            if (param.numel() == 1 or (group["force_1d_period_one"] and param.ndim == 1)
                    or (group["force_2d_period_one"] and param.ndim == 2)
                    or any(s in name for s in group["period_one_substrings"])):
                periods[i] = 1
            else:
                pending.setdefault(group["period_search"], []).append(i)
        for variant, idx in pending.items():
            # A strided gradient is made contiguous one tensor at a time, by the search.
            found = self._search_periods([items[i][1] for i in idx],
                                         [tuple(items[i][0].shape) for i in idx],
                                         [items[i][2] for i in idx], variant)
            for i, period in zip(idx, found):
                periods[i] = period
        for (_, grad, name, _), period in zip(items, periods):
            # The period is state geometry: it must divide the elements actually stepped (a
            # DTensor's local shard), not only the global numel.
            n = grad.numel()
            if period < 1 or n % period:
                raise RuntimeError(
                    f"Gefen: period search returned {period} for {name!r} (numel {n})")
        return periods

    # ------------------------------------------------------------------ codebook
    def _codebook_on(self, device: torch.device) -> Tensor:
        assert self._codebook is not None
        if self._codebook.device == device:
            return self._codebook
        cached = self._codebook_cache.get(device)
        if cached is None:
            cached = self._codebook.to(device)
            self._codebook_cache[device] = cached
        return cached

    def _anchor_device(self) -> torch.device:
        first = self.param_groups[0]["params"][0]
        return first.grad.device if first.grad is not None else first.device

    @staticmethod
    def _all_finite(grads: list[Tensor]) -> bool:
        return _nonfinite.all_finite(grads)

    def _learn(self, entries: list[tuple[dict[str, Any], Tensor, Tensor, str]],
               periods: dict[Tensor, int]) -> Tensor:
        """Histogram of every participating gradient (each with its own period), reduced,
        then the exact optimal codebook (docs/algorithm.md#codebook). Fills ``periods`` for tensors
        lacking one."""
        from gefen_kernels.ops import histogram_sum

        from .codebook import optimal_codebook

        unknown = [(p, g, name, group) for group, p, g, name in entries
                   if (p not in self.state or self.state[p].get("period") is None)
                   and p not in periods]
        for (p, _, _, _), found in zip(unknown, self._select_periods(unknown)):
            periods[p] = found
        grads, blocks, reference = [], [], []
        for group, p, g, _ in entries:
            stored = self.state[p].get("period") if p in self.state else None
            period = int(stored) if stored is not None else periods[p]
            path = _dispatch.choose_path(
                p, group, deterministic=self._deterministic,
                sharded_factored=self._reduces_factored_stats)
            grads.append(g)
            blocks.append(period)
            reference.append(path != "fused")
        # One int64 accumulator per device, read back once: a model's codebook pass costs one
        # device-to-host sync per device, not one per tensor (exact integer sums either way).
        counts = histogram_sum(grads, blocks, reference=reference)
        counts = self._reduce_histogram(counts)
        return optimal_codebook(counts, device=self._anchor_device())

    # ------------------------------------------------------------------ step
    def _capture_guard(self) -> None:
        if not torch.cuda.is_available() or not torch.cuda.is_current_stream_capturing():
            return
        if not all(g["capturable"] for g in self.param_groups):
            raise RuntimeError(
                "Gefen: CUDA graph capture of step() needs capturable=True in every param group"
            )
        dev = torch.device("cuda", torch.cuda.current_device())
        for _, p, name in self._named_params():
            if p.device != dev:
                raise RuntimeError(f"Gefen: parameter {name!r} is on {p.device}, not the "
                                   f"capture device {dev}")

    def _preflight(self) -> list[tuple[dict[str, Any], Tensor, Tensor, str]]:
        """docs/algorithm.md#step C: check every gradient before any mutation; returns (group, p,
        grad, name)."""
        entries = []
        for group, p, name in self._named_params():
            # Every parameter, with a gradient or not, so every rank refuses alike.
            self._refuse_sharded(p, name)
            g = p.grad
            if g is None:
                continue
            if g.layout != torch.strided or g.is_sparse:
                raise RuntimeError(
                    f"{type(self).__name__} does not support sparse gradients, please consider "
                    f"SparseAdam instead (parameter {name!r} has a {g.layout} gradient; "
                    "densify it)")
            if g.is_complex():
                raise RuntimeError(f"Gefen: parameter {name!r} has a complex gradient ({g.dtype})")
            if g.shape != p.shape:
                raise RuntimeError(
                    f"Gefen: gradient of {name!r} has shape {tuple(g.shape)} but the parameter "
                    f"has {tuple(p.shape)}")
            if not _dispatch.is_dtensor(p) and g.device != p.device:
                raise RuntimeError(
                    f"Gefen: gradient of {name!r} is on {g.device} but the parameter is on "
                    f"{p.device}; move the gradient to the parameter's device")
            if not g.is_floating_point():
                raise RuntimeError(f"Gefen: gradient of {name!r} has dtype {g.dtype}")
            entries.append((group, p, _dispatch.local(g), name))
        return entries

    def _host_lr(self, lr: float | Tensor) -> float:
        if not isinstance(lr, Tensor):
            return float(lr)
        # One device->host read per lr change (docs/algorithm.md#step), keyed by the tensor's
        # identity (held weakly, so a recycled id cannot alias) and its version counter (bumped by
        # fill_).
        hit = self._lr_cache.get(id(lr))
        if hit is not None and hit[0]() is lr and hit[1] == lr._version:
            return hit[2]
        if lr.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "Gefen: a tensor hyperparameter (lr of a group without capturable, or betas) "
                "changed since the last eager step and cannot be read on the host while a CUDA "
                "graph is being captured; take one eager step after changing it, then capture")
        value = float(lr.detach().reshape(()).item())
        self._lr_cache[id(lr)] = (weakref.ref(lr), lr._version, value)
        return value

    def _host_betas(self, group: dict[str, Any]) -> tuple[float, float]:
        """The group's ``betas`` as floats: tensor betas are read like a tensor lr (once per
        in-place change, :meth:`_host_lr`), because the kernels take them as scalars."""
        beta1, beta2 = group["betas"]
        return self._host_lr(beta1), self._host_lr(beta2)

    def _device_step(self, device: torch.device) -> Tensor:
        t = self._device_global_step.get(device)
        if t is None:
            t = torch.full((), self._global_step, dtype=torch.int64, device=device)
            self._device_global_step[device] = t
        return t

    def _sync_global_step(self) -> None:
        """Under capturable the device mirrors are the truth (graph replays advance only
        them); bring the host count in line (docs/algorithm.md#capturable)."""
        values = {int(t.item()) for t in self._device_global_step.values()}
        if len(values) > 1:
            raise RuntimeError(f"Gefen: per-device step counters disagree: {sorted(values)}")
        if values:
            self._global_step = values.pop()

    def _init_group(
        self, group: dict[str, Any], entries: list[tuple[Tensor, Tensor, str]],
        periods: dict[Tensor, int],
    ) -> dict[str, dict[str, list[Any]]]:
        """Create missing state and fill the per-path tensor lists for one group."""
        by_path: dict[str, dict[str, list[Any]]] = {}
        capturable = group["capturable"]
        pending_seeds: dict[torch.device, list[tuple[list[Any], int, int]]] = {}
        for p, g, name in entries:
            state = self.state[p]
            if "period" not in state:
                state["period"] = periods[p]
            period = state["period"]
            blocks = _dispatch.local_numel(p) // period
            dev = g.device
            step_dev = dev if capturable else torch.device("cpu")
            if "exp_avg_codes" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=step_dev)
                state["exp_avg_codes"] = torch.zeros(blocks, period, dtype=torch.uint8, device=dev)
                state["exp_avg_scale"] = torch.zeros(blocks, 1, dtype=torch.float32, device=dev)
            elif not capturable:
                # A framework may have paged the parameter (docs/algorithm.md#step): follow the
                # gradient.
                for key in ("exp_avg_codes", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_row",
                            "exp_avg_sq_col"):
                    if key in state and state[key].device != dev:
                        state[key] = state[key].to(dev)
            factored = _dispatch.is_factored(p, group, sharded=self._reduces_factored_stats)
            if factored and "exp_avg_sq_row" not in state:
                # Migration from block mode (docs/algorithm.md#checkpoint-format): fresh statistics
                # and age; O8 drops the now-unused per-block second moment. A row shard keeps its
                # own rows' r.
                state.pop("exp_avg_sq", None)
                state["exp_avg_sq_row"] = torch.zeros(
                    _dispatch.local(p).shape[0], dtype=torch.float32, device=dev)
                state["exp_avg_sq_col"] = torch.zeros(p.shape[1], dtype=torch.float32, device=dev)
                state["exp_avg_sq_step"] = torch.zeros((), dtype=torch.float32, device=step_dev)
            elif not factored and "exp_avg_sq" not in state:
                state.pop("exp_avg_sq_row", None)
                state.pop("exp_avg_sq_col", None)
                state["exp_avg_sq"] = torch.zeros(blocks, 1, dtype=torch.float32, device=dev)
                state["exp_avg_sq_step"] = torch.zeros((), dtype=torch.float32, device=step_dev)
            path = _dispatch.choose_path(
                p, group, deterministic=self._deterministic,
                sharded_factored=self._reduces_factored_stats)
            lists = by_path.get(path)
            if lists is None:  # not setdefault: its default dict would be built per tensor
                lists = by_path[path] = {k: [] for k in (
                    "params", "grads", "codes", "scales", "sqs", "rows", "cols", "steps",
                    "sq_steps", "seeds", "seed_tensors", "codebooks", "sharded",
                    "factored_stats")}
            lists["params"].append(_dispatch.local(p))
            lists["grads"].append(g)
            lists["codes"].append(state["exp_avg_codes"])
            lists["scales"].append(state["exp_avg_scale"])
            lists["sqs"].append(None if factored else state["exp_avg_sq"])
            lists["rows"].append(state["exp_avg_sq_row"] if factored else None)
            lists["cols"].append(state["exp_avg_sq_col"] if factored else None)
            # Row-sharded factored matrices get reduced statistics before the update.
            lists["sharded"].append(p if factored and _dispatch.is_dtensor(p) else None)
            lists["factored_stats"].append(None)
            lists["steps"].append(state["step"])
            lists["sq_steps"].append(state["exp_avg_sq_step"])
            salt = name_salt(name)
            lists["seeds"].append(mix_seed(self._global_step, salt))
            if capturable:
                slot = lists["seed_tensors"]
                pending_seeds.setdefault(dev, []).append((slot, len(slot), salt))
                slot.append(None)
            lists["codebooks"].append(self._codebook_on(dev))
        for dev, slots in pending_seeds.items():
            self._fill_device_seeds(dev, slots)
        return by_path

    def _fill_device_seeds(self, dev: torch.device,
                           slots: list[tuple[list[Any], int, int]]) -> None:
        _seeds.fill_device_seeds(self, dev, slots)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimization step (docs/algorithm.md#step).

        Args:
            closure (Callable, optional): re-evaluates the model and returns the loss; it runs
                first, with gradients enabled, so the first step learns the codebook from its
                gradients.

        Returns:
            The closure's loss, or ``None``.

        Raises:
            RuntimeError: sparse, complex, shape- or device-mismatched gradients (before any
                mutation); graph capture without ``capturable``; malformed scaler attributes.
        """
        if torch.compiler.is_compiling():
            return _compiled_step.traced_step(self, closure)  # docs/algorithm.md#compiled-stepping
        return self._eager_step(closure)

    def _eager_step(self, closure: Callable[[], Any] | None) -> Any:
        _compiled_step.sync_global_step(self)
        self._capture_guard()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._skip_nonfinite and self._step_is_nonfinite():
            self._record_skipped_step()
            return loss
        if self._steady is not None:
            # The recorded launches take betas as numbers: tensor betas take the full step.
            if not self._has_tensor_betas() and self._steady.run(self):
                self.last_step_skipped = False
                return loss
            self._steady = None
        entries = self._preflight()

        overflow, inv_scale = _amp.overflow_and_inverse_scale(self)
        if overflow:
            # docs/algorithm.md#mixed-precision: nothing learned, counted, or touched; T unchanged.
            return loss
        if inv_scale is not None:
            _amp.unscale_([g for _, _, g, _ in entries], inv_scale)

        live = [e for e in entries if _dispatch.local_numel(e[1]) > 0]
        periods: dict[Tensor, int] = {}
        if self._codebook is None:
            if live:
                if not self._all_finite([g for _, _, g, _ in live]):
                    warnings.warn(
                        "Gefen: non-finite gradients on the step that would learn the codebook; "
                        "codebook learning is deferred and this step is skipped (decision O9)",
                        RuntimeWarning, stacklevel=2)
                    return loss
                codebook = self._learn(live, periods)
                self._codebook = codebook
                self._codebook_cache = {}
        elif (self._codebook_refresh_every > 0 and self._global_step > 0
              and self._global_step % self._codebook_refresh_every == 0 and live):
            self._refresh(live, periods)

        # Parameters receiving their first gradient after the codebook exists
        # (docs/algorithm.md#step).
        stepped: list[tuple[dict[str, Any], Tensor, Tensor, str]] = []
        for group, p, g, name in live:
            if p in periods or "period" in self.state.get(p, {}):
                stepped.append((group, p, g, name))
                continue
            if not self._all_finite([g]):
                warnings.warn(
                    f"Gefen: non-finite first gradient for {name!r}; its period search is "
                    "deferred and the parameter is skipped this step (decision O9)",
                    RuntimeWarning, stacklevel=2)
                continue
            periods[p] = self._select_period(p, g, name, group)
            stepped.append((group, p, g, name))

        per_group: dict[int, list[tuple[Tensor, Tensor, str]]] = {}
        for group, p, g, name in stepped:
            per_group.setdefault(id(group), []).append((p, g, name))
        inits = []
        for group in self.param_groups:
            group_entries = per_group.get(id(group))
            if group_entries:
                inits.append((group, self._init_group(group, group_entries, periods)))
        if self._reduces_factored_stats and self._codebook is not None:
            self._attach_factored_stats(inits)
        for group, by_path in inits:
            self._step_group(group, by_path)
        for t in self._device_global_step.values():
            t.add_(1)
        self._global_step += 1
        self.last_step_skipped = False
        self._steady = None if self._has_tensor_betas() \
            else _steady_step.build(self, inits, live, stepped, _dispatch.split_by_device)
        _compiled_step.prepare(self)
        return loss

    def _step_group(self, group: dict[str, Any],
                    by_path: dict[str, dict[str, list[Any]]]) -> None:
        """One group's initialised lists (:meth:`_init_group`) through
        :func:`gefen_core.functional.gefen`, once per path and device. :meth:`step` calls it
        for every group; :mod:`gefen_core.backward_step` for one parameter from its gradient
        hook, with the step count ``T`` that the next :meth:`step` advances
        (docs/algorithm.md#step-in-backward)."""
        beta1, beta2 = self._host_betas(group)
        lr = group["lr"] if group["capturable"] else self._host_lr(group["lr"])
        for path, lists in by_path.items():
            # Lists are split by device only through the codebook copy they share.
            for dev_lists in _dispatch.split_by_device(lists):
                stats = dev_lists["factored_stats"]
                _gefen_functional(
                    dev_lists["params"], dev_lists["grads"], dev_lists["codes"],
                    dev_lists["scales"], dev_lists["sqs"], dev_lists["rows"], dev_lists["cols"],
                    dev_lists["steps"], dev_lists["sq_steps"],
                    codebook=dev_lists["codebooks"][0], lr=lr, beta1=beta1, beta2=beta2,
                    eps=group["eps"], weight_decay=group["weight_decay"],
                    maximize=group["maximize"], stochastic_round=group["stochastic_round"],
                    seeds=dev_lists["seeds"], seed_tensors=dev_lists["seed_tensors"] or None,
                    foreach=path == "foreach", fused=path == "fused",
                    capturable=group["capturable"], differentiable=False,
                    factored_stats=stats if any(s is not None for s in stats) else None)

    def _has_tensor_betas(self) -> bool:
        return any(isinstance(g["betas"][0], Tensor) for g in self.param_groups)

    def _attach_factored_stats(
        self, inits: list[tuple[dict[str, Any], dict[str, dict[str, list[Any]]]]],
    ) -> None:
        """Statistics of the row-sharded factored matrices, all at once, through
        :meth:`_factored_statistics`; stored as ``(stats, global_rows)`` in the path lists."""
        where: list[tuple[dict[str, list[Any]], int, int]] = []
        entries: list[tuple[Tensor, Tensor, Tensor, Tensor, float, bool]] = []
        for group, by_path in inits:
            for path, lists in by_path.items():
                for i, p in enumerate(lists["sharded"]):
                    if p is None:
                        continue
                    entries.append((p, lists["grads"][i], lists["rows"][i], lists["cols"][i],
                                    self._host_betas(group)[1], path == "fused"))
                    where.append((lists, i, int(p.shape[0])))
        stats = self._factored_statistics(entries)
        if len(stats) != len(entries):
            raise RuntimeError(f"Gefen: _factored_statistics returned {len(stats)} tensors for "
                               f"{len(entries)} parameters")
        for (lists, i, global_rows), st in zip(where, stats):
            lists["factored_stats"][i] = (st, global_rows)

    def _refresh(self, live: list[tuple[dict[str, Any], Tensor, Tensor, str]],
                 periods: dict[Tensor, int]) -> None:
        """docs/algorithm.md#codebook: relearn from the current gradients with the stored periods
        (missing ones computed on the fly, O6), re-map every code, commit all together."""
        if not self._all_finite([g for _, _, g, _ in live]):
            warnings.warn("Gefen: non-finite gradients on a codebook-refresh step; the refresh "
                          "is skipped (decision O9)", RuntimeWarning, stacklevel=3)
            return
        assert self._codebook is not None
        new = self._learn(live, periods)
        remapped = {
            p: remap_codes(st["exp_avg_codes"], self._codebook, new)
            for p, st in self.state.items() if isinstance(p, Tensor) and "exp_avg_codes" in st
        }
        for p, codes in remapped.items():
            self.state[p]["exp_avg_codes"] = codes
        self._codebook = new
        self._codebook_cache = {}

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The native checkpoint (docs/internals/contracts.md, docs/algorithm.md#checkpoint-format).

        Plain tensors, ints, floats, strings, bools, lists, tuples, dicts and ``None`` only, so
        ``torch.load(weights_only=True)`` reads it.
        """
        from .checkpoint import build_state_dict

        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        if self._device_global_step:
            self._sync_global_step()
        sd = build_state_dict(self)
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, sd)
            if result is not None:
                sd = result
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a checkpoint: stage it on a shadow, validate everything, then swap
        (docs/algorithm.md#checkpoint-format).

        A rejected checkpoint raises ``ValueError`` and leaves the optimizer unchanged.
        Checkpoints of the published ``gefen`` 1.2.x / ``gefen-x`` 0.5.x are converted first
        (:func:`gefen_core.legacy.convert_legacy_state_dict`). Saved dtypes are kept (fp32
        state is never cast to a bf16 parameter's dtype); counters are normalised to the live
        ``capturable`` mode; implementation flags (``foreach``, ``fused``, ``capturable``,
        ``differentiable``, ``factored_v_2d``) keep their live values, hyperparameters and
        extra group keys come from the checkpoint.
        """
        from .checkpoint import CheckpointError, commit, stage_load

        if not isinstance(state_dict, Mapping):
            raise CheckpointError(
                f"Gefen.load_state_dict: expected a dict, got {type(state_dict).__name__}; "
                "the optimizer was left unchanged")
        state_dict = dict(state_dict)
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        staged = stage_load(self, state_dict)
        commit(self, staged)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    #: Attributes that ``copy.deepcopy`` and pickling keep besides torch's ``defaults``,
    #: ``state`` and ``param_groups`` (hooks are dropped, as torch.optim drops them; runtime
    #: caches are rebuilt). A subclass with attributes of its own extends the tuple.
    _pickled_attrs: tuple[str, ...] = (
        "_global_step", "_codebook", "_deterministic", "_codebook_refresh_every",
        "_skip_nonfinite", "skipped_steps", "last_step_skipped")

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        if self._device_global_step:
            self._sync_global_step()
        state.update({k: getattr(self, k) for k in self._pickled_attrs if hasattr(self, k)})
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        state.setdefault("_global_step", 0)
        state.setdefault("_codebook", None)
        state.setdefault("_deterministic", False)
        state.setdefault("_codebook_refresh_every", 0)
        state.setdefault("_skip_nonfinite", False)
        state.setdefault("skipped_steps", 0)
        state.setdefault("last_step_skipped", False)
        super().__setstate__(state)
        self._init_runtime_caches()


Gefen.__doc__ = _docs.interpolate(
    Gefen.__doc__ or "",
    maximize=_docs.MAXIMIZE_DOC, foreach=_docs.FOREACH_DOC, capturable=_docs.CAPTURABLE_DOC,
    differentiable=_docs.DIFFERENTIABLE_DOC, fused=_docs.FUSED_DOC,
    skip_nonfinite=_docs.SKIP_NONFINITE_DOC,
    min_dim_size_to_factor=_docs.MIN_DIM_SIZE_TO_FACTOR_DOC,
    # The shared texts are indented for an Args entry; re-indent them for their sections.
    dispatch=_docs.DISPATCH_RULE.replace("\n            ", "\n        "),
    nan_policy=_docs.NAN_POLICY.replace("\n            ", "\n    "),
)
