"""The sequence-parallel-aware PyTorch norm of the local spec."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import tiny_config


@pytest.mark.parametrize("normalization,cls", [("RMSNorm", "RMSNorm"),
                                               ("LayerNorm", torch.nn.LayerNorm)])
@pytest.mark.parametrize("sp", [False, True])
def test_norm_marks_parameters_for_sequence_parallel_reduction(normalization, cls, sp):
    """The module is PyTorch's own norm; every parameter carries ``sequence_parallel`` as
    configured (``finalize_model_grads`` all-reduces those across TP)."""
    from megatron_lrattn.model import norms
    from megatron_lrattn.model.norms import SequenceParallelTorchNorm

    cls = getattr(norms, cls) if isinstance(cls, str) else cls
    config = tiny_config("lr_attnres", num_blocks=2)
    config.normalization = normalization
    config.sequence_parallel = sp
    norm = SequenceParallelTorchNorm(config=config, hidden_size=32, eps=1e-5)
    assert type(norm) is cls and norm.eps == 1e-5
    params = list(norm.parameters())
    assert params and all(p.sequence_parallel is sp for p in params)


def test_norm_matches_megatron_torch_norm_without_sp():
    """Without sequence parallelism the output equals megatron's ``WrappedTorchNorm``."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megatron_lrattn.model.norms import SequenceParallelTorchNorm

    config = tiny_config("standard")
    ours = SequenceParallelTorchNorm(config=config, hidden_size=32, eps=1e-5)
    theirs = WrappedTorchNorm(config=config, hidden_size=32, eps=1e-5)
    with torch.no_grad():
        w = torch.randn(32)
        ours.weight.copy_(w)
        theirs.weight.copy_(w)
    x = torch.randn(5, 2, 32)
    assert torch.equal(ours(x), theirs(x))


def test_norm_refuses_unsupported_settings():
    from megatron_lrattn.model.norms import SequenceParallelTorchNorm

    config = tiny_config("standard")
    config.normalization = "L2Norm"
    with pytest.raises(ValueError, match="RMSNorm or LayerNorm"):
        SequenceParallelTorchNorm(config=config, hidden_size=32)
    config = tiny_config("standard")
    config.layernorm_zero_centered_gamma = True
    with pytest.raises(ValueError, match="zero_centered_gamma"):
        SequenceParallelTorchNorm(config=config, hidden_size=32)


def test_specs_use_the_norm_everywhere():
    """Layer spec: input and pre-MLP norms (and q/k norms when enabled); block spec: the
    final norm, one layer spec per layer built on this stage."""
    from megatron_lrattn.model.norms import SequenceParallelTorchNorm
    from megatron_lrattn.model.spec import get_lr_attnres_block_spec, get_lr_attnres_layer_spec
    from tests.helpers import model_parallel_1x1

    config = tiny_config("lr_attnres", num_blocks=2)
    spec = get_lr_attnres_layer_spec(config, qk_layernorm=True, core_attention="local")
    sub = spec.submodules
    assert sub.input_layernorm is SequenceParallelTorchNorm
    assert sub.pre_mlp_layernorm is SequenceParallelTorchNorm
    attn = sub.self_attention
    attn_sub = attn.submodules if hasattr(attn, "submodules") else attn.keywords["submodules"]
    assert attn_sub.q_layernorm is SequenceParallelTorchNorm
    assert attn_sub.k_layernorm is SequenceParallelTorchNorm
    with model_parallel_1x1():
        block = get_lr_attnres_block_spec(config, spec)
    assert block.layer_norm is SequenceParallelTorchNorm
    assert block.layer_specs == [spec] * config.num_layers
