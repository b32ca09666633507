"""The one table of names that ``gefen`` re-exports.

Each entry maps a public name to ``(module, extra)``: the import name of the distribution
that defines it and the ``gefen-x`` extra that installs that distribution (``None`` for the
distributions every ``gefen-x`` install has). Adding a re-export is one line here;
``scripts/check_extras_sync.py`` checks that every extra named here exists in
``packages/gefen-x/pyproject.toml``.
"""

from __future__ import annotations

from typing import Final

#: import name -> distribution name, for error messages.
DISTRIBUTIONS: Final[dict[str, str]] = {
    "gefen_kernels": "gefen-kernels",
    "gefen_core": "gefen-core",
    "gefen_dist": "gefen-dist",
    "gefen_bench": "gefen-bench",
}

#: public name -> (module that defines it, gefen-x extra that installs it or None).
EXPORTS: Final[dict[str, tuple[str, str | None]]] = {
    # gefen-core: the optimizers (always installed with gefen-x).
    "Gefen": ("gefen_core", None),
    "gefen": ("gefen_core", None),
    "GefenMuon": ("gefen_core", None),
    "GefenMuonHybrid": ("gefen_core", None),
    "split_params_for_muon": ("gefen_core", None),
    "validate_split": ("gefen_core", None),
    "step_in_backward": ("gefen_core", None),
    "BackwardStep": ("gefen_core", None),
    "warm_up": ("gefen_core", None),
    # gefen-dist: engines and distributed checkpoints.
    "ShardedGefen": ("gefen_dist", "dist"),
    "ShardedGefenMuon": ("gefen_dist", "dist"),
    "ShardedGefenMuonHybrid": ("gefen_dist", "dist"),
    "GefenDCPState": ("gefen_dist", "dist"),
    "GefenSavePlanner": ("gefen_dist", "dist"),
    "GefenStager": ("gefen_dist", "dist"),
}
