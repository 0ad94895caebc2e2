"""Core attention on ``torch.nn.functional.scaled_dot_product_attention``.

Megatron's local ``DotProductAttention`` materialises [b * heads, s, s] scores; on GPU this
drop-in replacement calls the fused SDPA kernels instead (causal masks only).

Context parallelism (``context_parallel_size`` C > 1): a rank holds two of the sequence's
2C chunks, i and 2C-1-i (megatron's ``get_batch_on_this_cp_rank``, so every rank does the
same causal work). The core all-gathers K and V across the context-parallel group
(gradients reduce-scattered back in the backward), puts the chunks in sequence order and
attends each local query chunk j to keys [0, (j+1) c) with a lower-right-aligned causal
mask (c = s / 2C): the approach of Llama 3's context parallelism, one collective per layer
and direction, no ring. The depth read is per token and needs no communication.

Without Transformer Engine, megatron-core applies rotary embeddings with unfused ops (a
rotate-half built from two concatenations, then multiplies and an add, each a pass over q
and k, forward and backward). ``RotarySDPASelfAttention`` hands the rotary embedding to its
SDPA core instead, which applies the same formula fused with the layout change for SDPA
(one ``torch.compile``d kernel each way on CUDA; the eager formula, identical to megatron's
op for op, elsewhere). The cos and sin tables are computed once per rotary tensor (that is,
once per sequence length: megatron caches the tensor) instead of in every layer's kernel.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right
from torch.utils._python_dispatch import is_in_torch_dispatch_mode


def rotary_tables(freqs: Tensor, dtype: torch.dtype) -> "tuple[Tensor, Tensor]":
    """cos and sin of megatron's rotary tensor ``freqs`` [s', 1, 1, rot_dim] (fp32), cast to
    ``dtype`` as megatron's ``apply_rotary_pos_emb`` casts them."""
    return torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype)


def rotary_to_heads(t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding of ``t`` [s, b, heads, hn] (megatron's non-interleaved formula),
    returned as [b, heads, s, hn] for SDPA.

    ``cos``, ``sin``: :func:`rotary_tables` of the rotary tensor, [s', 1, 1, rot_dim] with
    s' >= s; coordinates past ``rot_dim`` pass through unrotated.
    """
    cos, sin = cos[: t.shape[0]], sin[: t.shape[0]]
    rot = cos.shape[-1]
    x, x_pass = t[..., :rot], t[..., rot:]
    x1, x2 = torch.chunk(x, 2, dim=-1)
    x = (x * cos) + (torch.cat((-x2, x1), dim=-1) * sin)
    return torch.cat((x, x_pass), dim=-1).permute(1, 2, 0, 3)


_compiled_rotary = None
# The rotary tensor of a sequence length is one tensor for every layer and step
# (megatron's RotaryEmbedding caches it), so its cos and sin are taken once, not in every
# layer's kernel: (freqs, dtype) -> (freqs, cos, sin); freqs is held so that its storage
# cannot be reused by another tensor while the entry exists.
_TABLES: dict = {}


def _cached_tables(freqs: Tensor, dtype: torch.dtype) -> "tuple[Tensor, Tensor]":
    key = (freqs.data_ptr(), tuple(freqs.shape), freqs.device, dtype, freqs._version)
    hit = _TABLES.get(key)
    if hit is not None and hit[0] is freqs:
        return hit[1], hit[2]
    if len(_TABLES) >= 16:
        _TABLES.clear()
    cos, sin = rotary_tables(freqs, dtype)
    _TABLES[key] = (freqs, cos, sin)
    return cos, sin


def _rotary(t: Tensor, freqs: Tensor) -> Tensor:
    global _compiled_rotary
    if freqs.requires_grad:  # never in megatron's models; keep the gradient path exact
        return rotary_to_heads(t, *rotary_tables(freqs, t.dtype))
    cos, sin = _cached_tables(freqs, t.dtype)
    # eager on CPU, and under a Python dispatch mode (a FLOP counter, a tensor tracer):
    # torch.compile cannot run there, and a frame it had to skip may stay eager afterwards
    if not t.is_cuda or is_in_torch_dispatch_mode(include_infra_modes=False):
        return rotary_to_heads(t, cos, sin)
    if _compiled_rotary is None:
        _compiled_rotary = torch.compile(rotary_to_heads, fullgraph=True, dynamic=False)
    return _compiled_rotary(t, cos, sin)


def cp_chunk_order(cp: int) -> Tensor:
    """Where each sequence chunk lies in the all-gathered K/V of a context-parallel group
    of ``cp`` ranks: rank i contributes chunks (i, 2cp-1-i), so the gathered chunk order is
    0, 2cp-1, 1, 2cp-2, ...; entry j of the result is the gathered position of chunk j."""
    gathered = [c for i in range(cp) for c in (i, 2 * cp - 1 - i)]
    return torch.tensor([gathered.index(j) for j in range(2 * cp)])


@functools.lru_cache(maxsize=None)
def _chunk_order_on(cp: int, device: torch.device) -> Tensor:
    # built once per group size and device, not per layer call (a host-to-device copy)
    return cp_chunk_order(cp).to(device)


def context_parallel_attention(q: Tensor, k: Tensor, v: Tensor, group, *, dropout_p: float,
                               scale: Optional[float]) -> Tensor:
    """Causal attention of this rank's two query chunks against the whole sequence.

    Args:
        q: [b, np, s_local, hn], the local chunks (i, 2C-1-i) of the sequence.
        k, v: [s_local, b, ng, hn] local keys (rotary applied) and values.
        group: the context-parallel process group (C ranks).
        dropout_p, scale: as for SDPA.

    Returns:
        [b, np, s_local, hn], the output for the local chunks in their local order.
    """
    cp, rank = group.size(), group.rank()
    c = q.shape[2] // 2
    order = _chunk_order_on(cp, k.device)

    def gather(t: Tensor) -> Tensor:
        # [C s_local, b, ng, hn] in the gathered order -> sequence order, as [b, ng, s, hn]
        full = gather_from_sequence_parallel_region(t.contiguous(), True, group)
        full = full.view(2 * cp, c, *full.shape[1:]).index_select(0, order)
        full = full.flatten(0, 1).permute(1, 2, 0, 3)
        if full.shape[1] != q.shape[1]:
            # grouped-query attention: SDPA's lower-right causal path takes equal head counts
            full = full.repeat_interleave(q.shape[1] // full.shape[1], dim=1)
        return full

    k_full, v_full = gather(k), gather(v)
    outs = []
    for half, chunk in enumerate((rank, 2 * cp - 1 - rank)):
        end = (chunk + 1) * c
        qs = q[:, :, half * c:(half + 1) * c]
        outs.append(F.scaled_dot_product_attention(
            qs, k_full[:, :, :end], v_full[:, :, :end], attn_mask=causal_lower_right(c, end),
            dropout_p=dropout_p, scale=scale))
    return torch.cat(outs, dim=2)


class SDPACoreAttention(MegatronModule):
    """Causal self-attention core with the constructor and call of ``DotProductAttention``.

    Inputs query [sq, b, np, hn], key/value [sk, b, ng, hn] (grouped-query attention is
    handled by SDPA); output [sq, b, np * hn]. With context parallelism the inputs are this
    rank's two sequence chunks and K/V are all-gathered (module docstring).
    """

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                 pg_collection=None):
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"SDPACoreAttention supports causal masks only, got {attn_mask_type}")
        self.cp_group = (parallel_state.get_context_parallel_group()
                         if config.context_parallel_size > 1 else None)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale
        # (q_freqs, k_freqs) set by RotarySDPASelfAttention for the call it is making
        self.pending_rotary = None

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias: Optional[Tensor] = None, packed_seq_params=None,
                **unused) -> Tensor:
        """Causal attention; ``attention_mask`` is ignored (the mask is causal). Extra
        keyword arguments newer megatron-core versions pass are accepted and unused."""
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("SDPACoreAttention: packed sequences / attention bias")
        sq, b, np_, hn = query.shape
        dropout = self.dropout if self.training else 0.0
        if self.pending_rotary is not None:
            q_freqs, k_freqs = self.pending_rotary
            q, k = _rotary(query, q_freqs), _rotary(key, k_freqs)
        else:
            q, k = query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3)
        if self.cp_group is not None:
            out = context_parallel_attention(q, k.permute(2, 0, 1, 3), value, self.cp_group,
                                             dropout_p=dropout, scale=self.softmax_scale)
            return out.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)
        v = value.permute(1, 2, 0, 3)  # [b, heads, s, hn]
        out = F.scaled_dot_product_attention(
            q, k, v,
            dropout_p=dropout,
            is_causal=True,
            scale=self.softmax_scale,
            enable_gqa=k.shape[1] != q.shape[1],
        )
        return out.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)


class RotarySDPASelfAttention(SelfAttention):
    """``SelfAttention`` whose SDPA core applies the rotary embedding (fused, see the module
    docstring). Any call the core cannot take over (packed sequences, inference, interleaved
    settings) runs megatron's own path. Under context parallelism megatron's rotary
    embedding already holds this rank's chunks of positions, so the fused path applies.

    Selective recompute (``recompute_granularity='selective'``, core attention) is a no-op
    here: megatron would rerun the core in the backward to avoid storing its [b * heads, s,
    s] probabilities, but flash SDPA stores none (only q, k, v, its output, which the output
    projection saves anyway, and an fp32 log-sum-exp per row), so the rerun would cost a
    forward and save nothing.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.checkpoint_core_attention = False

    def forward(self, *args, rotary_pos_emb=None, **kwargs):
        core = self.core_attention
        c = self.config
        fusable = (rotary_pos_emb is not None and isinstance(core, SDPACoreAttention)
                   and kwargs.get("packed_seq_params") is None
                   and kwargs.get("inference_context") is None
                   and kwargs.get("inference_params") is None
                   and not getattr(c, "rotary_interleaved", False)
                   and not (self.checkpoint_core_attention and self.training)
                   and getattr(self, "_yarn_concentration_factor", 1.0) in (None, 1.0))
        if not fusable:
            return super().forward(*args, rotary_pos_emb=rotary_pos_emb, **kwargs)
        if not isinstance(rotary_pos_emb, tuple):
            rotary_pos_emb = (rotary_pos_emb, rotary_pos_emb)
        core.pending_rotary = rotary_pos_emb
        try:
            return super().forward(*args, rotary_pos_emb=None, **kwargs)
        finally:
            core.pending_rotary = None
