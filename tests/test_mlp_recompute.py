"""The MLP that recomputes its SwiGLU output for the output projection's backward
(``megatron_lrattn.model.mlp``): same loss and bit-identical gradients as megatron-core's MLP,
the SwiGLU output no longer kept, and megatron-core's forward wherever the recompute does not
apply."""
from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch
from helpers import build_gpt, model_parallel_1x1, tiny_batch, tiny_config


@pytest.fixture(scope="module")
def mp():
    with model_parallel_1x1():
        yield


def _run(config, *, hooks=None):
    """Loss, named gradients, and weak references to the tensors each MLP handed its
    output projection (alive after the forward only if something kept them)."""
    model = build_gpt(config, seed=7)
    model.train()
    handed = []
    for layer in model.decoder.layers:
        layer.mlp.linear_fc2.register_forward_pre_hook(
            lambda m, args: handed.append(weakref.ref(args[0])))
    tokens, pos, labels = tiny_batch(3)
    if hooks is not None:
        with torch.autograd.graph.saved_tensors_hooks(*hooks):
            loss = model(tokens, pos, None, labels=labels).float().mean()
    else:
        loss = model(tokens, pos, None, labels=labels).float().mean()
    gc.collect()
    alive = [r() is not None for r in handed]
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), grads, alive, model


@pytest.mark.parametrize("residual", ["standard", "attnres", "lr_attnres"])
def test_recomputed_swiglu_gives_bit_identical_gradients_and_is_not_kept(mp, residual):
    from megatron_lrattn.model.mlp import RecomputedActivationMLP

    cfg = tiny_config(residual, **({} if residual == "standard" else {"num_blocks": 2}))
    off = dataclasses.replace(cfg, recompute_mlp_activation=False)
    loss_on, g_on, alive_on, model = _run(cfg)
    loss_off, g_off, alive_off, _ = _run(off)
    assert all(isinstance(layer.mlp, RecomputedActivationMLP) for layer in model.decoder.layers)
    assert torch.equal(loss_on, loss_off)
    assert g_on.keys() == g_off.keys()
    for name in g_on:
        assert torch.equal(g_on[name], g_off[name]), name
    # megatron-core's MLP keeps the SwiGLU output for fc2's weight gradient; ours does not
    assert alive_off == [True] * 2 and alive_on == [False] * 2


def test_projected_keys_output_projection_recomputes_too(mp):
    cfg = tiny_config("lr_attnres", key_type="projected", key_rank=8, num_blocks=2)
    loss_on, g_on, alive_on, _ = _run(cfg)
    loss_off, g_off, _, _ = _run(dataclasses.replace(cfg, recompute_mlp_activation=False))
    assert torch.equal(loss_on, loss_off)
    assert all(torch.equal(g_on[n], g_off[n]) for n in g_on)
    assert alive_on == [False] * 2


def test_mlp_with_bias_and_caller_hooks_take_megatrons_forward(mp):
    """Configurations the recompute does not cover keep megatron-core's forward (the SwiGLU
    output stays saved): a biased MLP, and a caller's own saved-tensor hooks (activation
    offloading must see every saved tensor)."""
    _, _, alive, _ = _run(tiny_config("standard", bias=True))
    assert alive == [True] * 2
    seen = []
    _, _, alive, _ = _run(tiny_config("standard"),
                          hooks=(lambda t: seen.append(t.shape) or t, lambda t: t))
    assert alive == [True] * 2 and seen


def test_no_grad_forward_equals_training_forward(mp):
    cfg = tiny_config("lr_attnres", num_blocks=2)
    model = build_gpt(cfg, seed=7)
    tokens, pos, _ = tiny_batch(3)
    with torch.no_grad():
        ref = model(tokens, pos, None)
    assert torch.equal(model(tokens, pos, None).detach(), ref)


def test_flag_reaches_the_config():
    from megatron_lrattn.training.arguments import parse_args

    from megatron_lrattn.training.builder import build_config

    for flags, value in (([], True), (["--no-recompute-mlp-activation"], False)):
        args = parse_args(["--preset", "tiny"] + flags)
        assert args.recompute_mlp_activation is value
        assert build_config(args, bf16=False).recompute_mlp_activation is value


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="megatron-core's compiled SwiGLU "
                    "path (bias_activation_fusion) runs on CUDA")
def test_fused_swiglu_path_on_gpu_is_bit_identical_and_frees_memory(mp):
    cfg = tiny_config("lr_attnres", num_blocks=2, hidden_size=256, ffn_hidden_size=1024)
    cfg = dataclasses.replace(cfg, bias_activation_fusion=True, bf16=True,
                              params_dtype=torch.bfloat16, use_cpu_initialization=False)
    out = {}
    for on in (True, False):
        c = dataclasses.replace(cfg, recompute_mlp_activation=on)
        model = build_gpt(c, seed=7, seq_length=512).cuda()
        tokens, pos, labels = (t.cuda() for t in tiny_batch(3, seq_length=512, batch=4))
        # a first step makes what megatron-core allocates once (rotary cache, buffers)
        model(tokens, pos, None, labels=labels).float().mean().backward()
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = model(tokens, pos, None, labels=labels).float().mean()
        kept = torch.cuda.memory_allocated() - base
        loss.backward()
        out[on] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, kept)
        del model, loss
    (l1, g1, kept1), (l0, g0, kept0) = out[True], out[False]
    assert torch.equal(l1, l0)
    assert all(torch.equal(g1[n], g0[n]) for n in g1)
    y_bytes = 2 * 512 * 4 * 1024 * 2  # two layers' [s, b, f] bf16 SwiGLU outputs
    assert kept0 - kept1 >= 0.9 * y_bytes, (kept0, kept1, y_bytes)
