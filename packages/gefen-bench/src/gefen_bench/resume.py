"""``gefen-bench resume``: the Trainer-resume gate (docs/algorithm.md#distributed).

For each recipe (plain ``Gefen``; ``GefenMuonHybrid`` with an AdamW backup; with a Gefen
backup) the Hugging Face ``Trainer`` trains a tiny Llama or Qwen3 built from a config (tied
input/output embeddings, no download) on real text (the Python standard library's sources,
as bytes) three times:

1. **uninterrupted**: ``--steps`` optimizer updates;
2. **interrupted**: the same run, stopped right after the native Trainer checkpoint
   ``checkpoint-<split>`` is written;
3. **resumed**: a fresh model, optimizer and Trainer, ``train(resume_from_checkpoint=...)`` to
   ``--steps``.

Every update accumulates ``--grad-accum`` micro-batches, and the learning rate follows a
warmup + cosine schedule, so a scheduler restored at the wrong step shows in the LRs. The gate
passes only if, between runs 1 and 3, the model weights, the optimizer ``state_dict`` (every
tensor bit for bit, with its dtype, and every non-tensor value), the scheduler ``state_dict``,
the logged learning rates and the logged losses (and gradient norms) are **exactly** equal,
and the structural checks hold: the Trainer built or wrapped the given optimizer once, stepped
it once per accumulated update (``steps`` times), and the tied embedding/LM-head tensor is in
the optimizer once. Under DDP (``--world-size 2``, gloo on CPU) every rank must also hold
bit-identical weights and optimizer state (one SHA-256 over all of them).

``--break drop_codebook`` removes the learned codebook from the checkpoint's ``optimizer.pt``
(the resume must then fail: a code tensor without its codebook means nothing) and
``--break flip_code`` moves one momentum code to the other end of the codebook (the resume
loads, and the comparison must catch it). They exist to show the gate can fail.

Run it as ``gefen-bench resume [--recipes gefen,muon_adamw,muon_gefen] [--world-size 2]
[--device cuda --bf16]``; the exit status is 1 when any recipe fails.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

RECIPES = ("gefen", "muon_adamw", "muon_gefen")
BREAKS = ("none", "drop_codebook", "flip_code")
MODELS = ("llama", "qwen3")
VOCAB = 256 + 2  # bytes plus bos/eos ids the configs insist on


# ------------------------------------------------------------------------------ model & data


def tiny_config(family: str = "llama") -> Any:
    """A tiny causal-LM config with tied input/output embeddings (no download)."""
    from transformers import LlamaConfig, Qwen3Config

    common: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True, bos_token_id=256, eos_token_id=257, pad_token_id=257,
    )
    if family == "llama":
        return LlamaConfig(**common)
    if family == "qwen3":
        return Qwen3Config(head_dim=8, **common)
    raise ValueError(f"model family must be one of {MODELS}, got {family!r}")


def tiny_model(family: str = "llama", seed: int = 0) -> torch.nn.Module:
    """The tiny model with deterministic initial weights (``torch.manual_seed(seed)``)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family))
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    if emb is not head:
        raise RuntimeError("tiny model: input and output embeddings are not tied")
    return model


class ByteWindows(torch.utils.data.Dataset):
    """Fixed ``[seq]`` windows of real text (the stdlib's ``os.py``/``argparse.py`` bytes)."""

    def __init__(self, n: int, seq: int) -> None:
        blob = b""
        for path in (os.__file__, argparse.__file__):
            with open(path, "rb") as fh:
                blob += fh.read()
        data = torch.tensor(list(blob[: n * seq]), dtype=torch.int64)
        if data.numel() < n * seq:
            raise ValueError(f"not enough text for {n} windows of {seq} bytes")
        self.windows = data.view(n, seq)

    def __len__(self) -> int:
        return self.windows.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.windows[i]
        return {"input_ids": ids, "labels": ids.clone()}


# ------------------------------------------------------------------------------ optimizers


def build_optimizer(recipe: str, model: torch.nn.Module, lr: float,
                    fused: bool | None) -> tuple[dict[str, Any], Any]:
    """The Trainer arguments that install ``recipe`` for ``model``.

    Returns ``({"optimizer_cls_and_kwargs": ...} or {"optimizers": (opt, None)}, optimizer or
    None)``: plain Gefen is built by the Trainer from its class and kwargs
    (docs/algorithm.md#distributed); the hybrid splits the model at construction and is passed
    built.
    """
    from gefen_core import Gefen

    if recipe == "gefen":
        kw = dict(lr=lr, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01, fused=fused,
                  deterministic=True)
        return {"optimizer_cls_and_kwargs": (Gefen, kw)}, None
    from gefen_core.hybrid import GefenMuonHybrid

    backup = {"muon_adamw": "adamw", "muon_gefen": "gefen"}.get(recipe)
    if backup is None:
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
    opt = GefenMuonHybrid(model, lr=lr, backup_optimizer=backup,
                          backup_lr=lr if backup == "adamw" else 0.5 * lr,
                          weight_decay=0.01, fused=fused, deterministic=True)
    return {"optimizers": (opt, None)}, opt


# ------------------------------------------------------------------------------ comparison


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts/lists -> ``{"a.b.0": leaf}``, keys sorted (integer-like keys numerically)."""
    out: dict[str, Any] = {}
    if isinstance(obj, Mapping):
        for k in sorted(obj, key=lambda x: (not isinstance(x, int), str(x))):
            out.update(_flatten(obj[k], f"{prefix}{k}."))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(_flatten(v, f"{prefix}{i}."))
        if not obj:
            out[prefix.rstrip(".")] = type(obj).__name__ + "()"
    else:
        out[prefix.rstrip(".")] = obj
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.detach().cpu(), b.detach().cpu()))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def compare_trees(a: Any, b: Any, what: str, limit: int = 5) -> list[str]:
    """Exact differences between two nested states, as messages (empty when equal)."""
    fa, fb = _flatten(a), _flatten(b)
    diffs = []
    for key in sorted(set(fa) | set(fb)):
        if key not in fa or key not in fb:
            diffs.append(f"{what}: {key!r} only in the {'resumed' if key in fb else 'reference'}")
        elif not _same(fa[key], fb[key]):
            va, vb = fa[key], fb[key]
            if isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) \
                    and va.shape == vb.shape and va.dtype == vb.dtype:
                n = int((va.detach().cpu() != vb.detach().cpu()).sum())
                diffs.append(f"{what}: {key!r} differs in {n} of {va.numel()} elements")
            else:
                diffs.append(f"{what}: {key!r} differs ({_short(va)} vs {_short(vb)})")
    if len(diffs) > limit:
        diffs = diffs[:limit] + [f"{what}: ... {len(diffs) - limit} more"]
    return diffs


def _short(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"tensor{tuple(v.shape)}:{v.dtype}"
    return repr(v)[:60]


def state_digest(*trees: Any) -> str:
    """SHA-256 over every leaf (tensor bytes with dtype and shape, or ``repr``) in key order."""
    h = hashlib.sha256()
    for tree in trees:
        for key, v in _flatten(tree).items():
            h.update(key.encode())
            if isinstance(v, torch.Tensor):
                t = v.detach().cpu().contiguous()
                h.update(f"{t.dtype}{tuple(t.shape)}".encode())
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
            else:
                h.update(repr(v).encode())
    return h.hexdigest()


# ------------------------------------------------------------------------------ breaking


def _break_checkpoint(ckpt: Path, how: str) -> str:
    """Damage ``ckpt/optimizer.pt`` on purpose; returns what was done."""
    path = ckpt / "optimizer.pt"
    sd = torch.load(path, map_location="cpu", weights_only=False)
    halves = [sd[k] for k in ("muon", "backup") if isinstance(sd.get(k), dict)] or [sd]
    gefen_halves = [h for h in halves if "gefen_meta" in h]
    if not gefen_halves:
        raise RuntimeError("--break: the checkpoint holds no Gefen state to damage")
    if how == "drop_codebook":
        for h in gefen_halves:
            h["gefen_meta"] = {**h["gefen_meta"], "codebook": None}
            for g in h["param_groups"]:
                if "gefen_meta" in g:
                    g["gefen_meta"] = {**g["gefen_meta"], "codebook": None}
        done = "removed the codebook from every Gefen half"
    elif how == "flip_code":
        h = gefen_halves[0]
        for i in sorted(h["state"]):
            codes = h["state"][i].get("exp_avg_codes")
            scale = h["state"][i].get("exp_avg_scale")
            if not isinstance(codes, torch.Tensor) or not isinstance(scale, torch.Tensor):
                continue
            # A code in a block of scale 0 means 0 whatever its value: pick a live block. Move
            # the code to the opposite end of the codebook: a one-level nudge can vanish in the
            # next step's re-quantization, a sign flip of one momentum element cannot.
            live = (scale.view(-1) > 0).nonzero()
            if live.numel():
                b = int(live[0])
                q = int(codes[b, 0])
                codes[b, 0] = 0 if q >= 128 else 255
                done = f"changed one momentum code of state entry {i} (block {b})"
                break
        else:
            raise RuntimeError("--break flip_code: no momentum codes in the checkpoint")
    else:
        raise ValueError(f"break must be one of {BREAKS}, got {how!r}")
    torch.save(sd, path)
    return done


# ------------------------------------------------------------------------------ the gate


@dataclass
class GateResult:
    """One recipe's outcome. ``passed`` is true only if ``differences`` and ``errors`` are
    empty; ``losses``/``lrs`` are the uninterrupted run's logged values per update."""

    recipe: str
    model: str
    world_size: int
    rank: int
    passed: bool = False
    differences: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    optimizer_steps: int = 0
    digest: str = ""
    broken: str = ""


@dataclass
class _Run:
    logs: list[dict[str, float]]
    model_sd: dict[str, torch.Tensor]
    optim_sd: dict[str, Any]
    sched_sd: dict[str, Any]
    steps: int
    checks: list[str]


class _StopAfterSave:
    """Trainer callback: stop training right after the checkpoint at ``step`` is written."""

    def __new__(cls, step: int) -> Any:
        from transformers import TrainerCallback

        class Stop(TrainerCallback):
            def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
                if state.global_step >= step:
                    control.should_training_stop = True
                return control

        return Stop()


def _training_args(out: Path, o: argparse.Namespace, world_size: int, save: bool) -> Any:
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(out), max_steps=o.steps, per_device_train_batch_size=o.batch,
        gradient_accumulation_steps=o.grad_accum, learning_rate=o.lr,
        lr_scheduler_type="cosine", warmup_steps=2, logging_steps=1,
        save_strategy="steps" if save else "no",
        save_steps=o.split, save_only_model=False, report_to=[], seed=0, data_seed=0,
        dataloader_num_workers=0, disable_tqdm=True, use_cpu=o.device == "cpu",
        bf16=o.bf16, max_grad_norm=1.0, weight_decay=0.01, adam_beta2=0.99,
        ddp_backend="gloo" if (o.device == "cpu" and world_size > 1) else None,
    )


def _train_once(recipe: str, o: argparse.Namespace, out: Path, world_size: int, *,
                stop_at: int | None = None, resume: Path | None = None) -> _Run:
    from transformers import Trainer

    model = tiny_model(o.model, seed=0)
    args = _training_args(out, o, world_size, save=stop_at is not None)
    if o.device == "cuda":
        # An optimizer built by the user (the Muon recipes) sees the parameters where they will
        # train, as with any fused optimizer; the Trainer's own move is then a no-op.
        model.to(args.device)
    fused = (True if o.device == "cuda" else None) if o.fused else False
    trainer_kw, given = build_optimizer(recipe, model, o.lr, fused=fused)
    counter = {"steps": 0}
    trainer = Trainer(
        model=model, args=args,
        train_dataset=ByteWindows(o.windows, o.seq),
        callbacks=[_StopAfterSave(stop_at)] if stop_at is not None else None, **trainer_kw,
    )
    if given is None:
        trainer.create_optimizer()
    opt: Any = trainer.optimizer
    opt.register_step_post_hook(lambda *_: counter.__setitem__("steps", counter["steps"] + 1))
    trainer.train(resume_from_checkpoint=str(resume) if resume is not None else None)
    checks = []
    wrapped = trainer.optimizer
    inner = getattr(wrapped, "optimizer", wrapped)
    if inner is not opt:
        checks.append("the Trainer replaced the optimizer it was given / built")
    if getattr(inner, "optimizer", None) is not None and type(inner).__name__.startswith("Acc"):
        checks.append("the optimizer was wrapped more than once")
    if given is not None and opt is not given:
        checks.append("the Trainer did not use the optimizer passed in optimizers=")
    live: Any = trainer.model_wrapped if hasattr(trainer, "model_wrapped") else trainer.model
    module: Any = getattr(live, "module", live)
    if world_size > 1 and (trainer.args.world_size != world_size or not isinstance(
            live, torch.nn.parallel.DistributedDataParallel)):
        checks.append(f"the Trainer did not train with DDP over {world_size} ranks "
                      f"(args.world_size={trainer.args.world_size}, {type(live).__name__})")
    ids = [id(p) for g in opt.param_groups for p in g["params"]]
    trainable = {id(p) for p in module.parameters() if p.requires_grad}
    if len(ids) != len(set(ids)):
        checks.append("a parameter (the tied embedding?) appears twice in the optimizer")
    if set(ids) != trainable:
        checks.append("the optimizer's parameters are not exactly the trained model's")
    tied = module.get_input_embeddings().weight
    if module.get_output_embeddings().weight is not tied or ids.count(id(tied)) != 1:
        checks.append("the tied embedding / LM head is not one tensor routed once")
    logs = [{k: v for k, v in e.items() if k in ("step", "loss", "learning_rate", "grad_norm")}
            for e in trainer.state.log_history if "loss" in e]
    return _Run(
        logs=logs,
        model_sd={k: v.detach().clone() for k, v in module.state_dict().items()},
        optim_sd=opt.state_dict(),
        sched_sd=trainer.lr_scheduler.state_dict() if trainer.lr_scheduler is not None else {},
        steps=counter["steps"],
        checks=checks,
    )


def gate_one(recipe: str, o: argparse.Namespace, workdir: Path, *, rank: int = 0,
             world_size: int = 1) -> GateResult:
    """Run the three trainings of one recipe in this process and compare them exactly."""
    res = GateResult(recipe=recipe, model=o.model, world_size=world_size, rank=rank)
    base = workdir / recipe
    try:
        ref = _train_once(recipe, o, base / "uninterrupted", world_size)
        res.losses = [e["loss"] for e in ref.logs]
        res.lrs = [e["learning_rate"] for e in ref.logs]
        res.optimizer_steps = ref.steps
        res.errors += ref.checks
        if ref.steps != o.steps:
            res.errors.append(f"optimizer stepped {ref.steps} times for {o.steps} updates of "
                              f"{o.grad_accum} micro-batches")
        part = _train_once(recipe, o, base / "interrupted", world_size, stop_at=o.split)
        if part.steps != o.split:
            res.errors.append(f"interrupted run stepped {part.steps} times, expected {o.split}")
        ckpt = base / "interrupted" / f"checkpoint-{o.split}"
        for name in ("optimizer.pt", "scheduler.pt", "trainer_state.json", "model.safetensors"):
            if not (ckpt / name).is_file():
                res.errors.append(f"native Trainer checkpoint lacks {name}")
        if o.break_ != "none":
            if world_size > 1:
                import torch.distributed as dist

                dist.barrier()
            if rank == 0:
                res.broken = _break_checkpoint(ckpt, o.break_)
            if world_size > 1:
                dist.barrier()
        try:
            new = _train_once(recipe, o, base / "interrupted", world_size, resume=ckpt)
        except Exception as exc:  # noqa: BLE001 - a failed resume is a gate failure, reported
            res.errors.append(f"resume failed: {type(exc).__name__}: {exc}"[:400])
        else:
            res.errors += new.checks
            if new.steps != o.steps - o.split:
                res.errors.append(f"resumed run stepped {new.steps} times, expected "
                                  f"{o.steps - o.split}")
            res.differences += compare_trees(ref.model_sd, new.model_sd, "model")
            res.differences += compare_trees(ref.optim_sd, new.optim_sd, "optimizer")
            res.differences += compare_trees(ref.sched_sd, new.sched_sd, "scheduler")
            ref_lr = [e["learning_rate"] for e in ref.logs]
            new_lr = [e["learning_rate"] for e in new.logs]
            if ref_lr != new_lr:
                res.differences.append(f"learning rates differ: {ref_lr} vs {new_lr}")
            for key in ("loss", "grad_norm"):
                a = [e.get(key) for e in ref.logs]
                b = [e.get(key) for e in new.logs]
                if a != b:
                    res.differences.append(f"logged {key} differ: {a} vs {b}")
            if len(new.logs) != o.steps:
                res.differences.append(f"resumed log has {len(new.logs)} updates, "
                                       f"expected {o.steps}")
        res.digest = state_digest(ref.model_sd, ref.optim_sd)
    except Exception as exc:  # noqa: BLE001 - any crash is a failure of the gate
        res.errors.append(f"{type(exc).__name__}: {exc}"[:400])
    res.passed = not res.errors and not res.differences
    return res


def _rank_worker(rank: int, world_size: int, recipes: Sequence[str], o: argparse.Namespace,
                 workdir: str) -> list[dict[str, Any]]:
    import torch.distributed as dist

    # The Trainer (Accelerate) reads the launcher's variables; the process group already
    # exists (gefen_dist.testing made it), so it is reused as is.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    out = []
    for recipe in recipes:
        r = gate_one(recipe, o, Path(workdir), rank=rank, world_size=world_size)
        digests: list[Any] = [None] * world_size
        dist.all_gather_object(digests, r.digest)
        if len(set(digests)) != 1:
            r.differences.append(f"DDP replicas differ: state digests {digests}")
            r.passed = False
        out.append(asdict(r))
    return out


def run_gate(recipes: Sequence[str], o: argparse.Namespace,
             workdir: Path | None = None) -> list[GateResult]:
    """Run the gate for ``recipes`` (one process, or ``o.world_size`` spawned gloo/NCCL ranks).

    Returns one :class:`GateResult` per recipe (rank 0's; under DDP a replica mismatch on any
    rank fails it).
    """
    for r in recipes:
        if r not in RECIPES:
            raise argparse.ArgumentTypeError(f"--recipes: unknown recipe {r!r}; choose from "
                                             f"{','.join(RECIPES)}")
    if not 1 <= o.split < o.steps:
        raise argparse.ArgumentTypeError(f"--split must be in [1, --steps), got {o.split}")
    with tempfile.TemporaryDirectory(prefix="gefen_resume_") as tmp:
        root = Path(workdir or tmp)
        if o.world_size == 1:
            return [gate_one(r, o, root) for r in recipes]
        from gefen_dist.testing import run_distributed

        backend = "gloo" if o.device == "cpu" else "nccl"
        per_rank = run_distributed(_rank_worker, o.world_size, list(recipes), o, str(root),
                                   backend=backend, timeout=o.timeout,
                                   collective_timeout=o.timeout * 0.8,
                                   env={"CUDA_VISIBLE_DEVICES": ""} if o.device == "cpu" else {})
    results = []
    for i in range(len(recipes)):
        ranks = [GateResult(**rank_out[i]) for rank_out in per_rank]
        head = ranks[0]
        for other in ranks[1:]:
            head.errors += [f"rank {other.rank}: {e}" for e in other.errors]
            head.differences += [f"rank {other.rank}: {d}" for d in other.differences]
        head.passed = all(r.passed for r in ranks)
        results.append(head)
    return results


def default_options(**overrides: Any) -> argparse.Namespace:
    """The command's defaults as a namespace (for tests and scripts)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    ns = parser.parse_args([])
    for k, v in overrides.items():
        if not hasattr(ns, k):
            raise TypeError(f"unknown option {k!r}")
        setattr(ns, k, v)
    return ns


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``resume``'s options on ``parser``."""
    parser.add_argument("--recipes", default=",".join(RECIPES),
                        help=f"comma-separated recipes (default {','.join(RECIPES)})")
    parser.add_argument("--model", choices=MODELS, default="llama",
                        help="tiny model family built from a config (default llama)")
    parser.add_argument("--world-size", type=int, default=1,
                        help="processes (DDP; gloo on CPU, NCCL on CUDA; default 1)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where to train (default cpu)")
    parser.add_argument("--bf16", action="store_true",
                        help="bf16 mixed precision (use with --device cuda for fused kernels)")
    parser.add_argument("--no-fused", dest="fused", action="store_false",
                        help="fused=False (PyTorch path); default: fused=True on CUDA, the "
                        "fastest available path (fused=None) on the CPU")
    parser.add_argument("--steps", type=int, default=6, help="optimizer updates (default 6)")
    parser.add_argument("--split", type=int, default=3,
                        help="update after which the checkpoint is taken (default 3)")
    parser.add_argument("--grad-accum", type=int, default=2,
                        help="micro-batches per update (default 2)")
    parser.add_argument("--batch", type=int, default=2, help="micro-batch size (default 2)")
    parser.add_argument("--seq", type=int, default=32, help="sequence length (default 32)")
    parser.add_argument("--windows", type=int, default=96,
                        help="training windows in the dataset (default 96)")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--break", dest="break_", choices=BREAKS, default="none",
                        help="damage the checkpoint on purpose (the gate must then fail)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds before spawned ranks are killed (default 600)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="keep the runs' output here (default: a temporary directory)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The ``resume`` subcommand: run the gate, print a table, write JSON; exit 1 on failure."""
    from .report import print_table, write_json

    recipes = [r.strip() for r in str(args.recipes).split(",") if r.strip()]
    if args.world_size < 1:
        raise argparse.ArgumentTypeError("--world-size must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError("--device cuda: no CUDA device is available")
    results = run_gate(recipes, args, args.workdir)
    rows = [[r.recipe, r.model, r.world_size, "PASS" if r.passed else "FAIL",
             r.optimizer_steps, r.losses[-1] if r.losses else None,
             "; ".join(r.errors + r.differences)[:120] or "-"] for r in results]
    print_table("Trainer resume gate: uninterrupted vs checkpoint + resume",
                ["recipe", "model", "ranks", "result", "steps", "final loss", "why"], rows)
    payload = {"passed": all(r.passed for r in results),
               "options": {k: v for k, v in vars(args).items() if k != "func"},
               "results": [asdict(r) for r in results]}
    if args.out is not None:
        write_json(args.out, "resume", payload, argv=getattr(args, "argv", sys.argv))
    if not payload["passed"]:
        raise SystemExit(1)
    return payload


__all__ = [
    "BREAKS", "MODELS", "RECIPES", "ByteWindows", "GateResult", "add_arguments",
    "build_optimizer", "compare_trees", "default_options", "gate_one", "run", "run_gate",
    "state_digest", "tiny_config", "tiny_model",
]
