"""StepGroups (one launch per class of tensors) against one StepPlan launch per tensor: the
same bits for every parameter and state tensor, whatever the grouping and chunking."""

from __future__ import annotations

import importlib
from collections import Counter
from typing import Any

import pytest
import torch
from kernels_inputs import (
    assert_bitwise,
    count_launches,
    make_codebook,
    random_state,
    with_zero_gradients,
)

from gefen_kernels._numerics import f32
from gefen_kernels.ops import step_groups
from gefen_kernels.ops.step_groups import StepGroups
from gefen_kernels.ops.step_plan import StepPlan
from gefen_kernels.ops.step_scalars import StepScalars


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


# (shape, period, param dtype, grad dtype, factored). Factored shapes include a column count
# that is not a multiple of 16 (no alignment hints), several column tiles, a zero row.
CASES = [
    ((24, 40), 20, torch.bfloat16, torch.bfloat16, True),
    ((32, 64), 64, torch.float32, torch.float32, True),
    ((33, 48), 16, torch.bfloat16, torch.bfloat16, True),
    ((5, 600), 40, torch.bfloat16, torch.bfloat16, True),
    ((16, 32), 32, torch.bfloat16, torch.float16, True),  # another gradient dtype: its class
    ((48, 64), 64, torch.float32, torch.float32, True),  # second member of the fp32 class
    ((9, 600), 50, torch.bfloat16, torch.bfloat16, True),  # second member of the 600's class
    # A head and a tail piece (tile_shape's TAIL), with per-element and with row statistics,
    # and a period of the same P2 without a tail: a class of its own (TAIL is in the key).
    ((6, 96), 144, torch.bfloat16, torch.bfloat16, True),
    ((4, 288), 144, torch.bfloat16, torch.bfloat16, True),
    ((10, 96), 240, torch.bfloat16, torch.bfloat16, True),
    ((210,), 7, torch.bfloat16, torch.bfloat16, False),
    ((150,), 5, torch.bfloat16, torch.bfloat16, False),
    ((3072,), 1024, torch.float32, torch.float32, False),
    ((96,), 32, torch.float16, torch.float16, False),
    ((8198,), 4099, torch.bfloat16, torch.bfloat16, False),  # split route: launched alone
    # Split route, factored: grouped statistics (a class of its own), the update alone.
    ((3, 8200), 8200, torch.bfloat16, torch.bfloat16, True),
    ((0,), 1, torch.bfloat16, torch.bfloat16, False),  # empty: nothing to launch
]


def _tensors(dev: str, seed: int, cases: list[Any] = CASES) -> list[dict[str, Any]]:
    out = []
    for j, (shape, period, pdt, gdt, factored) in enumerate(cases):
        gen = torch.Generator().manual_seed(seed + j)
        n = 1
        for s in shape:
            n *= s
        item: dict[str, Any] = {
            "param": torch.randn(shape, generator=gen).to(pdt).to(dev),
            "grad": with_zero_gradients(torch.randn(shape, generator=gen).to(gdt).to(dev),
                                        period, seed + j),
        }
        st = random_state(n // period, period, seed=seed + j)
        item["codes"], item["scale"] = st["codes"].to(dev), st["scale"].to(dev)
        if factored:
            item["grad"][1] = 0.0
            item["sq"] = None
            item["row"] = (torch.rand(shape[0], generator=gen) * 1e-3).to(dev)
            item["col"] = (torch.rand(shape[1], generator=gen) * 1e-3).to(dev)
        else:
            item["sq"], item["row"], item["col"] = st["exp_avg_sq"].to(dev), None, None
        out.append(item)
    return out


def _unaligned(grad: torch.Tensor) -> torch.Tensor:
    """A copy of ``grad`` one element past a 16-byte boundary (not 16-byte aligned)."""
    buf = torch.empty(grad.numel() + 1, dtype=grad.dtype, device=grad.device)
    out = buf[1:].view_as(grad)
    out.copy_(grad)
    return out


def _clone(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in it.items()}
            for it in items]


def _plans(items: list[dict[str, Any]], cb: torch.Tensor, **options: Any) -> list[StepPlan]:
    return [StepPlan(it["param"], it["codes"], it["scale"], it["sq"], it["row"], it["col"], cb,
                     beta1=0.9, beta2=0.999, eps=1e-8, capturable=False, **options)
            for it in items]


def _scalars(j: int, factored: bool) -> StepScalars:
    # A different step count per tensor, so a wrong row of the scalar table shows.
    t = 3 + j
    bc2 = 1.0 / (1.0 - 0.999**t) if factored else (1.0 - 0.999**t) ** -0.5
    return StepScalars(lr=f32(1e-3 * (1 + j)), bc2=f32(bc2), bc1_recip=f32(1.0 / (1.0 - 0.9**t)),
                       decay=f32(1.0 - 1e-5 * j))


def _compare(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    for j, (x, y) in enumerate(zip(a, b)):
        for k in ("param", "codes", "scale", "sq", "row", "col"):
            if x[k] is not None:
                assert_bitwise(x[k], y[k], f"tensor {j} {k}")


@pytest.mark.parametrize("options", [
    {"maximize": False, "stochastic_round": False},
    {"maximize": True, "stochastic_round": True},
])
@pytest.mark.parametrize("scratch_bytes", [step_groups.GROUP_SCRATCH_BYTES, 4096])
def test_groups_equal_one_launch_per_plan(options, scratch_bytes, monkeypatch) -> None:
    monkeypatch.setattr(step_groups, "GROUP_SCRATCH_BYTES", scratch_bytes)
    dev = _device()
    cb = make_codebook(2).to(dev)
    base = _tensors(dev, seed=10)
    scalars = [_scalars(j, c[4]) for j, c in enumerate(CASES)]
    seeds = [17 * j - 40 for j in range(len(CASES))]
    a, b = _clone(base), _clone(base)
    for plan, it, sc, seed in zip(_plans(a, cb, **options), a, scalars, seeds):
        lr, bc2, bc1, decay = sc
        plan.launch(it["grad"], lr=lr, bc1_recip=bc1, bc2=bc2, decay=decay, seed=seed)
    plans = _plans(b, cb, **options)
    grads = [it["grad"] for it in b]
    groups = StepGroups(plans, grads)
    groups.launch(grads, scalars, seeds)
    # A second step through the same tables, with the gradients at new addresses (as in a
    # loop that frees them): their offsets are recomputed every step.
    moved = [g.clone() for g in grads]
    assert groups.matches(plans, moved)
    groups.launch(moved, scalars, seeds)
    for plan, it, sc, seed in zip(_plans(a, cb, **options), a, scalars, seeds):
        lr, bc2, bc1, decay = sc
        plan.launch(it["grad"], lr=lr, bc1_recip=bc1, bc2=bc2, decay=decay, seed=seed)
    _compare(b, a)
    assert groups.matches(plans, grads)


def test_loop_route_factored_plans_share_the_statistics_launches(monkeypatch) -> None:
    # Routes forced by period (choose_route is speed-only): loop above 32, else tile.
    step_plan = importlib.import_module("gefen_kernels.ops.step_plan")
    monkeypatch.setattr(step_plan, "choose_route",
                        lambda num_blocks, period, device: "loop" if period > 32 else "tile")
    cases = [((40, 64), 64, torch.bfloat16, torch.bfloat16, True),  # loop
             ((40, 64), 64, torch.bfloat16, torch.bfloat16, True),  # loop, same class
             ((24, 40), 20, torch.bfloat16, torch.bfloat16, True),  # tile
             ((64,), 64, torch.bfloat16, torch.bfloat16, False)]  # block, loop: alone
    launches: Counter[str] = Counter()
    original = step_groups._group_stats_kernel

    class Counting:
        def __getitem__(self, grid: Any) -> Any:
            launches["stats"] += 1
            return original[grid]

    monkeypatch.setattr(step_groups, "_group_stats_kernel", Counting())
    dev = _device()
    cb = make_codebook(5).to(dev)
    base = _tensors(dev, seed=30, cases=cases)
    scalars = [_scalars(j, c[4]) for j, c in enumerate(cases)]
    seeds = [5 * j + 1 for j in range(len(cases))]
    a, b = _clone(base), _clone(base)
    plans_a = _plans(a, cb, maximize=False, stochastic_round=True)
    assert [p.route for p in plans_a] == ["loop", "loop", "tile", "loop"]
    for plan, it, sc, seed in zip(plans_a, a, scalars, seeds):
        lr, bc2, bc1, decay = sc
        plan.launch(it["grad"], lr=lr, bc1_recip=bc1, bc2=bc2, decay=decay, seed=seed)
    plans = _plans(b, cb, maximize=False, stochastic_round=True)
    grads = [it["grad"] for it in b]
    StepGroups(plans, grads).launch(grads, scalars, seeds)
    assert launches["stats"] == 2  # the two loop-route tensors' class, the tile class
    _compare(b, a)


# Classes of several members whose blocks cross rows (FLAT_UPDATE): fp32 parameters, where
# a one-ulp difference in an update shows.
FLAT_CASES = [((40, 112), 80, torch.float32, torch.bfloat16, True)] * 3 + [
    ((6, 96), 144, torch.float32, torch.float32, True)] * 2


@pytest.mark.parametrize("scratch_bytes", [step_groups.GROUP_SCRATCH_BYTES, 0])
def test_flat_update_classes_match_the_fused_tile(scratch_bytes, monkeypatch) -> None:
    """Grouped FLAT_UPDATE classes (the flat update's programs of later members start at
    ``update_first`` > 0; with no scratch to share, one chunk per member) give the bits of
    one fused tile launch per plan (``flat_update`` switched off)."""
    step_plan = importlib.import_module("gefen_kernels.ops.step_plan")
    dev = _device()
    cb = make_codebook(2).to(dev)
    base = _tensors(dev, seed=60, cases=FLAT_CASES)
    scalars = [_scalars(j, True) for j in range(len(FLAT_CASES))]
    seeds = [17 * j - 40 for j in range(len(FLAT_CASES))]
    a, b = _clone(base), _clone(base)
    with monkeypatch.context() as m:
        m.setattr(step_plan, "flat_update", lambda *args: False)
        for plan, it, sc, seed in zip(_plans(a, cb, maximize=False, stochastic_round=True), a,
                                      scalars, seeds):
            assert not plan._consts["FLAT_UPDATE"]
            lr, bc2, bc1, decay = sc
            plan.launch(it["grad"], lr=lr, bc1_recip=bc1, bc2=bc2, decay=decay, seed=seed)
    monkeypatch.setattr(step_groups, "GROUP_SCRATCH_BYTES", scratch_bytes)
    plans = _plans(b, cb, maximize=False, stochastic_round=True)
    grads = [it["grad"] for it in b]
    groups = StepGroups(plans, grads)
    flat = [cls for cls in groups._classes if cls.consts["FLAT_UPDATE"]]
    assert sorted(cls.members for cls in flat) == [[0, 1, 2], [3, 4]]
    assert [len(cls.chunks) for cls in flat] == ([1, 1] if scratch_bytes else [3, 2])
    groups.launch(grads, scalars, seeds)
    _compare(b, a)
    for it, orig in zip(b, base):
        assert (it["param"] != orig["param"]).any()


def test_groups_launch_once_per_class_and_chunk(monkeypatch) -> None:
    counts = count_launches(monkeypatch, step_groups, (
        "_group_tile_kernel", "_group_stats_kernel", "_group_finalize_kernel",
        "_group_update_kernel"))
    dev = _device()
    cb = make_codebook(2).to(dev)
    items = _tensors(dev, seed=3)
    plans = _plans(items, cb, maximize=False, stochastic_round=False)
    grads = [it["grad"] for it in items]
    StepGroups(plans, grads).launch(grads, [_scalars(j, c[4]) for j, c in enumerate(CASES)],
                                    None)
    # Factored classes: (bf16, bf16, P2 32, unaligned), (fp32, P2 64, aligned),
    # (bf16, P2 16, aligned), (bf16, P2 64, unaligned: 600 columns), (bf16 param, fp16 grad),
    # the two head-and-tail classes (P2 256, TAIL 16; with and without IN_ROW), P2 256 without
    # a tail, and the split-route tensor's (statistics only). Block classes: P2 8 bf16, P2 1024
    # fp32, P2 32 fp16. The block split-route tensor launches alone and the empty one not at
    # all. The two classes whose blocks cross rows at a period that is a multiple of 16 (P 144
    # and 240 on 96 columns) follow their tile launch with a flat update (FLAT_UPDATE).
    assert counts == {"_group_stats_kernel": 9, "_group_finalize_kernel": 9,
                      "_group_tile_kernel": 11, "_group_update_kernel": 2}
    flat = [cls.members for cls in StepGroups(plans, grads)._classes
            if cls.consts.get("FLAT_UPDATE")]
    assert sorted(flat) == [[7], [9]]
    # One factored tensor per chunk; block classes need no scratch and stay whole.
    monkeypatch.setattr(step_groups, "GROUP_SCRATCH_BYTES", 0)
    counts.clear()
    StepGroups(plans, grads).launch(grads, [_scalars(j, c[4]) for j, c in enumerate(CASES)],
                                    None)
    assert counts == {"_group_stats_kernel": 11, "_group_finalize_kernel": 11,
                      "_group_tile_kernel": 13, "_group_update_kernel": 2}


@pytest.mark.parametrize("force_loop", [False, True])
def test_staged_launch_with_device_scalars_equals_launch(force_loop, monkeypatch) -> None:
    """stage() into one reused buffer + launch_staged(device_scalars=True), the form a CUDA
    graph captures and replays, gives the bits of launch() over two steps with different
    scalars and seeds, for grouped classes, statistics-only classes and plans launched alone
    (which then read their scalars and seed from the buffer: another compiled variant). The
    lone plans: an unaligned tile-route gradient and split-route tensors; with ``force_loop``
    also loop-route ones (StepPlan's device-scalar variants of the tile and loop kernels)."""
    if force_loop:  # periods above 32 take the loop route (choose_route is speed-only)
        step_plan = importlib.import_module("gefen_kernels.ops.step_plan")
        monkeypatch.setattr(step_plan, "choose_route",
                            lambda num_blocks, period, device: "loop" if period > 32 else "tile")
    dev = _device()
    cb = make_codebook(3).to(dev)
    base = _tensors(dev, seed=40)
    a, b = _clone(base), _clone(base)
    for it in (a[1], b[1]):
        it["grad"] = _unaligned(it["grad"])  # a tile-route plan launched alone
    plans_a = _plans(a, cb, maximize=False, stochastic_round=True)
    plans_b = _plans(b, cb, maximize=False, stochastic_round=True)
    grads_a = [it["grad"] for it in a]
    grads_b = [it["grad"] for it in b]
    groups_a, groups_b = StepGroups(plans_a, grads_a), StepGroups(plans_b, grads_b)
    assert groups_b._singles and any(cls.stats_only for cls in groups_b._classes)
    buffer = torch.empty(4 * len(CASES), dtype=torch.int64, device=dev)
    for step in range(2):
        scalars = [_scalars(j + 5 * step, c[4]) for j, c in enumerate(CASES)]
        seeds = [31 * j - 7 + step for j in range(len(CASES))]
        groups_a.launch(grads_a, scalars, seeds)
        assert groups_b.stage(grads_b, scalars, seeds, out=buffer) is buffer
        groups_b.launch_staged(grads_b, buffer, None, None, device_scalars=True)
        # The next step's gradients at new addresses (autograd re-allocates them), each with
        # its alignment: grouped ones reach the kernels through the staged offsets only.
        grads_b = [_unaligned(g) if g.data_ptr() % 16 else g.clone() for g in grads_b]
    _compare(b, a)
    # Launched with their own gradient's address: the unaligned one, the empty one and every
    # plan off the tile route (alone, or the update of a statistics-only class).
    assert groups_b.direct == [i for i, plan in enumerate(plans_b)
                               if i == 1 or plan.numel == 0 or plan.route != "tile"]


def test_groups_signature_tracks_gradient_dtype_and_alignment() -> None:
    dev = _device()
    cb = make_codebook(2).to(dev)
    items = _tensors(dev, seed=5)[:2]
    plans = _plans(items, cb, maximize=False, stochastic_round=False)
    grads = [it["grad"] for it in items]
    groups = StepGroups(plans, grads)
    assert groups.matches(plans, [g.clone() for g in grads])
    assert not groups.matches(plans, [grads[0].float(), grads[1]])
    buf = torch.empty(grads[0].numel() + 1, dtype=grads[0].dtype, device=dev)
    shifted = buf[1:].view_as(grads[0])  # 2-byte offset: no longer 16-byte aligned
    shifted.copy_(grads[0])
    assert not groups.matches(plans, [shifted, grads[1]])
    assert not groups.matches(plans[::-1], grads[::-1])
    # A planned tensor whose storage moved keeps its identity (and its plan) but not its
    # address: the tables must be rebuilt.
    items[1]["param"].data = items[1]["param"].data.clone()
    assert not groups.matches(plans, grads)


def test_launch_refuses_a_grouped_gradient_that_lost_its_alignment() -> None:
    dev = _device()
    cb = make_codebook(2).to(dev)
    items = [_tensors(dev, seed=4)[j] for j in (1, 5)]  # two members of one fp32 class
    plans = _plans(items, cb, maximize=False, stochastic_round=False)
    grads = [it["grad"] for it in items]
    groups = StepGroups(plans, grads)
    assert groups._singles == [] and len(groups._classes) == 1
    before = [it["param"].clone() for it in items]
    buf = torch.empty(grads[1].numel() + 1, dtype=grads[1].dtype, device=dev)
    shifted = buf[1:].view_as(grads[1])
    shifted.copy_(grads[1])
    assert not groups.matches(plans, [grads[0], shifted])
    with pytest.raises(ValueError, match="no longer 16-byte aligned"):
        groups.launch([grads[0], shifted], [_scalars(0, True), _scalars(1, True)], None)
    for it, p in zip(items, before):
        assert torch.equal(it["param"], p)  # refused before anything was launched


def test_device_buffer_equals_the_staged_buffer() -> None:
    """A capturable step's buffer, assembled from device scalars and seeds, is the buffer
    stage() copies from the host; the device offsets are kept per distinct offsets (a graph
    reads the copy it was captured with), the first OFFSET_TABLES of them."""
    from gefen_kernels.ops import step_groups as sg

    dev = _device()
    cb = make_codebook(2).to(dev)
    items = _tensors(dev, seed=3)
    plans = _plans(items, cb, maximize=False, stochastic_round=True)
    grads = [it["grad"] for it in items]
    groups = StepGroups(plans, grads)
    assert groups.factored.tolist() == [c[4] for c in CASES]
    scalars = [_scalars(j, c[4]) for j, c in enumerate(CASES)]
    seeds = [31 * j - 7 for j in range(len(CASES))]
    hyper = torch.tensor([[lr, bc2, bc1, decay] for lr, bc2, bc1, decay in scalars],
                         dtype=torch.float32, device=dev)
    offsets = groups.device_offsets(grads)
    assert offsets is not None and groups.device_offsets(grads) is offsets
    staged = groups.stage(grads, scalars, seeds)
    assembled = groups.device_buffer(hyper, offsets, torch.tensor(seeds, device=dev))
    assert torch.equal(assembled, staged)
    kept = []  # alive, so every copy of the gradients has its own addresses
    for _ in range(sg.OFFSET_TABLES + 2):
        kept.append([g.clone() for g in grads])
        assert groups.device_offsets(kept[-1]) is not None
    assert len(groups._offset_tables) == sg.OFFSET_TABLES
    assert groups.device_offsets(grads) is offsets  # the first copy is never evicted


def test_transient_tables_build_offset_tables_without_keeping_them() -> None:
    """Inside transient_tables() (a compiled caller whose memory pool refuses tensors that
    outlive the call) a new gradient-offset table serves the call and is not kept; the kept
    ones are still used, and the scope nests."""
    from gefen_kernels.ops import transient_tables
    from gefen_kernels.ops._device import keeps_tables

    dev = _device()
    cb = make_codebook(2).to(dev)
    items = _tensors(dev, seed=5)
    grads = [it["grad"] for it in items]
    groups = StepGroups(_plans(items, cb, maximize=False, stochastic_round=False), grads)
    kept = groups.device_offsets(grads)
    other = [g.clone() for g in grads]
    with transient_tables():
        with transient_tables():
            assert not keeps_tables()
        assert not keeps_tables()
        assert groups.device_offsets(grads) is kept
        fresh = groups.device_offsets(other)
        assert fresh is not None and fresh is not kept
        assert groups.device_offsets(other) is not fresh
    assert keeps_tables()
    assert list(groups._offset_tables.values()) == [kept]
    outside = groups.device_offsets(other)
    assert torch.equal(outside, fresh) and groups.device_offsets(other) is outside


def test_groups_hold_no_tensor() -> None:
    """The tables keep offsets and plans (weak references), never a tensor: the optimizer
    state a group was built for is freed with it, also when the group is cached under a weak
    key such as its first codes tensor."""
    import gc
    import weakref

    from torch.utils.weak import WeakIdKeyDictionary

    dev = _device()
    cb = make_codebook(2).to(dev)
    items = _tensors(dev, seed=6)[:3]
    plans = _plans(items, cb, maximize=False, stochastic_round=False)
    grads = [it["grad"] for it in items]
    cache = WeakIdKeyDictionary()
    cache[items[0]["codes"]] = StepGroups(plans, grads)
    alive = [weakref.ref(it[k]) for it in items for k in ("param", "codes", "scale")]
    del items, grads
    gc.collect()
    assert all(ref() is None for ref in alive)
    assert len(cache) == 0


def test_unaligned_gradients_launch_alone_with_the_same_bits() -> None:
    """A gradient that is not 16-byte aligned takes its plan's own launch (a one-tensor launch
    would compile without the alignment hint, so its sums may be ordered differently): the
    result equals per-plan launches with the same gradients."""
    dev = _device()
    cb = make_codebook(4).to(dev)
    base = _tensors(dev, seed=8)[1:3]  # two aligned factored cases of one class
    scalars = [_scalars(j, True) for j in range(2)]
    grads = []
    for it in base:
        buf = torch.empty(it["grad"].numel() + 2, dtype=it["grad"].dtype, device=dev)
        g = buf[2:].view_as(it["grad"])
        g.copy_(it["grad"])
        grads.append(g)
    a, b = _clone(base), _clone(base)
    for plan, g, (lr, bc2, bc1, decay) in zip(_plans(a, cb, maximize=False,
                                                     stochastic_round=False), grads, scalars):
        plan.launch(g, lr=lr, bc1_recip=bc1, bc2=bc2, decay=decay, seed=0)
    plans = _plans(b, cb, maximize=False, stochastic_round=False)
    groups = StepGroups(plans, grads)
    assert groups._classes == [] and groups._singles == [0, 1]
    groups.launch(grads, scalars, None)
    _compare(b, a)


def test_groups_refuse_plans_of_different_options() -> None:
    dev = _device()
    cb = make_codebook(2).to(dev)
    items = _tensors(dev, seed=1)[:2]
    plans = (_plans(items[:1], cb, maximize=False, stochastic_round=False)
             + _plans(items[1:], cb, maximize=True, stochastic_round=False))
    with pytest.raises(ValueError, match=r"plans\[1\] differs from plans\[0\]"):
        StepGroups(plans, [it["grad"] for it in items])
    with pytest.raises(ValueError, match="one gradient per plan"):
        StepGroups(plans[:1], [])


@pytest.mark.gpu
@pytest.mark.parametrize("scratch_bytes", [step_groups.GROUP_SCRATCH_BYTES, 1 << 20])
def test_gpt2_shaped_list_equals_one_launch_per_plan_gpu(scratch_bytes, monkeypatch) -> None:
    """GPT-2 small's 148 tensors (matrices factored, vectors in block mode) plus a
    [16384, 2048] matrix, and two factored matrices whose one block per row takes the loop
    route ([2048, 8192]) and the split route ([4, 65536]: grouped statistics, the update
    alone), bf16, both rounding modes, in one chunk per class and in 1 MiB chunks: grouped
    launches against one launch per plan, bit for bit."""
    monkeypatch.setattr(step_groups, "GROUP_SCRATCH_BYTES", scratch_bytes)
    shapes: list[tuple[int, ...]] = [(50257, 768), (1024, 768), (16384, 2048), (2048, 8192),
                                     (4, 65536)]
    for _ in range(12):
        shapes += [(768,), (768,), (768, 2304), (2304,), (768, 768), (768,), (768,), (768,),
                   (768, 3072), (3072,), (3072, 768), (768,)]
    shapes += [(768,), (768,)]
    cb = make_codebook(4).cuda()
    for stochastic in (False, True):
        base = []
        for j, shape in enumerate(shapes):
            gen = torch.Generator(device="cuda").manual_seed(j)
            # 1152, GPT-2's most common searched period, takes a head and a tail piece.
            period = (1152 if shape in ((768, 2304), (768, 3072), (3072, 768)) else
                      shape[-1] if len(shape) == 2 else min(shape[0], 768))
            n = shape[0] * (shape[1] if len(shape) == 2 else 1)
            st = random_state(n // period, period, seed=j, device="cuda")
            item: dict[str, Any] = {
                "param": torch.randn(shape, generator=gen, device="cuda").to(torch.bfloat16),
                "grad": torch.randn(shape, generator=gen, device="cuda").to(torch.bfloat16),
                "codes": st["codes"], "scale": st["scale"]}
            if len(shape) == 2:
                item.update(sq=None, row=torch.rand(shape[0], generator=gen, device="cuda"),
                            col=torch.rand(shape[1], generator=gen, device="cuda"))
            else:
                item.update(sq=st["exp_avg_sq"], row=None, col=None)
            base.append(item)
        scalars = [_scalars(j % 7, len(s) == 2) for j, s in enumerate(shapes)]
        seeds = [1000 + j for j in range(len(shapes))]
        a, b = _clone(base), _clone(base)
        options = {"maximize": False, "stochastic_round": stochastic}
        plans = _plans(b, cb, **options)
        assert [p.route for p in plans[3:5]] == ["loop", "split"]
        grads = [it["grad"] for it in b]
        groups = StepGroups(plans, grads)
        # The small block-mode classes run on the side stream, the matrices' on the current.
        assert groups._side_stream is not None
        assert any(c.side for c in groups._classes) and not all(c.side for c in groups._classes)
        for _ in range(2):
            for plan, it, (lr, bc2, bc1, decay), seed in zip(_plans(a, cb, **options), a,
                                                             scalars, seeds):
                plan.launch(it["grad"], lr=lr, bc1_recip=bc1, bc2=bc2, decay=decay, seed=seed)
            groups.launch(grads, scalars, seeds)
        torch.cuda.synchronize()
        _compare(b, a)


def test_small_classes_follow_the_side_limits(monkeypatch) -> None:
    """``_Launches.small``: a tile launch of at most SIDE_PROGRAMS programs and (factored) at
    most SIDE_SCRATCH_BYTES of scratch per chunk; a statistics-only class never. Off CUDA no
    class runs on a side stream."""
    dev = _device()
    cb = make_codebook(2).to(dev)
    items = _tensors(dev, seed=5)
    plans = _plans(items, cb, maximize=False, stochastic_round=False)
    grads = [it["grad"] for it in items]
    groups = StepGroups(plans, grads)
    classes = groups._classes
    assert any(c.factored for c in classes) and any(not c.factored for c in classes)
    assert any(c.stats_only for c in classes)
    monkeypatch.setattr(step_groups, "SIDE_PROGRAMS", 10**9)
    monkeypatch.setattr(step_groups, "SIDE_SCRATCH_BYTES", 1 << 40)
    assert [c.small() for c in classes] == [not c.stats_only for c in classes]
    monkeypatch.setattr(step_groups, "SIDE_SCRATCH_BYTES", 0)
    assert [c.small() for c in classes] == [not c.factored for c in classes]
    monkeypatch.setattr(step_groups, "SIDE_SCRATCH_BYTES", 1 << 40)
    monkeypatch.setattr(step_groups, "SIDE_PROGRAMS", 0)
    assert not any(c.small() for c in classes)
    # At the largest block-mode class's program count every block class is small; one fewer
    # and that class is not.
    largest = max(sum(ch["n_tile"] for ch in c.chunks) for c in classes if not c.factored)
    monkeypatch.setattr(step_groups, "SIDE_PROGRAMS", largest)
    assert all(c.small() for c in classes if not c.factored)
    monkeypatch.setattr(step_groups, "SIDE_PROGRAMS", largest - 1)
    assert not all(c.small() for c in classes if not c.factored)
    if dev == "cpu":
        assert groups._side_stream is None and groups._forks == []
        assert not any(c.side for c in classes)


def _side_stream_case(seed: int) -> tuple[list[dict[str, Any]], list[tuple[float, ...]], list[int]]:
    """Two factored matrices of two classes (2048 tile programs each: the current stream and
    the chain stream) and small block-mode vectors of several classes (the side stream),
    bf16."""
    shapes: list[tuple[tuple[int, ...], int]] = [((2048, 2048), 2048), ((4096, 1024), 1024),
                                                 ((768,), 16), ((768,), 48), ((2304,), 36),
                                                 ((3072,), 1536)]
    items = []
    for j, (shape, period) in enumerate(shapes):
        gen = torch.Generator(device="cuda").manual_seed(seed + j)
        n = shape[0] * (shape[1] if len(shape) == 2 else 1)
        st = random_state(n // period, period, seed=seed + j, device="cuda")
        item: dict[str, Any] = {
            "param": torch.randn(shape, generator=gen, device="cuda").to(torch.bfloat16),
            "grad": torch.randn(shape, generator=gen, device="cuda").to(torch.bfloat16),
            "codes": st["codes"], "scale": st["scale"]}
        if len(shape) == 2:
            item.update(sq=None, row=torch.rand(shape[0], generator=gen, device="cuda"),
                        col=torch.rand(shape[1], generator=gen, device="cuda"))
        else:
            item.update(sq=st["exp_avg_sq"], row=None, col=None)
        items.append(item)
    scalars = [_scalars(j, len(s) == 2) for j, (s, _) in enumerate(shapes)]
    return items, scalars, [77 + j for j in range(len(shapes))]


@pytest.mark.gpu
@pytest.mark.parametrize("slow", [0, 1])
def test_side_stream_is_ordered_with_the_current_stream_gpu(slow, monkeypatch) -> None:
    """The side stream (small classes) and the chain stream (every second large chunk) run
    after the work the current stream queued before the step, and the current stream's later
    work waits for them. The kernels are compiled first (a warm-up step), so the timing below
    is the device's, not the compiler's.

    Start: the buffer is staged and synchronised, then the current stream sleeps and only
    then writes the gradients (zeros until then), and the step is launched at once; a side or
    chain stream that does not wait reads zeros. End: one other stream's launches (the side
    stream's for ``slow`` 0, the chain stream's for 1) are delayed by a device sleep, so that
    stream finishes last, and the current stream overwrites the gradients with NaN right after
    the step; a current stream that does not wait for that stream lets it read NaN."""
    items, scalars, seeds = _side_stream_case(seed=11)
    cb = make_codebook(5).cuda()
    options = {"maximize": False, "stochastic_round": True}
    a = _clone(items)
    for plan, it, (lr, bc2, bc1, decay), seed in zip(_plans(a, cb, **options), a, scalars,
                                                     seeds):
        plan.launch(it["grad"], lr=lr, bc1_recip=bc1, bc2=bc2, decay=decay, seed=seed)
    warm = _clone(items)
    warm_grads = [it["grad"] for it in warm]
    StepGroups(_plans(warm, cb, **options), warm_grads).launch(warm_grads, scalars, seeds)
    torch.cuda.synchronize()
    current = torch.cuda.current_stream()

    def fresh() -> tuple[list[dict[str, Any]], list[torch.Tensor], StepGroups]:
        b = _clone(items)
        grads = [it["grad"] for it in b]
        groups = StepGroups(_plans(b, cb, **options), grads)
        assert groups._side_stream is not None and len(groups._forks) == 2
        assert [c.side for c in groups._classes] == [not c.factored for c in groups._classes]
        assert all(stream != current for stream, _ in groups._forks)
        return b, grads, groups

    # The start.
    b, grads, groups = fresh()
    true_grads = [g.clone() for g in grads]
    for g in grads:
        g.zero_()
    buffer = groups.stage(grads, scalars, seeds)
    torch.cuda.synchronize()
    torch.cuda._sleep(20_000_000)  # about 10 ms on the current stream
    for g, true in zip(grads, true_grads):
        g.copy_(true)
    groups.launch_staged(grads, buffer, scalars, seeds)
    torch.cuda.synchronize()
    _compare(b, a)

    # The end.
    b, grads, groups = fresh()
    launch_chunks = StepGroups._launch_chunks
    delays: Counter = Counter()

    def delayed(self: StepGroups, pairs: Any, *args: Any) -> None:
        stream = torch.cuda.current_stream()
        if stream != current:
            if stream == self._forks[slow][0]:
                torch.cuda._sleep(20_000_000)
            delays["side" if stream == self._side_stream else "chain"] += len(pairs)
        launch_chunks(self, pairs, *args)

    monkeypatch.setattr(StepGroups, "_launch_chunks", delayed)
    groups.launch(grads, scalars, seeds)
    for g in grads:
        g.fill_(float("nan"))
    torch.cuda.synchronize()
    _compare(b, a)
    assert delays == {"side": 4, "chain": 1}


@pytest.mark.gpu
@pytest.mark.parametrize("slow", [0, 1])
def test_side_stream_is_joined_when_a_launch_raises_gpu(slow, monkeypatch) -> None:
    """A launch that raises after the other streams were forked still leaves the current
    stream waiting for them (the step's buffer and gradients stay in use until they finish):
    the streams' work is done once the current stream's is. One stream sleeps (the side
    stream for ``slow`` 0, the chain stream for 1), so each stream's join is checked alone."""
    items, scalars, seeds = _side_stream_case(seed=17)
    cb = make_codebook(5).cuda()
    b = _clone(items)
    grads = [it["grad"] for it in b]
    groups = StepGroups(_plans(b, cb, maximize=False, stochastic_round=False), grads)
    groups.launch(grads, scalars, None)  # compiled
    torch.cuda.synchronize()
    launch_chunks = StepGroups._launch_chunks
    current = torch.cuda.current_stream()

    def failing(self: StepGroups, pairs: Any, *args: Any) -> None:
        stream = torch.cuda.current_stream()
        if stream != current:
            if stream == self._forks[slow][0]:
                torch.cuda._sleep(20_000_000)
            launch_chunks(self, pairs, *args)
        else:
            raise RuntimeError("planted failure")

    monkeypatch.setattr(StepGroups, "_launch_chunks", failing)
    with pytest.raises(RuntimeError, match="planted"):
        groups.launch(grads, scalars, None)
    done = torch.cuda.Event()
    done.record(current)
    done.synchronize()
    assert all(stream.query() for stream, _ in groups._forks)


@pytest.mark.gpu
def test_side_stream_launches_replay_from_a_cuda_graph_gpu() -> None:
    """launch_staged with side-stream classes, captured in a CUDA graph and replayed over two
    steps with new staged scalars and seeds, gives the bits of eager launch()."""
    items, scalars, seeds = _side_stream_case(seed=23)
    a, b = _clone(items), _clone(items)
    cb = make_codebook(6).cuda()
    options = {"maximize": False, "stochastic_round": True}
    plans_a, plans_b = _plans(a, cb, **options), _plans(b, cb, **options)
    grads_a, grads_b = [it["grad"] for it in a], [it["grad"] for it in b]
    groups_a, groups_b = StepGroups(plans_a, grads_a), StepGroups(plans_b, grads_b)
    assert groups_b._side_stream is not None and any(c.side for c in groups_b._classes)
    assert len(groups_b._forks) == 2
    buffer = torch.empty(4 * len(items), dtype=torch.int64, device="cuda")
    # Warm-up on a side stream (compilation and the search table), as graph capture asks.
    warm = _clone(items)
    groups_w = StepGroups(_plans(warm, cb, **options), [it["grad"] for it in warm])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        groups_w.stage([it["grad"] for it in warm], scalars, seeds, out=buffer)
        groups_w.launch_staged([it["grad"] for it in warm], buffer, None, None,
                               device_scalars=True)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        groups_b.launch_staged(grads_b, buffer, None, None, device_scalars=True)
    for step in range(2):
        step_scalars = [_scalars(j + 3 * step, len(it["param"].shape) == 2)
                        for j, it in enumerate(items)]
        step_seeds = [s + step for s in seeds]
        groups_a.launch(grads_a, step_scalars, step_seeds)
        groups_b.stage(grads_b, step_scalars, step_seeds, out=buffer)
        graph.replay()
    torch.cuda.synchronize()
    _compare(b, a)


def test_deal_puts_every_chunk_on_one_stream(monkeypatch) -> None:
    """``_deal`` with stand-in streams: small classes on the side stream where something runs
    beside them, every other chunk dealt round-robin over CHAIN_STREAMS streams in order,
    each chunk exactly once; off CUDA (no streams) everything on the current stream."""
    dev = _device()
    cb = make_codebook(2).to(dev)
    items = _tensors(dev, seed=7)
    plans = _plans(items, cb, maximize=False, stochastic_round=False)
    grads = [it["grad"] for it in items]
    monkeypatch.setattr(step_groups, "GROUP_SCRATCH_BYTES", 0)  # several chunks per class
    classes = StepGroups(plans, grads)._classes
    every = [(cls, chunk) for cls in classes for chunk in cls.chunks]
    # The classes with the fewest tile programs are the small ones.
    monkeypatch.setattr(step_groups, "SIDE_PROGRAMS", min(
        sum(ch["n_tile"] for ch in c.chunks) for c in classes if not c.stats_only))

    def fake(chains: int) -> list[str]:
        return ["side"] + [f"chain{k}" for k in range(1, chains + 1)]

    def ids(pairs: list[Any]) -> list[int]:
        return [id(chunk) for _, chunk in pairs]

    for ways in (1, 2, 3):
        monkeypatch.setattr(step_groups, "CHAIN_STREAMS", ways)
        side, forks, current = step_groups._deal(classes, False, fake)
        small = [(c, ch) for c, ch in every if c.small()]
        large = [(c, ch) for c, ch in every if not c.small()]
        assert small and len(large) >= 3 and side == "side"
        assert forks[0] == ("side", small) and all(c.side for c, _ in small)
        assert [name for name, _ in forks[1:]] == [f"chain{k}" for k in range(1, ways)]
        for k, (_, pairs) in enumerate(forks[1:], start=1):
            assert ids(pairs) == ids(large[k::ways])
        assert ids(current) == ids(large[0::ways])
        assert sorted(ids(current) + [i for _, p in forks for i in ids(p)]) == sorted(ids(every))
    # Only small classes, beside a non-empty lone plan: all on the side stream, the current
    # stream gets none; without the lone plan, no class is on the side stream (the chunks
    # are dealt over the chain streams like any others).
    only_small = [c for c in classes if not c.stats_only]
    monkeypatch.setattr(step_groups, "SIDE_PROGRAMS", 10**9)
    monkeypatch.setattr(step_groups, "SIDE_SCRATCH_BYTES", 1 << 40)
    side, forks, current = step_groups._deal(only_small, True, fake)
    assert side == "side" and current == [] and len(forks) == 1
    assert ids(forks[0][1]) == ids([(c, ch) for c in only_small for ch in c.chunks])
    side, forks, current = step_groups._deal(only_small, False, fake)
    assert side is None and not any(c.side for c in only_small)
    dealt = [(c, ch) for c in only_small for ch in c.chunks]  # CHAIN_STREAMS is 3 here
    assert ids(current) == ids(dealt[0::3])
    assert [(name, ids(p)) for name, p in forks] == [("chain1", ids(dealt[1::3])),
                                                    ("chain2", ids(dealt[2::3]))]
    # Off CUDA.
    side, forks, current = step_groups._deal(classes, True, None)
    assert side is None and forks == [] and ids(current) == ids(every)
    assert not any(c.side for c in classes)
