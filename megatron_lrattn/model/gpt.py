"""GPT model with a depth-attention residual stream."""

from __future__ import annotations

from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_model import GPTModel
from torch import Tensor

from megatron_lrattn.model.block import LRAttnResBlock


class LRAttnResGPTModel(GPTModel):
    """``GPTModel`` whose decoder is an ``LRAttnResBlock`` for ``attnres``/``lr_attnres``.

    Takes exactly ``GPTModel``'s arguments; ``config`` must be an ``LRAttnResConfig`` and
    ``transformer_layer_spec`` should come from ``get_lr_attnres_layer_spec(config)``. With
    ``residual='standard'`` the model is megatron-core's ``GPTModel`` unchanged.
    """

    def __init__(self, config, transformer_layer_spec, *args, **kwargs):
        super().__init__(config, transformer_layer_spec, *args, **kwargs)
        if getattr(config, "uses_depth_attention", False):
            LRAttnResBlock.adopt(self.decoder)

    def compute_language_model_loss(self, labels: Tensor, logits: Tensor) -> Tensor:
        """megatron-core's per-token loss [b, s] from labels [b, s] and logits [s, b, V/tp];
        with ``config.triton_cross_entropy`` (and the cross-entropy fusion on) through
        ``megatron_lrattn.ops.cross_entropy`` instead of megatron-core's fusion."""
        config = self.config
        if not (getattr(config, "triton_cross_entropy", False)
                and config.cross_entropy_loss_fusion):
            return super().compute_language_model_loss(labels, logits)
        from megatron_lrattn.ops.cross_entropy import vocab_parallel_cross_entropy

        group = getattr(getattr(self, "pg_collection", None), "tp", None)
        if group is None:
            group = parallel_state.get_tensor_model_parallel_group()
        loss = vocab_parallel_cross_entropy(logits, labels.transpose(0, 1).contiguous(), group)
        return loss.transpose(0, 1).contiguous()
