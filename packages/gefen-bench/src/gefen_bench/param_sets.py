"""Parameter sets built from model shapes alone (no download, no model code).

* ``gpt2``: GPT-2 small (124,439,808 parameters in 148 tensors; the LM head is tied to
  ``wte`` so it adds no tensor). Linear weights use GPT-2's ``Conv1D`` layout ``[in, out]``.
* ``llama``: Llama-3.2-1B with an *untied* ``lm_head`` (1,498,482,688 parameters in 147
  tensors; vocabulary 128256, hidden 2048, 16 layers, MLP 8192, 32 query / 8 key-value heads
  of 64). Linear weights use ``nn.Linear``'s ``[out, in]`` layout.
* ``llama-lora``: the trainable part of Llama-3.2-1B with rank-16 LoRA adapters on every
  attention and MLP projection, the base frozen (11,272,192 parameters in 224 tensors: per
  projection ``lora_A`` ``[16, in]`` and ``lora_B`` ``[out, 16]``, PEFT's names and layouts).
* ``square4096``: one ``[4096, 4096]`` matrix (the CPU step's large-tensor case).
* ``small64x256``: 64 ``[256, 256]`` matrices (the CPU step's many-small-tensors case).

``scale="tiny"`` keeps each set's tensor structure (same names, count and ranks) with small
dimensions, for CPU tests.
"""

from __future__ import annotations

import torch

Shapes = list[tuple[str, tuple[int, ...]]]

MODELS = ("gpt2", "llama", "llama-lora", "square4096", "small64x256")
SCALES = ("full", "tiny")


def gpt2_shapes(vocab: int = 50257, positions: int = 1024, d: int = 768,
                layers: int = 12) -> Shapes:
    """GPT-2 parameter names and shapes (tied head)."""
    shapes: Shapes = [("transformer.wte.weight", (vocab, d)),
                      ("transformer.wpe.weight", (positions, d))]
    for i in range(layers):
        h = f"transformer.h.{i}"
        shapes += [
            (f"{h}.ln_1.weight", (d,)), (f"{h}.ln_1.bias", (d,)),
            (f"{h}.attn.c_attn.weight", (d, 3 * d)), (f"{h}.attn.c_attn.bias", (3 * d,)),
            (f"{h}.attn.c_proj.weight", (d, d)), (f"{h}.attn.c_proj.bias", (d,)),
            (f"{h}.ln_2.weight", (d,)), (f"{h}.ln_2.bias", (d,)),
            (f"{h}.mlp.c_fc.weight", (d, 4 * d)), (f"{h}.mlp.c_fc.bias", (4 * d,)),
            (f"{h}.mlp.c_proj.weight", (4 * d, d)), (f"{h}.mlp.c_proj.bias", (d,)),
        ]
    shapes += [("transformer.ln_f.weight", (d,)), ("transformer.ln_f.bias", (d,))]
    return shapes


def llama_shapes(vocab: int = 128256, d: int = 2048, layers: int = 16, mlp: int = 8192,
                 heads: int = 32, kv_heads: int = 8, head_dim: int = 64) -> Shapes:
    """Llama parameter names and shapes with an untied ``lm_head``."""
    q, kv = heads * head_dim, kv_heads * head_dim
    shapes: Shapes = [("model.embed_tokens.weight", (vocab, d))]
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes += [
            (f"{p}.self_attn.q_proj.weight", (q, d)), (f"{p}.self_attn.k_proj.weight", (kv, d)),
            (f"{p}.self_attn.v_proj.weight", (kv, d)), (f"{p}.self_attn.o_proj.weight", (d, q)),
            (f"{p}.mlp.gate_proj.weight", (mlp, d)), (f"{p}.mlp.up_proj.weight", (mlp, d)),
            (f"{p}.mlp.down_proj.weight", (d, mlp)),
            (f"{p}.input_layernorm.weight", (d,)),
            (f"{p}.post_attention_layernorm.weight", (d,)),
        ]
    shapes += [("model.norm.weight", (d,)), ("lm_head.weight", (vocab, d))]
    return shapes


def lora_shapes(base: Shapes, rank: int = 16) -> Shapes:
    """The adapters of ``base``'s attention and MLP projections (``[out, in]`` weights): per
    projection ``lora_A`` ``[rank, in]`` and ``lora_B`` ``[out, rank]``, the tensors an
    optimizer steps when the base model is frozen."""
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    shapes: Shapes = []
    for name, shape in base:
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.rpartition(".")[2] in projections:
            out_features, in_features = shape
            shapes += [(f"{module}.lora_A.weight", (rank, in_features)),
                       (f"{module}.lora_B.weight", (out_features, rank))]
    return shapes


def shapes_for(model: str, scale: str = "full") -> Shapes:
    """Shapes of ``model`` (one of :data:`MODELS`) at ``scale`` (``"full"`` or ``"tiny"``).

    Raises:
        ValueError: unknown model or scale (the message lists the valid ones).
    """
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; available: {', '.join(MODELS)}")
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; available: {', '.join(SCALES)}")
    if model == "gpt2":
        return gpt2_shapes() if scale == "full" else gpt2_shapes(512, 64, 64, 2)
    if model == "square4096":
        side = 4096 if scale == "full" else 128
        return [("square.weight", (side, side))]
    if model == "small64x256":
        side = 256 if scale == "full" else 16
        return [(f"small.{i}.weight", (side, side)) for i in range(64)]
    llama = llama_shapes() if scale == "full" else llama_shapes(512, 64, 2, 256, 4, 2, 16)
    if model == "llama-lora":
        return lora_shapes(llama, rank=16 if scale == "full" else 4)
    return llama


def numel(shapes: Shapes) -> int:
    """Total number of elements."""
    total = 0
    for _, shape in shapes:
        n = 1
        for s in shape:
            n *= s
        total += n
    return total


def build_param_set(shapes: Shapes, *, device: torch.device, dtype: torch.dtype,
                    seed: int = 0) -> list[tuple[str, torch.nn.Parameter]]:
    """Named parameters with random-normal values and random-normal ``.grad`` of ``dtype``.

    Values are generated on ``device`` tensor by tensor (no full-size host copy).
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    named: list[tuple[str, torch.nn.Parameter]] = []
    for name, shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, device=device, dtype=dtype, generator=gen))
        p.grad = torch.randn(shape, device=device, dtype=dtype, generator=gen)
        named.append((name, p))
    return named
