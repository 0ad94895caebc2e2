"""Initial weights that depend only on the seed and each parameter's global identity.

megatron-core draws a model's initial weights from the process's random stream, which the
runtime seeds per pipeline stage, and on GPU from a stream offset per tensor-parallel rank;
so the weights of layer l depend on which stage and rank built it. After the model (chunk)
is built, ``init_by_global_name`` redraws every randomly initialised parameter from a CPU
generator seeded by ``(seed, global name)``: it generates the full, unsharded tensor with
the init function megatron used for that parameter, casts it to the parameter dtype and
copies this rank's tensor-parallel slice (cut exactly as megatron's CPU initialisation cuts
its master weight, ``partition_dim`` and ``partition_stride``). The global name is the
checkpoint name: ``decoder.layers.<l-1>.`` with l the global layer number, depth queries by
global read site, a tied output weight on the last stage by the word embedding's name.

Constant parameters (norm gains and biases, zero-initialised depth queries, biases) are left
as built: they do not depend on the layout. A parameter that no rule covers is an error, so
a new parameter cannot silently keep a layout-dependent initialisation.
"""

from __future__ import annotations

import hashlib
from typing import Callable, Dict, Optional, Tuple

import torch
from torch import nn

from megatron_lrattn.model.layer import DepthQuery

OUTPUT_PROJECTIONS = ("linear_proj", "linear_fc2")
"""Modules initialised with ``config.output_layer_init_method`` (std / sqrt(2L)),
megatron's choice for the attention and MLP output projections (with r key rows under
projected keys)."""

EMBEDDINGS = ("word_embeddings", "position_embeddings")
"""Modules initialised with ``config.embedding_init_method``."""

INPUT_PROJECTIONS = ("linear_qkv", "linear_fc1", "output_layer", "embedding_key_proj")
"""Modules initialised with ``config.init_method``."""

CONSTANT_LEAVES = ("bias", "layer_norm_weight", "layer_norm_bias")
"""Parameter names that are constant at initialisation in every module (biases are zeroed,
TE's fused-norm gains are ones)."""

TIED_OUTPUT = "output_layer.weight"
WORD_EMBEDDING = "embedding.word_embeddings.weight"


def parameter_seed(seed: int, global_name: str) -> int:
    """The generator seed of one parameter: 63 bits of SHA-256 of ``"<seed>:<name>"``
    (stable across processes and Python versions, unlike ``hash``)."""
    digest = hashlib.sha256(f"{seed}:{global_name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def global_parameter_name(name: str, model: nn.Module) -> str:
    """The layout-independent name of ``model``'s parameter ``name``: a stage-local
    ``decoder.layers.<i>.`` becomes ``decoder.layers.<layer_number - 1>.`` (megatron's
    ``layer_number`` is global and 1-based); a tied output weight (the last stage's copy of
    the word embedding under PP) becomes the word embedding's name. Other names (embedding,
    final norm, output layer, depth queries keyed by global site, the embedding key
    projection) exist once per model and are already global."""
    if name.startswith("decoder.layers."):
        _, _, local, rest = name.split(".", 3)
        layer = model.decoder.layers[int(local)]
        return f"decoder.layers.{layer.layer_number - 1}.{rest}"
    if name == TIED_OUTPUT and getattr(model, "share_embeddings_and_output_weights", False):
        return WORD_EMBEDDING
    return name


def _is_norm(module: nn.Module) -> bool:
    # a norm module (torch's, megatron's FusedLayerNorm / WrappedTorchNorm, TE's RMSNorm),
    # not a fused norm + linear such as TE's LayerNormLinear, whose weight is a projection's
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or (
        type(module).__name__.lower().endswith("norm"))


def init_rule(module_path: str, module: nn.Module, leaf: str, config) -> Optional[Callable]:
    """The init function megatron-core (or our block) applies to one parameter, None for a
    constant one.

    Args:
        module_path: the owning module's name in the model (``decoder.layers.0.mlp.linear_fc1``).
        module: that module.
        leaf: the parameter's attribute name (``weight``, ``bias``, ...).
        config: the model's ``TransformerConfig``.

    Raises:
        ValueError: no rule covers the parameter.
    """
    last = module_path.rsplit(".", 1)[-1]
    if leaf in CONSTANT_LEAVES or isinstance(module, DepthQuery) or _is_norm(module):
        return None
    if leaf == "weight":
        if last in OUTPUT_PROJECTIONS:
            return config.output_layer_init_method
        if last in EMBEDDINGS:
            return config.embedding_init_method
        if last in INPUT_PROJECTIONS:
            return config.init_method
    raise ValueError(
        f"parameter {module_path}.{leaf} ({type(module).__name__}) has no layout-independent "
        "initialisation rule; add one to megatron_lrattn/model/init.py"
    )


def tp_slice(full: torch.Tensor, param: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    """This tensor-parallel rank's part of the full tensor ``full``, cut as megatron's
    ``_initialize_affine_weight_cpu`` cuts its master weight: ``tp * partition_stride``
    equal pieces along ``partition_dim``, pieces ``tp_rank, tp_rank + tp, ...`` (stride 2:
    the rank's part of the gate and of the up projection of a gated MLP)."""
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    pieces = full.chunk(tp * stride, dim=dim)
    return torch.cat(pieces[tp_rank::tp], dim=dim)


def full_shape(param: torch.Tensor, tp: int) -> Tuple[int, ...]:
    """The unsharded shape of a (possibly tensor-parallel) parameter."""
    shape = list(param.shape)
    if tp > 1 and getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= tp
    return tuple(shape)


def draw_full(seed: int, global_name: str, shape, init: Callable) -> torch.Tensor:
    """The full fp32 tensor of one parameter: ``init`` applied to an empty CPU tensor with
    the process's CPU generator seeded by ``parameter_seed(seed, global_name)`` and its
    previous state restored afterwards (other streams, dropout's included, are untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(parameter_seed(seed, global_name))
        full = torch.empty(shape, dtype=torch.float32)
        init(full)
    return full


def _check_constant(name: str, param: torch.Tensor) -> None:
    if param.numel() and not bool((param == param.reshape(-1)[0]).all()):
        raise ValueError(f"parameter {name} is treated as constant at initialisation but its "
                         "values differ; give it a rule in megatron_lrattn/model/init.py")


def init_by_global_name(model: nn.Module, config, seed: int) -> Dict[str, str]:
    """Redraw ``model``'s randomly initialised parameters from ``(seed, global name)``.

    Args:
        model: a freshly built ``GPTModel`` (one pipeline chunk), before DDP wrapping.
        config: its config (``init_method``, ``output_layer_init_method``,
            ``embedding_init_method``).
        seed: the run's seed (``--seed``).

    Returns:
        {local parameter name: global name} of the parameters redrawn.

    Raises:
        ValueError: a parameter has no rule, or one treated as constant is not constant.
    """
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    redrawn = {}
    with torch.no_grad():
        for module_path, module in model.named_modules():
            for leaf, param in module.named_parameters(recurse=False):
                name = f"{module_path}.{leaf}" if module_path else leaf
                init = init_rule(module_path, module, leaf, config)
                global_name = global_parameter_name(name, model)
                if global_name == WORD_EMBEDDING:
                    init = config.embedding_init_method
                if init is None:
                    _check_constant(name, param)
                    continue
                full = draw_full(seed, global_name, full_shape(param, tp), init)
                param.data.copy_(tp_slice(full.to(param.dtype), param, tp_rank, tp))
                redrawn[name] = global_name
    return redrawn
