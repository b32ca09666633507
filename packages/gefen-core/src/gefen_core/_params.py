"""Parameter groups, names and hyperparameter validation (docs/algorithm.md#overview).

Everything here is pure: it builds or checks plain dicts and never touches an optimizer, so
the constructor, ``add_param_group`` and ``load_state_dict`` can validate a whole group (or a
whole checkpoint) before anything is registered.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

PERIOD_SEARCH_VARIANTS = ("log_contrast", "variance")

# Keys of a group that describe *how* a parameter is stepped rather than *what* is optimised.
# On load the live optimizer keeps these (so fused<->reference, capturable<->non-capturable and
# factored<->block migrations of docs/algorithm.md#checkpoint-format are made by constructing the
# new optimizer), while the hyperparameters and user extras come from the checkpoint.
IMPLEMENTATION_KEYS = ("foreach", "fused", "capturable", "differentiable", "factored_v_2d")


def _is_real_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_lr(lr: Any, where: str) -> None:
    """Check a learning rate: a float >= 0 or a 1-element tensor holding one."""
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError(
                f"{where}: a tensor lr must have exactly one element, got shape "
                f"{tuple(lr.shape)}; pass a 0-dim tensor such as torch.tensor(1e-3)"
            )
        if lr.is_complex() or not lr.is_floating_point():
            raise ValueError(f"{where}: a tensor lr must be a real floating tensor, got {lr.dtype}")
        value = float(lr.detach().reshape(()).item())
    elif _is_real_number(lr):
        value = float(lr)
    else:
        raise TypeError(
            f"{where}: lr must be a float or a 1-element tensor, got {type(lr).__name__}")
    if not math.isfinite(value) or value < 0.0:
        raise ValueError(f"{where}: invalid learning rate lr={value}; it must be finite and >= 0")


def check_betas(betas: Any, where: str) -> tuple[float, float]:
    """Check ``betas = (beta1, beta2)``, each a float in [0, 1). Returns it as a tuple."""
    if isinstance(betas, (str, bytes, Tensor)) or not isinstance(betas, Iterable):
        raise TypeError(f"{where}: betas must be a pair of floats (beta1, beta2), got {betas!r}")
    pair = tuple(betas)
    if len(pair) != 2:
        raise ValueError(f"{where}: betas must have two entries (beta1, beta2), got {pair!r}")
    for i, b in enumerate(pair):
        if isinstance(b, Tensor):
            raise TypeError(
                f"{where}: betas[{i}] is a tensor; Gefen takes Python floats for betas "
                f"(use float(...))"
            )
        if not _is_real_number(b):
            raise TypeError(f"{where}: betas[{i}] must be a float, got {type(b).__name__}")
        if not (0.0 <= float(b) < 1.0):
            raise ValueError(
                f"{where}: invalid beta parameter at index {i}: {b}; need 0 <= beta < 1")
    return (float(pair[0]), float(pair[1]))


def check_group_options(group: Mapping[str, Any], where: str) -> None:
    """Validate every hyperparameter and option of one (complete) group,
    docs/algorithm.md#overview."""
    check_lr(group["lr"], where)
    check_betas(group["betas"], where)
    eps = group["eps"]
    if not _is_real_number(eps) or not math.isfinite(eps) or eps <= 0.0:
        raise ValueError(f"{where}: invalid epsilon value eps={eps!r}; it must be finite and > 0")
    wd = group["weight_decay"]
    if not _is_real_number(wd) or not math.isfinite(wd) or wd < 0.0:
        raise ValueError(
            f"{where}: invalid weight_decay value {wd!r}; it must be finite and >= 0"
        )
    for key in ("maximize", "capturable", "factored_v_2d", "stochastic_round",
                "force_1d_period_one", "force_2d_period_one"):
        if not isinstance(group[key], bool):
            raise TypeError(f"{where}: {key} must be a bool, got {group[key]!r}")
    for key in ("foreach", "fused"):
        if group[key] is not None and not isinstance(group[key], bool):
            raise TypeError(f"{where}: {key} must be None or a bool, got {group[key]!r}")
    if group["differentiable"] is not False:
        raise RuntimeError(
            f"{where}: Gefen does not support differentiable=True: the momentum is re-quantized "
            "to uint8 codes every step, which has no gradient. Use differentiable=False (the "
            "default), or torch.optim.AdamW(differentiable=True) for meta-learning."
        )
    if group["amsgrad"] is not False:
        raise RuntimeError(
            f"{where}: Gefen does not support amsgrad=True (it would need a per-element running "
            "maximum of the second moment, 4 bytes/param); use amsgrad=False"
        )
    if group["fused"] and group["foreach"]:
        raise RuntimeError(f"{where}: fused=True and foreach=True cannot both be set; pick one")
    if group["period_search"] not in PERIOD_SEARCH_VARIANTS:
        raise ValueError(
            f"{where}: period_search must be one of {PERIOD_SEARCH_VARIANTS}, got "
            f"{group['period_search']!r}"
        )
    subs = group["period_one_substrings"]
    if not isinstance(subs, tuple) or not all(isinstance(s, str) for s in subs):
        raise TypeError(
            f"{where}: period_one_substrings must be a tuple of str, got {subs!r}"
        )


def normalize_substrings(subs: Any, where: str) -> tuple[str, ...]:
    """``period_one_substrings`` as a lower-cased tuple; a bare string is refused (it would be
    read as its characters)."""
    if isinstance(subs, str):
        raise TypeError(
            f"{where}: period_one_substrings must be a tuple of strings, got the string "
            f"{subs!r}; write ({subs!r},)"
        )
    if isinstance(subs, Tensor) or not isinstance(subs, Iterable):
        raise TypeError(f"{where}: period_one_substrings must be a tuple of str, got {subs!r}")
    out = tuple(subs)
    for s in out:
        if not isinstance(s, str):
            raise TypeError(
                f"{where}: period_one_substrings entries must be str, got {type(s).__name__}"
            )
    return tuple(s.lower() for s in out)


def merge_betas(group: dict[str, Any], where: str) -> None:
    """Accept ``beta1``/``beta2`` on input (O1) and store the canonical ``betas`` pair."""
    has_split = "beta1" in group or "beta2" in group
    if not has_split:
        return
    if "betas" in group:
        raise ValueError(
            f"{where}: give either betas=(b1, b2) or beta1/beta2, not both"
        )
    if "beta1" not in group or "beta2" not in group:
        raise ValueError(f"{where}: beta1 and beta2 must be given together (or use betas)")
    group["betas"] = (group.pop("beta1"), group.pop("beta2"))


def split_params(raw: Any, where: str) -> tuple[list[Tensor], list[str | None]]:
    """Split a group's ``params`` into tensors and optional caller names, checking each."""
    if isinstance(raw, Tensor):
        items: list[Any] = [raw]
    elif isinstance(raw, (set, frozenset)):
        raise TypeError(
            f"{where}: params must be an ordered collection (the order of a set changes between "
            "runs); pass a list"
        )
    elif isinstance(raw, Iterable):
        items = list(raw)
    else:
        raise TypeError(f"{where}: params must be tensors or (name, tensor) pairs, got {raw!r}")
    tensors: list[Tensor] = []
    names: list[str | None] = []
    for i, item in enumerate(items):
        if isinstance(item, tuple):
            if len(item) != 2 or not isinstance(item[0], str):
                raise TypeError(
                    f"{where}: params[{i}] is a tuple but not a (name: str, tensor) pair"
                )
            name, tensor = item
        else:
            name, tensor = None, item
        if not isinstance(tensor, Tensor):
            raise TypeError(
                f"{where}: Gefen can only optimize tensors, but params[{i}] is "
                f"{torch.typename(tensor)}"
            )
        if tensor.is_complex():
            raise ValueError(
                f"{where}: params[{i}]{'' if name is None else ' (' + name + ')'} is complex "
                f"({tensor.dtype}); Gefen supports real floating parameters only "
                "(view it as real with torch.view_as_real and optimize that)"
            )
        if not tensor.is_floating_point():
            raise ValueError(
                f"{where}: params[{i}] has dtype {tensor.dtype}; Gefen optimizes floating tensors"
            )
        if not (tensor.is_leaf or tensor.retains_grad):
            raise ValueError(f"{where}: params[{i}] is a non-leaf tensor; can't optimize it")
        tensors.append(tensor)
        names.append(None if name is None else name.lower())
    return tensors, names


def assign_names(
    names: list[str | None],
    *,
    group_index: int,
    group_name: str | None,
    implicit: bool,
    registered: set[str],
    registered_count: int,
) -> tuple[list[str], list[bool]]:
    """Names and provenance flags per docs/algorithm.md#overview (synthesized names and collision
    suffixes)."""
    out: list[str] = []
    synthesized: list[bool] = []
    taken = set(registered)
    for i, name in enumerate(names):
        synth = name is None
        if name is None:
            if implicit:
                name = f"param_{registered_count + i}"
            elif group_name is not None and len(names) == 1:
                name = group_name
                synth = False
            else:
                name = f"group_{group_index}_param_{i}"
        if name in taken:
            k = 1
            while f"{name}_{k}" in taken:
                k += 1
            name = f"{name}_{k}"
            synth = True
        taken.add(name)
        out.append(name)
        synthesized.append(synth)
    return out, synthesized
