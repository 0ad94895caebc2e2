"""Core attention on ``torch.nn.functional.scaled_dot_product_attention``.

Megatron's local ``DotProductAttention`` materialises [b * heads, s, s] scores; on GPU this
drop-in replacement calls the fused SDPA kernels instead (causal masks only).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from torch import Tensor


class SDPACoreAttention(MegatronModule):
    """Causal self-attention core with the constructor and call of ``DotProductAttention``.

    Inputs query [sq, b, np, hn], key/value [sk, b, ng, hn] (grouped-query attention is
    handled by SDPA); output [sq, b, np * hn].
    """

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                 pg_collection=None):
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"SDPACoreAttention supports causal masks only, got {attn_mask_type}")
        if config.context_parallel_size > 1:
            raise ValueError("SDPACoreAttention does not support context parallelism")
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias: Optional[Tensor] = None, packed_seq_params=None,
                **unused) -> Tensor:
        """Causal attention; ``attention_mask`` is ignored (the mask is causal). Extra
        keyword arguments newer megatron-core versions pass are accepted and unused."""
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("SDPACoreAttention: packed sequences / attention bias")
        sq, b, np_, hn = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
        out = F.scaled_dot_product_attention(
            q, k, v,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=True,
            scale=self.softmax_scale,
            enable_gqa=k.shape[1] != q.shape[1],
        )
        return out.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)
