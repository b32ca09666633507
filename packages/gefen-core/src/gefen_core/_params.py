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

from . import dispatch as _dispatch

PERIOD_SEARCH_VARIANTS = ("log_contrast", "variance")

# Keys of a group that describe *how* a parameter is stepped rather than *what* is optimised.
# On load the live optimizer keeps these (so fused<->reference, capturable<->non-capturable and
# factored<->block migrations of docs/algorithm.md#checkpoint-format are made by constructing the
# new optimizer), while the hyperparameters and user extras come from the checkpoint.
IMPLEMENTATION_KEYS = ("foreach", "fused", "capturable", "differentiable", "factored_v_2d")


def _is_real_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def torch_error(torch_text: str, where: str, hint: str) -> str:
    """A message that starts with ``torch.optim``'s own text for the same mistake (so code and
    tests matching torch's wording keep working) and then names the group and the fix."""
    return f"{torch_text} ({where}: {hint})"


#: torch.optim's wording for the learning-rate mistakes: ``"adamw"`` (Adam, AdamW, and so
#: Gefen) or ``"muon"`` (torch.optim.Muon, and so GefenMuon).
_LR_TEXT = {"adamw": "Invalid learning rate: {}", "muon": "Learning rate should be >= 0 but is: {}"}
_WD_TEXT = {"adamw": "Invalid weight_decay value: {}",
            "muon": "weight decay should be >= 0 but is: {}"}


def check_lr(lr: Any, where: str, wording: str = "adamw") -> None:
    """Check a learning rate: a float >= 0 or a 1-element real floating tensor holding one.

    Raises ``ValueError`` with torch's text for the same mistake (``wording`` picks AdamW's or
    Muon's); a non-finite lr, which torch accepts, is refused with the same text.
    """
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError(torch_error(
                "Tensor lr must be 1-element", where,
                f"got shape {tuple(lr.shape)}; pass a 0-dim tensor such as torch.tensor(1e-3)"))
        if lr.is_complex() or not lr.is_floating_point():
            raise ValueError(f"{where}: a tensor lr must be a real floating tensor, got {lr.dtype}")
        value = float(lr.detach().reshape(()).item())
    elif _is_real_number(lr):
        value = float(lr)
    else:
        raise TypeError(
            f"{where}: lr must be a float or a 1-element tensor, got {type(lr).__name__}")
    if not math.isfinite(value) or value < 0.0:
        raise ValueError(torch_error(_LR_TEXT[wording].format(lr), where,
                                     "lr must be finite and >= 0"))


def check_weight_decay(wd: Any, where: str, wording: str = "adamw") -> None:
    """Check a decoupled weight decay: a finite float >= 0 (torch's text for a negative one)."""
    if not _is_real_number(wd):
        raise TypeError(f"{where}: weight_decay must be a float, got {type(wd).__name__}")
    if not math.isfinite(wd) or wd < 0.0:
        raise ValueError(torch_error(_WD_TEXT[wording].format(wd), where,
                                     "weight_decay must be finite and >= 0"))


def check_eps(eps: Any, where: str) -> None:
    """Check ``eps``: a finite float > 0 (torch refuses only negative ones; see
    docs/internals/torch-optim-deviations.md)."""
    if not _is_real_number(eps):
        raise TypeError(f"{where}: eps must be a float, got {type(eps).__name__}")
    if not math.isfinite(eps) or eps <= 0.0:
        raise ValueError(torch_error(f"Invalid epsilon value: {eps}", where,
                                     "eps must be finite and > 0"))


def check_betas(betas: Any, where: str) -> tuple[Any, Any]:
    """Check ``betas = (beta1, beta2)``, each in [0, 1): two numbers, or two 1-element real
    floating tensors as ``torch.optim.AdamW`` accepts them.

    Returns:
        ``(float, float)``, or the two tensors as 0-dim tensors (a 1-element tensor of higher
        rank becomes a 0-dim view of it, as AdamW stores it), so an in-place change by the
        caller reaches the optimizer.

    Raises:
        TypeError: not a pair; an entry that is neither a number nor a tensor.
        ValueError: a pair of the wrong length, an entry out of range, a float mixed with a
            tensor, a tensor of more than one element or not real floating (torch's texts).
    """
    if isinstance(betas, (str, bytes, Tensor)) or not isinstance(betas, Iterable):
        raise TypeError(f"{where}: betas must be a pair of floats (beta1, beta2), got {betas!r}")
    pair = tuple(betas)
    if len(pair) != 2:
        raise ValueError(f"{where}: betas must have two entries (beta1, beta2), got {pair!r}")
    tensors = [isinstance(b, Tensor) for b in pair]
    for i, b in enumerate(pair):
        if not tensors[i] and not _is_real_number(b):
            raise TypeError(f"{where}: betas[{i}] must be a float, got {type(b).__name__}")
        if tensors[i]:
            if b.numel() != 1:
                raise ValueError(torch_error(
                    f"Tensor betas[{i}] must be 1-element", where,
                    f"got shape {tuple(b.shape)}; pass 0-dim tensors"))
            if b.is_complex() or not b.is_floating_point():
                raise ValueError(
                    f"{where}: a tensor betas[{i}] must be a real floating tensor, got {b.dtype}")
    values = [float(b.detach().reshape(()).item()) if t else float(b)
              for b, t in zip(pair, tensors)]
    for i, (b, v) in enumerate(zip(pair, values)):
        if not (0.0 <= v < 1.0):
            raise ValueError(torch_error(f"Invalid beta parameter at index {i}: {b}", where,
                                         "need 0 <= beta < 1"))
    if tensors[0] != tensors[1]:
        raise ValueError(torch_error("betas must be either both floats or both Tensors", where,
                                     "make both tensors or both Python floats"))
    if tensors[0]:
        return (pair[0] if pair[0].dim() == 0 else pair[0].squeeze(),
                pair[1] if pair[1].dim() == 0 else pair[1].squeeze())
    return (values[0], values[1])


def check_group_options(group: Mapping[str, Any], where: str) -> None:
    """Validate every hyperparameter and option of one (complete) group, in the order
    ``torch.optim.AdamW`` checks them (lr, eps, betas, weight_decay)."""
    check_lr(group["lr"], where)
    check_eps(group["eps"], where)
    check_betas(group["betas"], where)
    check_weight_decay(group["weight_decay"], where)
    for key in ("maximize", "capturable", "factored_v_2d", "stochastic_round",
                "force_1d_period_one", "force_2d_period_one"):
        if not isinstance(group[key], bool):
            raise TypeError(f"{where}: {key} must be a bool, got {group[key]!r}")
    min_dim = group["min_dim_size_to_factor"]
    if not isinstance(min_dim, int) or isinstance(min_dim, bool) or min_dim < 0:
        raise ValueError(
            f"{where}: min_dim_size_to_factor must be an int >= 0 (a 2-D parameter is factored "
            f"when both sides are at least this; 0 factors every 2-D parameter), got "
            f"{min_dim!r}"
        )
    for key in ("foreach", "fused"):
        if group[key] is not None and not isinstance(group[key], bool):
            raise TypeError(f"{where}: {key} must be None or a bool, got {group[key]!r}")
    if group["differentiable"] is not False:
        raise RuntimeError(
            ("`fused` does not support `differentiable`; " if group["fused"] else "")
            + f"{where}: Gefen does not support differentiable=True: the momentum is "
            "re-quantized to uint8 codes every step, which has no gradient. Use "
            "differentiable=False (the default), or torch.optim.AdamW(differentiable=True) for "
            "meta-learning."
        )
    if group["amsgrad"] is not False:
        raise RuntimeError(
            f"{where}: Gefen does not support amsgrad=True (it would need a per-element running "
            "maximum of the second moment, 4 bytes/param); use amsgrad=False"
        )
    if group["fused"] and group["foreach"]:
        raise RuntimeError(torch_error("`fused` and `foreach` cannot be `True` together.", where,
                                       "pick one"))
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
        raise TypeError(torch_error(
            "optimizer parameters need to be organized in ordered collections, but the ordering "
            "of tensors in sets will change between runs. Please use a list instead.", where,
            "params must be an ordered collection; pass a list"))
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
            raise TypeError(torch_error(
                "optimizer can only optimize Tensors, but one of the params is "
                f"{torch.typename(tensor)}", where, f"params[{i}] is not a tensor"))
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
            raise ValueError(torch_error(
                "can't optimize a non-leaf Tensor", where,
                f"params[{i}] is the result of an operation; pass the leaf tensor it came from"))
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


def live_names(groups: list[dict[str, Any]]) -> list[tuple[list[str], list[bool]]]:
    """Each group's ``(param_names, param_names_synthesized)``, valid for its current
    ``params``.

    A wrapper may rebind ``group["params"]`` after construction (FSDP/Accelerate-style flat
    parameters, DeepSpeed ZeRO partitions), leaving the parallel name lists describing tensors
    the group no longer holds. Such a group's tensors get positional names
    ``group_{g}_param_{i}``, flagged synthesized (docs/algorithm.md#checkpoint-format), unique
    among the other groups' names; consistent groups are returned as they are. Pure: the
    groups are not changed.
    """
    out: list[tuple[list[str], list[bool]] | None] = []
    for group in groups:
        names = group.get("param_names")
        flags = group.get("param_names_synthesized")
        n = len(group["params"])
        if isinstance(names, list) and isinstance(flags, list) \
                and len(names) == n and len(flags) == n:
            out.append((names, flags))
        else:
            out.append(None)
    taken = {name for entry in out if entry is not None for name in entry[0]}
    result: list[tuple[list[str], list[bool]]] = []
    for index, (group, entry) in enumerate(zip(groups, out)):
        if entry is None:
            entry = assign_names([None] * len(group["params"]), group_index=index,
                                 group_name=None, implicit=False, registered=taken,
                                 registered_count=0)
            taken.update(entry[0])
        result.append(entry)
    return result


def new_group(param_group: Any, *, defaults: Mapping[str, Any], groups: list[dict[str, Any]],
              implicit: bool, refresh_every: int) -> dict[str, Any]:
    """The complete, validated group ``Gefen.add_param_group`` registers for ``param_group``
    (names and provenance assigned, defaults filled in); nothing is registered here.

    ``groups`` are the groups registered so far, ``implicit`` whether this is the one group a
    plain parameter list forms, ``refresh_every`` the optimizer's ``codebook_refresh_every``.

    Raises:
        TypeError, ValueError, RuntimeError: with ``torch.optim``'s text where it refuses the
            same input, naming the group.
    """
    index = len(groups)
    where = f"Gefen param group {index}"
    if not isinstance(param_group, dict):
        raise TypeError(torch_error(f"param_group must be a dict, but got {type(param_group)}",
                                    where, "pass {'params': [...], ...}"))
    if "params" not in param_group:
        raise ValueError(f"{where}: a param group dict needs a 'params' entry")
    group = dict(param_group)
    tensors, raw_names = split_params(group["params"], where)
    group["params"] = tensors
    caller_names = group.pop("param_names", None)
    if caller_names is not None:
        if len(caller_names) != len(tensors) or any(n is not None for n in raw_names):
            raise ValueError(f"{where}: param_names must list one name per tensor")
        raw_names = [str(n).lower() for n in caller_names]
    group.pop("param_names_synthesized", None)
    merge_betas(group, where)
    for key, default in defaults.items():
        group.setdefault(key, default)
    group["betas"] = check_betas(group["betas"], where)
    group["period_one_substrings"] = normalize_substrings(group["period_one_substrings"], where)
    check_group_options(group, where)
    if group["capturable"] and refresh_every > 0:
        raise ValueError(f"{where}: capturable=True is incompatible with codebook refresh")
    if "name" in group:
        if not isinstance(group["name"], str):
            raise TypeError(f"{where}: a group 'name' must be a str, got {group['name']!r}")
        group["name"] = group["name"].lower()

    seen: set[int] = set()
    for t in tensors:
        if id(t) in seen:
            raise ValueError(
                f"{where}: a tensor appears twice in this group (tied parameters must be "
                "passed once; model.parameters() already deduplicates them)"
            )
        seen.add(id(t))
    registered: set[str] = set()
    registered_count = 0
    for g, (names, _) in zip(groups, live_names(groups)):
        registered.update(names)
        registered_count += len(g["params"])
        if any(id(p) in seen for p in g["params"]):
            raise ValueError(torch_error(
                "some parameters appear in more than one parameter group", where,
                "each tensor may be listed in one group only"))
    names, synthesized = assign_names(
        raw_names, group_index=index, group_name=group.get("name"),
        implicit=implicit, registered=registered, registered_count=registered_count,
    )
    if group["fused"] is True:
        for t, name in zip(tensors, names):
            why = _dispatch.fused_blocker(t)
            if why is not None:
                raise RuntimeError(
                    f"{where}: fused=True cannot be honoured for parameter {name!r}: {why}. "
                    "Pass fused=None to take the fastest available path per tensor."
                )
    group["param_names"] = names
    group["param_names_synthesized"] = synthesized
    return group
