"""SDPA core attention with the rotary embedding applied inside it, against megatron-core's
own rotary path (exact in fp32 on CPU: the same ops in the same order)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import build_gpt, model_parallel_1x1, seed_all, tiny_batch, tiny_config


@pytest.fixture
def mp():
    with model_parallel_1x1():
        yield


@pytest.mark.parametrize("rot_dim", [8, 4])
def test_rotary_to_heads_equals_megatron_rotary(mp, rot_dim):
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    from megatron_lrattn.model.attention import rotary_tables, rotary_to_heads

    g = torch.Generator().manual_seed(0)
    s, b, h, hn = 12, 2, 3, 8
    t = torch.randn(s, b, h, hn, generator=g, requires_grad=True)
    freqs = torch.randn(s + 4, 1, 1, rot_dim, generator=g)
    cfg = tiny_config("standard")
    ref = apply_rotary_pos_emb(t, freqs[:s], config=cfg).permute(1, 2, 0, 3)
    out = rotary_to_heads(t, *rotary_tables(freqs, t.dtype))
    assert torch.equal(out, ref)
    grad = torch.randn(out.shape, generator=g)
    (g_ref,) = torch.autograd.grad(ref, t, grad)
    (g_out,) = torch.autograd.grad(out, t, grad)
    assert torch.equal(g_out, g_ref)


def _megatron_split_rotary(mixed, q_freqs, k_freqs, q_per_group, norms, cfg):
    """Megatron's path: split views of the QKV projection, the QK-norm modules' formula,
    ``apply_rotary_pos_emb``, then SDPA's [b, heads, s, hn] layout."""
    import torch.nn.functional as F
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    s, b, ng, width = mixed.shape
    hn = width // (q_per_group + 2)
    q, k, v = torch.split(mixed, [q_per_group * hn, hn, hn], dim=3)
    q = q.reshape(s, b, -1, hn)
    if norms:
        q, k = F.rms_norm(q, (hn,), norms[0], norms[2]), F.rms_norm(k, (hn,), norms[1], norms[2])
    return (apply_rotary_pos_emb(q, q_freqs[:s], config=cfg).permute(1, 2, 0, 3),
            apply_rotary_pos_emb(k, k_freqs[:s], config=cfg).permute(1, 2, 0, 3),
            v.permute(1, 2, 0, 3))


@pytest.mark.parametrize("q_per_group,rot_dim,norm", [(1, 8, False), (2, 8, False),
                                                      (3, 4, False), (2, 8, True),
                                                      (1, 4, True)])
def test_split_rotary_to_heads_equals_megatron_split_and_rotary(mp, q_per_group, rot_dim, norm):
    """Megatron's QKV split, QK-norm, rotary embedding and SDPA layout as one autograd node
    with its own backward: the same q, k, v (exact) and the same gradients of the projection
    and of the norm gains (exact without QK-norm, whose backward is autograd's terms; within
    fp32 rounding with it, whose backward is the closed form), in fp32 on CPU."""
    from megatron_lrattn.model.attention import split_rotary_to_heads

    g = torch.Generator().manual_seed(2)
    s, b, ng, hn = 10, 2, 3, 8
    mixed = torch.randn(s, b, ng, (q_per_group + 2) * hn, generator=g, requires_grad=True)
    qf, kf = (torch.randn(s + 3, 1, 1, rot_dim, generator=g) for _ in range(2))
    norms = ()
    if norm:
        norms = tuple(torch.empty(hn).uniform_(0.5, 1.5, generator=g).requires_grad_()
                      for _ in range(2)) + (1e-5,)
    ref = _megatron_split_rotary(mixed, qf, kf, q_per_group, norms, tiny_config("standard"))
    out = split_rotary_to_heads(mixed, qf, kf, q_per_group, norms)
    assert out[0].shape == (b, ng * q_per_group, s, hn)
    for o, r in zip(out, ref):
        assert o.shape == r.shape
        assert torch.equal(o, r)
    grads = [torch.randn(r.shape, generator=g) for r in ref]
    wrt = [mixed] + list(norms[:2])
    for a, r in zip(torch.autograd.grad(out, wrt, grads), torch.autograd.grad(ref, wrt, grads)):
        if norm:
            torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(a, r)


def test_split_rotary_backward_takes_gradients_in_any_strides(mp):
    """The node's backward reads the incoming gradients in the strides they come in (an
    attention kernel's own layout): the same projection gradient from contiguous and from
    transposed-storage gradients, and a gradient for v only (q and k unused)."""
    from megatron_lrattn.model.attention import split_rotary_to_heads

    g = torch.Generator().manual_seed(3)
    s, b, ng, hn, qpg = 6, 2, 2, 8, 2
    mixed = torch.randn(s, b, ng, (qpg + 2) * hn, generator=g, requires_grad=True)
    qf = torch.randn(s, 1, 1, hn, generator=g)
    out = split_rotary_to_heads(mixed, qf, qf, qpg)
    grads = [torch.randn(o.shape, generator=g) for o in out]
    (dense,) = torch.autograd.grad(out, mixed, grads, retain_graph=True)
    # the same values stored [b, s, heads, hn] and viewed [b, heads, s, hn]
    strided = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in grads]
    assert not strided[0].is_contiguous()
    (other,) = torch.autograd.grad(out, mixed, strided, retain_graph=True)
    assert torch.equal(dense, other)
    (only_v,) = torch.autograd.grad(out[2], mixed, grads[2])
    ref = torch.zeros_like(mixed)
    ref[..., -hn:] = grads[2].permute(2, 0, 1, 3)
    assert torch.equal(only_v, ref)


@pytest.mark.parametrize("qk_layernorm,groups,normalization,fused", [
    (False, 4, "RMSNorm", True), (False, 2, "RMSNorm", True), (True, 2, "RMSNorm", True),
    (True, 4, "LayerNorm", False)])
def test_the_qkv_split_joins_the_rotary_kernel_where_it_can(mp, monkeypatch, qk_layernorm,
                                                            groups, normalization, fused):
    """The model takes the joined path without QK-norm and with an RMSNorm one (grouped-query
    attention included), megatron's split with a LayerNorm one; either way the losses equal
    those of megatron's own attention, and so does every gradient (within fp32 rounding
    with the RMSNorm QK-norm, exactly otherwise)."""
    from megatron_lrattn.model import attention
    from megatron_lrattn.model.spec import get_lr_attnres_layer_spec

    calls = []
    real = attention.split_rotary_to_heads
    monkeypatch.setattr(attention, "split_rotary_to_heads",
                        lambda *a: calls.append(1) or real(*a))
    cfg = tiny_config("standard", num_layers=2, num_query_groups=groups)
    cfg.normalization = normalization
    fused_spec = get_lr_attnres_layer_spec(cfg, core_attention="sdpa", qk_layernorm=qk_layernorm)
    losses, grads = _losses_and_grads(cfg, (fused_spec, _stock_self_attention(fused_spec)), 4)
    assert len(calls) == (2 if fused else 0)  # once per layer, in the first model only
    assert torch.equal(losses[0], losses[1])
    for n in grads[0]:
        if qk_layernorm and fused:  # the QK-norm's closed-form backward: fp32 rounding
            torch.testing.assert_close(grads[0][n], grads[1][n], rtol=1e-5, atol=1e-7, msg=n)
        else:
            assert torch.equal(grads[0][n], grads[1][n]), n


def _losses_and_grads(cfg, specs, batch_seed: int):
    """The loss and every parameter's gradient of one forward-backward of a model built
    (same seeds) from each layer spec in ``specs``, on one random batch."""
    tokens, position_ids, labels = tiny_batch(seed=batch_seed)
    losses, grads = [], []
    for spec in specs:
        seed_all(5)
        model = build_gpt(cfg, seed=7, spec=spec)
        loss = model(tokens, position_ids, None, labels=labels).float().mean()
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    return losses, grads


def _stock_self_attention(spec):
    """The same layer spec with megatron's own ``SelfAttention`` (rotary applied outside the
    core)."""
    from megatron.core.transformer.attention import SelfAttention

    from megatron_lrattn.model.spec import _replace_submodules

    attn = spec.submodules.self_attention
    assert attn.module is not SelfAttention
    stock = dataclasses.replace(attn, module=SelfAttention)
    return _replace_submodules(spec, self_attention=stock)


@pytest.mark.parametrize("residual", ["standard", "lr_attnres"])
def test_sdpa_spec_rotary_inside_core_matches_megatron_rotary(mp, residual):
    from megatron_lrattn.model.spec import get_lr_attnres_layer_spec

    cfg = tiny_config(residual, num_layers=2, **({} if residual == "standard" else {"num_blocks": 3}))
    from megatron.core.transformer.attention import SelfAttention

    fused_spec = get_lr_attnres_layer_spec(cfg, core_attention="sdpa")
    unfused_spec = get_lr_attnres_layer_spec(cfg, core_attention="sdpa", rope_fusion=False)
    assert unfused_spec.submodules.self_attention.module is SelfAttention  # --no-rope-fusion
    assert fused_spec.submodules.self_attention.module is not SelfAttention
    losses, grads = _losses_and_grads(cfg, (fused_spec, unfused_spec), 3)
    assert torch.equal(losses[0], losses[1])
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        assert torch.equal(grads[0][n], grads[1][n]), n


def test_rotary_tables_are_taken_once_per_rotary_tensor():
    from megatron_lrattn.model import attention

    g = torch.Generator().manual_seed(1)
    freqs = torch.randn(16, 1, 1, 8, generator=g)
    t = torch.randn(12, 2, 3, 8, generator=g, dtype=torch.bfloat16)
    first = attention._cached_tables(freqs, t.dtype)
    assert all(a is b for a, b in zip(first, attention._cached_tables(freqs, t.dtype)))
    assert attention._cached_tables(freqs, torch.float32)[0].dtype == torch.float32
    ref = attention.rotary_to_heads(t, *attention.rotary_tables(freqs, t.dtype))
    assert torch.equal(attention._rotary(t, freqs), ref)
    freqs.mul_(2.0)  # changed in place: new tables
    again = attention._cached_tables(freqs, t.dtype)
    assert not torch.equal(again[0], first[0])
    torch.testing.assert_close(again[0], torch.cos(freqs).to(t.dtype), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="the rotary kernel is compiled on CUDA only (GPU box)")
def test_rotary_runs_eager_under_a_dispatch_mode_and_compiled_after_it():
    # A tensor tracer (bench_step's --copies-csv) runs the step under a Python dispatch mode;
    # torch.compile cannot run there, and a frame it skipped stayed eager for the rest of a
    # torch 2.11 process (9.8 ms of rotate-half copies per 1b step). The rotary must run
    # eager inside the mode and compiled again after it.
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_lrattn.model import attention

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    g = torch.Generator(device="cuda").manual_seed(3)
    t = torch.randn(256, 2, 4, 64, device="cuda", dtype=torch.bfloat16, generator=g,
                    requires_grad=True)
    freqs = torch.randn(256, 1, 1, 64, device="cuda", generator=g)
    ref = attention.rotary_to_heads(t, *attention.rotary_tables(freqs, t.dtype)).float()
    # compiled, the products are summed before rounding to bf16: within 2 bf16 ulps
    close = dict(rtol=2 ** -7, atol=2 ** -7)
    torch.testing.assert_close(attention._rotary(t, freqs).float(), ref, **close)  # compiles
    with Ops() as ops:
        inside = attention._rotary(t, freqs)
    assert "cat" in ops.seen, sorted(ops.seen)  # the eager formula ran inside the mode
    torch.testing.assert_close(inside.float(), ref, rtol=0, atol=0)
    with torch.profiler.profile() as prof:
        after = attention._rotary(t, freqs)
    names = sorted({e.name for e in prof.events()})
    assert "aten::cat" not in names, f"the rotary ran eager after the dispatch mode: {names}"
    torch.testing.assert_close(after.float(), ref, **close)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="the split + rotary node runs compiled on CUDA only (GPU box)")
@pytest.mark.parametrize("q_per_group,norm", [(1, False), (4, False), (4, True)])
def test_compiled_split_rotary_matches_megatron_through_sdpa(mp, q_per_group, norm):
    """The compiled split + QK-norm + rotary node (one kernel each way) against megatron's
    eager path in bf16, both feeding SDPA so that the gradients arrive in the attention
    kernel's own strides: the attention output, the projection's gradient and the gains'
    gradients agree to bf16 rounding."""
    import torch.nn.functional as F

    from megatron_lrattn.model.attention import split_rotary_to_heads

    g = torch.Generator(device="cuda").manual_seed(5)
    s, b, ng, hn = 512, 2, 4, 128
    mixed = torch.randn(s, b, ng, (q_per_group + 2) * hn, device="cuda", dtype=torch.bfloat16,
                        generator=g, requires_grad=True)
    freqs = torch.randn(s, 1, 1, hn, device="cuda", generator=g)
    norms = ()
    if norm:
        norms = tuple((torch.rand(hn, device="cuda", generator=g) + 0.5).to(torch.bfloat16)
                      .requires_grad_() for _ in range(2)) + (1e-6,)
    cfg = tiny_config("standard")

    def attend(qkv):
        return F.scaled_dot_product_attention(*qkv, is_causal=True, enable_gqa=q_per_group > 1)

    y_ref = attend(_megatron_split_rotary(mixed, freqs, freqs, q_per_group, norms, cfg))
    y = attend(split_rotary_to_heads(mixed, freqs, freqs, q_per_group, norms))
    close = dict(rtol=2 ** -6, atol=2 ** -6)
    torch.testing.assert_close(y.float(), y_ref.float(), **close)
    dy = torch.randn(y.shape, device="cuda", dtype=y.dtype, generator=g)
    wrt = [mixed] + list(norms[:2])
    for a, r in zip(torch.autograd.grad(y, wrt, dy), torch.autograd.grad(y_ref, wrt, dy)):
        scale = r.float().abs().max()
        torch.testing.assert_close(a.float() / scale, r.float() / scale, **close)
