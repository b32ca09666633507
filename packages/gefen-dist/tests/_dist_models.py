"""Small models and real data shared by the distributed tests (imported by spawned ranks)."""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 256


def text_bytes(n: int = 1 << 14) -> torch.Tensor:
    """``n`` bytes of real text: the Python standard library's ``os.py`` source (ships with
    every Python), as int64 token ids in ``[0, 256)``."""
    with open(os.__file__, "rb") as f:
        data = f.read(n)
    return torch.tensor(list(data), dtype=torch.int64)


def batches(steps: int, batch: int, seq: int, seed: int = 0) -> list[tuple[torch.Tensor, ...]]:
    """Deterministic (input, target) windows of the byte stream, one per step."""
    data = text_bytes()
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen)
        x = torch.stack([data[s:s + seq] for s in starts.tolist()])
        y = torch.stack([data[s + 1:s + seq + 1] for s in starts.tolist()])
        out.append((x, y))
    return out


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyLM(nn.Module):
    """Byte-level decoder: embedding, ``layers`` pre-norm blocks, tied-free head.

    ``extra_rows`` adds a ``[extra_rows, dim]`` parameter (a learned "register" table added
    to the first positions) so tests can put a parameter with fewer rows than ranks (empty
    local shards) or a row count that does not divide evenly (uneven shards) in the model.
    """

    def __init__(self, dim: int = 32, layers: int = 2, heads: int = 2, seq: int = 16,
                 extra_rows: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.registers = nn.Parameter(torch.randn(extra_rows, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos[: x.shape[1]]
        r = self.registers.shape[0]
        h = torch.cat([h[:, :r] + self.registers, h[:, r:]], dim=1)
        for blk in self.blocks:
            h = blk(h)
        return self.head(self.norm(h))


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def make_model(seed: int = 0, **kwargs) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(**kwargs)


ALIGNED_KW = dict(dim=128, layers=1, heads=4, seq=64, extra_rows=4)
"""Every 2-D parameter has ``R % 4 == 0`` and ``2**13 | numel``, so any period the search can
return (a divisor of the numel that is at most 2048, docs/algorithm.md#period-search rule 4) divides
the ``Shard(0)`` chunk on 1, 2 and 4 ranks: the layout never forces a different period."""
ALIGNED_OPT_KW = dict(force_1d_period_one=True, period_one_substrings=("registers",))


def shard(model: nn.Module, **kwargs) -> nn.Module:
    """``fully_shard`` every block, then the root (FSDP2)."""
    from torch.distributed.fsdp import fully_shard

    for blk in model.blocks:
        fully_shard(blk, **kwargs)
    fully_shard(model, **kwargs)
    return model


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as a plain full tensor (collective for DTensors)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        t = p.detach()
        out[name] = (t.full_tensor() if isinstance(t, DTensor) else t).clone().cpu()
    return out


@functools.cache
def gloo_avg_sums(device: str = "cpu") -> bool:
    """Whether this process group's ``reduce_scatter_tensor(op=AVG)`` returns the *sum* for
    tensors on ``device``.

    torch 2.7's gloo backend does (measured: FSDP2 gradients come out ``world`` times the
    single-process gradient), so FSDP2 there does not average over ranks. The probe runs on the
    model's device because a ``"cpu:gloo,cuda:nccl"`` group reduces CUDA gradients with NCCL,
    which averages. Collective: every rank calls it, the first time ``train`` sees an FSDP2
    model.
    """
    import torch.distributed as dist

    world = dist.get_world_size()
    out = torch.empty(1, device=device)
    dist.reduce_scatter_tensor(out, torch.ones(world, device=device), op=dist.ReduceOp.AVG)
    return float(out) == float(world)


def train(model: nn.Module, opt, data, closure_style: bool = False) -> list[float]:
    """Plain steps. Under FSDP2 on a backend whose AVG sums (see :func:`gloo_avg_sums`),
    the gradients are divided by the world size after backward, which completes FSDP2's
    documented averaging exactly (the tests use power-of-two world sizes)."""
    from torch.distributed.fsdp import FSDPModule

    fix = isinstance(model, FSDPModule) and gloo_avg_sums(
        next(model.parameters()).device.type)
    losses = []
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model, x, y)
        loss.backward()
        if fix:
            import torch.distributed as dist

            for p in model.parameters():
                if p.grad is not None:
                    p.grad.div_(dist.get_world_size())
        opt.step()
        losses.append(loss.item())
    return losses


class TinyLlama(nn.Module):
    """A small ``transformers`` Llama (embedding, attention with grouped KV heads, gated MLP,
    RMSNorms, untied head) from a config, returning logits so :func:`lm_loss` and
    :func:`train` drive it like :class:`TinyLM`. Its 64-element RMSNorm weights are the
    tensors whose single-process period (the whole tensor) does not tile two ranks' shards."""

    def __init__(self, layers: int = 1) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64, tie_word_embeddings=False)
        config._attn_implementation = "eager"
        self.llama = LlamaForCausalLM(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.llama(input_ids=x, use_cache=False).logits


def make_llama(seed: int = 0, layers: int = 1) -> TinyLlama:
    torch.manual_seed(seed)
    return TinyLlama(layers)


def shard_llama(model: TinyLlama, **kwargs) -> TinyLlama:
    """``fully_shard`` every decoder layer, then the root (FSDP2)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.llama.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model
