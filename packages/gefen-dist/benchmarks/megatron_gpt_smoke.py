#!/usr/bin/env python3
"""Megatron-Core GPT smoke with Gefen: three recipes, TP=PP=1, mock data, checkpoint continuation.

    python3 packages/gefen-dist/benchmarks/megatron_gpt_smoke.py --out DIR [--steps 10] [--fp32]
    torchrun --nproc-per-node 2 packages/gefen-dist/benchmarks/megatron_gpt_smoke.py --out DIR

(``--split 5`` sets the checkpoint step; ``torchrun`` runs it data parallel.)

For each recipe of docs/algorithm.md#distributed (``gefen``, ``muon_adamw``, ``muon_gefen``) a tiny
``megatron.core`` GPTModel (local layer spec, tied embedding/output weights, no dropout) is
trained on Megatron's ``MockGPTDataset`` through Megatron-Core's own training path: its
``DistributedDataParallel``, ``get_forward_backward_func()`` (two micro-batches per update),
the optimizer from ``gefen_dist.megatron.get_gefen_megatron_optimizer`` (Megatron's
``FP32Optimizer`` / ``Float16OptimizerWithFloat16Params`` / ``ChainedOptimizer`` wrappers with
gradient clipping) and ``OptimizerParamScheduler`` (warmup + cosine).

Checkpoint continuation: one run trains ``--steps`` updates uninterrupted; a second trains
``--split`` updates and saves a legacy-format (``torch.save``) checkpoint — model, optimizer
(``optimizer.state_dict()``), scheduler — from which a fresh model, optimizer and scheduler built
from a *different* seed resume to ``--steps``. The table reports the final loss, the loss drop
and whether losses, learning rates and final weights of the continued run equal the
uninterrupted run bit for bit (``deterministic=True``). ``DIR/megatron_gpt_smoke.json`` holds
every per-step value. Needs CUDA (Megatron's forward asserts it) and megatron-core >= 0.16.
Exit status 1 if a run fails, a loss is not finite or the loss does not fall.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch

RECIPES = ("gefen", "muon_adamw", "muon_gefen")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="output directory (JSON, checkpoints)")
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated recipes")
    p.add_argument("--steps", type=int, default=10, help="optimizer updates (default 10)")
    p.add_argument("--split", type=int, default=5, help="checkpoint after this update (default 5)")
    p.add_argument("--micro-batches", type=int, default=2, help="micro-batches per update")
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--seq", type=int, default=64, help="sequence length")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--fp32", action="store_true", help="fp32 instead of bf16")
    p.add_argument("--no-fused", action="store_true", help="Gefen's PyTorch path")
    a = p.parse_args(argv)
    for r in a.recipes.split(","):
        if r not in RECIPES:
            p.error(f"--recipes: unknown recipe {r!r}; choose from {','.join(RECIPES)}")
    if not 1 <= a.split < a.steps:
        p.error(f"--split must be in [1, --steps), got {a.split}")
    return a


def _init_distributed(tmp: str) -> tuple[int, int]:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not torch.cuda.is_available():
        raise SystemExit("megatron_gpt_smoke: needs CUDA (Megatron's GPT forward asserts it)")
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if world == 1 and "MASTER_ADDR" not in os.environ:
        dist.init_process_group("nccl", init_method=f"file://{tmp}/store", rank=0, world_size=1)
    else:
        dist.init_process_group("nccl")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1
    )
    model_parallel_cuda_manual_seed(0)
    return rank, world


def _dataset(a: argparse.Namespace, world: int) -> Any:
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    cfg = GPTDatasetConfig(
        random_seed=1234,
        sequence_length=a.seq,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        tokenizer=NullTokenizer(vocab_size=a.vocab - 1),
    )
    n = a.steps * a.micro_batches * a.micro_batch_size * world
    train, _, _ = BlendedMegatronDatasetBuilder(
        MockGPTDataset, [n, None, None], lambda: True, cfg
    ).build()
    return train


def _batches(
    train: Any, a: argparse.Namespace, rank: int, world: int, first_update: int
) -> Iterator[dict[str, torch.Tensor]]:
    """Micro-batches of this rank from update ``first_update`` on (a resumed run skips the
    samples the interrupted run consumed, as Megatron's sampler does)."""
    per_update = a.micro_batches * a.micro_batch_size
    i = (first_update * world + rank) * per_update
    while True:
        rows = [train[j] for j in range(i, i + a.micro_batch_size)]
        i += a.micro_batch_size
        if (i // a.micro_batch_size) % a.micro_batches == 0:
            i += (world - 1) * per_update  # the other ranks' share of this update
        yield {k: torch.stack([r[k] for r in rows]).cuda(non_blocking=True) for k in rows[0]}


def _build(a: argparse.Namespace, recipe: str, seed: int) -> tuple[Any, Any, Any, Any]:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from gefen_dist.megatron import get_gefen_megatron_optimizer

    torch.manual_seed(seed)
    bf16 = not a.fp32
    dtype = torch.bfloat16 if bf16 else torch.float32
    tcfg = TransformerConfig(
        num_layers=a.layers,
        hidden_size=a.hidden,
        num_attention_heads=4,
        ffn_hidden_size=4 * a.hidden,
        use_cpu_initialization=True,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=bf16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    model = GPTModel(
        config=tcfg,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=a.vocab,
        max_sequence_length=a.seq,
        share_embeddings_and_output_weights=True,
    ).cuda()
    # Megatron's own training entry wraps a bf16 model the same way: the module holds bf16
    # parameters and the wrapper casts the fp32 inputs and outputs at its boundary.
    module = Float16Module(tcfg, model) if bf16 else model
    ddp = DistributedDataParallel(
        config=tcfg,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
        ),
        module=module,
    )
    ocfg = OptimizerConfig(
        lr=a.lr,
        min_lr=a.lr / 10,
        weight_decay=0.1,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_eps=1e-8,
        clip_grad=1.0,
        bf16=bf16,
    )
    fused = False if a.no_fused else True
    opt = get_gefen_megatron_optimizer(
        ocfg, [ddp], recipe, gefen_kwargs={"fused": fused, "deterministic": True}
    )
    sched = OptimizerParamScheduler(
        opt,
        init_lr=0.0,
        max_lr=a.lr,
        min_lr=a.lr / 10,
        lr_warmup_steps=2,
        lr_decay_steps=a.steps,
        lr_decay_style="cosine",
        start_wd=0.1,
        end_wd=0.1,
        wd_incr_steps=a.steps,
        wd_incr_style="constant",
    )
    return model, ddp, opt, sched


def _loss_func(
    loss_mask: torch.Tensor, output: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    losses = output.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask) / mask.sum()
    return loss, {"lm loss": loss.detach()}


def _forward_step(data_iterator: Iterator[dict[str, torch.Tensor]], model: Any) -> Any:
    batch = next(data_iterator)
    out = model(
        batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
    )
    return out, partial(_loss_func, batch["loss_mask"])


def _train(
    a: argparse.Namespace,
    ddp: Any,
    opt: Any,
    sched: Any,
    data: Iterator[dict[str, torch.Tensor]],
    updates: int,
) -> list[dict[str, Any]]:
    import torch.distributed as dist
    from megatron.core.pipeline_parallel import get_forward_backward_func

    fwd_bwd = get_forward_backward_func()
    log = []
    for _ in range(updates):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        out = fwd_bwd(
            forward_step_func=_forward_step,
            data_iterator=data,
            model=[ddp],
            num_microbatches=a.micro_batches,
            seq_length=a.seq,
            micro_batch_size=a.micro_batch_size,
            decoder_seq_length=a.seq,
            forward_only=False,
        )
        ok, grad_norm, _ = opt.step()
        loss = torch.stack([o["lm loss"] for o in out]).mean()
        dist.all_reduce(loss)
        loss /= dist.get_world_size()
        lr = opt.param_groups[0]["lr"]
        sched.step(increment=1)
        log.append(
            {
                "loss": float(loss),
                "lr": float(lr),
                "grad_norm": float(grad_norm or 0.0),
                "ok": bool(ok),
            }
        )
    return log


def _weights(model: Any) -> list[torch.Tensor]:
    return [p.detach().float().cpu().clone() for p in model.parameters()]


def _one_recipe(
    a: argparse.Namespace, recipe: str, train: Any, rank: int, world: int, ckdir: Path
) -> dict[str, Any]:
    t0 = time.perf_counter()
    model, ddp, opt, sched = _build(a, recipe, seed=0)
    full = _train(a, ddp, opt, sched, _batches(train, a, rank, world, 0), a.steps)
    ref_w = _weights(model)
    del model, ddp, opt, sched

    model, ddp, opt, sched = _build(a, recipe, seed=0)
    _train(a, ddp, opt, sched, _batches(train, a, rank, world, 0), a.split)
    path = ckdir / f"{recipe}_rank{rank}.pt"
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(),
            "update": a.split,
        },
        path,
    )
    del model, ddp, opt, sched

    # Different seed: a continuation that matches can only come from the checkpoint.
    model, ddp, opt, sched = _build(a, recipe, seed=1)
    ck = torch.load(path, map_location="cuda", weights_only=False)
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["optimizer"])
    sched.load_state_dict(ck["scheduler"])
    cont = _train(a, ddp, opt, sched, _batches(train, a, rank, world, a.split), a.steps - a.split)
    new_w = _weights(model)
    max_diff = max(float((x - y).abs().max()) for x, y in zip(ref_w, new_w, strict=True))
    ref_tail = full[a.split :]
    return {
        "recipe": recipe,
        "uninterrupted": full,
        "continued": cont,
        "losses_equal": [e["loss"] for e in ref_tail] == [e["loss"] for e in cont],
        "lrs_equal": [e["lr"] for e in ref_tail] == [e["lr"] for e in cont],
        "weights_equal": max_diff == 0.0,
        "max_weight_diff": max_diff,
        "seconds": time.perf_counter() - t0,
    }


def main(argv: list[str] | None = None) -> int:
    a = _parse(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    with tempfile.TemporaryDirectory() as tmp:
        rank, world = _init_distributed(tmp)
        import torch.distributed as dist

        train = _dataset(a, world)
        results, failed = [], False
        for recipe in a.recipes.split(","):
            try:
                results.append(_one_recipe(a, recipe, train, rank, world, a.out))
            except Exception as exc:  # noqa: BLE001 - report every recipe, then fail
                failed = True
                results.append(
                    {
                        "recipe": recipe,
                        "error": f"{type(exc).__name__}: {exc}",
                        "traceback": traceback.format_exc(),
                    }
                )
        dist.barrier()
        dist.destroy_process_group()
    if rank != 0:
        return 0
    import megatron.core

    rows = []
    for r in results:
        if "error" in r:
            rows.append(f"{r['recipe']:12s} ERROR {r['error'][:150]}")
            continue
        losses = [e["loss"] for e in r["uninterrupted"]]
        good = all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
        failed |= not good
        rows.append(
            f"{r['recipe']:12s} {losses[0]:9.4f} {losses[-1]:9.4f} "
            f"{'yes' if good else 'NO':>5s} {str(r['losses_equal']):>7s} "
            f"{str(r['lrs_equal']):>6s} {str(r['weights_equal']):>8s} "
            f"{r['max_weight_diff']:10.3e} {r['seconds']:7.1f}"
        )
    print(
        f"Megatron-Core {megatron.core.__version__} GPT smoke, TP=PP=1, DP={world}, "
        f"{'fp32' if a.fp32 else 'bf16'}, {a.steps} updates, checkpoint at {a.split}"
    )
    print(
        f"{'recipe':12s} {'loss[0]':>9s} {'loss[-1]':>9s} {'falls':>5s} {'losses=':>7s} "
        f"{'lrs=':>6s} {'weights=':>8s} {'max|dw|':>10s} {'s':>7s}"
    )
    print("\n".join(rows))
    doc = {
        "schema": "gefen-x/megatron_gpt_smoke/1",
        "argv": sys.argv,
        "options": {k: str(v) for k, v in vars(a).items()},
        "versions": {
            "torch": torch.__version__,
            "megatron_core": megatron.core.__version__,
            "python": platform.python_version(),
        },
        "device": torch.cuda.get_device_name(0),
        "world_size": world,
        "results": results,
    }
    out = a.out / "megatron_gpt_smoke.json"
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
