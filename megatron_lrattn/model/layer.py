"""Transformer layer whose sub-layer inputs are depth reads instead of a residual sum."""

from __future__ import annotations

from functools import partial
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_layer import TransformerLayer
from torch import Tensor, nn

from megatron_lrattn.depth.schedule import schedule_from_config
from megatron_lrattn.depth.state import DepthState, rms_normalize
from megatron_lrattn.model.norms import apply_norm, fusable_rmsnorm


class DepthQuery(nn.Module):
    """One static depth-read query q ([r]), zero-initialised.

    The parameter has the model's parameter dtype. With ``--bf16`` megatron's optimizer
    keeps an fp32 main copy of it (as of every weight), so small updates accumulate in fp32
    and are not lost to bf16 rounding (a query *stored and updated* in bf16 stalls); the
    depth read computes its logits in fp32 from the query. megatron-core's mixed-precision
    optimizers cannot checkpoint fp32 parameters inside a bf16 model (0.16-0.19: the
    optimizer's sharded state only maps the bf16 groups), so the query is not kept fp32 in
    the model itself.
    """

    def __init__(self, rank: int, sequence_parallel: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(rank, dtype=torch.float32))
        # Replicated across TP ranks; under SP its gradient is a partial sum over the
        # local tokens and Megatron reduces parameters carrying this attribute.
        self.weight.sequence_parallel = sequence_parallel

    def forward(self) -> Tensor:
        """Return the query. Read sites call the module rather than reading ``weight``,
        so module hooks run first: megatron's DDP waits in a forward pre-hook for the
        overlapped all-gather of the parameter's bucket (``--overlap-param-gather``)."""
        return self.weight


class LRAttnResLayer(TransformerLayer):
    """``TransformerLayer`` for ``attnres`` / ``lr_attnres``.

    Layer l (global, 1-based) runs sub-layers 2l-1 (attention) and 2l (MLP). The input of
    its attention is read site 2l-2 (the embedding itself for l = 1) and the input of its
    MLP is read site 2l-1; the layer owns the queries of those two sites. Each sub-layer's
    output (bias added, dropout applied) is added to the ``DepthState`` instead of to a
    residual stream. The layer math is single-device: parallelism comes from the Megatron
    modules inside it and from parameter attributes.
    """

    def __init__(self, config, submodules, *args, **kwargs):
        if not getattr(config, "uses_depth_attention", False):
            raise ValueError(
                "LRAttnResLayer needs an LRAttnResConfig with residual attnres or lr_attnres; "
                "residual standard uses megatron-core's TransformerLayer"
            )
        extra = set(config.recompute_modules or ()) - {"core_attn"}
        if config.recompute_granularity == "selective" and extra:
            raise ValueError(
                f"recompute_modules {sorted(extra)} with depth attention: selective recompute "
                "covers core_attn only (full recompute is the block's, LRAttnResBlock)"
            )
        super().__init__(config, submodules, *args, **kwargs)
        if self.is_moe_layer:
            raise ValueError("MoE MLPs are not supported with depth attention yet")
        self.schedule = schedule_from_config(config)

    def _sublayer_output(self, output_with_bias) -> tuple[Tensor, Optional[Tensor]]:
        out, bias = output_with_bias
        if bias is not None:
            out = out + bias
        out = F.dropout(out, p=self.hidden_dropout, training=self.training)
        if not self.config.projected_keys:
            return out, None
        # the value stays a view with rows d + r apart: the depth kernels take row strides,
        # and a copy to d-wide rows cost 2.2 ms per 0.5b step (H100)
        d = self.config.hidden_size
        value, key = out.split([d, out.shape[-1] - d], dim=-1)
        return value, rms_normalize(key, self.config.key_norm_eps)

    def _read_input(self, depth_state: DepthState, query: Tensor, site: int, norm) -> Tensor:
        # a weighted torch RMSNorm can be applied inside a two-phase merge
        return depth_state.read_normed(query, self.config, site, partial(apply_norm, norm),
                                       partial(fusable_rmsnorm, norm))

    def forward(
        self,
        depth_state: DepthState,
        input_query: Optional[Tensor],
        pre_mlp_query: Tensor,
        attention_mask: Optional[Tensor] = None,
        rotary_pos_emb: Optional[Tensor] = None,
        rotary_pos_cos: Optional[Tensor] = None,
        rotary_pos_sin: Optional[Tensor] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params=None,
    ) -> DepthState:
        """Run attention and MLP on depth reads and add their outputs to ``depth_state``.

        Args:
            depth_state: sources after sub-layer 2l-2; updated in place and returned.
            input_query: query [r] of read site 2l-2 (None for layer 1: its input is the
                embedding).
            pre_mlp_query: query [r] of read site 2l-1.
            attention_mask, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin, attention_bias,
                packed_seq_params: passed to self-attention as in ``TransformerLayer``.

        Returns:
            The same ``DepthState``, now holding the outputs of sub-layers 2l-1 and 2l.
        """
        attn_site = 2 * self.layer_number - 2
        if depth_state.num_sublayers_done != attn_site:
            raise RuntimeError(
                f"layer {self.layer_number} expects the state after sub-layer {attn_site}, "
                f"got one after sub-layer {depth_state.num_sublayers_done}"
            )
        if attn_site == 0:
            x = apply_norm(self.input_layernorm, depth_state.embedding)
        else:
            x = self._read_input(depth_state, input_query, attn_site, self.input_layernorm)
        attn = self.self_attention(
            x,
            attention_mask=attention_mask,
            rotary_pos_emb=rotary_pos_emb,
            rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin,
            attention_bias=attention_bias,
            packed_seq_params=packed_seq_params,
        )
        depth_state.add(*self._sublayer_output(attn), self.schedule.closes_block(attn_site + 1))

        x = self._read_input(depth_state, pre_mlp_query, attn_site + 1, self.pre_mlp_layernorm)
        mlp = self.mlp(x)
        depth_state.add(*self._sublayer_output(mlp), self.schedule.closes_block(attn_site + 2))
        return depth_state
