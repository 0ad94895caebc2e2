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

Where it can (no context parallelism, no output gate, no QK-norm or an RMSNorm one), the
split of the fused QKV projection into q, k and v joins that kernel as one autograd node
(``split_rotary_to_heads``) with its own backward: megatron's split, the QK-norm and the
rotary embedding forward, and one pass that writes the projection's gradient from the
gradients SDPA returns, in the strides SDPA returns them. Megatron's path instead joins
three gradient slices with a concatenation, and a compiled function's autograd backward
copies each incoming gradient into the layout it traced (at the 1b preset these two copies
were 5.3 ms of a 201 ms step on an H100).
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
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from megatron_lrattn.model.norms import RMSNorm


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
    return rope(t, cos, sin).permute(1, 2, 0, 3)


def rope(t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Megatron's non-interleaved rotary embedding of ``t`` [s, b, heads, hn], same layout
    out (coordinates past the tables' ``rot_dim`` pass through)."""
    cos, sin = cos[: t.shape[0]], sin[: t.shape[0]]
    rot = cos.shape[-1]
    x, x_pass = t[..., :rot], t[..., rot:]
    x1, x2 = torch.chunk(x, 2, dim=-1)
    x = (x * cos) + (torch.cat((-x2, x1), dim=-1) * sin)
    return torch.cat((x, x_pass), dim=-1)


def rope_backward(g: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The gradient of :func:`rope`'s input from its output's ``g`` [s, b, heads, hn]: the
    rotation is linear, ``y = x cos + R x sin`` with ``R x = (-x2, x1)``, so
    ``dx = g cos + R^T (g sin)`` with ``R^T u = (u2, -u1)`` (the terms autograd adds)."""
    cos, sin = cos[: g.shape[0]], sin[: g.shape[0]]
    rot = cos.shape[-1]
    x, x_pass = g[..., :rot], g[..., rot:]
    u1, u2 = torch.chunk(x * sin, 2, dim=-1)
    x = (x * cos) + torch.cat((u2, -u1), dim=-1)
    return torch.cat((x, x_pass), dim=-1)


def rms_norm_backward(g: Tensor, x: Tensor, w: Tensor, eps: float) -> "tuple[Tensor, Tensor]":
    """Gradients of ``F.rms_norm(x, (hn,), w, eps)`` over the last dimension from the
    output's ``g``, computed in fp32: ``dx = r (g w - x^ mean(g w x^))`` with
    ``r = 1 / sqrt(mean(x^2) + eps)`` and ``x^ = x r``; ``dw = sum(g x^)`` over the rows."""
    xf, gf = x.float(), g.float()
    r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    xhat = xf * r
    gw = gf * w.float()
    dx = r * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))
    return dx.to(x.dtype), (gf * xhat).flatten(0, -2).sum(0).to(w.dtype)


def _split_q_k(mixed: Tensor, q_per_group: int) -> "tuple[Tensor, Tensor, int]":
    """q [s, b, ng * q_per_group, hn] and k [s, b, ng, hn] views of the QKV projection's
    output ``mixed`` [s, b, ng, (q_per_group + 2) * hn] (megatron's interleaved layout: a
    query group's q heads, then its k and v head), and hn."""
    s, b, ng, width = mixed.shape
    hn = width // (q_per_group + 2)
    q, k, _ = torch.split(mixed, [q_per_group * hn, hn, hn], dim=3)
    return q.reshape(s, b, ng * q_per_group, hn), k, hn


def split_rotary_forward(mixed: Tensor, q_cos: Tensor, q_sin: Tensor, k_cos: Tensor,
                         k_sin: Tensor, q_per_group: int, q_gain: Optional[Tensor] = None,
                         k_gain: Optional[Tensor] = None, eps: Optional[float] = None
                         ) -> "tuple[Tensor, Tensor]":
    """Megatron's split of the fused QKV projection ``mixed`` [s, b, ng, (q_per_group + 2)
    * hn] into q and k, its RMSNorm QK-norm (gains ``q_gain``, ``k_gain``, when given) and
    the rotary embedding: q [s, b, ng * q_per_group, hn], k [s, b, ng, hn]."""
    q, k, hn = _split_q_k(mixed, q_per_group)
    if q_gain is not None:  # torch.nn.RMSNorm's forward, as megatron calls the norm modules
        q, k = F.rms_norm(q, (hn,), q_gain, eps), F.rms_norm(k, (hn,), k_gain, eps)
    return rope(q, q_cos, q_sin), rope(k, k_cos, k_sin)


def split_rotary_backward(gq: Tensor, gk: Tensor, gv: Tensor, mixed: Optional[Tensor],
                          q_cos: Tensor, q_sin: Tensor, k_cos: Tensor, k_sin: Tensor,
                          q_per_group: int, q_gain: Optional[Tensor] = None,
                          k_gain: Optional[Tensor] = None, eps: Optional[float] = None
                          ) -> "tuple[Tensor, Optional[Tensor], Optional[Tensor]]":
    """The gradient of the QKV projection's output ``mixed`` (written whole, in one pass
    where compiled) and of the QK-norm gains, from the gradients of
    :func:`split_rotary_forward`'s q and k and of v (each [s, b, heads, hn], any strides).
    ``mixed`` is needed only with QK-norm (None without)."""
    s, b, ng = gk.shape[:3]
    gq, gk = rope_backward(gq, q_cos, q_sin), rope_backward(gk, k_cos, k_sin)
    dq_gain = dk_gain = None
    if q_gain is not None:
        q, k, _ = _split_q_k(mixed, q_per_group)
        gq, dq_gain = rms_norm_backward(gq, q, q_gain, eps)
        gk, dk_gain = rms_norm_backward(gk, k, k_gain, eps)
    return torch.cat((gq.reshape(s, b, ng, -1), gk, gv), dim=3), dq_gain, dk_gain


_compiled_rotary = None
_compiled_split = {}  # 'forward' / 'backward' -> the compiled function
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


def _split_rotary_fn(name: str, eager, like: Tensor):
    """``eager`` on CPU and under a Python dispatch mode (as :func:`_rotary`), else its
    ``torch.compile``d kernel."""
    if not like.is_cuda or is_in_torch_dispatch_mode(include_infra_modes=False):
        return eager
    if name not in _compiled_split:
        _compiled_split[name] = torch.compile(eager, fullgraph=True, dynamic=False)
    return _compiled_split[name]


class _SplitRotary(torch.autograd.Function):
    """:func:`split_rotary_forward` and :func:`split_rotary_backward` as one autograd node.

    Its own backward, not autograd's graph of the compiled forward: the gradients SDPA
    returns reach the kernel in the strides SDPA gives them (autograd's compiled backward
    would first copy each into the layout it traced), and the projection's gradient is
    written once instead of three slices joined by a concatenation.
    """

    @staticmethod
    def forward(ctx, mixed, q_cos, q_sin, k_cos, k_sin, q_per_group, q_gain, k_gain, eps):
        fwd = _split_rotary_fn("forward", split_rotary_forward, mixed)
        q, k = fwd(mixed, q_cos, q_sin, k_cos, k_sin, q_per_group, q_gain, k_gain, eps)
        hn = k.shape[-1]
        ctx.q_per_group, ctx.eps = q_per_group, eps
        # mixed is kept only for the QK-norm's backward (the linear layer keeps its input,
        # not its output)
        ctx.save_for_backward(mixed if q_gain is not None else None, q_cos, q_sin, k_cos,
                              k_sin, q_gain, k_gain)
        return q, k, mixed[..., mixed.shape[-1] - hn:]

    @staticmethod
    def backward(ctx, gq, gk, gv):
        mixed, q_cos, q_sin, k_cos, k_sin, q_gain, k_gain = ctx.saved_tensors
        bwd = _split_rotary_fn("backward", split_rotary_backward, gk)
        dmixed, dq_gain, dk_gain = bwd(gq, gk, gv, mixed, q_cos, q_sin, k_cos, k_sin,
                                       ctx.q_per_group, q_gain, k_gain, ctx.eps)
        return dmixed, None, None, None, None, None, dq_gain, dk_gain, None


def split_rotary_to_heads(mixed: Tensor, q_freqs: Tensor, k_freqs: Tensor, q_per_group: int,
                          norms=()) -> "tuple[Tensor, Tensor, Tensor]":
    """q, k and v for SDPA from the QKV projection's output ``mixed`` [s, b, ng,
    (q_per_group + 2) * hn]: megatron's split, its RMSNorm QK-norm (``norms`` = (q gain,
    k gain, eps), or () without) and its rotary embedding of q and k (rotary tensors
    ``q_freqs``, ``k_freqs``), as [b, heads, s, hn] views (v a view of ``mixed``)."""
    tables = _cached_tables(q_freqs, mixed.dtype) + _cached_tables(k_freqs, mixed.dtype)
    q_gain, k_gain, eps = norms if norms else (None, None, None)
    q, k, v = _SplitRotary.apply(mixed, *tables, q_per_group, q_gain, k_gain, eps)
    return q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)


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


# SDPACoreAttention.pending_rotary: the inputs are rotated and in [b, heads, s, hn]
HEADS_LAYOUT = "heads"


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
        # set by RotarySDPASelfAttention for the call it is making: (q_freqs, k_freqs) when
        # the core applies the rotary embedding, or HEADS_LAYOUT when q, k and v come
        # already rotated and in SDPA's [b, heads, s, hn] layout
        self.pending_rotary = None

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias: Optional[Tensor] = None, packed_seq_params=None,
                **unused) -> Tensor:
        """Causal attention; ``attention_mask`` is ignored (the mask is causal). Extra
        keyword arguments newer megatron-core versions pass are accepted and unused."""
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("SDPACoreAttention: packed sequences / attention bias")
        dropout = self.dropout if self.training else 0.0
        if self.pending_rotary is HEADS_LAYOUT:
            b, np_, sq, hn = query.shape
            out = F.scaled_dot_product_attention(
                query, key, value, dropout_p=dropout, is_causal=True, scale=self.softmax_scale,
                enable_gqa=key.shape[1] != np_)
            return out.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)
        sq, b, np_, hn = query.shape
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
        # the QKV split joins the rotary kernel where megatron's split would run as is
        self._split_rotary = (
            rotary_pos_emb if (core.cp_group is None
                               and not getattr(c, "attention_output_gate", False)
                               and not getattr(c, "test_mode", False)
                               and self.num_query_groups_per_partition * self.world_size
                               == c.num_query_groups
                               and self._qk_norm_joins()
                               and all(f is not None and not f.requires_grad
                                       for f in rotary_pos_emb))
            else None)
        core.pending_rotary = HEADS_LAYOUT if self._split_rotary is not None else rotary_pos_emb
        try:
            return super().forward(*args, rotary_pos_emb=None, **kwargs)
        finally:
            core.pending_rotary = None
            self._split_rotary = None

    def _no_qk_norm(self) -> bool:
        return all(n is None or isinstance(n, IdentityOp)
                   for n in (self.q_layernorm, self.k_layernorm))

    def _qk_norm_joins(self) -> bool:
        """No QK-norm, or an RMSNorm one over the head dimension (what the joined node
        implements; any other norm runs megatron's path)."""
        q, k = self.q_layernorm, self.k_layernorm
        return self._no_qk_norm() or (
            type(q) is RMSNorm and type(k) is RMSNorm and q.eps is not None
            and q.eps == k.eps
            and q.normalized_shape == k.normalized_shape == (self.hidden_size_per_attention_head,))

    def _qk_norms(self):
        """() without QK-norm, else (q gain, k gain, eps) of the RMSNorm QK-norm that
        :meth:`_qk_norm_joins` accepted."""
        if self._no_qk_norm():
            return ()
        q, k = self.q_layernorm, self.k_layernorm
        return q(None), k(None), q.eps  # the module call runs its pre-hooks

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, *args,
                                    **kwargs):
        """Megatron's, or, in a call ``forward`` marked for it, q, k and v from one
        :func:`split_rotary_to_heads` (rotated, in SDPA's layout)."""
        freqs = getattr(self, "_split_rotary", None)
        if freqs is None or kwargs.get("split_qkv", True) is False or kwargs.get("output_gate"):
            if freqs is not None:  # the core applies the rotary embedding after all
                self.core_attention.pending_rotary = freqs
            return super().get_query_key_value_tensors(hidden_states, key_value_states,
                                                       *args, **kwargs)
        mixed, _ = self.linear_qkv(hidden_states)
        ng = self.num_query_groups_per_partition
        q_per_group = self.num_attention_heads_per_partition // ng
        mixed = mixed.view(*mixed.shape[:2], ng, -1)
        return split_rotary_to_heads(mixed, freqs[0], freqs[1], q_per_group,
                                    self._qk_norms())
