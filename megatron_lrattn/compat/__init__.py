"""Compatibility shims: ``cpu`` (megatron-core on CPU/gloo, applied only without CUDA) and ``te``
(Transformer Engine availability, FP8 shape checks, local <-> TE state-dict key maps)."""
