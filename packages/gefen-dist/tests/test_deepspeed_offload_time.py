"""ZeRO-2 ``offload_optimizer`` on one GPU: the CPU optimizer step of Gefen against DeepSpeed's
own CPU Adam (``DeepSpeedCPUAdam``), same model, same data, same process.

Under offload the optimizer steps the fp32 master partition on the host, so this is the cost a
user pays for choosing Gefen there. The test checks that both optimizers train and that the
timing covers every step; it prints the medians and their ratio and, when
``GEFEN_OFFLOAD_TIME_JSON`` names a file, writes them there (docs/results/). Speed is
reported, not asserted: the ratio depends on the host's cores and vector units.
"""

from __future__ import annotations

import datetime
import gc
import json
import math
import os
import platform
import statistics
import sys
import time

import pytest
import torch
from _dist_models import batches, lm_loss, make_model

from gefen_core import Gefen
from gefen_dist.deepspeed import initialize, zero_config_keys
from gefen_dist.testing import run_distributed
from gefen_kernels import cpu_step_status

EXT_DIR = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(sys.prefix, "torch_extensions")
# About 110M parameters: one flat fp32 partition of that size reaches the host optimizer.
MODEL_KW = dict(dim=1024, layers=8, heads=16, seq=256, extra_rows=3)
BATCH, STEPS, WARMUP = 8, 10, 2
LR = 1e-3
OPTIMIZERS = ("gefen", "deepspeed-cpu-adam")


def _config() -> dict:
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        "bf16": {"enabled": True},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        **zero_config_keys(offload=True),
    }


def _run(name: str, data: list) -> dict:
    import deepspeed
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    model = make_model(seed=0, **MODEL_KW)
    n_params = sum(p.numel() for p in model.parameters())
    if name == "gefen":
        opt = Gefen(model.parameters(), lr=LR, weight_decay=0.01)
        engine, *_ = initialize(model=model, optimizer=opt, config=_config())
    else:
        opt = DeepSpeedCPUAdam(model.parameters(), lr=LR, weight_decay=0.01, adamw_mode=True)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=_config())
    assert engine.basic_optimizer is opt
    opt_ms: list[float] = []
    engine_ms: list[float] = []
    losses: list[float] = []
    started: list[float] = []
    hooks = (opt.register_step_pre_hook(lambda *_: started.append(time.perf_counter())),
             opt.register_step_post_hook(
                 lambda *_: opt_ms.append(1e3 * (time.perf_counter() - started[-1]))))
    for x, y in data:
        loss = lm_loss(engine, x.to(engine.device), y.to(engine.device))
        engine.backward(loss)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        engine_ms.append(1e3 * (time.perf_counter() - t0))
        losses.append(loss.item())
    for h in hooks:
        h.remove()
    devices = sorted({str(p.device) for g in opt.param_groups for p in g["params"]})
    del engine, opt, model
    gc.collect()
    torch.cuda.empty_cache()
    return {"params": n_params, "losses": losses, "optimizer_devices": devices,
            "optimizer_step_ms": opt_ms, "engine_step_ms": engine_ms,
            "optimizer_step_ms_median": statistics.median(opt_ms[WARMUP:]),
            "engine_step_ms_median": statistics.median(engine_ms[WARMUP:])}


def _direct_step_ms(numel: int) -> float:
    """Median ``Gefen.step()`` of one flat fp32 CPU tensor of ``numel`` elements outside
    DeepSpeed, in the same process: tells the optimizer's own cost from the engine's."""
    p = torch.nn.Parameter(torch.zeros(numel))
    opt = Gefen([p], lr=LR, weight_decay=0.01)
    gen = torch.Generator().manual_seed(0)
    times = []
    for _ in range(STEPS):
        p.grad = torch.randn(numel, generator=gen)
        t0 = time.perf_counter()
        opt.step()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times[WARMUP:])


def _timing_worker(rank: int, world: int) -> dict:
    data = batches(STEPS, batch=BATCH, seq=MODEL_KW["seq"], seed=11)
    out = {name: _run(name, data) for name in OPTIMIZERS}
    out["gefen_direct_step_ms"] = _direct_step_ms(out["gefen"]["params"])
    out["cpu_step_status"] = cpu_step_status()
    out["torch_threads"] = torch.get_num_threads()
    return out


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_zero2_offload_step_time_against_deepspeed_cpu_adam():
    env = {"TORCH_EXTENSIONS_DIR": EXT_DIR, "LOCAL_RANK": "0"}
    # A cold cache JIT-builds DeepSpeed's CPU Adam (about a minute).
    (res,) = run_distributed(_timing_worker, 1, backend="nccl", timeout=560,
                             collective_timeout=400, env=env)
    for name in OPTIMIZERS:
        r = res[name]
        assert r["optimizer_devices"] == ["cpu"], f"{name}: the optimizer did not step on the host"
        assert len(r["optimizer_step_ms"]) == STEPS, f"{name}: not every step was timed"
        assert all(math.isfinite(v) for v in r["losses"]), f"{name}: non-finite loss"
        assert r["losses"][-1] < r["losses"][0], f"{name}: training loss did not fall"
    gefen, adam = res["gefen"], res["deepspeed-cpu-adam"]
    report = {
        "what": "ZeRO-2 offload_optimizer, one GPU, bf16: median host optimizer step and "
                "engine.step() after the first steps",
        "command": "GEFEN_OFFLOAD_TIME_JSON=<file> python -m pytest -s -m gpu "
                   "packages/gefen-dist/tests/test_deepspeed_offload_time.py",
        "utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0),
        "host_cpus": os.cpu_count(),
        "host_processor": platform.processor() or platform.machine(),
        "torch_threads": res["torch_threads"],
        "cpu_step_status": res["cpu_step_status"],
        "gefen_direct_step_ms_median": res["gefen_direct_step_ms"],
        "versions": {"torch": torch.__version__, "deepspeed": _version("deepspeed"),
                     "python": platform.python_version()},
        "model": {**MODEL_KW, "params": gefen["params"]}, "batch": BATCH, "steps": STEPS,
        "warmup": WARMUP, "lr": LR,
        "optimizers": {name: res[name] for name in OPTIMIZERS},
        "ratio_optimizer_step": gefen["optimizer_step_ms_median"]
        / adam["optimizer_step_ms_median"],
        "ratio_engine_step": gefen["engine_step_ms_median"] / adam["engine_step_ms_median"],
    }
    print(f"\n{'optimizer':22s} {'opt.step ms':>12s} {'engine.step ms':>15s}  final loss")
    for name in OPTIMIZERS:
        r = res[name]
        print(f"{name:22s} {r['optimizer_step_ms_median']:12.1f} "
              f"{r['engine_step_ms_median']:15.1f}  {r['losses'][-1]:.4f}")
    print(f"Gefen / DeepSpeed CPU Adam: opt.step {report['ratio_optimizer_step']:.2f}x, "
          f"engine.step {report['ratio_engine_step']:.2f}x ({gefen['params']:,} parameters)")
    print(f"Gefen.step() of one flat CPU tensor of that size outside DeepSpeed: "
          f"{res['gefen_direct_step_ms']:.1f} ms; CPU step: {res['cpu_step_status']}; "
          f"{res['torch_threads']} torch threads")
    path = os.environ.get("GEFEN_OFFLOAD_TIME_JSON")
    if path:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=1)


def _version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"
