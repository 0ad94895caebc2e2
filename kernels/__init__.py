"""Fused Triton kernels of megatron_lrattn, importable as ``lrattn_kernels``."""
