"""The optimizer step under ``torch.compile`` (docs/algorithm.md#compiled-stepping).

When ``torch.compile`` traces :meth:`Gefen.step <gefen_core.Gefen.step>` (``torch.compile(
opt.step)``, or a compiled function that calls it), the step takes this module's path instead
of the eager one. A *steady* step, one in which every parameter with a gradient already has its
period and state and nothing host-side is due, is traced into the caller's graph without a
graph break:

* the per-tensor update is one ``torch.ops.gefen.functional_step`` call per (group, path,
  device): an opaque custom op whose kernel is :func:`gefen_core.functional.gefen`, the very
  function the eager step calls, on the same tensors with the same scalars, so a compiled step
  gives the eager step's bits. Its bias corrections are computed inside the op from the step
  counters (the host-scalar paths read fp32 CPU counters; ``capturable`` groups read device
  counters), never in Python from values the compiler would have to guard on;
* the optimizer's step count ``T`` (which seeds stochastic rounding, O7) lives in tensors:
  the mirrors of ``Gefen._device_global_step`` (on the CPU for host-scalar groups, on the
  device for ``capturable`` ones), which every step advances. The Python count
  ``Gefen._global_step`` would make the compiler specialise on a value that changes every
  step, so the graph does not touch it; the next eager step, ``state_dict()`` or pickling
  read it back from the mirrors.

Every other step runs eagerly, outside the graph (one graph break, behind
``torch.compiler.disable``): the first step (period search and codebook learning read the
gradients on the host), a step in which a parameter gets its first gradient, a codebook
refresh schedule (``codebook_refresh_every > 0``: whether a refresh is due depends on ``T``),
a step under the GradScaler protocol (its ``found_inf`` decides on the host), DTensor
parameters and optimizers that reduce factored statistics across ranks.

Every eager step ends by preparing what a trace reads and cannot create (:func:`prepare`:
the mirrors and the name salts), so after one eager step, taken before compiling or by the
first compiled call, the next trace is the steady step. Dynamo keeps the frames above a graph
break as it compiled them: when the first compiled call takes the eager step, the steady step
is later traced in a frame of its own, one graph called from the caller's compiled frames;
an eager first step before compiling lets the steady step join the caller's graph.

Traced code never reads ``group["capturable"]`` (dynamo shows every group of an optimizer as
capturable to it) nor tells groups apart by ``is``/``id()`` (older dynamo cannot trace them
on dicts): the mode comes from the state's layout (:func:`counters_on_device`), the group
from its index.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from gefen_kernels.ops import transient_tables

from . import _op_record, functional
from . import dispatch as _dispatch

__all__ = ["counters_on_device", "functional_step", "seed_tensor", "sync_global_step",
           "traced_hybrid_step", "traced_muon_step", "traced_step"]

_CPU = torch.device("cpu")
_DTENSOR: type | None
try:
    from torch.distributed.tensor import DTensor

    _DTENSOR = DTensor
except ImportError:  # builds without torch.distributed
    _DTENSOR = None


# --------------------------------------------------------------------------------------------
# The opaque per-call op
# --------------------------------------------------------------------------------------------


# The op takes its scalars packed in lists: torch's custom-op dispatch costs time quadratic in
# the number of schema arguments (about 0.3 ms a call at 26 arguments).
#
# The step counters (state_steps, exp_avg_sq_steps) are advanced inside the op but are not
# declared mutated: the traced graph passes them through and never reads them, so nothing in
# the graph depends on their new values. Declared, inductor functionalizes them, and for CUDA
# parameters with CPU counters (capturable=False) it hands the op reinterpreted views of its
# own buffers instead of the state's tensors, whose values make the host bias corrections fail
# ("math domain error", seen on an H200 with torch 2.11).


@torch.library.custom_op(
    "gefen::functional_step",
    mutates_args=("params", "exp_avg_codes", "exp_avg_scales", "exp_avg_sqs", "exp_avg_sq_rows",
                  "exp_avg_sq_cols"),
)
def _functional_step_op(
    params: list[Tensor], grads: list[Tensor], exp_avg_codes: list[Tensor],
    exp_avg_scales: list[Tensor], exp_avg_sqs: list[Tensor], exp_avg_sq_rows: list[Tensor],
    exp_avg_sq_cols: list[Tensor], state_steps: list[Tensor], exp_avg_sq_steps: list[Tensor],
    codebook: Tensor, global_step: Tensor, lr_tensor: Tensor | None, factored: list[bool],
    salts: list[int], scalars: list[float], flags: list[bool], path: str,
) -> None:
    lr, beta1, beta2, eps, weight_decay = scalars
    maximize, stochastic_round, capturable = flags
    functional_step(
        params, grads, exp_avg_codes, exp_avg_scales, exp_avg_sqs, exp_avg_sq_rows,
        exp_avg_sq_cols, state_steps, exp_avg_sq_steps, codebook=codebook,
        global_step=global_step, lr=lr if lr_tensor is None else lr_tensor,
        factored=factored, salts=salts, beta1=beta1, beta2=beta2, eps=eps,
        weight_decay=weight_decay, maximize=maximize, stochastic_round=stochastic_round,
        path=path, capturable=capturable)


@_functional_step_op.register_fake
def _functional_step_fake(
    params: list[Tensor], grads: list[Tensor], exp_avg_codes: list[Tensor],
    exp_avg_scales: list[Tensor], exp_avg_sqs: list[Tensor], exp_avg_sq_rows: list[Tensor],
    exp_avg_sq_cols: list[Tensor], state_steps: list[Tensor], exp_avg_sq_steps: list[Tensor],
    codebook: Tensor, global_step: Tensor, lr_tensor: Tensor | None, factored: list[bool],
    salts: list[int], scalars: list[float], flags: list[bool], path: str,
) -> None:
    return None


def functional_step(
    params: list[Tensor], grads: list[Tensor], exp_avg_codes: list[Tensor],
    exp_avg_scales: list[Tensor], exp_avg_sqs: list[Tensor], exp_avg_sq_rows: list[Tensor],
    exp_avg_sq_cols: list[Tensor], state_steps: list[Tensor], exp_avg_sq_steps: list[Tensor],
    *, codebook: Tensor, global_step: Tensor, lr: float | Tensor, factored: list[bool],
    salts: list[int], beta1: float, beta2: float, eps: float, weight_decay: float,
    maximize: bool, stochastic_round: bool, path: str, capturable: bool,
) -> None:
    """One eager-step call of :func:`gefen_core.functional.gefen` (the kernel of
    ``torch.ops.gefen.functional_step``).

    Args:
        params, grads, exp_avg_codes, exp_avg_scales, state_steps, exp_avg_sq_steps: one
            entry per parameter, as :func:`gefen_core.functional.gefen`.
        exp_avg_sqs: the block-mode parameters' fp32 ``[B, 1]`` second moments, in order;
            exp_avg_sq_rows, exp_avg_sq_cols: the factored parameters' statistics, in order
            (``factored[i]`` says which list parameter ``i`` draws from).
        codebook: fp32 ``[256]`` on the parameters' device.
        global_step: int64 0-d step count ``T`` before this step: on the CPU for the host
            seeds, on the parameters' device when ``capturable``.
        lr: float, or a 1-element tensor.
        salts: each parameter's name salt as a signed 64-bit int (O7).
        path: ``"fused"``, ``"foreach"`` or ``"for_loop"``.
        beta1, beta2, eps, weight_decay, maximize, stochastic_round, capturable: the group's.

    Seeds are those of the eager step: ``(T * MIX) xor salt`` (docs/algorithm.md#
    stochastic-rounding), as Python ints from the CPU count or, when ``capturable``, as device
    tensors.

    Raises:
        RuntimeError: a CUDA graph is being captured (``mode="reduce-overhead"``) and the
            group is not ``capturable``: the host scalars would be frozen into the graph.
    """
    from ._seeds import _SEED_MIX, _to_signed64, mix_seed

    if not params:
        return
    if (not capturable and params[0].device.type == "cuda"
            and torch.cuda.is_current_stream_capturing()):
        raise RuntimeError(
            "Gefen: a CUDA graph is capturing the compiled step (torch.compile mode="
            "'reduce-overhead') but the param group has capturable=False, whose bias "
            "corrections and seeds are host values that a replay would repeat; build the "
            "optimizer with capturable=True")
    sqs, rows, cols = iter(exp_avg_sqs), iter(exp_avg_sq_rows), iter(exp_avg_sq_cols)
    sq_list = [None if f else next(sqs) for f in factored]
    row_list = [next(rows) if f else None for f in factored]
    col_list = [next(cols) if f else None for f in factored]
    seeds: list[int] | None = None
    seed_tensors: list[Tensor] | None = None
    if capturable:
        mixed = global_step * _to_signed64(_SEED_MIX)
        seed_tensors = [torch.bitwise_xor(mixed, salt).reshape(1) for salt in salts]
    else:
        step_count = int(global_step.item())  # a CPU tensor: no device synchronisation
        seeds = [mix_seed(step_count, salt) for salt in salts]
    # A host-scalar fused call repeats its recorded launches when nothing they depend on
    # changed (gefen_core._op_record), as the eager steady step does.
    steady = path == "fused" and not capturable and not isinstance(lr, Tensor)
    lists = (params, grads, exp_avg_codes, exp_avg_scales, sq_list, row_list, col_list,
             state_steps, exp_avg_sq_steps)
    if steady and _op_record.run(
            *lists, codebook=codebook, lr=float(lr), beta1=beta1, beta2=beta2, eps=eps,
            weight_decay=weight_decay, maximize=maximize, stochastic_round=stochastic_round,
            seeds=seeds):
        return
    # A compiled caller may own the memory this call allocates from (reduce-overhead: the
    # CUDA-graph trees' pool, which refuses tensors that outlive the call), so the launch
    # tables built here are not kept; the eager steps keep theirs.
    with transient_tables():
        functional.gefen(
            *lists, codebook=codebook, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
            weight_decay=weight_decay, maximize=maximize, stochastic_round=stochastic_round,
            seeds=seeds, seed_tensors=seed_tensors, foreach=path == "foreach",
            fused=path == "fused", capturable=capturable, differentiable=False)
    if steady:
        # Host-scalar groups only: under reduce-overhead a capture refuses them (above), so
        # the tables this keeps never come from the CUDA-graph trees' pool of a working step.
        _op_record.record(*lists, codebook=codebook, beta1=beta1, beta2=beta2, eps=eps,
                          maximize=maximize, stochastic_round=stochastic_round)


# --------------------------------------------------------------------------------------------
# The traced step
# --------------------------------------------------------------------------------------------


def _scaler_attached(opt: Any) -> bool:
    return (getattr(opt, "found_inf", None) is not None
            or getattr(opt, "grad_scale", None) is not None)


def counters_on_device(state: dict[str, Any]) -> bool:
    """Whether a parameter steps in ``capturable`` mode in a traced step: its step counter
    lives off the CPU, where a ``capturable`` group creates it.

    The traced step reads the mode from the state's layout, not from ``group["capturable"]``:
    dynamo's optimizer support shows every group as capturable to traced code (so that
    torch's own optimizers take their capturable math). For CUDA parameters the layout is the
    flag; for CPU parameters both modes keep CPU counters and the traced step takes the host
    path (Gefen's two paths give the same bits there)."""
    return bool(state["step"].device.type != "cpu")


def _entries(opt: Any) -> list[tuple[int, dict[str, Any], Tensor, Tensor, str]] | None:
    """``(group index, group, param, grad, name)`` of every parameter with a gradient, in
    group order, or ``None`` when a gradient would fail the eager step's checks (the eager
    step then raises its error) or a parameter is a DTensor. (Groups are told apart by their
    index: older dynamo versions cannot trace ``is`` or ``id()`` on a dict.)"""
    out = []
    for index, group in enumerate(opt.param_groups):
        for p, name in zip(group["params"], group["param_names"]):
            g = p.grad
            if g is None:
                continue
            if (_DTENSOR is not None and isinstance(p, _DTENSOR)) or (
                    g.layout != torch.strided or g.is_sparse or g.is_complex()
                    or not g.is_floating_point() or g.shape != p.shape or g.device != p.device):
                return None
            out.append((index, group, p, g, name))
    return out


def _salts(opt: Any) -> dict[str, int] | None:
    """Each parameter name's salt (O7) as a signed 64-bit int, computed by an eager step
    (:func:`prepare`): the hash cannot be traced."""
    salts: dict[str, int] | None = opt._compiled_salts
    return salts


def _steady_calls(opt: Any) -> list[dict[str, Any]] | None:
    """The ``functional_step`` calls of a steady step, or ``None`` when this step must run
    eagerly (see the module docstring). Reads only what is fixed from one steady step to the
    next (the compiler guards on it): state keys, tensor metadata, group options.

    A group's mode is its state's layout: ``capturable`` where the step counters live on the
    parameters' device (where a ``capturable`` group creates them), the host-scalar path where
    they are fp32 CPU tensors; on the CPU both give the same bits."""
    if (opt._codebook is None or opt._codebook_refresh_every > 0 or opt._reduces_factored_stats
            or _scaler_attached(opt)):
        return None
    entries = _entries(opt)
    if entries is None:
        return None
    salts = _salts(opt)
    if salts is None:
        return None
    mirrors = opt._device_global_step
    calls: list[dict[str, Any]] = []
    for index, group, p, g, name in entries:
        if p.numel() == 0:
            continue
        state = opt.state.get(p)
        if state is None or "exp_avg_codes" not in state or "exp_avg_sq_step" not in state:
            return None
        # p is no DTensor here: sharded=True only skips the DTensor test, which the compiler
        # would trace through a cache wrapper.
        factored = _dispatch.is_factored(p, group, sharded=True)
        if factored != ("exp_avg_sq_row" in state):
            return None  # a mode migration (docs/algorithm.md#factoring-rule) runs eagerly
        dev = g.device
        counters = state["step"].device
        if (state["exp_avg_codes"].device != dev or state["exp_avg_sq_step"].device != counters
                or counters not in mirrors or counters.type not in ("cpu", dev.type)):
            return None  # paged state follows the gradient eagerly
        path = _dispatch.choose_path(p, group, deterministic=opt._deterministic,
                                     sharded_factored=True)
        call = _call_for(calls, index, group, path, dev, counters)
        call["params"].append(p)
        call["grads"].append(g)
        call["codes"].append(state["exp_avg_codes"])
        call["scales"].append(state["exp_avg_scale"])
        if factored:
            call["rows"].append(state["exp_avg_sq_row"])
            call["cols"].append(state["exp_avg_sq_col"])
        else:
            call["sqs"].append(state["exp_avg_sq"])
        call["factored"].append(factored)
        call["steps"].append(state["step"])
        call["sq_steps"].append(state["exp_avg_sq_step"])
        salt = salts.get(name)
        if salt is None:
            return None
        call["salts"].append(salt)
    return calls


def _call_for(calls: list[dict[str, Any]], index: int, group: dict[str, Any], path: str,
              dev: torch.device, counters: torch.device) -> dict[str, Any]:
    for call in calls:
        if (call["index"] == index and call["path"] == path and call["device"] == dev
                and call["counters"] == counters):
            return call
    call = {"index": index, "group": group, "path": path, "device": dev, "counters": counters,
            "params": [], "grads": [], "codes": [], "scales": [], "sqs": [], "rows": [], "cols": [],
            "factored": [], "steps": [], "sq_steps": [], "salts": []}
    calls.append(call)
    return call


def _run_closure(closure: Callable[[], Any] | None) -> Any:
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def traced_step(opt: Any, closure: Callable[[], Any] | None) -> Any:
    """:meth:`Gefen.step` while ``torch.compile`` traces it (module docstring)."""
    loss = _run_closure(closure)
    calls = _steady_calls(opt)
    if calls is None:
        _step_outside_graph(opt)
        return loss
    mirrors = opt._device_global_step
    for call in calls:
        group = call["group"]
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        lr_tensor = lr if isinstance(lr, Tensor) else None
        torch.ops.gefen.functional_step(
            call["params"], call["grads"], call["codes"], call["scales"], call["sqs"],
            call["rows"], call["cols"], call["steps"], call["sq_steps"],
            opt._codebook_on(call["device"]), mirrors[call["counters"]], lr_tensor,
            call["factored"], call["salts"],
            [0.0 if lr_tensor is not None else float(lr), float(beta1), float(beta2),
             float(group["eps"]), float(group["weight_decay"])],
            [bool(group["maximize"]), bool(group["stochastic_round"]),
             call["counters"].type != "cpu"], call["path"])
    advance_global_step(opt)
    return loss


@torch.library.custom_op("gefen::step_seed", mutates_args=())
def _step_seed_op(step_count: Tensor, salt: int) -> Tensor:
    from ._seeds import _SEED_MIX, _to_signed64

    return torch.bitwise_xor(step_count * _to_signed64(_SEED_MIX), salt).reshape(1)


@_step_seed_op.register_fake
def _step_seed_fake(step_count: Tensor, salt: int) -> Tensor:
    return step_count.new_empty((1,), dtype=torch.int64)


def seed_tensor(opt: Any, name: str, state: dict[str, Any], device: torch.device) -> Tensor:
    """The stochastic-rounding seed ``(T * MIX) xor salt`` of one tensor in a traced step, as
    an int64 ``[1]`` tensor on ``device`` (the eager step's value, docs/algorithm.md#
    stochastic-rounding), from the step-count mirror. Mixed by an opaque op: the compiler's
    range analysis refuses the wrapping int64 product."""
    count = opt._device_global_step[state["step"].device]
    seed: Tensor = torch.ops.gefen.step_seed(count, opt._compiled_salts[name])
    return seed.to(device)


Grouped = list[tuple[dict[str, Any], list[tuple[Tensor, Tensor, str]]]]


def _muon_groups(opt: Any) -> Grouped | None:
    """Each group's ``(param, grad, name)`` items of a steady GefenMuon step, or ``None``:
    codebook learnt, every stepped matrix initialised (its NorMuon state too), the mirrors and
    salts in place, no GradScaler protocol, every parameter a plain 2-D matrix with a valid
    gradient. (Empty matrices are skipped, as the eager step does.)"""
    if opt._codebook is None or opt._dense_momentum_for_testing or _scaler_attached(opt):
        return None
    entries = _entries(opt)
    if entries is None:
        return None
    salts = _salts(opt) or {}
    grouped: Grouped = [(group, []) for group in opt.param_groups]
    for index, group, p, g, name in entries:
        if p.ndim != 2:
            return None
        if g.numel() == 0:
            continue
        state = opt.state.get(p)
        if state is None or "exp_avg_codes" not in state or (
                group["normuon"] and "normuon_exp_avg_sq" not in state):
            return None
        if (state["exp_avg_codes"].device != g.device
                or state["step"].device not in opt._device_global_step):
            return None
        if group["stochastic_round"] and name not in salts:
            return None
        grouped[index][1].append((p, g, name))
    return grouped


def traced_muon_step(opt: Any, closure: Callable[[], Any] | None) -> Any:
    """:meth:`GefenMuon.step <gefen_core.GefenMuon.step>` while ``torch.compile`` traces it:
    the eager pipeline with its momentum, Newton–Schulz and update as opaque ops, seeded from
    the step-count mirrors; non-steady steps run eagerly (module docstring)."""
    loss = _run_closure(closure)
    grouped = _muon_groups(opt)
    if grouped is None:
        _step_outside_graph(opt)
        return loss
    opt._step_groups(grouped)
    return loss


def traced_hybrid_step(hybrid: Any, closure: Callable[[], Any] | None, *,
                       backup_is_gefen: bool) -> Any:
    """:meth:`GefenMuonHybrid.step <gefen_core.GefenMuonHybrid.step>` while ``torch.compile``
    traces it: both halves' traced steps when both are steady (an AdamW backup always is:
    torch compiles it), else the whole eager step outside the graph. ``backup_is_gefen``:
    the backup is a :class:`gefen_core.Gefen` (whose steadiness is checked)."""
    loss = _run_closure(closure)
    muon, backup = hybrid.muon, hybrid.backup
    grouped = None if muon is None else _muon_groups(muon)
    if _scaler_attached(hybrid) or (muon is not None and grouped is None) or (
            backup_is_gefen and _steady_calls(backup) is None):
        _step_outside_graph(hybrid)
        return loss
    if muon is not None and grouped is not None:
        muon._step_groups(grouped)
    if backup is not None:
        backup.step()
    return loss


def advance_global_step(opt: Any) -> None:
    """End of a traced step: ``T + 1`` in every mirror; the Python count follows later
    (:func:`sync_global_step`)."""
    for t in opt._device_global_step.values():
        t.add_(1)


def sync_global_step(opt: Any) -> None:
    """Start of an eager step: the Python count ``T`` from the CPU mirror, which traced steps
    advance and it does not (one read of a CPU tensor, no device synchronisation). Where all
    groups are ``capturable`` there is no CPU mirror: the device mirrors are the count, as
    after CUDA-graph replays, and ``state_dict()`` reads them (``_sync_global_step``)."""
    cpu = opt._device_global_step.get(_CPU)
    if cpu is not None:
        opt._global_step = int(cpu.item())


@torch.compiler.disable
def _step_outside_graph(opt: Any) -> None:
    """A non-steady step, eagerly (one graph break); the eager step prepares the next trace
    (:func:`prepare`)."""
    with torch.no_grad():
        opt._eager_step(None)


def prepare(opt: Any) -> None:
    """After an eager step: what a traced step reads and cannot create itself.

    * the step-count mirror of each group's counters: the CPU one for host-scalar groups, the
      parameters' devices for ``capturable`` ones (created from the current count; the eager
      steps advance them from then on);
    * each parameter name's salt (the hash cannot be traced);
    * when dynamo is loaded, the parameters, state and mirrors marked as static inputs, as dynamo
      marks torch's optimizers' (a CUDA graph of the step, ``mode="reduce-overhead"``, then
      neither copies them nor refuses to mutate them).

    Cheap when nothing changed; skipped while a CUDA graph is being captured (a capture is
    preceded by eager warm-up steps, which prepare)."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return
    groups = opt.param_groups
    mirrors = opt._device_global_step
    for group in groups:
        if not group["capturable"]:
            if _CPU not in mirrors:
                opt._device_step(_CPU)
            continue
        for p in group["params"]:
            device = _dispatch.local(p).device
            if device not in mirrors:
                opt._device_step(device)
    key = tuple(id(group["param_names"]) for group in groups)
    if opt._compiled_salts_key != key:
        from ._seeds import _to_signed64, name_salt

        opt._compiled_salts = {name: _to_signed64(name_salt(name))
                               for group in groups for name in group["param_names"]}
        opt._compiled_salts_key = key
    if "torch._dynamo" in sys.modules:
        _mark_static(opt)


def _mark_static(opt: Any) -> None:
    codebook = opt._codebook
    key = (len(opt.state), id(codebook), len(opt._device_global_step))
    if opt._static_marked_key == key:
        return
    mark = torch._dynamo.mark_static_address
    tensors = [p for group in opt.param_groups for p in group["params"]]
    tensors += [t for state in opt.state.values() if isinstance(state, dict)
                for t in state.values() if isinstance(t, Tensor)]
    tensors += list(opt._device_global_step.values())
    if codebook is not None:
        tensors.append(codebook)
    for t in tensors:
        if _DTENSOR is None or not isinstance(t, _DTENSOR):
            mark(t, guard=True)
    opt._static_marked_key = key
