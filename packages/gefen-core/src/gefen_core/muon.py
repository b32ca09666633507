"""GefenMuon: Muon with Gefen's ~1 byte/param quantized momentum (docs/algorithm.md#gefenmuon).

Muon keeps an fp32 momentum matrix per weight (4 bytes/param) and steps along its
Newton–Schulz orthogonalisation. GefenMuon stores that momentum the way Gefen stores its first
moment — uint8 codes into one learned 256-entry codebook times one fp32 scale per block of
``P`` elements — and keeps no second moment. Internally it *is* a :class:`~gefen_core.Gefen`
with ``betas = (momentum, 0)``, ``eps`` = the Newton–Schulz eps and block state, so parameter
groups, names, codebook learning, period search, the AMP protocol and the checkpoint format
are Gefen's; this module adds the Muon pipeline of docs/algorithm.md#gefenmuon and its options.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from . import _compiled_step, _muon_update, _params
from . import amp as _amp
from ._muon_options import (
    ADJUST_LR_FNS,
    SHARDED_MODES,
    _is_real,
    _not_a_matrix_at_construction,
    adjusted_lr_ratio,
    check_muon_options,
)
from ._seeds import mix_seed, name_salt
from .newton_schulz import (
    DEFAULT_NS_STEPS,
    STANDARD_COEFFICIENTS,
    fp8_ns_eligible,
    fp8_ns_supported,
    newton_schulz,
    newton_schulz_opaque,
    plan_ns_batches,
    resolve_ns_schedule,
)
from .optimizer import Gefen

__all__ = [
    "ADJUST_LR_FNS",
    "SHARDED_MODES",
    "GefenMuon",
    "adjusted_lr_ratio",
]

#: Per-parameter NorMuon state (docs/algorithm.md#gefenmuon), on top of Gefen's
#: ``step``/``period``/codes/scale.
NORMUON_STATE_KEYS = ("normuon_exp_avg_sq", "normuon_step")
_DEFAULT_WORKSPACE = 256 << 20
# Batched Newton–Schulz eligibility (docs/algorithm.md#gefenmuon).
_BATCH_MAX_MIN_DIM = 512
_BATCH_MAX_NUMEL = 1 << 20
_BATCH_MIN = 8
# Gefen options whose Muon value is fixed (docs/algorithm.md#gefenmuon: no force gates, block state,
# no betas).
_PINNED = {
    "factored_v_2d": False,
    "force_1d_period_one": False,
    "force_2d_period_one": False,
    "period_one_substrings": (),
}
_MUON_KEYS = (
    "momentum", "nesterov", "ns_coefficients", "ns_steps", "adjust_lr_fn", "sharded_mode",
    "fp8_ns", "fp8_ns_compile", "batched_ns", "batched_ns_workspace_bytes", "normuon",
    "normuon_beta2", "normuon_eps", "cautious",
)

Entry = tuple[dict[str, Any], Tensor, Tensor, str]


def _is_dtensor(t: Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - builds without torch.distributed
        return False
    return isinstance(t, DTensor)


def _newton_schulz(x: Tensor, schedule: Sequence[Any], **options: Any) -> Tensor:
    # A traced step keeps Newton-Schulz opaque, so it rounds as the eager step does
    # (docs/algorithm.md#compiled-stepping).
    if torch.compiler.is_compiling():
        return newton_schulz_opaque(x, schedule, **options)
    return newton_schulz(x, schedule, **options)


class GefenMuon(Gefen):
    r"""Muon with Gefen's quantized momentum: ~1 byte of state per parameter
    (docs/algorithm.md#gefenmuon).

    .. math::
       \begin{aligned}
            &\textbf{input}: \gamma \text{ (lr)}, \lambda \text{ (weight decay)},
                \mu \text{ (momentum)}, (a_k, b_k, c_k)_{k=1}^K \text{ (NS schedule)},
                \varepsilon, c \in [-1, 1]^{256} \text{ (codebook, learned at } t=1) \\
            &\textbf{for} \: t=1 \: \textbf{to} \: \ldots \: \textbf{do} \\
            &\hspace{5mm} g_t \leftarrow \nabla_\theta f_t(\theta_{t-1}) \quad
                (\theta \in \mathbb{R}^{R\times C}) \\
            &\hspace{5mm} m_i \leftarrow \mu\, s_{b}\, c[q_i] + (1-\mu)\, g_{t,i};\quad
                s_b \leftarrow \max_{i\in b}|m_i|;\quad q_i \leftarrow
                \mathrm{round}_c(m_i / s_b) \\
            &\hspace{5mm} U \leftarrow c[q]\, s \quad\text{(re-quantized momentum)};\quad
                \textbf{if } \textit{nesterov}: U \leftarrow \mu U + (1-\mu) g_t \\
            &\hspace{5mm} O \leftarrow \mathrm{NS}_{(a,b,c)}(U;\ \varepsilon)
                \quad\text{(bf16; rows} \le \text{cols)} \\
            &\hspace{5mm} \textbf{if } \textit{normuon}: O \leftarrow \mathrm{NorMuon}(O);\quad
                \textbf{if } \textit{cautious}: O \leftarrow \mathrm{Cautious}(O, g_t) \\
            &\hspace{5mm} \theta_t \leftarrow \theta_{t-1}(1 - \gamma\lambda)
                - \gamma\, \alpha(R, C)\, O \\
            &\textbf{return} \: \theta_t
       \end{aligned}

    ``round_c`` is the nearest codeword (or unbiased stochastic rounding). ``α(R, C)`` is
    ``sqrt(max(1, R/C))`` (``adjust_lr_fn=None``/``"original"``) or ``0.2·sqrt(max(R, C))``
    (``"match_rms_adamw"``), from the global shape; weight decay uses the un-adjusted ``γ``.
    Newton–Schulz drives every singular value of ``U / ‖U‖_F`` into a band around 1
    (docs/algorithm.md#gefenmuon), so the update is roughly the nearest semi-orthogonal matrix. The
    momentum EMA runs in fp32 (decision O10); the Nesterov look-ahead and the NS input are in the
    gradient dtype.

    NorMuon (docs/algorithm.md#gefenmuon) keeps a per-row EMA ``ν`` of ``‖O_r‖² / C``, divides each
    row by ``sqrt(ν_r / (1 - β₂ⁿ^t)) + εⁿ`` and rescales so ``‖O‖_F`` is unchanged. Cautious masks
    the entries whose sign disagrees with the gradient and rescales by
    ``numel / (kept + ...)``.

    Args:
        params (iterable): 2-D tensors, ``(name, tensor)`` pairs or group dicts, as
            :class:`~gefen_core.Gefen`. Groups may override every option below.
        lr (float or Tensor, optional): learning rate γ ≥ 0; with the default
            ``adjust_lr_fn`` it is in units of spectral norm per update (default: 1e-3)
        weight_decay (float, optional): decoupled decay λ ≥ 0 (default: 0.1, as
            ``torch.optim.Muon``; plain Gefen and the hybrid default to 0)
        momentum (float, optional): μ in [0, 1) (default: 0.95)
        nesterov (bool, optional): Nesterov look-ahead on the dense momentum (default: True)
        ns_coefficients (tuple, optional): one ``(a, b, c)`` triple repeated ``ns_steps``
            times, or a list of triples (default: (3.4445, -4.7750, 2.0315))
        eps (float, optional): floor of ``‖U‖_F`` in the NS normalisation, finite and > 0
            (default: 1e-7)
        ns_steps (int, optional): iterations of a single triple, in [1, 100) (default: 5)
        adjust_lr_fn (str, optional): None, ``"original"`` or ``"match_rms_adamw"``
            (default: None)
        ns_schedule (str or list, optional): ``"standard"``, ``"tuned3"``, ``"tuned4"`` or a
            list of triples; overrides ``ns_coefficients``/``ns_steps`` (default: None)
        {maximize}
        {foreach}
        {capturable}
        {differentiable}
        fused (bool, optional): run the momentum step (docs/algorithm.md#gefenmuon: quantized EMA,
            re-quantisation and the dense momentum, one Triton launch per matrix for ``P <= 4096``)
            with the Triton kernel of ``gefen_kernels.ops.muon_momentum`` on CUDA matrices of dtype
            fp32, bf16 or fp16; bit-identical to its PyTorch reference. ``None`` picks the
            kernel wherever it can run and the reference elsewhere (CPU, fp64, no Triton);
            ``False`` always runs the reference; ``True`` that cannot be honoured for some
            matrix raises ``RuntimeError`` at construction, as :class:`~gefen_core.Gefen`
            does (default: None)
        sharded_mode (str, optional): ``"exact"``, ``"distributed"`` or ``"approx"`` for
            DTensor parameters (docs/algorithm.md#distributed); plain tensors ignore it. The sharded
            modes need collectives and run in ``gefen_dist.ShardedGefenMuon``; this class raises
            ``ValueError`` at ``step()`` for a DTensor parameter with a gradient
            (default: "exact")
        fp8_ns (bool, optional): fp8 Newton–Schulz where the GPU supports it (capability
            ≥ 8.9) and ``min(R, C) ≥ 1536``; other matrices use bf16 silently. Warns once at
            construction when no capable GPU is visible (default: False)
        fp8_ns_compile (bool, optional): compile the fp8 iteration (default: True)
        batched_ns (bool, optional): run Newton–Schulz on stacks of same-shaped small matrices
            (``min(R, C) ≤ 512``, ``R·C ≤ 2^20``, at least 8) with batched GEMMs; not
            bit-identical to the serial path (default: False)
        batched_ns_workspace_bytes (int, optional): memory budget of one batch, bytes
            (default: 256 MiB)
        stochastic_round (bool, optional): unbiased stochastic rounding of the momentum codes
            (default: False)
        deterministic (bool, optional): persisted and checked like Gefen's; the Muon path has
            no order-dependent reductions (default: False)
        period_search (str, optional): as Gefen (default: "log_contrast")
        normuon (bool, optional): NorMuon row normalisation (default: False)
        normuon_beta2 (float, optional): β₂ⁿ in [0, 1) (default: 0.95)
        normuon_eps (float, optional): εⁿ, finite and > 0 (default: 1e-8)
        cautious (bool, optional): sign-agreement masking (default: False)
        {skip_nonfinite}

    State:
        Per matrix ``R × C`` (``B = R·C / P`` blocks): ``step`` (fp32 0-dim), ``period`` (int),
        ``exp_avg_codes`` (uint8 ``[B, P]``, 1 byte/param), ``exp_avg_scale`` (fp32
        ``[B, 1]``, 4/P bytes/param); with NorMuon ``normuon_exp_avg_sq`` (fp32 ``[R, 1]``)
        and ``normuon_step`` (fp32 0-dim). About ``1 + 4/P`` bytes/param; optimizer-wide the
        fp32 ``[256]`` codebook.

    Raises:
        RuntimeError: ``fused=True`` for a matrix the kernel cannot step (not on CUDA, fp64,
            Triton missing); ``differentiable=True``.
        TypeError: a non-bool flag, a non-int ``ns_steps``, bad parameter types (as Gefen).
        ValueError: a non-2-D parameter; ``lr``, ``momentum``, ``eps``, ``weight_decay``,
            ``normuon_*``, ``batched_ns_workspace_bytes``, ``adjust_lr_fn``, ``sharded_mode``
            or schedule out of range; ``betas``/force-gate options given to a Muon group.
            At ``step()``: a parameter that is no longer 2-D (a wrapper such as DeepSpeed ZeRO
            flattened it) or a DTensor parameter (use ``gefen_dist.ShardedGefenMuon``).

        Where ``torch.optim.Muon`` refuses the same input, the exception type is Muon's and the
        message starts with Muon's text (``Learning rate should be >= 0 but is: -1.0 (...)``).

    Differences from torch.optim.Muon (each with its reason in
    docs/internals/torch-optim-deviations.md): quantized momentum (no ``momentum_buffer``);
    ``momentum`` must be < 1 and ``eps`` > 0; complex parameters are refused at construction
    (Muon raises at ``step()``); besides those, Gefen's differences from AdamW apply.

    {nan_policy}

    References:
        Jordan et al., "Muon: An optimizer for hidden layers in neural networks", 2024,
        https://kellerjordan.github.io/posts/muon/. Liu et al., "Muon is Scalable for LLM
        Training", https://arxiv.org/abs/2502.16982 (``match_rms_adamw``). NorMuon,
        https://arxiv.org/abs/2510.05491. Liang et al., "Cautious Optimizers",
        https://arxiv.org/abs/2411.16085. Benedek, Koren, Fried, "Gefen",
        https://arxiv.org/abs/2606.13894.
    """

    _pickled_attrs = Gefen._pickled_attrs + (
        "_muon_defaults", "_ns_args", "_ns_dtype", "_dense_momentum_for_testing")
    # Sharded DTensors are refused by _check_sharded at step(), with the sharded_mode they need.
    _sharded_alternative = None

    def __init__(
        self,
        params: Any,
        lr: float | Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: Sequence[float] | Sequence[Sequence[float]] = STANDARD_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = DEFAULT_NS_STEPS,
        # adjust_lr_fn before ns_schedule: torch.optim.Muon's positional order (a drop-in
        # replacement must read the same positional call the same way).
        adjust_lr_fn: str | None = None,
        ns_schedule: str | Sequence[Sequence[float]] | None = None,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        sharded_mode: str = "exact",
        fp8_ns: bool = False,
        fp8_ns_compile: bool = True,
        batched_ns: bool = False,
        batched_ns_workspace_bytes: int = _DEFAULT_WORKSPACE,
        stochastic_round: bool = False,
        deterministic: bool = False,
        period_search: str = "log_contrast",
        normuon: bool = False,
        normuon_beta2: float = 0.95,
        normuon_eps: float = 1e-8,
        cautious: bool = False,
        skip_nonfinite: bool = False,
    ) -> None:
        where = "GefenMuon"
        # torch.optim.Muon's wording for these (Gefen's own checks would word them as AdamW's).
        _params.check_lr(lr, where, "muon")
        _params.check_weight_decay(weight_decay, where, "muon")
        schedule = resolve_ns_schedule(
            ns_schedule, ns_coefficients=ns_coefficients, ns_steps=ns_steps)
        muon_defaults: dict[str, Any] = {
            "momentum": momentum, "nesterov": nesterov, "ns_coefficients": list(schedule),
            "ns_steps": len(schedule), "adjust_lr_fn": adjust_lr_fn,
            "sharded_mode": sharded_mode, "fp8_ns": fp8_ns, "fp8_ns_compile": fp8_ns_compile,
            "batched_ns": batched_ns, "batched_ns_workspace_bytes": batched_ns_workspace_bytes,
            "normuon": normuon, "normuon_beta2": normuon_beta2, "normuon_eps": normuon_eps,
            "cautious": cautious,
        }
        check_muon_options(muon_defaults, where)
        # Read by add_param_group, which torch's constructor calls for every group.
        self._muon_defaults = muon_defaults
        self._ns_args = (ns_schedule, ns_coefficients, ns_steps)
        # Test hooks (never set in production): the NS working dtype, and dense fp32-exact
        # momentum instead of codes, so tests can compare with a full-precision Muon.
        self._ns_dtype: torch.dtype = torch.bfloat16
        self._dense_momentum_for_testing = False
        super().__init__(
            params, lr=lr, betas=(momentum, 0.0), eps=eps, weight_decay=weight_decay,
            maximize=maximize, foreach=foreach, capturable=capturable,
            differentiable=differentiable, fused=fused, factored_v_2d=False,
            stochastic_round=stochastic_round, deterministic=deterministic,
            period_search=period_search, skip_nonfinite=skip_nonfinite,
        )
        self.defaults.update(muon_defaults)
        if any(g["fp8_ns"] for g in self.param_groups) and not _fp8_visible():
            import warnings

            warnings.warn(
                "GefenMuon: fp8_ns=True but no CUDA device with compute capability >= 8.9 is "
                "visible; Newton-Schulz runs in bf16", UserWarning, stacklevel=2)

    # ------------------------------------------------------------------ groups
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of 2-D matrices; Muon options are validated with Gefen's
        (docs/algorithm.md#gefenmuon).

        Raises:
            TypeError, ValueError: as the constructor, naming the group, before anything is
                registered.
        """
        where = f"GefenMuon param group {len(self.param_groups)}"
        if not isinstance(param_group, dict):
            raise TypeError(f"{where}: a param group must be a dict, got {type(param_group)}")
        if "params" not in param_group:
            raise ValueError(f"{where}: a param group dict needs a 'params' entry")
        group = dict(param_group)
        raw = group["params"]
        if not isinstance(raw, (Tensor, set, frozenset)) and hasattr(raw, "__iter__"):
            group["params"] = raw = list(raw)  # consumed twice below (a generator once)
        for key in ("betas", "beta1", "beta2"):
            if key in group:
                raise ValueError(
                    f"{where}: GefenMuon has no {key!r} (it keeps no second moment); set the "
                    "momentum with 'momentum'"
                )
        for key, pinned in _PINNED.items():
            if key in group and group[key] != pinned:
                raise ValueError(
                    f"{where}: {key}={group[key]!r} is a Gefen option that GefenMuon fixes to "
                    f"{pinned!r} (block-quantized momentum, period search without gates)"
                )
        self._resolve_group_ns(group, where)
        for key, default in self._muon_defaults.items():
            group.setdefault(key, default)
        _params.check_lr(group.get("lr", self.defaults["lr"]), where, "muon")
        _params.check_weight_decay(group.get("weight_decay", self.defaults["weight_decay"]),
                                   where, "muon")
        check_muon_options(group, where)
        tensors, names = _params.split_params(raw, where)
        for i, (t, name) in enumerate(zip(tensors, names, strict=True)):
            if t.ndim != 2:
                raise _not_a_matrix_at_construction(where, i, name, tuple(t.shape))
        group["betas"] = (float(group["momentum"]), 0.0)
        group.update(_PINNED)
        super().add_param_group(group)

    def _resolve_group_ns(self, group: dict[str, Any], where: str) -> None:
        ctor_schedule, ctor_coefficients, ctor_steps = self._ns_args
        if not any(k in group for k in ("ns_schedule", "ns_coefficients", "ns_steps")):
            return
        explicit = group.pop("ns_schedule", None)
        if explicit is None and "ns_coefficients" not in group:
            explicit = ctor_schedule
        coefficients = group.get("ns_coefficients", ctor_coefficients)
        steps = group.get("ns_steps", ctor_steps)
        schedule = resolve_ns_schedule(explicit, ns_coefficients=coefficients, ns_steps=steps)
        if ("ns_steps" in group and "ns_coefficients" in group and explicit is None
                and len(resolve_ns_schedule(ns_coefficients=coefficients, ns_steps=1)) > 1
                and steps != len(schedule)):
            raise ValueError(
                f"{where}: ns_steps={steps!r} disagrees with the {len(schedule)} iterations "
                "listed in ns_coefficients"
            )
        group["ns_coefficients"] = list(schedule)
        group["ns_steps"] = len(schedule)

    def step_paths(self) -> dict[str, str]:
        """``{name: "fused" | "for_loop"}``: how each matrix's momentum is stepped (the Triton
        kernel, or the PyTorch reference of ``gefen_kernels.ops.muon_momentum``); the step uses
        exactly this choice. Newton–Schulz is ``torch.matmul`` on the parameter's device."""
        return {name: _muon_momentum_path(p, group) for group, p, name in self._named_params()}

    # ------------------------------------------------------------------ step
    def _check_matrices(self) -> None:
        """Every registered parameter must still be a whole 2-D matrix (docs/algorithm.md#gefenmuon,
        docs/algorithm.md#distributed)."""
        for _, p, name in self._named_params():
            if p.ndim != 2:
                raise ValueError(
                    f"GefenMuon: parameter {name!r} has shape {tuple(p.shape)} at step time. "
                    "It was a 2-D matrix when the optimizer was built, so a wrapper such as "
                    "DeepSpeed ZeRO has replaced the parameter groups with flattened 1-D "
                    "partitions. Muon needs whole matrices: use plain Gefen with ZeRO, or use "
                    "GefenMuon with FSDP2 or DDP"
                )

    def _muon_preflight(self) -> list[Entry]:
        """Structural checks of docs/algorithm.md#gefenmuon before any mutation: 2-D shapes, Gefen's
        gradient checks, and no DTensor parameter needing a sharded mode that is not built."""
        self._check_matrices()
        entries = self._preflight()
        self._check_sharded(entries)
        return entries

    def _check_sharded(self, entries: list[Entry]) -> None:
        """Refuse DTensor parameters: the sharded modes of docs/algorithm.md#distributed need
        collectives, which live in ``gefen_dist.ShardedGefenMuon`` (it overrides this hook and the
        two below)."""
        for group, p, _, name in entries:
            if _is_dtensor(p):
                raise ValueError(
                    f"GefenMuon: parameter {name!r} is a DTensor (FSDP2 / tensor parallel) and "
                    f"needs sharded_mode={group['sharded_mode']!r}, which "
                    "runs in gefen_dist.ShardedGefenMuon (same arguments) or, for a whole "
                    "model, gefen_dist.ShardedGefenMuonHybrid. gefen_core.GefenMuon steps plain "
                    "tensors only (one process or DDP)"
                )

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one GefenMuon step (docs/algorithm.md#gefenmuon).

        Args:
            closure (Callable, optional): re-evaluates the model and returns the loss; runs
                first, with gradients enabled.

        Returns:
            The closure's loss, or ``None``.

        Raises:
            ValueError: a parameter is no longer 2-D (flattened by a wrapper such as DeepSpeed
                ZeRO) or is a DTensor; nothing is mutated.
            RuntimeError: sparse, complex, shape- or device-mismatched gradients (before any
                mutation); graph capture without ``capturable``.
        """
        if torch.compiler.is_compiling():
            # docs/algorithm.md#compiled-stepping
            return _compiled_step.traced_muon_step(self, closure)
        return self._eager_step(closure)

    def _eager_step(self, closure: Callable[[], Any] | None) -> Any:
        _compiled_step.sync_global_step(self)
        self._capture_guard()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        entries = self._muon_preflight()
        if self._skip_nonfinite and self._step_is_nonfinite():
            self._record_skipped_step()
            return loss
        overflow, inv_scale = _amp.overflow_and_inverse_scale(self)
        if overflow:
            # docs/algorithm.md#mixed-precision: nothing learned, counted or touched; T unchanged.
            return loss
        if inv_scale is not None:
            _amp.unscale_([g for _, _, g, _ in entries], inv_scale)
        self._apply(entries)
        self.last_step_skipped = False
        return loss

    def _prepare(self, entries: list[Entry]) -> list[Entry] | None:
        """Codebook learning (docs/algorithm.md#codebook) and first periods
        (docs/algorithm.md#period-search): the entries to step, or ``None`` when the step must be
        skipped (non-finite gradients while learning the codebook)."""
        import warnings

        live = [e for e in entries if e[1].numel() > 0]
        if self._dense_momentum_for_testing:
            return live
        periods: dict[Tensor, int] = {}
        if self._codebook is None and live:
            if not self._all_finite([g for _, _, g, _ in live]):
                warnings.warn(
                    "GefenMuon: non-finite gradients on the step that would learn the codebook; "
                    "codebook learning is deferred and this step is skipped (decision O9)",
                    RuntimeWarning, stacklevel=3)
                return None
            self._codebook = self._learn(live, periods)
            self._codebook_cache = {}
        stepped = []
        for group, p, g, name in live:
            state = self.state[p]
            if "period" not in state:
                if p not in periods:
                    if not self._all_finite([g]):
                        warnings.warn(
                            f"GefenMuon: non-finite first gradient for {name!r}; its period "
                            "search is deferred and it is skipped this step (decision O9)",
                            RuntimeWarning, stacklevel=3)
                        continue
                    periods[p] = self._select_period(p, g, name, group)
                state["period"] = periods[p]
            stepped.append((group, p, g, name))
        return stepped

    def _apply(self, entries: list[Entry]) -> None:
        stepped = self._prepare(entries)
        if stepped is None:
            return
        per_group: dict[int, list[tuple[Tensor, Tensor, str]]] = {}
        for group, p, g, name in stepped:
            per_group.setdefault(id(group), []).append((p, g, name))
        self._step_groups([(group, per_group.get(id(group), [])) for group in self.param_groups])

    def _step_groups(self, grouped: list[tuple[dict[str, Any], list[tuple[Tensor, Tensor, str]]]],
                     ) -> None:
        """docs/algorithm.md#gefenmuon for each group's ``(param, grad, name)`` items, in order,
        then the step count. A traced step (docs/algorithm.md#compiled-stepping) groups its entries
        itself."""
        compiling = torch.compiler.is_compiling()
        for group, items in grouped:
            if not items:
                continue
            # A traced step keeps a tensor lr a tensor (reading it would end the graph; the
            # update op reads it) and takes its mode from the state's layout.
            capturable = (_compiled_step.counters_on_device(self.state[items[0][0]])
                          if compiling else group["capturable"])
            lr = group["lr"] if capturable or compiling else self._host_lr(group["lr"])
            serial = items
            if group["batched_ns"] and not capturable:
                serial = self._step_batched(group, items, lr)
            if compiling:
                self._traced_matrices_step(serial, group, lr)
                continue
            for p, g, name in serial:
                u = self._momentum(p, g, name, group)
                o = self._orthogonalise(u, group)
                self._finish(p, g, o, group, lr)
        if compiling:
            _compiled_step.advance_global_step(self)
            return
        for t in self._device_global_step.values():
            t.add_(1)
        self._global_step += 1
        _compiled_step.prepare(self)

    def _step_batched(self, group: dict[str, Any], items: list[tuple[Tensor, Tensor, str]],
                      lr: float | Tensor) -> list[tuple[Tensor, Tensor, str]]:
        """Step the batchable matrices of a group (docs/algorithm.md#gefenmuon) and return the rest,
        in order."""
        by_shape: dict[tuple[Any, ...], list[tuple[Tensor, Tensor, str]]] = {}
        serial = []
        for p, g, name in items:
            rows, cols = p.shape
            eligible = (min(rows, cols) <= _BATCH_MAX_MIN_DIM and rows * cols <= _BATCH_MAX_NUMEL
                        and not (group["fp8_ns"] and fp8_ns_eligible(p)))
            if eligible:
                by_shape.setdefault((rows, cols, g.dtype, p.device), []).append((p, g, name))
            else:
                serial.append((p, g, name))
        for (rows, cols, _, _), members in by_shape.items():
            sizes, rest = plan_ns_batches(len(members), rows, cols,
                                          group["batched_ns_workspace_bytes"],
                                          min_batch=_BATCH_MIN)
            start = 0
            for size in sizes:
                chunk = members[start:start + size]
                start += size
                stack = torch.stack([self._momentum(p, g, n, group) for p, g, n in chunk])
                outs = _newton_schulz(stack, group["ns_coefficients"], eps=group["eps"],
                                      dtype=self._ns_dtype)
                for (p, g, _), o in zip(chunk, outs.unbind(0), strict=True):
                    self._finish(p, g, o, group, lr)
            if rest:
                serial.extend(members[len(members) - rest:])
        return serial

    def _traced_matrices_step(self, items: list[tuple[Tensor, Tensor, str]],
                              group: dict[str, Any], lr: float | Tensor) -> None:
        """:meth:`_momentum`, :meth:`_orthogonalise` and :meth:`_finish` of a group's
        initialised matrices, in order, as one opaque op per device (and momentum path), while
        ``torch.compile`` traces the step (docs/algorithm.md#compiled-stepping)."""
        calls: dict[tuple[torch.device, bool, bool], dict[str, list[Any]]] = {}
        for p, g, name in items:
            state = self.state[p]
            key = (g.device, _muon_momentum_path(p, group) == "fused",
                   _compiled_step.counters_on_device(state))
            call = calls.get(key)
            if call is None:
                call = calls[key] = {k: [] for k in ("params", "grads", "codes", "scales",
                                                     "steps", "sqs", "sq_steps", "seeds",
                                                     "alphas")}
            call["params"].append(p)
            call["grads"].append(g)
            call["codes"].append(state["exp_avg_codes"])
            call["scales"].append(state["exp_avg_scale"])
            call["steps"].append(state["step"])
            if group["normuon"]:
                call["sqs"].append(state["normuon_exp_avg_sq"])
                call["sq_steps"].append(state["normuon_step"])
            if group["stochastic_round"]:
                call["seeds"].append(_compiled_step.seed_tensor(self, name, state, g.device))
            call["alphas"].append(adjusted_lr_ratio(group["adjust_lr_fn"], p.shape))
        for (device, fused, capturable), call in calls.items():
            _muon_update.matrices_step_opaque(
                call["params"], call["grads"], call["codes"], call["scales"], call["steps"],
                call["sqs"], call["sq_steps"], call["seeds"], self._codebook_on(device), lr=lr,
                alphas=call["alphas"], schedule=group["ns_coefficients"],
                beta=float(group["momentum"]), nesterov=group["nesterov"],
                maximize=group["maximize"], stochastic_round=group["stochastic_round"],
                fused_momentum=fused, ns_eps=group["eps"], ns_dtype=self._ns_dtype,
                fp8=group["fp8_ns"], fp8_compile=group["fp8_ns_compile"],
                weight_decay=group["weight_decay"],
                normuon_beta2=float(group["normuon_beta2"]), normuon_eps=group["normuon_eps"],
                use_cautious=group["cautious"], capturable=capturable)

    def _momentum(self, p: Tensor, g: Tensor, name: str, group: dict[str, Any]) -> Tensor:
        """docs/algorithm.md#gefenmuon steps 1–3: the quantized EMA, its age, and the (Nesterov)
        dense momentum."""
        state = self.state[p]
        dev = g.device
        step_dev = dev if group["capturable"] else torch.device("cpu")
        beta = float(group["momentum"])
        if self._dense_momentum_for_testing:
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = torch.zeros_like(g)
                state["step"] = torch.zeros((), dtype=torch.float32, device=step_dev)
            grad = g.neg() if group["maximize"] else g
            buf.mul_(beta).add_(grad, alpha=1.0 - beta)
            state["step"].add_(1)
            return buf * beta + grad * (1.0 - beta) if group["nesterov"] else buf.clone()
        period = state["period"]
        if "exp_avg_codes" not in state:
            # The gradient's numel, not the parameter's: under approx sharding
            # (docs/algorithm.md#distributed) the pipeline runs on a DTensor's local shard.
            blocks = g.numel() // period
            state["step"] = torch.zeros((), dtype=torch.float32, device=step_dev)
            state["exp_avg_codes"] = torch.zeros(blocks, period, dtype=torch.uint8, device=dev)
            state["exp_avg_scale"] = torch.zeros(blocks, 1, dtype=torch.float32, device=dev)
        elif not group["capturable"]:
            # A framework may have paged the parameter (docs/algorithm.md#step): follow the
            # gradient.
            for key in ("exp_avg_codes", "exp_avg_scale", "normuon_exp_avg_sq"):
                if key in state and state[key].device != dev:
                    state[key] = state[key].to(dev)
        from gefen_kernels.ops.muon_momentum import muon_momentum, muon_momentum_reference

        compiling = torch.compiler.is_compiling()
        # A traced step calls the op (opaque to the compiler, the reference's bits on the CPU)
        # and seeds from the step-count tensors (docs/algorithm.md#compiled-stepping). On the
        # CPU the op runs the native CPU step (the reference's bits, docs/decisions.md).
        momentum_fn = (muon_momentum if _muon_momentum_path(p, group) == "fused" or compiling
                       or g.device.type == "cpu" else muon_momentum_reference)
        seed = 0
        seed_tensor = None
        if group["stochastic_round"]:
            if compiling:
                seed_tensor = _compiled_step.seed_tensor(self, name, state, dev)
            elif group["capturable"]:
                from ._seeds import _SEED_MIX, _to_signed64

                seed_tensor = torch.bitwise_xor(
                    self._device_step(dev) * _to_signed64(_SEED_MIX),
                    _to_signed64(name_salt(name))).reshape(1)
            else:
                salt = name_salt(name)
                seed = mix_seed(self._global_step, salt)
        u = momentum_fn(
            g.contiguous(), state["exp_avg_codes"], state["exp_avg_scale"],
            self._codebook_on(dev), beta=beta, nesterov=group["nesterov"],
            maximize=group["maximize"], stochastic_round=group["stochastic_round"],
            seed=seed, seed_tensor=seed_tensor)
        state["step"].add_(1)
        return u.view(g.shape)

    def _orthogonalise(self, u: Tensor, group: dict[str, Any]) -> Tensor:
        return _newton_schulz(u, group["ns_coefficients"], eps=group["eps"],
                              dtype=self._ns_dtype, fp8=group["fp8_ns"],
                              fp8_compile=group["fp8_ns_compile"])

    def _finish(self, p: Tensor, g: Tensor, o: Tensor, group: dict[str, Any],
                lr: float | Tensor) -> None:
        """docs/algorithm.md#gefenmuon steps 5–8: NorMuon, cautious masking, decoupled decay and the
        update."""
        if torch.compiler.is_compiling():
            # One opaque op, so the compiled step rounds as the eager one
            # (docs/algorithm.md#compiled-stepping); a steady step has the NorMuon state.
            state = self.state[p]
            _muon_update.update_opaque(
                p, g, o, [state["normuon_exp_avg_sq"], state["normuon_step"]]
                if group["normuon"] else [], lr=lr, weight_decay=group["weight_decay"],
                alpha=adjusted_lr_ratio(group["adjust_lr_fn"], p.shape),
                normuon_beta2=float(group["normuon_beta2"]), normuon_eps=group["normuon_eps"],
                use_cautious=group["cautious"], maximize=group["maximize"],
                capturable=_compiled_step.counters_on_device(state))
            return
        self._apply_update(p, self._post_ns(p, g, o, group), group, lr)

    def _post_ns(self, p: Tensor, g: Tensor, o: Tensor, group: dict[str, Any]) -> Tensor:
        """docs/algorithm.md#gefenmuon steps 5–6 on the matrix the pipeline ran on (NorMuon,
        cautious masking)."""
        if group["normuon"]:
            o = self._normuon(p, o, group)
        if group["cautious"]:
            o = _muon_update.cautious(o, g, maximize=group["maximize"])
        return o

    def _update_target(self, p: Tensor, o: Tensor) -> tuple[Tensor, Tensor]:
        """The tensor to write and the part of ``o`` it receives: ``(p, o)`` here; a sharded
        subclass returns a DTensor's local shard and this rank's rows of the full ``o``."""
        return p, o

    def _apply_update(self, p: Tensor, o: Tensor, group: dict[str, Any],
                      lr: float | Tensor) -> None:
        """docs/algorithm.md#gefenmuon steps 7–8: decoupled decay, then ``θ ← θ − η·α(R, C)·O`` (α
        from the global shape, docs/algorithm.md#gefenmuon) on :meth:`_update_target`'s tensor."""
        alpha = adjusted_lr_ratio(group["adjust_lr_fn"], p.shape)
        p, o = self._update_target(p, o)
        _muon_update.write_update(p, o, lr, group["weight_decay"], alpha)

    def _normuon(self, p: Tensor, o: Tensor, group: dict[str, Any]) -> Tensor:
        """docs/algorithm.md#gefenmuon per-row normalisation; keeps ``‖O‖_F`` (so ``adjust_lr_fn``
        still holds)."""
        state = self.state[p]
        if "normuon_exp_avg_sq" not in state:
            step_dev = o.device if group["capturable"] else torch.device("cpu")
            state["normuon_exp_avg_sq"] = torch.zeros(o.shape[0], 1, dtype=torch.float32,
                                                      device=o.device)
            state["normuon_step"] = torch.zeros((), dtype=torch.float32, device=step_dev)
        return _muon_update.normuon(o, state["normuon_exp_avg_sq"], state["normuon_step"],
                                    beta2=float(group["normuon_beta2"]),
                                    eps=group["normuon_eps"], capturable=group["capturable"])

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Gefen's native checkpoint (contracts.md) plus the NorMuon state
        (docs/algorithm.md#distributed)."""
        from .checkpoint import build_state_dict

        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        if self._device_global_step:
            self._sync_global_step()
        sd = build_state_dict(self)
        index: dict[int, int] = {}
        for group in self.param_groups:
            for p in group["params"]:
                index.setdefault(id(p), len(index))
        for p, st in self.state.items():
            if id(p) in index and "normuon_exp_avg_sq" in st:
                entry = sd["state"].setdefault(index[id(p)], {})
                for key in NORMUON_STATE_KEYS:
                    entry[key] = st[key]
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, sd)
            if result is not None:
                sd = result
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a GefenMuon checkpoint, all-or-nothing (docs/algorithm.md#checkpoint-format,
        docs/algorithm.md#distributed).

        Gefen's staging validates the codes, scales, counters, codebook and groups; the Muon
        group options and the NorMuon state are validated here, before anything is
        committed. A rejected checkpoint raises ``ValueError`` and changes nothing.
        """
        state_dict = dict(state_dict)
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        staged = self.stage_load(state_dict)
        self.commit_load(staged)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def stage_load(self, state_dict: Mapping[str, Any]) -> Any:
        """Validate ``state_dict`` completely and return the staged load; mutates nothing.

        Together with :meth:`commit_load` this lets a container (the hybrid) validate several
        optimizers before committing any of them.
        """
        from .checkpoint import CheckpointError, split_state, stage_load

        def err(msg: str) -> CheckpointError:
            return CheckpointError(
                f"GefenMuon.load_state_dict: {msg}; the optimizer was left unchanged")

        if not isinstance(state_dict, Mapping):
            raise err(f"expected a dict, got {type(state_dict).__name__}")
        saved_state = state_dict.get("state")
        saved_groups = state_dict.get("param_groups")
        if not isinstance(saved_state, Mapping) or not isinstance(saved_groups, list):
            raise err("a state dict needs a 'state' dict and a 'param_groups' list")
        for i, g in enumerate(saved_groups):
            missing = [k for k in _MUON_KEYS if not isinstance(g, Mapping) or k not in g]
            if missing:
                raise err(f"param_groups[{i}] lacks the Muon options {missing}: this is not a "
                          "GefenMuon checkpoint")
        # Gefen's staging knows no NorMuon keys and requires a second moment with momentum;
        # give it the NorMuon-free entries plus a placeholder second moment, then drop it.
        param_state, gefen_state = split_state(saved_state, saved_groups)
        normuon: dict[Any, dict[str, Any]] = {}
        for sid, entry in param_state.items():
            if not isinstance(entry, Mapping):
                gefen_state[sid] = entry
                continue
            e = {k: v for k, v in entry.items() if k not in NORMUON_STATE_KEYS}
            extra = {k: entry[k] for k in NORMUON_STATE_KEYS if k in entry}
            if extra:
                normuon[sid] = extra
            for banned in ("exp_avg_sq", "exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq_step"):
                if banned in e:
                    raise err(f"state[{sid!r}] has {banned!r}: GefenMuon keeps no second moment")
            codes = e.get("exp_avg_codes")
            if isinstance(codes, Tensor) and codes.ndim == 2:
                e["exp_avg_sq"] = torch.zeros(codes.shape[0], 1, dtype=torch.float32)
            gefen_state[sid] = e
        sd = dict(state_dict)
        sd["state"] = gefen_state
        staged = stage_load(self, sd)
        for st in staged.state.values():
            st.pop("exp_avg_sq", None)
            st.pop("exp_avg_sq_step", None)
        # Muon group options, checked with the constructor's rules.
        for i, g in enumerate(staged.groups):
            where = f"param_groups[{i}]"
            try:
                g["ns_coefficients"] = list(resolve_ns_schedule(g["ns_coefficients"]))
                check_muon_options(g, where)
            except (TypeError, ValueError) as exc:
                raise err(str(exc)) from exc
            g["betas"] = (float(g["momentum"]), 0.0)
            g.update(_PINNED)
        # NorMuon entries: map saved ids to live parameters exactly as Gefen's staging did.
        if len(saved_groups) != len(self.param_groups):
            raise err(f"the checkpoint has {len(saved_groups)} parameter groups, the optimizer "
                      f"{len(self.param_groups)}")
        id_map: dict[Any, tuple[Tensor, dict[str, Any], str]] = {}
        for live, saved, new in zip(self.param_groups, saved_groups, staged.groups, strict=True):
            for sid, p, name in zip(saved["params"], live["params"], new["param_names"],
                                    strict=True):
                id_map[sid] = (p, new, name)
        for sid, extra in normuon.items():
            p, group, name = id_map[sid]
            st = staged.state.get(p, {})
            if "exp_avg_codes" not in st:
                raise err(f"state[{name!r}] has NorMuon statistics but no momentum")
            if set(extra) != set(NORMUON_STATE_KEYS):
                raise err(f"state[{name!r}] needs both {NORMUON_STATE_KEYS}, got {sorted(extra)}")
            v = extra["normuon_exp_avg_sq"]
            if (not isinstance(v, Tensor) or v.dtype != torch.float32
                    or tuple(v.shape) != (p.shape[0], 1)):
                got = (v.dtype, list(v.shape)) if isinstance(v, Tensor) else type(v).__name__
                raise err(f"state[{name!r}]['normuon_exp_avg_sq'] must be fp32 "
                          f"[{p.shape[0]}, 1], got {got}")
            if not bool(torch.isfinite(v).all()) or bool((v < 0).any()):
                raise err(f"state[{name!r}]['normuon_exp_avg_sq'] must be finite and >= 0")
            t = extra["normuon_step"]
            tv = float(t.detach().reshape(()).item()) if isinstance(t, Tensor) and t.numel() == 1 \
                else (float(t) if _is_real(t) else float("nan"))
            if not math.isfinite(tv) or tv < 1 or tv != int(tv):
                raise err(f"state[{name!r}]['normuon_step'] must be an integer >= 1, got {t!r}")
            step_dev = p.device if group["capturable"] else torch.device("cpu")
            st["normuon_exp_avg_sq"] = v.detach().to(device=p.device, copy=True)
            st["normuon_step"] = torch.tensor(tv, dtype=torch.float32, device=step_dev)
        return staged

    def commit_load(self, staged: Any) -> None:
        """Install a load validated by :meth:`stage_load` (assignments that cannot fail)."""
        from .checkpoint import commit

        commit(self, staged)


def _muon_momentum_path(p: Tensor, group: Mapping[str, Any]) -> str:
    """``"fused"`` (the custom op, Triton on CUDA) unless ``fused=False`` or the kernel cannot
    step ``p`` (the reasons of :func:`gefen_core.dispatch.fused_blocker`), else
    ``"for_loop"`` (the PyTorch reference)."""
    from .dispatch import fused_blocker

    if group["fused"] is not False and fused_blocker(p) is None:
        return "fused"
    return "for_loop"


def _fp8_visible() -> bool:
    if not torch.cuda.is_available():
        return False
    return any(fp8_ns_supported(torch.device("cuda", i))
               for i in range(torch.cuda.device_count()))


def _with_flag_docs(doc: str) -> str:
    # The shared flag text of gefen_core._docs (str.format would trip over the LaTeX braces).
    from . import _docs

    parts = {"maximize": _docs.MAXIMIZE_DOC, "foreach": _docs.FOREACH_DOC,
             "capturable": _docs.CAPTURABLE_DOC, "differentiable": _docs.DIFFERENTIABLE_DOC,
             "skip_nonfinite": _docs.SKIP_NONFINITE_DOC,
             "nan_policy": _docs.NAN_POLICY.replace("\n            ", "\n    ")}
    for key, text in parts.items():
        doc = doc.replace("{" + key + "}", text)
    return doc


GefenMuon.__doc__ = _with_flag_docs(GefenMuon.__doc__ or "")
