"""Megatron-core model pieces: the config subclass, the depth-attention layer and block, the GPT
model, the layer specs (local and TE), the attention core and the SP-aware norms."""
