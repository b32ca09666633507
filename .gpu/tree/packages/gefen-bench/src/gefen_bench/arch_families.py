"""Tiny models of each architecture family, built offline from ``transformers`` configs.

Each family function takes a width multiplier ``w`` (1 = the CPU-sized tiny config) and a
seeded ``torch.Generator`` and returns ``(model, batch)``: calling ``model(**batch)`` returns
an object whose ``.loss`` is the scalar training loss for that fixed batch. No weights are
downloaded: every model is initialised from its config.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

Batch = dict[str, torch.Tensor]
Builder = Callable[[int, torch.Generator], tuple[nn.Module, Batch]]

_VOCAB = 128
_SEQ = 16
_BATCH = 2


@dataclass(frozen=True)
class Family:
    """One row of the matrix: a name, its group (dense decoder, MoE, ...) and its builder."""

    name: str
    group: str
    build: Builder


def _extra(**kwargs: Any) -> dict[str, Any]:
    """Generic ``PretrainedConfig`` keywords (typed stubs list only each config's own)."""
    return kwargs


def _tokens(gen: torch.Generator, vocab: int = _VOCAB, seq: int = _SEQ) -> torch.Tensor:
    return torch.randint(0, vocab, (_BATCH, seq), generator=gen)


def _causal_lm(config: Any, cls_name: str, gen: torch.Generator) -> tuple[nn.Module, Batch]:
    import transformers

    model = getattr(transformers, cls_name)(config)
    ids = _tokens(gen)
    return model, {"input_ids": ids, "labels": ids}


def _decoder_kwargs(w: int) -> dict[str, Any]:
    return {"vocab_size": _VOCAB, "hidden_size": 32 * w, "intermediate_size": 64 * w,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 64, "bos_token_id": 1, "eos_token_id": 2,
            "pad_token_id": 0}


def llama(w: int, gen: torch.Generator) -> tuple[nn.Module, Batch]:
    from transformers import LlamaConfig

    return _causal_lm(LlamaConfig(**_decoder_kwargs(w)), "LlamaForCausalLM", gen)


def qwen3(w: int, gen: torch.Generator) -> tuple[nn.Module, Batch]:
    from transformers import Qwen3Config

    return _causal_lm(Qwen3Config(**_decoder_kwargs(w), head_dim=8 * w), "Qwen3ForCausalLM",
                      gen)


def gemma3(w: int, gen: torch.Generator) -> tuple[nn.Module, Batch]:
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(**_decoder_kwargs(w), head_dim=8 * w, sliding_window=8)
    return _causal_lm(config, "Gemma3ForCausalLM", gen)


def mistral(w: int, gen: torch.Generator) -> tuple[nn.Module, Batch]:
    from transformers import MistralConfig

    return _causal_lm(MistralConfig(**_decoder_kwargs(w), sliding_window=8),
                      "MistralForCausalLM", gen)


def phi3(w: int, gen: torch.Generator) -> tuple[nn.Module, Batch]:
    from transformers import Phi3Config

    return _causal_lm(Phi3Config(**_decoder_kwargs(w)), "Phi3ForCausalLM", gen)


def gpt2(w: int, gen: torch.Generator) -> tuple[nn.Module, Batch]:
    from transformers import GPT2Config

    config = GPT2Config(vocab_size=_VOCAB, n_embd=32 * w, n_layer=2, n_head=4, n_positions=64,
                        bos_token_id=1, eos_token_id=2)
    return _causal_lm(config, "GPT2LMHeadModel", gen)


def mixtral(w: int, gen: torch.Generator) -> tuple[nn.Module, Batch]:
    from transformers import MixtralConfig

    config = MixtralConfig(**_decoder_kwargs(w), num_local_experts=4, num_experts_per_tok=2)
    return _causal_lm(config, "MixtralForCausalLM", gen)


def mamba2(w: int, gen: torch.Generator) -> tuple[nn.Module, Batch]:
    from transformers import Mamba2Config

    hidden = 32 * w
    config = Mamba2Config(vocab_size=_VOCAB, hidden_size=hidden, num_hidden_layers=2,
                          expand=2, head_dim=8, num_heads=2 * hidden // 8, n_groups=1,
                          state_size=16, conv_kernel=4, chunk_size=8)
    return _causal_lm(config, "Mamba2ForCausalLM", gen)


def bert(w: int, gen: torch.Generator) -> tuple[nn.Module, Batch]:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=_VOCAB, hidden_size=32 * w, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=64 * w,
                        max_position_embeddings=64)
    ids = _tokens(gen)
    return BertForMaskedLM(config), {"input_ids": ids, "labels": ids}


def t5(w: int, gen: torch.Generator) -> tuple[nn.Module, Batch]:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=_VOCAB, d_model=32 * w, d_kv=8 * w, d_ff=64 * w,
                      num_layers=2, num_decoder_layers=2, num_heads=4,
                      **_extra(decoder_start_token_id=0, pad_token_id=0))
    return T5ForConditionalGeneration(config), {"input_ids": _tokens(gen),
                                                "labels": _tokens(gen, seq=8)}


def whisper(w: int, gen: torch.Generator) -> tuple[nn.Module, Batch]:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    config = WhisperConfig(vocab_size=_VOCAB, num_mel_bins=16, d_model=32 * w,
                           encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                           decoder_attention_heads=4, encoder_ffn_dim=64 * w,
                           decoder_ffn_dim=64 * w, max_source_positions=16,
                           max_target_positions=32, decoder_start_token_id=1, pad_token_id=0,
                           bos_token_id=1, eos_token_id=2)
    features = torch.randn(_BATCH, 16, 32, generator=gen)
    return WhisperForConditionalGeneration(config), {"input_features": features,
                                                     "labels": _tokens(gen, seq=8)}


def _images(gen: torch.Generator, size: int = 32) -> torch.Tensor:
    return torch.randn(_BATCH, 3, size, size, generator=gen)


def _labels(gen: torch.Generator, classes: int = 10) -> torch.Tensor:
    return torch.randint(0, classes, (_BATCH,), generator=gen)


def vit(w: int, gen: torch.Generator) -> tuple[nn.Module, Batch]:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(image_size=32, patch_size=8, hidden_size=32 * w, num_hidden_layers=2,
                       num_attention_heads=4, intermediate_size=64 * w, **_extra(num_labels=10))
    return ViTForImageClassification(config), {"pixel_values": _images(gen),
                                               "labels": _labels(gen)}


def convnext(w: int, gen: torch.Generator) -> tuple[nn.Module, Batch]:
    from transformers import ConvNextConfig, ConvNextForImageClassification

    config = ConvNextConfig(hidden_sizes=[8 * w, 16 * w], depths=[1, 1], num_stages=2,
                            patch_size=4, **_extra(num_labels=10))
    return ConvNextForImageClassification(config), {"pixel_values": _images(gen),
                                                    "labels": _labels(gen)}


def swin(w: int, gen: torch.Generator) -> tuple[nn.Module, Batch]:
    from transformers import SwinConfig, SwinForImageClassification

    config = SwinConfig(image_size=32, patch_size=4, embed_dim=16 * w, depths=[1, 1],
                        num_heads=[2, 4], window_size=4, **_extra(num_labels=10))
    return SwinForImageClassification(config), {"pixel_values": _images(gen),
                                                "labels": _labels(gen)}


def wav2vec2(w: int, gen: torch.Generator) -> tuple[nn.Module, Batch]:
    from transformers import Wav2Vec2Config, Wav2Vec2ForSequenceClassification

    config = Wav2Vec2Config(hidden_size=32 * w, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=64 * w, conv_dim=(16, 16), conv_stride=(5, 2),
                            conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                            num_conv_pos_embedding_groups=4, **_extra(num_labels=4),
                            mask_time_prob=0.0, classifier_proj_size=16)
    audio = torch.randn(_BATCH, 800, generator=gen)
    return Wav2Vec2ForSequenceClassification(config), {"input_values": audio,
                                                       "labels": _labels(gen, 4)}


class _Output:
    def __init__(self, loss: torch.Tensor) -> None:
        self.loss = loss


class Conv3dNet(nn.Module):
    """Video-style classifier whose Conv3d kernels are 5-D parameters ``[out, in, t, h, w]``."""

    def __init__(self, w: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv3d(3, 8 * w, kernel_size=3, padding=1), nn.GELU(),
            nn.Conv3d(8 * w, 8 * w, kernel_size=(2, 3, 3), padding=(0, 1, 1)), nn.GELU(),
            nn.AdaptiveAvgPool3d(1), nn.Flatten(), nn.Linear(8 * w, 10),
        )

    def forward(self, video: torch.Tensor, labels: torch.Tensor) -> _Output:
        return _Output(nn.functional.cross_entropy(self.body(video), labels))


def conv3d(w: int, gen: torch.Generator) -> tuple[nn.Module, Batch]:
    video = torch.randn(_BATCH, 3, 4, 8, 8, generator=gen)
    return Conv3dNet(w), {"video": video, "labels": _labels(gen)}


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in [
        Family("llama", "dense decoder", llama),
        Family("qwen3", "dense decoder", qwen3),
        Family("gemma3", "dense decoder", gemma3),
        Family("mistral", "dense decoder", mistral),
        Family("phi3", "dense decoder", phi3),
        Family("gpt2", "dense decoder", gpt2),
        Family("mixtral", "MoE decoder", mixtral),
        Family("mamba2", "state-space", mamba2),
        Family("bert", "encoder", bert),
        Family("t5", "encoder-decoder", t5),
        Family("whisper", "encoder-decoder (audio)", whisper),
        Family("vit", "vision", vit),
        Family("convnext", "vision", convnext),
        Family("swin", "vision", swin),
        Family("wav2vec2", "audio", wav2vec2),
        Family("conv3d", "5-D parameter", conv3d),
    ]
}
