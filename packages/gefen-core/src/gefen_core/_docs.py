"""Flag and behaviour text, written once and interpolated into every docstring.

The dispatch rule stated in :data:`DISPATCH_RULE` is the one implemented by
:func:`gefen_core.dispatch.choose_path`; change both together.
"""

from __future__ import annotations

DISPATCH_RULE = r"""Each parameter is stepped by one of three implementations, chosen per tensor:

            * ``"fused"``: the Triton kernels of ``gefen_kernels`` (CUDA only);
            * ``"foreach"``: the PyTorch reference ops, with the per-step bookkeeping
              (counters, bias corrections) batched over the tensor list;
            * ``"for_loop"``: the PyTorch reference ops, one tensor at a time.

            An explicit flag always wins. With ``fused=None`` a parameter takes the fused path
            when it lives on CUDA, its dtype is fp32, bf16 or fp16, and
            ``gefen_kernels.triton_available()`` is true; otherwise it takes ``"foreach"`` on
            CUDA and ``"for_loop"`` elsewhere (``foreach=False`` forces the for-loop).
            ``deterministic=True`` routes factored (2-D) parameters to the reference, whose
            row/column reductions have a fixed order. ``fused=True`` that cannot be honoured
            for some parameter (CPU tensor, fp64, no Triton) raises at construction, naming the
            parameter; it never falls back to a slower path silently.
            :meth:`Gefen.step_paths` returns the path of every parameter."""

FOREACH_DOC = r"""foreach (bool, optional): batch the per-step bookkeeping (counter increments,
            bias corrections) over the tensor list. The per-tensor math is the same reference
            op, so ``foreach`` and the for-loop give bit-identical results (default: None)"""

FUSED_DOC = r"""fused (bool, optional): use the Triton kernels of ``gefen_kernels`` on CUDA
            tensors of dtype fp32, bf16 or fp16. ``None`` picks them when available
            (see the dispatch rule below); ``True`` that cannot be honoured raises at
            construction (default: None)"""

CAPTURABLE_DOC = r"""capturable (bool, optional): keep step counters, bias corrections, the
            learning rate and stochastic-rounding seeds on the parameter's device so that
            ``step()`` can be captured in a CUDA graph or compiled without host syncs. The first
            step (period search and codebook learning) must run eagerly before capture.
            Incompatible with ``codebook_refresh_every > 0`` (default: False)"""

DIFFERENTIABLE_DOC = r"""differentiable (bool, optional): must be ``False``. The momentum is
            re-quantized to uint8 codes every step, which has no gradient, so autograd through
            the step is not supported; ``True`` raises (default: False)"""

MIN_DIM_SIZE_TO_FACTOR_DOC = r"""min_dim_size_to_factor (int, optional): with ``factored_v_2d``, a
            2-D parameter is factored only if both sides of its (global) shape are at least
            this; smaller matrices keep the per-block second moment, which estimates them
            better (docs/algorithm.md#factoring-rule; Adafactor's convention). ``0`` factors
            every 2-D parameter, the rule before this option. An int >= 0, per group, saved
            with the group; a checkpoint without it loads with ``0``, the rule it was saved
            under, so every parameter keeps its mode (default: 128)"""

MAXIMIZE_DOC = r"""maximize (bool, optional): maximize the objective with respect to the
            params, instead of minimizing (default: False)"""

SKIP_NONFINITE_DOC = r"""skip_nonfinite (bool, optional): skip a step whose gradients hold any NaN
            or Inf element: parameters, state, step counters and the codebook stay untouched,
            the step is counted in ``skipped_steps`` and ``last_step_skipped`` is set
            (docs/algorithm.md#non-finite-gradients). Costs one host read per device per step;
            incompatible with ``capturable=True``; optimizer-wide (default: False)"""

NAN_POLICY = r"""Non-finite gradients (docs/algorithm.md#non-finite-gradients): with
            ``skip_nonfinite=True`` a step whose gradients hold any NaN or Inf element changes
            nothing (parameters, state, step counters, codebook) and is counted in
            ``skipped_steps``; the distributed classes decide it over every rank's gradients
            with one all-reduce. Without it: on the step that would learn the codebook, a
            non-finite gradient in any participating tensor defers codebook learning and skips
            that step entirely (a warning is issued); the same holds for the period search of
            a parameter that first receives a gradient later (that parameter is skipped for
            the step). Once state exists, a non-finite element is not guarded and, unlike in
            ``torch.optim.AdamW``, does not stay in its own coordinate: it makes its block's
            scale and second moment non-finite, so the whole block of the parameter becomes
            NaN; factored 2-D parameters get a NaN row and column through the element, and
            every other element of the matrix then gets a zero update (the mean row statistic
            is infinite). Every path (references and Triton kernels) applies this rule."""


def interpolate(doc: str, **parts: str) -> str:
    """``doc`` with each ``{key}`` replaced by its text (str.format would trip over the braces
    of a LaTeX block)."""
    for key, text in parts.items():
        doc = doc.replace("{" + key + "}", text)
    return doc
