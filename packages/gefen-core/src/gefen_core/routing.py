"""Which parameters Muon should train, and which go to the backup optimizer
(docs/algorithm.md#hybrid).

Muon orthogonalises a *matrix* update, which is only meaningful for hidden linear maps.
Embeddings (a lookup table, not a linear map of the activations), output heads and
classifiers (their rows are per-class, and AdamW-scale updates work better), and every
parameter that is not 2-D (biases, norm gains, scalars, convolution kernels) are trained by
the backup optimizer instead. This module makes that choice once, from the model, so that
:class:`~gefen_core.hybrid.GefenMuonHybrid` can hold both halves behind one optimizer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import Tensor, nn

__all__ = [
    "DEFAULT_BACKUP_SUBSTRINGS",
    "NamedParams",
    "describe_split",
    "split_params_for_muon",
    "validate_split",
]

NamedParams = list[tuple[str, Tensor]]

#: Lower-cased name fragments that send a 2-D parameter to the backup. Broad words such as
#: "head" or "output" are deliberately absent: they also name attention heads and hidden
#: output projections, which Muon should train.
DEFAULT_BACKUP_SUBSTRINGS: tuple[str, ...] = (
    "embed",
    "wte",
    "wpe",
    "lm_head",
    "classifier",
    "score",
)


def _embedding_weights(model: nn.Module) -> set[int]:
    # By tensor identity, so an LM head tied to the embedding (same Parameter object under
    # another name) is recognised even though named_parameters() reports it only once.
    return {
        id(m.weight)
        for m in model.modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and isinstance(m.weight, Tensor)
    }


def _check_substrings(backup_substrings: Iterable[str] | None) -> tuple[str, ...]:
    if backup_substrings is None:
        return DEFAULT_BACKUP_SUBSTRINGS
    if isinstance(backup_substrings, str):
        raise TypeError(
            "backup_substrings must be an iterable of strings, e.g. ('embed', 'lm_head'), "
            f"not the single string {backup_substrings!r}"
        )
    subs = tuple(backup_substrings)
    for s in subs:
        if not isinstance(s, str) or not s:
            raise TypeError(f"backup_substrings must hold non-empty strings, got {s!r}")
    return tuple(s.lower() for s in subs)


def _named_items(source: nn.Module | Iterable[tuple[str, Tensor]]) -> NamedParams:
    if isinstance(source, nn.Module):
        return list(source.named_parameters())
    if isinstance(source, Tensor):
        raise TypeError(
            "split_params_for_muon needs an nn.Module or (name, tensor) pairs such as "
            "model.named_parameters(); got a bare tensor"
        )
    items = []
    for i, item in enumerate(source):
        if (
            not isinstance(item, tuple)
            or len(item) != 2
            or not isinstance(item[0], str)
            or not isinstance(item[1], Tensor)
        ):
            raise TypeError(
                "split_params_for_muon needs (name, tensor) pairs, e.g. "
                f"model.named_parameters(); item {i} is {type(item).__name__}: {item!r:.80}"
            )
        items.append(item)
    return items


def split_params_for_muon(
    source: nn.Module | Iterable[tuple[str, Tensor]],
    *,
    backup_substrings: Iterable[str] | None = None,
) -> tuple[NamedParams, NamedParams]:
    """Split trainable parameters into a Muon list and a backup list (docs/algorithm.md#hybrid).

    For each ``(name, p)`` of ``model.named_parameters()`` (tied parameters appear once, under
    their first name), in order:

    1. ``p.requires_grad`` is False → in neither list (frozen; never touched);
    2. ``p`` is the ``.weight`` of an ``nn.Embedding``/``nn.EmbeddingBag`` (or subclass) of the
       model, by identity — this also catches an LM head tied to the embedding → backup;
    3. ``p.ndim != 2`` (biases, norms, scalars, convolution kernels) or ``p.numel() == 0``
       → backup;
    4. the lower-cased name contains one of ``backup_substrings`` → backup;
    5. otherwise → Muon.

    Args:
        source: an ``nn.Module``, or an iterable of ``(name, tensor)`` pairs (then rule 2 cannot
            apply: routing uses names and shapes only).
        backup_substrings: name fragments for rule 4 (case-insensitive); ``None`` means
            :data:`DEFAULT_BACKUP_SUBSTRINGS`. A given tuple replaces the defaults; extend
            them with ``DEFAULT_BACKUP_SUBSTRINGS + ("my_head",)``.

    Returns:
        ``(muon, backup)``: two lists of ``(name, parameter)`` in model order, names as given.

    Raises:
        TypeError: ``source`` is a bare tensor or holds something other than
            ``(str, Tensor)`` pairs; ``backup_substrings`` is a string or holds non-strings.
    """
    subs = _check_substrings(backup_substrings)
    embeddings = _embedding_weights(source) if isinstance(source, nn.Module) else set()
    muon: NamedParams = []
    backup: NamedParams = []
    for name, p in _named_items(source):
        if not p.requires_grad:
            continue
        lowered = name.lower()
        if (
            id(p) in embeddings
            or p.ndim != 2
            or p.numel() == 0
            or any(s in lowered for s in subs)
        ):
            backup.append((name, p))
        else:
            muon.append((name, p))
    return muon, backup


def _check_pairs(items: Sequence[object], what: str) -> NamedParams:
    if isinstance(items, (Tensor, str)) or not isinstance(items, Iterable):
        raise TypeError(f"{what} must be a list of (name, tensor) pairs, got {type(items)}")
    out = []
    for i, item in enumerate(items):
        if (
            not isinstance(item, tuple)
            or len(item) != 2
            or not isinstance(item[0], str)
            or not isinstance(item[1], Tensor)
        ):
            raise TypeError(
                f"{what}[{i}] must be a (name, tensor) pair, got {type(item).__name__}: "
                f"{item!r:.80}"
            )
        out.append(item)
    return out


def validate_split(
    muon: Sequence[tuple[str, Tensor]],
    backup: Sequence[tuple[str, Tensor]],
    model: nn.Module | None = None,
) -> None:
    """Check that a Muon/backup split is a partition of (trainable) parameters
    (docs/algorithm.md#hybrid).

    Args:
        muon, backup: lists of ``(name, tensor)`` pairs, e.g. from :func:`split_params_for_muon`.
        model: when given, every parameter of ``model`` with ``requires_grad=True`` must be in
            one of the lists (frozen ones may be absent).

    Raises:
        TypeError: an item is not a ``(str, Tensor)`` pair.
        ValueError: a tensor appears twice (in one list or in both); two names are equal
            ignoring case; a trainable parameter of ``model`` is in neither list.
    """
    muon_items = _check_pairs(muon, "muon")
    backup_items = _check_pairs(backup, "backup")
    seen_tensor: dict[int, str] = {}
    seen_name: dict[str, str] = {}
    for where, items in (("muon", muon_items), ("backup", backup_items)):
        for name, p in items:
            label = f"{where} parameter {name!r}"
            if id(p) in seen_tensor:
                raise ValueError(
                    f"{label} is the same tensor as {seen_tensor[id(p)]}; every parameter must "
                    "be in exactly one list, once (tied weights: list the tensor once)"
                )
            seen_tensor[id(p)] = label
            key = name.lower()
            if key in seen_name:
                raise ValueError(
                    f"{label} has the same (case-insensitive) name as {seen_name[key]}; "
                    "parameter names must be unique across both lists"
                )
            seen_name[key] = label
    if model is not None:
        missing = [
            n for n, p in model.named_parameters() if p.requires_grad and id(p) not in seen_tensor
        ]
        if missing:
            shown = ", ".join(repr(n) for n in missing[:8])
            more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            raise ValueError(
                f"{len(missing)} trainable parameter(s) of the model are in neither list: "
                f"{shown}{more}. Route them with split_params_for_muon(model) or freeze them "
                "(requires_grad=False)"
            )


def describe_split(muon: NamedParams, backup: NamedParams) -> str:
    """One line per half with parameter and element counts (for logs and ``verbose``)."""

    def count(items: NamedParams) -> str:
        return f"{len(items)} tensors, {sum(p.numel() for _, p in items):,} elements"

    return f"muon: {count(muon)}; backup: {count(backup)}"
