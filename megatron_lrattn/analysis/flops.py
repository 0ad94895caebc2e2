"""Parameter and FLOP accounting for a model configuration (pure Python, no torch).

Every count is per token. The block structure comes from ``megatron_lrattn.depth.schedule``;
nothing here re-derives which sources a read site sees.

Added forward FLOPs (the paper's Appendix A; docs/design.md)
------------------------------------------------------------
With ``S_j`` the number of sources read at site j (j = 1..2L, every query-carrying site,
including the read before the final norm) and ``kw`` the key width (``r`` for
``lr_attnres``, ``d`` for ``attnres``)::

    reads        = sum_j S_j * (2 * kw + 2 * d)       # logit dot product + weighted sum
    key_emit     = L * 2 r (d + h) + 2 d r            # projected keys only, else 0
    denominator  = L * (8 d^2 + 6 d h)                # the layers' forward matmul FLOPs
    added_flops_percent = 100 * (reads + key_emit) / denominator

The denominator is computed as ``2 * L * (matmul weights of one standard layer)``, which is
exactly ``L (8 d^2 + 6 d h)`` for the paper's multi-head SwiGLU layer and stays the matmul
count under grouped-query attention or a non-gated MLP. Key normalisation, the softmax and
the block-sum additions are not counted (the paper does not count them).

Worked check, the paper's 0.5B model (L=24, d=1024, h=2816, sliced keys, r=64, N=8):
blocks close every 6 sub-layers and all six sites of block k (0-based) read k + 2 sources,
so ``sum_j S_j = 6 * (2 + 3 + ... + 9) = 264``; ``reads = 264 * (2*64 + 2*1024) = 574,464``;
``denominator = 24 * (8*1024^2 + 6*1024*2816) = 616,562,688``; added = 0.093172% -> the
paper's 0.0932%.

Depth-read bytes per token (the wall-clock model; docs/design.md)
-----------------------------------------------------------------
A site reading S sources moves at least ``(S + 1) * d * b`` bytes in the forward (read S
values, write one output) and ``(3S + 2) * d * b`` in forward + backward, with ``b`` bytes
per element (2 for bf16). Sliced and AttnRes keys are views of the values and add nothing;
projected keys are separate ``[tokens, r]`` tensors and add ``S * r * b`` (forward: read)
and ``3 * S * r * b`` (forward + backward: read, read again, write the key gradient).
``standard`` has no depth reads (0 bytes).

Model FLOPs per token (for MFU; forward + backward)
---------------------------------------------------
::

    model_flops_per_token = 6 * M + 12 * L * s * (a * k)

``M`` is the number of matmul weights a token passes through: every linear weight of the
layers (including the r extra key rows of projected keys), the projected embedding key
``Linear(d, r)``, and the LM head ``V * d`` (counted whether or not it is tied to the
embedding, since the head matmul is done either way); the embedding lookup, norms, biases
and depth queries are not matmuls. ``12 * L * s * (a * k)`` is the attention score and
value product (``a`` heads of width ``k``, sequence length ``s``), forward ``4 s a k`` per
layer, times 3 for forward + backward, without a causal discount (the PaLM and nanoGPT
convention). Depth reads are not included: they are memory-bound reductions, not matmuls,
and their FLOPs are reported separately (``added_flops_per_token``).

Parameter counts follow the megatron-core local spec with RMSNorm (weight only) and RoPE
(no position table); ``params_non_embedding`` excludes the token embedding and an untied LM
head.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, Optional, Tuple

from megatron_lrattn.depth.schedule import depth_schedule

RESIDUAL_MODES = ("standard", "attnres", "lr_attnres")
"""Same names as ``megatron_lrattn.model.config.RESIDUAL_MODES`` (a test keeps them equal;
importing the config would import megatron-core, which takes seconds)."""

KEY_TYPES = ("sliced", "projected")
"""Same names as ``megatron_lrattn.model.config.KEY_TYPES``."""

DEFAULT_VOCAB_SIZE = 50304
"""GPT-2's 50,257 tokens padded to a multiple of 128. The vocabulary only changes the
embedding and head counts and ``model_flops_per_token``, never ``added_flops_percent``."""


class FlopsConfigError(ValueError):
    """A model shape that cannot be accounted; the message says which value and why."""


@dataclass(frozen=True)
class ModelShape:
    """The shape of a decoder for accounting.

    Attributes:
        num_layers: L.
        hidden_size: d.
        ffn_hidden_size: h.
        num_attention_heads: a; the head width is k = d // a.
        num_query_groups: key/value heads (default: a, multi-head attention).
        seq_length: s, used only by the attention term of ``model_flops_per_token``.
        vocab_size: V (default ``DEFAULT_VOCAB_SIZE``).
        swiglu: gated MLP (fc1 emits 2h) when True.
        untied: separate LM head weight when True.
        qk_layernorm: per-head RMSNorm weights on queries and keys.
        add_bias_linear: biases on every linear layer.
        residual: one of ``RESIDUAL_MODES``.
        key: one of ``KEY_TYPES`` (``projected`` only with ``lr_attnres``).
        rank: r; default d // 4 for ``lr_attnres``, d for ``attnres``, None for ``standard``.
        num_blocks: N, 1 <= N <= 2L (2L is full granularity); ignored for ``standard``.
    """

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: Optional[int] = None
    seq_length: int = 2048
    vocab_size: int = DEFAULT_VOCAB_SIZE
    swiglu: bool = True
    untied: bool = True
    qk_layernorm: bool = False
    add_bias_linear: bool = False
    residual: str = "lr_attnres"
    key: str = "sliced"
    rank: Optional[int] = None
    num_blocks: int = 8

    @classmethod
    def from_args(cls, args, vocab_size: int) -> "ModelShape":
        """The shape described by ``lrattn-pretrain``-style arguments (a namespace with
        ``num_layers``, ``hidden_size``, ..., ``residual``, ``key``, ``rank``, ``num_blocks``)."""
        return cls(
            num_layers=args.num_layers,
            hidden_size=args.hidden_size,
            ffn_hidden_size=args.ffn_hidden_size,
            num_attention_heads=args.num_attention_heads,
            num_query_groups=args.num_query_groups,
            seq_length=args.seq_length,
            vocab_size=vocab_size,
            swiglu=bool(args.swiglu),
            untied=bool(args.untie_embeddings_and_output_weights),
            qk_layernorm=bool(args.qk_layernorm),
            add_bias_linear=not args.disable_bias_linear,
            residual=args.residual,
            key=args.key,
            rank=args.rank,
            num_blocks=args.num_blocks,
        )

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                     "seq_length", "vocab_size"):
            _check_positive(name, getattr(self, name))
        d, a = self.hidden_size, self.num_attention_heads
        if d % a:
            raise FlopsConfigError(f"hidden_size={d} is not divisible by num_attention_heads={a}")
        if self.num_query_groups is None:
            object.__setattr__(self, "num_query_groups", a)
        _check_positive("num_query_groups", self.num_query_groups)
        if a % self.num_query_groups:
            raise FlopsConfigError(
                f"num_attention_heads={a} is not a multiple of num_query_groups="
                f"{self.num_query_groups}")
        if self.residual not in RESIDUAL_MODES:
            raise FlopsConfigError(
                f"residual={self.residual!r} is not allowed: one of {', '.join(RESIDUAL_MODES)}")
        if self.key not in KEY_TYPES:
            raise FlopsConfigError(
                f"key={self.key!r} is not allowed: one of {', '.join(KEY_TYPES)}")
        if self.residual == "standard":
            if self.rank is not None:
                raise FlopsConfigError("rank applies only to residual attnres/lr_attnres")
            return
        if self.residual == "attnres":
            if self.key != "sliced":
                raise FlopsConfigError("key=projected needs residual lr_attnres "
                                       "(attnres keys are the sources)")
            if self.rank is None:
                object.__setattr__(self, "rank", d)
            if self.rank != d:
                raise FlopsConfigError(f"rank={self.rank}: attnres uses r = hidden_size = {d}")
        elif self.rank is None:
            object.__setattr__(self, "rank", max(1, d // 4))
        _check_positive("rank", self.rank)
        if self.rank > d:
            raise FlopsConfigError(f"rank={self.rank} is not allowed: 1 <= r <= hidden_size ({d})")
        n_sub = 2 * self.num_layers
        _check_int("num_blocks", self.num_blocks)
        if not 1 <= self.num_blocks <= n_sub:
            raise FlopsConfigError(
                f"num_blocks={self.num_blocks} is not allowed: 1 <= N <= 2 * num_layers ({n_sub})")

    @property
    def head_dim(self) -> int:
        """k = d // a."""
        return self.hidden_size // self.num_attention_heads

    @property
    def projected(self) -> bool:
        """True for projected keys."""
        return self.residual == "lr_attnres" and self.key == "projected"


def _check_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise FlopsConfigError(f"{name}={value!r} is not an integer")


def _check_positive(name: str, value) -> None:
    _check_int(name, value)
    if value < 1:
        raise FlopsConfigError(f"{name}={value} is not allowed: must be >= 1")


@dataclass(frozen=True)
class ParameterCounts:
    """Parameter counts of a model.

    Attributes:
        total: every parameter (a tied head counted once).
        embedding: token embedding plus an untied LM head.
        non_embedding: total - embedding.
        added: parameters the residual mode adds over ``standard``.
        matmul: matmul weights a token passes through (``M`` of ``model_flops_per_token``).
    """

    total: int
    embedding: int
    non_embedding: int
    added: int
    matmul: int


def _layer_matmul_weights(shape: ModelShape, key_rows: int) -> int:
    d, h, k = shape.hidden_size, shape.ffn_hidden_size, shape.head_dim
    attn_width = shape.num_attention_heads * k
    qkv = d * (attn_width + 2 * shape.num_query_groups * k)
    proj = attn_width * (d + key_rows)
    fc1 = d * h * (2 if shape.swiglu else 1)
    fc2 = h * (d + key_rows)
    return qkv + proj + fc1 + fc2


def _layer_other_params(shape: ModelShape, key_rows: int) -> int:
    d, h, k = shape.hidden_size, shape.ffn_hidden_size, shape.head_dim
    norms = 2 * d + (2 * k if shape.qk_layernorm else 0)
    if not shape.add_bias_linear:
        return norms
    attn_width = shape.num_attention_heads * k
    biases = (attn_width + 2 * shape.num_query_groups * k) + (d + key_rows)
    biases += h * (2 if shape.swiglu else 1) + (d + key_rows)
    return norms + biases


def parameter_counts(shape: ModelShape) -> ParameterCounts:
    """Count the parameters of ``shape`` as megatron-core builds it.

    Per layer: QKV ``d (a k + 2 g k)``, out-projection ``a k (d + e)``, fc1 ``d h`` (``2 d h``
    with SwiGLU), fc2 ``h (d + e)`` with ``e = r`` extra key rows for projected keys (else 0),
    two RMSNorm weights ``2d`` (+ ``2k`` with QK-norm), biases when enabled. Model: embedding
    ``V d``, untied head ``V d``, final norm ``d``. Residual mode: ``2L r`` fp32 queries
    (``2L d`` for attnres) plus, for projected keys, the embedding key ``d r`` and the
    ``L (d r + h r)`` extra rows (and ``2 L r`` extra biases when biases are on).

    Args:
        shape: the model shape.

    Returns:
        ``ParameterCounts``.
    """
    L, d, V = shape.num_layers, shape.hidden_size, shape.vocab_size
    e = shape.rank if shape.projected else 0
    layers = L * (_layer_matmul_weights(shape, e) + _layer_other_params(shape, e))
    embedding = V * d * (2 if shape.untied else 1)
    queries = 0 if shape.residual == "standard" else 2 * L * shape.rank
    emb_key = d * e
    total = embedding + layers + d + queries + emb_key
    standard = embedding + L * (_layer_matmul_weights(shape, 0) + _layer_other_params(shape, 0)) + d
    matmul = L * _layer_matmul_weights(shape, e) + emb_key + V * d
    return ParameterCounts(total=total, embedding=embedding, non_embedding=total - embedding,
                           added=total - standard, matmul=matmul)


def sources_per_site(shape: ModelShape) -> Tuple[int, ...]:
    """S_j for the read sites j = 1..2L (empty for ``standard``), from the depth schedule."""
    if shape.residual == "standard":
        return ()
    sched = depth_schedule(shape.num_layers, shape.num_blocks)
    return tuple(sched.site(j).num_sources for j in range(1, sched.num_sites + 1))


@dataclass(frozen=True)
class ForwardFlops:
    """Forward FLOPs per token by the paper's Appendix A accounting (module docstring).

    Attributes:
        denominator: the layers' forward matmul FLOPs, L (8 d^2 + 6 d h) for MHA + SwiGLU.
        depth_reads: sum_j S_j (2 kw + 2 d).
        key_projections: L 2 r (d + h) + 2 d r for projected keys, else 0.
        added: depth_reads + key_projections.
        added_percent: 100 * added / denominator.
    """

    denominator: int
    depth_reads: int
    key_projections: int
    added: int
    added_percent: float


def forward_flops(shape: ModelShape) -> ForwardFlops:
    """Added forward FLOPs per token of the residual mode (see the module docstring)."""
    d, h, L = shape.hidden_size, shape.ffn_hidden_size, shape.num_layers
    denominator = 2 * L * _layer_matmul_weights(shape, 0)
    if shape.residual == "standard":
        return ForwardFlops(denominator, 0, 0, 0, 0.0)
    r = shape.rank
    reads = sum(sources_per_site(shape)) * (2 * r + 2 * d)
    keys = (L * 2 * r * (d + h) + 2 * d * r) if shape.projected else 0
    added = reads + keys
    return ForwardFlops(denominator, reads, keys, added, 100.0 * added / denominator)


def depth_read_bytes_per_token(shape: ModelShape, bytes_per_elem: int = 2) -> Tuple[int, int]:
    """Minimum bytes moved by the depth reads per token.

    Args:
        shape: the model shape.
        bytes_per_elem: activation element size (2 for bf16).

    Returns:
        (forward, forward + backward): sums over sites of ``(S + 1) d b`` and
        ``(3 S + 2) d b``, plus ``S r b`` and ``3 S r b`` for projected keys.
    """
    d, b = shape.hidden_size, bytes_per_elem
    key = shape.rank if shape.projected else 0
    fwd = bwd = 0
    for s in sources_per_site(shape):
        fwd += (s + 1) * d * b + s * key * b
        bwd += (3 * s + 2) * d * b + 3 * s * key * b
    return fwd, bwd


def model_flops_per_token(shape: ModelShape) -> int:
    """``6 M + 12 L s (a k)``: forward + backward model FLOPs per token for MFU (module
    docstring)."""
    attn = 12 * shape.num_layers * shape.seq_length * shape.num_attention_heads * shape.head_dim
    return 6 * parameter_counts(shape).matmul + attn


def flops_report(shape: ModelShape, bytes_per_elem: int = 2) -> Dict[str, object]:
    """Every count for ``shape`` as one flat, JSON-serialisable dict.

    Returns:
        The resolved shape fields plus ``params_*``, ``flops_denominator``,
        ``added_flops_per_token`` (with its ``depth_reads``/``key_projections`` parts),
        ``added_flops_percent``, ``sources_per_site_total``,
        ``depth_read_bytes_per_token_fwd``/``_fwd_bwd`` and ``model_flops_per_token``.
    """
    params = parameter_counts(shape)
    fl = forward_flops(shape)
    fwd_bytes, fwd_bwd_bytes = depth_read_bytes_per_token(shape, bytes_per_elem)
    out: Dict[str, object] = dict(asdict(shape))
    out.update(
        params_total=params.total,
        params_embedding=params.embedding,
        params_non_embedding=params.non_embedding,
        params_added=params.added,
        params_matmul=params.matmul,
        flops_denominator=fl.denominator,
        added_flops_per_token=fl.added,
        added_flops_depth_reads=fl.depth_reads,
        added_flops_key_projections=fl.key_projections,
        added_flops_percent=fl.added_percent,
        sources_per_site_total=sum(sources_per_site(shape)),
        bytes_per_elem=bytes_per_elem,
        depth_read_bytes_per_token_fwd=fwd_bytes,
        depth_read_bytes_per_token_fwd_bwd=fwd_bwd_bytes,
        model_flops_per_token=model_flops_per_token(shape),
    )
    return out
