"""The foreach gradient norm and scaling (``megatron_lrattn.compat.multi_tensor``) against
megatron-core's own local fallbacks: same results, no host synchronisation in the norm,
installed only where megatron-core uses the fallbacks."""
from __future__ import annotations

import importlib

import pytest
import torch
from torch.overrides import TorchFunctionMode

from megatron_lrattn.compat import multi_tensor as mt
from megatron_lrattn.compat.cpu import apply_cpu_compat


@pytest.fixture(autouse=True)
def _cpu():
    if not torch.cuda.is_available():
        apply_cpu_compat()  # megatron's fallbacks allocate with device="cuda"


def _grads(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    shapes = [(64, 32), (7,), (3, 5, 11), (1,), (128,), (33, 17)]
    return [torch.randn(s, generator=g).mul(10.0 ** (i % 3 - 1)).to(dtype)
            for i, s in enumerate(shapes)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_l2_norm_matches_megatrons_fallback(dtype):
    from megatron.core.utils import local_multi_tensor_l2_norm

    grads = _grads(dtype=dtype)
    ref, _ = local_multi_tensor_l2_norm(2048 * 32, None, [grads], False)
    ours, per = mt.multi_tensor_l2_norm(2048 * 32, None, [grads], False)
    assert per is None and ours.shape == (1,) and ours.dtype == torch.float32
    exact = torch.linalg.vector_norm(torch.cat([g.double().flatten() for g in grads]))
    assert abs(float(ours) - float(exact)) <= 1e-6 * float(exact)
    if dtype == torch.float32:
        assert abs(float(ours) - float(ref)) <= 1e-6 * float(exact)
    else:  # megatron's fallback takes each norm in bf16; ours accumulates in fp32
        assert abs(float(ours) - float(exact)) <= abs(float(ref) - float(exact))
    _, per = mt.multi_tensor_l2_norm(0, None, [grads], True)
    torch.testing.assert_close(per, torch.stack([g.float().norm() for g in grads]))


def test_l2_norm_of_nothing_is_zero():
    norm, _ = mt.multi_tensor_l2_norm(0, None, [[]], False)
    assert norm.shape == (1,) and float(norm) == 0.0


def test_l2_norm_never_reads_a_value_on_the_host():
    class NoHostRead(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            if name in ("item", "__float__", "tolist", "__bool__", "cpu", "numpy"):
                raise AssertionError(f"host read: {name}")
            return func(*args, **(kwargs or {}))

    grads = _grads()
    with NoHostRead():
        norm, _ = mt.multi_tensor_l2_norm(0, None, [grads], False)
    assert float(norm) > 0


@pytest.mark.parametrize("scale", [0.37, 1.0])
@pytest.mark.parametrize("inplace,dst_dtype", [(True, torch.float32), (False, torch.float32),
                                                (False, torch.bfloat16)])
def test_scale_is_bit_identical_to_megatrons_fallback(inplace, dst_dtype, scale):
    """Clipping (in place), and the fp32 -> bf16 weight copy (scale 1.0), with non-finite
    values among the sources."""
    from megatron.core.utils import local_multi_tensor_scale

    src = _grads(1)
    src[0].view(-1)[:3] = torch.tensor([float("inf"), -float("inf"), 3e38])
    ref_dst = [s.clone() if inplace else torch.zeros_like(s, dtype=dst_dtype) for s in src]
    our_dst = [s.clone() if inplace else torch.zeros_like(s, dtype=dst_dtype) for s in src]
    ref_src = ref_dst if inplace else src
    our_src = our_dst if inplace else src
    local_multi_tensor_scale(0, None, [ref_src, ref_dst], scale)
    mt.multi_tensor_scale(0, None, [our_src, our_dst], scale)
    for a, b in zip(ref_dst, our_dst):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_scale_refuses_lists_of_different_lengths():
    with pytest.raises(ValueError, match="3 sources, 2 destinations"):
        mt.multi_tensor_scale(0, None, [_grads()[:3], _grads()[:2]], 2.0)


def _params(seed, device="cpu"):
    grads = [g.to(device) for g in _grads(seed)]
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        params.append(p)
    return params


def test_megatron_clipping_gives_the_same_norm_and_gradients(monkeypatch):
    """megatron-core's get_grad_norm_fp32 and clip_grad_by_total_norm_fp32 with the foreach
    versions installed against the same calls with megatron's fallbacks (on the GPU where
    there is one: megatron's clipping asserts CUDA gradients then)."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.utils import local_multi_tensor_l2_norm, local_multi_tensor_scale

    from megatron_lrattn.training.runtime import single_process_model_parallel

    results = []
    with single_process_model_parallel():  # the norm all-reduces over a process group
        for l2, scale in ((local_multi_tensor_l2_norm, local_multi_tensor_scale),
                          (mt.multi_tensor_l2_norm, mt.multi_tensor_scale)):
            monkeypatch.setattr(clip_grads, "l2_norm_impl", l2)
            monkeypatch.setattr(clip_grads, "multi_tensor_scale_impl", scale)
            params = _params(2, "cuda" if torch.cuda.is_available() else "cpu")
            norm = clip_grads.get_grad_norm_fp32([p.grad for p in params])
            clip_grads.clip_grad_by_total_norm_fp32(params, 1.0, norm)
            results.append((norm, [p.grad for p in params]))
    (n_ref, g_ref), (n_ours, g_ours) = results
    assert abs(n_ref - n_ours) <= 1e-6 * n_ref and n_ref > 1.0  # so the clip applies
    for a, b in zip(g_ref, g_ours):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=0)


def test_install_replaces_only_megatrons_fallbacks(monkeypatch):
    from megatron.core.optimizer import clip_grads, optimizer

    monkeypatch.setattr(mt, "_installed", [])
    sentinel = object()  # what TE or Apex would have put there
    monkeypatch.setattr(clip_grads, "l2_norm_impl", sentinel)
    from megatron.core.utils import local_multi_tensor_scale

    monkeypatch.setattr(clip_grads, "multi_tensor_scale_impl", local_multi_tensor_scale)
    monkeypatch.setattr(optimizer, "multi_tensor_scale_impl", local_multi_tensor_scale)
    done = mt.install()
    assert clip_grads.l2_norm_impl is sentinel
    assert clip_grads.multi_tensor_scale_impl is mt.multi_tensor_scale
    assert optimizer.multi_tensor_scale_impl is mt.multi_tensor_scale
    assert sorted(done) == ["megatron.core.optimizer.clip_grads.multi_tensor_scale_impl",
                            "megatron.core.optimizer.optimizer.multi_tensor_scale_impl"]
    assert mt.install() == done  # idempotent


def test_a_renamed_upstream_target_fails_loudly(monkeypatch):
    monkeypatch.setattr(mt, "_installed", [])
    utils = importlib.import_module("megatron.core.utils")
    monkeypatch.delattr(utils, "local_multi_tensor_l2_norm")
    with pytest.raises(RuntimeError, match="local_multi_tensor_l2_norm"):
        mt.install()


def test_training_runtime_installs_them():
    from megatron.core.optimizer import clip_grads

    from megatron_lrattn.training.runtime import single_process_model_parallel

    with single_process_model_parallel():
        pass
    if "megatron.core.optimizer.clip_grads.l2_norm_impl" in mt.install():
        assert clip_grads.l2_norm_impl is mt.multi_tensor_l2_norm
