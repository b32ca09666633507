"""Write small real checkpoints with the published ``gefen`` 1.2.3 and ``gefen-x`` 0.5.0.

The fixtures let ``gefen-core`` prove that it imports what users of those releases have
on disk (docs/algorithm.md#legacy-import; docs/migration.md). Both releases install the import
name ``gefen``, so each runs in its own virtual environment, and this script is run by
that environment's Python:

    python3 -m venv /work/legacy-venv-gefen
    /work/legacy-venv-gefen/bin/pip install torch==2.13.0 numpy numba gefen==1.2.3
    /work/legacy-venv-gefen/bin/python packages/gefen-core/tests/make_legacy_fixtures.py

    python3 -m venv /work/legacy-venv-gefenx
    /work/legacy-venv-gefenx/bin/pip install torch==2.13.0 numpy numba gefen-x==0.5.0
    /work/legacy-venv-gefenx/bin/python packages/gefen-core/tests/make_legacy_fixtures.py

(`torch==2.13.0` is pinned: an unpinned torch pulls a multi-GB CUDA build.)

For each published package it trains a tiny deterministic parameter set on CPU with
``fused=False`` using a fixed, saved sequence of gradients (no model forward is needed on
replay): ``SAVE_STEP`` steps, then ``torch.save(opt.state_dict())`` plus the parameters,
then ``CONTINUE_STEPS`` more steps in the original package, whose parameters and state are
saved as the continuation reference. One directory per case under
``packages/gefen-core/tests/fixtures/legacy/`` holds:

    state_step{k}.pt        the optimizer state_dict exactly as the package wrote it
    params_step{k}.pt       {name: fp32 tensor} at the save point
    grads.pt                {"names": [...], "steps": [{name: fp32 tensor}, ...]}, one dict
                            per step 1..k+m; a name missing from a step's dict means
                            ``p.grad is None`` on that step
    params_step{k+m}.pt     parameters after the m continuation steps (the reference)
    state_step{k+m}.pt      the package's state_dict after the continuation
    manifest.json           package, version, torch, hyperparameters, periods, commands

gefen-x 0.5.0 also runs with FSDP2 DTensor parameters on CPU/gloo (loopback only): on one
process (its rank-local checkpoint of world size 1 imports, and is continued like the
others), and on two spawned processes (``gefen-x-0.5.0-fsdp2-world2``: the two-rank
checkpoint gefen-core refuses, plus the migration route its error names, GefenDCPState
saved on two ranks, loaded on one, ``state_dict()``: ``state_world1_from_dcp.pt``).

Every file is far below 200 KB (a few thousand elements in all). Rerunning the script
rewrites the ``.pt`` files byte for byte.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import platform
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

DEFAULT_OUT = Path(__file__).resolve().parent / "fixtures" / "legacy"

SEED = 20261129
SAVE_STEP = 3  # k: steps before the checkpoint
CONTINUE_STEPS = 4  # m: steps replayed after it

# (name, shape). Order is the optimizer's parameter order, i.e. the saved integer ids.
PARAM_SHAPES: list[tuple[str, tuple[int, ...]]] = [
    ("fc1.weight", (16, 32)),  # 2-D: factored second moment where the package has one
    ("fc1.bias", (16,)),  # 1-D
    ("conv.weight", (4, 2, 3, 3)),  # 4-D conv kernel: always the per-block second moment
    ("head.weight", (8, 16)),  # second 2-D weight
    ("gain", (1,)),  # numel 1 (P = 1); no gradient on steps 2, 5, 8, ...
    ("temperature", (1,)),  # no gradient before the checkpoint: never stepped when saved
]

# (case directory, pip distribution, version, Gefen keyword arguments beyond the common ones)
CASES = {
    "gefen": [
        ("gefen-1.2.3", "gefen", "1.2.3", {"weight_decay": 0.02}),
    ],
    "gefen-x": [
        (
            "gefen-x-0.5.0-factored",
            "gefen-x",
            "0.5.0",
            {"weight_decay": 0.01, "factored_v_2d": True},
        ),
        ("gefen-x-0.5.0-block", "gefen-x", "0.5.0", {"weight_decay": 0.0, "factored_v_2d": False}),
        # FSDP2 (DTensor parameters) on a one-process gloo mesh: state_dict() writes the
        # rank-local payload of docs/algorithm.md#legacy-import with world_size 1.
        (
            "gefen-x-0.5.0-fsdp2-world1",
            "gefen-x",
            "0.5.0",
            {"weight_decay": 0.01, "factored_v_2d": True, "fsdp2_world1": True},
        ),
        # The same on two gloo processes: a rank-local payload gefen-core must refuse, and
        # the migration route it names (GefenDCPState save on 2 ranks, load on 1, state_dict).
        (
            "gefen-x-0.5.0-fsdp2-world2",
            "gefen-x",
            "0.5.0",
            {"weight_decay": 0.01, "factored_v_2d": False, "fsdp2_world2": True},
        ),
    ],
}
COMMON_HYPER = {"lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8, "fused": False}


def has_grad(name: str, step: int) -> bool:
    """Whether ``name`` receives a gradient on optimizer step ``step`` (1-based)."""
    if name == "gain":
        return step % 3 != 2
    if name == "temperature":
        return step > SAVE_STEP
    return True


def make_initial_params(gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        name: (0.1 * torch.randn(shape, generator=gen, dtype=torch.float32))
        for name, shape in PARAM_SHAPES
    }


def make_gradients(gen: torch.Generator, total_steps: int) -> list[dict[str, torch.Tensor]]:
    """Gradients with the structure real layers have: per-row / per-kernel scales.

    Rows of the matrices and the 3x3 kernels of the conv get fixed log-uniform scales
    (a factor of e^4 apart at most), so the period search of either package finds
    structure rather than i.i.d. noise.
    """
    row_scale = {
        "fc1.weight": torch.exp(torch.empty(16, 1).uniform_(-2.0, 2.0, generator=gen)),
        "head.weight": torch.exp(torch.empty(8, 1).uniform_(-2.0, 2.0, generator=gen)),
    }
    kernel_scale = torch.exp(torch.empty(4, 2, 1, 1).uniform_(-2.0, 2.0, generator=gen))
    steps = []
    for step in range(1, total_steps + 1):
        grads: dict[str, torch.Tensor] = {}
        for name, shape in PARAM_SHAPES:
            noise = torch.randn(shape, generator=gen, dtype=torch.float32)
            if not has_grad(name, step):
                continue
            if name in row_scale:
                grads[name] = (row_scale[name] * noise).contiguous()
            elif name == "conv.weight":
                grads[name] = (kernel_scale * noise).contiguous()
            else:
                grads[name] = (0.5 * noise).contiguous()
        steps.append(grads)
    return steps


def run_steps(opt, params, grad_steps) -> None:
    for grads in grad_steps:
        for name, p in params.items():
            p.grad = as_grad(p, grads[name]) if name in grads else None
        opt.step()
    for p in params.values():
        p.grad = None


def describe_state(sd: dict) -> dict:
    """A JSON-able summary of a state_dict: key -> type/dtype/shape."""

    def leaf(v):
        if torch.is_tensor(v):
            return {"tensor": str(v.dtype).replace("torch.", ""), "shape": list(v.shape)}
        if isinstance(v, dict):
            return {str(k): leaf(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [leaf(x) for x in v] if len(v) <= 8 else f"{type(v).__name__}[{len(v)}]"
        return f"{type(v).__name__}: {v!r}"

    return leaf(sd)


@contextlib.contextmanager
def one_process_group():
    """A gloo process group of world size 1 on loopback (FSDP2 on CPU)."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method="tcp://127.0.0.1:29533",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def fsdp2_params(init: dict[str, torch.Tensor]) -> dict[str, torch.nn.Parameter]:
    """The parameters as FSDP2 DTensors (``Shard(0)`` on a CPU mesh of the whole world)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    module = torch.nn.Module()
    for name, t in init.items():
        module.register_parameter(name.replace(".", "_"), torch.nn.Parameter(t.clone()))
    import torch.distributed as dist

    fully_shard(module, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    return {name: module.get_parameter(name.replace(".", "_")) for name in init}


def as_grad(p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    if hasattr(p, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(g.clone(), p.device_mesh, p.placements)
    return g.clone()


def plain(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()


def _world2_worker(rank: int, case_dir: str, dcp_dir: str) -> None:
    """One of two ranks: 3 steps, save the rank-local state_dict and a GefenDCPState."""
    import datetime

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    dist.init_process_group(
        "gloo",
        init_method="tcp://127.0.0.1:29534",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        from gefen import Gefen, GefenDCPState

        params, grad_steps, kwargs = _world2_setup()
        opt = Gefen(list(params.items()), **kwargs)
        run_steps(opt, params, grad_steps[:SAVE_STEP])
        sd = opt.state_dict()  # collective; identical on every rank
        full = {n: plain(p) for n, p in params.items()}  # collective
        if rank == 0:
            torch.save(sd, Path(case_dir) / f"state_step{SAVE_STEP}.pt")
            torch.save(full, Path(case_dir) / f"params_step{SAVE_STEP}.pt")
        dcp.save({"optim": GefenDCPState(opt)}, checkpoint_id=dcp_dir)
    finally:
        dist.destroy_process_group()


WORLD2_KWARGS = {
    "lr": 1e-2,
    "betas": (0.9, 0.999),
    "eps": 1e-8,
    "weight_decay": 0.01,
    "fused": False,
    "factored_v_2d": False,
}


def _world2_setup():
    gen = torch.Generator().manual_seed(SEED)
    init = make_initial_params(gen)
    grad_steps = make_gradients(gen, SAVE_STEP + CONTINUE_STEPS)
    # gefen-x 0.5.0's GefenDCPState refuses to reshard a one-element parameter that had an
    # empty shard on one of the two ranks ("slot ... is uninitialized but carries nonzero
    # momentum/second-moment history"), so this case keeps the multi-element tensors.
    init = {n: t for n, t in init.items() if t.numel() > 1}
    grad_steps = [{n: g for n, g in step.items() if n in init} for step in grad_steps]
    return fsdp2_params(init), grad_steps, dict(WORLD2_KWARGS)


def make_world2_case(case: str, dist: str, dist_version: str, out_dir: Path) -> dict:
    import tempfile

    import torch.distributed.checkpoint as dcp
    import torch.multiprocessing as mp

    case_dir = out_dir / case
    case_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as dcp_dir:
        mp.spawn(_world2_worker, args=(str(case_dir), dcp_dir), nprocs=2, join=True)
        # The migration route for multi-rank checkpoints: reshard 2 -> 1 with gefen-x
        # 0.5.x's own GefenDCPState, then save that one-rank optimizer's state_dict().
        with one_process_group():
            from gefen import Gefen, GefenDCPState

            params, _, kwargs = _world2_setup()
            opt = Gefen(list(params.items()), **kwargs)
            dcp.load({"optim": GefenDCPState(opt)}, checkpoint_id=dcp_dir)
            torch.save(opt.state_dict(), case_dir / "state_world1_from_dcp.pt")

    saved = torch.load(case_dir / f"state_step{SAVE_STEP}.pt", weights_only=True)
    payloads = {
        k: torch.load(io.BytesIO(v.numpy().tobytes()), weights_only=True)
        for k, v in saved["state"][0].items()
        if k.startswith("_gefen_rank_local_payload_")
    }
    return {
        "case": case,
        "package": dist,
        "package_version": dist_version,
        "import_name": "gefen",
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "seed": SEED,
        "save_step": SAVE_STEP,
        "world_size": 2,
        "hyperparameters": {
            k: (list(v) if isinstance(v, tuple) else v) for k, v in WORLD2_KWARGS.items()
        },
        "param_order": [n for n, t in PARAM_SHAPES if math.prod(t) > 1],
        "periods_at_save": {
            key: {s["name"]: s.get("automatic_period") for s in p["states"]}
            for key, p in payloads.items()
        },
        "state_dict_layout_at_save": describe_state(saved),
        "rank_local_payload_layouts": {k: describe_state(p) for k, p in payloads.items()},
        "weights_only_load_ok": True,
        "weights_only_load_error": None,
        "files": sorted(p.name for p in case_dir.iterdir() if p.name != "manifest.json"),
    }


def make_case(case: str, dist: str, dist_version: str, extra: dict, out_dir: Path) -> dict:
    if extra.get("fsdp2_world2"):
        return make_world2_case(case, dist, dist_version, out_dir)
    if extra.get("fsdp2_world1"):
        with one_process_group():
            return _make_case(case, dist, dist_version, extra, out_dir)
    return _make_case(case, dist, dist_version, extra, out_dir)


def _make_case(case: str, dist: str, dist_version: str, extra: dict, out_dir: Path) -> dict:
    from gefen import Gefen  # the published package installed in this venv

    gen = torch.Generator().manual_seed(SEED)
    init = make_initial_params(gen)
    total = SAVE_STEP + CONTINUE_STEPS
    grad_steps = make_gradients(gen, total)

    fsdp = bool(extra.get("fsdp2_world1"))
    if fsdp:
        params = fsdp2_params(init)
    else:
        params = {n: torch.nn.Parameter(t.clone()) for n, t in init.items()}
    hyper = dict(COMMON_HYPER)
    hyper.update(extra)
    kwargs = {k: v for k, v in hyper.items() if k != "fsdp2_world1"}
    kwargs["betas"] = tuple(kwargs["betas"])
    named = [(n, p) for n, p in params.items()]
    # Both packages print or warn on construction; keep the fixture log readable.
    with contextlib.redirect_stdout(io.StringIO()):
        opt = Gefen(named, **kwargs)

    case_dir = out_dir / case
    case_dir.mkdir(parents=True, exist_ok=True)

    run_steps(opt, params, grad_steps[:SAVE_STEP])
    saved_sd = opt.state_dict()
    torch.save(saved_sd, case_dir / f"state_step{SAVE_STEP}.pt")
    torch.save({n: plain(p) for n, p in params.items()}, case_dir / f"params_step{SAVE_STEP}.pt")
    torch.save({"names": [n for n, _ in PARAM_SHAPES], "steps": grad_steps}, case_dir / "grads.pt")

    run_steps(opt, params, grad_steps[SAVE_STEP:])
    torch.save({n: plain(p) for n, p in params.items()}, case_dir / f"params_step{total}.pt")
    torch.save(opt.state_dict(), case_dir / f"state_step{total}.pt")

    payload = None
    states = saved_sd["state"]
    if fsdp:
        # The rank-local form: the per-parameter states of rank 0 are inside a serialized
        # payload (a uint8 tensor holding torch.save bytes) in the first state entry.
        blob = saved_sd["state"][0]["_gefen_rank_local_payload_0"]
        payload = torch.load(io.BytesIO(blob.numpy().tobytes()), weights_only=True)
        states = dict(zip(saved_sd["state"], payload["states"]))
    periods = {}
    for i, (name, _) in enumerate(PARAM_SHAPES):
        st = states.get(i, {})
        if "automatic_period" in st:
            periods[name] = st["automatic_period"]

    # weights_only loadability of the raw file, recorded honestly.
    try:
        torch.load(case_dir / f"state_step{SAVE_STEP}.pt", weights_only=True)
        weights_only_ok = True
        weights_only_error = None
    except Exception as exc:  # noqa: BLE001 - the message is what we record
        weights_only_ok = False
        weights_only_error = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"

    return {
        "case": case,
        "package": dist,
        "package_version": dist_version,
        "import_name": "gefen",
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "seed": SEED,
        "save_step": SAVE_STEP,
        "continue_steps": CONTINUE_STEPS,
        "hyperparameters": hyper,
        # gefen_core.Gefen keyword arguments that reproduce the package's algorithm: gefen
        # 1.2.x has no factored second moment (every tensor uses the per-block vmean), and
        # gefen-x 0.5.x steps DTensor (FSDP2) parameters in block mode whatever the flag.
        "gefen_core_kwargs": {
            "lr": hyper["lr"],
            "betas": hyper["betas"],
            "eps": hyper["eps"],
            "weight_decay": hyper["weight_decay"],
            "factored_v_2d": bool(hyper.get("factored_v_2d", False)) and not fsdp,
            "fused": False,
        },
        "param_order": [n for n, _ in PARAM_SHAPES],
        "param_shapes": {n: list(s) for n, s in PARAM_SHAPES},
        "no_grad_steps": {
            n: [t for t in range(1, total + 1) if not has_grad(n, t)] for n, _ in PARAM_SHAPES
        },
        "periods_at_save": periods,
        "state_dict_layout_at_save": describe_state(saved_sd),
        "rank_local_payload_0_layout": None if payload is None else describe_state(payload),
        "weights_only_load_ok": weights_only_ok,
        "weights_only_load_error": weights_only_error,
        "files": sorted(p.name for p in case_dir.iterdir() if p.name != "manifest.json"),
    }


def installed(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="fixture root (default: %(default)s)"
    )
    args = parser.parse_args(argv)

    found = [d for d in CASES if installed(d) is not None]
    if len(found) != 1:
        parser.error(
            "run this script with the Python of a virtual environment that has exactly one "
            f"of the published packages {sorted(CASES)} installed (found: {found or 'none'})"
        )
    dist = found[0]
    torch.manual_seed(SEED)
    for case, want_dist, want_version, extra in CASES[dist]:
        have = installed(want_dist)
        if have != want_version:
            parser.error(f"{want_dist}=={want_version} is required, found {have}")
        manifest = make_case(case, want_dist, want_version, extra, args.out)
        manifest["command"] = (
            f"{Path(sys.executable)} packages/gefen-core/tests/make_legacy_fixtures.py"
            + ("" if args.out == DEFAULT_OUT else f" --out {args.out}")
        )
        manifest["venv_setup"] = [
            f"python3 -m venv {Path(sys.prefix)}",
            (
                f"{Path(sys.prefix)}/bin/pip install torch==2.13.0 numpy numba "
                f"{want_dist}=={want_version}"
            ),
        ]
        path = args.out / case / "manifest.json"
        path.write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
        sizes = {p.name: p.stat().st_size for p in sorted((args.out / case).iterdir())}
        print(
            f"{case}: periods {manifest['periods_at_save']}, "
            f"weights_only load ok: {manifest['weights_only_load_ok']}"
        )
        for name, size in sizes.items():
            print(f"  {name:24s} {size:8d} bytes")
        if not math.isfinite(sum(sizes.values())):
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
