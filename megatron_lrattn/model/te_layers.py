"""Modules of the TE layer spec that megatron-core does not have. Needs Transformer Engine:
import only after ``megatron_lrattn.compat.te.require_te()`` (``spec.py`` does).

Precision: TE's FP8 autocast changes only TE modules (their GEMMs quantise inputs and weights
to FP8 and write bf16 outputs). The depth read is PyTorch or Triton code, so running it inside
the layer's autocast region leaves it as it is: it reads the bf16 sub-layer outputs, computes
logits, softmax and sums in fp32 from the query, and writes a bf16 mixture, which is the
input of the next ``TELayerNormColumnParallelLinear``; that module normalises it with the
sub-layer's norm gain (``layer_norm_weight``) and only then quantises for its GEMM.
"""

from __future__ import annotations

from contextlib import nullcontext

from megatron.core.extensions.transformer_engine import TERowParallelLinear
from megatron.core.fp8_utils import get_fp8_context

try:  # TE >= 2.8; older releases have it only in the (now deprecated) fp8 module
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager
except ImportError:  # pragma: no cover - depends on the TE release
    from transformer_engine.pytorch.fp8 import FP8GlobalStateManager

from megatron_lrattn.model.layer import LRAttnResLayer


class KeyEmittingTERowParallelLinear(TERowParallelLinear):
    """TE row-parallel output projection with r extra output rows that emit the routing key
    (``d_in -> d + r``), the TE counterpart of ``spec.KeyEmittingRowParallelLinear``: the key
    rows are reduced across tensor-parallel ranks with the value rows and run in FP8 with
    them; ``LRAttnResLayer`` splits the output and RMS-normalises the key in fp32."""

    def __init__(self, input_size: int, output_size: int, *, config, **kwargs):
        super().__init__(input_size, output_size + config.key_rank, config=config, **kwargs)


class TELRAttnResLayer(LRAttnResLayer):
    """``LRAttnResLayer`` built from TE modules, running inside megatron's FP8 context.

    megatron-core's ``TransformerBlock`` enters the FP8 autocast around its layers; the
    depth-attention block runs its own loop, so each layer enters the region itself (one
    region per layer: with the ``delayed`` recipe that is one amax reduction per layer rather
    than one per block). Nothing changes without ``config.fp8`` or when a region is already
    open.
    """

    def forward(self, *args, **kwargs):
        """``LRAttnResLayer.forward`` inside ``get_fp8_context(config, layer_number - 1)``."""
        region = nullcontext()
        if self.config.fp8 and not FP8GlobalStateManager.is_fp8_enabled():
            region = get_fp8_context(self.config, self.layer_number - 1)
        with region:
            return super().forward(*args, **kwargs)
