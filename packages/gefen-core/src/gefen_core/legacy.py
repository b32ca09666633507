"""Import of checkpoints written by the published ``gefen`` 1.2.x and ``gefen-x`` 0.5.x.

Both earlier releases install the import name ``gefen`` and save ``Gefen.state_dict()`` in
the reference vocabulary of docs/algorithm.md#legacy-import (``m_codebook``, ``m_magnitude``,
``vmean``, ``automatic_period``, ``beta1``/``beta2``, ...). :func:`convert_legacy_state_dict`
rewrites such a dict into the native format of ``docs/internals/contracts.md`` ("The native
checkpoint format"); ``Gefen.load_state_dict`` calls it when :func:`is_legacy_state_dict` says so
and then validates the result like any other checkpoint. ``docs/migration.md`` describes both legacy
layouts key by key and how users migrate.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = ["LegacyCheckpointError", "convert_legacy_state_dict", "is_legacy_state_dict"]

NATIVE_FORMAT_VERSION = 1

# Legacy top-level keys (gefen 1.2.x writes the first two; gefen-x 0.5.x all three).
_TOP_CODEBOOK = "gefen_codebook"
_TOP_GLOBAL_STEP = "gefen_global_step"
_TOP_DETERMINISTIC = "gefen_deterministic"
# GefenMuon distributed manifest (docs/algorithm.md#legacy-import)
_TOP_MUON_DISTRIBUTED = "gefen_muon_distributed"
_LEGACY_TOP_KEYS = (_TOP_CODEBOOK, _TOP_GLOBAL_STEP, _TOP_DETERMINISTIC, _TOP_MUON_DISTRIBUTED)

# gefen-x 0.5.x mirrors the optimizer-level values into every group under this key.
_GROUP_METADATA = "_gefen_checkpoint_metadata"
_RANK_LOCAL_MARKER = "rank_local_sharded_state"  # docs/algorithm.md#legacy-import, format_version 3
_MUON_DISTRIBUTED_MARKER = "muon_distributed_state"  # docs/algorithm.md#legacy-import
_RANK_LOCAL_PAYLOAD_PREFIX = "_gefen_rank_local_payload_"
_RANK_LOCAL_MEMBER = "_gefen_rank_local_member"
_RANK_LOCAL_PAYLOAD_FORMAT = "rank_local_dtensor_v2"
# format_version 2 is accepted by gefen-x 0.5.x's loader with the same schema as 1.
_PLAIN_FORMAT_VERSIONS = (1, 2)
_RANK_LOCAL_FORMAT_VERSION = 3

# Per-parameter state renames (docs/algorithm.md#legacy-import key naming).
_TENSOR_RENAMES = {
    "m_codebook": "exp_avg_codes",
    "m_magnitude": "exp_avg_scale",
    "vmean": "exp_avg_sq",
    "v_row": "exp_avg_sq_row",
    "v_col": "exp_avg_sq_col",
}
_LEGACY_STATE_KEYS = frozenset(
    set(_TENSOR_RENAMES)
    | {"automatic_period", "vmean_step", "factored_step", "period_one_divisor", "m_codebook_shape"}
)
# Keys dropped on import because they carry nothing the native format needs: the parameter
# name (the groups' ``param_names`` keep it), gefen 1.2.x's stored index-tensor shape and its
# shape-cap record, and step scratch that a writer may have leaked.
_INERT_STATE_KEYS = frozenset(
    {
        "name",
        "m_codebook_shape",
        "parameter_shape",
        "stepsize",
        "_h_buf",
        "_capt_scalars",
        "_capt_consts",
        "_capt_consts_key",
        "_capt_stack",
        "_capt_row",
    }
)
_MUON_STATE_KEYS = frozenset({"normuon_v", "normuon_step"})
_NATIVE_STATE_KEYS = frozenset(
    {
        "period",
        "step",
        "exp_avg_codes",
        "exp_avg_scale",
        "exp_avg_sq",
        "exp_avg_sq_row",
        "exp_avg_sq_col",
        "exp_avg_sq_step",
    }
)

_RANK_LOCAL_FIX = (
    "To migrate it, load it with the published gefen-x 0.5.x on the same topology (same "
    "world size and device mesh) and re-save it from a single process: save it there with "
    "gefen-x 0.5.x's GefenDCPState, load that in one process (a one-rank mesh: GefenDCPState "
    "reshards N -> 1) and save that optimizer's state_dict(); a one-rank checkpoint imports "
    "exactly."
)


class LegacyCheckpointError(ValueError):
    """A legacy checkpoint that cannot be imported (raised before anything is built)."""


def _err(msg: str) -> LegacyCheckpointError:
    return LegacyCheckpointError(f"legacy Gefen checkpoint: {msg}")


def is_legacy_state_dict(sd: Any) -> bool:
    """Whether ``sd`` is a ``state_dict()`` written by the published gefen 1.2.x / gefen-x 0.5.x.

    True when any legacy marker is present: a top-level ``gefen_codebook``,
    ``gefen_global_step``, ``gefen_deterministic`` or ``gefen_muon_distributed``; a group with
    ``beta1``/``beta2`` or ``_gefen_checkpoint_metadata``; or a per-parameter state entry with a
    reference key (``m_codebook``, ``m_magnitude``, ``vmean``, ``vmean_step``, ``v_row``,
    ``v_col``, ``factored_step``, ``automatic_period``, ``period_one_divisor``) or a rank-local
    payload key (docs/algorithm.md#legacy-import). Rank-local and distributed-Muon checkpoints count
    as legacy here so the loader routes them to :func:`convert_legacy_state_dict`, which imports a
    one-rank payload and refuses the rest with an explanation. Never raises; anything that is not a
    mapping is not legacy.

    Args:
        sd: the object handed to ``load_state_dict``.

    Returns:
        bool.
    """
    if not isinstance(sd, Mapping):
        return False
    if any(k in sd for k in _LEGACY_TOP_KEYS):
        return True
    groups = sd.get("param_groups")
    if isinstance(groups, (list, tuple)):
        for group in groups:
            if isinstance(group, Mapping) and (
                "beta1" in group or "beta2" in group or _GROUP_METADATA in group
            ):
                return True
    state = sd.get("state")
    if isinstance(state, Mapping):
        for entry in state.values():
            if isinstance(entry, Mapping) and any(
                k in _LEGACY_STATE_KEYS
                or k == _RANK_LOCAL_MEMBER
                or (isinstance(k, str) and k.startswith(_RANK_LOCAL_PAYLOAD_PREFIX))
                for k in entry
            ):
                return True
    return False


def convert_legacy_state_dict(
    sd: Mapping[str, Any],
    *,
    deterministic_if_untagged: bool = False,
    prefer_factored: bool = True,
) -> dict[str, Any]:
    """Rewrite a gefen 1.2.x / gefen-x 0.5.x ``state_dict()`` into the native format.

    The input is never mutated: every container of the result is new. Tensors whose value and
    dtype carry over are shared with the input, not copied (like
    ``torch.optim.Optimizer.load_state_dict``); ``Gefen.load_state_dict`` copies them onto
    the parameters' devices. Values are preserved exactly: every mapping below is a rename, an
    exact widening or an exact replication.

    Per-parameter state (``state[i]``; docs/algorithm.md#legacy-import -> contracts.md):

    * ``automatic_period`` (int) -> ``period`` (int).
    * ``step`` (int; a 0-dim tensor under ``capturable``) -> ``step``, 0-dim fp32 CPU tensor.
    * ``m_codebook`` (uint8 ``[B, P]``) -> ``exp_avg_codes`` (the same tensor).
    * ``m_magnitude`` (``[B, 1]``) -> ``exp_avg_scale`` (fp32 ``[B, 1]``).
    * ``vmean`` (``[B, 1]``) -> ``exp_avg_sq`` (fp32 ``[B, 1]``).
    * ``v_row`` / ``v_col`` (fp32 ``[R]`` / ``[C]``) -> ``exp_avg_sq_row`` / ``exp_avg_sq_col``.
    * ``vmean_step`` or ``factored_step`` -> ``exp_avg_sq_step``, 0-dim fp32 CPU tensor;
      ``vmean`` without ``vmean_step`` (gefen 1.2.x had one counter) -> ``exp_avg_sq_step =
      step`` (the docs/algorithm.md#block-second-moment backfill: the same bias correction as the
      package used).
    * ``name``, ``m_codebook_shape``, ``parameter_shape``, ``period_one_divisor`` and leaked
      step scratch (``stepsize``, ``_h_buf``, ``_capt_*``) are dropped; the name lives on in
      the group's ``param_names``.
    * An entry left empty (gefen-x 0.5.x registers ``{"name": ...}`` for every parameter)
      is omitted: that parameter was never stepped.

    Details:

    * gefen 1.2.x stored ``m_magnitude`` and ``vmean`` in the gradient's dtype (bf16/fp16
      for half-precision gradients); they are widened to fp32, which is exact.
    * gefen 1.2.x, ``automatic_period == 1`` with ``period_one_divisor = d``
      (docs/algorithm.md#legacy-import): one momentum scale per ``d`` consecutive elements,
      ``m_magnitude`` ``[N/d, 1]``. The native format has one scale per block, so the scale is
      replicated to ``[N, 1]`` (``repeat_interleave(d)``, exactly what 1.2.x did before using it);
      the dequantised momentum ``c[q_i] * s_i`` is bit-identical. From the next step on the native
      optimizer keeps that parameter's momentum per element (lossless at ``P = 1``) instead of
      re-quantising it against a shared group scale.
    * Both second moments present (a gefen-x 0.5.x run that toggled ``factored_v_2d``,
      Open choice O8): the factored pair is kept when ``prefer_factored`` (else ``vmean``);
      the other is dropped. If the live optimizer uses the other mode it recreates that
      second moment with a fresh age at the next step (docs/algorithm.md#legacy-import).

    Parameter groups:

    * ``beta1``, ``beta2`` → ``betas = (beta1, beta2)``; every other key (``lr``, ``eps``,
      ``weight_decay``, ``name``, ``param_names``, ``param_names_synthesized``, user extras)
      is kept. gefen 1.2.x groups (one per parameter, with ``name``) also get
      ``param_names = [name]``; the one-group-per-parameter layout itself is kept and the
      loader packs it into the live groups (docs/algorithm.md#legacy-import).
    * ``_gefen_checkpoint_metadata`` (gefen-x 0.5.x) is removed; its ``format_version``,
      ``global_step``, ``codebook``, ``deterministic`` are cross-checked with the top level
      (and with every other group); ``device_anchor`` is dropped.

    FSDP2 checkpoints of gefen-x 0.5.x (the rank-local form of docs/algorithm.md#legacy-import: the
    first state entry holds ``_gefen_rank_local_payload_<r>``, a uint8 tensor of ``torch.save``
    bytes per rank, the others ``_gefen_rank_local_member``; group metadata ``format_version`` 3): a
    one-rank payload is unpacked (``torch.load(..., weights_only=True)``) and imported like a plain
    checkpoint, since on a one-device mesh every local shard is the whole tensor; its states
    map to the saved ids in order, checked against the groups' ``param_names``. Payloads of
    several ranks are refused (one codebook and block geometry per shard).

    Optimizer level: ``gefen_codebook``, ``gefen_global_step``, ``gefen_deterministic`` and
    the group metadata become ``gefen_meta = {"format_version": 1, "global_step": int,
    "codebook": fp32 [256] or None, "deterministic": bool}``, at the top level and mirrored
    into every group. A checkpoint without a deterministic tag (gefen 1.2.x had no such
    option) gets ``deterministic_if_untagged``: docs/algorithm.md#deterministic loads untagged
    checkpoints under the live optimizer's value, so the loader passes its own flag. Unknown
    top-level keys are kept.

    Args:
        sd: the legacy state dict (as returned by ``torch.load``; ``weights_only=True`` works
            for both releases' files).
        deterministic_if_untagged: ``gefen_meta["deterministic"]`` when the checkpoint has
            no tag (default False).
        prefer_factored: which second moment to keep when both exist (default True, the
            factored pair, matching ``factored_v_2d=True``).

    Returns:
        A new dict ``{"state", "param_groups", "gefen_meta", ...}`` in the native format.

    Raises:
        TypeError: ``deterministic_if_untagged`` is not a bool.
        LegacyCheckpointError: (a ``ValueError``) the input cannot be imported, raised
            before anything is built: not a dict with
            ``state`` and ``param_groups``; a rank-local FSDP2 payload of more than one rank
            (docs/algorithm.md#legacy-import: one serialized state per rank, each with its own
            codebook and block geometry), or an unreadable or inconsistent one-rank payload;
            a distributed GefenMuon manifest (docs/algorithm.md#legacy-import) or GefenMuon
            (``normuon_*``) state; metadata with an unknown ``format_version`` or inconsistent
            copies; a counter that is not a non-negative integer; a period that is not a positive
            int; an inconsistent ``period_one_divisor``; momentum codes without a codebook; state
            keys that neither release writes; a dict that mixes native and legacy keys.
    """
    _check_container(sd)
    groups_in = sd["param_groups"]
    state_in = sd["state"]
    _refuse_unimportable(sd, groups_in, state_in)
    if _is_rank_local(groups_in, state_in):
        sd = _unwrap_single_rank(sd)
        groups_in, state_in = sd["param_groups"], sd["state"]
    meta = _merge_metadata(sd, groups_in, deterministic_if_untagged)

    new_state: dict[Any, dict[str, Any]] = {}
    any_codes = False
    for sid, entry in state_in.items():
        converted = _convert_entry(sid, entry, prefer_factored)
        any_codes = any_codes or "exp_avg_codes" in converted
        if converted:
            new_state[sid] = converted
    if any_codes and meta["codebook"] is None:
        raise _err(
            "the state holds momentum codes (m_codebook) but the "
            "checkpoint has no codebook (gefen_codebook / _gefen_checkpoint_metadata). The "
            "codes cannot be reinterpreted against a relearned codebook; load an unmodified "
            "checkpoint written by the package's own state_dict()"
        )

    new_groups = [_convert_group(i, g, meta) for i, g in enumerate(groups_in)]

    out: dict[str, Any] = {
        k: v
        for k, v in sd.items()
        if k not in ("state", "param_groups") and k not in _LEGACY_TOP_KEYS
    }
    out["state"] = new_state
    out["param_groups"] = new_groups
    out["gefen_meta"] = dict(meta)
    return out


# --------------------------------------------------------------------------- validation
def _check_container(sd: Any) -> None:
    if not isinstance(sd, Mapping):
        raise _err(f"expected a dict from Gefen.state_dict(), got {type(sd).__name__}")
    if {"muon", "backup"} & set(sd) and "state" not in sd:
        raise _err(
            "this is a GefenMuonHybrid state dict ('muon'/'backup'); "
            "load sd['backup'] into Gefen, or the whole dict into GefenMuonHybrid"
        )
    if "slot_count" in sd or "param_identities" in sd:
        raise _err(
            "this is a gefen-x 0.5.x GefenDCPState payload (slot_* keys), not an optimizer "
            "state_dict(); load it with gefen-x 0.5.x's GefenDCPState in one process (a "
            "one-rank mesh) and save that optimizer's state_dict(), which imports"
        )
    missing = [k for k in ("state", "param_groups") if k not in sd]
    if missing:
        raise _err(f"missing {missing}; expected the dict returned by Gefen.state_dict()")
    if not isinstance(sd["state"], Mapping):
        raise _err("'state' must be a dict")
    groups = sd["param_groups"]
    if not isinstance(groups, (list, tuple)) or not all(isinstance(g, Mapping) for g in groups):
        raise _err("'param_groups' must be a list of dicts")
    if "gefen_meta" in sd or any("gefen_meta" in g for g in groups):
        raise _err(
            "the dict mixes the native 'gefen_meta' with legacy keys; "
            "it was not written by either published package or by gefen-core, refusing to "
            "guess which values are authoritative"
        )


def _refuse_unimportable(sd: Mapping[str, Any], groups: Any, state: Mapping[Any, Any]) -> None:
    muon_distributed = _TOP_MUON_DISTRIBUTED in sd or any(
        isinstance(g.get(_GROUP_METADATA), Mapping)
        and _MUON_DISTRIBUTED_MARKER in g[_GROUP_METADATA]
        for g in groups
    )
    if muon_distributed:
        raise _err(
            "this carries a distributed GefenMuon manifest "
            "(muon_distributed_state / gefen_muon_distributed); it is "
            "GefenMuon state, not Gefen state, and is not imported by gefen_core.Gefen"
        )
    for sid, e in state.items():
        if isinstance(e, Mapping) and _MUON_STATE_KEYS & set(e):
            raise _err(
                f"state[{sid!r}] holds GefenMuon NorMuon statistics "
                f"({sorted(_MUON_STATE_KEYS & set(e))}); a GefenMuon checkpoint is not "
                "imported by gefen_core.Gefen"
            )


def _is_rank_local(groups: Any, state: Mapping[Any, Any]) -> bool:
    for e in state.values():
        if isinstance(e, Mapping) and any(
            k == _RANK_LOCAL_MEMBER
            or (isinstance(k, str) and k.startswith(_RANK_LOCAL_PAYLOAD_PREFIX))
            for k in e
        ):
            return True
    for g in groups:
        md = g.get(_GROUP_METADATA)
        if isinstance(md, Mapping) and (
            _RANK_LOCAL_MARKER in md or md.get("format_version") == _RANK_LOCAL_FORMAT_VERSION
        ):
            return True
    return False


def _unwrap_single_rank(sd: Mapping[str, Any]) -> Mapping[str, Any]:
    """A gefen-x 0.5.x rank-local payload (docs/algorithm.md#legacy-import) of world size 1 as a
    plain legacy dict.

    With one rank, ``Shard(0)`` on a one-device mesh makes every local shard the whole tensor,
    so that rank's states, codebook and block geometry are exactly a single optimizer's. More
    ranks mean one codebook and one block geometry per shard, which one optimizer cannot hold:
    refused.
    """
    groups, state = sd["param_groups"], sd["state"]
    blobs = {
        k: v
        for e in state.values()
        if isinstance(e, Mapping)
        for k, v in e.items()
        if isinstance(k, str) and k.startswith(_RANK_LOCAL_PAYLOAD_PREFIX)
    }
    markers = [
        g[_GROUP_METADATA].get(_RANK_LOCAL_MARKER)
        for g in groups
        if isinstance(g.get(_GROUP_METADATA), Mapping)
    ]
    sizes = {m.get("world_size") if isinstance(m, Mapping) else None for m in markers}
    if sizes != {1} or list(blobs) != [f"{_RANK_LOCAL_PAYLOAD_PREFIX}0"]:
        shown = sorted(map(str, sizes))
        raise _err(
            "this is a rank-local FSDP2 payload written by gefen-x 0.5.x "
            f"for world size {', '.join(shown)} with payloads {sorted(blobs)}: each rank learned "
            "its own codebook and block geometry for its local shards, which a single "
            "optimizer cannot hold. " + _RANK_LOCAL_FIX
        )
    blob = blobs[f"{_RANK_LOCAL_PAYLOAD_PREFIX}0"]
    if not isinstance(blob, Tensor) or blob.dtype != torch.uint8 or blob.dim() != 1:
        raise _err("the rank-local payload must be a 1-D uint8 tensor of torch.save bytes")
    try:
        raw = blob.detach().cpu().contiguous().numpy().tobytes()
        payload = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable payload gets the same answer
        raise _err(f"the rank-local payload cannot be read ({type(exc).__name__})") from exc
    if not isinstance(payload, Mapping) or payload.get("format") != _RANK_LOCAL_PAYLOAD_FORMAT:
        raise _err(f"the rank-local payload is not in the {_RANK_LOCAL_PAYLOAD_FORMAT} format")
    states, signature = payload.get("states"), payload.get("signature")
    if payload.get("world_size") != 1 or not isinstance(states, list) or len(states) != len(state):
        raise _err(
            f"the rank-local payload lists {len(states) if isinstance(states, list) else '?'} "
            f"states for world size {payload.get('world_size')!r}; the checkpoint has "
            f"{len(state)} entries"
        )
    if not isinstance(signature, list) or any(
        not isinstance(s, Mapping) or s.get("local_shape") != s.get("shape") for s in signature
    ):
        raise _err(
            "the rank-local payload has a parameter whose local shard is not the whole "
            "tensor; " + _RANK_LOCAL_FIX
        )
    # Payload states follow the saved ids in order; their names must match the groups'.
    names = {
        sid: name
        for g in groups
        for sid, name in zip(g.get("params", ()), g.get("param_names", ()))
    }
    new_state = {}
    for sid, entry in zip(state, states):
        if not isinstance(entry, Mapping):
            raise _err(f"the rank-local payload state for parameter id {sid!r} is not a dict")
        if sid in names and "name" in entry and entry["name"] != names[sid]:
            raise _err(
                f"the rank-local payload state named {entry['name']!r} does not belong to "
                f"parameter id {sid!r} ({names[sid]!r})"
            )
        new_state[sid] = dict(entry)
    codebook = payload.get("codebook")
    new_groups = []
    for g in groups:
        g = dict(g)
        md = g.get(_GROUP_METADATA)
        if isinstance(md, Mapping):
            md = {k: v for k, v in md.items() if k != _RANK_LOCAL_MARKER}
            md.update(
                format_version=_PLAIN_FORMAT_VERSIONS[0],
                codebook=codebook,
                global_step=payload.get("global_step"),
                deterministic=payload.get("deterministic"),
            )
            g[_GROUP_METADATA] = md
        new_groups.append(g)
    out = dict(sd)
    out.update(state=new_state, param_groups=new_groups)
    out[_TOP_CODEBOOK] = codebook
    return out


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return (
            isinstance(a, Tensor)
            and isinstance(b, Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.detach().cpu(), b.detach().cpu())
        )
    return a is b or a == b


def _merge_metadata(sd: Mapping[str, Any], groups: Any, untagged: bool) -> dict[str, Any]:
    """Fold top-level values and every group's ``_gefen_checkpoint_metadata`` into one META."""
    if not isinstance(untagged, bool):
        raise TypeError(f"deterministic_if_untagged must be a bool, got {untagged!r}")
    metas = [g[_GROUP_METADATA] for g in groups if _GROUP_METADATA in g]
    if metas and len(metas) != len(groups):
        raise _err(
            f"{_GROUP_METADATA} is present on {len(metas)} of "
            f"{len(groups)} parameter groups; a checkpoint from gefen-x 0.5.x has it on all"
        )
    for i, md in enumerate(metas):
        if not isinstance(md, Mapping):
            raise _err(
                f"param_groups[{i}][{_GROUP_METADATA!r}] must be a dict, got {type(md).__name__}"
            )
        version = md.get("format_version")
        if isinstance(version, bool) or version not in _PLAIN_FORMAT_VERSIONS:
            raise _err(
                f"unknown metadata format_version {version!r} (gefen-x "
                f"0.5.x writes {_PLAIN_FORMAT_VERSIONS[0]}, and "
                f"{_RANK_LOCAL_FORMAT_VERSION} for rank-local payloads); it was written by a "
                "release this gefen-core does not know"
            )
    for md in metas[1:]:
        for key in ("global_step", "codebook", "deterministic"):
            if not _same(md.get(key), metas[0].get(key)):
                raise _err(
                    f"parameter groups carry different {key} in "
                    f"{_GROUP_METADATA}; the checkpoint is inconsistent"
                )
    first = metas[0] if metas else {}

    def pick(top_key: str, meta_key: str) -> tuple[bool, Any]:
        has_top, has_meta = top_key in sd, meta_key in first
        if has_top and has_meta and not _same(sd[top_key], first[meta_key]):
            raise _err(
                f"top-level {top_key} and {_GROUP_METADATA}"
                f"[{meta_key!r}] disagree; the checkpoint is inconsistent"
            )
        if has_top:
            return True, sd[top_key]
        return has_meta, first.get(meta_key)

    _, global_step = pick(_TOP_GLOBAL_STEP, "global_step")
    if global_step is None:
        global_step = 0
    if isinstance(global_step, Tensor) and global_step.numel() == 1:
        global_step = _as_count(global_step, "gefen_global_step")
    if not _is_count(global_step):
        raise _err(f"gefen_global_step must be an int >= 0, got {global_step!r}")
    _, codebook = pick(_TOP_CODEBOOK, "codebook")
    if codebook is not None and not isinstance(codebook, Tensor):
        raise _err(f"gefen_codebook must be a tensor or None, got {type(codebook).__name__}")
    tagged, deterministic = pick(_TOP_DETERMINISTIC, "deterministic")
    if not tagged or deterministic is None:
        deterministic = untagged
    if not isinstance(deterministic, bool):
        raise _err(f"gefen_deterministic must be a bool, got {deterministic!r}")
    return {
        "format_version": NATIVE_FORMAT_VERSION,
        "global_step": global_step,
        "codebook": codebook,
        "deterministic": deterministic,
    }


# --------------------------------------------------------------------------- conversion
def _as_count(value: Any, where: str) -> int:
    """A legacy counter (int, or a 0-dim tensor under capturable) as an exact int >= 0."""
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.is_complex():
            raise _err(f"{where} must be a scalar, got shape {tuple(value.shape)}")
        v = float(value.detach().reshape(()).cpu().item())
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        v = float(value)
    else:
        raise _err(f"{where} must be a number, got {type(value).__name__}")
    if not math.isfinite(v) or v < 0 or v != int(v):
        raise _err(f"{where} must be a finite integer >= 0, got {v}")
    return int(v)


def _counter_tensor(value: Any, where: str) -> Tensor:
    return torch.tensor(float(_as_count(value, where)), dtype=torch.float32)


def _fp32(t: Any, where: str) -> Tensor:
    if not isinstance(t, Tensor):
        raise _err(f"{where} must be a tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise _err(f"{where} must be floating point, got {t.dtype}")
    # Widening bf16/fp16 to fp32 is exact; an fp32 tensor is passed through as is.
    return t if t.dtype == torch.float32 else t.to(torch.float32)


def _convert_entry(sid: Any, entry: Any, prefer_factored: bool) -> dict[str, Any]:
    where = f"state[{sid!r}]"
    if not isinstance(entry, Mapping):
        raise _err(f"{where} must be a dict, got {type(entry).__name__}")
    keys = set(entry)
    native = (keys & _NATIVE_STATE_KEYS) - {"step"}
    if native:
        raise _err(f"{where} mixes native keys {sorted(native)} with the legacy layout")
    unknown = keys - _LEGACY_STATE_KEYS - _INERT_STATE_KEYS - {"step"}
    if unknown:
        raise _err(
            f"{where} has keys {sorted(map(str, unknown))} that neither "
            "gefen 1.2.x nor gefen-x 0.5.x writes for a Gefen parameter"
        )
    out: dict[str, Any] = {}
    period = None
    if "automatic_period" in entry:
        period = entry["automatic_period"]
        if not isinstance(period, int) or isinstance(period, bool) or period < 1:
            raise _err(f"{where}['automatic_period'] must be a positive int, got {period!r}")
        out["period"] = period
    if "step" in entry:
        out["step"] = _counter_tensor(entry["step"], f"{where}['step']")
    if "m_codebook" in entry:
        out["exp_avg_codes"] = entry["m_codebook"]
    if "m_magnitude" in entry:
        scale = _fp32(entry["m_magnitude"], f"{where}['m_magnitude']")
        if "period_one_divisor" in entry and period == 1:
            scale = _expand_group_scale(entry, scale, where)
        out["exp_avg_scale"] = scale

    has_block = "vmean" in entry
    has_factored = "v_row" in entry or "v_col" in entry or "factored_step" in entry
    if has_block and has_factored:
        # O8 leftover of a factored_v_2d toggle: keep one complete form.
        has_block, has_factored = not prefer_factored, prefer_factored
    if has_factored:
        for old in ("v_row", "v_col"):
            if old in entry:
                out[_TENSOR_RENAMES[old]] = _fp32(entry[old], f"{where}[{old!r}]")
        if "factored_step" in entry:
            out["exp_avg_sq_step"] = _counter_tensor(
                entry["factored_step"], f"{where}['factored_step']"
            )
    elif has_block:
        out["exp_avg_sq"] = _fp32(entry["vmean"], f"{where}['vmean']")
        if "vmean_step" in entry:
            out["exp_avg_sq_step"] = _counter_tensor(entry["vmean_step"], f"{where}['vmean_step']")
        elif "step" in entry:
            # gefen 1.2.x had a single counter: its vmean is exactly as old as the momentum.
            out["exp_avg_sq_step"] = out["step"].clone()
    elif "vmean_step" in entry:
        raise _err(f"{where} has vmean_step without vmean")
    return out


def _expand_group_scale(entry: Mapping[str, Any], scale: Tensor, where: str) -> Tensor:
    """gefen 1.2.x's P = 1 scale groups (docs/algorithm.md#legacy-import) replicated to one scale
    per element."""
    d = entry["period_one_divisor"]
    codes = entry.get("m_codebook")
    if not isinstance(d, int) or isinstance(d, bool) or d < 1:
        raise _err(f"{where}['period_one_divisor'] must be a positive int, got {d!r}")
    if not isinstance(codes, Tensor):
        raise _err(f"{where} has period_one_divisor but no m_codebook tensor")
    n = codes.numel()
    if n % d != 0 or tuple(scale.shape) != (n // d, 1):
        raise _err(
            f"{where}['period_one_divisor'] = {d} is inconsistent with "
            f"m_codebook numel {n} and m_magnitude shape {tuple(scale.shape)} (expected "
            f"[{n // d if n % d == 0 else '?'}, 1])"
        )
    return scale if d == 1 else scale.repeat_interleave(d, dim=0)


def _convert_group(index: int, group: Mapping[str, Any], meta: Mapping[str, Any]) -> dict:
    where = f"param_groups[{index}]"
    out = {k: v for k, v in group.items() if k not in ("beta1", "beta2", _GROUP_METADATA)}
    if "beta1" in group or "beta2" in group:
        if "beta1" not in group or "beta2" not in group:
            raise _err(f"{where} has only one of beta1/beta2")
        betas = (group["beta1"], group["beta2"])
        if "betas" in group and tuple(group["betas"]) != betas:
            raise _err(f"{where} has betas {group['betas']!r} and beta1/beta2 {betas!r}")
        out["betas"] = betas
    params = group.get("params")
    if (
        "param_names" not in out
        and isinstance(group.get("name"), str)
        and isinstance(params, (list, tuple))
        and len(params) == 1
    ):
        out["param_names"] = [group["name"]]
    out["gefen_meta"] = dict(meta)
    return out
