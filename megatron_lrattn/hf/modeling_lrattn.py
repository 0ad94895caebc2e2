"""Plain-PyTorch (LR-)AttnRes decoder for Hugging Face ``transformers``.

This file is copied into every exported folder and loaded with ``trust_remote_code=True``:
it imports only ``torch`` and ``transformers``. The math follows megatron_lrattn exactly
(docs/design.md): every sub-layer input is a depth read

    s_i = tau * <q, RMS_r(k_i)>,   a = softmax_i(s) (fp32),   x = sum_i a_i v_i

over the embedding, completed block sums and the running partial block sum; keys are the
last r coordinates of each source (``sliced``) or r extra output rows of the attention and
MLP output projections, RMS-normalised when emitted (``projected``). ``standard`` is the
plain PreNorm residual sum. Depth routing is per token, so only per-layer attention keys
and values are cached for generation.
"""


import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.generation import GenerationMixin
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_lrattn import LRAttnConfig

try:  # the fused Triton read when megatron_lrattn is installed (used on CUDA only)
    from megatron_lrattn.ops import depth_read as _fused_depth_read
except ImportError:
    _fused_depth_read = None

_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def block_ends(num_layers, num_blocks):
    """Sub-layers (1..2L) that close a depth block: ceil(2L k / N) for k = 1..N."""
    total = 2 * num_layers
    return frozenset(-((-total * k) // num_blocks) for k in range(1, num_blocks + 1))


def rms_normalize(x, eps):
    """Stateless RMS normalisation over the last dimension, computed in fp32."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def depth_read_reference(values, query, keys=None, eps=1e-6, scale=1.0):
    """Softmax over depth sources (the reference math of ``megatron_lrattn.ops``).

    Args:
        values: S tensors [..., d] of one dtype.
        query: [r] fp32 query.
        keys: None (sliced: ``values[i][..., -r:]``) or S tensors [..., r].
        eps, scale: key-RMS epsilon and logit scale tau.

    Returns:
        [..., d] in the values' dtype; statistics, softmax and accumulation in fp32.
    """
    r = query.shape[-1]
    if keys is None:
        keys = [v[..., -r:] for v in values]
    acc = torch.promote_types(values[0].dtype, torch.float32)
    q = query.to(acc)
    logits = []
    for k in keys:
        kf = k.to(acc)
        kf = kf * torch.rsqrt(kf.pow(2).mean(-1, keepdim=True) + eps)
        logits.append(scale * (kf @ q))
    probs = torch.softmax(torch.stack(logits), dim=0)
    out = torch.zeros(values[0].shape, dtype=acc, device=values[0].device)
    for a, v in zip(probs, values):
        out.addcmul_(a.unsqueeze(-1), v)
    return out.to(values[0].dtype)


def depth_read(values, query, keys, eps, scale):
    """The fused op on CUDA when megatron_lrattn is importable, else the reference."""
    if _fused_depth_read is not None and values[0].is_cuda:
        return _fused_depth_read(values, query, keys, eps=eps, scale=scale)
    return depth_read_reference(values, query, keys, eps=eps, scale=scale)


class DepthState:
    """Depth sources of one forward call: embedding, completed blocks, partial sum (+ keys)."""

    def __init__(self, embedding, embedding_key, ends):
        self.values, self.keys = [embedding], ([embedding_key] if embedding_key is not None else None)
        self.partial = self.partial_key = None
        self.done, self.ends = 0, ends

    def add(self, value, key):
        """Add one sub-layer output (and its normalised key) to the current block.

        Sources keep the embedding's dtype (the parameters' dtype, as a residual stream does):
        under autocast the sub-layers return bf16 while an fp32 model's embedding is fp32,
        and one read takes sources of one dtype.
        """
        value = value.to(self.values[0].dtype)
        if key is not None and self.keys is not None:
            key = key.to(self.keys[0].dtype)
        self.partial = value if self.partial is None else self.partial + value
        if key is not None:
            self.partial_key = key if self.partial_key is None else self.partial_key + key
        self.done += 1
        if self.done in self.ends:
            self.values.append(self.partial)
            if self.keys is not None:
                self.keys.append(self.partial_key)
            self.partial = self.partial_key = None

    def read(self, query, config):
        """Depth read of the current sources."""
        values, keys = list(self.values), None if self.keys is None else list(self.keys)
        if self.partial is not None:
            values.append(self.partial)
            if keys is not None:
                keys.append(self.partial_key)
        return depth_read(values, query, keys, config.key_norm_eps, config.depth_scale)


class DepthQuery(nn.Module):
    """One static query [r]; kept fp32 whatever dtype the model is cast to, unless
    ``keep_fp32`` is set to False (DeepSpeed ZeRO-3 holds every parameter in one flat buffer
    of one dtype; its fp32 master copy then keeps the updates exact)."""

    keep_fp32 = True

    def __init__(self, rank):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(rank, dtype=torch.float32))

    def _apply(self, fn, recurse=True):
        if not self.keep_fp32:
            return super()._apply(fn, recurse)
        return super()._apply(lambda t: fn(t).float() if t.is_floating_point() else fn(t), recurse)


def make_norm(config, width):
    """RMSNorm or LayerNorm (torch modules, as in megatron-core's local spec)."""
    if config.normalization == "RMSNorm":
        return nn.RMSNorm(width, eps=config.norm_eps)
    return nn.LayerNorm(width, eps=config.norm_eps)


def rotate_half(x):
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_cos_sin(position_ids, head_dim, base, dtype):
    """cos, sin [b, 1, t, hn] exactly as megatron-core computes them (fp32 frequencies)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32,
                                            device=position_ids.device) / head_dim))
    freqs = position_ids.to(torch.float32).unsqueeze(-1) * inv_freq  # [b, t, hn/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    return torch.cos(emb).to(dtype), torch.sin(emb).to(dtype)


class LRAttnAttention(nn.Module):
    """GQA self-attention (SDPA) with optional QK norms and RoPE; o_proj emits d (+ r key rows)."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        d, hn = config.hidden_size, config.head_dim
        self.nh, self.nkv, self.hn = config.num_attention_heads, config.num_key_value_heads, hn
        bias = config.add_bias_linear
        self.q_proj = nn.Linear(d, self.nh * hn, bias=bias)
        self.k_proj = nn.Linear(d, self.nkv * hn, bias=bias)
        self.v_proj = nn.Linear(d, self.nkv * hn, bias=bias)
        extra = config.key_rank if config.projected_keys else 0
        self.o_proj = nn.Linear(self.nh * hn, d + extra, bias=bias)
        if config.qk_layernorm:
            self.q_norm = make_norm(config, hn)
            self.k_norm = make_norm(config, hn)

    def forward(self, x, cos_sin, cache, mask):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.nh, self.hn)
        k = self.k_proj(x).view(b, t, self.nkv, self.hn)
        v = self.v_proj(x).view(b, t, self.nkv, self.hn)
        if self.config.qk_layernorm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (y.transpose(1, 2) for y in (q, k, v))  # [b, heads, t, hn]
        if cos_sin is not None:
            cos, sin = cos_sin
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        if self.nkv != self.nh:
            rep = self.nh // self.nkv
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=t > 1)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.nh * self.hn))


class LRAttnMLP(nn.Module):
    """SwiGLU (silu(gate) * up) or GELU MLP; down_proj emits d (+ r key rows)."""

    def __init__(self, config):
        super().__init__()
        self.swiglu = config.swiglu
        d, h, bias = config.hidden_size, config.intermediate_size, config.add_bias_linear
        if self.swiglu:
            self.gate_proj = nn.Linear(d, h, bias=bias)
        self.up_proj = nn.Linear(d, h, bias=bias)
        extra = config.key_rank if config.projected_keys else 0
        self.down_proj = nn.Linear(h, d + extra, bias=bias)

    def forward(self, x):
        if self.swiglu:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(F.gelu(self.up_proj(x)))


class LRAttnDecoderLayer(nn.Module):
    """PreNorm attention and MLP; the caller supplies the inputs (depth reads or residual)."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.input_layernorm = make_norm(config, config.hidden_size)
        self.self_attn = LRAttnAttention(config, layer_idx)
        self.post_attention_layernorm = make_norm(config, config.hidden_size)
        self.mlp = LRAttnMLP(config)


class LRAttnPreTrainedModel(PreTrainedModel):
    """Weight init and ``transformers`` plumbing shared by the base and LM-head models."""

    config_class = LRAttnConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["LRAttnDecoderLayer"]
    _keep_in_fp32_modules = ["depth_queries"]
    _keep_in_fp32_modules_strict = ["depth_queries"]
    _supports_sdpa = True
    _supports_cache_class = True

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=std)
        elif isinstance(module, (nn.RMSNorm, nn.LayerNorm)):
            nn.init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, DepthQuery):
            nn.init.zeros_(module.weight)


class LRAttnModel(LRAttnPreTrainedModel):
    """The decoder without the LM head; returns the final-normed hidden states."""

    def __init__(self, config):
        super().__init__(config)
        d, L = config.hidden_size, config.num_hidden_layers
        self.embed_tokens = nn.Embedding(config.vocab_size, d)
        if config.position_embedding_type == "learned_absolute":
            self.embed_positions = nn.Embedding(config.max_position_embeddings, d)
        self.layers = nn.ModuleList(LRAttnDecoderLayer(config, i) for i in range(L))
        self.norm = make_norm(config, d)
        if config.residual != "standard":
            self.depth_queries = nn.ModuleDict(
                {str(j): DepthQuery(config.key_rank) for j in range(1, 2 * L + 1)})
            if config.projected_keys:
                self.embed_key_proj = nn.Linear(d, config.key_rank, bias=False)
            self._ends = block_ends(L, config.num_blocks)
        self.post_init()

    def _split(self, out):
        """(value, normalised key) of a sub-layer output; key None unless projected."""
        if not self.config.projected_keys:
            return out, None
        d = self.config.hidden_size
        return out[..., :d], rms_normalize(out[..., d:], self.config.key_norm_eps)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
                inputs_embeds=None, use_cache=None, **kwargs):
        """Hidden states [b, t, d] after the final norm, and the updated cache."""
        cfg = self.config
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        b, t, _ = inputs_embeds.shape
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            if attention_mask is not None and attention_mask.dim() == 2:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -t:]
            else:
                position_ids = torch.arange(past, past + t, device=inputs_embeds.device)[None]
            position_ids = position_ids.expand(b, t)
        x = inputs_embeds
        cos_sin = None
        if cfg.position_embedding_type == "learned_absolute":
            x = x + self.embed_positions(position_ids)
        else:
            cos_sin = rope_cos_sin(position_ids, cfg.head_dim, cfg.rotary_base, x.dtype)
        mask = self._mask(attention_mask, b, t, past, x.device)

        if cfg.residual == "standard":
            h = x
            for layer in self.layers:
                h = h + layer.self_attn(layer.input_layernorm(h), cos_sin, cache, mask)
                h = h + layer.mlp(layer.post_attention_layernorm(h))
            return self.norm(h), cache

        q = self.depth_queries
        key0 = rms_normalize(self.embed_key_proj(x), cfg.key_norm_eps) if cfg.projected_keys else None
        state = DepthState(x, key0, self._ends)
        for i, layer in enumerate(self.layers):
            inp = x if i == 0 else state.read(q[str(2 * i)].weight, cfg)
            state.add(*self._split(layer.self_attn(layer.input_layernorm(inp), cos_sin, cache, mask)))
            inp = state.read(q[str(2 * i + 1)].weight, cfg)
            state.add(*self._split(layer.mlp(layer.post_attention_layernorm(inp))))
        return self.norm(state.read(q[str(2 * cfg.num_hidden_layers)].weight, cfg)), cache

    @staticmethod
    def _mask(attention_mask, b, t, past, device):
        """Boolean [b, 1, t, past + t] mask, or None when plain causal attention suffices."""
        if attention_mask is not None and attention_mask.dim() == 4:
            return attention_mask.bool()
        padded = attention_mask is not None and not bool(attention_mask.all())
        if not padded and (past == 0 or t == 1):
            return None
        i = torch.arange(t, device=device)[:, None] + past
        j = torch.arange(past + t, device=device)[None]
        allowed = (j <= i)[None, None].expand(b, 1, t, past + t)
        if padded:
            keep = attention_mask[:, None, None, -(past + t):].bool()
            allowed = (allowed & keep) | (j == i)[None, None]
        return allowed


class LRAttnForCausalLM(LRAttnPreTrainedModel, GenerationMixin):
    """``LRAttnModel`` plus the LM head; ``generate()`` uses a ``DynamicCache``."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config):
        super().__init__(config)
        self.model = LRAttnModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0,
                past_key_values=None, **kwargs):
        """Logits [b, t, V] (loss when ``labels`` are given) and the cache.

        ``cache`` (transformers >= 5.x) and ``past_key_values`` (older) name the same
        ``Cache`` object.
        """
        cache = cache if cache is not None else past_key_values
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache()
        if not use_cache:
            cache = None
        hidden, cache = self.model(input_ids=input_ids, attention_mask=attention_mask,
                                   position_ids=position_ids, cache=cache,
                                   inputs_embeds=inputs_embeds)
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            hidden = hidden[:, -logits_to_keep:]
        elif isinstance(logits_to_keep, torch.Tensor):
            hidden = hidden[:, logits_to_keep]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                   labels[:, 1:].reshape(-1), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: cache})


__all__ = ["LRAttnForCausalLM", "LRAttnModel", "LRAttnPreTrainedModel", "depth_read_reference",
           "block_ends"]
