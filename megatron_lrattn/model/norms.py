"""PreNorm modules: a PyTorch RMSNorm / LayerNorm for the local spec that works with sequence
parallelism, and how the depth-attention layer applies a norm module or hands its gain to a
two-phase merge.

megatron-core's ``WrappedTorchNorm`` (what the local spec uses without TE or apex) refuses
``sequence_parallel``. The norm itself needs nothing for it: under sequence parallelism
each tensor-parallel rank normalises its own slice of the sequence with a weight that is
replicated across the tensor-parallel group, so the weight's gradient on one rank is a
partial sum over that rank's tokens. Megatron's ``finalize_model_grads`` all-reduces the
gradients of parameters carrying ``sequence_parallel = True`` across the tensor-parallel
group; this module sets that attribute and is otherwise ``torch.nn.RMSNorm`` /
``torch.nn.LayerNorm`` (identical numerics to ``WrappedTorchNorm`` without sequence
parallelism).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` whose gain a fused consumer takes through the module call.

    ``norm(None)`` returns the weight itself instead of normalising. A two-phase merge that
    applies the norm inside its kernel reads the weight this way, so the module's forward
    pre-hooks run first: megatron's DDP waits there for the overlapped all-gather of the
    parameter's bucket (``--overlap-param-gather``), and reading ``norm.weight`` directly
    could see the previous step's values.
    """

    def forward(self, x: Optional[Tensor]) -> Tensor:
        """Args: x [..., d], or None for the weight [d]. Returns: the normalised x, or the
        weight."""
        return self.weight if x is None else super().forward(x)


class SequenceParallelTorchNorm:
    """Build ``torch.nn.RMSNorm`` or ``torch.nn.LayerNorm`` (from ``config.normalization``)
    whose parameters carry ``sequence_parallel = config.sequence_parallel``.

    Called like every megatron-core norm builder (``build_module`` in megatron-core 0.16,
    a direct ``LayerNormBuilder`` call in 0.19), so it plugs into a spec's
    ``input_layernorm``, ``pre_mlp_layernorm``, ``q_layernorm``/``k_layernorm`` and a block
    spec's ``layer_norm``.

    Args:
        config: the ``TransformerConfig``.
        hidden_size: normalised width.
        eps: epsilon.
        persist_layer_norm, zero_centered_gamma, normalization: accepted for signature
            compatibility with megatron's norm builders; the config decides.

    Returns:
        The norm module.
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5,
                persist_layer_norm: bool = False, zero_centered_gamma: bool = False,
                normalization: str = "LayerNorm"):
        refused = [name for name in ("layernorm_zero_centered_gamma", "persist_layer_norm",
                                     "memory_efficient_layer_norm")
                   if getattr(config, name, False)]
        if refused:
            raise ValueError(
                f"{', '.join(refused)} is not supported by the PyTorch norm of the local spec"
            )
        if config.normalization == "RMSNorm":
            norm = RMSNorm(hidden_size, eps=eps)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        else:
            raise ValueError(
                f"normalization={config.normalization!r} is not supported by the local spec; "
                "use RMSNorm or LayerNorm"
            )
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm


def apply_norm(norm, x: Tensor) -> Tensor:
    """Apply a PreNorm module; newer megatron-core norms built for a residual return
    (out, residual)."""
    out = norm(x)
    return out[0] if isinstance(out, tuple) else out


def fusable_rmsnorm(norm) -> Optional[Tuple[Tensor, Optional[float]]]:
    """(weight, eps) of a PreNorm a two-phase merge can apply itself, else None.

    Only this module's ``RMSNorm`` with a weight (the local spec's norm) qualifies; its
    ``eps`` may be None (then the input dtype's machine epsilon, as the module uses). The
    weight is taken through the module call (``norm(None)``), so its hooks run. A plain
    ``torch.nn.RMSNorm``, LayerNorm, TE norms and the ``IdentityOp`` left where TE fuses the
    norm into the next linear do not qualify.
    """
    if type(norm) is RMSNorm and norm.weight is not None and len(norm.normalized_shape) == 1:
        return norm(None), norm.eps
    return None
