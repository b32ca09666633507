"""gefen-core: the Gefen optimizer (arXiv:2606.13894), an AdamW replacement with about one
byte of optimizer state per parameter.

Public API: :class:`Gefen` (the ``torch.optim.Optimizer``) and :func:`gefen` (the functional
step over tensor lists); :class:`GefenMuon` (Muon with Gefen's quantized momentum) and
:class:`GefenMuonHybrid` (Muon for hidden matrices, Gefen or AdamW for the rest), with
:func:`split_params_for_muon` / :func:`validate_split` for the routing;
:func:`step_in_backward` steps Gefen inside the backward pass, releasing each gradient at
once; :func:`warm_up` compiles a model's step kernels ahead of a job. The fused per-tensor
ops come from ``gefen_kernels``, whose ``KERNEL_API_VERSION`` is checked here at import.
"""

from __future__ import annotations

import gefen_kernels as _gefen_kernels

from ._version import __version__

# gefen_kernels API versions this release of gefen_core is written against (inclusive).
KERNEL_API_RANGE = (1, 1)


def _check_kernel_api() -> None:
    found = getattr(_gefen_kernels, "KERNEL_API_VERSION", None)
    lo, hi = KERNEL_API_RANGE
    if not isinstance(found, int) or not lo <= found <= hi:
        raise ImportError(
            f"gefen-core {__version__} needs gefen-kernels with KERNEL_API_VERSION in "
            f"[{lo}, {hi}], but the installed gefen-kernels "
            f"{getattr(_gefen_kernels, '__version__', '?')} reports {found!r}. Install a "
            "matching pair, e.g. `pip install -U gefen-core gefen-kernels`."
        )


_check_kernel_api()

from .backward_step import BackwardStep, step_in_backward  # noqa: E402
from .functional import gefen  # noqa: E402
from .hybrid import GefenMuonHybrid  # noqa: E402
from .muon import GefenMuon  # noqa: E402
from .optimizer import Gefen  # noqa: E402
from .routing import split_params_for_muon, validate_split  # noqa: E402
from .warm_up import warm_up  # noqa: E402

__all__ = [
    "KERNEL_API_RANGE",
    "BackwardStep",
    "Gefen",
    "GefenMuon",
    "GefenMuonHybrid",
    "__version__",
    "gefen",
    "split_params_for_muon",
    "step_in_backward",
    "validate_split",
    "warm_up",
]
