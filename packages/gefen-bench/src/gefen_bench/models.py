"""Models built offline from configs: the byte-level Llama and the digits CNN."""

from __future__ import annotations

import torch
from torch import nn

from .presets import DigitsConfig, LMConfig

BYTE_VOCAB = 256


def byte_llama(cfg: LMConfig) -> nn.Module:
    """A ``transformers.LlamaForCausalLM`` over bytes (vocabulary 256), untied head.

    Built from a ``LlamaConfig`` (no weights are downloaded); initialisation follows the
    global torch seed.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=BYTE_VOCAB,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.seq_len,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def enable_checkpointing(model: nn.Module) -> None:
    """Non-reentrant activation checkpointing of every decoder layer of a transformers model:
    ``activation_checkpointing_enable`` where transformers has it (5.x, where the older
    ``gradient_checkpointing_enable`` warns that v6 removes it), else the older name."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if callable(enable):
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(  # type: ignore[operator]
            gradient_checkpointing_kwargs={"use_reentrant": False})


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions, a 2x2 max-pool and two linear layers; input ``[N, 1, 8, 8]``."""

    def __init__(self, cfg: DigitsConfig) -> None:
        super().__init__()
        c = cfg.channels
        self.features = nn.Sequential(
            nn.Conv2d(1, c, 3, padding=1), nn.ReLU(),
            nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.hidden = nn.Sequential(nn.Flatten(), nn.Linear(2 * c * 16, cfg.hidden), nn.ReLU())
        # Named "classifier" so Muon-style routing (docs/algorithm.md#hybrid) sends it to the
        # backup.
        self.classifier = nn.Linear(cfg.hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.hidden(self.features(x)))


def warmup_cosine(steps: int, warmup_frac: float, final_frac: float):  # type: ignore[no-untyped-def]
    """LR multiplier for step ``i``: linear warm-up then cosine decay to ``final_frac``."""
    import math

    warmup = max(1, int(round(steps * warmup_frac)))

    def factor(i: int) -> float:
        if i < warmup:
            return (i + 1) / warmup
        t = min(1.0, (i - warmup) / max(1, steps - warmup))
        return final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * t))

    return factor
