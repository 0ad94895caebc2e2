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


def _fused_pair(d: int, eps, device: str):
    from megatron_lrattn.model.norms import SequenceParallelTorchNorm

    config = tiny_config("standard")
    ref = SequenceParallelTorchNorm(config=config, hidden_size=d, eps=eps).to(device)
    config.liger_rms_norm = True
    fused = SequenceParallelTorchNorm(config=config, hidden_size=d, eps=eps).to(device)
    assert not ref.fused and fused.fused
    with torch.no_grad():
        w = torch.randn(d, device=device) * 0.5 + 1.0
        ref.weight.copy_(w)
        fused.weight.copy_(w)
    return ref, fused


def _grads(norm, x, dy):
    x = x.detach().clone().requires_grad_(True)
    norm.zero_grad(set_to_none=True)
    y = norm(x)
    y.backward(dy)
    return y.detach(), x.grad, norm.weight.grad


def test_fused_flag_on_cpu_inputs_is_torchs_norm():
    """``liger_rms_norm`` applies to CUDA inputs only: on CPU the module is torch's."""
    ref, fused = _fused_pair(32, 1e-5, "cpu")
    x, dy = torch.randn(6, 3, 32), torch.randn(6, 3, 32)
    for a, b in zip(_grads(ref, x, dy), _grads(fused, x, dy)):
        assert torch.equal(a, b)


def test_the_command_lines_turn_it_on_where_liger_is_installed(monkeypatch):
    import importlib.util

    from megatron_lrattn.training import fusions
    from megatron_lrattn.training.arguments import parse_args

    real = importlib.util.find_spec
    for installed in (True, False):
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, _i=installed: (
            (object() if _i else None) if name == "liger_kernel" else real(name, *a)))
        cfg = fusions.fusion_config(parse_args(["--preset", "tiny"]), cuda=True)
        assert cfg.get("liger_rms_norm", False) is installed
        cfg = fusions.fusion_config(parse_args(["--preset", "tiny", "--no-rms-norm-fusion"]),
                                    cuda=True)
        assert "liger_rms_norm" not in cfg
        cfg = fusions.fusion_config(parse_args(["--preset", "tiny", "--normalization",
                                                "LayerNorm"]), cuda=True)
        assert "liger_rms_norm" not in cfg
    assert "liger_rms_norm" not in fusions.fusion_config(parse_args(["--preset", "tiny"]),
                                                         cuda=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="Liger-Kernel's RMSNorm runs on CUDA "
                    "(GPU box); CPU inputs take torch's path, tested above")
@pytest.mark.parametrize("d,eps", [(1024, 1e-5), (2048, None), (3072, 1e-6), (64, 1e-6)])
def test_liger_rms_norm_matches_torchs(d, eps):
    """Output, input gradient and weight gradient of the fused norm against torch's, bf16,
    [s, b, d] activations as the layers give them (the 0.5b, 1b and 4b widths and a head's)."""
    pytest.importorskip("liger_kernel", reason="Liger-Kernel is not installed")
    torch.manual_seed(0)
    ref, fused = _fused_pair(d, eps, "cuda")
    ref, fused = ref.to(torch.bfloat16), fused.to(torch.bfloat16)
    x = torch.randn(512, 8, d, device="cuda", dtype=torch.bfloat16) * 3.0
    dy = torch.randn_like(x)
    (y0, dx0, dw0), (y1, dx1, dw1) = _grads(ref, x, dy), _grads(fused, x, dy)
    # both compute in fp32 and round once: outputs agree to bf16 rounding
    torch.testing.assert_close(y1.float(), y0.float(), rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(dx1.float(), dx0.float(), rtol=1.6e-2, atol=1e-2)
    # the weight gradient sums 4096 rows in fp32 in a different order, rounded to bf16 once
    torch.testing.assert_close(dw1.float(), dw0.float(), rtol=1.6e-2,
                               atol=1e-2 * float(dw0.float().abs().max()))
    assert dw1.dtype == dw0.dtype == torch.bfloat16
