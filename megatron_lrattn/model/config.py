"""Model configuration: Megatron's ``TransformerConfig`` plus the depth-attention fields."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_lrattn.model.errors import ConfigError  # noqa: F401 - re-exported

RESIDUAL_MODES = ("standard", "attnres", "lr_attnres")
KEY_TYPES = ("sliced", "projected")
DEPTH_BACKENDS = ("auto", "torch", "triton")
DEPTH_SCHEDULES = ("auto", "per_site", "two_phase")


def _bad(field: str, value, allowed: str) -> ConfigError:
    return ConfigError(f"{field}={value!r} is not allowed: {allowed}")


@dataclass
class LRAttnResConfig(TransformerConfig):
    """``TransformerConfig`` with the residual-stream settings of (LR-)AttnRes.

    The math is in docs/design.md: every sub-layer input is a softmax over earlier depth
    sources (the embedding, completed block sums, and the running partial block sum)
    instead of the plain residual sum.
    """

    residual: str = "lr_attnres"
    """Residual mode: ``standard`` (plain PreNorm residual sum, identical to stock
    Megatron), ``attnres`` (depth attention with full d-wide keys) or ``lr_attnres``
    (depth attention with rank-r keys)."""

    key_type: str = "sliced"
    """Routing-key type for ``lr_attnres``: ``sliced`` (key = last r coordinates of the
    source, no extra parameters) or ``projected`` (output projections emit r extra key
    rows). ``attnres`` requires ``sliced``."""

    key_rank: Optional[int] = None
    """Key rank r. Default: hidden_size // 4 for ``lr_attnres``, hidden_size for
    ``attnres``; must stay None for ``standard``."""

    num_blocks: int = 8
    """Number of depth blocks N, 1 <= N <= 2 * num_layers. N = 2 * num_layers is full
    granularity (every sub-layer output is its own source)."""

    key_norm_eps: float = 1e-6
    """Epsilon of the stateless RMS normalisation applied to keys."""

    depth_scale: float = 1.0
    """Logit scale tau of the depth softmax (must be finite and > 0)."""

    depth_backend: str = "auto"
    """Depth-read implementation: ``torch`` (reference), ``triton`` (fused kernels) or
    ``auto`` (fused on CUDA when available, otherwise the reference)."""

    depth_schedule: str = "auto"
    """How the reads of a depth block are computed: ``per_site`` (one fused read over all
    sources per site), ``two_phase`` (phase 1 reads the block's completed sources once for
    all of its read sites on this pipeline chunk and caches (out, lse); each site then
    merges the running partial sum with an online-softmax step, see
    ``megatron_lrattn.ops.depth_read_multi`` and ``megatron_lrattn.ops.depth_merge``) or
    ``auto`` (two_phase where the reads run on the fused kernels, on CUDA with
    depth_backend auto or triton; per_site on the reference path). Both give the same
    result up to rounding."""

    fuse_depth_norm: bool = True
    """Fuse the next sub-layer's RMSNorm into the two-phase merges where the layer's norm is
    a ``torch.nn.RMSNorm`` with a weight (the local spec): the merge then writes only the
    normalised read (``megatron_lrattn.ops.depth_merge(norm_weight=...)``). Norms fused
    into the following linear (TE spec), LayerNorm and per-site reads are unaffected."""

    recompute_mlp_activation: bool = True
    """The local spec's gated-SiLU MLP recomputes its SwiGLU output in the output
    projection's backward instead of keeping it (``megatron_lrattn.model.mlp``; bit-identical
    gradients, one ``[s, b, f]`` tensor less per layer kept for the backward;
    ``--no-recompute-mlp-activation``). Other MLPs and the TE spec are unaffected."""

    triton_cross_entropy: bool = False
    """With ``cross_entropy_loss_fusion``: the loss is ``megatron_lrattn.ops.cross_entropy``
    (Triton) instead of megatron-core's ``native`` fusion; same loss, and the backward keeps
    the logits instead of their fp32 softmax (``--cross-entropy-fusion-impl triton``, the
    command lines' default on CUDA)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.residual not in RESIDUAL_MODES:
            raise _bad("residual", self.residual, f"one of {', '.join(RESIDUAL_MODES)}")
        if self.key_type not in KEY_TYPES:
            raise _bad("key_type", self.key_type, f"one of {', '.join(KEY_TYPES)}")
        if self.depth_backend not in DEPTH_BACKENDS:
            raise _bad("depth_backend", self.depth_backend, f"one of {', '.join(DEPTH_BACKENDS)}")
        if self.depth_schedule not in DEPTH_SCHEDULES:
            raise _bad("depth_schedule", self.depth_schedule,
                       f"one of {', '.join(DEPTH_SCHEDULES)} (two_phase with depth_backend torch "
                       "runs the reference ops)")
        if not isinstance(self.fuse_depth_norm, bool):
            raise _bad("fuse_depth_norm", self.fuse_depth_norm, "True or False")
        if not isinstance(self.recompute_mlp_activation, bool):
            raise _bad("recompute_mlp_activation", self.recompute_mlp_activation, "True or False")
        d = self.hidden_size
        if self.residual == "standard":
            if self.key_rank is not None:
                raise _bad("key_rank", self.key_rank,
                           "key_rank applies only to residual attnres/lr_attnres")
            if self.key_type != "sliced":
                raise _bad("key_type", self.key_type,
                           "key types apply only to residual lr_attnres")
            return
        if self.residual == "attnres":
            if self.key_type != "sliced":
                raise _bad("key_type", self.key_type,
                           "attnres keys are the full sources; use lr_attnres")
            if self.key_rank is None:
                self.key_rank = d
            if self.key_rank != d:
                raise _bad(
                    "key_rank", self.key_rank, f"attnres uses r = hidden_size = {d}; use lr_attnres"
                )
        elif self.key_rank is None:
            self.key_rank = max(1, d // 4)
        if isinstance(self.key_rank, bool) or not isinstance(self.key_rank, int):
            raise _bad("key_rank", self.key_rank, "an integer")
        if not 1 <= self.key_rank <= d:
            raise _bad("key_rank", self.key_rank, f"1 <= key_rank <= hidden_size ({d})")
        if isinstance(self.num_blocks, bool) or not isinstance(self.num_blocks, int):
            raise _bad("num_blocks", self.num_blocks, "an integer")
        if not 1 <= self.num_blocks <= 2 * self.num_layers:
            raise _bad(
                "num_blocks",
                self.num_blocks,
                f"1 <= num_blocks <= 2 * num_layers ({2 * self.num_layers})",
            )
        if not (self.key_norm_eps > 0 and math.isfinite(self.key_norm_eps)):
            raise _bad("key_norm_eps", self.key_norm_eps, "a finite number > 0")
        if not (self.depth_scale > 0 and math.isfinite(self.depth_scale)):
            raise _bad("depth_scale", self.depth_scale, "a finite number > 0")

    @property
    def uses_depth_attention(self) -> bool:
        """True for ``attnres`` and ``lr_attnres``."""
        return self.residual != "standard"

    @property
    def projected_keys(self) -> bool:
        """True when sub-layers emit projected keys."""
        return self.residual == "lr_attnres" and self.key_type == "projected"
