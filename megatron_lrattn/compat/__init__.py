"""Compatibility shims: ``cpu`` (megatron-core on CPU/gloo, applied only without CUDA),
``multi_tensor`` (foreach gradient norm and scaling where megatron-core would fall back to
per-tensor loops without Apex or TE) and ``te`` (Transformer Engine availability, FP8 shape
checks, local <-> TE state-dict key maps)."""
