"""The native checkpoint format: build, stage, validate, commit
(docs/algorithm.md#checkpoint-format).

Layout (docs/internals/contracts.md): torch's ``{"state": {i: ...}, "param_groups": [...]}``
plus ``gefen_meta`` at the top level and mirrored into every group, because distributed
checkpoint normalisation keeps only ``state`` and ``param_groups``.

Loading is fail-before-mutation: :func:`stage_load` builds the complete new state, groups,
step count and codebook from the input without touching the optimizer and validates all of
it; only then does :func:`commit` swap it in with plain assignments that cannot fail.
"""

from __future__ import annotations

import copy
import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from . import _params
from . import dispatch as _dispatch

if TYPE_CHECKING:
    from .optimizer import Gefen

FORMAT_VERSION = 1
META_KEY = "gefen_meta"
COUNTER_KEYS = ("step", "exp_avg_sq_step")
TENSOR_KEYS = ("exp_avg_codes", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_row", "exp_avg_sq_col")
STATE_KEYS = frozenset(("period",) + COUNTER_KEYS + TENSOR_KEYS)

class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; nothing was changed."""


def _err(msg: str) -> CheckpointError:
    return CheckpointError(f"Gefen.load_state_dict: {msg}; the optimizer was left unchanged")


# ---------------------------------------------------------------------------------- save
def build_state_dict(opt: Gefen) -> dict[str, Any]:
    """``Gefen.state_dict()`` without hooks. State tensors are returned by reference, like
    ``torch.optim``; the codebook is a copy."""
    codebook = None if opt._codebook is None else opt._codebook.detach().clone()
    meta = {"format_version": FORMAT_VERSION, "global_step": int(opt._global_step),
            "codebook": codebook, "deterministic": bool(opt._deterministic)}
    index: dict[int, int] = {}
    groups = []
    for group, (names, flags) in zip(opt.param_groups, _params.live_names(opt.param_groups)):
        packed = {k: v for k, v in group.items() if k != "params"}
        ids = []
        for p in group["params"]:
            ids.append(index.setdefault(id(p), len(index)))
        packed["params"] = ids
        packed["param_names"] = list(names)
        packed["param_names_synthesized"] = list(flags)
        packed[META_KEY] = dict(meta)
        groups.append(packed)
    state: dict[Any, Any] = {}
    for p, st in opt.state.items():
        if not isinstance(p, Tensor):
            # A key that is not a parameter (set by the caller or a hook) is kept as it is,
            # as torch.optim keeps it.
            state[p] = st
        elif id(p) in index and st:
            state[index[id(p)]] = {k: v for k, v in st.items() if k in STATE_KEYS}
    return {"state": state, "param_groups": groups, META_KEY: meta}


def split_state(saved_state: Mapping[Any, Any],
                saved_groups: list[Any]) -> tuple[dict[Any, Any], dict[Any, Any]]:
    """``(parameter entries, other entries)`` of a checkpoint's ``state``.

    A key that some saved group lists in its ``params`` is a parameter's entry; any other key
    is a non-parameter entry, loaded as it is (torch.optim's rule), except an int key, which
    can only be an orphaned parameter id and is left with the parameter entries for the
    staging to refuse.
    """
    ids: set[Any] = set()
    for g in saved_groups:
        listed = g.get("params") if isinstance(g, Mapping) else None
        if isinstance(listed, list):
            ids.update(sid for sid in listed if _hashable(sid))
    params: dict[Any, Any] = {}
    other: dict[Any, Any] = {}
    for key, entry in saved_state.items():
        orphan_id = isinstance(key, int) and not isinstance(key, bool)
        (params if key in ids or orphan_id else other)[key] = entry
    return params, other


def _hashable(x: Any) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True


# ---------------------------------------------------------------------------------- load
@dataclass
class Staged:
    state: dict[Tensor, dict[str, Any]]
    groups: list[dict[str, Any]]
    global_step: int
    codebook: Tensor | None
    #: The checkpoint's ``state`` entries whose keys are not parameters, installed as they are.
    extra: dict[Any, Any] = field(default_factory=dict)


def _check_meta(meta: Any, where: str) -> dict[str, Any]:
    if not isinstance(meta, Mapping):
        raise _err(f"{where} {META_KEY} must be a dict, got {type(meta).__name__}")
    missing = {"format_version", "global_step", "codebook", "deterministic"} - set(meta)
    if missing:
        raise _err(f"{where} {META_KEY} lacks {sorted(missing)}")
    version = meta["format_version"]
    if version != FORMAT_VERSION or isinstance(version, bool):
        raise _err(f"{where} has format_version {version!r}; this gefen-core reads "
                   f"version {FORMAT_VERSION}")
    t = meta["global_step"]
    if not isinstance(t, int) or isinstance(t, bool) or t < 0:
        raise _err(f"{where} global_step must be an int >= 0, got {t!r}")
    if not isinstance(meta["deterministic"], bool):
        raise _err(f"{where} deterministic must be a bool, got {meta['deterministic']!r}")
    if meta["codebook"] is not None:
        check_codebook(meta["codebook"])
    return dict(meta)


def _same_meta(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    if a["global_step"] != b["global_step"] or a["deterministic"] != b["deterministic"]:
        return False
    ca, cb = a["codebook"], b["codebook"]
    if ca is None or cb is None:
        return ca is None and cb is None
    return (ca.dtype == cb.dtype and ca.shape == cb.shape
            and torch.equal(ca.detach().cpu(), cb.detach().cpu()))


def check_codebook(codebook: Any) -> None:
    """docs/algorithm.md#checkpoint-format: fp32, 1-D, 256 entries, finite, non-decreasing, exactly
    -1 first and +1 last."""
    if not isinstance(codebook, Tensor):
        raise _err(f"codebook must be a tensor, got {type(codebook).__name__}")
    if codebook.dtype != torch.float32 or codebook.ndim != 1 or codebook.numel() != 256:
        raise _err(f"codebook must be fp32 [256], got {codebook.dtype} {tuple(codebook.shape)}")
    c = codebook.detach().cpu()
    if not bool(torch.isfinite(c).all()):
        raise _err("codebook has non-finite entries")
    if bool((c[1:] < c[:-1]).any()):
        raise _err("codebook is not sorted ascending")
    if float(c[0]) != -1.0 or float(c[-1]) != 1.0:
        raise _err(f"codebook must start at -1 and end at +1, got {float(c[0])}, {float(c[-1])}")


def _counter(value: Any, key: str, name: str) -> float:
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.is_complex():
            raise _err(f"state[{name!r}][{key!r}] must be a scalar, got shape "
                       f"{tuple(value.shape)}")
        v = float(value.detach().reshape(()).item())
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        v = float(value)
    else:
        raise _err(f"state[{name!r}][{key!r}] must be a number, got {type(value).__name__}")
    if not math.isfinite(v) or v < 1 or v != int(v):
        raise _err(f"state[{name!r}][{key!r}] must be a finite integer >= 1, got {v}")
    return v


def _fp32_stat(entry: Mapping[str, Any], key: str, shape: tuple[int, ...], name: str) -> Tensor:
    t = entry[key]
    if not isinstance(t, Tensor):
        raise _err(f"state[{name!r}][{key!r}] must be a tensor, got {type(t).__name__}")
    if t.dtype != torch.float32 or tuple(t.shape) != shape:
        raise _err(f"state[{name!r}][{key!r}] must be fp32 {list(shape)}, got {t.dtype} "
                   f"{list(t.shape)}")
    if not bool(torch.isfinite(t).all()) or bool((t < 0).any()):
        raise _err(f"state[{name!r}][{key!r}] must be finite and >= 0")
    return t


def stage_entry(entry: Any, p: Tensor, name: str, capturable: bool) -> dict[str, Any]:
    """Validate one parameter's saved state ``entry`` against the (local) parameter ``p`` and
    return it staged for loading (docs/algorithm.md#state-layout): new tensors on ``p``'s
    device in the live dtypes and layout, the counters on the CPU unless ``capturable``. Used
    by ``Gefen.load_state_dict`` and by optimizers that load the same state per entry
    (``gefen_dist.ShardedGefenMuon``). Nothing live is modified.

    Raises:
        CheckpointError: ``entry`` is not a dict, has unknown keys, or a tensor of the wrong
            shape, dtype or value range (the message names ``name`` and the key).
    """
    if not isinstance(entry, Mapping):
        raise _err(f"state[{name!r}] must be a dict, got {type(entry).__name__}")
    unknown = set(entry) - STATE_KEYS
    if unknown:
        raise _err(f"state[{name!r}] has unknown keys {sorted(map(str, unknown))}")
    keys = set(entry)
    has_codes = "exp_avg_codes" in keys and "exp_avg_scale" in keys
    initialised = keys - {"period"}
    if initialised and not has_codes:
        raise _err(f"state[{name!r}] has {sorted(initialised)} without both exp_avg_codes and "
                   "exp_avg_scale")
    out: dict[str, Any] = {}
    n = _dispatch.local_numel(p)
    if "period" in keys:
        period = entry["period"]
        if not isinstance(period, int) or isinstance(period, bool) or period < 1 \
                or n % period != 0:
            raise _err(f"state[{name!r}]['period'] must be a positive int dividing the "
                       f"parameter's numel {n}, got {period!r}")
        out["period"] = period
    if not has_codes:
        return out
    if "period" not in out:
        raise _err(f"state[{name!r}] has momentum but no period")
    if "step" not in keys:
        raise _err(f"state[{name!r}] has momentum but no step")
    period = out["period"]
    blocks = n // period
    codes = entry["exp_avg_codes"]
    if not isinstance(codes, Tensor) or codes.dtype != torch.uint8 \
            or tuple(codes.shape) != (blocks, period):
        got = (codes.dtype, list(codes.shape)) if isinstance(codes, Tensor) else type(codes)
        raise _err(f"state[{name!r}]['exp_avg_codes'] must be uint8 [{blocks}, {period}], "
                   f"got {got}")
    scale = _fp32_stat(entry, "exp_avg_scale", (blocks, 1), name)
    step = _counter(entry["step"], "step", name)
    block_v = "exp_avg_sq" in keys
    factored = "exp_avg_sq_row" in keys or "exp_avg_sq_col" in keys
    if block_v and factored:
        raise _err(f"state[{name!r}] has both a per-block and a factored second moment")
    if not block_v and not factored:
        raise _err(f"state[{name!r}] has momentum but no second moment")
    tensors = {"exp_avg_codes": codes, "exp_avg_scale": scale}
    if factored:
        if p.ndim != 2:
            raise _err(f"state[{name!r}] is factored but the parameter is {p.ndim}-D")
        if not ("exp_avg_sq_row" in keys and "exp_avg_sq_col" in keys):
            raise _err(f"state[{name!r}] needs both exp_avg_sq_row and exp_avg_sq_col")
        tensors["exp_avg_sq_row"] = _fp32_stat(entry, "exp_avg_sq_row", (p.shape[0],), name)
        tensors["exp_avg_sq_col"] = _fp32_stat(entry, "exp_avg_sq_col", (p.shape[1],), name)
        if "exp_avg_sq_step" not in keys:
            raise _err(f"state[{name!r}] factored statistics need exp_avg_sq_step")
    else:
        tensors["exp_avg_sq"] = _fp32_stat(entry, "exp_avg_sq", (blocks, 1), name)
    # A per-block second moment without its own age comes from old checkpoints:
    # docs/algorithm.md#checkpoint-format backfills it from the momentum age.
    sq_step = _counter(entry["exp_avg_sq_step"], "exp_avg_sq_step", name) \
        if "exp_avg_sq_step" in keys else step
    counter_device = p.device if capturable else torch.device("cpu")
    out["step"] = torch.tensor(step, dtype=torch.float32, device=counter_device)
    out["exp_avg_sq_step"] = torch.tensor(sq_step, dtype=torch.float32, device=counter_device)
    for key, t in tensors.items():
        # Saved dtype kept (torch's default load would cast fp32 state to a bf16 parameter's
        # dtype); always a copy so the input dict is never aliased by live state.
        out[key] = t.detach().to(device=p.device, copy=True)
    return out


def _pack_legacy_layout(opt: Gefen, saved_groups: list[Any]) -> list[Any]:
    """docs/algorithm.md#checkpoint-format: one saved group per parameter packed into the live
    groups."""
    live_counts = [len(g["params"]) for g in opt.param_groups]
    if len(saved_groups) == len(live_counts):
        return saved_groups
    if not all(isinstance(g, Mapping) and len(g.get("params", ())) == 1 for g in saved_groups) \
            or len(saved_groups) != sum(live_counts):
        raise _err(f"the checkpoint has {len(saved_groups)} parameter groups, the optimizer "
                   f"{len(live_counts)}")
    packed = []
    pos = 0
    ignore = {"params", "param_names", "param_names_synthesized", "name", META_KEY}
    for count in live_counts:
        chunk = saved_groups[pos:pos + count]
        pos += count
        first = {k: v for k, v in chunk[0].items() if k not in ignore}
        for g in chunk[1:]:
            other = {k: v for k, v in g.items() if k not in ignore}
            if set(other) != set(first) or any(
                    not _equal_values(other[k], first[k]) for k in first):
                raise _err("packing one-group-per-parameter checkpoint groups into the live "
                           "groups needs identical hyperparameters within each live group")
        merged = dict(chunk[0])
        merged.pop("name", None)
        merged.pop("param_names_synthesized", None)
        merged["params"] = [g["params"][0] for g in chunk]
        names = [g.get("name", (g.get("param_names") or [None])[0]) for g in chunk]
        if all(isinstance(n, str) for n in names):
            merged["param_names"] = names
        else:
            merged.pop("param_names", None)
        packed.append(merged)
    return packed


def _equal_values(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and torch.equal(a, b)
    return bool(a == b)


def stage_load(opt: Gefen, sd: Mapping[str, Any]) -> Staged:
    """Build and validate everything ``load_state_dict`` would install; mutate nothing."""
    if not isinstance(sd, Mapping):
        raise _err(f"expected a dict, got {type(sd).__name__}")
    from .legacy import convert_legacy_state_dict, is_legacy_state_dict

    if is_legacy_state_dict(sd):
        # docs/algorithm.md#deterministic: an untagged old checkpoint loads under the live
        # deterministic flag; when both second moments were saved (O8) keep the one the live
        # optimizer uses.
        sd = convert_legacy_state_dict(
            sd, deterministic_if_untagged=opt._deterministic,
            prefer_factored=all(g["factored_v_2d"] for g in opt.param_groups))
    if "state" not in sd or "param_groups" not in sd:
        raise _err("a state dict needs 'state' and 'param_groups'")
    saved_state, saved_groups = sd["state"], sd["param_groups"]
    if not isinstance(saved_state, Mapping):
        raise _err("'state' must be a dict")
    if not isinstance(saved_groups, list) or not all(isinstance(g, Mapping) for g in saved_groups):
        raise _err("'param_groups' must be a list of dicts")

    # Optimizer-level metadata: every group mirrors it; all copies must agree
    # (docs/algorithm.md#checkpoint-format).
    in_groups = [META_KEY in g for g in saved_groups]
    if any(in_groups) and not all(in_groups):
        raise _err(f"{META_KEY} is present in some parameter groups but not all")
    metas = [_check_meta(g[META_KEY], f"param_groups[{i}]")
             for i, g in enumerate(saved_groups) if META_KEY in g]
    if META_KEY in sd:
        metas.append(_check_meta(sd[META_KEY], "the top-level"))
    if not metas:
        raise _err(f"no {META_KEY} found: this is not a Gefen checkpoint (a torch.optim state "
                   "dict cannot be reinterpreted as quantized state)")
    for m in metas[1:]:
        if not _same_meta(metas[0], m):
            raise _err(f"the copies of {META_KEY} disagree (global_step, codebook or "
                       "deterministic)")
    meta = metas[0]
    if meta["deterministic"] != opt._deterministic:
        raise _err(f"the checkpoint was saved with deterministic={meta['deterministic']} but "
                   f"this optimizer has deterministic={opt._deterministic}; construct it with "
                   "the saved value")

    saved_groups = _pack_legacy_layout(opt, list(saved_groups))
    saved_state, extra = split_state(saved_state, saved_groups)
    live_names = _params.live_names(opt.param_groups)
    for i, (live, saved) in enumerate(zip(opt.param_groups, saved_groups)):
        ids = saved.get("params")
        if not isinstance(ids, list) or len(ids) != len(live["params"]):
            raise _err(f"param_groups[{i}] has {len(ids) if isinstance(ids, list) else ids!r} "
                       f"parameters, the optimizer's group {len(live['params'])}")
    id_map: dict[Any, tuple[Tensor, dict[str, Any], str]] = {}
    for live, saved, (names, _) in zip(opt.param_groups, saved_groups, live_names):
        for sid, p, name in zip(saved["params"], live["params"], names):
            if sid in id_map:
                raise _err(f"parameter id {sid!r} appears twice in param_groups")
            id_map[sid] = (p, live, name)

    new_state: dict[Tensor, dict[str, Any]] = {}
    any_codes = False
    for sid, entry in saved_state.items():
        if sid not in id_map:
            raise _err(f"state has an entry for parameter id {sid!r}, which no group lists")
        p, live, name = id_map[sid]
        staged = stage_entry(entry, p, name, live["capturable"])
        any_codes = any_codes or "exp_avg_codes" in staged
        if staged:
            new_state[p] = staged

    codebook = meta["codebook"]  # validated by _check_meta
    if codebook is None and any_codes:
        raise _err("the state holds momentum codes but no codebook (codes cannot be "
                   "reinterpreted against a relearned codebook)")

    new_groups = []
    for i, (live, saved, (live_group_names, live_flags)) in enumerate(
            zip(opt.param_groups, saved_groups, live_names)):
        where = f"param_groups[{i}]"
        g = {k: copy.deepcopy(v) for k, v in saved.items()
             if k not in ("params", META_KEY, "param_names", "param_names_synthesized")}
        try:
            _params.merge_betas(g, where)
            for key in _params.IMPLEMENTATION_KEYS:
                g[key] = live[key]
            # docs/algorithm.md#factoring-rule: a group saved before min_dim_size_to_factor
            # existed factored every 2-D parameter; keeping that rule keeps each parameter's
            # second moment in the mode it was saved in (never a guess from the live default).
            g.setdefault("min_dim_size_to_factor", 0)
            for key, default in opt.defaults.items():
                g.setdefault(key, default)
            g["betas"] = _params.check_betas(g["betas"], where)
            g["period_one_substrings"] = _params.normalize_substrings(
                g["period_one_substrings"], where)
            _params.check_group_options(g, where)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise _err(str(exc)) from exc
        g["params"] = live["params"]
        names = saved.get("param_names")
        if names is None:
            g["param_names"] = list(live_group_names)
            g["param_names_synthesized"] = list(live_flags)
        else:
            if not isinstance(names, list) or len(names) != len(live["params"]) or not all(
                    isinstance(n, str) for n in names):
                raise _err(f"{where}['param_names'] must list one str per parameter")
            flags = saved.get("param_names_synthesized")
            if not (isinstance(flags, list) and len(flags) == len(names)
                    and all(isinstance(f, bool) for f in flags)):
                flags = None
            # docs/algorithm.md#checkpoint-format: a name the checkpoint marks synthesized
            # stands for "no name" (torch.optim saves no param_names then), so the live name
            # stays; a caller's name replaces it, keeping the live provenance flag when it is
            # unchanged, else the saved flag, else synthesized (fail closed).
            merged, provenance = [], []
            for j, (saved_name, live_name, live_flag) in enumerate(
                    zip(names, live_group_names, live_flags)):
                if flags is not None and flags[j]:
                    merged.append(live_name)
                    provenance.append(live_flag)
                    continue
                saved_name = saved_name.lower()
                merged.append(saved_name)
                provenance.append(live_flag if saved_name == live_name
                                  else (flags[j] if flags is not None else True))
            g["param_names"] = merged
            g["param_names_synthesized"] = provenance
        new_groups.append(g)
    all_names = [n for g in new_groups for n in g["param_names"]]
    if len(set(all_names)) != len(all_names):
        raise _err("param_names in the checkpoint are not unique")

    anchor = opt.param_groups[0]["params"][0].device
    staged_codebook = None if codebook is None else codebook.detach().to(anchor, copy=True)
    return Staged(new_state, new_groups, int(meta["global_step"]), staged_codebook,
                  extra=dict(extra))


def commit(opt: Gefen, staged: Staged) -> None:
    """Install a validated :class:`Staged` load with assignments that cannot fail."""
    state: defaultdict[Tensor, dict[str, Any]] = defaultdict(dict)
    state.update(staged.state)
    state.update(staged.extra)
    opt.state = state
    for live, new in zip(opt.param_groups, staged.groups):
        live.clear()
        live.update(new)
    opt._global_step = staged.global_step
    opt._codebook = staged.codebook
    opt._init_runtime_caches()
