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
