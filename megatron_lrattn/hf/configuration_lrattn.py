"""Hugging Face configuration of an (LR-)AttnRes decoder exported from megatron_lrattn.

This file is copied into every exported folder and loaded by ``transformers`` with
``trust_remote_code=True``: it imports only ``transformers``.
"""

from transformers import PretrainedConfig

RESIDUAL_MODES = ("standard", "attnres", "lr_attnres")
KEY_TYPES = ("sliced", "projected")


class LRAttnConfig(PretrainedConfig):
    """Configuration of ``LRAttnForCausalLM``.

    Args:
        vocab_size: real vocabulary size (Megatron's padding rows are dropped on export).
        hidden_size: d.
        intermediate_size: FFN width h.
        num_hidden_layers: L.
        num_attention_heads: query heads.
        num_key_value_heads: key/value heads (Megatron's ``num_query_groups``).
        head_dim: per-head width (Megatron's ``kv_channels``); default d / heads.
        max_position_embeddings: longest sequence trained on.
        normalization: ``RMSNorm`` or ``LayerNorm`` (all norms of the model).
        norm_eps: epsilon of every norm.
        swiglu: SwiGLU MLP (gate, up, down) instead of GELU (up, down).
        add_bias_linear: biases on every linear layer.
        qk_layernorm: per-head norms on queries and keys.
        position_embedding_type: ``rope`` or ``learned_absolute``.
        rotary_base: RoPE theta (non-interleaved, rotate-half RoPE over the whole head).
        residual: ``standard``, ``attnres`` or ``lr_attnres``.
        key_type: ``sliced`` or ``projected`` routing keys (``lr_attnres`` only).
        key_rank: key rank r (None for ``standard``; d for ``attnres``).
        num_blocks: depth blocks N.
        key_norm_eps: epsilon of the stateless key RMS normalisation.
        depth_scale: logit scale tau of the depth softmax.
        tie_word_embeddings: the LM head shares the embedding matrix.
    """

    model_type = "lrattn"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]

    def __init__(
        self,
        vocab_size=4096,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=None,
        head_dim=None,
        max_position_embeddings=2048,
        normalization="RMSNorm",
        norm_eps=1e-5,
        swiglu=True,
        add_bias_linear=False,
        qk_layernorm=False,
        position_embedding_type="rope",
        rotary_base=10000,
        residual="lr_attnres",
        key_type="sliced",
        key_rank=None,
        num_blocks=8,
        key_norm_eps=1e-6,
        depth_scale=1.0,
        initializer_range=0.02,
        use_cache=True,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.max_position_embeddings = max_position_embeddings
        self.normalization = normalization
        self.norm_eps = norm_eps
        self.swiglu = swiglu
        self.add_bias_linear = add_bias_linear
        self.qk_layernorm = qk_layernorm
        self.position_embedding_type = position_embedding_type
        self.rotary_base = rotary_base
        self.residual = residual
        self.key_type = key_type
        if key_rank is None and residual == "attnres":
            key_rank = hidden_size
        elif key_rank is None and residual == "lr_attnres":
            key_rank = max(1, hidden_size // 4)
        self.key_rank = key_rank
        self.num_blocks = num_blocks
        self.key_norm_eps = key_norm_eps
        self.depth_scale = depth_scale
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        self.tie_word_embeddings = tie_word_embeddings
        self._validate()
        super().__init__(
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )
        self.tie_word_embeddings = tie_word_embeddings

    def _validate(self):
        def bad(what):
            raise ValueError(f"LRAttnConfig: {what}")

        if self.residual not in RESIDUAL_MODES:
            bad(f"residual={self.residual!r}; allowed: {', '.join(RESIDUAL_MODES)}")
        if self.key_type not in KEY_TYPES:
            bad(f"key_type={self.key_type!r}; allowed: {', '.join(KEY_TYPES)}")
        if self.normalization not in ("RMSNorm", "LayerNorm"):
            bad(f"normalization={self.normalization!r}; allowed: RMSNorm, LayerNorm")
        if self.position_embedding_type not in ("rope", "learned_absolute"):
            bad(f"position_embedding_type={self.position_embedding_type!r}; "
                "allowed: rope, learned_absolute")
        if self.num_attention_heads % self.num_key_value_heads:
            bad(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}")
        if self.residual == "standard":
            if self.key_rank is not None or self.key_type != "sliced":
                bad("key_rank/key_type apply only to residual attnres/lr_attnres")
            return
        if self.residual == "attnres" and (self.key_type != "sliced"
                                           or self.key_rank != self.hidden_size):
            bad("attnres uses sliced keys of rank hidden_size")
        if not 1 <= self.key_rank <= self.hidden_size:
            bad(f"key_rank={self.key_rank} must be in 1..hidden_size ({self.hidden_size})")
        if not 1 <= self.num_blocks <= 2 * self.num_hidden_layers:
            bad(f"num_blocks={self.num_blocks} must be in 1..{2 * self.num_hidden_layers}")

    @property
    def projected_keys(self):
        """True when sub-layers emit projected keys."""
        return self.residual == "lr_attnres" and self.key_type == "projected"
