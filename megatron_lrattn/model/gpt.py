"""GPT model with a depth-attention residual stream."""

from __future__ import annotations

from megatron.core.models.gpt.gpt_model import GPTModel

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
