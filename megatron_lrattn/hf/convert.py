"""Megatron <-> Hugging Face state dicts: one declarative key map, checked both ways.

Megatron names are those of a TP1PP1 ``LRAttnResGPTModel.state_dict()`` (what a
distributed checkpoint of any layout loads into) built with the local spec; a TE-spec state
dict (norm gains as ``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight``) is
accepted too and ``hf_to_megatron(..., naming="te")`` writes one (``megatron_lrattn.compat.te``).
HF names are those of ``LRAttnForCausalLM``. Layouts:

* ``linear_qkv`` is megatron's per-query-group interleaved [ng * (q_per_group + 2) * hn, d]
  (``q_1..q_g, k, v`` per group); it splits into ``q_proj``/``k_proj``/``v_proj``.
* SwiGLU ``linear_fc1`` is [gate; up] along the output dimension.
* Projected keys stay in ``o_proj``/``down_proj``: their last r output rows emit the key.
* The embedding and untied head of Megatron are padded to a multiple of 128 * TP rows; the
  export keeps the real vocabulary and the import pads with zero rows.

Unknown or missing keys and shapes that do not follow the config raise ``ConversionError``
naming them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from megatron_lrattn.hf.configuration_lrattn import LRAttnConfig
from megatron_lrattn.compat.te import local_to_te_keys, spec_naming, te_to_local_keys


class ConversionError(ValueError):
    """A state dict does not match the key map or the config; the message names the keys."""


@dataclass(frozen=True)
class KeyRule:
    """One Megatron key <-> one or more HF keys.

    Attributes:
        megatron: Megatron key template ({i}: layer index, {j}: read site).
        hf: HF key templates (one, or several for a split).
        kind: ``copy``, ``qkv`` (split/merge the fused QKV), ``glu`` ([gate; up]) or
            ``vocab`` (strip / re-add the vocabulary padding).
        when: the config condition under which the key exists.
    """

    megatron: str
    hf: Tuple[str, ...]
    kind: str = "copy"
    when: Callable[[LRAttnConfig], bool] = lambda c: True


def _has_bias(c):
    return c.add_bias_linear


def _layernorm(c):
    return c.normalization == "LayerNorm"


def _depth(c):
    return c.residual != "standard"


_ATTN, _MLP, _LAYER = "decoder.layers.{i}.self_attention", "decoder.layers.{i}.mlp", "decoder.layers.{i}"
_HATTN, _HMLP, _HLAYER = "model.layers.{i}.self_attn", "model.layers.{i}.mlp", "model.layers.{i}"

LAYER_RULES: Tuple[KeyRule, ...] = (
    KeyRule(f"{_LAYER}.input_layernorm.weight", (f"{_HLAYER}.input_layernorm.weight",)),
    KeyRule(f"{_LAYER}.input_layernorm.bias", (f"{_HLAYER}.input_layernorm.bias",), when=_layernorm),
    KeyRule(f"{_ATTN}.linear_qkv.weight",
            tuple(f"{_HATTN}.{p}_proj.weight" for p in "qkv"), "qkv"),
    KeyRule(f"{_ATTN}.linear_qkv.bias", tuple(f"{_HATTN}.{p}_proj.bias" for p in "qkv"), "qkv",
            when=_has_bias),
    KeyRule(f"{_ATTN}.q_layernorm.weight", (f"{_HATTN}.q_norm.weight",),
            when=lambda c: c.qk_layernorm),
    KeyRule(f"{_ATTN}.q_layernorm.bias", (f"{_HATTN}.q_norm.bias",),
            when=lambda c: c.qk_layernorm and _layernorm(c)),
    KeyRule(f"{_ATTN}.k_layernorm.weight", (f"{_HATTN}.k_norm.weight",),
            when=lambda c: c.qk_layernorm),
    KeyRule(f"{_ATTN}.k_layernorm.bias", (f"{_HATTN}.k_norm.bias",),
            when=lambda c: c.qk_layernorm and _layernorm(c)),
    KeyRule(f"{_ATTN}.linear_proj.weight", (f"{_HATTN}.o_proj.weight",)),
    KeyRule(f"{_ATTN}.linear_proj.bias", (f"{_HATTN}.o_proj.bias",), when=_has_bias),
    KeyRule(f"{_LAYER}.pre_mlp_layernorm.weight", (f"{_HLAYER}.post_attention_layernorm.weight",)),
    KeyRule(f"{_LAYER}.pre_mlp_layernorm.bias", (f"{_HLAYER}.post_attention_layernorm.bias",),
            when=_layernorm),
    KeyRule(f"{_MLP}.linear_fc1.weight", (f"{_HMLP}.gate_proj.weight", f"{_HMLP}.up_proj.weight"),
            "glu", when=lambda c: c.swiglu),
    KeyRule(f"{_MLP}.linear_fc1.bias", (f"{_HMLP}.gate_proj.bias", f"{_HMLP}.up_proj.bias"),
            "glu", when=lambda c: c.swiglu and c.add_bias_linear),
    KeyRule(f"{_MLP}.linear_fc1.weight", (f"{_HMLP}.up_proj.weight",),
            when=lambda c: not c.swiglu),
    KeyRule(f"{_MLP}.linear_fc1.bias", (f"{_HMLP}.up_proj.bias",),
            when=lambda c: not c.swiglu and c.add_bias_linear),
    KeyRule(f"{_MLP}.linear_fc2.weight", (f"{_HMLP}.down_proj.weight",)),
    KeyRule(f"{_MLP}.linear_fc2.bias", (f"{_HMLP}.down_proj.bias",), when=_has_bias),
)

GLOBAL_RULES: Tuple[KeyRule, ...] = (
    KeyRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"),
    KeyRule("embedding.position_embeddings.weight", ("model.embed_positions.weight",),
            when=lambda c: c.position_embedding_type == "learned_absolute"),
    KeyRule("decoder.final_layernorm.weight", ("model.norm.weight",)),
    KeyRule("decoder.final_layernorm.bias", ("model.norm.bias",), when=_layernorm),
    KeyRule("decoder.embedding_key_proj.weight", ("model.embed_key_proj.weight",),
            when=lambda c: c.projected_keys),
    KeyRule("output_layer.weight", ("lm_head.weight",), "vocab",
            when=lambda c: not c.tie_word_embeddings),
)

SITE_RULE = KeyRule("decoder.depth_queries.{j}.weight", ("model.depth_queries.{j}.weight",),
                    when=_depth)


def expanded_rules(config: LRAttnConfig) -> List[KeyRule]:
    """Every rule of ``config`` with layer and site numbers filled in."""
    out = [r for r in GLOBAL_RULES if r.when(config)]
    for i in range(config.num_hidden_layers):
        for r in LAYER_RULES:
            if r.when(config):
                out.append(KeyRule(r.megatron.format(i=i), tuple(h.format(i=i) for h in r.hf),
                                   r.kind))
    if SITE_RULE.when(config):
        for j in range(1, 2 * config.num_hidden_layers + 1):
            out.append(KeyRule(SITE_RULE.megatron.format(j=j),
                               tuple(h.format(j=j) for h in SITE_RULE.hf)))
    return out


def hf_shapes(config: LRAttnConfig) -> Dict[str, Tuple[int, ...]]:
    """Expected shape of every HF tensor for ``config``."""
    c = config
    d, h, hn, L = c.hidden_size, c.intermediate_size, c.head_dim, c.num_hidden_layers
    nq, nkv = c.num_attention_heads * hn, c.num_key_value_heads * hn
    extra = c.key_rank if c.projected_keys else 0
    shapes = {
        "model.embed_tokens.weight": (c.vocab_size, d),
        "model.embed_positions.weight": (c.max_position_embeddings, d),
        "model.norm.weight": (d,), "model.norm.bias": (d,),
        "model.embed_key_proj.weight": (c.key_rank, d),
        "lm_head.weight": (c.vocab_size, d),
    }
    per_layer = {
        "input_layernorm.weight": (d,), "input_layernorm.bias": (d,),
        "post_attention_layernorm.weight": (d,), "post_attention_layernorm.bias": (d,),
        "self_attn.q_proj.weight": (nq, d), "self_attn.q_proj.bias": (nq,),
        "self_attn.k_proj.weight": (nkv, d), "self_attn.k_proj.bias": (nkv,),
        "self_attn.v_proj.weight": (nkv, d), "self_attn.v_proj.bias": (nkv,),
        "self_attn.q_norm.weight": (hn,), "self_attn.q_norm.bias": (hn,),
        "self_attn.k_norm.weight": (hn,), "self_attn.k_norm.bias": (hn,),
        "self_attn.o_proj.weight": (d + extra, nq), "self_attn.o_proj.bias": (d + extra,),
        "mlp.gate_proj.weight": (h, d), "mlp.gate_proj.bias": (h,),
        "mlp.up_proj.weight": (h, d), "mlp.up_proj.bias": (h,),
        "mlp.down_proj.weight": (d + extra, h), "mlp.down_proj.bias": (d + extra,),
    }
    for i in range(L):
        shapes.update({f"model.layers.{i}.{k}": v for k, v in per_layer.items()})
    for j in range(1, 2 * L + 1):
        shapes[f"model.depth_queries.{j}.weight"] = (c.key_rank,)
    return shapes


def _check_keys(given, expected, side: str) -> None:
    missing = sorted(set(expected) - set(given))
    unknown = sorted(set(given) - set(expected))
    parts = []
    if missing:
        parts.append(f"missing {len(missing)} key(s): {', '.join(missing[:6])}"
                     + (" ..." if len(missing) > 6 else ""))
    if unknown:
        parts.append(f"unknown {len(unknown)} key(s): {', '.join(unknown[:6])}"
                     + (" ..." if len(unknown) > 6 else ""))
    if parts:
        raise ConversionError(f"{side} state dict does not match the config: {'; '.join(parts)}")


def _check_shapes(hf_sd: Dict[str, Tensor], config: LRAttnConfig, what: str) -> None:
    shapes = hf_shapes(config)
    for k, t in hf_sd.items():
        if tuple(t.shape) != shapes[k]:
            raise ConversionError(
                f"{what}: {k} has shape {tuple(t.shape)}, the config implies {shapes[k]}")


def _qkv_split(t: Tensor, c: LRAttnConfig) -> List[Tensor]:
    ng, hn = c.num_key_value_heads, c.head_dim
    qpg = c.num_attention_heads // ng
    g = t.reshape(ng, qpg + 2, hn, *t.shape[1:])
    return [g[:, :qpg].reshape(ng * qpg * hn, *t.shape[1:]).clone(),
            g[:, qpg].reshape(ng * hn, *t.shape[1:]).clone(),
            g[:, qpg + 1].reshape(ng * hn, *t.shape[1:]).clone()]


def _qkv_merge(q: Tensor, k: Tensor, v: Tensor, c: LRAttnConfig) -> Tensor:
    ng, hn = c.num_key_value_heads, c.head_dim
    qpg = c.num_attention_heads // ng
    rest = q.shape[1:]
    parts = [q.reshape(ng, qpg, hn, *rest), k.reshape(ng, 1, hn, *rest), v.reshape(ng, 1, hn, *rest)]
    return torch.cat(parts, dim=1).reshape(ng * (qpg + 2) * hn, *rest).contiguous()


def megatron_to_hf(megatron_sd: Dict[str, Tensor], config: LRAttnConfig) -> Dict[str, Tensor]:
    """HF state dict from a TP1PP1 Megatron state dict of the local or the TE spec
    (``_extra_state`` entries ignored).

    Raises:
        ConversionError: unknown/missing keys or shapes not following ``config``.
    """
    try:
        if spec_naming(megatron_sd) == "te":
            megatron_sd = te_to_local_keys(megatron_sd)
    except ValueError as e:
        raise ConversionError(f"Megatron state dict: {e}") from None
    sd = {k: v for k, v in megatron_sd.items() if not k.endswith("._extra_state")}
    rules = expanded_rules(config)
    _check_keys(sd, [r.megatron for r in rules], "Megatron")
    out: Dict[str, Tensor] = {}
    for r in rules:
        t = sd[r.megatron]
        if r.kind == "qkv":
            pieces = _qkv_split(t, config)
        elif r.kind == "glu":
            pieces = [p.clone() for p in torch.chunk(t, 2, dim=0)]
        elif r.kind == "vocab":
            if t.shape[0] < config.vocab_size:
                raise ConversionError(f"Megatron {r.megatron} has {t.shape[0]} rows, fewer than "
                                      f"the vocabulary ({config.vocab_size})")
            pieces = [t[: config.vocab_size].clone()]
        else:
            pieces = [t.clone()]
        if r.kind in ("qkv", "glu") and sum(p.shape[0] for p in pieces) != t.shape[0]:
            raise ConversionError(f"Megatron {r.megatron} has shape {tuple(t.shape)}, which does "
                                  "not split as the config implies")
        out.update(zip(r.hf, pieces))
    _check_shapes(out, config, "Megatron")
    return out


def hf_to_megatron(hf_sd: Dict[str, Tensor], config: LRAttnConfig,
                   padded_vocab: Optional[int] = None, naming: str = "local"
                   ) -> Dict[str, Tensor]:
    """TP1PP1 Megatron state dict from an HF state dict; vocabulary rows padded with zeros
    to ``padded_vocab`` (default: no padding); ``naming`` ``local`` or ``te`` picks the layer
    spec whose ``state_dict()`` names it uses.

    Raises:
        ConversionError: unknown/missing keys or shapes not following ``config``.
    """
    if naming not in ("local", "te"):
        raise ValueError(f"naming={naming!r}; allowed: local, te")
    sd = dict(hf_sd)
    if config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    rules = expanded_rules(config)
    _check_keys(sd, [h for r in rules for h in r.hf], "Hugging Face")
    _check_shapes(sd, config, "Hugging Face")
    padded_vocab = padded_vocab or config.vocab_size
    out: Dict[str, Tensor] = {}
    for r in rules:
        pieces = [sd[h] for h in r.hf]
        if r.kind == "qkv":
            t = _qkv_merge(*pieces, config)
        elif r.kind == "glu":
            t = torch.cat(pieces, dim=0)
        elif r.kind == "vocab":
            t = pieces[0]
            if padded_vocab > t.shape[0]:
                pad = t.new_zeros(padded_vocab - t.shape[0], *t.shape[1:])
                t = torch.cat([t, pad], dim=0)
        else:
            t = pieces[0]
        out[r.megatron] = t.contiguous().clone()
    return local_to_te_keys(out) if naming == "te" else out
