"""Llama interop: a ``--residual standard`` model is a ``LlamaForCausalLM`` when its features
allow it, and a ``LlamaForCausalLM`` folder imports as a standard model.

The state-dict names of a standard ``LRAttnForCausalLM`` are Llama's (``model.embed_tokens``,
``model.layers.{i}.self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``,
``input_layernorm``, ``post_attention_layernorm``, ``model.norm``, ``lm_head``), so only the
config is translated here; the key map of ``megatron_lrattn.hf.convert`` does the rest.

What Llama cannot express (the export refuses it, naming the feature): LayerNorm,
QK-layernorm, a non-gated GELU MLP, learned absolute positions, AttnRes/LR-AttnRes. What our
model cannot express (the import refuses it): RoPE scaling, partial rotary, an activation
other than SiLU, biases on attention but not on the MLP (or the reverse), ``head_dim`` other
than ``hidden_size / heads``, a norm epsilon other than ours, a vocabulary that differs from
the tokenizer's.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from megatron_lrattn.hf.configuration_lrattn import LRAttnConfig

LLAMA_MODEL_TYPE = "llama"
IGNORED_LLAMA_KEYS = ("rotary_emb.inv_freq",)
"""Buffers some older Llama checkpoints store; recomputed from ``rope_theta``."""


def llama_blockers(config: LRAttnConfig) -> List[str]:
    """Features of ``config`` that a ``LlamaForCausalLM`` cannot express (empty: exportable)."""
    out = []
    if config.residual != "standard":
        out.append(f"residual={config.residual} (Llama has the plain residual sum)")
    if config.normalization != "RMSNorm":
        out.append(f"normalization={config.normalization} (Llama uses RMSNorm)")
    if config.qk_layernorm:
        out.append("qk_layernorm (Llama has no query/key norms)")
    if not config.swiglu:
        out.append("a non-gated GELU MLP (Llama's MLP is SwiGLU)")
    if config.position_embedding_type != "rope":
        out.append(f"position_embedding_type={config.position_embedding_type} (Llama uses RoPE)")
    return out


def to_llama_config(config: LRAttnConfig):
    """The ``transformers.LlamaConfig`` of a standard ``config``.

    Raises:
        ValueError: ``llama_blockers(config)`` is not empty (the message names the features).
    """
    from transformers import LlamaConfig

    blockers = llama_blockers(config)
    if blockers:
        raise ValueError("cannot export as Llama: " + "; ".join(blockers))
    c = config
    return LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        hidden_act="silu",
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.norm_eps,
        rope_theta=float(c.rotary_base),
        attention_bias=c.add_bias_linear,
        mlp_bias=c.add_bias_linear,
        attention_dropout=0.0,
        tie_word_embeddings=c.tie_word_embeddings,
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
        pad_token_id=c.pad_token_id,
        initializer_range=c.initializer_range,
        architectures=["LlamaForCausalLM"],
    )


def _rope(raw: Dict[str, Any]) -> tuple:
    """(theta, rope type, partial rotary factor) of a Llama config.json of transformers 4
    (``rope_theta``, ``rope_scaling``) or 5 (``rope_parameters``)."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    return theta, kind, partial


def from_llama_config(raw: Dict[str, Any], norm_eps: float) -> LRAttnConfig:
    """A standard ``LRAttnConfig`` from a Llama ``config.json`` dict.

    Args:
        raw: the parsed ``config.json`` (``model_type: llama``).
        norm_eps: the epsilon every megatron_lrattn model uses (a Llama with another one is
            refused: the logits would differ).

    Raises:
        ValueError: a Llama feature megatron_lrattn cannot express, named in the message.
    """
    d = raw.get("hidden_size", 4096)
    heads = raw.get("num_attention_heads", 32)
    head_dim = raw.get("head_dim") or d // heads
    theta, kind, partial = _rope(raw)
    attn_bias, mlp_bias = bool(raw.get("attention_bias")), bool(raw.get("mlp_bias"))
    problems = []
    if raw.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={raw['hidden_act']} (SwiGLU with SiLU only)")
    if kind != "default":
        problems.append(f"rope type {kind!r} (plain RoPE only; no rope scaling)")
    if partial != 1.0:
        problems.append(f"partial_rotary_factor={partial} (RoPE over the whole head only)")
    if float(theta) != int(theta):
        problems.append(f"rope_theta={theta} is not an integer")
    if attn_bias != mlp_bias:
        problems.append(f"attention_bias={attn_bias} with mlp_bias={mlp_bias} (one switch, "
                        "--disable-bias-linear, covers every linear layer)")
    if head_dim * heads != d:
        problems.append(f"head_dim={head_dim} x heads={heads} != hidden_size={d}")
    eps = raw.get("rms_norm_eps", 1e-6)
    if abs(eps - norm_eps) > 1e-12:
        problems.append(f"rms_norm_eps={eps} (megatron_lrattn models use {norm_eps})")
    if problems:
        raise ValueError("cannot import this Llama: " + "; ".join(problems))
    return LRAttnConfig(
        vocab_size=raw.get("vocab_size", 32000),
        hidden_size=d,
        intermediate_size=raw.get("intermediate_size", 11008),
        num_hidden_layers=raw.get("num_hidden_layers", 32),
        num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        normalization="RMSNorm",
        norm_eps=eps,
        swiglu=True,
        add_bias_linear=attn_bias,
        qk_layernorm=False,
        position_embedding_type="rope",
        rotary_base=int(theta),
        residual="standard",
        key_type="sliced",
        key_rank=None,
        # lrattn-pretrain's default N (recorded even for standard models and checked on load)
        num_blocks=min(8, 2 * raw.get("num_hidden_layers", 32)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=raw.get("eos_token_id"),
        pad_token_id=raw.get("pad_token_id"),
    )


def drop_ignored_keys(sd: Dict[str, Any]) -> Dict[str, Any]:
    """``sd`` without the buffers listed in ``IGNORED_LLAMA_KEYS``."""
    return {k: v for k, v in sd.items() if not k.endswith(IGNORED_LLAMA_KEYS)}


def is_llama(raw: Optional[Dict[str, Any]]) -> bool:
    """True for a Llama ``config.json`` dict."""
    return bool(raw) and raw.get("model_type") == LLAMA_MODEL_TYPE
