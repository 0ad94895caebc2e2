"""Hugging Face export: ``transformers`` config and model (plain PyTorch), and the converter."""

from megatron_lrattn.hf.configuration_lrattn import LRAttnConfig
from megatron_lrattn.hf.modeling_lrattn import LRAttnForCausalLM, LRAttnModel

__all__ = ["LRAttnConfig", "LRAttnForCausalLM", "LRAttnModel"]
