"""megatron-core's MLP with the SwiGLU output recomputed for the output projection's backward.

A gated MLP keeps two wide tensors for its backward: the first linear's output ``x``
(``[s, b, 2f]``, which the SwiGLU backward needs) and the SwiGLU output ``y = silu(gate) *
up`` (``[s, b, f]``, which the output projection ``linear_fc2`` saves for its weight
gradient). ``y`` is a cheap function of ``x``, so keeping both is redundant: at the 1b preset
(8 x 2048 tokens, f = 5632, bf16) ``y`` is 3.0 GB of the step's saved activations.
``torch.compile`` makes the same choice for a plain model (its partitioner recomputes
pointwise ops instead of saving them).

``RecomputedActivationMLP`` runs the first linear and the activation as megatron-core does,
then calls ``linear_fc2`` inside ``torch.autograd.graph.saved_tensors_hooks`` that replace
``y`` by a note; when the output projection's backward unpacks it, the note recomputes ``y``
from ``x`` with the function that made it (megatron-core's compiled ``swiglu`` for the fused
path, ``silu(gate) * up`` for the eager one), so the gradients are bit-identical to the
unrecomputed MLP's. The recomputed ``y`` lives only while that backward runs. Only one kind of
MLP takes this path: gated SiLU, no bias, no per-token scale, no TE activation, none of
megatron-core's clamp/offset variants, gradients enabled, and no saved-tensor hooks of the
caller active (activation offloading packs ``x`` itself; a note holding ``x`` would defeat
it); every other MLP (and the forward of a full-layer recomputation, which runs without
gradients) is megatron-core's own forward.
``config.recompute_mlp_activation`` (``--no-recompute-mlp-activation``) turns it off.

Where ``linear_fc2`` saves something other than ``y`` itself (a cast or a copy), the hooks
find nothing to replace and the MLP keeps what it kept before: correct, with no saving.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.mlp import MLP


class _Recompute:
    """What the output projection's backward gets instead of the saved SwiGLU output: the
    first linear's output and the function that rebuilds ``y`` from it."""

    __slots__ = ("x", "fn", "y")

    def __init__(self, x: torch.Tensor, fn):
        self.x, self.fn, self.y = x, fn, None

    def get(self) -> torch.Tensor:
        if self.y is None:
            with torch.no_grad():
                self.y = self.fn(self.x)
        return self.y


def _caller_has_saved_tensor_hooks() -> bool:
    # torch keeps the active default hooks in a private stack; without that function
    # (another torch version) assume there are some and keep megatron-core's forward.
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(False) is not None


def _identity(t: torch.Tensor) -> tuple:
    # Where a tensor's elements are. The hooks keep this, not the tensor: autograd keeps the
    # pack hook of every tensor saved under it until the backward, so a hook closing over
    # ``y`` would keep ``y`` alive.
    return (t.data_ptr(), t.dtype, t.device, tuple(t.shape), t.stride())


def _eager_swiglu(x: torch.Tensor) -> torch.Tensor:
    # megatron-core's unfused gated activation, op for op (MLP.forward's ``glu``)
    gate, up = torch.chunk(x, 2, dim=-1)
    return F.silu(gate) * up


class RecomputedActivationMLP(MLP):
    """``MLP`` whose output projection's backward recomputes the SwiGLU output (module
    docstring). Same parameters, state dict and forward result as megatron-core's ``MLP``."""

    def _recomputes(self, per_token_scale) -> bool:
        c = self.config
        return (getattr(c, "recompute_mlp_activation", False) and torch.is_grad_enabled()
                and not _caller_has_saved_tensor_hooks()
                and per_token_scale is None and c.gated_linear_unit
                and c.activation_func is F.silu and not c.add_bias_linear
                and not getattr(c, "use_te_activation_func", False)
                and not getattr(c, "activation_func_fp8_input_store", False)
                and getattr(c, "activation_func_clamp_value", None) is None
                and not getattr(c, "glu_linear_offset", 0.0))

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        if not self._recomputes(per_token_scale):
            return super().forward(hidden_states, per_token_scale=per_token_scale, **kwargs)
        x, _ = self.linear_fc1(hidden_states)  # no bias: _recomputes checked add_bias_linear
        if self.config.bias_activation_fusion:
            from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl, swiglu

            y = bias_swiglu_impl(x, None, False, False)
            shape = y.shape
            # bias_swiglu_impl runs megatron's compiled swiglu on the 2-D view of x
            remake = lambda t: swiglu(t.view(-1, t.shape[-1])).view(shape)  # noqa: E731
        else:
            y = _eager_swiglu(x)
            remake = _eager_swiglu
        note, key = _Recompute(x, remake), _identity(y)

        def pack(t):
            return note if _identity(t) == key else t

        def unpack(saved):
            return saved.get() if isinstance(saved, _Recompute) else saved

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return self.linear_fc2(y)
