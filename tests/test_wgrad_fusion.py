"""Gradient-accumulation fusion without Apex (``megatron_lrattn.compat.wgrad_fusion``): the
functions against the unfused arithmetic, megatron-core's linear layers and DDP through them
(a training step's losses and gradient buffers equal the unfused step's on CPU, tied and
untied embeddings), and on the GPU box the fused bf16 GEMM against an fp32 reference."""
from __future__ import annotations

import itertools

import pytest
import torch

from megatron_lrattn.compat import wgrad_fusion as wf
from megatron_lrattn.training.fusions import gradient_accumulation_fusion


def _operands(n=48, d_in=24, d_out=16, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g).to(device, dtype)
    dy = torch.randn(n, d_out, generator=g).to(device, dtype)
    main = torch.randn(d_out, d_in, generator=g).to(device)
    return x, dy, main


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_accumulation_is_the_unfused_arithmetic(dtype):
    x, dy, main = _operands(dtype=dtype)
    ref = main.clone()
    ref.add_(dy.t().matmul(x))  # what megatron's DDP hook does with the unfused gradient
    wf.wgrad_gemm_accum_fp32(x, dy, main)
    assert torch.equal(main, ref)


def test_mismatched_shapes_are_refused():
    x, dy, main = _operands()
    with pytest.raises(ValueError, match="do not match"):
        wf.wgrad_gemm_accum_fp32(x, dy, main.t().contiguous())
    with pytest.raises(ValueError, match="do not match"):
        wf.wgrad_gemm_accum_fp32(x[:-1], dy, main)


def test_on_by_default_on_cuda_only_and_the_flag_turns_it_off():
    import argparse

    from megatron_lrattn.training.fusions import add_fusion_args

    p = argparse.ArgumentParser()
    add_fusion_args(p)
    assert gradient_accumulation_fusion(p.parse_args([]), cuda=True)
    assert not gradient_accumulation_fusion(p.parse_args([]), cuda=False)
    assert not gradient_accumulation_fusion(
        p.parse_args(["--no-gradient-accumulation-fusion"]), cuda=True)


def test_install_fills_in_only_what_apex_would_provide(monkeypatch):
    import megatron.core.tensor_parallel.layers as layers

    monkeypatch.setattr(wf, "_installed", [])
    monkeypatch.setattr(layers, "_grad_accum_fusion_available", True)  # "Apex present"
    assert wf.install() == []
    monkeypatch.setattr(layers, "_grad_accum_fusion_available", False)
    monkeypatch.delattr(layers, "fused_weight_gradient_mlp_cuda", raising=False)
    assert len(wf.install()) == 2
    assert layers._grad_accum_fusion_available and layers.fused_weight_gradient_mlp_cuda is wf


def _step_args(tied: bool):
    from megatron_lrattn.cli.profile import parse_args

    argv = ["--preset", "tiny", "--num-layers", "2", "--hidden-size", "64",
            "--ffn-hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "16",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--vocab-size", "128",
            "--arms", "lr_attnres", "--seed", "5"]
    if not tied:
        argv.append("--untie-embeddings-and-output-weights")
    return parse_args(argv)


def _run(args, fused: bool, steps: int = 3):
    from megatron_lrattn.profiling.arms import arm_args
    from megatron_lrattn.profiling.runner import synthetic_batch
    from megatron_lrattn.training.builder import padded_vocab_size
    from megatron_lrattn.training.step import build_train_step, step_config

    a = arm_args(args, args.arm_specs[0])
    config = step_config(a)
    assert not config.gradient_accumulation_fusion  # off on CPU by default
    if fused:
        wf.install()
        config.gradient_accumulation_fusion = True
    torch.manual_seed(0)
    vocab = padded_vocab_size(args.vocab_size, 1)
    step = build_train_step(a, config, vocab, 2, torch.device("cpu"))
    assert step.models[0].module.decoder.layers[0].mlp.linear_fc1.gradient_accumulation_fusion \
        is fused
    batches = [synthetic_batch(2, 16, vocab, torch.device("cpu"), s) for s in range(2)]
    losses, grads = [], []
    for i in range(1, steps + 1):
        losses.append(step.train(itertools.cycle(batches), i).loss)
        grads.append(torch.cat([b.grad_data.clone() for b in step.models[0].buffers]))
    return losses, grads


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="the CPU exactness check (with CUDA the step is built for the GPU)")
@pytest.mark.parametrize("tied", [True, False])
def test_a_training_step_with_the_fusion_equals_the_unfused_step_on_cpu(tied):
    """megatron-core's fused backward and DDP (``grad_added_to_main_grad``; the tied output
    weight's ``zero_out_wgrad``) through our functions: the gradient buffers and the losses
    of three steps are bit-identical to the unfused step's (fp32 on CPU)."""
    from megatron_lrattn.training.runtime import init_runtime, shutdown_runtime

    args = _step_args(tied)
    init_runtime(1, 1, 5)
    try:
        ref_losses, ref_grads = _run(args, fused=False)
        losses, grads = _run(args, fused=True)
    finally:
        shutdown_runtime()
    assert losses == ref_losses
    for g, r in zip(grads, ref_grads):
        assert torch.equal(g, r)
        assert g.abs().sum() > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused GEMM needs a CUDA device")
def test_fused_bf16_gemm_accumulates_in_fp32_on_cuda():
    """On CUDA the bf16 product accumulates into the fp32 buffer in the GEMM: closer to the
    fp32 product than the unfused bf16 gradient added afterwards, and into the same memory."""
    x, dy, main = _operands(n=4096, d_in=512, d_out=384, dtype=torch.bfloat16, device="cuda")
    exact = main.double() + dy.double().t() @ x.double()
    unfused = main.clone()
    unfused.add_(dy.t().matmul(x))
    ptr = main.data_ptr()
    wf.wgrad_gemm_accum_fp32(x, dy, main)
    torch.cuda.synchronize()
    assert main.data_ptr() == ptr and main.dtype == torch.float32
    err_fused = (main.double() - exact).abs().max().item()
    err_unfused = (unfused.double() - exact).abs().max().item()
    assert err_fused < 1e-3 * exact.abs().max().item()
    assert err_fused <= err_unfused
