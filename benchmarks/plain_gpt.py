"""A plain PyTorch decoder of a preset's shape: the model a user would write instead of ours.

Token embedding, ``L`` pre-norm layers (RMSNorm, causal SDPA attention with rotary
embeddings and grouped queries, RMSNorm, SwiGLU MLP), final RMSNorm and an untied LM head;
no biases, no dropout. Weights are fp32, the step runs under bf16 autocast with torch's
fused AdamW and gradient clipping at 1.0, and the whole model is ``torch.compile``d: the
setup of a well-tuned single-GPU baseline. Used by ``bench_step.py`` beside our model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class PlainShape:
    """Shape of the plain model (the fields of ``lrattn-pretrain``'s presets)."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    vocab_size: int
    seq_length: int
    rotary_base: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def rotary_tables(shape: PlainShape, device) -> Tuple[Tensor, Tensor]:
    """cos and sin of the rotary angles, [seq, head_dim] in fp32 (rotate-half layout)."""
    half = shape.head_dim // 2
    inv = 1.0 / shape.rotary_base ** (torch.arange(half, device=device, dtype=torch.float32)
                                     / half)
    angles = torch.outer(torch.arange(shape.seq_length, device=device, dtype=torch.float32), inv)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [b, heads, s, hd] rotated by the tables (computed in fp32, returned in x's dtype)."""
    xf = x.float()
    a, b = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat([-b, a], dim=-1) * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, s: PlainShape):
        super().__init__()
        self.s = s
        kv = s.num_query_groups * s.head_dim
        self.qkv = nn.Linear(s.hidden_size, s.hidden_size + 2 * kv, bias=False)
        self.proj = nn.Linear(s.hidden_size, s.hidden_size, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, t, d = x.shape
        s = self.s
        kv = s.num_query_groups * s.head_dim
        q, k, v = self.qkv(x).split([d, kv, kv], dim=-1)
        q = q.view(b, t, s.num_attention_heads, s.head_dim).transpose(1, 2)
        k = k.view(b, t, s.num_query_groups, s.head_dim).transpose(1, 2)
        v = v.view(b, t, s.num_query_groups, s.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=s.num_query_groups != s.num_attention_heads)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class SwiGLU(nn.Module):
    def __init__(self, s: PlainShape):
        super().__init__()
        self.up = nn.Linear(s.hidden_size, 2 * s.ffn_hidden_size, bias=False)
        self.down = nn.Linear(s.ffn_hidden_size, s.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Layer(nn.Module):
    def __init__(self, s: PlainShape):
        super().__init__()
        self.attn_norm = nn.RMSNorm(s.hidden_size, eps=s.norm_eps)
        self.attn = Attention(s)
        self.mlp_norm = nn.RMSNorm(s.hidden_size, eps=s.norm_eps)
        self.mlp = SwiGLU(s)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class PlainGPT(nn.Module):
    """The plain decoder; ``forward(tokens, labels)`` returns the mean cross-entropy loss."""

    def __init__(self, s: PlainShape, init_std: float = 0.02):
        super().__init__()
        self.s = s
        self.embed = nn.Embedding(s.vocab_size, s.hidden_size)
        self.layers = nn.ModuleList(Layer(s) for _ in range(s.num_layers))
        self.norm = nn.RMSNorm(s.hidden_size, eps=s.norm_eps)
        self.head = nn.Linear(s.hidden_size, s.vocab_size, bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=init_std)
        self._tables = None

    def forward(self, tokens: Tensor, labels: Tensor) -> Tensor:
        if self._tables is None or self._tables[0].device != tokens.device:
            self._tables = rotary_tables(self.s, tokens.device)
        cos, sin = self._tables
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))


class PlainTrainer:
    """fp32 weights, bf16 autocast, fused AdamW (decoupled weight decay on matrices only),
    gradient clipping at 1.0 and ``torch.compile`` of the model (``compile=False`` for CPU
    tests)."""

    def __init__(self, shape: PlainShape, device, *, lr: float = 3e-4, weight_decay: float = 0.1,
                 compile: bool = True, seed: int = 1234):
        torch.manual_seed(seed)
        self.model = PlainGPT(shape).to(device)
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        fused = torch.device(device).type == "cuda"
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": weight_decay},
             {"params": no_decay, "weight_decay": 0.0}],
            lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)
        self.forward = torch.compile(self.model) if compile else self.model
        self.autocast = torch.device(device).type == "cuda"

    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def step(self, tokens: Tensor, labels: Tensor) -> Tensor:
        """One optimizer step; returns the loss (a device tensor, not synchronised)."""
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.autocast):
            loss = self.forward(tokens, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()
