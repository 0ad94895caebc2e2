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


@pytest.mark.parametrize("q_per_group,rot_dim,norm", [(1, 8, False), (2, 8, False),
                                                      (3, 4, False), (2, 8, True)])
def test_split_rotary_to_heads_equals_megatron_split_and_rotary(mp, q_per_group, rot_dim, norm):
    """One function for megatron's QKV split, its QK-norm, its rotary embedding and the SDPA
    layout: the same q, k, v and the same gradients of the projection and of the norm gains
    (exact in fp32 on CPU)."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    from megatron_lrattn.model.attention import rotary_tables, split_rotary_to_heads

    g = torch.Generator().manual_seed(2)
    s, b, ng, hn = 10, 2, 3, 8
    mixed = torch.randn(s, b, ng, (q_per_group + 2) * hn, generator=g, requires_grad=True)
    qf, kf = (torch.randn(s + 3, 1, 1, rot_dim, generator=g) for _ in range(2))
    cfg = tiny_config("standard")
    qn, kn = torch.nn.RMSNorm(hn, eps=1e-5), torch.nn.RMSNorm(hn, eps=1e-5)
    with torch.no_grad():
        qn.weight.uniform_(0.5, 1.5, generator=g)
        kn.weight.uniform_(0.5, 1.5, generator=g)
    q, k, v = torch.split(mixed, [q_per_group * hn, hn, hn], dim=3)  # megatron's split
    q = q.reshape(s, b, -1, hn)
    if norm:
        q, k = qn(q), kn(k)
    ref = (apply_rotary_pos_emb(q, qf[:s], config=cfg).permute(1, 2, 0, 3),
           apply_rotary_pos_emb(k, kf[:s], config=cfg).permute(1, 2, 0, 3),
           v.permute(1, 2, 0, 3))
    out = split_rotary_to_heads(mixed, *rotary_tables(qf, mixed.dtype),
                                *rotary_tables(kf, mixed.dtype), q_per_group,
                                *((qn.weight, kn.weight, 1e-5) if norm else ()))
    assert [o.shape for o in out] == [r.shape for r in ref]
    assert out[0].shape == (b, ng * q_per_group, s, hn)
    for o, r in zip(out, ref):
        assert torch.equal(o, r)
    grads = [torch.randn(r.shape, generator=g) for r in ref]
    wrt = [mixed] + ([qn.weight, kn.weight] if norm else [])
    for a, r in zip(torch.autograd.grad(out, wrt, grads), torch.autograd.grad(ref, wrt, grads)):
        assert torch.equal(a, r)


@pytest.mark.parametrize("qk_layernorm,groups,normalization,fused", [
    (False, 4, "RMSNorm", True), (False, 2, "RMSNorm", True), (True, 2, "RMSNorm", True),
    (True, 4, "LayerNorm", False)])
def test_the_qkv_split_joins_the_rotary_kernel_where_it_can(mp, monkeypatch, qk_layernorm,
                                                            groups, normalization, fused):
    """The model takes the joined path without QK-norm and with an RMSNorm one (grouped-query
    attention included), megatron's split with a LayerNorm one; either way the losses and
    every gradient equal those of megatron's own attention."""
    from megatron_lrattn.model import attention
    from megatron_lrattn.model.spec import get_lr_attnres_layer_spec

    calls = []
    real = attention.split_rotary_to_heads
    monkeypatch.setattr(attention, "split_rotary_to_heads",
                        lambda *a: calls.append(1) or real(*a))
    cfg = tiny_config("standard", num_layers=2, num_query_groups=groups)
    cfg.normalization = normalization
    fused_spec = get_lr_attnres_layer_spec(cfg, core_attention="sdpa", qk_layernorm=qk_layernorm)
    tokens, position_ids, labels = tiny_batch(seed=4)
    losses, grads = [], []
    for spec in (fused_spec, _stock_self_attention(fused_spec)):
        seed_all(5)
        model = build_gpt(cfg, seed=7, spec=spec)
        loss = model(tokens, position_ids, None, labels=labels).float().mean()
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert len(calls) == (2 if fused else 0)  # once per layer, in the first model only
    assert torch.equal(losses[0], losses[1])
    for n in grads[0]:
        assert torch.equal(grads[0][n], grads[1][n]), n


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
    fused_spec = get_lr_attnres_layer_spec(cfg, core_attention="sdpa")
    stock_spec = _stock_self_attention(fused_spec)
    tokens, position_ids, labels = tiny_batch(seed=3)
    losses, grads = [], []
    for spec in (fused_spec, stock_spec):
        seed_all(5)
        model = build_gpt(cfg, seed=7, spec=spec)
        loss = model(tokens, position_ids, None, labels=labels).float().mean()
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
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
                    reason="the joined split and rotary kernel is compiled on CUDA only (GPU box)")
@pytest.mark.parametrize("q_per_group,norm", [(1, False), (4, False), (4, True)])
def test_compiled_split_rotary_matches_the_eager_formula(q_per_group, norm):
    """The compiled split + rotary + layout (one kernel each way) against the eager formula
    in bf16: outputs within 2 ulps, the projection's gradient likewise, and SDPA accepts
    the layouts it returns."""
    import torch.nn.functional as F

    from megatron_lrattn.model import attention

    g = torch.Generator(device="cuda").manual_seed(5)
    s, b, ng, hn = 512, 2, 4, 128
    mixed = torch.randn(s, b, ng, (q_per_group + 2) * hn, device="cuda", dtype=torch.bfloat16,
                        generator=g, requires_grad=True)
    freqs = torch.randn(s, 1, 1, hn, device="cuda", generator=g)
    norms = ()
    if norm:
        norms = tuple(torch.rand(hn, device="cuda", generator=g, dtype=torch.bfloat16) + 0.5
                      for _ in range(2)) + (1e-6,)
    ref = attention.split_rotary_to_heads(mixed, *attention.rotary_tables(freqs, mixed.dtype),
                                          *attention.rotary_tables(freqs, mixed.dtype),
                                          q_per_group, *norms)
    out = attention._split_rotary(mixed, freqs, freqs, q_per_group, norms)
    close = dict(rtol=2 ** -7, atol=2 ** -7)
    for o, r in zip(out, ref):
        assert o.shape == r.shape
        torch.testing.assert_close(o.float(), r.float(), **close)
    grads = [torch.randn(r.shape, device="cuda", dtype=r.dtype, generator=g) for r in ref]
    (g_ref,) = torch.autograd.grad(ref, mixed, grads)
    (g_out,) = torch.autograd.grad(out, mixed, grads)
    torch.testing.assert_close(g_out.float(), g_ref.float(), **close)
    y = F.scaled_dot_product_attention(*out, is_causal=True, enable_gqa=q_per_group > 1)
    y_ref = F.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=q_per_group > 1)
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=2 ** -6, atol=2 ** -6)
