"""The CUDA fusions of the training step: which config fields they set, that megatron-core
accepts them, that the optimizer switch touches only CUDA tensors, and (on the GPU box) that
the fused step trains like the unfused one."""
from __future__ import annotations

import argparse

import pytest
import torch

from megatron_lrattn.training.fusions import add_fusion_args, fusion_config, use_fused_adamw


def _args(*argv, swiglu=True, bias=False):
    p = argparse.ArgumentParser()
    add_fusion_args(p)
    a = p.parse_args(list(argv))
    a.swiglu, a.disable_bias_linear = swiglu, not bias
    return a


def test_no_fusion_without_cuda():
    assert fusion_config(_args(), cuda=False) == {}


def test_fusions_on_cuda_by_default_and_each_flag_turns_one_off():
    on = fusion_config(_args(), cuda=True)
    assert on == {"bias_activation_fusion": True, "bias_dropout_fusion": True,
                  "cross_entropy_loss_fusion": True, "cross_entropy_fusion_impl": "native",
                  "triton_cross_entropy": True}
    assert fusion_config(_args("--no-bias-swiglu-fusion"), cuda=True)["bias_activation_fusion"] is False
    assert fusion_config(_args("--no-bias-dropout-fusion"), cuda=True)["bias_dropout_fusion"] is False
    assert "cross_entropy_loss_fusion" not in fusion_config(
        _args("--no-cross-entropy-loss-fusion"), cuda=True)
    triton = fusion_config(_args("--cross-entropy-fusion-impl", "triton"), cuda=True)
    assert triton == on
    native = fusion_config(_args("--cross-entropy-fusion-impl", "native"), cuda=True)
    assert "triton_cross_entropy" not in native and native["cross_entropy_loss_fusion"]
    # GeLU without biases has nothing to fuse (megatron-core refuses that combination)
    assert fusion_config(_args(swiglu=False), cuda=True)["bias_activation_fusion"] is False
    assert fusion_config(_args(swiglu=False, bias=True), cuda=True)["bias_activation_fusion"]


@pytest.mark.parametrize("swiglu,bias", [(True, False), (False, True)])
def test_megatron_accepts_the_fused_config(swiglu, bias):
    import torch.nn.functional as F

    from megatron_lrattn.model.config import LRAttnResConfig

    cfg = LRAttnResConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_blocks=2,
                          gated_linear_unit=swiglu, activation_func=F.silu if swiglu else F.gelu,
                          add_bias_linear=bias,
                          **fusion_config(_args(swiglu=swiglu, bias=bias), cuda=True))
    assert cfg.bias_activation_fusion and cfg.cross_entropy_loss_fusion
    cfg = LRAttnResConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_blocks=2,
                          **fusion_config(_args("--cross-entropy-fusion-impl", "triton",
                                                swiglu=swiglu, bias=bias), cuda=True))
    assert cfg.triton_cross_entropy and cfg.cross_entropy_fusion_impl == "native"


class _Wrapper:
    def __init__(self, inner):
        self.optimizer = inner


def test_fused_adamw_switch_leaves_cpu_optimizers_alone():
    p = torch.nn.Parameter(torch.randn(3))
    opt = torch.optim.AdamW([p])
    assert use_fused_adamw(_Wrapper(opt)) == 0
    assert not opt.param_groups[0]["fused"]


def test_fused_adamw_switch_can_be_turned_back():
    """A loaded checkpoint's parameter groups carry the writer's setting; the switch resets
    it either way (here: groups saved as fused, then set for an unfused run)."""
    p = torch.nn.Parameter(torch.randn(3))
    opt = torch.optim.AdamW([p])
    opt.param_groups[0].update(fused=True, foreach=False)
    assert use_fused_adamw(_Wrapper(opt), enabled=False) == 0
    assert opt.param_groups[0]["fused"] is None and opt.param_groups[0]["foreach"] is None
    p.grad = torch.ones(3)
    opt.step()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_adamw_matches_multi_tensor_adamw_on_cuda():
    g = torch.Generator(device="cuda").manual_seed(0)
    ps = [torch.randn(64, 48, device="cuda", generator=g) for _ in range(3)]
    a = [torch.nn.Parameter(x.clone()) for x in ps]
    b = [torch.nn.Parameter(x.clone()) for x in ps]
    oa = torch.optim.AdamW(a, lr=1e-2, weight_decay=0.1)
    ob = torch.optim.AdamW(b, lr=1e-2, weight_decay=0.1)
    assert use_fused_adamw(_Wrapper(ob)) == 1
    assert ob.param_groups[0]["fused"] and not oa.param_groups[0]["fused"]
    for _ in range(5):
        grads = [torch.randn(x.shape, device="cuda", generator=g) for x in ps]
        for pa, pb, gr in zip(a, b, grads):
            pa.grad, pb.grad = gr.clone(), gr.clone()
        oa.step()
        ob.step()
    for pa, pb in zip(a, b):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)


def test_triton_cross_entropy_needs_the_fusion_on():
    """``--cross-entropy-fusion-impl triton`` with ``--no-cross-entropy-loss-fusion`` is a
    contradiction, refused in one line before anything is built."""
    from megatron_lrattn.training.arguments import parse_args
    from megatron_lrattn.training.arg_types import ArgumentError

    for impl in ("triton", "native"):
        with pytest.raises(ArgumentError, match="contradicts --no-cross-entropy-loss-fusion"):
            parse_args(["--preset", "tiny", "--cross-entropy-fusion-impl", impl,
                        "--no-cross-entropy-loss-fusion"])
        assert parse_args(["--preset", "tiny", "--cross-entropy-fusion-impl", impl]
                          ).cross_entropy_fusion_impl == impl
    assert parse_args(["--preset", "tiny"]).cross_entropy_fusion_impl == "triton"
    off = parse_args(["--preset", "tiny", "--no-cross-entropy-loss-fusion"])
    assert not off.cross_entropy_loss_fusion and off.cross_entropy_fusion_impl is None


def test_rope_fusion_fields_of_the_te_spec():
    """The TE spec's rotary fusion (megatron-core's ``apply_rope_fusion`` and
    ``fused_single_qkv_rope``): off with ``--no-rope-fusion`` or without rotary embeddings
    (no TE needed to say so), asked of TE otherwise; the local spec's fields are untouched
    (its fusion lives in the spec, ``get_lr_attnres_layer_spec(rope_fusion=...)``)."""
    from megatron_lrattn.compat import te as te_compat
    from megatron_lrattn.training.fusions import te_rope_fusion

    def te_args(*argv, **fields):
        a = _args(*argv)
        a.transformer_impl, a.qk_layernorm = "transformer_engine", False
        a.position_embedding_type = "rope"
        vars(a).update(fields)
        return a

    off = {"apply_rope_fusion": False, "fused_single_qkv_rope": False}
    assert te_rope_fusion(te_args("--no-rope-fusion")) == off
    assert te_rope_fusion(te_args(position_embedding_type="learned_absolute")) == off
    assert fusion_config(te_args("--no-rope-fusion"), cuda=True)["apply_rope_fusion"] is False
    assert "apply_rope_fusion" not in fusion_config(_args(), cuda=True)  # local spec
    assert _args().rope_fusion and not _args("--no-rope-fusion").rope_fusion
    if te_compat.te_available():
        on = te_rope_fusion(te_args())
        assert on["apply_rope_fusion"] is True
        assert te_rope_fusion(te_args(qk_layernorm=True))["fused_single_qkv_rope"] is False
    else:
        with pytest.raises(te_compat.TEUnavailableError):
            te_rope_fusion(te_args())


def test_megatron_builds_torch_adamw_for_the_one_kernel_step(monkeypatch):
    """Where TE or Apex is installed megatron-core builds their FusedAdam; the one-kernel
    step needs torch's AdamW (its state layout), so the builder switches megatron's choice
    for the build only, and only where the kernel step will run."""
    import megatron.core.optimizer as mcore_optimizer

    from megatron_lrattn.training import builder

    monkeypatch.setattr(mcore_optimizer, "USING_PYTORCH_OPTIMIZER", False)
    with builder._torch_adamw_under_megatron(True):
        assert mcore_optimizer.USING_PYTORCH_OPTIMIZER is True
    assert mcore_optimizer.USING_PYTORCH_OPTIMIZER is False
    with pytest.raises(RuntimeError):
        with builder._torch_adamw_under_megatron(True):
            raise RuntimeError("build failed")
    assert mcore_optimizer.USING_PYTORCH_OPTIMIZER is False
    with builder._torch_adamw_under_megatron(False):
        assert mcore_optimizer.USING_PYTORCH_OPTIMIZER is False
    args = argparse.Namespace(use_distributed_optimizer=False, fused_optimizer_step=True,
                              fused_adamw=True)
    cuda = torch.cuda.is_available()
    assert builder.torch_adamw_for_fused_step(args, bf16=True) is cuda
    assert builder.torch_adamw_for_fused_step(args, bf16=False) is False
    assert builder.torch_adamw_for_fused_step(
        argparse.Namespace(**{**vars(args), "use_distributed_optimizer": True}), bf16=True) is cuda
    for change in ({"fused_optimizer_step": False}, {"fused_adamw": False}):
        assert builder.torch_adamw_for_fused_step(
            argparse.Namespace(**{**vars(args), **change}), bf16=True) is False
