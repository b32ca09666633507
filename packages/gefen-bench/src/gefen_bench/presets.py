"""Sizes for ``gefen-bench train``: one code path, scaled by preset.

``cpu-default`` is the embedded default (no download, CPU, ≤ 10 minutes on 2 cores for the
default optimizer set: the byte-level LM, the digits CNN and the digits MLP); ``h200-small``
and ``h200-1b`` scale the same byte-level Llama model, sequence and step count for one GPU;
``tiny`` exists for tests and smoke runs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any


@dataclass(frozen=True)
class LMConfig:
    """Byte-level Llama-style decoder (``transformers.LlamaConfig``) on standard-library text.

    Units: ``steps`` optimizer steps of ``batch`` windows of ``seq_len`` bytes; learning rates
    are peak values of a linear-warm-up (``warmup_frac`` of the steps) cosine schedule that
    decays to ``final_lr_frac`` of the peak.
    """

    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    seq_len: int = 128
    batch: int = 16
    steps: int = 300
    eval_every: int = 50
    eval_windows: int = 64
    final_eval_windows: int = 256
    adamw_lr: float = 3e-3
    weight_decay: float = 0.1
    warmup_frac: float = 0.05
    final_lr_frac: float = 0.1
    grad_clip: float = 1.0
    # Activation checkpointing of every decoder layer (recomputed in backward, non-reentrant).
    checkpointing: bool = False
    param_dtype: str = "float32"
    autocast_bf16: bool = False
    max_train_bytes: int | None = None
    # Steps of each LR-sweep run (gefen-bench train's shared-grid sweep, validation split):
    # a quarter of the reported run, so that the CPU default's sweep (5 optimizers x 3 LRs)
    # costs about as much as its reported LM runs and the whole job stays within 10 minutes.
    sweep_steps: int = 75


@dataclass(frozen=True)
class DigitsConfig:
    """A small classifier on scikit-learn's digits; ``epochs`` passes over the training split.

    ``model`` is ``"cnn"`` (two 3x3 convolutions of ``channels`` and ``2 * channels``, a
    max-pool, a ``hidden``-unit layer) or ``"mlp"`` (two ``hidden``-unit ReLU layers on the 64
    pixels; ``channels`` unused). Learning rates are peak values of a linear-warm-up cosine
    schedule over all ``epochs`` that decays to ``final_lr_frac`` of the peak.
    """

    model: str = "cnn"
    channels: int = 16
    hidden: int = 64
    # 20 epochs = 340 steps of 64 (the training split is 1077 images). Measured (3 seeds,
    # held-out, docs/benchmarks.md "digits"): AdamW's accuracy is 97.33% after 10 epochs and
    # 98.00 / 98.15 / 98.22% after 20 / 30 / 40, so 20 is where it has levelled off.
    epochs: int = 20
    batch: int = 64
    seeds: tuple[int, ...] = (0, 1, 2)
    adamw_lr: float = 3e-3
    # The value both AdamW and Gefen default to; the same for every optimizer.
    weight_decay: float = 0.01
    warmup_frac: float = 0.05
    final_lr_frac: float = 0.1
    # Each LR-sweep run: this many epochs on the first ``sweep_seeds`` seeds.
    sweep_epochs: int = 10
    sweep_seeds: int = 1


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    lm: LMConfig
    digits: DigitsConfig | None
    digits_mlp: DigitsConfig | None = None


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset("cpu-default",
               "embedded default: 0.85M-param byte-level Llama (4 layers, d=128, seq 128, "
               "300 steps of 16 windows) + digits CNN and MLP, 3 seeds; CPU, no download",
               LMConfig(), DigitsConfig(),
               # AdamW's LR for the MLP is AdamW's own best on the validation split of
               # {1e-3, 3e-3, 1e-2, 3e-2} at 20 epochs (mean val loss 0.162 / 0.103 / 0.089 /
               # 0.089, seed std 0.002 at 1e-2 against 0.022 at 3e-2); by epoch 20 its
               # held-out loss has levelled off (and rises again by 30). The LR sweep's shared
               # grid is built around it.
               DigitsConfig(model="mlp", hidden=128, epochs=20, adamw_lr=1e-2)),
        Preset("tiny", "smoke test: a few steps of a 2-layer d=32 model",
               LMConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, seq_len=32, batch=4,
                        steps=8, eval_every=4, eval_windows=8, final_eval_windows=16,
                        max_train_bytes=200_000, sweep_steps=4),
               DigitsConfig(channels=4, hidden=16, epochs=1, batch=64, seeds=(0, 1),
                            sweep_epochs=1),
               DigitsConfig(model="mlp", hidden=16, epochs=1, batch=64, seeds=(0, 1),
                            sweep_epochs=1)),
        Preset("h200-small",
               "one GPU: 85M-param byte-level Llama (12 layers, d=768, seq 512), bf16 autocast",
               LMConfig(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                        num_attention_heads=12, num_key_value_heads=4, seq_len=512,
                        batch=32, steps=2000, eval_every=200, eval_windows=128,
                        final_eval_windows=512, adamw_lr=1e-3, autocast_bf16=True,
                        sweep_steps=400),
               DigitsConfig(channels=32, hidden=128, epochs=20),
               DigitsConfig(model="mlp", hidden=128, epochs=20, adamw_lr=1e-2)),
        Preset("h200-1b",
               "one GPU: Llama-3.2-1B-shaped body (16 layers, d=2048, GQA 32/8) on bytes, "
               "bf16 parameters, seq 1024",
               LMConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                        num_attention_heads=32, num_key_value_heads=8, seq_len=1024, batch=8,
                        steps=600, eval_every=100, eval_windows=64, final_eval_windows=256,
                        adamw_lr=3e-4, param_dtype="bfloat16", sweep_steps=150),
               None),
    ]
}


def get_preset(name: str) -> Preset:
    """The preset called ``name``; ValueError listing the presets otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; available: {', '.join(PRESETS)}") from None


def with_overrides(cfg: Any, **overrides: Any) -> Any:
    """``cfg`` with the non-``None`` overrides applied."""
    return replace(cfg, **{k: v for k, v in overrides.items() if v is not None})


def as_dict(cfg: Any) -> dict[str, Any]:
    """JSON-friendly dict of a config dataclass."""
    out = asdict(cfg)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}
