"""Layer and block specs: megatron-core's own GPT layer spec with our layer, key-emitting output
projections and a sequence-parallel-aware PyTorch norm. One builder serves both backends;
``SpecModules`` is what differs between them: ``local`` (megatron-core modules, SDPA core
attention on GPU) and ``te`` (megatron-core's Transformer Engine modules, TE imported only
then)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megatron_lrattn.model.attention import RotarySDPASelfAttention, SDPACoreAttention
from megatron_lrattn.model.layer import LRAttnResLayer
from megatron_lrattn.model.mlp import RecomputedActivationMLP
from megatron_lrattn.model.norms import SequenceParallelTorchNorm

CORE_ATTENTION = ("auto", "local", "sdpa")


class KeyEmittingRowParallelLinear(RowParallelLinear):
    """Row-parallel output projection with r extra output rows that emit the routing key.

    ``d_in -> d + r``; the key rows are reduced across tensor-parallel ranks together with
    the value rows. The layer splits the output and RMS-normalises the key.
    """

    def __init__(self, input_size: int, output_size: int, *, config, **kwargs):
        super().__init__(input_size, output_size + config.key_rank, config=config, **kwargs)


@dataclasses.dataclass(frozen=True)
class SpecModules:
    """The modules one backend puts into megatron-core's layer spec.

    Attributes:
        base: megatron-core's GPT layer spec of the backend (the ``standard`` layer).
        layer: our depth-attention layer class (``attnres`` / ``lr_attnres``).
        key_linear: row-parallel output projection with r key rows (projected keys).
        prenorm: the sub-layer PreNorm, or None where the backend fuses it into the next
            linear.
        core_attention: replacement core attention, or None to keep the base spec's.
        mlp: replacement MLP class (a subclass of megatron-core's ``MLP``), or None to keep
            the base spec's.
    """

    base: ModuleSpec
    layer: type
    key_linear: type
    prenorm: Optional[type]
    core_attention: Optional[type]
    mlp: Optional[type] = None


def _local_modules(config, normalization: str, qk_layernorm: bool,
                   core_attention: str) -> SpecModules:
    """megatron-core's local modules; SDPA core attention for ``sdpa`` (``auto``: on CUDA,
    or with context parallelism, which only the SDPA core implements)."""
    if getattr(config, "fp8", None):
        raise ValueError(f"fp8={config.fp8!r} needs backend='te' (FP8 GEMMs are Transformer "
                         "Engine modules; the local spec runs bf16)")
    if core_attention not in CORE_ATTENTION:
        raise ValueError(f"core_attention={core_attention!r}; allowed: {CORE_ATTENTION}")
    if normalization not in ("RMSNorm", "LayerNorm"):
        raise ValueError(f"normalization={normalization!r}; allowed: RMSNorm, LayerNorm")
    cp = getattr(config, "context_parallel_size", 1)
    if core_attention == "auto":
        core_attention = "sdpa" if torch.cuda.is_available() or cp > 1 else "local"
    if core_attention == "local" and cp > 1:
        raise ValueError(f"context_parallel_size={cp} needs core_attention='sdpa' or 'auto' "
                         "(megatron's local DotProductAttention has no context parallelism)")
    return SpecModules(
        base=get_gpt_layer_local_spec(normalization=normalization, qk_layernorm=qk_layernorm),
        layer=LRAttnResLayer, key_linear=KeyEmittingRowParallelLinear,
        prenorm=SequenceParallelTorchNorm,
        core_attention=SDPACoreAttention if core_attention == "sdpa" else None,
        mlp=RecomputedActivationMLP)


def _te_modules(config, normalization: str, qk_layernorm: bool,
                core_attention: str) -> SpecModules:
    """megatron-core's TE modules: ``TELayerNormColumnParallelLinear`` for QKV and FC1 (the
    PreNorm fused in, so ``input_layernorm``/``pre_mlp_layernorm`` stay ``IdentityOp``),
    ``TEDotProductAttention``, ``TERowParallelLinear`` (``KeyEmittingTERowParallelLinear``
    for projected keys), ``TELRAttnResLayer``. The norms follow ``config.normalization``."""
    from megatron_lrattn.compat import te as te_compat

    if core_attention != "auto":
        raise ValueError(f"core_attention={core_attention!r} applies to backend='local'; the "
                         "TE spec uses TEDotProductAttention")
    if config.projected_keys and getattr(config, "tp_comm_overlap", False):
        raise ValueError("tp_comm_overlap with projected keys: TE's communication buffers are "
                         "sized for d output rows, the key-emitting projections have d + r")
    te_compat.check_fp8_config(config)
    te_compat.require_te()
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_with_transformer_engine_spec,
    )

    from megatron_lrattn.model.te_layers import KeyEmittingTERowParallelLinear, TELRAttnResLayer

    return SpecModules(base=get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm),
                       layer=TELRAttnResLayer, key_linear=KeyEmittingTERowParallelLinear,
                       prenorm=None, core_attention=None)


_BACKEND_MODULES = {"local": _local_modules, "te": _te_modules}
SPEC_BACKENDS = tuple(_BACKEND_MODULES)
"""The ``backend`` choices of ``get_lr_attnres_layer_spec``."""


def _replace_submodules(entry, **changes):
    """Copy of a spec entry with some submodules replaced. megatron-core <= 0.17 describes
    sub-modules as ``ModuleSpec``; newer versions also use ``functools.partial`` builders
    carrying ``submodules=``."""
    if isinstance(entry, ModuleSpec):
        return dataclasses.replace(entry, submodules=dataclasses.replace(entry.submodules, **changes))
    if isinstance(entry, functools.partial) and "submodules" in entry.keywords:
        keywords = dict(entry.keywords)
        keywords["submodules"] = dataclasses.replace(keywords["submodules"], **changes)
        return functools.partial(entry.func, *entry.args, **keywords)
    raise TypeError(f"cannot replace submodules of spec entry {entry!r}")


def _replace_module(entry, module: type):
    """Copy of a spec entry that builds ``module`` (a subclass of the entry's class) instead.
    megatron-core <= 0.17: a ``ModuleSpec``; newer: ``functools.partial`` of the class's
    builder classmethod (``MLP.as_mlp_submodule``)."""
    if isinstance(entry, ModuleSpec):
        if not issubclass(module, entry.module):
            raise TypeError(f"{module.__name__} does not subclass {entry.module.__name__}")
        return dataclasses.replace(entry, module=module)
    if isinstance(entry, functools.partial):
        owner = getattr(entry.func, "__self__", None)
        if isinstance(owner, type) and issubclass(module, owner):
            return functools.partial(getattr(module, entry.func.__name__), *entry.args,
                                     **entry.keywords)
    raise TypeError(f"cannot replace the module of spec entry {entry!r} by {module.__name__}")


def get_lr_attnres_layer_spec(
    config,
    backend: str = "local",
    normalization: str = "RMSNorm",
    qk_layernorm: bool = False,
    core_attention: str = "auto",
    rope_fusion: bool = True,
) -> ModuleSpec:
    """Transformer-layer spec for a residual mode.

    Args:
        config: ``LRAttnResConfig``; its ``residual`` and ``key_type`` choose the layer.
        backend: ``local`` (megatron-core modules) or ``te`` (Transformer Engine modules,
            experimental; FP8 through ``config.fp8``/``config.fp8_recipe``).
        normalization: ``RMSNorm`` or ``LayerNorm`` (local; the TE norms follow
            ``config.normalization``).
        qk_layernorm: normalise queries and keys of self-attention.
        core_attention: ``local`` (megatron's DotProductAttention), ``sdpa`` or ``auto``
            (``sdpa`` when CUDA is available or ``context_parallel_size`` > 1); the TE spec takes only ``auto`` (it uses
            ``TEDotProductAttention``).
        rope_fusion: local spec with the SDPA core: the core applies the rotary embedding
            (``RotarySDPASelfAttention``, fused with the QKV split where it can); False
            keeps megatron-core's unfused rotary embedding. The TE spec follows
            ``config.apply_rope_fusion`` / ``config.fused_single_qkv_rope`` instead
            (``megatron_lrattn.training.fusions.te_rope_fusion``).

    Returns:
        A ``ModuleSpec``: the backend's megatron-core GPT layer spec with our layer
        (``LRAttnResLayer``, ``TELRAttnResLayer`` for ``te``) unless ``residual`` is
        ``standard``, key-emitting output projections for projected keys, and
        ``SequenceParallelTorchNorm`` (the same PyTorch modules as megatron's
        ``WrappedTorchNorm``, but accepting ``sequence_parallel``) for the QK norms and,
        with ``local``, the PreNorms (``get_lr_attnres_block_spec`` adds the final norm).
        So every distributed-checkpoint key is the same in both backends
        (``megatron_lrattn.compat.te``).

    Raises:
        ValueError: an unknown choice, or FP8 settings without ``te`` or that TE refuses.
        megatron_lrattn.compat.te.TEUnavailableError: ``te`` without Transformer Engine.
    """
    if backend not in SPEC_BACKENDS:
        raise ValueError(f"backend={backend!r} is not available; allowed: {SPEC_BACKENDS}")
    modules = _BACKEND_MODULES[backend](config, normalization, qk_layernorm, core_attention)
    sub = modules.base.submodules
    attn_changes, mlp_changes, layer_changes = {}, {}, {}
    if qk_layernorm:
        attn_changes["q_layernorm"] = SequenceParallelTorchNorm
        attn_changes["k_layernorm"] = SequenceParallelTorchNorm
    if modules.core_attention is not None:
        attn_changes["core_attention"] = modules.core_attention
    if config.projected_keys:
        attn_changes["linear_proj"] = modules.key_linear
        mlp_changes["linear_fc2"] = modules.key_linear
    if modules.prenorm is not None:
        layer_changes.update(input_layernorm=modules.prenorm, pre_mlp_layernorm=modules.prenorm)
    if attn_changes:
        layer_changes["self_attention"] = _replace_submodules(sub.self_attention, **attn_changes)
    attn = layer_changes.get("self_attention")
    if (rope_fusion and modules.core_attention is SDPACoreAttention
            and isinstance(attn, ModuleSpec)):
        # the SDPA core applies the rotary embedding itself (fused, model/attention.py)
        layer_changes["self_attention"] = dataclasses.replace(attn, module=RotarySDPASelfAttention)
    if mlp_changes:
        layer_changes["mlp"] = _replace_submodules(sub.mlp, **mlp_changes)
    if modules.mlp is not None:
        layer_changes["mlp"] = _replace_module(layer_changes.get("mlp", sub.mlp), modules.mlp)
    module = modules.layer if config.uses_depth_attention else modules.base.module
    return ModuleSpec(module=module, submodules=dataclasses.replace(sub, **layer_changes))


def get_lr_attnres_block_spec(config, layer_spec: ModuleSpec, vp_stage=None, pp_rank=None
                              ) -> TransformerBlockSubmodules:
    """Block spec of one pipeline stage (or virtual stage): its layers and the final norm.

    ``GPTModel`` given a layer spec builds the final norm from megatron's default norm,
    which refuses sequence parallelism without TE or apex; given this block spec it builds
    ``SequenceParallelTorchNorm``.

    Args:
        config: ``LRAttnResConfig``.
        layer_spec: from ``get_lr_attnres_layer_spec``.
        vp_stage: virtual pipeline stage of the model chunk (None without interleaving).
        pp_rank: pipeline rank; default the current one.

    Returns:
        ``TransformerBlockSubmodules`` with one copy of ``layer_spec`` per layer built here.
    """
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * count,
                                      layer_norm=SequenceParallelTorchNorm)
